"""The compiled loops against the numpy formulations they replaced, on hand-made and random inputs."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.engine import cuts, judging, shipment
from staleness_metrics.engine.cuts import (
    WEIGHT_NAN,
    WEIGHT_NONFINITE,
    WEIGHT_NONZERO,
    WEIGHT_NOT_POSITIVE,
    CutFlags,
    SampleLabels,
    sample_cuts,
)
from staleness_metrics.engine.judging import zero_spans
from staleness_metrics.engine.segments import expand_ranges, segment_max, segment_sum
from staleness_metrics.engine.spans import SampleSpans, SpanRanges
from staleness_metrics.engine.warm_up import warm_up
from staleness_metrics.records import validation as plain
from tests.support.cuts import segment_min, token_spans

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


# The loops' arguments spelt out one by one, as the numpy formulations below take them.
def span_rows(
    lo: IntArray, hi: IntArray, label: IntArray, labelled: IntArray, kept: BoolArray, sampled: BoolArray,
    live_labelled: BoolArray, live_unlabelled: BoolArray, side: BoolArray, pos_off: IntArray, dispatch: IntArray,
    no_version: tuple[int, int],
) -> cuts.SpanTable:  # fmt: skip
    flags = CutFlags(kept, sampled, live_labelled, live_unlabelled, side)
    return cuts.span_rows(lo, hi, label, labelled, flags, pos_off, dispatch, no_version)


def shipped_rows(
    span_lo: IntArray, span_hi: IntArray, kept_sample: BoolArray, sample_rollout: IntArray, mask_below: IntArray,
    version: IntArray, sampled: IntArray, frozen: BoolArray, rollout_chunk: IntArray, rollout_env: IntArray,
    part: npt.NDArray[np.int8], table_lo: IntArray, table_hi: IntArray, trained: int, not_sampled: int,
) -> shipment.ShippedRows:  # fmt: skip
    assert not_sampled == shipment.NOT_SAMPLED
    return shipment.shipped_rows(
        SampleSpans(span_lo, span_hi, sample_rollout), SpanRanges(part, table_lo, table_hi), version, sampled,
        (kept_sample, mask_below), (frozen, rollout_chunk, rollout_env), trained,
    )  # fmt: skip


def stale_rows(
    span_lo: IntArray, span_hi: IntArray, sample_rollout: IntArray, old_below: IntArray, new_below: IntArray,
    raised: BoolArray, version: IntArray, sampled: IntArray, rollout_chunk: IntArray, part: npt.NDArray[np.int8],
    table_lo: IntArray, table_hi: IntArray,
) -> judging.StaleRows:  # fmt: skip
    return judging.stale_rows(
        SampleSpans(span_lo, span_hi, sample_rollout), SpanRanges(part, table_lo, table_hi), version, sampled,
        (old_below, new_below, raised), rollout_chunk,
    )  # fmt: skip


def plain_values(
    n_rollouts: int, sample_offsets: IntArray, position_offsets: IntArray, dispatch: IntArray, completion: IntArray,
    label_kind: npt.NDArray[np.int8], labels: int, mask: npt.NDArray[Any], weights: plain.Weights,
    tokens: IntArray | None,
) -> bool:  # fmt: skip
    rows = plain.BatchRows(n_rollouts, sample_offsets, position_offsets, dispatch, completion, label_kind, labels)
    return plain.plain_values(rows, mask, weights, tokens)


def token_cuts(
    tokens: IntArray, mask: npt.NDArray[Any], pos_off: IntArray, samples: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    found = token_spans(tokens, mask, pos_off, samples)
    return found.starts, found.labels, found.labelled


def numpy_bits(values: npt.NDArray[Any], lo: IntArray, hi: IntArray) -> list[int]:
    """The ``WEIGHT_*`` bits of each span ``[lo, hi)``, from what numpy says of its values."""
    bits = []
    for a, b in zip(lo.tolist(), hi.tolist()):
        span = values[a:b].astype(np.float64)
        bits.append(
            WEIGHT_NONZERO * bool((span != 0).any()) | WEIGHT_NONFINITE * bool((~np.isfinite(span)).any())
            | WEIGHT_NAN * bool(np.isnan(span).any()) | WEIGHT_NOT_POSITIVE * bool((~(span > 0)).any())
        )  # fmt: skip
    return bits


def numpy_token_cuts(
    tokens: IntArray, pos_off: IntArray, tokened: npt.NDArray[np.bool_], changes: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """The engine's former numpy cuts: runs of equal values, then a decision per run."""
    n_positions = len(tokens)
    segment_start = np.zeros(n_positions, dtype=bool)
    segment_start[changes] = True
    segment_start[pos_off[:-1][pos_off[:-1] < n_positions]] = True
    boundary = np.empty(n_positions, dtype=bool)
    boundary[0] = True
    np.not_equal(tokens[1:], tokens[:-1], out=boundary[1:])
    boundary |= segment_start
    starts = np.flatnonzero(boundary)
    run_sample = np.searchsorted(pos_off, starts, "right") - 1
    chosen = tokened[run_sample]
    starts, run_sample = starts[chosen], run_sample[chosen]
    ends = np.minimum(np.append(starts[1:], n_positions), pos_off[run_sample + 1])
    label = tokens[starts]
    new_segment = segment_start[starts]
    is_labelled = label >= 0
    before = np.full(len(starts), -2)
    before[1:] = label[:-1]
    two_back = np.full(len(starts), -2)
    two_back[2:] = label[:-2]
    unlabelled_run_began_segment = np.zeros(len(starts), dtype=bool)
    unlabelled_run_began_segment[1:] = new_segment[:-1]
    new_label = (before >= 0) | (~unlabelled_run_began_segment & (two_back != label))
    new_cut = new_segment | (is_labelled & new_label)
    first = np.flatnonzero(new_cut)
    labelled = segment_sum(np.where(is_labelled, ends - starts, 0), np.append(first, len(starts)))
    return starts[first], np.maximum.reduceat(label, first) if len(first) else label, labelled


