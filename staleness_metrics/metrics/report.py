"""What one ship reports: the SPEC 6 metrics dict plus the additive tallies behind it."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from .mismatch import MismatchSums

# numbers, and the one string key ``staleness/mismatch/floor_source`` (SPEC 14)
MetricValue = float | int | str

Counts = npt.NDArray[np.int64]
Operation = Callable[[Any, Any], Any]


def _empty_counts() -> Counts:
    return np.zeros(0, dtype=np.int64)


def _aligned(a: Counts, b: Counts) -> tuple[Counts, Counts]:
    """``a`` and ``b``, the shorter padded with zeros."""
    if len(a) != len(b):
        n = max(len(a), len(b))
        a, b = (np.concatenate((x, np.zeros(n - len(x), np.int64))) for x in (a, b))
    return a, b


@dataclass(frozen=True)
class Tally:
    """Additive numbers of one ship window for one population (the batch or one env), merged exactly
    by ``a + b``; histogram index = staleness, the last index (4096) counting all at or above it."""

    tokens_sampled: int = 0
    tokens_masked: int = 0
    tokens_unlabelled: int = 0
    tokens_dropped: int = 0
    samples_dropped: int = 0
    rollouts_dropped: int = 0
    rollouts_shipped: int = 0
    rollouts_frozen: int = 0
    rollouts_held: int = 0
    rollouts_invalid: int = 0
    token_histogram: Counts = field(default_factory=_empty_counts)
    rollout_histogram: Counts = field(default_factory=_empty_counts)
    # SPEC 12, over the shipped samples plus the samples dropped in the window (live rollouts):
    length_samples: int = 0
    length_sampled: Counts = field(default_factory=_empty_counts)  # sampled positions per bucket
    length_removed: Counts = field(default_factory=_empty_counts)  # of those, masked or dropped
    # what each histogram's last index holds, exactly: the staleness beyond that index summed, the
    # lowest and the highest (0: none, or none kept by a checkpoint saved before these)
    token_beyond: int = 0
    token_top_min: int = 0
    token_top_max: int = 0
    rollout_beyond: int = 0
    rollout_top_min: int = 0
    rollout_top_max: int = 0

    def __add__(self, other: Tally) -> Tally:
        return self._combine(other, operator.add, operator.add, lambda a, b: b)

    def excess_over(self, other: Tally) -> Tally:
        """``self - other`` field by field, floored at 0 (an extreme: ``self``'s where ``other``'s
        does not reach it, else 0)."""
        floored = lambda a, b: max(a - b, 0), lambda a, b: np.maximum(a - b, 0)
        return self._combine(other, *floored, lambda a, b: 0)

    def _combine(self, other: Tally, count_op: Operation, array_op: Operation,
                 unbeaten: Operation) -> Tally:  # fmt: skip
        """``count_op`` of each number, ``array_op`` of each array (the shorter one padded); each
        extreme ``self``'s where it beats ``other``'s, else ``unbeaten`` of the two."""
        mine, theirs = self.__dict__, other.__dict__  # (no slots: every field is there)
        values: dict[str, object] = {n: count_op(mine[n], theirs[n]) for n in _COUNT_FIELDS}
        for n, beats in _EXTREMES.items():
            values[n] = mine[n] if beats(mine[n], theirs[n]) else unbeaten(mine[n], theirs[n])
        for n in _COUNTS_FIELDS:
            values[n] = array_op(*_aligned(mine[n], theirs[n])).astype(np.int64, copy=False)
        total = object.__new__(Tally)  # every field set below: no frozen __init__ setattr
        total.__dict__.update(values)
        return total

    def within(self, other: Tally) -> bool:
        """Whether no number or extreme of ``self`` beats ``other``'s (arrays index by index)."""
        mine, theirs = self.__dict__, other.__dict__
        if any(beats(mine[n], theirs[n]) for n, beats in _BEATS.items()):
            return False
        return not any((a > b).any() for a, b in (_aligned(mine[n], theirs[n]) for n in _COUNTS_FIELDS))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tally):
            return NotImplemented
        return all(
            np.array_equal(np.trim_zeros(a, "b"), np.trim_zeros(b, "b")) if isinstance(a, np.ndarray) else a == b
            for a, b in ((getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
        )

    __hash__ = None  # type: ignore[assignment]


# what the histograms fold (not in checkpoints saved before them); of those, the extremes, by what
# tells one beats another (a lowest: lower, or any over none: 0); arrays, added by index; numbers
TOP_FIELDS = tuple(f"{of}_{end}" for of in ("token", "rollout") for end in ("beyond", "top_min", "top_max"))
_EXTREMES: dict[str, Operation] = {name: operator.gt for name in TOP_FIELDS if name.endswith("max")}
_EXTREMES |= {n: lambda a, b: a > 0 and not 0 < b <= a for n in TOP_FIELDS if n.endswith("min")}
_COUNTS_FIELDS = tuple(f.name for f in fields(Tally) if f.type == "Counts")
_COUNT_FIELDS = tuple(f.name for f in fields(Tally) if f.name not in {*_COUNTS_FIELDS, *_EXTREMES})
_BEATS = {**dict.fromkeys(_COUNT_FIELDS, operator.gt), **_EXTREMES}  # a number or extreme over


@dataclass(frozen=True)
class StepReport:
    """The outcome of one ship: ``metrics`` the SPEC 6 dict as written to W&B (without ``step``),
    ``env_metrics`` / ``env_tally`` the same per env name (``""``: rollouts without an env)."""

    step: int
    max_staleness: int
    metrics: Mapping[str, MetricValue]
    tally: Tally
    env_metrics: Mapping[str, Mapping[str, MetricValue]] = field(default_factory=dict)
    env_tally: Mapping[str, Tally] = field(default_factory=dict)
    mismatch: MismatchSums | None = None
    # with the env breakdown, each named env's SPEC 11 sums from the records
    env_mismatch: Mapping[str, MismatchSums] = field(default_factory=dict)

    def row(self) -> dict[str, MetricValue]:
        """The ``--metrics-out`` line: ``{"step": S, <key>: <value>, ...}``."""
        return {"step": self.step, **self.metrics}
