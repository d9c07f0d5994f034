"""The metrics of a ship (SPEC 6), computed from the engine's decision and nothing else: the
shipped slice after the sink applied it (each sample's ``mask_below`` and ``dropped``), so the
numbers agree with the masking by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop
from . import keys
from .bound import ShipBound, mismatch_metrics
from .buckets import HISTOGRAM_TOP, LENGTH_BUCKETS, LENGTH_UPPER_BOUNDS
from .metric_table import env_key
from .mismatch import MismatchSums
from .population import PopulationColumns, PopulationSummary, population_summary
from .report import MetricValue, StepReport, Tally

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

QUANTILES = ((keys.TOKEN_P50, 50, 100), (keys.TOKEN_P90, 90, 100), (keys.TOKEN_P99, 99, 100))
_LENGTH_BOUNDS = np.asarray(LENGTH_UPPER_BOUNDS, dtype=np.int64)
_QUANTILE_FRACTIONS = np.array([(numerator, denominator) for _, numerator, denominator in QUANTILES], dtype=np.int64)


class ShippedSlice(Protocol):
    """What the metrics read of a shipped slice after the decision was applied
    (``engine.decision.Judgement`` is one)."""

    @property
    def step(self) -> int: ...
    @property
    def trained_version(self) -> int: ...
    @property
    def n_rollouts(self) -> int: ...
    @property
    def env(self) -> IntArray: ...
    @property
    def frozen(self) -> BoolArray: ...
    @property
    def dispatch(self) -> IntArray: ...
    @property
    def completion(self) -> IntArray: ...
    @property
    def sample_offsets(self) -> IntArray: ...
    @property
    def dropped(self) -> BoolArray: ...
    @property
    def mask_below(self) -> IntArray: ...
    @property
    def n_sampled(self) -> IntArray: ...
    @property
    def span_offsets(self) -> IntArray: ...
    @property
    def version(self) -> IntArray: ...
    @property
    def sampled(self) -> IntArray: ...
    @property
    def labelled(self) -> BoolArray: ...


def columns_of(slice_: ShippedSlice) -> PopulationColumns:
    """The columns of ``slice_`` a population pass reads."""
    return PopulationColumns(
        slice_.frozen, slice_.dispatch, slice_.completion, slice_.sample_offsets, slice_.dropped, slice_.mask_below,
        slice_.n_sampled, slice_.span_offsets, slice_.version, slice_.sampled, slice_.labelled,
    )  # fmt: skip


@CompiledLoop
def _env_sums(
    env: IntArray,
    amounts: IntArray,
    bounds: IntArray,
) -> IntArray:  # pragma: no cover - compiled
    """Per env index (row): its entries in ``env``, the sum of their ``amounts``, then that sum by
    SPEC 12 length bucket of each amount (an amount of 0 in none)."""
    n_env = 0
    for i in range(len(env)):
        n_env = max(n_env, env[i] + 1)
    sums = np.zeros((n_env, len(bounds) + 3), dtype=np.int64)
    for i in range(len(env)):
        e = env[i]
        amount = amounts[i]
        sums[e, 0] += 1
        sums[e, 1] += amount
        if amount > 0:
            bucket = 0
            while bucket < len(bounds) and bounds[bucket] < amount:
                bucket += 1
            sums[e, 2 + bucket] += amount
    return sums


class WindowCounts:
    """Drops, holds and invalid rollouts since the last ship, per env index."""

    FIELDS = (
        "rollouts_dropped",
        "samples_dropped",
        "tokens_dropped",
        "rollouts_held",
        "rollouts_invalid",
    )

    def __init__(self) -> None:
        self.counts: dict[int, dict[str, int]] = {}
        # per env: dropped sampled positions per length bucket
        self.dropped_lengths: dict[int, IntArray] = {}
        self.dropped_rollouts: list[str] = []
        self.dropped_samples: list[tuple[str, int]] = []
        self.held: list[str] = []

    def add(self, env: IntArray, name: str, amounts: IntArray | None = None) -> None:
        """Add ``amounts`` (1 each when None) to ``name`` for the env of each entry."""
        column = 0 if amounts is None else 1  # (None: the entries counted)
        per_env = _env_sums(env, env if amounts is None else amounts, _LENGTH_BOUNDS)
        for index, total in enumerate(per_env[:, column].tolist()):
            if total:
                bucket = self.counts.setdefault(index, dict.fromkeys(self.FIELDS, 0))
                bucket[name] += total

    def add_dropped_lengths(self, env: IntArray, lengths: IntArray) -> None:
        """Dropped samples' sampled positions, by the samples' length bucket (SPEC 12)."""
        per_env = _env_sums(env, lengths, _LENGTH_BOUNDS)
        for index in np.flatnonzero(per_env[:, 0]).tolist():
            self.dropped_lengths[index] = self.dropped_lengths.get(index, 0) + per_env[index, 2:]

    def dropped_by_length(self, env: int | None) -> IntArray:
        if env is None:
            return sum(self.dropped_lengths.values(), np.zeros(len(LENGTH_BUCKETS), dtype=np.int64))
        return self.dropped_lengths.get(env, np.zeros(len(LENGTH_BUCKETS), dtype=np.int64))

    def totals(self, env: int | None) -> dict[str, int]:
        """The :data:`FIELDS` of ``env`` (None: summed over every env)."""
        if env is not None:
            return dict(self.counts.get(env) or dict.fromkeys(self.FIELDS, 0))
        totals = dict.fromkeys(self.FIELDS, 0)
        for bucket in self.counts.values():
            for name, count in bucket.items():
                totals[name] += count
        return totals

    def get(self, env: int | None, name: str) -> int:
        return self.totals(env)[name]


_ROLLOUT_KEYS = (
    (keys.ROLLOUT_MEAN, keys.ROLLOUT_MAX),
    (keys.ROLLOUT_IN_FLIGHT_MEAN, keys.ROLLOUT_IN_FLIGHT_MAX),
    (keys.ROLLOUT_IN_QUEUE_MEAN, keys.ROLLOUT_IN_QUEUE_MAX),
    (keys.ROLLOUT_NEWEST_MEAN, keys.ROLLOUT_NEWEST_MAX),
)


def _population(
    slice_: ShippedSlice,
    rollout_in: BoolArray,
    env: int | None,
    window: WindowCounts,
    max_staleness: int,
) -> tuple[dict[str, float | int], Tally]:
    """Metrics and tally of the live shipped rollouts selected by ``rollout_in``."""
    columns = columns_of(slice_)
    t, top = slice_.trained_version, HISTOGRAM_TOP
    found = population_summary(t, rollout_in, columns, _LENGTH_BOUNDS, top, _QUANTILE_FRACTIONS)
    tokens, masked, unlabelled = found.tokens, found.masked, found.unlabelled
    metrics: dict[str, float | int] = {}
    if tokens:
        metrics[keys.TOKEN_MEAN] = found.token_dot / tokens
        metrics[keys.TOKEN_MASKED] = masked / tokens
        metrics[keys.TOKEN_UNLABELLED] = unlabelled / tokens
        for (key, _, _), value in zip(QUANTILES, found.quantiles):
            metrics[key] = value
    live = found.live
    if live:
        for (mean_key, max_key), total, top in _rollout_numbers(found):
            metrics[mean_key] = total / live
            metrics[max_key] = top
    # SPEC 12 over the shipped samples plus the window's dropped samples
    counted = window.totals(env)
    length_samples = found.samples + counted["samples_dropped"]
    length_sampled, length_removed = found.length_sampled, found.length_removed
    if window.dropped_lengths:
        dropped = window.dropped_by_length(env)
        length_sampled, length_removed = length_sampled + dropped, length_removed + dropped
    metrics.update(_length_metrics(length_samples, length_sampled, length_removed))
    metrics[keys.ROLLOUTS_DROPPED] = counted["rollouts_dropped"]
    metrics[keys.SAMPLES_DROPPED] = counted["samples_dropped"]
    metrics[keys.ROLLOUTS_HELD] = counted["rollouts_held"]
    metrics[keys.MAX_STALENESS] = max_staleness

    # (every field given: the frozen __init__'s setattr per field skipped)
    tally = object.__new__(Tally)
    tally.__dict__.update(
        tokens_sampled=tokens,
        tokens_masked=masked,
        tokens_unlabelled=unlabelled,
        tokens_dropped=counted["tokens_dropped"],
        samples_dropped=counted["samples_dropped"],
        rollouts_dropped=counted["rollouts_dropped"],
        rollouts_shipped=live,
        rollouts_frozen=found.frozen,
        rollouts_held=counted["rollouts_held"],
        rollouts_invalid=counted["rollouts_invalid"],
        token_histogram=found.token_histogram,
        rollout_histogram=found.rollout_histogram,
        length_samples=length_samples,
        length_sampled=length_sampled,
        length_removed=length_removed,
    )
    return metrics, tally


def _rollout_numbers(found: PopulationSummary) -> zip[tuple[tuple[str, str], int, int]]:
    """The four per-rollout numbers' keys, sums and maxima, in :data:`_ROLLOUT_KEYS` order."""
    return zip(
        _ROLLOUT_KEYS,
        (found.rollout_sum, found.in_flight_sum, found.in_queue_sum, found.newest_sum),
        (found.rollout_max, found.in_flight_max, found.in_queue_max, found.newest_max),
    )


