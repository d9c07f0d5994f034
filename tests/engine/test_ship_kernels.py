"""The compiled passes of a ship against the numpy steps they replaced: ``judging.slice_rows`` (range
expansions, offset sums and repeats) and ``metrics.population.population_sums`` (per-span selections, segment
reductions per sample and rollout, bucket counts)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import Sink, StalenessConfig
from staleness_metrics.engine.judging import slice_rows
from staleness_metrics.engine.segments import expand_ranges, segment_max, segment_min, segment_sum
from staleness_metrics.metrics import keys
from staleness_metrics.metrics.population import PopulationColumns, population_sums

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
BOUNDS = np.array([256, 1024, 4096, 16384], dtype=np.int64)
HIGH, LOW = np.iinfo(np.int64).max // 4, np.iinfo(np.int64).min // 4


def numpy_population(t: int, rollout_in: BoolArray, a: dict[str, Any]) -> dict[str, Any]:
    """The numpy steps the pass replaced."""
    sample_rollout = np.repeat(np.arange(len(a["frozen"])), np.diff(a["sample_offsets"]))
    span_sample = np.repeat(np.arange(len(a["dropped"])), np.diff(a["span_offsets"]))
    live = rollout_in & ~a["frozen"]
    sample_in = live[sample_rollout] & ~a["dropped"]
    span_in = sample_in[span_sample]
    sampled = np.where(span_in, a["sampled"], 0)
    masked = np.where(a["version"] < a["mask_below"][span_sample], sampled, 0)
    masked_per_sample = segment_sum(masked, a["span_offsets"])
    has = span_in & (a["sampled"] > 0)
    oldest = segment_min(segment_min(np.where(has, a["version"], HIGH), a["span_offsets"], HIGH),
                         a["sample_offsets"], HIGH)  # fmt: skip
    oldest = np.where(oldest == HIGH, a["dispatch"], oldest)
    newest = segment_max(segment_max(np.where(has, a["version"], LOW), a["span_offsets"], LOW),
                         a["sample_offsets"], LOW)  # fmt: skip
    newest = np.where(newest == LOW, a["dispatch"], newest)
    rollout = t - oldest
    lengths = np.where(sample_in, a["n_sampled"], 0)
    inside = lengths > 0
    buckets = np.searchsorted(BOUNDS, lengths[inside], "left")
    staleness = t - a["version"][has]
    return {
        "tokens": int(sampled.sum()),
        "masked": int(masked.sum()),
        "unlabelled": int(np.where(a["labelled"], 0, sampled).sum()),
        "frozen": int((rollout_in & a["frozen"]).sum()),
        "samples": int(sample_in.sum()),
        "token_dot": sum(s * w for s, w in zip(staleness.tolist(), a["sampled"][has].tolist())),
        "by_staleness": {int(v): int(a["sampled"][has][staleness == v].sum()) for v in np.unique(staleness)},
        "rollout": rollout[live].tolist(),
        "in_flight": np.minimum(np.maximum(a["completion"] - oldest, 0), rollout)[live].tolist(),
        "newest": (t - newest)[live].tolist(),
        "length_sampled": np.bincount(buckets, weights=lengths[inside], minlength=5).astype(np.int64).tolist(),
        "length_removed": np.bincount(buckets, weights=masked_per_sample[inside], minlength=5)
        .astype(np.int64).tolist(),
    }  # fmt: skip


def random_slice(seed: int, rollouts: int, spread: int) -> tuple[int, BoolArray, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    per_rollout = rng.integers(0, 4, rollouts)
    samples = int(per_rollout.sum())
    per_sample = rng.integers(0, 5, samples)
    spans = int(per_sample.sum())
    t = int(rng.integers(0, 2 * spread + 1)) + spread
    a = {
        "frozen": rng.random(rollouts) < 0.2,
        "dispatch": rng.integers(0, t + 1, rollouts),
        "completion": rng.integers(-2, t + 3, rollouts),
        "sample_offsets": np.concatenate(([0], np.cumsum(per_rollout))).astype(np.int64),
        "dropped": rng.random(samples) < 0.2,
        "mask_below": rng.integers(-1, t + 2, samples),
        "n_sampled": rng.integers(0, 20000, samples) * (rng.random(samples) < 0.8),
        "span_offsets": np.concatenate(([0], np.cumsum(per_sample))).astype(np.int64),
        "version": rng.integers(t - spread, t + 1, spans),
        "sampled": rng.integers(0, 40, spans) * (rng.random(spans) < 0.7),
        "labelled": rng.random(spans) < 0.7,
    }
    return t, rng.random(rollouts) < 0.8, a


def columns(a: dict[str, Any]) -> PopulationColumns:
    """The slice's columns a population pass reads."""
    return PopulationColumns(**{name: a[name] for name in PopulationColumns._fields})


