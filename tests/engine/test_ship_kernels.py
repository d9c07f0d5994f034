"""The compiled passes of a ship against the numpy steps they replaced: ``judging.slice_rows`` (range
expansions, offset sums and repeats); the population pass's are in ``tests/metrics/test_population_summary.py``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import Sink, StalenessConfig
from staleness_metrics.engine.judging import slice_rows
from staleness_metrics.engine.segments import expand_ranges
from staleness_metrics.metrics import keys


def test_a_ship_of_far_apart_versions_reports_exact_quantiles_and_mean() -> None:
    """Staleness 0 and 6,000 in one ship: beyond the histogram's top, so the pass sorts the values above it."""
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
