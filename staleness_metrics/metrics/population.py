"""The population of a ship in one compiled pass over its spans: the sums, extremes, quantiles and histograms
:mod:`.compute` turns into SPEC 6's metrics.

The input is a shipped slice's columns (:class:`PopulationColumns`: rollouts, their samples by
``sample_offsets``, the samples' spans by ``span_offsets``, as ``engine.decision.Judgement`` holds them).
:func:`population_summary` finds every number of a population at once; :func:`population_sums` the sums alone,
for the rare populations the summary declines (a staleness below 0, a range too wide to count by value, a sum
beyond int64). The steps each replaced are in ``tests/metrics/test_population_summary.py`` and
``tests/engine/test_ship_kernels.py``, checked equal on random inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop

__all__ = ["PopulationColumns", "PopulationSummary", "PopulationSums", "population_summary", "population_sums"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class PopulationColumns(NamedTuple):
    """The columns of a shipped slice a population pass reads (see ``engine.decision.Judgement``)."""

    # rollouts
    frozen: BoolArray
    dispatch: IntArray
    completion: IntArray
    sample_offsets: IntArray
    # samples
    dropped: BoolArray
    mask_below: IntArray
    n_sampled: IntArray
    span_offsets: IntArray
    # spans
    version: IntArray
    sampled: IntArray
    labelled: BoolArray


class PopulationSums(NamedTuple):
    """What :func:`population_sums` finds over the selected rollouts of a shipped slice."""

    tokens: int  # sampled positions of their live, kept samples
    masked: int  # of those, below their sample's threshold
    unlabelled: int  # of those, on unlabelled spans
    frozen: int  # selected frozen rollouts
    samples: int  # their live, kept samples
    token_dot: int | None  # sum of staleness x sampled positions (None: int64 could overflow)
    low: int  # the smallest staleness of a span with sampled positions
    counts: IntArray | None  # sampled positions per staleness low, low + 1, ... (None: none, or too wide a range)
    rollout: IntArray  # per selected live rollout: T - its oldest shipped sampled version (dispatch when none)
    in_flight: IntArray  # its completion - that version, within 0..rollout
    newest: IntArray  # T - its newest shipped sampled version (dispatch when none)
    length_sampled: IntArray  # per length bucket (by a sample's sampled positions): sampled positions
    length_removed: IntArray  # of those, masked


class PopulationSummary(NamedTuple):
    """What :func:`population_summary` finds over the selected rollouts of a shipped slice."""

    tokens: int  # sampled positions of their live, kept samples
    masked: int  # of those, below their sample's threshold
    unlabelled: int  # of those, on unlabelled spans
    frozen: int  # selected frozen rollouts
    samples: int  # their live, kept samples
    token_dot: int  # sum of staleness x sampled positions
    live: int  # selected live rollouts
    # their staleness (T - oldest shipped sampled version), in-flight and in-queue times, newest staleness
    rollout_sum: int
    rollout_max: int
    in_flight_sum: int
    in_flight_max: int
    in_queue_sum: int
    in_queue_max: int
    newest_sum: int
    newest_max: int
    quantiles: list[int]  # the nearest-rank staleness of each quantile asked (none without sampled positions)
    length_sampled: IntArray  # per length bucket (by a sample's sampled positions): sampled positions
    length_removed: IntArray  # of those, masked
    token_histogram: IntArray  # sampled positions per staleness 0, 1, ..., the last counting all from ``top`` up
    rollout_histogram: IntArray  # live rollouts per staleness (their oldest shipped version's), folded alike


# Places in the totals array the compiled passes share (the loops' own layout: the results are named).
(_TOKENS, _MASKED, _UNLABELLED, _FROZEN, _SAMPLES, _DOT, _LIVE, _ROLLOUT, _MAX_ROLLOUT, _IN_FLIGHT, _MAX_IN_FLIGHT,
 _IN_QUEUE, _MAX_IN_QUEUE, _NEWEST, _MAX_NEWEST, _TOTALS) = range(16)  # fmt: skip

Columns = tuple[BoolArray, IntArray, IntArray, IntArray, BoolArray, IntArray, IntArray, IntArray, IntArray,
                IntArray, BoolArray]  # fmt: skip


def _check_population(rollout_in: BoolArray, columns: Columns) -> None:  # pragma: no cover - compiled
    """The checks of a population pass's arrays (a callee of ``_population_sums`` and ``_population_summary``)."""
    frozen, dispatch, completion, sample_offsets, dropped, mask_below, n_sampled, span_offsets = columns[:8]
    version, sampled, labelled = columns[8:]
    n_rollouts = len(frozen)
    n_samples = len(dropped)
    n_spans = len(version)
    if len(rollout_in) != n_rollouts or len(dispatch) != n_rollouts or len(completion) != n_rollouts:
        raise ValueError("population: rollout arrays differ in length")
    if len(sample_offsets) != n_rollouts + 1 or len(mask_below) != n_samples or len(n_sampled) != n_samples:
        raise ValueError("population: sample arrays differ in length")
    if len(span_offsets) != n_samples + 1 or len(sampled) != n_spans or len(labelled) != n_spans:
        raise ValueError("population: span arrays differ in length")
    if sample_offsets[0] != 0 or sample_offsets[n_rollouts] != n_samples or span_offsets[0] != 0:
        raise ValueError("population: offsets do not cover the arrays")
    if span_offsets[n_samples] != n_spans:
        raise ValueError("population: offsets do not cover the arrays")
    for r in range(n_rollouts):
        if sample_offsets[r + 1] < sample_offsets[r]:
            raise ValueError("population: offsets out of order")
    for k in range(n_samples):
        if span_offsets[k + 1] < span_offsets[k]:
            raise ValueError("population: offsets out of order")


