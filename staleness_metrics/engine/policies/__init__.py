"""The masking policies of SPEC 5, one small class each, behind :class:`Policy`."""

from __future__ import annotations

from dataclasses import replace

from ...config import StalenessConfig
from ..decision import Decision, Judgement, Policy
from .token import TokenPolicy
from .xtuner import XtunerPolicy

__all__ = ["EpisodePolicy", "GroupPolicy", "Policy", "TokenPolicy", "XtunerPolicy", "policy_for"]


class EpisodePolicy(Policy):
    """``episode``: drop a whole rollout whose dispatch version is older than the bound."""

    name = "episode"

    def decide(self, judgement: Judgement) -> Decision:
        stale = judgement.trained_version - judgement.dispatch > self.max_staleness
        return replace(Decision.keep_all(judgement), drop_rollout=~judgement.frozen & stale)


class GroupPolicy(Policy):
    """``group``: drop every live member of a group whose oldest live member is past the bound."""

    name = "group"
    judges_groups = True

    def decide(self, judgement: Judgement) -> Decision:
        live = ~judgement.frozen
        stale = live & (judgement.trained_version - judgement.dispatch > self.max_staleness)
        return replace(Decision.keep_all(judgement), drop_rollout=live & judgement.group_any(stale))


def policy_for(config: StalenessConfig) -> Policy:
    """The policy a configuration names."""
    if config.policy == "xtuner":
        bounds = config.max_staleness, config.max_token_staleness
        return XtunerPolicy(*bounds, config.sync_interval, config.retry_expired)
    simple: dict[str, type[Policy]] = {"token": TokenPolicy, "episode": EpisodePolicy, "group": GroupPolicy}
    return simple[config.policy](config.max_staleness)
