"""prime-rl run directories: replay reproduces the logged off_policy/* values, frozen episodes aside."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from staleness_metrics.cli import main
from staleness_metrics.config import StalenessConfig
from staleness_metrics.engine.sink import Sink
from staleness_metrics.errors import EventError
from staleness_metrics.replay.sources import as_replay_events, compare_prime_rl, read_prime_rl
from staleness_metrics.replay.sources.prime_rl import comparison_summary
from staleness_metrics.replay.stream import replay, run_events
from tests.support.examples import EXAMPLES

EXAMPLE = EXAMPLES / "prime-rl-run"
OFF_POLICY_KEYS = (
    "off_policy/mean",
    "off_policy/max",
    "off_policy/in_flight/mean",
    "off_policy/in_flight/max",
    "off_policy/in_queue/mean",
    "off_policy/in_queue/max",
    "off_policy/dropped",
)
NEW_KEY = {
    "off_policy/mean": "staleness/rollout/mean",
    "off_policy/max": "staleness/rollout/max",
    "off_policy/in_flight/mean": "staleness/rollout/in_flight/mean",
    "off_policy/in_flight/max": "staleness/rollout/in_flight/max",
    "off_policy/in_queue/mean": "staleness/rollout/in_queue/mean",
    "off_policy/in_queue/max": "staleness/rollout/in_queue/max",
    "off_policy/dropped": "staleness/rollout/dropped",
}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _prime_rl_logged_row(episodes: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """prime-rl's own per-episode staleness rule (frozen episodes count as 0), as its orchestrator logs it."""
    values = []
    for episode in episodes:
        policy = episode["run"]["work"].get("policy")
        if policy is None:
            values.append((0, 0, 0))
            continue
        total = max(0, (step - 1) - policy["start"])
        in_flight = min(total, max(0, policy["end"] - policy["start"]))
        values.append((total, in_flight, total - in_flight))
    totals, flights, queues = zip(*values, strict=True)
    return {
        "step": step,
        "off_policy/mean": sum(totals) / len(totals),
        "off_policy/max": float(max(totals)),
        "off_policy/in_flight/mean": sum(flights) / len(flights),
        "off_policy/in_flight/max": float(max(flights)),
        "off_policy/in_queue/mean": sum(queues) / len(queues),
        "off_policy/in_queue/max": float(max(queues)),
        "off_policy/dropped": 0.0,
    }


def test_replay_cli_reproduces_every_logged_off_policy_value(tmp_path: Path) -> None:
    out = tmp_path / "metrics.jsonl"
    assert main(["replay", str(EXAMPLE), "--policy", "episode", "--metrics-out", str(out)]) == 0
    replayed = {row["step"]: row for row in _jsonl(out)}
    logged = {row["step"]: row for row in _jsonl(EXAMPLE / "metrics.jsonl")}
    assert sorted(replayed) == sorted(logged) == list(range(1, 21))
    for step, row in logged.items():
        for key in OFF_POLICY_KEYS:
            assert replayed[step][NEW_KEY[key]] == pytest.approx(row[key], abs=1e-12), (step, key)


def test_a_torn_last_line_of_metrics_jsonl_ends_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run still being written: its metrics.jsonl read to the torn line and said (replay died with a
    traceback, report refused the run)."""
    run = tmp_path / "run"
    shutil.copytree(EXAMPLE, run)
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-40])
    assert main(["replay", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"{metrics}: a torn last line (line 20), read as the end" in err
    assert "prime-rl's logged orchestrator staleness: 19 of 19 steps equal ours" in err
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0


def test_comparison_marks_every_step_of_the_example_as_matching() -> None:
    shipments = replay(as_replay_events(read_prime_rl(EXAMPLE)), StalenessConfig(policy="episode"))
    rows = compare_prime_rl(EXAMPLE, [s.report for s in shipments])
    assert len(rows) == 20 * len(OFF_POLICY_KEYS)
    assert comparison_summary(rows)["match"] == list(range(1, 21))
    assert {r.status for r in rows} == {"match"}


def _frozen_copy(tmp_path: Path, frozen_ids: set[str]) -> Path:
    """The example with some episodes turned into frozen-model ones, logged by prime-rl's rule."""
    run = tmp_path / "run"
    shutil.copytree(EXAMPLE, run)
    logged = []
    for step in range(1, 21):
        for subset in ("all", "effective"):
            path = run / f"rollouts/step_{step}/train/{subset}/traces.jsonl"
            episodes = _jsonl(path)
            for episode in episodes:
                if episode["id"] in frozen_ids:
                    del episode["run"]["work"]["policy"]
            _write_jsonl(path, episodes)
        logged.append(_prime_rl_logged_row(_jsonl(run / f"rollouts/step_{step}/train/effective/traces.jsonl"), step))
    _write_jsonl(run / "metrics.jsonl", logged)
    return run


