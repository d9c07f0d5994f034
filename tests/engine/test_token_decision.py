"""The ``token`` policy's compiled pass (``policies.token.token_decision``) against the numpy steps it replaced, on
random slices; and the policy's decisions on a sink unchanged (the reference cross-checks hold the rest)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.engine.decision import NO_MASK
from staleness_metrics.engine.policies.token import token_decision
from staleness_metrics.engine.segments import segment_any, segment_sum

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def numpy_decision(bound: int, a: dict[str, Any]) -> tuple[IntArray, BoolArray, BoolArray]:
    """The numpy steps the pass replaced (``TokenPolicy.decide`` and ``Judgement.trainable_after``)."""
    sample_rollout = np.repeat(np.arange(len(a["frozen"])), np.diff(a["sample_offsets"]))
    span_sample = np.repeat(np.arange(len(a["mask_below"])), np.diff(a["span_offsets"]))
    live = ~a["frozen"][sample_rollout]
    mask_below = np.maximum(a["mask_below"], np.where(live, bound, NO_MASK))
    alive = a["live"] & (a["version"] >= mask_below[span_sample])
    left = a["unmaskable"] | segment_any(alive, a["span_offsets"])
    drop_sample = live & ~a["dropped"] & a["had_train"] & ~left
    gone = (a["dropped"] | drop_sample).astype(np.int64)
    offsets = a["sample_offsets"]
    all_gone = segment_sum(gone, offsets) == offsets[1:] - offsets[:-1]
    return mask_below, drop_sample, ~a["frozen"] & all_gone


def random_slice(seed: int, rollouts: int) -> tuple[int, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    per_rollout = rng.integers(0, 4, rollouts)
    samples = int(per_rollout.sum())
    per_sample = rng.integers(0, 5, samples)
    spans = int(per_sample.sum())
    bound = int(rng.integers(-2, 12))
    return bound, {
        "frozen": rng.random(rollouts) < 0.2,
        "sample_offsets": np.concatenate(([0], np.cumsum(per_rollout))).astype(np.int64),
        "mask_below": np.where(rng.random(samples) < 0.5, NO_MASK, rng.integers(-1, 12, samples)),
        "dropped": rng.random(samples) < 0.2,
        "had_train": rng.random(samples) < 0.8,
        "unmaskable": rng.random(samples) < 0.1,
        "span_offsets": np.concatenate(([0], np.cumsum(per_sample))).astype(np.int64),
        "version": rng.integers(-1, 12, spans),
        "live": rng.random(spans) < 0.8,
    }


def decide(bound: int, a: dict[str, Any]) -> Any:
    return token_decision(
        bound, a["frozen"], a["sample_offsets"], a["mask_below"], a["dropped"], a["had_train"],
        a["unmaskable"], a["span_offsets"], a["version"], a["live"],
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rollouts=st.integers(0, 12))
def test_token_decision_equals_the_numpy_steps(seed: int, rollouts: int) -> None:
    bound, a = random_slice(seed, rollouts)
    got = decide(bound, a)
    mask_below, drop_sample, drop_rollout = numpy_decision(bound, a)
    assert got.mask_below.dtype == mask_below.dtype and got.mask_below.tolist() == mask_below.tolist()
    assert got.drop_sample.dtype == drop_sample.dtype and got.drop_sample.tolist() == drop_sample.tolist()
    assert got.drop_rollout.dtype == drop_rollout.dtype and got.drop_rollout.tolist() == drop_rollout.tolist()


def test_offsets_that_do_not_tile_the_arrays_are_refused() -> None:
    bound, a = random_slice(11, 5)
    a["span_offsets"] = a["span_offsets"].copy()
    a["span_offsets"][-1] += 1
    with pytest.raises(ValueError, match="offsets"):
        decide(bound, a)