def _walk_live_rollout(
    r: int,
    t: int,
    columns: Columns,
    length_bounds: IntArray,
    totals: IntArray,
    lengths: tuple[IntArray, IntArray],
    extent: IntArray,
) -> tuple[int, int]:  # pragma: no cover - compiled
    """Add live rollout ``r``'s kept samples and their spans with sampled positions to ``totals`` (tokens,
    masked, unlabelled and samples), the length buckets (``lengths``: sampled and removed positions) and
    ``extent`` (the lowest, highest and largest absolute staleness, and 1 once any is seen); returns the
    rollout's oldest and newest sampled version (its dispatch version for both when it has none). A callee of
    ``_population_sums`` and ``_population_summary``."""
    dispatch, sample_offsets, dropped, mask_below, n_sampled, span_offsets = columns[1], columns[3], *columns[4:8]
    version, sampled, labelled = columns[8:]
    length_sampled, length_removed = lengths
    n_buckets = len(length_bounds) + 1
    oldest = dispatch[r]
    freshest = dispatch[r]
    found = False
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
            if not found:
                oldest = v
                freshest = v
                found = True
            else:
                oldest = min(oldest, v)
                freshest = max(freshest, v)
            staleness = t - v
            if extent[3] == 0:
                extent[0] = staleness
                extent[1] = staleness
                extent[3] = 1
            else:
                extent[0] = min(extent[0], staleness)
                extent[1] = max(extent[1], staleness)
            extent[2] = max(extent[2], abs(staleness))
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
    return oldest, freshest


def _staleness_counts(
    t: int, rollout_in: BoolArray, columns: Columns, counts: IntArray, low: int, fits: bool
) -> int:  # pragma: no cover - compiled
    """Add each selected live rollout's kept samples' sampled positions to ``counts`` at their staleness - ``low``
    (an empty ``counts``: none); return the sum of staleness x positions when it ``fits`` in int64 (else 0). A
    callee of ``_population_sums`` and ``_population_summary``."""
    frozen, sample_offsets, dropped, span_offsets, version, sampled = columns[0], columns[3], columns[4], *columns[7:10]
    direct = len(counts) > 0
    dot = 0
    for r in range(len(frozen)):
        if not rollout_in[r] or frozen[r]:
            continue
        for s in range(sample_offsets[r], sample_offsets[r + 1]):
            if dropped[s]:
                continue
            for k in range(span_offsets[s], span_offsets[s + 1]):
                count = sampled[k]
                if count <= 0:
                    continue
                if fits:
                    dot += (t - version[k]) * count
                if direct:
                    counts[t - version[k] - low] += count
    return dot


_POPULATION_CALLEES: dict[str, tuple[Callable[..., Any], Mapping[str, Any]]] = {
    "_check_population": (_check_population, {}),
    "_walk_live_rollout": (_walk_live_rollout, {}),
    "_staleness_counts": (_staleness_counts, {}),
}