def test_frozen_episodes_show_as_the_difference_they_are(tmp_path: Path) -> None:
    # s7-e3 is the oldest episode of step 7; every shipped episode of step 13 becomes frozen.
    run = _frozen_copy(tmp_path, {"s4-e2", "s7-e3", "s13-e0", "s13-e3"})
    shipments = replay(as_replay_events(read_prime_rl(run)), StalenessConfig(policy="episode"))
    by_step = {s.step: s.report for s in shipments}
    assert by_step[7].tally.rollouts_frozen == 1 and by_step[7].tally.rollouts_shipped == 4
    # SPEC leaves frozen rollouts out: step 7's mean is over its 4 live episodes (3, 3, 1, 2).
    assert by_step[7].metrics["staleness/rollout/mean"] == pytest.approx(9 / 4)
    assert "staleness/rollout/mean" not in by_step[13].metrics  # nothing live shipped

    rows = compare_prime_rl(run, [s.report for s in shipments])
    summary = comparison_summary(rows)
    assert summary["prime_rl_rule"] == [4, 7, 13]
    assert summary["match"] == [s for s in range(1, 21) if s not in (4, 7, 13)]
    assert summary["mismatch"] == summary["missing"] == []
    step7 = {r.legacy_key: r for r in rows if r.step == 7}
    mean = step7["off_policy/mean"]
    # The logged value is prime-rl's (frozen as 0, over 5 episodes); the recomputed one is SPEC's.
    assert mean.status == "prime_rl_rule"
    assert mean.historical == pytest.approx(9 / 5) and mean.recomputed == pytest.approx(9 / 4)
    assert mean.legacy_rule == pytest.approx(mean.historical)
    assert step7["off_policy/max"].status == "match"  # max is 3 either way: the frozen 0 changes nothing
    step13 = {r.legacy_key: r for r in rows if r.step == 13}
    assert step13["off_policy/mean"].recomputed is None and step13["off_policy/mean"].legacy_rule == 0.0


def test_unshipped_episodes_enter_only_when_stale_at_the_replayed_bound() -> None:
    """At bound 3, an arrival that was not shipped counts as a stale drop exactly when T - start > 3."""
    bound = 3
    expected_drops = {}
    for step in range(1, 21):
        arrivals = _jsonl(EXAMPLE / f"rollouts/step_{step}/train/all/traces.jsonl")
        expected_drops[step] = sum((step - 1) - e["run"]["work"]["policy"]["start"] > bound for e in arrivals)
    sink = Sink(StalenessConfig(policy="episode", max_staleness=bound))
    shipments = run_events(as_replay_events(read_prime_rl(EXAMPLE, max_staleness=bound)), sink)
    assert {s.step: s.report.metrics["staleness/rollout/dropped"] for s in shipments} == expected_drops
    assert sink.queued == 0  # discarded-for-other-reasons episodes never sit in the queue


def test_no_unshipped_episode_enters_when_none_is_stale() -> None:
    events = list(read_prime_rl(EXAMPLE, max_staleness=8))
    added = {e["rollout"]["id"] for e in events if e["type"] == "rollout"}
    shipped = {i for e in events if e["type"] == "ship" for i in e["ids"]}
    assert added == shipped
    assert "s1-e0" not in added  # in step 1's arrivals, never shipped, not stale


def test_each_trace_is_one_unlabelled_sample_so_token_figures_are_per_trace() -> None:
    shipments = replay(as_replay_events(read_prime_rl(EXAMPLE)), StalenessConfig(policy="episode"))
    step2 = shipments[1].report
    # Step 2 ships 8 episodes with 12 traces; staleness per trace: 1; 1,1; 0,0; 1; 0,0; 1; 1; 0,0 -> 6 / 12.
    assert step2.tally.tokens_sampled == 12
    assert step2.metrics["staleness/token/unlabelled"] == 1.0
    assert step2.metrics["staleness/token/mean"] == pytest.approx(0.5)
    assert step2.metrics["staleness/rollout/mean"] == pytest.approx(0.625)


def test_an_episode_shipped_after_the_step_it_arrived_in_is_named_by_the_later_ship(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(EXAMPLE, run)
    # s2-e2 (start 1, end 1) arrived for batch 2 but ships with batch 3.
    effective2 = run / "rollouts/step_2/train/effective/traces.jsonl"
    effective3 = run / "rollouts/step_3/train/effective/traces.jsonl"
    moved = [e for e in _jsonl(effective2) if e["id"] == "s2-e2"]
    _write_jsonl(effective2, [e for e in _jsonl(effective2) if e["id"] != "s2-e2"])
    _write_jsonl(effective3, _jsonl(effective3) + moved)
    events = list(read_prime_rl(run))
    position = {e["rollout"]["id"]: i for i, e in enumerate(events) if e["type"] == "rollout"}
    ships = {e["step"]: i for i, e in enumerate(events) if e["type"] == "ship"}
    assert ships[1] < position["s2-e2"] < ships[2]  # added on arrival, before batch 2 ships
    shipments = replay(as_replay_events(events), StalenessConfig(policy="episode"))
    assert "s2-e2" not in shipments[1].ids and "s2-e2" in shipments[2].ids
    # In batch 3 (T = 2) it is 1 version stale, all of it in the queue: 7 + 1 over 7 episodes.
    assert shipments[2].report.metrics["staleness/rollout/mean"] == pytest.approx(8 / 7)


def test_an_episode_without_a_usable_id_names_its_file_and_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(EXAMPLE, run)
    traces = run / "rollouts/step_2/train/all/traces.jsonl"
    episodes = _jsonl(traces)
    episodes[1]["id"] = 7
    _write_jsonl(traces, episodes)
    with pytest.raises(EventError, match=r"^line 2: .*step_2/train/all/traces.jsonl: rollout None: field id: "):
        list(read_prime_rl(run))
