"""The project's configuration model: which policy masks, and with which bound."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from .errors import ConfigError

PolicyName = Literal["token", "episode", "group", "xtuner"]
POLICY_NAMES: tuple[PolicyName, ...] = ("token", "episode", "group", "xtuner")
# orchestrator settings that were renamed (old -> new), as config files spell them
RENAMED_SETTINGS: Mapping[str, str] = {"max_off_policy_steps": "max_staleness"}
MAX_SETTING = 2**53  # far beyond any run; keeps every threshold exact in int64 arithmetic


def check_int(name: str, value: object, minimum: int, maximum: int = MAX_SETTING) -> int:
    """``value`` if an integer in ``minimum..maximum``; else a ``ConfigError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    if not minimum <= value <= maximum:
        raise ConfigError(f"{name}: must be in {minimum}..{maximum}, got {value}")
    return value


def _check_ints(config: StalenessConfig, **minimums: int) -> None:
    """Each setting an integer in ``minimum..MAX_SETTING``, or None where None is its default."""
    for name, minimum in minimums.items():
        value = getattr(config, name)
        if value is not None or config.__dataclass_fields__[name].default is not None:
            check_int(name, value, minimum)


def _renamed(key: str) -> ConfigError:
    """SPEC 7: a renamed setting's old name, refused by its new one."""
    migrate = "run `staleness-metrics migrate --write PATH` to update config files"
    reason = f"renamed to {RENAMED_SETTINGS[key]!r}; {migrate}"
    return ConfigError(f"{key}: {reason}", field=key, reason=reason)


@dataclass(frozen=True)
class StalenessConfig:
    """How the sink judges staleness (SPEC 5) and how strictly it reads input (SPEC 3).

    ``max_staleness`` defaults to 8, as prime-rl. ``max_token_staleness``, ``sync_interval`` and
    ``retry_expired`` only matter to the ``xtuner`` policy. ``mismatch_band`` is the ratio band
    ``[lo, hi]`` of SPEC 11's out-of-band share. ``floor_min_tokens``, ``floor_max_age`` (steps),
    ``cost_window`` (ships) and ``mismatch_budget`` (nats per token; None = the floor) choose the
    bound (SPEC 14); ``adapt_every`` (ships; None = off), ``adapt_low`` and ``adapt_high`` adapt it
    (``token`` policy only)."""

    policy: PolicyName = "token"
    max_staleness: int = 8
    max_token_staleness: int | None = None
    sync_interval: int = 1
    retry_expired: bool = False
    strict: bool = True
    env_breakdown: bool = False
    mismatch_band: tuple[float, float] = (0.5, 2.0)
    floor_min_tokens: int = 1000
    floor_max_age: int = 100
    cost_window: int = 20
    mismatch_budget: float | None = None
    adapt_every: int | None = None
    adapt_low: int = 1
    adapt_high: int = 16

    def __new__(cls, *args: Any, **kwargs: Any) -> StalenessConfig:
        for key in RENAMED_SETTINGS.keys() & kwargs:  # (else a TypeError not naming the new name)
            raise _renamed(key)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"policy: expected one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        _check_ints(self, max_staleness=0, max_token_staleness=0, sync_interval=1)
        for name in ("max_staleness", "max_token_staleness"):  # SPEC 5's thresholds, kept in int64
            if (getattr(self, name) or 0) + 1 > 2**62 // self.sync_interval:
                raise ConfigError(f"{name}: ({name} + 1) * sync_interval must be <= 2**62 (SPEC 5's threshold)")
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
        _check_ints(self, floor_min_tokens=1, floor_max_age=0, cost_window=1)
        budget = self.mismatch_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
                raise ConfigError(f"mismatch_budget: expected a finite number of nats per token, got {budget!r}")
            if budget < 0:
                raise ConfigError(f"mismatch_budget: must be >= 0, got {budget!r}")
            object.__setattr__(self, "mismatch_budget", float(budget))
        _check_ints(self, adapt_every=1, adapt_low=0, adapt_high=0)
        if self.adapt_low > self.adapt_high:
            raise ConfigError(f"adapt_low: {self.adapt_low} is above adapt_high {self.adapt_high}")
        defaults = {f.name: f.default for f in fields(self)}  # what a policy ignores keeps these
        if self.policy != "token":
            for name in ("adapt_every", "adapt_low", "adapt_high"):
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(f"{name}: only the 'token' policy adapts its bound (policy is {self.policy!r})")
        elif self.adapt_every is not None and not self.adapt_low <= self.max_staleness <= self.adapt_high:
            raise ConfigError(
                f"max_staleness: {self.max_staleness} is outside adapt_low..adapt_high "
                f"{self.adapt_low}..{self.adapt_high}, where the adaptive bound starts"
            )
        if self.policy != "xtuner":
            for name in ("max_token_staleness", "sync_interval", "retry_expired"):
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(f"{name}: only the 'xtuner' policy takes it (policy is {self.policy!r})")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> StalenessConfig:
        """Build from a parsed config table; unknown and renamed keys are errors, never ignored."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key in RENAMED_SETTINGS:
                raise _renamed(key)
            if key not in known:
                reason = f"unknown setting (known: {', '.join(sorted(known))})"
                raise ConfigError(f"{key}: {reason}", field=key, reason=reason)
        return cls(**dict(data))
