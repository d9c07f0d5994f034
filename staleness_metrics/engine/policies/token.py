"""``token``: mask positions older than the bound; drop samples left with nothing to train."""

from __future__ import annotations

import numpy as np

from ..decision import NO_MASK, Decision, Judgement
from ..kernels import token_decision
from .base import Policy

__all__ = ["TokenPolicy"]


class TokenPolicy(Policy):
    name = "token"

    def decide(self, judgement: Judgement) -> Decision:
        """Each live rollout's samples mask below ``T - max_staleness`` (staleness == max_staleness trains); a
        sample left with nothing to train is dropped, and a rollout left with no sample. One compiled pass
        (:func:`~staleness_metrics.engine.kernels.token_decision`)."""
        found = token_decision(
            judgement.trained_version - self.max_staleness, NO_MASK, judgement.frozen, judgement.sample_offsets,
            judgement.mask_below, judgement.dropped, judgement.had_train, judgement.unmaskable,
            judgement.span_offsets, judgement.version, judgement.live,
        )  # fmt: skip
        return Decision(
            mask_below=found.mask_below,
            drop_sample=found.drop_sample,
            drop_rollout=found.drop_rollout,
            hold_rollout=np.zeros(len(found.drop_rollout), dtype=bool),
        )
