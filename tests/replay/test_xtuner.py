"""xtuner rollout states: one state is one rollout with one sample, shipped after its newest version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from staleness_metrics.config import StalenessConfig
from staleness_metrics.replay.sources import as_replay_events, detect_and_read, read_xtuner_states
from staleness_metrics.replay.stream import replay
from tests.support.examples import EXAMPLES

EXAMPLE = EXAMPLES / "xtuner-states.jsonl"


def _states() -> list[dict[str, Any]]:
    return [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip()]


def _sampled_versions(state: dict[str, Any]) -> list[int]:
    mask = state["response_mask"] or [1] * len(state["response_ids"])
    return [v for v, m in zip(state["response_model_steps"], mask, strict=True) if m]


def test_the_example_ships_at_step_6_and_token_figures_follow_the_states() -> None:
    read = read_xtuner_states(EXAMPLE)
    assert read.step == 6 and read.skipped == {}
    (shipment,) = replay(as_replay_events(read), StalenessConfig(max_staleness=1))
    # Token policy at bound 1: positions older than version 4 are masked, and a rollout whose sampled
    # positions are all masked is dropped; the shipped batch is the rest.
    per_state = {str(s["uid"]): [5 - v for v in _sampled_versions(s)] for s in _states()}
    dropped = sorted(i for i, values in per_state.items() if all(v > 1 for v in values))
    shipped = [v for i, values in per_state.items() if i not in dropped for v in values]
    report = shipment.report
    assert report.step == 6
    assert sorted(shipment.dropped_rollouts) == dropped and dropped  # some rollouts are wholly stale
    assert report.tally.tokens_dropped == sum(len(per_state[i]) for i in dropped)
    assert report.tally.tokens_sampled == len(shipped)  # a null response_mask counts every position
    assert report.metrics["staleness/token/mean"] == pytest.approx(sum(shipped) / len(shipped))
    assert report.metrics["staleness/token/masked"] == pytest.approx(sum(v > 1 for v in shipped) / len(shipped))
    assert report.metrics["staleness/token/unlabelled"] == 0.0


def test_groups_come_from_group_id_and_the_xtuner_policy_drops_whole_groups() -> None:
    read = read_xtuner_states(EXAMPLE)
    rollouts = [e["rollout"] for e in read.events if e["type"] == "rollout"]
    assert {r["group_id"] for r in rollouts} == {str(g) for g in range(6)}
    config = StalenessConfig(policy="xtuner", max_staleness=2)  # S = 3: expired when T - min(v) >= 3
    (shipment,) = replay(as_replay_events(read), config)
    # xtuner's sequence staleness looks at every labelled position, unsampled ones included.
    expired_groups = {str(s["group_id"]) for s in _states() if 5 - min(s["response_model_steps"]) >= 3}
    group_of = {r["id"]: r["group_id"] for r in rollouts}
    assert expired_groups  # the example has old tokens in some groups
    assert {group_of[i] for i in shipment.dropped_rollouts} == expired_groups
    assert len(shipment.dropped_rollouts) == 4 * len(expired_groups)  # fresh members go too


def test_only_completed_states_enter_unless_asked(tmp_path: Path) -> None:
    states = _states()[:4]
    states[1]["status"] = "aborted"
    states[2]["status"] = "expired"
    path = tmp_path / "states.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in states))
    read = read_xtuner_states(path)
    assert [e["rollout"]["id"] for e in read.events if e["type"] == "rollout"] == ["1", "4"]
    assert read.skipped == {"aborted": 1, "expired": 1}
    wider = read_xtuner_states(path, statuses=("completed", "aborted"))
    assert [e["rollout"]["id"] for e in wider.events if e["type"] == "rollout"] == ["1", "2", "4"]


def test_a_line_may_hold_a_whole_group_and_the_step_can_be_given(tmp_path: Path) -> None:
    states = _states()
    path = tmp_path / "groups.jsonl"
    path.write_text("".join(json.dumps(states[i : i + 4]) + "\n" for i in range(0, 24, 4)))
    read = read_xtuner_states(path, step=9)
    rollouts = [e["rollout"] for e in read.events if e["type"] == "rollout"]
    assert len(rollouts) == 24 and read.events[-1] == {"type": "ship", "step": 9}
    first = rollouts[0]
    assert first["dispatch_version"] == 4 and first["completion_version"] == 5
    assert first["samples"][0]["mask"] == [1] * 6  # null response_mask
    assert first["samples"][0]["token_versions"] == [4, 4, 4, 4, 5, 5]


def test_a_length_mismatch_is_reported_by_the_sink_with_the_rollout_id(tmp_path: Path) -> None:
    state = _states()[1]
    state["response_model_steps"] = state["response_model_steps"][:-1]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(state) + "\n")
    with pytest.raises(ValueError, match=r"rollout '2'.*token_versions"):
        replay(as_replay_events(read_xtuner_states(path)), StalenessConfig())


def test_replay_says_which_states_it_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = (EXAMPLES / "xtuner-states.jsonl").read_text().splitlines()
    first = json.loads(lines[0]) | {"status": "aborted"}
    states = tmp_path / "states.jsonl"
    states.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with caplog.at_level("WARNING"):
        events = list(detect_and_read(states))
    assert sum(e["type"] == "rollout" for e in events) == len(lines) - 1
    assert "1 aborted" in caplog.text
