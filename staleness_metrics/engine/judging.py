"""Judging queued rollouts (SPEC 5): the slice a policy sees, and its decision written back.

:func:`judgement_of` reads the queue's rows into a :class:`~.decision.Judgement`; the policy decides; and
:func:`apply_decision` raises masking thresholds (zeroing newly stale positions in place, :func:`mask_positions`)
and drops samples and rollouts, counting them in the open window.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..metrics.compute import WindowCounts
from .decision import Decision, Judgement
from .kernels import slice_rows, stale_rows
from .masking import mask_spans
from .queue import DROPPED, QUEUED, RolloutQueue

__all__ = ["apply_decision", "judgement_after", "judgement_again", "judgement_of", "mask_positions", "with_groups"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def with_groups(queue: RolloutQueue, rows: IntArray, judges_groups: bool) -> IntArray:
    """``rows`` plus every queued member of their groups (for policies that judge groups)."""
    if not judges_groups or len(rows) == 0:
        return rows
    queued = np.flatnonzero(queue.rollouts["status"] == QUEUED)
    members = queued[np.isin(queue.rollouts["group"][queued], queue.rollouts["group"][rows])]
    return np.union1d(rows, members)


def judgement_of(queue: RolloutQueue, rows: IntArray, step: int) -> Judgement:
    """The columnar slice of queued ``rows`` a policy judges at ``step``."""
    r, s, n = queue.rollouts, queue.samples, queue.spans
    cut = slice_rows(rows, r["sample_lo"], r["sample_hi"], s["span_lo"], s["span_hi"])
    sample_rows, span_rows = cut.sample_rows, cut.span_rows
    group = r["group"][rows]
    judgement = object.__new__(Judgement)  # (every field given: the frozen __init__'s setattr per field skipped)
    judgement.__dict__.update(
        step=step, rows=rows, frozen=r["frozen"][rows], env=r["env"][rows], dispatch=r["dispatch"][rows],
        completion=r["completion"][rows], group=group, group_agentic=queue.group_agentic[group],
        sample_offsets=cut.sample_offsets, sample_rows=sample_rows, sample_rollout=cut.sample_rollout,
        mask_below=s["mask_below"][sample_rows], dropped=s["dropped"][sample_rows],
        had_train=s["had_train"][sample_rows], unmaskable=s["unmaskable"][sample_rows],
        n_sampled=s["n_sampled"][sample_rows], n_unlabelled=s["n_unlabelled"][sample_rows],
        max_sampled_version=s["max_sampled"][sample_rows], seq_min_version=s["seq_min"][sample_rows],
        span_offsets=cut.span_offsets, span_sample=cut.span_sample,
        version=n["version"][span_rows], labelled=n["labelled"][span_rows], sampled=n["sampled"][span_rows],
        live=n["live"][span_rows],
    )  # fmt: skip
    return judgement


def judgement_again(queue: RolloutQueue, judgement: Judgement | None, rows: IntArray, step: int) -> Judgement:
    """:func:`judgement_of` ``rows`` at ``step``, from ``judgement`` when that judged the very same rows at the
    same step: only what applying a decision changes since (thresholds and dropped samples) is read again."""
    if judgement is None or judgement.step != step or not np.array_equal(judgement.rows, rows):
        return judgement_of(queue, rows, step)
    return judgement_after(queue, judgement)


def judgement_after(queue: RolloutQueue, judgement: Judgement) -> Judgement:
    """``judgement`` once its decision was applied: the thresholds and dropped samples read again."""
    s = queue.samples
    again = object.__new__(Judgement)  # (a frozen dataclass: a copy, its two fields set as its __init__ would)
    again.__dict__.update(judgement.__dict__)
    again.__dict__["mask_below"] = s["mask_below"][judgement.sample_rows]
    again.__dict__["dropped"] = s["dropped"][judgement.sample_rows]
    return again


def apply_decision(queue: RolloutQueue, window: WindowCounts, judgement: Judgement, decision: Decision) -> None:
    """Write ``decision`` into the queue: raised thresholds masked in place, drops counted in ``window`` (rollouts
    dropped leave the queue)."""
    samples = queue.samples
    rows, sample_rows = judgement.rows, judgement.sample_rows
    mask_below = np.maximum(judgement.mask_below, decision.mask_below)
    raised = decision.mask_below > judgement.mask_below
    # A sampled span's version is at least its sample's ``seq_min_version``: when no raised sample's is below its
    # new threshold, no position becomes stale (the usual sweep of a run within its bound: nothing to look for).
    if raised.any() and (raised & (judgement.seq_min_version < mask_below)).any():
        mask_positions(queue, judgement, mask_below, raised)
    samples["mask_below"][sample_rows] = mask_below

    if not (decision.drop_sample.any() or decision.drop_rollout.any()):  # (nothing dropped: the usual case)
        return
    drop_rollout = decision.drop_rollout & ~judgement.frozen
    drop_sample = (decision.drop_sample | drop_rollout[judgement.sample_rollout]) & ~judgement.dropped
    if drop_sample.any():
        local = np.flatnonzero(drop_sample)
        samples["dropped"][sample_rows[local]] = True
        env = judgement.env[judgement.sample_rollout[local]]
        window.add(env, "samples_dropped")
        window.add(env, "tokens_dropped", judgement.n_sampled[local])
        window.add_dropped_lengths(env, judgement.n_sampled[local])
        ids = queue.ids
        window.dropped_samples.extend(
            (ids[rows[judgement.sample_rollout[i]]], int(samples["local"][sample_rows[i]])) for i in local
        )
    if drop_rollout.any():
        gone = rows[drop_rollout]
        window.add(judgement.env[drop_rollout], "rollouts_dropped")
        window.dropped_rollouts.extend(queue.ids[i] for i in gone)
        queue.leave(gone, DROPPED)


def mask_positions(queue: RolloutQueue, judgement: Judgement, mask_below: IntArray, raised: BoolArray) -> None:
    """Zero newly stale sampled positions in mask and the three weight arrays, in place: the rows to write
    found by one compiled pass over the judged span rows (:func:`~staleness_metrics.engine.kernels.stale_rows`)."""
    s, spans = queue.samples, queue.spans
    found = stale_rows(
        s["span_lo"][judgement.sample_rows], s["span_hi"][judgement.sample_rows], judgement.sample_rollout,
        judgement.mask_below, mask_below, raised, judgement.version, judgement.sampled,
        queue.rollouts["chunk"][judgement.rows], spans["part"], spans["lo"], spans["hi"],
    )  # fmt: skip
    if len(found.lo):
        mask_spans(queue.chunks, found.chunk, found.lo, found.hi, found.part, found.positions)
