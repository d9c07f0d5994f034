"""Choosing the bound (SPEC 14): the floor, the excess curve, the budget and the suggested bound,
pure functions of the SPEC 11 sums, and the run-long state in :class:`BoundTracker`."""

from __future__ import annotations

import bisect
import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import StalenessConfig
from ..errors import FieldError
from . import keys
from .buckets import CURVE_BUCKETS, LAG_BUCKETS, FloorSource
from .mismatch import MismatchSums
from .report import MetricValue

TRACKER_FORMAT = 1


@dataclass(frozen=True)
class Floor:
    """The engines' numeric mismatch (k3 per token) the excess is measured against, measured at
    ``step``, ``age`` steps before this ship."""

    value: float
    source: FloorSource
    step: int
    age: int


def _k3(sums: MismatchSums, index: int) -> float:
    return float(sums.sum_k3[index]) / int(sums.tokens[index])


def select_floor(
    sums: MismatchSums, step: int, last_lag0: tuple[float, int] | None, *, min_tokens: int, max_age: int
) -> Floor | None:
    """SPEC 14's first rule that applies: ``lag0``, ``carried`` (``last_lag0``, the latest
    ``(floor, step)``, at most ``max_age`` old), ``min_lag``, else ``None``."""
    if int(sums.tokens[0]) >= min_tokens:
        return Floor(_k3(sums, 0), "lag0", step, 0)
    if last_lag0 is not None:
        value, measured = last_lag0
        if 0 <= step - measured <= max_age:
            return Floor(value, "carried", measured, step - measured)
    enough = np.flatnonzero(sums.tokens >= min_tokens)
    return Floor(_k3(sums, int(enough[0])), "min_lag", step, 0) if enough.size else None


def isotonic_increasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool-adjacent-violators); weights must be > 0."""
    if len(values) != len(weights):
        raise FieldError("weights", f"length {len(weights)} differs from the values' {len(values)}")
    blocks: list[list[float]] = []  # [weighted mean, total weight, number of points]
    for value, weight in zip(values, weights, strict=True):
        if not weight > 0:
            raise FieldError("weights", f"must be > 0, got {weight!r}")
        blocks.append([float(value), float(weight), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight_last, count = blocks.pop()
            previous = blocks[-1]
            total = previous[1] + weight_last
            previous[0] = (previous[0] * previous[1] + mean * weight_last) / total
            previous[1] = total
            previous[2] += count
    return [mean for mean, _, count in blocks for _ in range(int(count))]


@dataclass(frozen=True)
class Curve:
    """Per lag with enough tokens: its tokens, the raw excess ``e`` and the isotonic fit ``ê``."""

    lags: tuple[int, ...]
    tokens: tuple[int, ...]
    raw: tuple[float, ...]
    fitted: tuple[float, ...]

    def __bool__(self) -> bool:
        return bool(self.lags)


def excess_curve(window: MismatchSums, floor: float, *, min_tokens: int) -> Curve:
    """The window's k3 minus ``floor`` at each lag 1..16 with ``min_tokens``, and its fit."""
    lags = tuple(b for b in CURVE_BUCKETS if int(window.tokens[b]) >= min_tokens)
    tokens = tuple(int(window.tokens[b]) for b in lags)
    raw = tuple(_k3(window, b) - floor for b in lags)
    return Curve(lags, tokens, raw, tuple(isotonic_increasing(raw, [float(n) for n in tokens])))


def budget_of(mismatch_budget: float | None, floor: float) -> float:
    return floor if mismatch_budget is None else float(mismatch_budget)


@dataclass(frozen=True)
class BoundAdvice:
    """``suggested``: the largest lag with ``ê ≤ β`` (0 when the first is above); ``crossed``:
    some lag is above ``β``; ``excess_at_bound``: ``ê`` of the largest lag not above the bound."""

    suggested: int
    crossed: bool
    excess_at_bound: float | None


def advise(curve: Curve, budget: float, bound: int) -> BoundAdvice | None:
    if not curve:
        return None
    within = [lag for lag, fitted in zip(curve.lags, curve.fitted, strict=True) if fitted <= budget]
    # ê is non-decreasing, so the lags within budget are a prefix of the curve.
    suggested = within[-1] if within else 0
    crossed = len(within) < len(curve.lags)
    at_bound = [fitted for lag, fitted in zip(curve.lags, curve.fitted, strict=True) if lag <= bound]
    return BoundAdvice(suggested, crossed, at_bound[-1] if at_bound else None)