def _length_metrics(samples: int, sampled: IntArray, removed: IntArray) -> dict[str, float | int]:
    if samples == 0:
        return {}
    # (a few buckets: summed as Python integers)
    sampled_list, removed_list = sampled.tolist(), removed.tolist()
    total = sum(sampled_list)
    metrics: dict[str, float | int] = {
        keys.LENGTH_SAMPLED_MEAN: total / samples,
        keys.LENGTH_TRAINED_MEAN: (total - sum(removed_list)) / samples,
    }
    for name, n, gone in zip(LENGTH_BUCKETS, sampled_list, removed_list):
        if n:
            metrics[keys.LENGTH_REMOVED_SHARE_BY_LENGTH[name]] = gone / n
    return metrics


def compute_report(
    shipped: ShippedSlice,
    window: WindowCounts,
    max_staleness: int,
    env_names: Mapping[int, str],
    env_breakdown: bool,
    mismatch: MismatchSums | None = None,
    bound: ShipBound | None = None,
    env_costs: Mapping[str, tuple[MismatchSums, ShipBound | None]] | None = None,
    per_env: bool = True,
) -> StepReport:
    """The :class:`StepReport` of one ship: ``shipped`` is the slice after the decision was applied
    (``per_env=False``: the whole population only), ``bound`` SPEC 14's view of ``mismatch``."""
    population, tally = _population(shipped, np.ones(shipped.n_rollouts, dtype=bool), None, window, max_staleness)
    metrics: dict[str, MetricValue] = dict(population)
    if mismatch is not None:
        metrics.update(mismatch_metrics(mismatch, bound))
    env_metrics: dict[str, dict[str, MetricValue]] = {}
    env_tally: dict[str, Tally] = {}
    envs = set(shipped.env.tolist()) | set(window.counts) if per_env else set()
    if len(envs) == 1 and set(window.dropped_lengths) <= envs:
        # one env holds every shipped rollout and count of the window: its population is the whole
        (env,) = envs
        env_tally[env_names[env]] = tally
        env_metrics[env_names[env]] = dict(population)
        envs = set()
    for env in sorted(envs, key=lambda e: env_names[e]):
        env_population, env_tally[env_names[env]] = _population(shipped, shipped.env == env, env, window, max_staleness)
        env_metrics[env_names[env]] = dict(env_population)
    # SPEC 11 and 14 per env (env breakdown)
    for name, (sums, env_bound) in (env_costs or {}).items():
        env_metrics.setdefault(name, {}).update(mismatch_metrics(sums, env_bound))
    if env_breakdown:
        for name, values in env_metrics.items():
            if name:
                metrics.update({env_key(name, key): v for key, v in values.items()})
    return StepReport(
        step=shipped.step,
        max_staleness=max_staleness,
        metrics=metrics,
        tally=tally,
        env_metrics=env_metrics,
        env_tally=env_tally,
        mismatch=mismatch,
        env_mismatch={name: sums for name, (sums, _) in (env_costs or {}).items()},
    )