def mask_changes(mask: npt.NDArray[Any]) -> IntArray:
    return (np.flatnonzero(mask[1:] != mask[:-1]) + 1).astype(np.int64)


def test_unlabelled_positions_stay_in_the_cut_of_the_label_around_them() -> None:
    tokens = np.array([5, -1, 5, -1, 6, -1, -1, 7], dtype=np.int64)
    pos_off = np.array([0, 8], dtype=np.int64)
    starts, labels, labelled = token_cuts(tokens, np.ones(8, dtype=np.float32), pos_off, np.array([0]))
    assert starts.tolist() == [0, 4, 7]
    assert labels.tolist() == [5, 6, 7]
    assert labelled.tolist() == [2, 1, 1]


def test_a_mask_change_cuts_and_leading_unlabelled_positions_join_the_next_label() -> None:
    tokens = np.array([5, 5, -1, 5, 6, -1, -1, -1], dtype=np.int64)
    mask = np.array([0, 0, 1, 1, 1, 1, 1, 1], dtype=np.float32)
    pos_off = np.array([0, 5, 8], dtype=np.int64)
    starts, labels, labelled = token_cuts(tokens, mask, pos_off, np.array([0, 1]))
    # sample 0: [0, 2) label 5 mask 0; [2, 4) a -1 then 5; [4, 5) label 6. Sample 1: only -1 positions.
    assert starts.tolist() == [0, 2, 4, 5]
    assert labels.tolist() == [5, 5, 6, -1]
    assert labelled.tolist() == [2, 1, 1, 0]


@st.composite
def labelled_samples(draw: st.DrawFn) -> tuple[IntArray, IntArray, npt.NDArray[np.bool_], npt.NDArray[np.float32]]:
    # Lengths past the loop's 32-position blocks, so blocks with and without a cut both occur.
    lengths = draw(st.lists(st.integers(0, 80), min_size=1, max_size=8))
    total = sum(lengths)
    tokens = np.array(draw(st.lists(st.integers(-1, 3), min_size=total, max_size=total)), dtype=np.int64)
    if draw(st.booleans()):  # long runs of one label, as real labels come
        tokens = np.where(tokens < 0, tokens, np.maximum.accumulate(np.maximum(tokens, 0)))
    values = st.sampled_from([0.0, 1.0, 1.0, 1.0, 0.5, float("nan"), -0.0])  # invalid values must cut as numpy's !=
    dtype = draw(st.sampled_from([np.float32, np.float64, np.float16]))
    mask = np.array(draw(st.lists(values, min_size=total, max_size=total)), dtype=dtype)
    tokened = np.array(draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths))))
    pos_off = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    tokened &= np.diff(pos_off) > 0  # the engine passes non-empty samples only
    return tokens, pos_off, tokened, mask


@settings(max_examples=400, deadline=None)
@given(labelled_samples())
def test_token_cuts_equal_the_numpy_runs(case: tuple[IntArray, IntArray, npt.NDArray[np.bool_], Any]) -> None:
    tokens, pos_off, tokened, mask = case
    if len(tokens) == 0 or not tokened.any():
        return
    got = token_cuts(tokens, mask, pos_off, np.flatnonzero(tokened))
    want = numpy_token_cuts(tokens, pos_off, tokened, mask_changes(mask))
    for g, w in zip(got, want):
        assert g.tolist() == w.tolist()


