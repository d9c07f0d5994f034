"""The metrics of a ship (SPEC 6), computed from the engine's decision and nothing else.

Input is the judgement slice of the shipped rollouts after the sink applied the decision: each
sample's ``mask_below`` and ``dropped`` are what the masking did, so the numbers agree with it by
construction. Every statistic is a reduction over spans; no position is read here.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import numpy.typing as npt

from . import keys
from .bound import ShipBound, mismatch_metrics
from .metric_table import env_key
from .mismatch import MismatchSums
from .population import PopulationColumns, PopulationSummary, population_summary, population_sums
from .report import HISTOGRAM_TOP, LENGTH_BUCKETS, LENGTH_UPPER_BOUNDS, MetricValue, StepReport, Tally

__all__ = ["ShippedSlice", "WindowCounts", "columns_of", "compute_report"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

QUANTILES = ((keys.TOKEN_P50, 50, 100), (keys.TOKEN_P90, 90, 100), (keys.TOKEN_P99, 99, 100))
_LENGTH_BOUNDS = np.asarray(LENGTH_UPPER_BOUNDS, dtype=np.int64)
_FEW = 64  # entries summed over Python lists rather than numpy arrays
_QUANTILE_FRACTIONS = np.array([(numerator, denominator) for _, numerator, denominator in QUANTILES], dtype=np.int64)
_NO_LENGTHS = np.zeros(len(LENGTH_BUCKETS), dtype=np.int64)


class ShippedSlice(Protocol):
    """What the metrics read of a shipped slice (``engine.decision.Judgement`` is one): its rollouts, their
    samples by ``sample_offsets`` and the samples' spans by ``span_offsets``, after the decision was applied."""

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
    def sample_rollout(self) -> IntArray: ...
    @property
    def dropped(self) -> BoolArray: ...
    @property
    def mask_below(self) -> IntArray: ...
    @property
    def n_sampled(self) -> IntArray: ...
    @property
    def span_offsets(self) -> IntArray: ...
    @property
    def span_sample(self) -> IntArray: ...
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


def length_bucket_totals(lengths: IntArray, amounts: IntArray) -> IntArray:
    """Per SPEC 12 length bucket, the sum of ``amounts`` over samples by their sampled length (0: none)."""
    inside = lengths > 0
    buckets = np.searchsorted(_LENGTH_BOUNDS, lengths[inside], "left")
    return np.bincount(buckets, weights=amounts[inside], minlength=len(LENGTH_BUCKETS)).astype(np.int64)


class WindowCounts:
    """Drops, holds and invalid rollouts since the last ship, per env index."""

    FIELDS = ("rollouts_dropped", "samples_dropped", "tokens_dropped", "rollouts_held", "rollouts_invalid")

    def __init__(self) -> None:
        self.counts: dict[int, dict[str, int]] = {}
        self.dropped_lengths: dict[int, IntArray] = {}  # per env: dropped sampled positions per length bucket
        self.dropped_rollouts: list[str] = []
        self.dropped_samples: list[tuple[str, int]] = []
        self.held: list[str] = []

    def add(self, env: IntArray, name: str, amounts: IntArray | None = None) -> None:
        """Add ``amounts`` (1 each when None) to ``name`` for the env of each entry (an env whose entries add
        up to 0 gets no counts)."""
        if len(env) == 0:
            return
        if len(env) <= _FEW:  # (Python over a short list costs less than numpy calls)
            totals: dict[int, int] = {}
            for index, amount in zip(env.tolist(), [1] * len(env) if amounts is None else amounts.tolist()):
                totals[index] = totals.get(index, 0) + amount
            found = [(index, total) for index, total in totals.items() if total]
        else:
            weights = np.ones(len(env), dtype=np.int64) if amounts is None else amounts
            summed = np.bincount(env, weights=weights)
            found = [(int(index), int(summed[index])) for index in np.flatnonzero(summed)]
        for index, total in found:
            bucket = self.counts.setdefault(index, dict.fromkeys(self.FIELDS, 0))
            bucket[name] += total

    def add_dropped_lengths(self, env: IntArray, lengths: IntArray) -> None:
        """Dropped samples' sampled positions, by the samples' length bucket (SPEC 12)."""
        if len(env) <= _FEW:
            for index, length in zip(env.tolist(), lengths.tolist()):
                totals = self.dropped_lengths.get(index)
                if totals is None:
                    totals = self.dropped_lengths[index] = np.zeros(len(LENGTH_BUCKETS), dtype=np.int64)
                if length > 0:
                    totals[bisect.bisect_left(LENGTH_UPPER_BOUNDS, length)] += length
            return
        for index in np.unique(env).tolist():
            here = env == index
            totals = length_bucket_totals(lengths[here], lengths[here])
            self.dropped_lengths[index] = self.dropped_lengths.get(index, 0) + totals

    def dropped_by_length(self, env: int | None) -> IntArray:
        if env is None:
            return sum(self.dropped_lengths.values(), np.zeros(len(LENGTH_BUCKETS), dtype=np.int64))
        return self.dropped_lengths.get(env, np.zeros(len(LENGTH_BUCKETS), dtype=np.int64))

    def get(self, env: int | None, name: str) -> int:
        if env is None:
            return sum(bucket[name] for bucket in self.counts.values())
        return self.counts.get(env, {}).get(name, 0)


