"""``episode``: drop a whole rollout whose dispatch version is older than the bound."""

from __future__ import annotations

from dataclasses import replace

from ..decision import Decision, Judgement
from .base import Policy


class EpisodePolicy(Policy):
    name = "episode"

    def decide(self, judgement: Judgement) -> Decision:
        stale = judgement.trained_version - judgement.dispatch > self.max_staleness
        return replace(Decision.keep_all(judgement), drop_rollout=~judgement.frozen & stale)