def test_token_cuts_in_parallel_shares_equal_one_pass() -> None:
    """Past PARALLEL_MIN_POSITIONS the samples are cut in shares on threads: the same cuts, in order."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 3000, size=1500)
    pos_off = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    total = int(pos_off[-1])
    tokens = np.minimum(rng.integers(0, 4, size=total), 3).astype(np.int64)
    tokens = np.where(rng.random(total) < 0.3, -1, np.sort(tokens))
    mask = (rng.random(total) < 0.999).astype(np.float32)
    tokened = (lengths > 0) & (rng.random(len(lengths)) < 0.9)
    got = token_cuts(tokens, mask, pos_off, np.flatnonzero(tokened))
    want = numpy_token_cuts(tokens, pos_off, tokened, mask_changes(mask))
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


@settings(max_examples=300, deadline=None)
@given(
    labelled_samples(),
    st.lists(st.sampled_from([0.0, -0.0, 1.0, 0.5, -2.0, float("inf"), float("nan")]), min_size=1, max_size=7),
    st.integers(1, 3),
    st.sampled_from([np.float16, np.float32, np.float64]),
    st.integers(-4, -2),
)
def test_token_spans_read_each_cut_s_weight_bits_as_numpy_says(
    case: tuple[IntArray, IntArray, npt.NDArray[np.bool_], Any],
    pattern: list[float],
    n_weights: int,
    dtype: Any,
    wild_label: int,
) -> None:
    """The cuts of the fused pass are token_cuts'; its bits per cut are numpy's over [start, next start);
    it counts the labels below -1 of the samples it cuts (and only those)."""
    tokens, pos_off, tokened, mask = case
    if len(tokens) == 0 or not tokened.any():
        return
    weights = [np.resize(np.asarray(pattern[k:] + pattern[:k], dtype=dtype), len(tokens)) for k in range(n_weights)]
    samples = np.flatnonzero(tokened)
    found = token_spans(tokens, mask, pos_off, samples, weights)
    cuts = token_cuts(tokens, mask, pos_off, samples)
    for got, want in zip((found.starts, found.labels, found.labelled), cuts):
        assert got.tolist() == want.tolist()
    # A cut ends where the next begins, or where its sample ends.
    sample_end = pos_off[np.searchsorted(pos_off, found.starts, "right")]
    ends = np.minimum(np.append(found.starts[1:], len(tokens)), sample_end)
    assert found.flags.shape == (n_weights, len(found.starts))
    assert found.ends.tolist() == ends.tolist()
    for values, bits in zip(weights, found.flags):
        assert bits.tolist() == numpy_bits(values, found.starts, ends)
    assert found.below == 0
    wild = tokens.copy()
    wild[pos_off[samples[-1]]] = wild_label  # the first position of the last sample cut
    assert token_spans(wild, mask, pos_off, samples, weights).below == 1
    outside = np.flatnonzero(~np.isin(np.searchsorted(pos_off, np.arange(len(tokens)), "right") - 1, samples))
    if len(outside):
        wild = tokens.copy()
        wild[outside] = wild_label
        assert token_spans(wild, mask, pos_off, samples, weights).below == 0


def test_token_spans_in_parallel_shares_equal_one_pass() -> None:
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 3000, size=1500)
    pos_off = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    total = int(pos_off[-1])
    tokens = np.where(rng.random(total) < 0.3, -1, np.sort(rng.integers(0, 4, size=total))).astype(np.int64)
    tokens[rng.integers(0, total, size=3)] = -7
    mask = (rng.random(total) < 0.999).astype(np.float32)
    weights = [np.where(rng.random(total) < 0.01, 0.0, rng.random(total)).astype(np.float32) for _ in range(3)]
    weights[1][rng.integers(0, total, size=5)] = np.nan
    samples = np.flatnonzero((lengths > 0) & (rng.random(len(lengths)) < 0.9))
    found = token_spans(tokens, mask, pos_off, samples, weights)  # shares on threads
    one = [token_spans(tokens, mask, pos_off, samples[k : k + 1], weights) for k in range(len(samples))]
    assert np.array_equal(found.starts, np.concatenate([p.starts for p in one]))
    assert np.array_equal(found.flags, np.concatenate([p.flags for p in one], axis=1))
    assert found.below == sum(p.below for p in one)


def test_token_spans_with_more_cuts_than_their_first_room_equal_the_numpy_runs() -> None:
    """The outputs start with room for a few cuts per sample and grow: samples that cut at almost every
    position (alternating labels and mask) make them grow many times, between samples and within one."""
    rng = np.random.default_rng(5)
    lengths = np.concatenate((rng.integers(1, 40, size=300), [5000], rng.integers(1, 40, size=300)))
    pos_off = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    total = int(pos_off[-1])
    tokens = np.where(rng.random(total) < 0.2, -1, rng.integers(0, 3, size=total)).astype(np.int64)
    mask = (rng.random(total) < 0.7).astype(np.float32)
    weights = [np.where(rng.random(total) < 0.3, 0.0, rng.random(total)).astype(np.float32) for _ in range(2)]
    tokened = rng.random(len(lengths)) < 0.95
    samples = np.flatnonzero(tokened)
    found = token_spans(tokens, mask, pos_off, samples, weights)
    want = numpy_token_cuts(tokens, pos_off, tokened, mask_changes(mask))
    assert len(found.starts) > 8 * len(samples)  # past the first room several times over
    for got, expected in zip((found.starts, found.labels, found.labelled), want):
        assert got.tolist() == expected.tolist()
    sample_end = pos_off[np.searchsorted(pos_off, found.starts, "right")]
    ends = np.minimum(np.append(found.starts[1:], total), sample_end)
    for values, bits in zip(weights, found.flags):
        assert bits.tolist() == numpy_bits(values, found.starts, ends)


def test_weights_of_other_or_mixed_dtypes_give_the_bits_of_their_values() -> None:
    """Integers, booleans, a strided view and mixed float widths: the bits numpy says of the values."""
    tokens = np.array([0, 0, 1, 1, 1, 2, 2, 2], dtype=np.int64)
    mask = np.ones(8, dtype=np.float32)
    pos_off, samples = np.array([0, 8]), np.array([0])
    weights: list[npt.NDArray[Any]] = [
        np.array([0, 0, 3, -1, 0, 0, 0, 7], dtype=np.int64),
        np.array([1.0, 0.5, 0.0, -0.0, 0.0, np.inf, 1e-40, 1.0], dtype=np.float64)[::-1][::1],
        np.array([1, 1, 0, 0, 0, 1, 1, 1] * 2, dtype=np.float16)[::2],
    ]
    choices: list[list[npt.NDArray[Any]]] = [[weights[0]], [weights[2], weights[1]], weights, [np.arange(8) % 2 == 0]]
    for chosen in choices:
        found = token_spans(tokens, mask, pos_off, samples, chosen)
        for values, bits in zip(chosen, found.flags):
            assert bits.tolist() == numpy_bits(values, found.starts, found.ends)
    with pytest.raises(ValueError, match="at most three"):
        token_spans(tokens, mask, pos_off, samples, weights * 2)


def test_token_cuts_refuse_damaged_offsets_instead_of_writing_out_of_bounds() -> None:
    tokens = np.array([1, 1, 2, 2], dtype=np.int64)
    mask = np.ones(4, dtype=np.float32)
    with pytest.raises(ValueError, match="beyond the arrays"):
        token_cuts(tokens, mask, np.array([0, 2, 9], dtype=np.int64), np.array([0, 1]))
    with pytest.raises(ValueError, match="out of order"):
        token_cuts(tokens, mask, np.array([0, 3, 2, 4], dtype=np.int64), np.array([0, 1, 2]))
    with pytest.raises(IndexError, match="sample index"):
        token_cuts(tokens, mask, np.array([0, 4], dtype=np.int64), np.array([0, 1]))
    with pytest.raises(ValueError, match="differ in length"):
        token_cuts(tokens, mask[:3], np.array([0, 3], dtype=np.int64), np.array([0]))


def test_span_cuts_refuse_span_starts_out_of_order_or_past_their_sample() -> None:
    mask = np.ones(6, dtype=np.float32)
    pos_off, samples = np.array([0, 3, 6]), np.array([0, 1])

    def cut(starts: list[int], offsets: list[int]) -> Any:
        labels = SampleLabels(np.array([1, 1], dtype=np.int8), np.zeros(0, dtype=np.int64), np.array(offsets),
                              np.array(starts), np.zeros(len(starts), dtype=np.int64))  # fmt: skip
        return sample_cuts(labels, mask, pos_off, samples)

    assert cut([0, 2, 1], [0, 2, 3]).starts.tolist() == [0, 2, 3, 4]  # (starts count from their sample)
    for starts in ([0, 2, 2], [1, 0, 2], [0, 1, 3], [-1, 0, 1]):  # all three in the first sample
        with pytest.raises(ValueError, match="span starts"):
            cut(starts, [0, 3, 3])
    with pytest.raises(ValueError, match="span offsets"):
        cut([0, 1, 2], [0, 2, 4])


def numpy_zero_spans(
    arrays: list[npt.NDArray[Any]], tokens: IntArray, lo: IntArray, hi: IntArray, part: npt.NDArray[np.int8]
) -> None:
    positions = expand_ranges(lo, hi)
    row_part = np.repeat(part, hi - lo)
    hit = (row_part == 0) | ((row_part == 2) == (tokens[positions] < 0))
    for values in arrays:
        values[positions[hit]] = 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-1, 2), min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 39), st.integers(0, 8), st.sampled_from([0, 1, 2])), max_size=6),
    st.sampled_from([np.float16, np.float32, np.float64]),
    st.booleans(),
)
def test_zero_spans_equals_a_masked_numpy_write(
    values: list[int], rows: list[tuple[int, int, int]], dtype: Any, few: bool
) -> None:
    """Whatever ``count`` says (it only chooses between a branch and a select), the writes are the same."""
    tokens = np.array(values, dtype=np.int64)
    n = len(tokens)
    lo = np.array([min(a, n) for a, _, _ in rows], dtype=np.int64)
    hi = np.minimum(lo + np.array([w for _, w, _ in rows], dtype=np.int64), n)
    part = np.array([p for _, _, p in rows], dtype=np.int8)
    rng = np.random.default_rng(len(rows))
    arrays = [rng.random(n).astype(dtype) + 1 for _ in range(3)]
    expected = [a.copy() for a in arrays]
    count = np.zeros(len(lo), dtype=np.int64) if few else hi - lo
    zero_spans(arrays, tokens, lo, hi, part, count)
    numpy_zero_spans(expected, tokens, lo, hi, part)
    for got, want in zip(arrays, expected):
        assert got.tobytes() == want.tobytes()


def test_zero_spans_writes_positive_zero_and_leaves_the_rest() -> None:
    mask = np.array([1.0, 1.0, -0.0, 1.0, 1.0, 1.0], dtype=np.float64)
    weights = np.array([0.5, 0.25, 2.0, 3.0, 4.0, 5.0], dtype=np.float32)
    tokens = np.array([3, -1, 3, -1, 4, 4], dtype=np.int64)
    # rows: the whole of [0, 3); the unlabelled positions of [3, 5); the labelled ones of [5, 6)
    counts = np.array([3, 1, 1])
    zero_spans(
        [mask, weights], tokens, np.array([0, 3, 5]), np.array([3, 5, 6]), np.array([0, 2, 1], dtype=np.int8), counts
    )
    assert mask.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert not np.signbit(mask).any()  # -0.0 written as +0.0, as numpy's ``values[...] = 0`` does
    assert weights.tolist() == [0.0, 0.0, 0.0, 0.0, 4.0, 0.0]


def test_zero_spans_without_token_labels_fills_whole_spans() -> None:
    mask = np.ones(10, dtype=np.float32)
    zero_spans([mask], None, np.array([2, 7]), np.array([4, 9]), np.zeros(2, dtype=np.int8), np.array([2, 2]))
    assert mask.tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 0, 1]


def test_the_part_numbers_the_loop_reads_are_the_span_table_s() -> None:
    from staleness_metrics.engine.spans import PART_LABELLED, PART_UNLABELLED, PART_WHOLE

    assert (PART_WHOLE, PART_LABELLED, PART_UNLABELLED) == (0, 1, 2)


def test_zero_spans_refuse_a_span_outside_the_arrays() -> None:
    """A damaged checkpoint once crashed the process through a kernel writing out of bounds."""
    values = np.ones(4, dtype=np.float32)
    lo, hi = np.array([2], dtype=np.int64), np.array([9], dtype=np.int64)
    with pytest.raises(IndexError, match="outside the arrays"):
        zero_spans([values], None, lo, hi, np.zeros(1, dtype=np.int8), np.array([7]))
    with pytest.raises(IndexError, match="outside the arrays"):
        zero_spans([values], None, np.array([-3]), np.array([1]), np.zeros(1, dtype=np.int8), np.array([4]))
    with pytest.raises(IndexError, match="outside the arrays"):  # a part reads the labels: they must be long enough
        zero_spans([values], np.zeros(2, dtype=np.int64), np.array([0]), np.array([4]), np.ones(1, dtype=np.int8),
                   np.array([4]))  # fmt: skip
    with pytest.raises(ValueError, match="differ in length"):
        zero_spans([values, np.ones(3, dtype=np.float32)], None, np.array([0]), np.array([1]),
                   np.zeros(1, dtype=np.int8), np.array([1]))  # fmt: skip
    assert values.tolist() == [1.0] * 4  # nothing was written before the refusal


SPECIAL_WEIGHTS = [0.0, -0.0, 1.0, 0.5, -2.0, 1e-40, -1e-310, float("inf"), float("-inf"), float("nan"), 3e38]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(SPECIAL_WEIGHTS) | st.floats(allow_nan=True), min_size=1, max_size=90),
    st.lists(st.integers(1, 89), max_size=8),
    st.sampled_from([np.float16, np.float32, np.float64]),
    st.booleans(),
)
def test_span_bits_say_what_the_values_are(
    values: list[float], cuts: list[int], dtype: Any, negative_nan: bool
) -> None:
    """The compiled bits per cut say what numpy says of the cut's values, for every kind of value (cuts
    of one unlabelled sample per span here)."""
    with np.errstate(over="ignore"):
        array = np.array(values, dtype=dtype)
    if negative_nan:  # NaN with the sign bit set: still a NaN
        array[np.isnan(array)] = -np.abs(array[np.isnan(array)])
    lo = np.unique(np.concatenate(([0], [c for c in cuts if c < len(array)]))).astype(np.int64)
    hi = np.append(lo[1:], len(array)).astype(np.int64)
    none = np.zeros(0, dtype=np.int64)
    labels = SampleLabels(np.zeros(len(lo), dtype=np.int8), none, none, none, none)
    found = sample_cuts(labels, np.ones(len(array)), np.append(lo, len(array)), np.arange(len(lo)), [array])
    assert found.starts.tolist() == lo.tolist() and found.ends.tolist() == hi.tolist()
    assert found.flags[0].tolist() == numpy_bits(array, lo, hi)


Rows = tuple[int, IntArray, IntArray, IntArray, IntArray, npt.NDArray[np.int8], int]


def one_sample(n: int, tokens: bool) -> Rows:
    """The rollout and sample arguments of ``plain_values`` for one rollout of one sample of ``n`` positions
    (labelled by token versions when ``tokens``)."""
    kind = np.array([2 if tokens else 0], dtype=np.int8)
    return 1, np.array([0, 1]), np.array([0, n]), np.array([0]), np.array([-1]), kind, 0b101


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64]),
    mask=st.lists(st.sampled_from([0.0, 1.0, 1.0, 0.5, -0.0, float("nan")]), min_size=0, max_size=40),
    weights=st.lists(st.sampled_from([0.0, 2.5, -1.0, float("inf"), float("-inf"), float("nan")]), max_size=40),
    tokens=st.lists(st.integers(-3, 4), max_size=40),
    given_arrays=st.tuples(*[st.booleans()] * 4),  # rl, ce, ref-KL, token versions (log-probs: never read)
)
def test_plain_values_equals_the_numpy_checks(
    dtype: Any,
    mask: list[float],
    weights: list[float],
    tokens: list[int],
    given_arrays: tuple[bool, ...],
) -> None:
    warm_up()
    mask_array = np.asarray(mask, dtype=dtype)
    n = len(mask)
    floats = [
        np.resize(np.asarray(weights[k:] or [1.0], dtype=dtype), n) if given_arrays[k] else None for k in range(3)
    ]
    token_array = np.resize(np.asarray(tokens or [0], dtype=np.int64), n) if given_arrays[3] else None
    expected = (
        bool(np.all((mask_array == 0) | (mask_array == 1)))
        and all(bool(np.isfinite(a).all()) for a in floats if a is not None)
        and (token_array is None or bool((token_array >= -1).all()))
    )
    rows = one_sample(n, given_arrays[3])
    assert plain_values(*rows, mask_array, (floats[0], floats[1], floats[2]), token_array) is expected


def test_plain_values_is_not_sure_of_other_types() -> None:
    """Other dtypes are "not sure" (False): the exact checks say what they hold."""
    ints = np.array([0, 1], dtype=np.int64)
    floats = np.array([0.0, 1.0])
    rows = one_sample(2, False)
    assert plain_values(*rows, ints, (None, None, None), None) is False
    assert plain_values(*rows, floats.astype(np.float16), (None, None, None), None) is False
    assert plain_values(*rows, floats, (floats.astype(np.float32), None, None), None) is False  # the mask's type
    assert plain_values(*rows, floats, (floats[::-1][::1].copy(), None, None), None) is True


def test_plain_values_reads_offsets_versions_and_label_kinds() -> None:
    warm_up()
    mask, none = np.ones(4), (None, None, None)

    def plain(**changed: Any) -> bool:
        rows = {"n_rollouts": 2, "sample_offsets": np.array([0, 1, 2]), "position_offsets": np.array([0, 2, 4]),
                "dispatch": np.array([0, 1]), "completion": np.array([-1, 3]),
                "label_kind": np.array([0, 2], dtype=np.int8), "labels": 0b101} | changed  # fmt: skip
        return plain_values(**rows, mask=mask, weights=none, tokens=np.zeros(4, dtype=np.int64))

    assert plain() is True
    assert plain(sample_offsets=np.array([0, 2, 2])) is False  # a rollout of no sample: SPEC 3 refuses it
    assert plain(sample_offsets=np.array([0, 3, 2])) is False  # back
    assert plain(sample_offsets=np.array([0, 1])) is False  # one entry short (the lengths come first)
    assert plain(position_offsets=np.array([0, 3, 2])) is False
    assert plain(position_offsets=np.array([0, 2, 5])) is False  # not the mask's length
    assert plain(dispatch=np.array([-1, 1])) is False
    assert plain(completion=np.array([-2, 3])) is False
    assert plain(completion=np.array([-1, 0])) is False  # below its dispatch
    assert plain(label_kind=np.array([0, 1], dtype=np.int8)) is False  # spans the batch does not have
    assert plain(label_kind=np.array([0, 1], dtype=np.int8), labels=0b111) is True
    assert plain(label_kind=np.array([0, 3], dtype=np.int8)) is False
    assert plain(label_kind=np.array([0, 2])) is False  # (not int8: not sure, the exact checks say)
    assert plain(dispatch=np.array([[0, 1]])) is False  # (not 1-d)


# ---------------------------------------------------------------------------------------------- span rows


NO_VERSION = (-(1 << 60), 1 << 60)


def numpy_span_rows(
    lo: IntArray,
    hi: IntArray,
    label: IntArray,
    labelled: IntArray,
    kept: npt.NDArray[np.bool_],
    sampled: npt.NDArray[np.bool_],
    live_labelled: npt.NDArray[np.bool_],
    live_unlabelled: npt.NDArray[np.bool_],
    side: npt.NDArray[np.bool_],
    pos_off: IntArray,
    dispatch: IntArray,
) -> dict[str, npt.NDArray[Any]]:
    """``spans.build_spans``' former numpy steps from the cuts to the span table."""
    mixed = (labelled > 0) & (labelled < hi - lo)
    row_cut = np.repeat(np.arange(len(lo)), 1 + mixed)
    part = np.zeros(len(row_cut), dtype=np.int8)
    second = np.flatnonzero(mixed) + np.arange(1, int(mixed.sum()) + 1)
    part[second - 1], part[second] = 1, 2
    count = np.where(part == 1, labelled[row_cut], hi[row_cut] - lo[row_cut])
    count = np.where(part == 2, (hi - lo - labelled)[row_cut], count)
    row_live = np.where(part == 2, live_unlabelled[row_cut], live_labelled[row_cut])
    keep_rows = kept[row_cut]
    row_cut, part, count, row_live = row_cut[keep_rows], part[keep_rows], count[keep_rows], row_live[keep_rows]
    row_label = np.where(part == 2, -1, label[row_cut])
    row_sampled = np.where(sampled[row_cut], count, 0).astype(np.int64)
    sample = (np.searchsorted(pos_off, lo[row_cut], "right") - 1).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(np.bincount(sample, minlength=len(pos_off) - 1)))).astype(np.int64)
    version = np.where(row_label >= 0, row_label, dispatch[sample])
    has_sampled = row_sampled > 0
    unmaskable = segment_sum(side[row_cut], offsets) > 0
    low, high = NO_VERSION
    return {
        "sample": sample, "lo": lo[row_cut], "hi": hi[row_cut], "label": row_label, "version": version,
        "part": part, "sampled": row_sampled, "live": row_live, "span_offsets": offsets,
        "n_sampled": segment_sum(row_sampled, offsets),
        "n_unlabelled": segment_sum(np.where(row_label < 0, row_sampled, 0), offsets),
        "unmaskable": unmaskable, "had_train": unmaskable | (segment_sum(row_live, offsets) > 0),
        "max_label": segment_max(row_label, offsets, -1),
        "max_sampled_version": segment_max(np.where(has_sampled, version, low), offsets, low),
        "seq_min_version": segment_min(np.where((row_label >= 0) | has_sampled, version, high), offsets, high),
    }  # fmt: skip


