"""Judging queued rollouts (SPEC 5): the slice a policy sees (:func:`judgement_of`) and its decision
written back, newly stale sampled positions zeroed in place (:func:`apply_decision`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import UNSIGNED_OF_SIZE, CompiledLoop
from ..metrics.compute import WindowCounts
from ..parallel import PARALLEL_MIN_POSITIONS, SHARES, run_all
from ..records.columnar import WEIGHT_FIELDS
from .decision import Decision, Judgement
from .queue import DROPPED, QUEUED, RolloutQueue
from .segments import BoolArray, IntArray
from .spans import SampleSpans, SpanRanges, as_compiled, check_sample_spans


def with_groups(queue: RolloutQueue, rows: IntArray, judges_groups: bool) -> IntArray:
    """``rows`` plus every queued member of their groups (for a policy that judges groups)."""
    if not judges_groups or len(rows) == 0:
        return rows
    queued = np.flatnonzero(queue.rollouts.status == QUEUED)
    members = queued[np.isin(queue.rollouts.group[queued], queue.rollouts.group[rows])]
    return np.union1d(rows, members)


def judgement_of(queue: RolloutQueue, rows: IntArray, step: int) -> Judgement:
    """The columnar slice of queued ``rows`` a policy judges at ``step``."""
    r, s, n = queue.rollouts, queue.samples, queue.spans
    cut = slice_rows(rows, r.sample_lo, r.sample_hi, s.span_lo, s.span_hi)
    sample_rows, span_rows = cut.sample_rows, cut.span_rows
    group = r.group[rows]
    judgement = object.__new__(Judgement)  # (the frozen __init__'s setattr per field skipped)
    judgement.__dict__.update(
        step=step, rows=rows, frozen=r.frozen[rows], env=r.env[rows], dispatch=r.dispatch[rows],
        completion=r.completion[rows], group=group, group_agentic=queue.group_agentic[group],
        sample_offsets=cut.sample_offsets, sample_rows=sample_rows, sample_rollout=cut.sample_rollout,
        mask_below=s.mask_below[sample_rows], dropped=s.dropped[sample_rows],
        had_train=s.had_train[sample_rows], unmaskable=s.unmaskable[sample_rows],
        n_sampled=s.n_sampled[sample_rows], n_unlabelled=s.n_unlabelled[sample_rows],
        max_sampled_version=s.max_sampled[sample_rows], seq_min_version=s.seq_min[sample_rows],
        span_offsets=cut.span_offsets, span_sample=cut.span_sample,
        version=n.version[span_rows], labelled=n.labelled[span_rows], sampled=n.sampled[span_rows],
        live=n.live[span_rows],
    )  # fmt: skip
    return judgement


def judgement_again(queue: RolloutQueue, judgement: Judgement | None, rows: IntArray, step: int) -> Judgement:
    """:func:`judgement_of`, from ``judgement`` when that judged the same rows at ``step``."""
    if judgement is None or judgement.step != step or not np.array_equal(judgement.rows, rows):
        return judgement_of(queue, rows, step)
    s, rows = queue.samples, judgement.sample_rows
    again = object.__new__(Judgement)
    vars(again).update(vars(judgement), mask_below=s.mask_below[rows], dropped=s.dropped[rows])
    return again


def apply_decision(queue: RolloutQueue, window: WindowCounts, judgement: Judgement, decision: Decision) -> None:
    """Write ``decision`` into the queue: raised thresholds masked in place, drops counted."""
    samples = queue.samples
    rows, sample_rows = judgement.rows, judgement.sample_rows
    mask_below = np.maximum(judgement.mask_below, decision.mask_below)
    raised = decision.mask_below > judgement.mask_below
    if raised.any() and (raised & (judgement.seq_min_version < mask_below)).any():
        mask_positions(queue, judgement, mask_below, raised)
    samples.mask_below[sample_rows] = mask_below

    if not (decision.drop_sample.any() or decision.drop_rollout.any()):
        return
    drop_rollout = decision.drop_rollout & ~judgement.frozen
    drop_sample = (decision.drop_sample | drop_rollout[judgement.sample_rollout]) & ~judgement.dropped
    if drop_sample.any():
        local = np.flatnonzero(drop_sample)
        samples.dropped[sample_rows[local]] = True
        env = judgement.env[judgement.sample_rollout[local]]
        window.add_dropped_samples(env, judgement.n_sampled[local])
        ids = queue.ids
        window.dropped_samples.extend(
            (ids[rows[judgement.sample_rollout[i]]], int(samples.local[sample_rows[i]])) for i in local
        )
    if drop_rollout.any():
        gone = rows[drop_rollout]
        window.add(judgement.env[drop_rollout], "rollouts_dropped")
        window.dropped_rollouts.extend(queue.ids[i] for i in gone)
        queue.leave(gone, DROPPED)


def mask_positions(queue: RolloutQueue, judgement: Judgement, mask_below: IntArray, raised: BoolArray) -> None:
    """Zero newly stale sampled positions in mask and weights, in place."""
    s, spans = queue.samples, queue.spans
    samples = SampleSpans(s.span_lo[judgement.sample_rows], s.span_hi[judgement.sample_rows],
                          judgement.sample_rollout)  # fmt: skip
    table = SpanRanges(spans.part, spans.lo, spans.hi)
    thresholds = (judgement.mask_below, mask_below, raised)
    chunk = queue.rollouts.chunk[judgement.rows]
    found = stale_rows(samples, table, judgement.version, judgement.sampled, thresholds, chunk)
    # in the mask and the weight arrays of each batch, a run of rows of one chunk at a time
    cuts = [0, *(np.flatnonzero(found.chunk[1:] != found.chunk[:-1]) + 1).tolist(), len(found.chunk)]
    for a, b in itertools.pairwise(cuts) if len(found.chunk) else ():
        batch = queue.chunks[int(found.chunk[a])]
        assert batch is not None
        weights = [getattr(batch, f) for f in WEIGHT_FIELDS if getattr(batch, f) is not None]
        spans_of = found.lo[a:b], found.hi[a:b], found.part[a:b], found.positions[a:b]
        zero_spans([batch.mask, *weights], batch.token_versions, *spans_of)


class SliceRows(NamedTuple):
    sample_rows: IntArray
    sample_offsets: IntArray  # per rollout, into sample_rows
    sample_rollout: IntArray  # per sample, its local rollout
    span_rows: IntArray
    span_offsets: IntArray  # per sample, into span_rows
    span_sample: IntArray  # per span, its local sample


@CompiledLoop
def _slice_rows(
    rows: IntArray, sample_lo: IntArray, sample_hi: IntArray, span_lo: IntArray, span_hi: IntArray
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray, IntArray]:  # pragma: no cover
    n_rollouts, n_samples = len(sample_lo), len(span_lo)
    if len(sample_hi) != n_rollouts or len(span_hi) != n_samples:
        raise ValueError("slice_rows: lo and hi differ in length")
    samples = 0
    for row in rows:
        if row < 0 or row >= n_rollouts:
            raise IndexError("slice_rows: a rollout row outside the table")
        a, b = sample_lo[row], sample_hi[row]
        if a < 0 or b < a or b > n_samples:
            raise IndexError("slice_rows: a sample range outside the table")
        samples += b - a
    sample_rows = np.empty(samples, dtype=np.int64)
    sample_offsets = np.empty(len(rows) + 1, dtype=np.int64)
    sample_rollout = np.empty(samples, dtype=np.int64)
    sample_offsets[0] = 0
    at = spans = 0
    for i in range(len(rows)):
        for k in range(sample_lo[rows[i]], sample_hi[rows[i]]):
            a, b = span_lo[k], span_hi[k]
            if a < 0 or b < a:
                raise IndexError("slice_rows: a span range out of order")
            sample_rows[at] = k
            sample_rollout[at] = i
            spans += b - a
            at += 1
        sample_offsets[i + 1] = at
    span_rows = np.empty(spans, dtype=np.int64)
    span_offsets = np.empty(samples + 1, dtype=np.int64)
    span_sample = np.empty(spans, dtype=np.int64)
    span_offsets[0] = 0
    at = 0
    for j in range(samples):
        k = sample_rows[j]
        for row in range(span_lo[k], span_hi[k]):
            span_rows[at] = row
            span_sample[at] = j
            at += 1
        span_offsets[j + 1] = at
    return sample_rows, sample_offsets, sample_rollout, span_rows, span_offsets, span_sample


def slice_rows(
    rows: IntArray, sample_lo: IntArray, sample_hi: IntArray, span_lo: IntArray, span_hi: IntArray
) -> SliceRows:
    """The sample and span rows of the rollouts at ``rows`` with their offsets, in one pass."""
    return SliceRows(*_slice_rows(rows, sample_lo, sample_hi, span_lo, span_hi))


class StaleRows(NamedTuple):
    chunk: IntArray
    lo: IntArray
    hi: IntArray
    part: npt.NDArray[np.int8]
    positions: IntArray  # the sampled positions of each (the whole range's or its part's)


@CompiledLoop(callees={"check_sample_spans": (check_sample_spans, {})})
def _stale_rows(
    samples: tuple[IntArray, IntArray, IntArray],
    table: tuple[npt.NDArray[np.int8], IntArray, IntArray],
    version: IntArray,
    sampled: IntArray,
    thresholds: tuple[IntArray, IntArray, BoolArray],
    rollout_chunk: IntArray,
) -> tuple[IntArray, IntArray, IntArray, npt.NDArray[np.int8], IntArray]:  # pragma: no cover
    span_lo, span_hi, sample_rollout = samples
    part, table_lo, table_hi = table
    old_below, new_below, raised = thresholds
    n_samples = len(span_lo)
    if len(old_below) != n_samples or len(new_below) != n_samples or len(raised) != n_samples:
        raise ValueError("stale_rows: the sample arrays differ in length")
    n = check_sample_spans(samples, table, version, sampled, len(rollout_chunk))
    # per row (in judgement order): stale at the new threshold, and newly masked (hit)
    stale = np.empty(n, dtype=np.bool_)
    hit = np.empty(n, dtype=np.bool_)
    i = 0
    for k in range(n_samples):
        for _ in range(span_lo[k], span_hi[k]):
            stale[i] = version[i] < new_below[k]
            hit[i] = raised[k] & stale[i] & (version[i] >= old_below[k]) & (sampled[i] > 0)
            i += 1
    out_chunk = np.empty(n, dtype=np.int64)
    out_lo = np.empty(n, dtype=np.int64)
    out_hi = np.empty(n, dtype=np.int64)
    out_part = np.empty(n, dtype=np.int8)
    out_count = np.empty(n, dtype=np.int64)
    j = i = 0
    for k in range(n_samples):
        for r in range(span_lo[k], span_hi[k]):
            # A mixed span's parts are adjacent rows (1 labelled, 2 unlabelled): both stale, the
            # whole range goes, by the labelled part's row
            p = part[r]
            partner = i + (p == 1) - (p == 2)
            if partner < 0 or partner >= n:
                raise IndexError("stale_rows: a part of a mixed span without its other part")
            if hit[i] and not (p == 2 and hit[partner]):
                out_chunk[j] = rollout_chunk[sample_rollout[k]]
                out_lo[j], out_hi[j] = table_lo[r], table_hi[r]
                out_part[j] = 0 if stale[partner] else p
                out_count[j] = sampled[i]
                j += 1
            i += 1
    return out_chunk[:j], out_lo[:j], out_hi[:j], out_part[:j], out_count[:j]


def stale_rows(
    samples: SampleSpans,
    table: SpanRanges,
    version: IntArray,
    sampled: IntArray,
    thresholds: tuple[IntArray, IntArray, BoolArray],
    rollout_chunk: IntArray,
) -> StaleRows:
    """The span rows a decision newly masks (sampled, from the old threshold up to the new), in one
    pass; a mixed span whose parts are both stale as one row of part 0."""
    as_int = partial(np.ascontiguousarray, dtype=np.int64)
    old_below, new_below, raised = thresholds
    checked = (as_int(old_below), as_int(new_below), np.ascontiguousarray(raised, dtype=np.bool_))
    rows = as_int(version), as_int(sampled), checked, as_int(rollout_chunk)
    return StaleRows(*_stale_rows(*as_compiled(samples, table), *rows))


_NO_TOKENS = np.zeros(0, dtype=np.int64)


@CompiledLoop
def _zero_spans(
    b0: npt.NDArray[Any],
    b1: npt.NDArray[Any],
    b2: npt.NDArray[Any],
    b3: npt.NDArray[Any],
    tokens: IntArray,
    lo: IntArray,
    hi: IntArray,
    part: npt.NDArray[np.int8],
    count: IntArray,
    zeros: tuple[Any, Any, Any, Any],
) -> None:  # pragma: no cover - compiled
    z0, z1, z2, z3 = zeros
    n = len(b0)
    if len(b1) != n or len(b2) != n or len(b3) != n:
        raise ValueError("zero_spans: the arrays differ in length")
    rows = len(lo)
    if len(hi) != rows or len(part) != rows or len(count) != rows:
        raise ValueError("zero_spans: lo, hi, part and count differ in length")
    for r in range(rows):
        a, b = lo[r], hi[r]
        if a >= b:
            continue
        if a < 0 or b > n or (part[r] != 0 and b > len(tokens)):
            raise IndexError("zero_spans: a span lies outside the arrays")
        # Slices, in bounds by the check above: LLVM makes each loop a memset or a vector select
        s0, s1, s2, s3 = b0[a:b], b1[a:b], b2[a:b], b3[a:b]
        if part[r] == 0:
            for i in range(b - a):
                s0[i] = z0
            for i in range(b - a):
                s1[i] = z1
            for i in range(b - a):
                s2[i] = z2
            for i in range(b - a):
                s3[i] = z3
            continue
        want = part[r] == 2
        tok = tokens[a:b]
        if 4 * count[r] < b - a:  # few positions to write: a branch, rarely taken
            for i in range(b - a):
                if (tok[i] < 0) == want:
                    s0[i], s1[i], s2[i], s3[i] = z0, z1, z2, z3
            continue
        for i in range(b - a):  # many: unconditional stores of a select, no branch to mispredict
            keep = (tok[i] < 0) != want
            s0[i] = s0[i] if keep else z0
            s1[i] = s1[i] if keep else z1
            s2[i] = s2[i] if keep else z2
            s3[i] = s3[i] if keep else z3


def zero_spans(
    arrays: Sequence[npt.NDArray[Any]],
    tokens: npt.NDArray[np.signedinteger[Any]] | None,
    lo: IntArray,
    hi: IntArray,
    part: npt.NDArray[np.int8],
    count: IntArray,
) -> None:
    """Zero, in place, in each of ``arrays`` (one to four), the positions of ``[lo[r], hi[r])``: all
    (``part`` 0), the labelled (1) or unlabelled (2, ``tokens < 0``) ones; ``count``: how many."""
    if len(lo) == 0:
        return
    views = [values.view(UNSIGNED_OF_SIZE[values.dtype.itemsize]) for values in arrays]
    views += [views[0]] * (4 - len(views))  # zeroing a position twice is harmless
    # (a literal 0 would make the selects float64)
    zeros = tuple(view.dtype.type(0) for view in views)
    labels = _NO_TOKENS if tokens is None else tokens
    total = int((hi - lo).sum())
    if total < PARALLEL_MIN_POSITIONS:
        _zero_spans(*views, labels, lo, hi, part, count, zeros)
        return
    written = (hi - lo).cumsum()
    # shares of about equal positions, written in parallel (the rows are disjoint)
    edges = np.searchsorted(written, np.linspace(0, total, num=SHARES + 1)[1:-1], "left").tolist()
    tasks = [
        partial(_zero_spans, *views, labels, lo[a:b], hi[a:b], part[a:b], count[a:b], zeros)
        for a, b in itertools.pairwise([0, *edges, len(lo)]) if b > a
    ]  # fmt: skip
    run_all(tasks, total)