def compare(t: int, rollout_in: BoolArray, a: dict[str, Any], direct_range: int = 4096) -> None:
    got = population_sums(t, rollout_in, columns(a), BOUNDS, direct_range)
    want = numpy_population(t, rollout_in, a)
    assert (got.tokens, got.masked, got.unlabelled, got.frozen, got.samples) == (
        want["tokens"], want["masked"], want["unlabelled"], want["frozen"], want["samples"],
    )  # fmt: skip
    assert got.token_dot is None or got.token_dot == want["token_dot"]
    if want["by_staleness"] and max(want["by_staleness"]) - min(want["by_staleness"]) < direct_range:
        assert got.counts is not None and got.low == min(want["by_staleness"])
        counted = {got.low + i: int(c) for i, c in enumerate(got.counts.tolist()) if c}
        assert counted == {v: c for v, c in want["by_staleness"].items() if c}
    else:
        assert got.counts is None
    assert got.rollout.tolist() == want["rollout"]
    assert got.in_flight.tolist() == want["in_flight"]
    assert got.newest.tolist() == want["newest"]
    assert got.length_sampled.tolist() == want["length_sampled"]
    assert got.length_removed.tolist() == want["length_removed"]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rollouts=st.integers(0, 12), spread=st.sampled_from([0, 3, 5000]))
def test_population_sums_equal_the_numpy_steps(seed: int, rollouts: int, spread: int) -> None:
    t, rollout_in, a = random_slice(seed, rollouts, spread)
    compare(t, rollout_in, a)
    compare(t, np.ones(rollouts, dtype=bool), a, direct_range=2)  # too wide a range: counted in numpy


def test_a_dot_product_beyond_int64_is_left_to_python_integers() -> None:
    t, _, a = random_slice(7, 6, 3)
    a["version"] = a["version"] - (1 << 61)  # staleness near 2**61: a few tokens overflow int64
    got = population_sums(t, np.ones(6, dtype=bool), columns(a), BOUNDS, 4096)
    assert got.tokens > 4 and got.token_dot is None


def test_offsets_that_do_not_tile_the_arrays_are_refused() -> None:
    t, rollout_in, a = random_slice(3, 5, 3)
    a["span_offsets"] = a["span_offsets"].copy()
    a["span_offsets"][-1] += 1
    with pytest.raises(ValueError, match="offsets"):
        compare(t, rollout_in, a)


def test_a_ship_of_far_apart_versions_reports_exact_quantiles_and_mean() -> None:
    """Staleness 0 and 6,000 in one ship: wider than counting by value allows, so numpy sorts them."""
    sink = Sink(StalenessConfig(max_staleness=10_000))
    sink.add([
        {"id": "old", "dispatch_version": 0, "samples": [{"mask": [0, 1, 1, 1], "token_versions": [0, 0, 0, 0]}]},
        {"id": "new", "dispatch_version": 6000, "samples": [{"mask": [1], "token_versions": [6000]}]},
    ])  # fmt: skip
    metrics = sink.ship(6001).report.metrics
    assert metrics[keys.TOKEN_MEAN] == (3 * 6000 + 0) / 4
    assert (metrics[keys.TOKEN_P50], metrics[keys.TOKEN_P90]) == (6000, 6000)
    assert metrics[keys.ROLLOUT_MAX] == 6000 and metrics[keys.ROLLOUT_MEAN] == 3000


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rollouts=st.integers(0, 12), taken=st.integers(0, 12))
def test_slice_rows_equal_the_range_expansions(seed: int, rollouts: int, taken: int) -> None:
    rng = np.random.default_rng(seed)
    per_rollout = rng.integers(0, 4, rollouts)
    sample_hi = np.cumsum(per_rollout).astype(np.int64)
    sample_lo = sample_hi - per_rollout
    per_sample = rng.integers(0, 5, int(per_rollout.sum()))
    span_hi = np.cumsum(per_sample).astype(np.int64)
    span_lo = span_hi - per_sample
    rows = rng.permutation(rollouts)[: min(taken, rollouts)].astype(np.int64)
    got = slice_rows(rows, sample_lo, sample_hi, span_lo, span_hi)
    sample_rows = expand_ranges(sample_lo[rows], sample_hi[rows])
    sample_counts = sample_hi[rows] - sample_lo[rows]
    span_counts = span_hi[sample_rows] - span_lo[sample_rows]
    assert got.sample_rows.tolist() == sample_rows.tolist()
    assert got.sample_offsets.tolist() == [0, *np.cumsum(sample_counts).tolist()]
    assert got.sample_rollout.tolist() == np.repeat(np.arange(len(rows)), sample_counts).tolist()
    assert got.span_rows.tolist() == expand_ranges(span_lo[sample_rows], span_hi[sample_rows]).tolist()
    assert got.span_offsets.tolist() == [0, *np.cumsum(span_counts).tolist()]
    assert got.span_sample.tolist() == np.repeat(np.arange(len(sample_rows)), span_counts).tolist()


def test_slice_rows_refuse_a_row_outside_the_table() -> None:
    lo, hi = np.array([0, 1], dtype=np.int64), np.array([1, 2], dtype=np.int64)
    with pytest.raises(IndexError, match="outside"):
        slice_rows(np.array([2], dtype=np.int64), lo, hi, lo, hi)
    with pytest.raises(IndexError, match="outside"):
        slice_rows(np.array([0], dtype=np.int64), lo, np.array([3, 2], dtype=np.int64), lo, hi)