def assert_same_rows(got: Any, want: dict[str, npt.NDArray[Any]]) -> None:
    """Every array of ``want`` equals the kernel result's field of that name, dtype included."""
    for name, values in want.items():
        mine = getattr(got, name)
        assert mine.dtype == values.dtype and mine.tolist() == values.tolist(), name


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), samples=st.integers(0, 12), cut_share=st.floats(0.0, 0.3))
def test_span_rows_equal_the_numpy_steps(seed: int, samples: int, cut_share: float) -> None:
    """Rows (one per kept cut, two per mixed cut), their sample, version and sampled positions, and every
    per-sample reduction equal the numpy steps ``build_spans`` took, with empty samples, cuts left out,
    mixed cuts and unlabelled ones."""
    rng = np.random.default_rng(seed)
    pos_off = np.concatenate(([0], np.cumsum(rng.integers(0, 40, samples) * (rng.random(samples) < 0.8))))
    n = int(pos_off[-1])
    starts = np.zeros(n, dtype=bool)
    starts[pos_off[:-1][np.diff(pos_off) > 0]] = True  # every nonempty sample starts a cut
    starts |= rng.random(n) < cut_share
    lo = np.flatnonzero(starts).astype(np.int64)
    cuts = len(lo)
    hi = np.append(lo[1:], n)[:cuts].astype(np.int64)
    label = rng.integers(-1, 6, cuts)
    labelled = np.where(rng.random(cuts) < 0.5, rng.integers(0, 1 + hi - lo), np.where(label >= 0, hi - lo, 0))
    flags = [rng.random(cuts) < p for p in (0.8, 0.7, 0.6, 0.5, 0.2)]
    dispatch = rng.integers(0, 4, samples)
    arrays = (lo, hi, label, labelled, *flags, pos_off, dispatch)
    got = span_rows(*arrays, NO_VERSION)
    want = numpy_span_rows(*arrays)
    assert_same_rows(got, want)