def adapt_bound(bound: int, advice: BoundAdvice, low: int, high: int) -> int:
    """One step in ``[low, high]``: to ``suggested`` if crossed, else up if it is ≥ ``bound``."""
    if advice.crossed:
        moved = bound + (advice.suggested > bound) - (advice.suggested < bound)
    else:
        moved = bound + (advice.suggested >= bound)
    return min(max(moved, low), high)


@dataclass(frozen=True)
class ShipBound:
    """Everything SPEC 14 says about one ship."""

    floor: Floor | None
    budget: float | None
    curve: Curve
    advice: BoundAdvice | None
    bound: int  # the bound this ship was judged with


def bound_metrics(result: ShipBound) -> dict[str, MetricValue]:
    """The SPEC 14 keys of a ship (``floor_source`` a string); empty when there is no floor."""
    floor = result.floor
    if floor is None or result.budget is None:
        return {}
    out: dict[str, MetricValue] = {
        keys.MISMATCH_FLOOR: floor.value,
        keys.MISMATCH_FLOOR_AGE: floor.age,
        keys.MISMATCH_FLOOR_SOURCE: floor.source,
        keys.MISMATCH_BUDGET: result.budget,
    }
    for lag, fitted in zip(result.curve.lags, result.curve.fitted, strict=True):
        out[keys.MISMATCH_CURVE_BY_LAG[LAG_BUCKETS[lag]]] = fitted
    advice = result.advice
    if advice is not None:
        out[keys.BOUND_SUGGESTED] = advice.suggested
        out[keys.BOUND_CROSSED] = int(advice.crossed)
        if advice.excess_at_bound is not None:
            out[keys.BOUND_EXCESS_AT_BOUND] = advice.excess_at_bound
    return out


def mismatch_metrics(sums: MismatchSums, bound: ShipBound | None) -> dict[str, MetricValue]:
    """SPEC 11 keys with their excess over the floor, then SPEC 14 keys; ``{}`` if none covered."""
    floor = None if bound is None or bound.floor is None else bound.floor.value
    out: dict[str, MetricValue] = dict(sums.metrics(floor=floor))
    if out and bound is not None:
        out.update(bound_metrics(bound))
    return out


def env_tracker_config(config: StalenessConfig) -> StalenessConfig:
    """An env's tracker: the run's config without adaptation (the bound is the batch's)."""
    return dataclasses.replace(config, adapt_every=None, adapt_low=1, adapt_high=16)


