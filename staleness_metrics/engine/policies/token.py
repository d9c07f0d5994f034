"""``token``: mask positions older than the bound; drop samples left with nothing to train."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ...compiled import CompiledLoop
from ..decision import NO_MASK, Decision, Judgement, Policy
from ..segments import BoolArray, IntArray


class TokenPolicy(Policy):
    name = "token"

    def decide(self, judgement: Judgement) -> Decision:
        return token_decision(
            judgement.trained_version - self.max_staleness, judgement.frozen, judgement.sample_offsets,
            judgement.mask_below, judgement.dropped, judgement.had_train, judgement.unmaskable,
            judgement.span_offsets, judgement.version, judgement.live,
        )  # fmt: skip


@CompiledLoop
def _token_decision(
    bound: int,
    frozen: BoolArray,
    sample_offsets: IntArray,
    mask_below: IntArray,
    dropped: BoolArray,
    had_train: BoolArray,
    unmaskable: BoolArray,
    span_offsets: IntArray,
    version: IntArray,
    live: BoolArray,
) -> tuple[IntArray, BoolArray, BoolArray]:  # pragma: no cover - compiled
    n_rollouts, n_samples, n_spans = len(frozen), len(mask_below), len(version)
    if len(sample_offsets) != n_rollouts + 1 or len(span_offsets) != n_samples + 1:
        raise ValueError("token_decision: offsets of the wrong length")
    if len(dropped) != n_samples or len(had_train) != n_samples or len(unmaskable) != n_samples:
        raise ValueError("token_decision: sample arrays differ in length")
    if len(live) != n_spans:
        raise ValueError("token_decision: span arrays differ in length")
    covered = sample_offsets[n_rollouts] == n_samples and span_offsets[n_samples] == n_spans
    if sample_offsets[0] != 0 or span_offsets[0] != 0 or not covered:
        raise ValueError("token_decision: offsets do not cover the arrays")
    if (np.diff(sample_offsets) < 0).any() or (np.diff(span_offsets) < 0).any():
        raise ValueError("token_decision: offsets out of order")
    new_below = np.empty(n_samples, dtype=np.int64)
    drop_sample = np.zeros(n_samples, dtype=np.bool_)
    drop_rollout = np.zeros(n_rollouts, dtype=np.bool_)
    for r in range(n_rollouts):
        is_live = not frozen[r]
        gone = 0
        for k in range(sample_offsets[r], sample_offsets[r + 1]):
            below = max(mask_below[k], bound if is_live else NO_MASK)
            new_below[k] = below
            left = unmaskable[k]
            if not left:
                for i in range(span_offsets[k], span_offsets[k + 1]):
                    if live[i] and version[i] >= below:
                        left = True
                        break
            drop = is_live and not dropped[k] and had_train[k] and not left
            drop_sample[k] = drop
            gone += dropped[k] or drop
        drop_rollout[r] = is_live and gone == sample_offsets[r + 1] - sample_offsets[r]
    return new_below, drop_sample, drop_rollout


def token_decision(bound: int, *slice_: npt.NDArray[Any]) -> Decision:
    """The ``token`` policy over a judged slice (the fields :meth:`TokenPolicy.decide` passes)."""
    mask_below, drop_sample, drop_rollout = _token_decision(int(bound), *slice_)
    return Decision(mask_below, drop_sample, drop_rollout, np.zeros(len(drop_rollout), dtype=bool))