def test_span_rows_refuse_a_cut_outside_the_positions() -> None:
    one = np.ones(1, dtype=bool)
    with pytest.raises(IndexError, match="outside the positions"):
        span_rows(np.array([0]), np.array([9]), np.array([1]), np.array([9]), one, one, one, one, ~one,
                  np.array([0, 4]), np.array([0]), NO_VERSION)  # fmt: skip
    with pytest.raises(ValueError, match="differ in length"):
        span_rows(np.array([0]), np.array([4, 5]), np.array([1]), np.array([4]), one, one, one, one, ~one,
                  np.array([0, 4]), np.array([0]), NO_VERSION)  # fmt: skip


def numpy_shipped_rows(
    span_lo: IntArray,
    span_hi: IntArray,
    kept_sample: npt.NDArray[np.bool_],
    sample_rollout: IntArray,
    mask_below: IntArray,
    version: IntArray,
    sampled: IntArray,
    frozen: npt.NDArray[np.bool_],
    rollout_chunk: IntArray,
    rollout_env: IntArray,
    table_part: npt.NDArray[np.int8],
    table_lo: IntArray,
    table_hi: IntArray,
    trained: int,
    not_sampled: int,
) -> dict[str, npt.NDArray[Any]]:
    """``shipment.ShippedSpans``' former numpy steps from the shipped samples to their kept rows."""
    span_rows = expand_ranges(span_lo, span_hi)
    span_offsets = np.concatenate(([0], np.cumsum(span_hi - span_lo)))
    span_sample = np.repeat(np.arange(len(span_lo)), span_hi - span_lo)
    part = table_part[span_rows]
    kept = kept_sample[span_sample] & (part != 2)
    span_rollout = sample_rollout[span_sample]
    in_population = ~frozen[span_rollout] & (sampled > 0)
    lag = np.where(in_population, trained - version, not_sampled)
    masked = version < mask_below[span_sample]
    partner = np.minimum(np.arange(len(part)) + 1, max(len(part) - 1, 0))
    spans_per_sample = segment_sum(kept.astype(np.int64), span_offsets)[kept_sample]
    return {
        "chunk": rollout_chunk[span_rollout][kept], "lo": table_lo[span_rows][kept], "hi": table_hi[span_rows][kept],
        "lag": lag[kept], "masked": masked[kept], "sample_offsets": np.concatenate(([0], np.cumsum(spans_per_sample))),
        "mixed": (part == 1)[kept], "unlabelled_lag": lag[partner][kept], "unlabelled_masked": masked[partner][kept],
        "env": rollout_env[span_rollout][kept],
    }  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rollouts=st.integers(0, 8), table_rows=st.integers(0, 60))
