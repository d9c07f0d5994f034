"""The masking policies of SPEC 5, one small class each, behind :class:`Policy`."""

from __future__ import annotations

from ...config import StalenessConfig
from .base import Policy
from .episode import EpisodePolicy
from .group import GroupPolicy
from .token import TokenPolicy
from .xtuner import XtunerPolicy

__all__ = ["EpisodePolicy", "GroupPolicy", "Policy", "TokenPolicy", "XtunerPolicy", "policy_for"]


def policy_for(config: StalenessConfig) -> Policy:
    """The policy a configuration names."""
    if config.policy == "xtuner":
        bounds = config.max_staleness, config.max_token_staleness
        return XtunerPolicy(*bounds, config.sync_interval, config.retry_expired)
    simple: dict[str, type[Policy]] = {
        "token": TokenPolicy,
        "episode": EpisodePolicy,
        "group": GroupPolicy,
    }
    return simple[config.policy](config.max_staleness)
