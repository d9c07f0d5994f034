"""The population of a ship in one compiled pass over its spans: the sums, extremes, quantiles and
histograms :mod:`.compute` turns into SPEC 6's metrics (the numpy reference is in
``tests/metrics/test_population_summary.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class PopulationColumns(NamedTuple):
    """The columns of a shipped slice a population pass reads (``engine.decision.Judgement``)."""

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
    # the nearest-rank staleness of each quantile asked (none without sampled positions)
    quantiles: list[int]
    # per length bucket (by a sample's sampled positions): sampled positions
    length_sampled: IntArray
    length_removed: IntArray  # of those, masked
    # sampled positions per staleness 0, 1, ..., the last counting all from ``top`` up
    token_histogram: IntArray
    # live rollouts per staleness (their oldest shipped version's), folded alike
    rollout_histogram: IntArray


# Places in the compiled pass's totals array (the loop's own layout: the results are named).
(_TOKENS, _MASKED, _UNLABELLED, _FROZEN, _SAMPLES, _DOT, _LIVE, _ROLLOUT, _MAX_ROLLOUT, _IN_FLIGHT, _MAX_IN_FLIGHT,
 _IN_QUEUE, _MAX_IN_QUEUE, _NEWEST, _MAX_NEWEST, _TOTALS) = range(16)  # fmt: skip

Columns = tuple[BoolArray, IntArray, IntArray, IntArray, BoolArray, IntArray, IntArray, IntArray, IntArray,
                IntArray, BoolArray]  # fmt: skip


def _check_population(rollout_in: BoolArray, columns: Columns) -> None:  # pragma: no cover - compiled
    """The checks of a population pass's arrays."""
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
    """Add live rollout ``r``'s kept samples to ``totals``, ``lengths`` (sampled and removed
    positions per length bucket) and ``extent`` (the highest staleness, the spans at ``extent[2]``
    or above); returns its oldest and newest sampled version (else its dispatch version)."""
    dispatch, sample_offsets = columns[1], columns[3]
    dropped, mask_below, n_sampled, span_offsets = columns[4:8]
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
            extent[0] = max(extent[0], staleness)
            extent[1] += staleness >= extent[2]
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
    t: int, rollout_in: BoolArray, columns: Columns, extent: IntArray
) -> tuple[IntArray, IntArray, int]:  # pragma: no cover - compiled
    """The selected live rollouts' sampled positions by staleness: the histogram (the last index
    ``top`` counting all at or above it), the spans at ``top`` or above (staleness, positions)
    sorted by staleness, and the sum of staleness x positions below ``top``."""
    frozen, sample_offsets, dropped = columns[0], columns[3], columns[4]
    span_offsets, version, sampled = columns[7:10]
    high, n_above, top = extent[0], extent[1], extent[2]
    histogram = np.zeros(min(high, top) + 1, dtype=np.int64)  # (empty without sampled positions)
    above = np.empty((2, n_above), dtype=np.int64)
    at = 0
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
                staleness = t - version[k]
                if staleness < top:
                    histogram[staleness] += count
                    dot += staleness * count
                else:
                    histogram[top] += count
                    above[0, at] = staleness
                    above[1, at] = count
                    at += 1
    if at > 1:
        above = above[:, np.argsort(above[0], kind="mergesort")]
    return histogram, above, dot


