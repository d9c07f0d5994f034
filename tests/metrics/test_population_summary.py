"""A ship's population in one compiled pass (``compute.population_summary``) against the numpy steps it
replaced, on random slices: every sum, extreme, quantile and histogram equal, at every range of staleness."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.engine.segments import segment_max, segment_sum
from staleness_metrics.metrics.compute import PopulationColumns, population_summary
from tests.support.cuts import segment_min

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
BOUNDS = np.array([256, 1024, 4096, 16384], dtype=np.int64)
HIGH, LOW = np.iinfo(np.int64).max // 4, np.iinfo(np.int64).min // 4
QUANTILES = np.array([[50, 100], [90, 100], [99, 100], [1, 3]], dtype=np.int64)


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


def assert_summary_equals_the_numpy_steps(t: int, rollout_in: BoolArray, a: dict[str, Any], top: int) -> None:
    got = population_summary(t, np.flatnonzero(rollout_in), columns(a), BOUNDS, top, QUANTILES)
    want = numpy_population(t, rollout_in, a)
    assert [got.tokens, got.masked, got.unlabelled, got.frozen, got.samples] == [
        want[name] for name in ("tokens", "masked", "unlabelled", "frozen", "samples")
    ]
    assert got.token_dot == want["token_dot"]
    rollout, in_flight, newest = (np.array(want[k], dtype=np.int64) for k in ("rollout", "in_flight", "newest"))
    in_queue = rollout - in_flight
    assert got.live == len(rollout)
    for total, most, values in (
        (got.rollout_sum, got.rollout_max, rollout),
        (got.in_flight_sum, got.in_flight_max, in_flight),
        (got.in_queue_sum, got.in_queue_max, in_queue),
        (got.newest_sum, got.newest_max, newest),
    ):
        assert total == int(values.sum())
        assert not len(values) or most == int(values.max())
    values = sorted(v for v, c in want["by_staleness"].items() for _ in range(c))
    assert len(got.quantiles) == (len(QUANTILES) if values else 0)
    for q, (numerator, denominator) in enumerate(QUANTILES.tolist()):
        if values:
            rank = max(1, -(-numerator * len(values) // denominator))
            assert got.quantiles[q] == values[rank - 1]
    token_histogram = np.zeros(min(max(values), top) + 1 if values else 0, dtype=np.int64)
    for v in values:
        token_histogram[min(v, top)] += 1
    assert got.token_histogram.tolist() == token_histogram.tolist()
    rollout_histogram = np.zeros(min(int(rollout.max()), top) + 1 if len(rollout) else 0, dtype=np.int64)
    np.add.at(rollout_histogram, np.minimum(rollout, top), 1)
    assert got.rollout_histogram.tolist() == rollout_histogram.tolist()
    # what the last index holds, exactly (Python integers): the staleness beyond it summed, the lowest, the highest
    for got_top, folded in (
        (got.token_top, [v for v in values if v >= top]),
        (got.rollout_top, [int(v) for v in rollout if v >= top]),
    ):
        assert got_top == ((sum(folded) - top * len(folded), min(folded), max(folded)) if folded else (0, 0, 0))
    assert got.length_sampled.tolist() == want["length_sampled"]
    assert got.length_removed.tolist() == want["length_removed"]


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rollouts=st.integers(0, 12),
    spread=st.sampled_from([0, 3, 5000]),
    top=st.sampled_from([2, 64, 4096]),
)
def test_the_summary_equals_the_numpy_steps(seed: int, rollouts: int, spread: int, top: int) -> None:
    """Staleness within a few versions, and 5,000 apart: values above ``top`` folded in the histograms and
    exact in the quantiles and the mean."""
    t, rollout_in, a = random_slice(seed, rollouts, spread)
    a["version"] = np.minimum(a["version"], t)  # a ship's versions: none above the trained one
    a["dispatch"] = np.minimum(a["dispatch"], t)
    assert_summary_equals_the_numpy_steps(t, rollout_in, a, top)
    assert_summary_equals_the_numpy_steps(t, np.ones(rollouts, dtype=bool), a, top)


def test_a_dot_product_beyond_int64_is_exact() -> None:
    t, _, a = random_slice(7, 6, 3)
    a["version"] = np.minimum(a["version"], t) - (1 << 61)  # staleness near 2**61: a few tokens overflow int64
    a["dispatch"] = np.minimum(a["dispatch"], t)
    got = population_summary(t, np.arange(6), columns(a), BOUNDS, 4096, QUANTILES)
    assert got.tokens > 4 and got.token_dot > 2**63
    assert_summary_equals_the_numpy_steps(t, np.ones(6, dtype=bool), a, 4096)


def test_a_staleness_below_zero_is_refused() -> None:
    t, _, a = random_slice(5, 6, 3)
    a["frozen"] = np.zeros(6, dtype=bool)
    above = dict(a, dispatch=a["dispatch"] + 2 * t + 10, sampled=np.zeros_like(a["sampled"]))  # no sampled span
    with pytest.raises(ValueError, match="above the trained version"):
        population_summary(t, np.arange(6), columns(above), BOUNDS, 4096, QUANTILES)
    a["version"] = a["version"] + 1  # the newest sampled spans one version above the trained one
    a["sampled"] = a["sampled"] + 1
    with pytest.raises(ValueError, match="above the trained version"):
        population_summary(t, np.arange(6), columns(a), BOUNDS, 4096, QUANTILES)


def test_offsets_that_do_not_tile_the_arrays_are_refused() -> None:
    t, rollout_in, a = random_slice(3, 5, 3)
    a["span_offsets"] = a["span_offsets"].copy()
    a["span_offsets"][-1] += 1
    with pytest.raises(ValueError, match="offsets"):
        population_summary(t, np.flatnonzero(rollout_in), columns(a), BOUNDS, 4096, QUANTILES)
