"""The metrics of a ship (SPEC 6), from the shipped slice after the decision was applied (so they
agree with the masking by construction), its population in one compiled pass."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop
from . import keys
from .bound import ShipBound, mismatch_metrics
from .buckets import HISTOGRAM_TOP, LENGTH_BUCKETS, LENGTH_UPPER_BOUNDS
from .metric_table import env_key
from .mismatch import MismatchSums
from .report import TOP_FIELDS, MetricValue, StepReport, Tally

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

QUANTILES = ((keys.TOKEN_P50, 50, 100), (keys.TOKEN_P90, 90, 100), (keys.TOKEN_P99, 99, 100))
_LENGTH_BOUNDS = np.asarray(LENGTH_UPPER_BOUNDS, dtype=np.int64)
_QUANTILE_FRACTIONS = np.array([(num, den) for _, num, den in QUANTILES], dtype=np.int64)


class PopulationColumns(NamedTuple):
    """The columns of a shipped slice a population pass reads (``engine.decision.Judgement``)."""

    frozen: BoolArray  # (per rollout from here)
    dispatch: IntArray
    completion: IntArray
    sample_offsets: IntArray
    dropped: BoolArray  # (per sample from here)
    mask_below: IntArray
    n_sampled: IntArray
    span_offsets: IntArray
    version: IntArray  # (per span from here)
    sampled: IntArray
    labelled: BoolArray


class ShippedSlice(NamedTuple):
    """A shipped slice after the decision was applied: its step, env indices, population columns."""

    step: int
    env: IntArray
    columns: PopulationColumns


class PopulationSummary(NamedTuple):
    """What :func:`population_summary` finds over the selected rollouts of a shipped slice."""

    tokens: int  # sampled positions of their live, kept samples
    masked: int  # of those, below their sample's threshold
    unlabelled: int  # of those, on unlabelled spans
    frozen: int  # selected frozen rollouts
    samples: int  # their live, kept samples
    token_dot: int  # sum of staleness x sampled positions (a Python integer: exact beyond int64)
    live: int  # selected live rollouts
    # their staleness (T - oldest shipped version), in-flight and in-queue times, newest staleness
    rollout_sum: int
    rollout_max: int
    in_flight_sum: int
    in_flight_max: int
    in_queue_sum: int
    in_queue_max: int
    newest_sum: int
    newest_max: int
    quantiles: list[int]  # the nearest-rank staleness of each (none without sampled positions)
    length_sampled: IntArray  # sampled positions per length bucket (of the sample's length)
    length_removed: IntArray  # of those, masked
    token_histogram: IntArray  # sampled positions per staleness 0, 1, ..., the last from ``top`` up
    rollout_histogram: IntArray  # live rollouts per staleness, folded alike
    # what each histogram folds from ``top`` up: beyond ``top`` summed, lowest, highest (0s: none)
    token_top: tuple[int, int, int]
    rollout_top: tuple[int, int, int]


# Places in the compiled pass's totals array (the loop's own layout: the results are named).
(_TOKENS, _MASKED, _UNLABELLED, _FROZEN, _SAMPLES, _DOT, _LIVE, _ROLLOUT, _MAX_ROLLOUT, _IN_FLIGHT, _MAX_IN_FLIGHT,
 _IN_QUEUE, _MAX_IN_QUEUE, _NEWEST, _MAX_NEWEST, _TOTALS) = range(16)  # fmt: skip

Columns = tuple[BoolArray, IntArray, IntArray, IntArray, BoolArray, IntArray, IntArray, IntArray, IntArray,
                IntArray, BoolArray]  # fmt: skip
_NO_OLDEST, _NO_FRESHEST = np.iinfo(np.int64).max, np.iinfo(np.int64).min  # (none seen yet)


def _check_population(rows: IntArray, columns: Columns) -> None:  # pragma: no cover
    frozen, dispatch, completion, sample_offsets, dropped, mask_below, n_sampled, span_offsets = columns[:8]
    version, sampled, labelled = columns[8:]
    n_rollouts, n_samples, n_spans = len(frozen), len(dropped), len(version)
    if len(dispatch) != n_rollouts or len(completion) != n_rollouts:
        raise ValueError("population: rollout arrays differ in length")
    if len(sample_offsets) != n_rollouts + 1 or len(mask_below) != n_samples or len(n_sampled) != n_samples:
        raise ValueError("population: sample arrays differ in length")
    if len(span_offsets) != n_samples + 1 or len(sampled) != n_spans or len(labelled) != n_spans:
        raise ValueError("population: span arrays differ in length")
    covered = sample_offsets[n_rollouts] == n_samples and span_offsets[n_samples] == n_spans
    if sample_offsets[0] != 0 or span_offsets[0] != 0 or not covered:
        raise ValueError("population: offsets do not cover the arrays")
    for r in rows:  # (the selected rollouts' offsets only: a pass per env must not read them all)
        if not 0 <= r < n_rollouts or not 0 <= sample_offsets[r] <= sample_offsets[r + 1] <= n_samples:
            raise ValueError("population: a selected row of no rollout, or offsets out of order")
        for s in range(sample_offsets[r], sample_offsets[r + 1]):
            if not 0 <= span_offsets[s] <= span_offsets[s + 1] <= n_spans:
                raise ValueError("population: offsets out of order")


def _walk_live_rollout(
    r: int,
    t: int,
    columns: Columns,
    length_bounds: IntArray,
    sums: tuple[IntArray, IntArray, IntArray, IntArray, IntArray],
    extent: IntArray,
) -> tuple[int, int]:  # pragma: no cover - compiled
    """Add live rollout ``r``'s kept samples to ``sums`` (totals, positions by length bucket, the
    staleness histogram up to ``top``, the spans from it up); its oldest and newest version."""
    dispatch, sample_offsets = columns[1], columns[3]
    dropped, mask_below, n_sampled, span_offsets = columns[4:8]
    version, sampled, labelled = columns[8:]
    totals, length_sampled, length_removed, histogram, above = sums
    top = extent[2]
    n_buckets = len(length_bounds) + 1
    oldest, freshest = _NO_OLDEST, _NO_FRESHEST
    for s in range(sample_offsets[r], sample_offsets[r + 1]):
        if dropped[s]:
            continue
        totals[_SAMPLES] += 1
        masked_here = 0
        for k in range(span_offsets[s], span_offsets[s + 1]):
            count = sampled[k]
            if count <= 0:
                continue
            v = version[k]
            oldest, freshest = min(oldest, v), max(freshest, v)
            staleness = t - v
            extent[0] = max(extent[0], staleness)
            if staleness >= top:
                histogram[top] += count
                above[0, extent[1]] = staleness
                above[1, extent[1]] = count
                extent[1] += 1
            elif staleness >= 0:  # (below 0: the rollout is refused once walked)
                histogram[staleness] += count
                totals[_DOT] += staleness * count
            totals[_TOKENS] += count
            if not labelled[k]:
                totals[_UNLABELLED] += count
            if v < mask_below[s]:
                masked_here += count
        totals[_MASKED] += masked_here
        length = n_sampled[s]
        if length > 0:
            bucket = 0
            while bucket < n_buckets - 1 and length_bounds[bucket] < length:
                bucket += 1
            length_sampled[bucket] += length
            length_removed[bucket] += masked_here
    if oldest > freshest:  # no sampled span: the dispatch version
        return dispatch[r], dispatch[r]
    return oldest, freshest


def _nearest_ranks(
    histogram: IntArray, above: IntArray, quantiles: IntArray, out: IntArray
) -> None:  # pragma: no cover - compiled
    """Into ``out``, per ``quantiles`` row, the ceil(p * N)-th smallest staleness."""
    values, counts = above[0], above[1]
    below = len(histogram) - 1 if len(values) else len(histogram)
    total = histogram.sum()
    for q in range(len(quantiles)):
        numerator, denominator = quantiles[q, 0], quantiles[q, 1]
        # ceil(numerator * total / denominator) without the product, which may not fit in int64
        whole, rest = total // denominator, total % denominator
        rank = max(1, numerator * whole + (numerator * rest + denominator - 1) // denominator)
        running = 0
        for i in range(below + len(values)):
            running += histogram[i] if i < below else counts[i - below]
            if running >= rank:
                out[q] = i if i < below else values[i - below]
                break


def rows_by_key(rows: IntArray, key: IntArray) -> list[tuple[int, IntArray]]:
    """``rows`` by ``key[rows]``, keys ascending, rows in order (one sort, not a pass per key)."""
    order = np.argsort(keys := key[rows], kind="stable")
    found, starts = np.unique(keys[order], return_index=True)
    return list(zip(found.tolist(), np.split(rows[order], starts[1:])))


_SUMMARY_CALLEES = (_check_population, _walk_live_rollout, _nearest_ranks)


@CompiledLoop(callees={f.__name__: (f, {}) for f in _SUMMARY_CALLEES})
def _population_summary(
    t: int, rows: IntArray, columns: Columns, length_bounds: IntArray, top: int, quantiles: IntArray
) -> tuple[IntArray, ...]:  # pragma: no cover - compiled
    _check_population(rows, columns)
    frozen, completion, sample_offsets, span_offsets = columns[0], columns[2], columns[3], columns[7]
    totals = np.zeros(_TOTALS + len(quantiles), dtype=np.int64)  # (then the quantiles' staleness)
    lengths = np.zeros((2, len(length_bounds) + 1), dtype=np.int64)  # sampled and removed positions
    rollout_histogram = np.zeros(top + 1, dtype=np.int64)
    histogram = np.zeros(top + 1, dtype=np.int64)
    spans = span_offsets[sample_offsets[rows + 1]] - span_offsets[sample_offsets[rows]]  # (selected)
    above = np.empty((2, spans.sum()), dtype=np.int64)  # (at most one entry per span)
    # the highest staleness (-1: none), the spans at top or above, and top
    extent = np.array([-1, 0, top], dtype=np.int64)
    rollout_top = -1
    folded_rollouts, n_folded = np.empty(len(rows), dtype=np.int64), 0  # staleness from top up
    for r in rows:
        if frozen[r]:
            totals[_FROZEN] += 1
            continue
        sums = (totals, lengths[0], lengths[1], histogram, above)
        oldest, freshest = _walk_live_rollout(r, t, columns, length_bounds, sums, extent)
        rollout = t - oldest
        in_flight = min(max(completion[r] - oldest, 0), rollout)
        in_queue = rollout - in_flight
        newest = t - freshest
        if newest < 0:  # (a sampled span, or the dispatch of a rollout without any)
            raise ValueError("population: a version above the trained version")
        totals[_LIVE] += 1
        # each sum is followed by its maximum (every number is >= 0, the maxima start at 0)
        for i, value in enumerate((rollout, in_flight, in_queue, newest)):
            totals[_ROLLOUT + 2 * i] += value
            totals[_MAX_ROLLOUT + 2 * i] = max(totals[_MAX_ROLLOUT + 2 * i], value)
        folded = min(rollout, top)
        rollout_histogram[folded] += 1
        rollout_top = max(rollout_top, folded)
        if rollout >= top:
            folded_rollouts[n_folded] = rollout
            n_folded += 1
    histogram = histogram[: min(extent[0], top) + 1].copy()  # (empty without sampled positions)
    above = above[:, : extent[1]].copy()
    if extent[1] > 1:
        above = above[:, np.argsort(above[0], kind="mergesort")]
    if len(histogram):  # (no quantile without sampled positions)
        _nearest_ranks(histogram, above, quantiles, totals[_TOTALS:])
    else:
        totals = totals[:_TOTALS]
    rollout_histogram = rollout_histogram[: rollout_top + 1].copy()
    return totals, lengths, histogram, rollout_histogram, above, folded_rollouts[:n_folded].copy()


def population_summary(
    trained_version: int,
    rows: IntArray,
    columns: PopulationColumns,
    length_bounds: IntArray,
    top: int,
    quantiles: IntArray,
) -> PopulationSummary:
    """The population of the rollouts ``rows`` (ascending), in one pass over their spans
    (frozen rollouts only counted, dropped samples left out); ``quantiles`` rows are (numerator,
    denominator). ``ValueError`` on arrays that do not tile, or a version above ``t``."""
    t, top = int(trained_version), int(top)
    found = _population_summary(t, rows, tuple(columns), length_bounds, top, quantiles)
    totals, lengths, token_histogram, rollout_histogram, above, folded_rollouts = found
    numbers = totals.tolist()
    (staleness, positions), rollouts = above.tolist(), folded_rollouts.tolist()
    tops = _from_top(staleness, positions, top), _from_top(rollouts, [1] * len(rollouts), top)
    numbers[_DOT] += tops[0][0] + top * sum(positions)
    arrays = (lengths[0], lengths[1], token_histogram, rollout_histogram)
    return PopulationSummary._make((*numbers[:_TOTALS], numbers[_TOTALS:], *arrays, *tops))


def _from_top(staleness: list[int], counts: list[int], top: int) -> tuple[int, int, int]:
    """Staleness from ``top`` up, ``counts`` of each: summed beyond ``top`` as Python integers
    (exact beyond int64), lowest, highest; 0s when none."""
    beyond = sum(map(operator.mul, staleness, counts)) - top * sum(counts)
    return (beyond, min(staleness), max(staleness)) if staleness else (0, 0, 0)


@CompiledLoop
def _env_sums(env: IntArray, amounts: IntArray, bounds: IntArray) -> IntArray:  # pragma: no cover
    """Per env index (row): its entries, their ``amounts``' sum, and that sum by length bucket."""
    n_env = env.max() + 1 if len(env) else 0
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

    FIELDS = ("rollouts_dropped", "samples_dropped", "tokens_dropped", "rollouts_held", "rollouts_invalid")

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
                self.counts.setdefault(index, dict.fromkeys(self.FIELDS, 0))[name] += total

    def add_dropped_samples(self, env: IntArray, sampled: IntArray) -> None:
        """Dropped samples of live rollouts: counted, their sampled positions summed, and those by
        the samples' length bucket (SPEC 12), in one pass."""
        per_env = _env_sums(env, sampled, _LENGTH_BOUNDS)
        for index in np.flatnonzero(per_env[:, 0]).tolist():
            bucket = self.counts.setdefault(index, dict.fromkeys(self.FIELDS, 0))
            bucket["samples_dropped"] += int(per_env[index, 0])
            bucket["tokens_dropped"] += int(per_env[index, 1])
            self.dropped_lengths[index] = self.dropped_lengths.get(index, 0) + per_env[index, 2:]

    def totals(self, env: int | None) -> dict[str, int]:
        """The :data:`FIELDS` of ``env`` (None: summed over every env)."""
        buckets = list(self.counts.values()) if env is None else [self.counts.get(env, {})]
        return {name: sum(bucket.get(name, 0) for bucket in buckets) for name in self.FIELDS}


