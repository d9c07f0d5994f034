"""The queue's three tables (:class:`~.queue.RolloutQueue`): one row per rollout,
sample and span it tracks."""

from __future__ import annotations

import numpy as np

from .table import Column, Table

__all__ = ["RolloutRows", "SampleRows", "SpanRows"]


class RolloutRows(Table):
    """One row per rollout: where it arrived, where it is, and what the policies read of it."""

    chunk = Column(np.int64)  # the batch it arrived in (the queue's ``chunks``)
    index = Column(np.int64)  # its rollout number in that batch
    status = Column(np.int8)  # queue.QUEUED, SHIPPED, DROPPED or INVALID
    judged = Column(np.int64)  # the last step that judged it (queue.NEVER: none yet)
    frozen = Column(np.bool_)
    dispatch = Column(np.int64)
    completion = Column(np.int64)
    group = Column(np.int64)  # the queue's group index
    env = Column(np.int64)  # the queue's env index (0: none)
    sample_lo = Column(np.int64)  # its sample rows
    sample_hi = Column(np.int64)


class SampleRows(Table):
    """One row per sample: its spans, its masking threshold and what the cut found in it."""

    rollout = Column(np.int64)  # its rollout row
    local = Column(np.int64)  # its number within its rollout
    span_lo = Column(np.int64)  # its span rows
    span_hi = Column(np.int64)
    mask_below = Column(np.int64)  # versions below this are masked (decision.NO_MASK: none)
    dropped = Column(np.bool_)
    had_train = Column(np.bool_)
    unmaskable = Column(np.bool_)
    n_sampled = Column(np.int64)
    n_unlabelled = Column(np.int64)
    max_label = Column(np.int64)
    max_sampled = Column(np.int64)
    seq_min = Column(np.int64)
    label_kind = Column(np.int8)


class SpanRows(Table):
    """One row per span: a range of positions of one version label and one
    mask value in its batch."""

    sample = Column(np.int64)  # its sample row
    lo = Column(np.int64)  # positions in its rollout's batch
    hi = Column(np.int64)
    version = Column(np.int64)
    labelled = Column(np.bool_)
    sampled = Column(np.int64)
    live = Column(np.bool_)
    part = Column(np.int8)  # spans.PART_WHOLE, PART_LABELLED or PART_UNLABELLED
