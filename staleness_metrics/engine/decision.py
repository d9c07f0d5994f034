"""What a policy sees (a :class:`Judgement`) and what it decides (a :class:`Decision`).

A judgement is a columnar slice of the sink: some rollouts, their samples and their spans, with
local offsets. A decision is four arrays over that slice; the sink applies it and the metrics core
reads it. Nothing else passes between a policy and the rest of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .segments import segment_any

__all__ = ["NO_MASK", "Decision", "Judgement"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NO_MASK = np.iinfo(np.int64).min // 4  # a masking threshold below every version


@dataclass(frozen=True)
class Judgement:
    """Rollouts under judgement at ``step`` (train version ``T = step - 1``).

    Rollout arrays are indexed by local rollout, sample arrays by local sample (``sample_offsets``
    groups them per rollout), span arrays by local span (``span_offsets`` groups them per sample).
    Every rollout here is queued in the sink; for group policies the slice holds every queued member
    of each group it touches.
    """

    step: int
    # rollouts
    rows: IntArray  # the sink's row of each rollout
    frozen: BoolArray
    env: IntArray
    dispatch: IntArray
    completion: IntArray
    group: IntArray  # group index; a rollout without group_id has a group of its own
    group_agentic: BoolArray  # any rollout of the group that ever entered the sink was agentic
    sample_offsets: IntArray
    # samples
    sample_rows: IntArray
    sample_rollout: IntArray
    mask_below: IntArray  # current threshold: positions with version < it are masked
    dropped: BoolArray
    had_train: BoolArray
    unmaskable: BoolArray
    n_sampled: IntArray
    n_unlabelled: IntArray
    max_sampled_version: IntArray
    seq_min_version: IntArray
    span_offsets: IntArray
    # spans
    span_sample: IntArray
    version: IntArray
    labelled: BoolArray
    sampled: IntArray
    live: BoolArray  # some sampled position of the span carries a loss weight

    @property
    def trained_version(self) -> int:
        return self.step - 1

    @property
    def n_rollouts(self) -> int:
        return len(self.dispatch)

    @property
    def n_samples(self) -> int:
        return len(self.sample_rollout)

    def trainable_after(self, mask_below: IntArray) -> BoolArray:
        """Whether each sample still has something to train once positions
        below ``mask_below`` go."""
        alive = self.live & (self.version >= mask_below[self.span_sample])
        return self.unmaskable | segment_any(alive, self.span_offsets)

    def group_any(self, flags: BoolArray) -> BoolArray:
        """Per rollout: whether any rollout of its group (within this slice) has the flag."""
        groups, inverse = np.unique(self.group, return_inverse=True)
        hit = np.zeros(len(groups), dtype=bool)
        np.logical_or.at(hit, inverse, flags)
        return hit[inverse]


@dataclass(frozen=True)
class Decision:
    """A policy's verdict on a :class:`Judgement`.

    ``mask_below`` is the new threshold per sample (the sink keeps the larger of old and new, so
    masking only grows); ``drop_sample`` / ``drop_rollout`` mark what leaves for staleness now;
    ``hold_rollout`` marks rollouts that stay queued instead of shipping.
    """

    mask_below: IntArray
    drop_sample: BoolArray
    drop_rollout: BoolArray
    hold_rollout: BoolArray

    @classmethod
    def keep_all(cls, judgement: Judgement) -> Decision:
        return cls(
            mask_below=judgement.mask_below.copy(),
            drop_sample=np.zeros(judgement.n_samples, dtype=bool),
            drop_rollout=np.zeros(judgement.n_rollouts, dtype=bool),
            hold_rollout=np.zeros(judgement.n_rollouts, dtype=bool),
        )