_ROLLOUT_KEYS = (
    (keys.ROLLOUT_MEAN, keys.ROLLOUT_MAX),
    (keys.ROLLOUT_IN_FLIGHT_MEAN, keys.ROLLOUT_IN_FLIGHT_MAX),
    (keys.ROLLOUT_IN_QUEUE_MEAN, keys.ROLLOUT_IN_QUEUE_MAX),
    (keys.ROLLOUT_NEWEST_MEAN, keys.ROLLOUT_NEWEST_MAX),
)


def _population(
    slice_: ShippedSlice, rows: IntArray, env: int | None, window: WindowCounts, max_staleness: int
) -> tuple[dict[str, float | int], Tally]:
    """Metrics and tally of the live shipped rollouts ``rows``."""
    t, top = slice_.step - 1, HISTOGRAM_TOP
    found = population_summary(t, rows, slice_.columns, _LENGTH_BOUNDS, top, _QUANTILE_FRACTIONS)
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
        sums = (found.rollout_sum, found.in_flight_sum, found.in_queue_sum, found.newest_sum)
        tops = (found.rollout_max, found.in_flight_max, found.in_queue_max, found.newest_max)
        for (mean_key, max_key), total, top in zip(_ROLLOUT_KEYS, sums, tops):
            metrics[mean_key] = total / live
            metrics[max_key] = top
    # SPEC 12 over the shipped samples plus the window's dropped samples
    counted = window.totals(env)
    length_samples = found.samples + counted["samples_dropped"]
    length_sampled, length_removed = found.length_sampled, found.length_removed
    if window.dropped_lengths:
        zeros = np.zeros(len(LENGTH_BUCKETS), dtype=np.int64)
        by_env = window.dropped_lengths
        dropped = sum(by_env.values(), zeros) if env is None else by_env.get(env, zeros)
        length_sampled, length_removed = length_sampled + dropped, length_removed + dropped
    if length_samples:  # (a few buckets: summed as Python integers)
        sampled_list, removed_list = length_sampled.tolist(), length_removed.tolist()
        total = sum(sampled_list)
        metrics[keys.LENGTH_SAMPLED_MEAN] = total / length_samples
        metrics[keys.LENGTH_TRAINED_MEAN] = (total - sum(removed_list)) / length_samples
        for name, n, gone in zip(LENGTH_BUCKETS, sampled_list, removed_list):
            if n:
                metrics[keys.LENGTH_REMOVED_SHARE_BY_LENGTH[name]] = gone / n
    metrics[keys.ROLLOUTS_DROPPED] = counted["rollouts_dropped"]
    metrics[keys.SAMPLES_DROPPED] = counted["samples_dropped"]
    metrics[keys.ROLLOUTS_HELD] = counted["rollouts_held"]
    metrics[keys.MAX_STALENESS] = max_staleness

    tally = object.__new__(Tally)  # fields set below: no frozen __init__ (a setattr per field)
    # (the window's FIELDS are the tally's fields of the same names)
    tally.__dict__.update(
        counted, tokens_sampled=tokens, tokens_masked=masked, tokens_unlabelled=unlabelled,
        rollouts_shipped=live, rollouts_frozen=found.frozen, length_samples=length_samples,
        token_histogram=found.token_histogram, rollout_histogram=found.rollout_histogram,
        length_sampled=length_sampled, length_removed=length_removed,
        **dict(zip(TOP_FIELDS, (*found.token_top, *found.rollout_top))),
    )  # fmt: skip
    return metrics, tally


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
    population, tally = _population(shipped, np.arange(len(shipped.env)), None, window, max_staleness)
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
    rows_of = dict(rows_by_key(np.arange(len(shipped.env)), shipped.env)) if envs else {}
    for env in sorted(envs, key=lambda e: env_names[e]):
        rows = rows_of.get(env, np.zeros(0, dtype=np.int64))
        env_population, env_tally[env_names[env]] = _population(shipped, rows, env, window, max_staleness)
        env_metrics[env_names[env]] = dict(env_population)
    for name, (sums, env_bound) in (env_costs or {}).items():  # SPEC 11 and 14 per env
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