@CompiledLoop(callees=_POPULATION_CALLEES)
def _population_sums(
    t: int, rollout_in: BoolArray, columns: Columns, length_bounds: IntArray, direct_range: int
) -> tuple[IntArray, ...]:  # pragma: no cover - compiled
    _check_population(rollout_in, columns)
    frozen, completion = columns[0], columns[2]
    n_rollouts = len(frozen)
    totals = np.zeros(_TOTALS, dtype=np.int64)  # (tokens, masked, unlabelled, frozen and samples only)
    n_buckets = len(length_bounds) + 1
    lengths = (np.zeros(n_buckets, dtype=np.int64), np.zeros(n_buckets, dtype=np.int64))
    selected = 0
    for r in range(n_rollouts):
        if rollout_in[r] and not frozen[r]:
            selected += 1
    rollout = np.empty(selected, dtype=np.int64)
    in_flight = np.empty(selected, dtype=np.int64)
    newest = np.empty(selected, dtype=np.int64)
    extent = np.zeros(4, dtype=np.int64)  # _walk_live_rollout's lowest, highest and largest |staleness|, any
    at = 0
    for r in range(n_rollouts):
        if not rollout_in[r]:
            continue
        if frozen[r]:
            totals[_FROZEN] += 1
            continue
        oldest, freshest = _walk_live_rollout(r, t, columns, length_bounds, totals, lengths, extent)
        rollout[at] = t - oldest
        flight = completion[r] - oldest
        flight = max(flight, 0)
        in_flight[at] = min(flight, t - oldest)
        newest[at] = t - freshest
        at += 1
    low, high, largest, present = extent[0], extent[1], extent[2], extent[3] != 0
    # sum(staleness x count) fits in int64 when |staleness| x tokens does (every partial sum is below it)
    fits = largest == 0 or totals[_TOKENS] <= (2**62 - 1) // largest
    counts = np.zeros(0, dtype=np.int64)
    found = np.zeros(4, dtype=np.int64)  # dot, dot fits, low, any present
    if present:
        found[2] = low
        found[3] = 1
        if high - low < direct_range:
            counts = np.zeros(high - low + 1, dtype=np.int64)
        if fits or len(counts):
            found[0] = _staleness_counts(t, rollout_in, columns, counts, low, fits)
    found[1] = 1 if fits else 0
    return totals, found, counts, rollout, in_flight, newest, lengths[0], lengths[1]


def population_sums(
    trained_version: int,
    rollout_in: BoolArray,
    columns: PopulationColumns,
    length_bounds: IntArray,
    direct_range: int,
) -> PopulationSums:
    """The sums of a ship's metrics over the rollouts selected by ``rollout_in``, in one pass over their spans.
    Frozen rollouts are only counted; dropped samples are left out. A sample's length bucket is the first of
    ``length_bounds`` at or above its sampled positions (the last bucket past them all); samples with none are
    in no bucket. ``counts`` is given when the staleness values of spans with sampled positions lie within
    ``direct_range``.

    Raises ``ValueError`` on arrays of different lengths or offsets that do not tile them.
    """
    found = _population_sums(int(trained_version), rollout_in, tuple(columns), length_bounds, int(direct_range))
    totals, numbers, counts, rollout, in_flight, newest, length_sampled, length_removed = found
    tokens, masked, unlabelled, n_frozen, samples = totals[:_DOT].tolist()
    dot, fits, low, present = numbers.tolist()
    return PopulationSums(
        tokens, masked, unlabelled, n_frozen, samples, dot if fits and present else (0 if not present else None),
        low, counts if present and len(counts) else None, rollout, in_flight, newest, length_sampled, length_removed,
    )  # fmt: skip


