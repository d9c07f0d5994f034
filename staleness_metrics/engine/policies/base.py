"""The interface every masking policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ..decision import Decision, Judgement


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

    def check_state_dict(self, state: Any, path: str) -> Mapping[str, Any]:
        """Check a :meth:`state_dict` before anything loads (``ConfigError`` naming the key)."""
        from ...state_checks import keys

        if type(self).state_dict is Policy.state_dict:
            return keys(state, path, ())
        return keys(state, path, state.keys() if isinstance(state, Mapping) else ())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`check_state_dict` accepted."""