def test_shipped_rows_equal_the_numpy_steps(seed: int, rollouts: int, table_rows: int) -> None:
    """The kept rows of a ship (samples in any order of a span table, dropped samples, frozen rollouts,
    mixed spans whose unlabelled part follows, unsampled rows) and their per-sample offsets equal the numpy
    steps ``ShippedSpans.rows`` took, including the next row read past a sample's last row."""
    rng = np.random.default_rng(seed)
    # The table: runs of rows per sample, some rows a labelled part followed by its unlabelled part.
    part = np.zeros(table_rows, dtype=np.int8)
    second = np.flatnonzero(rng.random(max(table_rows - 1, 0)) < 0.3) + 1
    second = second[np.diff(np.concatenate(([-2], second))) > 1]  # parts never overlap
    part[second - 1], part[second] = 1, 2
    n_cuts = min(max(table_rows - 1, 0), int(rng.integers(0, 10)))
    cuts = np.sort(rng.choice(np.arange(1, table_rows), size=n_cuts, replace=False))
    cuts = cuts[part[cuts] != 2]  # a sample starts at a whole row or a labelled part
    edges = np.concatenate(([0], cuts, [table_rows])).astype(np.int64)
    order = rng.permutation(len(edges) - 1)
    span_lo, span_hi = edges[:-1][order], edges[1:][order]
    n_samples = len(span_lo)
    sample_rollout = np.sort(rng.integers(0, max(rollouts, 1), n_samples)) if rollouts else np.zeros(0, np.int64)
    if not rollouts:
        span_lo, span_hi, n_samples = span_lo[:0], span_hi[:0], 0
    n = int((span_hi - span_lo).sum())
    args = (
        span_lo, span_hi, rng.random(n_samples) < 0.8, sample_rollout, rng.integers(0, 6, n_samples),
        rng.integers(0, 8, n), rng.integers(0, 3, n) * (rng.random(n) < 0.7), rng.random(rollouts) < 0.3,
        rng.integers(0, 3, rollouts), rng.integers(0, 4, rollouts), part, rng.integers(0, 1000, table_rows),
        rng.integers(0, 1000, table_rows), 9, -1,
    )  # fmt: skip
    got = shipped_rows(*args)
    want = numpy_shipped_rows(*args)
    assert_same_rows(got, want)


