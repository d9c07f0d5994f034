"""The project's configuration model: which policy masks, and with which bound."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from .errors import ConfigError
from .legacy import RENAMED_SETTINGS as _RENAMED

__all__ = ["POLICY_NAMES", "PolicyName", "StalenessConfig"]

PolicyName = Literal["token", "episode", "group", "xtuner"]
POLICY_NAMES: tuple[PolicyName, ...] = ("token", "episode", "group", "xtuner")


MAX_SETTING = 2**53  # far beyond any run; keeps every threshold exact in int64 arithmetic


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    if not minimum <= value <= MAX_SETTING:
        raise ConfigError(f"{name}: must be in {minimum}..{MAX_SETTING}, got {value}")


@dataclass(frozen=True)
class StalenessConfig:
    """How the sink judges staleness (SPEC 5) and how strictly it reads input (SPEC 3).

    ``max_staleness`` defaults to 8, as prime-rl. ``max_token_staleness``, ``sync_interval`` and
    ``retry_expired`` only matter to the ``xtuner`` policy. ``mismatch_band`` is the ratio band
    ``[lo, hi]`` of SPEC 11's out-of-band share.
    """

    policy: PolicyName = "token"
    max_staleness: int = 8
    max_token_staleness: int | None = None
    sync_interval: int = 1
    retry_expired: bool = False
    strict: bool = True
    env_breakdown: bool = False
    mismatch_band: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"policy: expected one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        _check_int("max_staleness", self.max_staleness, 0)
        if self.max_token_staleness is not None:
            _check_int("max_token_staleness", self.max_token_staleness, 0)
        _check_int("sync_interval", self.sync_interval, 1)
        for name in ("retry_expired", "strict", "env_breakdown"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected a boolean, got {getattr(self, name)!r}")
        band = self.mismatch_band
        if (
            not isinstance(band, (tuple, list))
            or len(band) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in band)
            or not 0 < band[0] <= band[1]
        ):
            raise ConfigError(f"mismatch_band: expected [lo, hi] with 0 < lo <= hi, got {band!r}")
        object.__setattr__(self, "mismatch_band", (float(band[0]), float(band[1])))
        if self.policy != "xtuner":
            for name, default in (("max_token_staleness", None), ("sync_interval", 1), ("retry_expired", False)):
                if getattr(self, name) != default:
                    raise ConfigError(f"{name}: only the 'xtuner' policy takes it (policy is {self.policy!r})")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> StalenessConfig:
        """Build from a parsed config table; unknown and renamed keys are errors, never ignored."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key in _RENAMED:
                migrate = "run `staleness-metrics migrate --write PATH` to update config files"
                reason = f"renamed to {_RENAMED[key]!r}; {migrate}"
                raise ConfigError(f"{key}: {reason}", field=key, reason=reason)
            if key not in known:
                reason = f"unknown setting (known: {', '.join(sorted(known))})"
                raise ConfigError(f"{key}: {reason}", field=key, reason=reason)
        return cls(**dict(data))
