"""``xtuner``: xtuner's partial-rollout rule (sequence expiry, token masking, group drop, hold)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ..decision import NO_MASK, Decision, Judgement, Policy
from ..segments import segment_any


class XtunerPolicy(Policy):
    name = "xtuner"
    judges_groups = True

    def __init__(
        self,
        max_staleness: int,
        max_token_staleness: int | None = None,
        sync_interval: int = 1,
        retry_expired: bool = False,
    ) -> None:
        super().__init__(max_staleness)
        self.max_token_staleness = max_token_staleness
        self.sync_interval = sync_interval
        self.retry_expired = self.holds = retry_expired
        # per group: re-rollouts still owed for expired members (retry_expired only); capacity
        # doubled as groups appear, the first ``_groups`` meant
        self._owed, self._groups = np.zeros(0, dtype=np.int64), 0

    def observe_added(self, groups: npt.NDArray[np.int64]) -> None:
        self._grow(int(groups.max(initial=-1)) + 1)
        # only groups that owe: a handful, not per token
        for group in groups[self._owed[groups] > 0]:
            self._owed[group] = max(self._owed[group] - 1, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"owed": self._owed[: self._groups].tolist()}

    def checkpoint_state(self, groups: npt.NDArray[np.int64]) -> dict[str, Any]:
        # (a nameless group's count is dead: its one member left when it was dropped)
        return {"owed": np.append(self._owed, 0)[np.minimum(groups, len(self._owed))].tolist()}

    def check_state_dict(self, state: Any, path: str) -> Mapping[str, Any]:
        from ...state_checks import integer, join, keys, sequence

        owed = sequence(keys(state, path, ("owed",))["owed"], at := join(path, "owed"))
        return {"owed": [integer(n, join(at, i), 0, 2**63 - 1) for i, n in enumerate(owed)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._owed = np.asarray(state["owed"], dtype=np.int64)
        self._groups = len(self._owed)

    def _grow(self, size: int) -> None:
        if size > len(self._owed):
            self._owed = np.pad(self._owed, (0, max(size, 2 * len(self._owed)) - len(self._owed)))
        self._groups = max(self._groups, size)

    def decide(self, judgement: Judgement) -> Decision:
        k, t = self.sync_interval, judgement.trained_version
        rollout = judgement.sample_rollout
        live = ~judgement.frozen[rollout]

        has_version = judgement.seq_min_version < np.iinfo(np.int64).max // 8
        seq_staleness = np.where(has_version, t - judgement.seq_min_version, 0)
        expired = live & (seq_staleness >= (self.max_staleness + 1) * k)
        mask_below = judgement.mask_below
        if self.max_token_staleness is not None:  # staleness >= S_tok <=> v < threshold
            threshold = t - (self.max_token_staleness + 1) * k + 1
            applies = live & ~judgement.group_agentic[rollout] & (judgement.n_sampled > 0)
            mask_below = np.maximum(mask_below, np.where(applies, threshold, NO_MASK))
            expired |= applies & (judgement.max_sampled_version < threshold)
        expired_rollout = segment_any(expired, judgement.sample_offsets) & ~judgement.frozen

        hold = np.zeros(judgement.n_rollouts, dtype=bool)
        if not self.retry_expired:
            drop = ~judgement.frozen & judgement.group_any(expired_rollout)
        else:
            drop = expired_rollout
            self._grow(int(judgement.group.max(initial=-1)) + 1)
            np.add.at(self._owed, judgement.group[drop], 1)
            hold = ~drop & (self._owed[judgement.group] > 0)
        return Decision(mask_below, np.zeros(judgement.n_samples, dtype=bool), drop, hold)