def test_shipped_rows_refuse_rows_outside_the_table() -> None:
    one, no = np.ones(1, dtype=np.int64), np.zeros(1, dtype=bool)
    part = np.zeros(2, dtype=np.int8)
    with pytest.raises(IndexError, match="outside the span table"):
        shipped_rows(np.array([1]), np.array([3]), ~no, 0 * one, one, one, one, no, one, one, part,
                     one.repeat(2), one.repeat(2), 2, -1)  # fmt: skip
    with pytest.raises(IndexError, match="no rollout"):
        shipped_rows(0 * one, one, ~no, one, one, one, one, no, one, one, part, one.repeat(2), one.repeat(2), 2, -1)
    with pytest.raises(ValueError, match="one version"):
        shipped_rows(0 * one, 2 * one, ~no, 0 * one, one, one, one, no, one, one, part, one.repeat(2), one.repeat(2),
                     2, -1)  # fmt: skip


def numpy_stale_rows(
    span_lo: IntArray,
    span_hi: IntArray,
    sample_rollout: IntArray,
    old_below: IntArray,
    new_below: IntArray,
    raised: npt.NDArray[np.bool_],
    version: IntArray,
    sampled: IntArray,
    rollout_chunk: IntArray,
    table_part: npt.NDArray[np.int8],
    table_lo: IntArray,
    table_hi: IntArray,
) -> dict[str, npt.NDArray[Any]]:
    """``judging.mask_positions``' and ``masking.mask_spans``' former numpy steps to the rows they write."""
    span_sample = np.repeat(np.arange(len(span_lo)), span_hi - span_lo)
    old, new = old_below[span_sample], new_below[span_sample]
    stale = version < new
    hit = raised[span_sample] & stale & (version >= old) & (sampled > 0)
    span_rows = expand_ranges(span_lo, span_hi)
    part = table_part[span_rows]
    partner = np.arange(len(part)) + (part == 1) - (part == 2)
    whole = stale[partner]
    hit &= ~((part == 2) & hit[partner])
    rows = span_rows[hit]
    return {
        "chunk": rollout_chunk[sample_rollout[span_sample[hit]]], "lo": table_lo[rows], "hi": table_hi[rows],
        "part": np.where(whole[hit], 0, part[hit]).astype(np.int8), "positions": sampled[hit],
    }  # fmt: skip


