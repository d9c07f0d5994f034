"""Rollout records for the service tests, and the accounting of what a client sent."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sent", "make_rollout"]


def make_rollout(rid: str, dispatch: int, newest: int, rng: random.Random, *, env: str | None = None) -> dict[str, Any]:
    """A live rollout with one sample of 4-8 positions: a prompt (mask 0), then sampled positions labelled
    with non-decreasing versions in ``dispatch..newest`` (weights loaded mid-response), one left
    unlabelled now and then."""
    n = rng.randint(4, 8)
    prompt = rng.randint(0, 2)
    mask = [0] * prompt + [1] * (n - prompt)
    versions = [-1] * prompt + sorted(rng.randint(dispatch, newest) for _ in range(n - prompt))
    if rng.random() < 0.2:
        versions[-1] = -1  # unlabelled: takes the dispatch version
    sample = {"mask": mask, "token_versions": versions}
    record: dict[str, Any] = {"id": rid, "dispatch_version": dispatch, "samples": [sample]}
    if env is not None:
        record["env"] = env
    return record


@dataclass
class Sent:
    """What one client sent: distinct rollouts, their sampled positions, and re-sends."""

    rollouts: int = 0
    sampled_tokens: int = 0
    duplicates: int = 0
    ids: set[str] = field(default_factory=set)

    def record(self, rollouts: list[dict[str, Any]]) -> None:
        for rollout in rollouts:
            if rollout["id"] in self.ids:
                self.duplicates += 1
                continue
            self.ids.add(rollout["id"])
            self.rollouts += 1
            self.sampled_tokens += sum(sum(s["mask"]) for s in rollout["samples"])

    def __add__(self, other: Sent) -> Sent:
        return Sent(
            self.rollouts + other.rollouts,
            self.sampled_tokens + other.sampled_tokens,
            self.duplicates + other.duplicates,
            self.ids | other.ids,
        )
