"""The policy seam: what a :class:`Policy` sees (a :class:`Judgement`) and what it decides (a
:class:`Decision`); nothing else passes between a policy and the rest of the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .segments import BoolArray, IntArray

NO_MASK = np.iinfo(np.int64).min // 4  # a masking threshold below every version


@dataclass(frozen=True)
class Judgement:
    """Queued rollouts under judgement at ``step`` (train version ``T = step - 1``): per rollout,
    per sample (``sample_offsets`` per rollout), then per span (``span_offsets`` per sample); for
    group policies every queued member of each group it touches."""

    step: int
    rows: IntArray  # the sink's row of each rollout
    frozen: BoolArray
    env: IntArray
    dispatch: IntArray
    completion: IntArray
    group: IntArray  # group index; a rollout without group_id has a group of its own
    group_agentic: BoolArray  # any rollout of the group that ever entered the sink was agentic
    sample_offsets: IntArray
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

    def group_any(self, flags: BoolArray) -> BoolArray:
        """Per rollout: whether any rollout of its group (within this slice) has the flag."""
        groups, inverse = np.unique(self.group, return_inverse=True)
        hit = np.zeros(len(groups), dtype=bool)
        np.logical_or.at(hit, inverse, flags)
        return hit[inverse]


@dataclass(frozen=True)
class Decision:
    """A policy's verdict on a :class:`Judgement`: ``mask_below`` the new threshold per sample (the
    sink keeps the larger of old and new), what leaves for staleness now (``drop_sample``,
    ``drop_rollout``) and what stays queued instead of shipping (``hold_rollout``)."""

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


class Policy(ABC):
    """Decides, for rollouts under judgement at a step, what is masked, dropped and held
    (``judges_groups``: it sees every queued member of each group it touches)."""

    name: str = ""
    judges_groups: bool = False
    holds: bool = False

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness

    @abstractmethod
    def decide(self, judgement: Judgement) -> Decision: ...

    def observe_added(self, groups: npt.NDArray[np.int64]) -> None:
        """Called with the group index of every rollout the sink accepts, in order."""

    def state_dict(self) -> dict[str, Any]:
        """What the policy remembers between calls, as JSON-serialisable data."""
        return {}

    def checkpoint_state(self, groups: IntArray) -> dict[str, Any]:
        """:meth:`state_dict` for a checkpoint, which numbers the group ``groups[i]`` ``i``."""
        return self.state_dict()

    def check_state_dict(self, state: Any, path: str) -> Mapping[str, Any]:
        """Check a :meth:`state_dict` before anything loads (``ConfigError`` naming the key)."""
        from ..state_checks import keys

        if type(self).state_dict is Policy.state_dict:
            return keys(state, path, ())
        return keys(state, path, state.keys() if isinstance(state, Mapping) else ())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`check_state_dict` accepted."""