def random_span_table(
    rng: np.random.Generator, table_rows: int, rollouts: int
) -> tuple[npt.NDArray[np.int8], IntArray, IntArray, IntArray]:
    """A span table's parts (a labelled part followed by its unlabelled part, in one sample) and the span rows
    of some samples in any order, each sample's rollout (ascending), as a judgement lists them."""
    part = np.zeros(table_rows, dtype=np.int8)
    second = np.flatnonzero(rng.random(max(table_rows - 1, 0)) < 0.3) + 1
    second = second[np.diff(np.concatenate(([-2], second))) > 1]  # parts never overlap
    part[second - 1], part[second] = 1, 2
    n_cuts = min(max(table_rows - 1, 0), int(rng.integers(0, 10)))
    cuts = np.sort(rng.choice(np.arange(1, table_rows), size=n_cuts, replace=False))
    cuts = cuts[part[cuts] != 2]  # a sample starts at a whole row or a labelled part
    edges = np.concatenate(([0], cuts, [table_rows])).astype(np.int64)
    order = rng.permutation(len(edges) - 1)
    span_lo, span_hi = edges[:-1][order], edges[1:][order]
    if not rollouts:
        return part, span_lo[:0], span_hi[:0], np.zeros(0, dtype=np.int64)
    return part, span_lo, span_hi, np.sort(rng.integers(0, rollouts, len(span_lo)))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rollouts=st.integers(0, 8), table_rows=st.integers(0, 60))
def test_stale_rows_equal_the_numpy_steps(seed: int, rollouts: int, table_rows: int) -> None:
    """The rows a decision newly masks (thresholds raised on some samples, rows already masked at the old
    threshold, unsampled rows, mixed spans with one or both parts stale) equal the numpy steps of
    ``mask_positions``, with a part written whole when its other part is stale too."""
    rng = np.random.default_rng(seed)
    part, span_lo, span_hi, sample_rollout = random_span_table(rng, table_rows, rollouts)
    n_samples, n = len(span_lo), int((span_hi - span_lo).sum())
    old_below = rng.integers(-1, 4, n_samples)
    args = (
        span_lo, span_hi, sample_rollout, old_below, old_below + rng.integers(0, 4, n_samples),
        rng.random(n_samples) < 0.8, rng.integers(0, 8, n), rng.integers(0, 3, n) * (rng.random(n) < 0.8),
        rng.integers(0, 3, rollouts), part, rng.integers(0, 1000, table_rows), rng.integers(0, 1000, table_rows),
    )  # fmt: skip
    got = stale_rows(*args)
    want = numpy_stale_rows(*args)
    assert_same_rows(got, want)


def test_stale_rows_refuse_rows_outside_the_table() -> None:
    one, yes = np.ones(1, dtype=np.int64), np.ones(1, dtype=bool)
    part = np.zeros(2, dtype=np.int8)
    with pytest.raises(IndexError, match="outside the span table"):
        stale_rows(one, 3 * one, 0 * one, one, one, yes, one, one, one, part, one.repeat(2), one.repeat(2))
    with pytest.raises(IndexError, match="without its other part"):
        stale_rows(0 * one, one, 0 * one, one, one, yes, one, one, one, part + 1, one.repeat(2), one.repeat(2))
