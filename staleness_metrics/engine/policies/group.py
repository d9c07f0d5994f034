"""``group``: drop every live member of a group whose oldest live member is older than the bound."""

from __future__ import annotations

from dataclasses import replace

from ..decision import Decision, Judgement
from .base import Policy


class GroupPolicy(Policy):
    name = "group"
    judges_groups = True

    def decide(self, judgement: Judgement) -> Decision:
        live = ~judgement.frozen
        stale = live & (judgement.trained_version - judgement.dispatch > self.max_staleness)
        return replace(Decision.keep_all(judgement), drop_rollout=live & judgement.group_any(stale))
