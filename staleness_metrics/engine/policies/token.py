"""``token``: mask positions older than the bound; drop samples left with nothing to train."""

from __future__ import annotations

import numpy as np

from ..decision import NO_MASK, Decision, Judgement
from ..segments import segment_sum
from .base import Policy

__all__ = ["TokenPolicy"]


class TokenPolicy(Policy):
    name = "token"

    def decide(self, judgement: Judgement) -> Decision:
        bound = judgement.trained_version - self.max_staleness  # staleness == max_staleness trains
        live = ~judgement.frozen[judgement.sample_rollout]
        mask_below = np.maximum(judgement.mask_below, np.where(live, bound, NO_MASK))
        left = judgement.trainable_after(mask_below)
        drop_sample = live & ~judgement.dropped & judgement.had_train & ~left
        gone = (judgement.dropped | drop_sample).astype(np.int64)
        offsets = judgement.sample_offsets
        all_gone = segment_sum(gone, offsets) == offsets[1:] - offsets[:-1]
        return Decision(
            mask_below=mask_below,
            drop_sample=drop_sample,
            drop_rollout=~judgement.frozen & all_gone,
            hold_rollout=np.zeros(judgement.n_rollouts, dtype=bool),
        )
