"""verl batches in verl's own shapes (left-padded prompts, right-padded responses, per-trajectory
param_version_start/_end, uid groups) equal the same rollouts given as SPEC 3 records."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import StalenessConfig
from staleness_metrics.adapters.verl import from_verl, verl_response_mask, verl_row_ids
from staleness_metrics.errors import TraceError
from tests.adapters.equivalence import compare_ships, shipped_records


def verl_batch(rows: list[dict[str, Any]], prompt_width: int = 4) -> SimpleNamespace:
    """A DataProto-like object: batch tensors [B, Lp + Lr] / [B, Lr] and non_tensor_batch object arrays."""
    width = max(len(r["response_mask"]) for r in rows)
    b = len(rows)
    attention = np.zeros((b, prompt_width + width), dtype=np.int64)
    response_mask = np.zeros((b, width), dtype=np.int64)
    log_probs = np.full((b, width), -1.0, dtype=np.float32)  # process_rollout_log_probs pads with -1
    for i, r in enumerate(rows):
        attention[i, prompt_width - r["prompt"] : prompt_width] = 1  # prompts are left-padded
        n = len(r["response_mask"])
        attention[i, prompt_width : prompt_width + n] = 1  # responses right-padded
        response_mask[i, :n] = r["response_mask"]
        log_probs[i, :n] = -0.5
    extras = {
        "param_version_start": np.array([r["start"] for r in rows], dtype=object),
        "param_version_end": np.array([r["end"] for r in rows], dtype=object),
        "uid": np.array([r["uid"] for r in rows], dtype=object),
        "data_source": np.array([r["env"] for r in rows], dtype=object),
    }
    tensors = {
        "responses": np.ones((b, width), dtype=np.int64),
        "response_mask": response_mask,
        "attention_mask": attention,
        "rollout_log_probs": log_probs,
    }
    return SimpleNamespace(batch=tensors, non_tensor_batch=extras)


def as_records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ids = verl_row_ids([r["uid"] for r in rows])
    return [
        {
            "id": rid,
            "group_id": r["uid"],
            "env": r["env"],
            "dispatch_version": r["start"],
            "completion_version": r["end"],
            "samples": [{"mask": r["response_mask"], "logprobs": [-0.5] * len(r["response_mask"])}],
        }
        for rid, r in zip(ids, rows, strict=True)
    ]


ROWS = [
    {"uid": "p0", "env": "math", "prompt": 3, "start": 5, "end": 7, "response_mask": [1, 1, 1, 1]},
    {"uid": "p0", "env": "math", "prompt": 3, "start": 7, "end": 7, "response_mask": [1, 1]},
    {"uid": "p1", "env": "code", "prompt": 2, "start": 2, "end": 4, "response_mask": [1, 0, 0, 1, 1]},  # tool tokens
]


def test_a_fixed_verl_batch_measures_oldest_newest_and_queue_like_verl() -> None:
    data = verl_batch(ROWS)
    batch = from_verl(data)
    assert list(batch.ids) == ["p0/0", "p0/1", "p1/0"]
    both = compare_ships(batch, as_records(ROWS), StalenessConfig(max_staleness=3), [9])
    m = both.adapter[0].metrics
    # T = 8. Rows p0/0 and p0/1 ship (R = 3 and 1); p1/0 (R = 6) is dropped by the token policy.
    assert m["staleness/rollout/dropped"] == 1
    assert m["staleness/rollout/max"] == 3  # verl's trajectory_staleness_worst: T - start
    assert m["staleness/rollout/in_queue/max"] == 1  # verl's trajectory_staleness: T - end
    assert m["staleness/rollout/newest/max"] == 3  # no per-token versions: every token takes the start
    mask = verl_response_mask(both.adapter[0], batch)
    assert mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_per_token_versions_make_newest_the_trajectory_staleness() -> None:
    data = verl_batch(ROWS[:1])
    versions = np.array([[5, 6, 7, 7]])
    batch = from_verl(data, token_versions=versions)
    record = as_records(ROWS[:1])[0]
    record["samples"][0]["token_versions"] = [5, 6, 7, 7]
    both = compare_ships(batch, [record], StalenessConfig(max_staleness=8), [9])
    assert both.adapter[0].metrics["staleness/rollout/newest/max"] == 1  # T - max(v) = 8 - 7


def test_the_agent_loop_names_min_and_max_global_steps_are_read_too() -> None:
    data = verl_batch(ROWS)
    extras = dict(data.non_tensor_batch)
    extras["min_global_steps"] = extras.pop("param_version_start")
    extras["max_global_steps"] = extras.pop("param_version_end")
    batch = from_verl((data.batch, extras))
    assert batch.dispatch_version.tolist() == [5, 7, 2]
    assert batch.completion_version is not None and batch.completion_version.tolist() == [7, 7, 4]
    del extras["min_global_steps"]
    with pytest.raises(TraceError, match=r"non_tensor_batch\['min_global_steps'\].*param_version_start"):
        from_verl((data.batch, extras))


@st.composite
def verl_rows(draw: st.DrawFn) -> list[dict[str, Any]]:
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 6))
        n = draw(st.integers(1, 6))
        rows.append(
            {
                "uid": draw(st.sampled_from(["u0", "u1", "u2"])),
                "env": draw(st.sampled_from(["math", "code"])),
                "prompt": draw(st.integers(1, 4)),
                "start": start,
                "end": start + draw(st.integers(0, 2)),
                "response_mask": draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
            }
        )
    return rows


@settings(max_examples=100, deadline=None)
@given(rows=verl_rows(), bound=st.integers(0, 3), policy=st.sampled_from(["token", "episode", "group"]))
def test_random_verl_batches_equal_their_records(rows: list[dict[str, Any]], bound: int, policy: str) -> None:
    batch = from_verl(verl_batch(rows))
    both = compare_ships(batch, as_records(rows), StalenessConfig(policy=policy, max_staleness=bound), [8, 10])
    for adapter, reference in zip(both.adapter, both.records, strict=True):
        mask = verl_response_mask(adapter, batch)
        shipped = shipped_records(reference)
        for i, rid in enumerate(batch.ids):
            n = len(rows[i]["response_mask"])
            expected = shipped[rid]["samples"][0]["mask"] if rid in shipped else [0] * n
            assert mask[i, :n].tolist() == expected