def _nearest_ranks(values: IntArray, counts: IntArray) -> list[int]:
    """The :data:`QUANTILES`' nearest ranks: the ceil(p * N)-th smallest value each (exact integer maths).

    ``values`` are sorted distinct values, ``counts`` how often each occurs."""
    running = np.cumsum(counts)
    total = int(running[-1])
    ranks = [max(1, -(-numerator * total // denominator)) for _, numerator, denominator in QUANTILES]
    return values[np.searchsorted(running, ranks)].tolist()  # type: ignore[no-any-return]


def _distribution(values: IntArray, weights: IntArray | None) -> tuple[IntArray, IntArray]:
    """Sorted distinct values and their total weights (None: one each)."""
    if len(values) == 0:  # (a ship that dropped everything)
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if int(values.max()) - (low := int(values.min())) < _DIRECT_RANGE:
        # a few staleness values (the usual case): counted by value, no sort
        shifted = values - low
        counted = np.bincount(shifted)
        present = np.flatnonzero(counted)
        totals = counted if weights is None else np.bincount(shifted, weights=weights).astype(np.int64)
        return present + low, totals[present]
    distinct, inverse = np.unique(values, return_inverse=True)
    if weights is None:
        return distinct, np.bincount(inverse, minlength=len(distinct))
    return distinct, np.bincount(inverse, weights=weights, minlength=len(distinct)).astype(np.int64)


_DIRECT_RANGE = 4096


def _histogram(distinct: IntArray, counts: IntArray) -> IntArray:
    """Integer-bucket histogram (index = staleness); the last index counts all from HISTOGRAM_TOP up,
    so a wild version number cannot make it huge."""
    if len(distinct) == 0:
        return np.zeros(0, dtype=np.int64)
    if int(distinct[0]) >= 0 and int(distinct[-1]) < HISTOGRAM_TOP:  # (sorted) nothing to fold into the top
        histogram = np.zeros(int(distinct[-1]) + 1, dtype=np.int64)
        histogram[distinct] = counts
        return histogram
    return np.bincount(np.minimum(distinct, HISTOGRAM_TOP), weights=counts).astype(np.int64)


def _exact_dot(a: IntArray, b: IntArray) -> int:
    """``sum(a * b)`` without int64 overflow (Python integers only when it could overflow)."""
    if len(a) == 0:
        return 0
    if int(np.abs(a).max()) * int(np.abs(b).sum()) < 2**62:
        return int(np.dot(a, b))
    return sum(x * y for x, y in zip(a.tolist(), b.tolist()))


_ROLLOUT_KEYS = (
    (keys.ROLLOUT_MEAN, keys.ROLLOUT_MAX),
    (keys.ROLLOUT_IN_FLIGHT_MEAN, keys.ROLLOUT_IN_FLIGHT_MAX),
    (keys.ROLLOUT_IN_QUEUE_MEAN, keys.ROLLOUT_IN_QUEUE_MAX),
    (keys.ROLLOUT_NEWEST_MEAN, keys.ROLLOUT_NEWEST_MAX),
)


def _population_spans(slice_: ShippedSlice, rollout_in: BoolArray) -> BoolArray:
    """The spans with sampled positions of the selected live rollouts' kept samples (for the rare sums done
    in numpy: a staleness range too wide to count by value, or a dot product beyond int64)."""
    sample_in = (rollout_in & ~slice_.frozen)[slice_.sample_rollout] & ~slice_.dropped
    return sample_in[slice_.span_sample] & (slice_.sampled > 0)


def _population(
    slice_: ShippedSlice,
    rollout_in: BoolArray,
    env: int | None,
    window: WindowCounts,
    max_staleness: int,
) -> tuple[dict[str, float | int], Tally]:
    """Metrics and tally of the live shipped rollouts selected by ``rollout_in``.

    A rollout's own numbers (its oldest and newest shipped version, its in-flight time) depend on its spans
    alone, so they are the same in every population holding it; one compiled pass finds every number of a
    population (:func:`~staleness_metrics.metrics.population.population_summary`), so a small ship costs a few
    Python steps."""
    limits = (_DIRECT_RANGE, HISTOGRAM_TOP)
    found = population_summary(
        slice_.trained_version, rollout_in, columns_of(slice_), _LENGTH_BOUNDS, limits, _QUANTILE_FRACTIONS
    )
    if found is None:
        return _population_in_numpy(slice_, rollout_in, env, window, max_staleness)
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
    samples = found.samples
    if window.counts or window.dropped_lengths:
        dropped = window.dropped_by_length(env)
        samples_dropped = window.get(env, "samples_dropped")
        length_samples = samples + samples_dropped
        length_sampled, length_removed = found.length_sampled + dropped, found.length_removed + dropped
        rollouts_dropped, rollouts_held = window.get(env, "rollouts_dropped"), window.get(env, "rollouts_held")
        tokens_dropped, rollouts_invalid = window.get(env, "tokens_dropped"), window.get(env, "rollouts_invalid")
    else:  # (nothing dropped, held or set aside since the last ship: the usual case)
        length_samples, length_sampled, length_removed = samples, found.length_sampled, found.length_removed
        samples_dropped = rollouts_dropped = rollouts_held = tokens_dropped = rollouts_invalid = 0
    metrics.update(_length_metrics(length_samples, length_sampled, length_removed))
    metrics[keys.ROLLOUTS_DROPPED] = rollouts_dropped
    metrics[keys.SAMPLES_DROPPED] = samples_dropped
    metrics[keys.ROLLOUTS_HELD] = rollouts_held
    metrics[keys.MAX_STALENESS] = max_staleness

    tally = object.__new__(Tally)  # (every field given: the frozen __init__'s setattr per field skipped)
    tally.__dict__.update(
        tokens_sampled=tokens,
        tokens_masked=masked,
        tokens_unlabelled=unlabelled,
        tokens_dropped=tokens_dropped,
        samples_dropped=samples_dropped,
        rollouts_dropped=rollouts_dropped,
        rollouts_shipped=live,
        rollouts_frozen=found.frozen,
        rollouts_held=rollouts_held,
        rollouts_invalid=rollouts_invalid,
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


def _population_in_numpy(
    slice_: ShippedSlice,
    rollout_in: BoolArray,
    env: int | None,
    window: WindowCounts,
    max_staleness: int,
) -> tuple[dict[str, float | int], Tally]:
    """:func:`_population` where its one compiled pass declines (a staleness below 0, a range of staleness
    too wide to count by value, a sum beyond int64): the sums in a compiled pass, the rest in numpy."""
    t = slice_.trained_version
    sums = population_sums(t, rollout_in, columns_of(slice_), _LENGTH_BOUNDS, _DIRECT_RANGE)
    tokens, masked, unlabelled = sums.tokens, sums.masked, sums.unlabelled
    if sums.counts is not None:
        present = np.flatnonzero(sums.counts)
        token_values, token_counts = present + sums.low, sums.counts[present]
    elif tokens:
        spans = _population_spans(slice_, rollout_in)
        token_values, token_counts = _distribution(t - slice_.version[spans], slice_.sampled[spans])
    else:
        token_values = token_counts = np.zeros(0, dtype=np.int64)

    rollout, in_flight, newest = sums.rollout, sums.in_flight, sums.newest
    in_queue = rollout - in_flight
    rollout_values, rollout_counts = _distribution(rollout, None)

    metrics: dict[str, float | int] = {}
    if tokens:
        dot = sums.token_dot
        if dot is None:  # beyond int64: Python integers
            spans = _population_spans(slice_, rollout_in)
            dot = _exact_dot(t - slice_.version[spans], slice_.sampled[spans])
        metrics[keys.TOKEN_MEAN] = dot / tokens
        metrics[keys.TOKEN_MASKED] = float(masked / tokens)
        metrics[keys.TOKEN_UNLABELLED] = float(unlabelled / tokens)
        for (key, _, _), value in zip(QUANTILES, _nearest_ranks(token_values, token_counts)):
            metrics[key] = value
    if len(rollout):
        per_rollout = np.stack((rollout, in_flight, in_queue, newest))  # (one sum and one max for the four)
        for (mean_key, max_key), total, top in zip(_ROLLOUT_KEYS, per_rollout.sum(axis=1).tolist(),
                                                   per_rollout.max(axis=1).tolist()):  # fmt: skip
            metrics[mean_key] = total / len(rollout)
            metrics[max_key] = top
    # SPEC 12 over the shipped samples plus the window's dropped samples
    dropped = window.dropped_by_length(env)
    length_samples = sums.samples + window.get(env, "samples_dropped")
    length_sampled, length_removed = sums.length_sampled + dropped, sums.length_removed + dropped
    metrics.update(_length_metrics(length_samples, length_sampled, length_removed))
    metrics[keys.ROLLOUTS_DROPPED] = window.get(env, "rollouts_dropped")
    metrics[keys.SAMPLES_DROPPED] = window.get(env, "samples_dropped")
    metrics[keys.ROLLOUTS_HELD] = window.get(env, "rollouts_held")
    metrics[keys.MAX_STALENESS] = max_staleness

    tally = Tally(
        tokens_sampled=tokens,
        tokens_masked=masked,
        tokens_unlabelled=unlabelled,
        tokens_dropped=window.get(env, "tokens_dropped"),
        samples_dropped=window.get(env, "samples_dropped"),
        rollouts_dropped=window.get(env, "rollouts_dropped"),
        rollouts_shipped=len(rollout),
        rollouts_frozen=sums.frozen,
        rollouts_held=window.get(env, "rollouts_held"),
        rollouts_invalid=window.get(env, "rollouts_invalid"),
        token_histogram=_histogram(token_values, token_counts),
        rollout_histogram=_histogram(rollout_values, rollout_counts),
        length_samples=length_samples,
        length_sampled=length_sampled,
        length_removed=length_removed,
    )
    return metrics, tally


def _length_metrics(samples: int, sampled: IntArray, removed: IntArray) -> dict[str, float | int]:
    if samples == 0:
        return {}
    sampled_list, removed_list = sampled.tolist(), removed.tolist()  # (a few buckets: summed as Python integers)
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
    (``per_env=False``: the whole population only).

    ``bound`` is SPEC 14's view of ``mismatch`` (its floor, curve and advice, from the run's tracker)."""
    population, tally = _population(shipped, np.ones(shipped.n_rollouts, dtype=bool), None, window, max_staleness)
    metrics: dict[str, MetricValue] = dict(population)
    if mismatch is not None:
        metrics.update(mismatch_metrics(mismatch, bound))
    env_metrics: dict[str, dict[str, MetricValue]] = {}
    env_tally: dict[str, Tally] = {}
    envs = set(shipped.env.tolist()) | set(window.counts) if per_env else set()
    if len(envs) == 1 and set(window.dropped_lengths) <= envs:
        # One env holds every shipped rollout and every count of the window: its population is the whole
        # (the same inputs to the same sums), so it is not computed twice.
        (env,) = envs
        env_tally[env_names[env]] = tally
        env_metrics[env_names[env]] = dict(population)
        envs = set()
    for env in sorted(envs, key=lambda e: env_names[e]):
        env_population, env_tally[env_names[env]] = _population(shipped, shipped.env == env, env, window, max_staleness)
        env_metrics[env_names[env]] = dict(env_population)
    for name, (sums, env_bound) in (env_costs or {}).items():  # SPEC 11 and 14 per env (env breakdown)
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
