"""AReaL batches in AReaL's own shapes (prompt versions -1, right padding with 0, missing versions)
decide, measure and mask exactly like the same rollouts given as SPEC 3 records."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import MissingFieldError, StalenessConfig, TraceError
from staleness_metrics.adapters.areal import areal_loss_mask, from_areal
from tests.adapters.equivalence import compare_ships, shipped_records


def areal_sequence(prompt: int, output_versions: list[int], logprobs: list[float]) -> dict[str, list[Any]]:
    """One sequence as RLVRWorkflow.arun_episode builds it (before the batch dimension)."""
    return {
        "input_ids": list(range(prompt + len(output_versions))),
        "loss_mask": [0] * prompt + [1] * len(output_versions),
        "logprobs": [0.0] * prompt + logprobs,
        "versions": [-1] * prompt + output_versions,
        "attention_mask": [1] * (prompt + len(output_versions)),
    }


def concat_padded(sequences: list[dict[str, list[Any]]]) -> dict[str, np.ndarray]:
    """concat_padded_tensors: right padding to the longest row, 0 everywhere (versions included)."""
    width = max(len(s["input_ids"]) for s in sequences)
    out: dict[str, np.ndarray] = {}
    for key, dtype in (("input_ids", np.int64), ("loss_mask", np.int64), ("logprobs", np.float32),
                       ("versions", np.int64), ("attention_mask", np.bool_)):  # fmt: skip
        array = np.zeros((len(sequences), width), dtype=dtype)
        for i, s in enumerate(sequences):
            array[i, : len(s[key])] = s[key]
        out[key] = array
    return out


def as_records(ids: list[str], sequences: list[dict[str, list[Any]]]) -> list[dict[str, Any]]:
    records = []
    for rid, s in zip(ids, sequences, strict=True):
        labelled = [v for v in s["versions"] if v >= 0]
        records.append(
            {
                "id": rid,
                "dispatch_version": min(labelled),
                "samples": [{"mask": s["loss_mask"], "token_versions": s["versions"], "logprobs": s["logprobs"]}],
            }
        )
    return records


def test_a_fixed_areal_batch_masks_its_stale_output_tokens() -> None:
    sequences = [
        areal_sequence(3, [4, 4, 5, 6], [-0.1, -0.2, -0.3, -0.4]),
        areal_sequence(2, [6, -1, 7], [-0.5, -0.6, -0.7]),  # a missing version takes the dispatch (6)
        areal_sequence(4, [2, 2], [-1.0, -1.0]),  # every output token stale: dropped
    ]
    batch_arrays = concat_padded(sequences)
    ids = ["a", "b", "c"]
    batch = from_areal(batch_arrays, ids)
    both = compare_ships(batch, as_records(ids, sequences), StalenessConfig(max_staleness=2), [9])
    shipment = both.adapter[0]
    assert shipment.metrics["staleness/rollout/dropped"] == 1
    assert shipment.metrics["staleness/rollout/max"] == 4  # T = 8, oldest 4
    assert shipment.metrics["staleness/rollout/newest/max"] == 2  # row a's newest token is 6
    loss_mask = areal_loss_mask(shipment, batch)
    assert loss_mask.tolist() == [
        [0, 0, 0, 0, 0, 0, 1],  # versions 4, 4, 5 are older than 8 - 2
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],  # dropped
    ]
    # the batch's own loss_mask was masked in place (the padded shape the trainer reads)
    assert batch_arrays["loss_mask"][0].tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert shipped_records(both.records[0])["b"]["samples"][0]["mask"] == [0, 0, 1, 1, 1]


@st.composite
def areal_batches(draw: st.DrawFn) -> list[dict[str, list[Any]]]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 5))
        n = draw(st.integers(1, 6))
        versions = sorted(draw(st.lists(st.integers(start, start + 3), min_size=n, max_size=n)))
        versions[0] = start  # the first output token carries the dispatch version
        missing = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        versions = [-1 if gone and i else v for i, (v, gone) in enumerate(zip(versions, missing, strict=True))]
        out.append(areal_sequence(draw(st.integers(0, 4)), versions, [-0.25] * n))
    return out


@settings(max_examples=100, deadline=None)
@given(sequences=areal_batches(), bound=st.integers(0, 3), policy=st.sampled_from(["token", "episode", "xtuner"]))
def test_random_areal_batches_equal_their_records(
    sequences: list[dict[str, list[Any]]], bound: int, policy: str
) -> None:
    ids = [f"q{i}" for i in range(len(sequences))]
    arrays = concat_padded(sequences)
    extra: dict[str, Any] = {"max_token_staleness": 0} if policy == "xtuner" else {}
    config = StalenessConfig(policy=policy, max_staleness=bound, **extra)
    batch = from_areal(arrays, ids)
    both = compare_ships(batch, as_records(ids, sequences), config, [10])
    loss_mask = areal_loss_mask(both.adapter[0], batch)
    shipped = shipped_records(both.records[0])
    for i, rid in enumerate(ids):
        n = len(sequences[i]["loss_mask"])
        expected = shipped[rid]["samples"][0]["mask"] if rid in shipped else [0] * n
        assert loss_mask[i, :n].tolist() == expected
        assert not loss_mask[i, n:].any()


def test_a_row_without_any_version_needs_a_dispatch_version() -> None:
    arrays = concat_padded([areal_sequence(2, [-1, -1], [0.0, 0.0])])
    with pytest.raises(TraceError) as caught:
        from_areal(arrays, ["x"])
    assert caught.value.rollout_id == "x" and caught.value.field == "dispatch_version"
    assert from_areal(arrays, ["x"], dispatch_version=[3]).dispatch_version.tolist() == [3]
    with pytest.raises(KeyError, match="versions") as missing:
        from_areal({"loss_mask": arrays["loss_mask"]}, ["x"])
    assert isinstance(missing.value, MissingFieldError) and missing.value.field == "versions"
    assert str(missing.value).startswith("versions: missing from the AReaL batch")
