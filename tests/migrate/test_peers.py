"""``migrate --from PEER``: each peer's fixture dashboard, history (and config) checked, diffed and written.

Keys with the same meaning are renamed (in PromQL to this project's series), keys whose meaning differs
are reported with their reason and left alone, and the exit status follows the legacy migration.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from staleness_metrics.metrics.metric_table import metric_by_key
from staleness_metrics.migrate.peers import PEER_KEYS, PEERS, peer_keys
from tests.migrate.cli import FIXTURES, migrate

PEER_FIXTURES = FIXTURES / "peers"

# (peer, renamed in the fixtures: old -> new, reported only)
EXPECTED = {
    "verl": (
        {
            "training/off_policy/trajectory_staleness/mean": "staleness/rollout/in_queue/mean",
            "training/off_policy/trajectory_staleness/max": "staleness/rollout/in_queue/max",
            "training/off_policy/trajectory_staleness_worst/mean": "staleness/rollout/mean",
            "training/off_policy/trajectory_staleness_worst/max": "staleness/rollout/max",
            "fully_async/partial/max_partial_span": "staleness/rollout/in_flight/max",
            "training_off_policy_trajectory_staleness_mean": "rl_staleness_rollout_in_queue_mean_steps",
            "training_off_policy_trajectory_staleness_worst_max": "rl_staleness_rollout_max_steps",
        },
        {"training_off_policy_trajectory_spans_mean", "fully_async/partial/partial_ratio",
         "fully_async/count/dropped_stale_samples", "training/off_policy/evicted_samples_staleness/mean",
         "fully_async/count/staleness_samples"},
    ),
    "skyrl": (
        {
            "async/staleness_mean": "staleness/rollout/mean",
            "async/staleness_max": "staleness/rollout/max",
            "async_staleness_mean": "rl_staleness_rollout_mean_steps",
            "async_staleness_max": "rl_staleness_rollout_max_steps",
        },
        {"async/staleness_min", "async/staleness_ratio", "async_staleness_ratio"},
    ),
    "areal": ({}, {"max_head_offpolicyness", "behave_imp_weight", "ppo_actor/update/behave_imp_weight/avg",
                   "ppo_actor/update/behave_approx_kl/avg",
                   "ppo_actor/update/version_stats/sample_staleness_theta_avg",
                   "ppo_actor/update/version_stats/sample_staleness_theta_avg__count",
                   "ppo_actor/update/version_stats/sample_staleness_theta_max",
                   "ppo_actor/update/version_stats/sample_staleness_proximal_avg",
                   "ppo_actor/update/version_stats/v_theta"}),
    "trl": ({}, {"sample/staleness_mean", "sample/staleness_max", "sample/dropped_stale_total",
                 "sample/time_in_queue_s", "sample_staleness_max"}),
    "nemo-rl": (
        {
            "train/avg_trajectory_age": "staleness/rollout/mean",
            "train_avg_trajectory_age": "rl_staleness_rollout_mean_steps",
        },
        set(),
    ),
    "roll": ({}, {"async_generation_ratio", "scheduler/off_policy_ratio"}),
    "pipelinerl": ({}, {"stats/lag", "stats_lag", "stats_min_actor_version", "stats/min_actor_version",
                        "stats/samples_too_old_to_train", "stats/lag_mean", "stats/lag_max", "stats_lag_max"}),
}  # fmt: skip


def _copy(peer: str, tmp_path: Path) -> Path:
    target = tmp_path / peer
    shutil.copytree(PEER_FIXTURES / peer, target)
    return target


def test_every_peer_has_a_fixture_and_every_row_a_source_and_a_reason() -> None:
    assert set(EXPECTED) == set(PEERS) == {path.name for path in PEER_FIXTURES.iterdir()}
    for row in PEER_KEYS:
        assert row.source and row.reason, row
        if row.new is not None:
            metric_by_key(row.new)  # a key of the metric table, not an invented one
    assert len({(row.peer, row.key) for row in PEER_KEYS}) == len(PEER_KEYS)
    with pytest.raises(ValueError, match="unknown peer"):
        peer_keys("nope")


@pytest.mark.parametrize("peer", sorted(EXPECTED))
def test_check_lists_renames_and_reasons_and_fails(
    peer: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = _copy(peer, tmp_path)
    before = {p.name: p.read_text() for p in folder.iterdir()}
    run = migrate(capsys, "--from", peer, "--check", str(folder))
    assert run.code == 1, run.err
    renamed, reported = EXPECTED[peer]
    for old, new in renamed.items():
        assert any(f"{old} -> {new} (" in line for line in run.lines), (old, run.out)
    for old in reported:
        hits = [line for line in run.lines if f": {old}: not edited ({peer}: " in line]
        assert hits, (old, run.out)
        assert "[" in hits[0] and "]" in hits[0]  # the source file of the key is named
    assert {p.name: p.read_text() for p in folder.iterdir()} == before  # --check changes nothing


@pytest.mark.parametrize("peer", sorted(EXPECTED))
def test_write_renames_same_meaning_keys_only(peer: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = _copy(peer, tmp_path)
    history_before = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    run = migrate(capsys, "--from", peer, "--write", str(folder))
    assert run.code == 0, run.err
    renamed, reported = EXPECTED[peer]
    history = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    dashboard = (folder / "dashboard.json").read_text()
    json.loads(dashboard)  # still a valid dashboard
    flat_keys = {key for row in history for key in row}
    for old, new in renamed.items():
        assert old not in flat_keys and old not in dashboard
        assert new in flat_keys or new in dashboard
    for old in reported:
        assert old in flat_keys or old in dashboard or any(old in p.read_text() for p in folder.iterdir())
    # values are untouched: every old value sits under its new key on the same step
    data_rows = [row for row in history if "migrate/legacy_through_step" not in row]
    for old_row, new_row in zip(history_before, data_rows, strict=True):
        for key, value in old_row.items():
            assert new_row[renamed.get(key, key)] == value
    has_marker = any("migrate/legacy_through_step" in row for row in history)
    assert has_marker == any("/" in old for old in renamed)  # a boundary line only where keys changed meaning
    again = migrate(capsys, "--from", peer, "--check", str(folder))
    assert again.code == (1 if reported else 0)  # what differs keeps being reported
    assert not any(" -> " in line and "not edited" not in line for line in again.lines)


def test_peer_mode_leaves_this_projects_legacy_names_alone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    history = tmp_path / "metrics.jsonl"
    history.write_text('{"step": 1, "off_policy/mean": 2.0, "async/staleness_mean": 1.5}\n')
    run = migrate(capsys, "--from", "skyrl", "--write", str(history))
    assert run.code == 0
    assert json.loads(history.read_text().splitlines()[0]) == {
        "step": 1,
        "off_policy/mean": 2.0,
        "staleness/rollout/mean": 1.5,
    }


def test_a_wandb_regex_over_peer_keys_is_rewritten_only_when_every_key_maps(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "panels.json"
    spec.write_text(json.dumps({"panel_regexes": ["async/staleness_(mean|max)", "async/staleness_.*"]}, indent=2))
    run = migrate(capsys, "--from", "skyrl", "--write", str(spec))
    assert run.code == 0
    regexes = json.loads(spec.read_text())["panel_regexes"]
    assert regexes[0] == r"^(?:staleness/rollout/max|staleness/rollout/mean)$"
    assert regexes[1] == "async/staleness_.*"  # also matches staleness_ratio, which has no equivalent
    assert any("async/staleness_.*: not edited" in line and "async/staleness_ratio" in line for line in run.lines)