class BoundTracker:
    """SPEC 14's run-long state: the sums of the last ``cost_window`` ships, the last ``lag0``
    floor, and the adaptive bound with the count toward its next change."""

    def __init__(self, config: StalenessConfig) -> None:
        self.config = config
        self.window: list[tuple[int, MismatchSums]] = []  # (step, sums), oldest first
        self.last_lag0: tuple[float, int] | None = None  # (floor, step) of the latest lag0 floor
        self.bound = config.max_staleness  # in force: max_staleness, or where adaptation moved it
        self.toward_change = 0  # ships with a curve since the bound last had a chance to move
        self.last_counted = 0
        self.counted: set[int] = set()  # steps of the window whose merged sums counted toward it

    def __copy__(self) -> BoundTracker:  # (what observe changes is copied: a ship observes a copy)
        new = object.__new__(BoundTracker)
        vars(new).update(vars(self), window=list(self.window), counted=set(self.counted))
        return new

    @property
    def adaptive(self) -> bool:
        return self.config.adapt_every is not None

    def window_sums(self, upto: int | None = None) -> MismatchSums:
        """The sums of the ``cost_window`` entries up to entry ``upto`` (default: the latest)."""
        end = len(self.window) if upto is None else upto + 1
        kept = self.window[max(0, end - self.config.cost_window) : end]
        return sum((sums for _, sums in kept), MismatchSums.zero())

    def _enter(self, step: int, sums: MismatchSums, merge: bool) -> int:
        """Put the ship in the window; returns its index there."""
        window = self.window
        # in step order (a late step of the live path too); merge: replace the step's last entry
        at = bisect.bisect_right(window, step, key=operator.itemgetter(0))
        if merge and at and window[at - 1][0] == step:
            window[at - 1] = (step, sums)
            return at - 1
        window.insert(at, (step, sums))
        if len(window) > self.config.cost_window:
            del window[0]
            at -= 1
            self.counted = {counted for counted in self.counted if counted >= window[0][0]}
        return at

    def observe(
        self, step: int, sums: MismatchSums, *, merge: bool = False, bound: int | None = None
    ) -> ShipBound | None:
        """Record the ship at ``step`` (``merge``: a step's total so far, replacing its entry) and
        derive its SPEC 14 values, ``excess_at_bound`` at ``bound`` (default: the one in force)."""
        if sums.covered == 0:
            return None
        config = self.config
        bound = self.bound if bound is None else bound
        at = self._enter(step, sums, merge)
        last = self.last_lag0
        floor = select_floor(sums, step, last, min_tokens=config.floor_min_tokens, max_age=config.floor_max_age)
        if floor is None:
            return ShipBound(None, None, Curve((), (), (), ()), None, bound)
        if floor.source == "lag0" and (last is None or step >= last[1]):
            self.last_lag0 = (floor.value, step)
        budget = budget_of(config.mismatch_budget, floor.value)
        # A ship that left the window at once (a very late step of the live path) is its own window.
        window = self.window_sums(at) if at >= 0 else sums
        curve = excess_curve(window, floor.value, min_tokens=config.floor_min_tokens)
        advice = advise(curve, budget, bound)
        counted = not merge or step not in self.counted  # (a step's later totals count once)
        if advice is not None and config.adapt_every is not None and counted:
            self.last_counted = max(self.last_counted, step)
            if merge:
                self.counted.add(step)
            self.toward_change += 1
            if self.toward_change >= config.adapt_every:
                self.toward_change = 0
                self.bound = adapt_bound(self.bound, advice, config.adapt_low, config.adapt_high)
        return ShipBound(floor, budget, curve, advice, bound)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state; :meth:`load_state_dict` takes it back."""
        return {
            "format": TRACKER_FORMAT,
            "window": [[step, sums.to_dict()] for step, sums in self.window],
            "last_lag0": None if self.last_lag0 is None else list(self.last_lag0),
            "bound": self.bound,
            "toward_change": self.toward_change,
            "last_counted": self.last_counted,
            "counted": sorted(self.counted),
        }

    def check_state_dict(self, state: Any, path: str = "bound") -> BoundTracker:
        """A new tracker of this config holding ``state`` (``ConfigError`` if it does not fit)."""
        from ..state_checks import fail, integer, join, keys, sequence

        required = ("format", "window", "last_lag0", "bound", "toward_change", "last_counted")
        found = keys(state, path, required, ("counted",))
        if found["format"] != TRACKER_FORMAT:
            fail(join(path, "format"), f"unknown format {found['format']!r} (expected {TRACKER_FORMAT})")
        config = self.config
        new = BoundTracker(config)
        window = new.window
        for i, item in enumerate(sequence(found["window"], join(path, "window"))):
            where = join(join(path, "window"), i)
            step, data = sequence(item, where, 2)
            step = integer(step, join(where, 0), 1)
            if window and step < window[-1][0]:
                fail(join(where, 0), f"step {step} is below the previous step {window[-1][0]}")
            try:
                sums = MismatchSums.from_dict(data)
            except ValueError as exc:
                fail(join(where, 1), str(exc))
            if sums.covered == 0:
                fail(join(where, 1), "no covered position: such a ship never enters the window")
            window.append((step, sums))
        # A smaller cost_window than the run had: the window keeps its latest ships.
        new.window = window[-config.cost_window :]
        if found["last_lag0"] is not None:
            where = join(path, "last_lag0")
            value, step = sequence(found["last_lag0"], where, 2)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                fail(join(where, 0), f"expected a finite number >= 0, got {value!r}")
            new.last_lag0 = (float(value), integer(step, join(where, 1), 1))
        bound = new.bound = integer(found["bound"], join(path, "bound"), 0)
        new.last_counted = integer(found["last_counted"], join(path, "last_counted"), 0)
        # (absent before: the window's steps up to the last counted one had counted)
        counted = sequence(found.get("counted", [s for s, _ in new.window if s <= new.last_counted]), path)
        new.counted = {integer(step, join(join(path, "counted"), i), 1) for i, step in enumerate(counted)}
        top = 0 if config.adapt_every is None else config.adapt_every - 1
        new.toward_change = integer(found["toward_change"], join(path, "toward_change"), 0, top)
        if config.adapt_every is None:
            if bound != config.max_staleness:
                ours = f"max_staleness={config.max_staleness} and no adapt_every"
                fail(join(path, "bound"), f"adapted to {bound}, but this config has {ours}")
        elif not config.adapt_low <= bound <= config.adapt_high:
            limits = f"{config.adapt_low}..{config.adapt_high}"
            fail(join(path, "bound"), f"{bound} is outside adapt_low..adapt_high {limits}")
        return new

    def load_checked(self, new: BoundTracker) -> None:
        vars(self).update(vars(new))  # (built by check_state_dict for this tracker's config)

    def load_state_dict(self, state: Any) -> None:
        self.load_checked(self.check_state_dict(state))