def _nearest_ranks(
    histogram: IntArray, above: IntArray, quantiles: IntArray, out: IntArray
) -> None:  # pragma: no cover - compiled
    """Into ``out``, per ``quantiles`` row (numerator, denominator), the ceil(p * N)-th smallest
    staleness of ``histogram``'s positions (its last index read from ``above``)."""
    values, counts = above[0], above[1]
    below = len(histogram) - 1 if len(values) else len(histogram)
    total = 0
    for i in range(len(histogram)):
        total += histogram[i]
    for q in range(len(quantiles)):
        numerator = quantiles[q, 0]
        denominator = quantiles[q, 1]
        # ceil(numerator * total / denominator) without the product, which may not fit in int64
        whole = total // denominator
        rest = total % denominator
        rank = max(1, numerator * whole + (numerator * rest + denominator - 1) // denominator)
        running = 0
        for i in range(below + len(values)):
            running += histogram[i] if i < below else counts[i - below]
            if running >= rank:
                out[q] = i if i < below else values[i - below]
                break


_POPULATION_CALLEES: dict[str, tuple[Callable[..., Any], Mapping[str, Any]]] = {
    "_check_population": (_check_population, {}),
    "_walk_live_rollout": (_walk_live_rollout, {}),
    "_staleness_counts": (_staleness_counts, {}),
    "_nearest_ranks": (_nearest_ranks, {}),
}


@CompiledLoop(callees=_POPULATION_CALLEES)
def _population_summary(
    t: int,
    rollout_in: BoolArray,
    columns: Columns,
    length_bounds: IntArray,
    top: int,
    quantiles: IntArray,
) -> tuple[IntArray, ...]:  # pragma: no cover - compiled
    _check_population(rollout_in, columns)
    frozen, completion = columns[0], columns[2]
    totals = np.zeros(_TOTALS + len(quantiles), dtype=np.int64)  # (then the quantiles' staleness)
    lengths = np.zeros((2, len(length_bounds) + 1), dtype=np.int64)  # sampled and removed positions
    rollout_histogram = np.zeros(top + 1, dtype=np.int64)
    # the highest staleness (-1: none), the spans at top or above, and top
    extent = np.array([-1, 0, top], dtype=np.int64)
    rollout_top = -1
    for r in range(len(frozen)):
        if not rollout_in[r]:
            continue
        if frozen[r]:
            totals[_FROZEN] += 1
            continue
        buckets = (lengths[0], lengths[1])
        oldest, freshest = _walk_live_rollout(r, t, columns, length_bounds, totals, buckets, extent)
        rollout = t - oldest
        in_flight = min(max(completion[r] - oldest, 0), rollout)
        in_queue = rollout - in_flight
        newest = t - freshest
        if newest < 0:  # (a sampled span, or the dispatch of a rollout without any)
            raise ValueError("population: a version above the trained version")
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
        rollout_histogram[folded] += 1
        rollout_top = max(rollout_top, folded)
    histogram, above, dot = _staleness_counts(t, rollout_in, columns, extent)
    totals[_DOT] = dot
    if len(histogram):  # (no quantile without sampled positions)
        _nearest_ranks(histogram, above, quantiles, totals[_TOTALS:])
    else:
        totals = totals[:_TOTALS]
    return totals, lengths, histogram, rollout_histogram[: rollout_top + 1].copy(), above


def population_summary(
    trained_version: int,
    rollout_in: BoolArray,
    columns: PopulationColumns,
    length_bounds: IntArray,
    top: int,
    quantiles: IntArray,
) -> PopulationSummary:
    """What a ship reports of the rollouts selected by ``rollout_in``, in one pass over their spans
    (frozen rollouts only counted, dropped samples left out; see :class:`PopulationSummary`). A
    sample's length bucket is the first of ``length_bounds`` at or above its sampled positions;
    ``quantiles`` rows are (numerator, denominator). ``ValueError`` on arrays of different lengths,
    offsets that do not tile them, or a version above ``trained_version``."""
    t, top = int(trained_version), int(top)
    found = _population_summary(t, rollout_in, tuple(columns), length_bounds, top, quantiles)
    totals, lengths, token_histogram, rollout_histogram, above = found
    numbers = totals.tolist()
    # the staleness at top or above, times its positions, as Python integers: exact beyond int64
    numbers[_DOT] += sum(map(operator.mul, *above.tolist()))
    arrays = (lengths[0], lengths[1], token_histogram, rollout_histogram)
    return PopulationSummary._make((*numbers[:_TOTALS], numbers[_TOTALS:], *arrays))