def _nearest_ranks(
    counts: IntArray, low: int, total: int, quantiles: IntArray, out: IntArray
) -> None:  # pragma: no cover - compiled
    """Into ``out``, per ``quantiles`` row (numerator, denominator), the ceil(p * total)-th smallest staleness of
    ``counts`` (positions per staleness ``low``, ``low + 1``, ...). A callee of ``_population_summary``."""
    for q in range(len(quantiles)):
        numerator = quantiles[q, 0]
        denominator = quantiles[q, 1]
        # ceil(numerator * total / denominator) without the product, which may not fit in int64
        whole = total // denominator
        rest = total % denominator
        rank = max(1, numerator * whole + (numerator * rest + denominator - 1) // denominator)
        running = 0
        for i in range(len(counts)):
            running += counts[i]
            if running >= rank:
                out[q] = low + i
                break


@CompiledLoop(callees={**_POPULATION_CALLEES, "_nearest_ranks": (_nearest_ranks, {})})
def _population_summary(
    t: int,
    rollout_in: BoolArray,
    columns: Columns,
    length_bounds: IntArray,
    limits: tuple[int, int],
    quantiles: IntArray,
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray, IntArray]:  # pragma: no cover - compiled
    _check_population(rollout_in, columns)
    frozen, completion = columns[0], columns[2]
    direct_range, top = limits
    n_rollouts = len(frozen)
    totals = np.zeros(_TOTALS, dtype=np.int64)
    ranks = np.zeros(len(quantiles), dtype=np.int64)
    n_buckets = len(length_bounds) + 1
    lengths = (np.zeros(n_buckets, dtype=np.int64), np.zeros(n_buckets, dtype=np.int64))
    rollout_hist = np.zeros(top + 1, dtype=np.int64)
    extent = np.zeros(4, dtype=np.int64)  # _walk_live_rollout's lowest, highest and largest |staleness|, any
    declined = np.zeros(0, dtype=np.int64)  # (an empty totals: the caller's general path)
    rollout_top = -1
    for r in range(n_rollouts):
        if not rollout_in[r]:
            continue
        if frozen[r]:
            totals[_FROZEN] += 1
            continue
        oldest, freshest = _walk_live_rollout(r, t, columns, length_bounds, totals, lengths, extent)
        rollout = t - oldest
        in_flight = min(max(completion[r] - oldest, 0), rollout)
        in_queue = rollout - in_flight
        newest = t - freshest
        if rollout < 0:
            return declined, ranks, lengths[0], lengths[1], declined, declined  # a staleness below 0
        first = totals[_LIVE] == 0
        totals[_LIVE] += 1
        totals[_ROLLOUT] += rollout
        totals[_IN_FLIGHT] += in_flight
        totals[_IN_QUEUE] += in_queue
        totals[_NEWEST] += newest
        totals[_MAX_ROLLOUT] = rollout if first else max(totals[_MAX_ROLLOUT], rollout)
        totals[_MAX_IN_FLIGHT] = in_flight if first else max(totals[_MAX_IN_FLIGHT], in_flight)
        totals[_MAX_IN_QUEUE] = in_queue if first else max(totals[_MAX_IN_QUEUE], in_queue)
        totals[_MAX_NEWEST] = newest if first else max(totals[_MAX_NEWEST], newest)
        folded = min(rollout, top)
        rollout_hist[folded] += 1
        rollout_top = max(rollout_top, folded)
    low, high, largest, present = extent[0], extent[1], extent[2], extent[3] != 0
    token_hist = np.zeros(0, dtype=np.int64)
    if present:
        # the general path: a staleness below 0, too wide a range to count by value, or a dot beyond int64
        if low < 0 or high - low >= direct_range or (largest > 0 and totals[_TOKENS] > (2**62 - 1) // largest):
            return declined, ranks, lengths[0], lengths[1], declined, declined
        counts = np.zeros(high - low + 1, dtype=np.int64)
        totals[_DOT] = _staleness_counts(t, rollout_in, columns, counts, low, True)
        _nearest_ranks(counts, low, totals[_TOKENS], quantiles, ranks)
        token_hist = np.zeros(min(high, top) + 1, dtype=np.int64)
        for i in range(len(counts)):
            token_hist[min(low + i, top)] += counts[i]
    else:
        ranks = ranks[:0]
    return totals, ranks, lengths[0], lengths[1], token_hist, rollout_hist[: rollout_top + 1].copy()


def population_summary(
    trained_version: int,
    rollout_in: BoolArray,
    columns: PopulationColumns,
    length_bounds: IntArray,
    limits: tuple[int, int],
    quantiles: IntArray,
) -> PopulationSummary | None:
    """What a ship reports of the rollouts selected by ``rollout_in`` (the inputs of :func:`population_sums`),
    in one pass: the sums of :func:`population_sums`, the count, sum and maximum of the live rollouts'
    staleness, in-flight and in-queue times and newest staleness, the nearest-rank staleness of each
    ``quantiles`` row (numerator, denominator: the ceil(p * N)-th smallest sampled position's), and the token and
    rollout histograms (index = staleness, the last index ``top`` counting all above it). ``limits`` is
    ``(direct_range, top)``.

    None where the general path is needed: a staleness below 0, staleness values of sampled positions that
    span ``direct_range`` or more, or a staleness x positions sum that could overflow int64.

    Raises ``ValueError`` on arrays of different lengths or offsets that do not tile them.
    """
    found = _population_summary(int(trained_version), rollout_in, tuple(columns), length_bounds,
                                (int(limits[0]), int(limits[1])), quantiles)  # fmt: skip
    totals, ranks, length_sampled, length_removed, token_histogram, rollout_histogram = found
    if not len(totals):
        return None
    arrays = (length_sampled, length_removed, token_histogram, rollout_histogram)
    return PopulationSummary._make((*totals.tolist(), ranks.tolist(), *arrays))
