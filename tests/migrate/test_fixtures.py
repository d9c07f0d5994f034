"""The realistic fixtures end to end: check, diff, write, check again, and the tools that read the results.

``fixtures/before`` holds a prime-rl style orchestrator TOML, a trainer YAML config, a Grafana dashboard
with off_policy panels, a W&B workspace spec and a regex panel list, an alert rule file and a metrics
history spanning the rename. ``fixtures/expected`` is each file after ``--write --drop-removed``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import promql_parser
import pytest

from staleness_metrics.config import StalenessConfig
from staleness_metrics.migrate.driver import load_config
from staleness_metrics.migrate.legacy import CURRENT_PROMETHEUS_NAMES
from tests.support.programs import missing_program
from tests.support.prometheus import PROMTOOL, requires_promtool

from .cli import BEFORE, EXPECTED, apply_patch, migrate, migrate_process

LEGACY_TEXT = re.compile(r"off_policy|Off-Policy|max_off_policy_steps")


@pytest.fixture
def work(tmp_path: Path) -> Path:
    copy = tmp_path / "configs"
    shutil.copytree(BEFORE, copy)
    return copy


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_check_lists_each_place_and_fails(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(work)
    run = migrate(capsys, "--check", str(work))
    assert run.code == 1
    assert _snapshot(work) == before  # --check never writes
    toml = [line.removeprefix(str(work) + "/") for line in run.lines if "orchestrator.toml" in line]
    assert toml == [
        "orchestrator.toml:14: max_off_policy_steps -> max_staleness (renamed setting)",
        "orchestrator.toml:15: max_off_policy_steps -> max_staleness (renamed setting)",
        "orchestrator.toml:25: off_policy/mean -> staleness/rollout/mean (renamed)",
        "orchestrator.toml:25: off_policy/max -> staleness/rollout/max (renamed)",
        "orchestrator.toml:28: off_policy/max -> staleness/rollout/max (renamed)",
    ]
    # every legacy occurrence in every file is listed at its line
    for name, content in before.items():
        text = content.decode()
        listed = {int(line.split(":")[1].split("-")[0]) for line in run.lines if f"/{name}:" in line}
        if name == "metrics.jsonl":
            assert any(line.startswith(f"{work}/metrics.jsonl:1-5: off_policy/mean ->") for line in run.lines)
            continue
        legacy_lines = {n for n, line in enumerate(text.splitlines(), 1) if LEGACY_TEXT.search(line)}
        assert legacy_lines <= listed, (name, sorted(legacy_lines - listed))
    assert "removed" in run.out and 'deletes panel "Token max"' in run.out
    assert "legacy name(s) in 7 file(s)" in run.err


def test_write_changes_only_the_legacy_names(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = migrate(capsys, "--write", "--drop-removed", str(work))
    assert run.code == 0, run.err
    for expected in sorted(EXPECTED.iterdir()):
        assert (work / expected.name).read_bytes() == expected.read_bytes(), expected.name
    for path in work.iterdir():
        assert not LEGACY_TEXT.search(path.read_text()), f"{path.name} still names a legacy key"
    assert migrate(capsys, "--check", str(work)).code == 0
    again = _snapshot(work)
    assert migrate(capsys, "--write", "--drop-removed", str(work)).code == 0
    assert _snapshot(work) == again  # idempotent
    assert not [p for p in work.iterdir() if p.name.startswith(".")]  # no temp files left behind


def test_the_orchestrator_toml_keeps_every_other_byte(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The headline case, spelled out: the original with only these lines replaced."""
    original = (BEFORE / "orchestrator.toml").read_text().splitlines(keepends=True)
    assert migrate(capsys, "--write", str(work / "orchestrator.toml")).code == 0
    replaced = {
        14: "# versions; older rollouts are dropped (max_staleness = 8 is the default).\n",
        15: "max_staleness = 8    # tighter bounds drop more rollouts\n",
        25: 'pinned = ["staleness/rollout/mean", "staleness/rollout/max", "reward/mean"]\n',
        28: '"staleness/rollout/max" = { above = 6, for = "10m" }\n',
    }
    expected = [replaced.get(number, line) for number, line in enumerate(original, 1)]
    assert (work / "orchestrator.toml").read_text() == "".join(expected)
    table = load_config((work / "orchestrator.toml").read_text(), "toml")
    assert table["orchestrator"]["max_staleness"] == 8
    assert "max_off_policy_steps" not in table["orchestrator"]


def test_without_drop_removed_the_removed_panels_stay_and_are_reported(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = migrate(capsys, "--write", str(work))
    assert run.code == 0
    dashboard = json.loads((work / "rl-dashboard.json").read_text())
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert "Token max" in titles and "Dispatcher off-policy level" in titles
    assert "off_policy/token/max" in (work / "metrics.jsonl").read_text()  # history data is kept
    check = migrate(capsys, "--check", str(work))
    assert check.code == 1
    left = {line.split(": ", 1)[1] for line in check.lines}
    assert any(line.startswith("off_policy_token_max: removed") for line in left)
    assert any(line.startswith("orchestrator_off_policy_level_max: removed") for line in left)
    assert all("removed" in line for line in left), left  # only what has no new name is left


def test_diff_is_a_patch_that_does_what_write_does(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(work)
    run = migrate(capsys, "--diff", "--drop-removed", str(work))
    assert run.code == 0
    assert _snapshot(work) == before  # --diff only prints
    assert run.out.startswith(f"--- a/{work}/")
    assert run.out.count("\n--- a/") + 1 == len(list(EXPECTED.iterdir()))  # one patch per changed file
    (tmp_path / "changes.patch").write_text(run.out)
    if shutil.which("patch") is not None:  # GNU patch, as a user applies it
        patched = subprocess.run(
            ["patch", "-p1", "-d", "/", "-i", str(tmp_path / "changes.patch")], capture_output=True, text=True
        )
        assert patched.returncode == 0, patched.stdout + patched.stderr
    else:
        apply_patch(run.out)
    for expected in EXPECTED.iterdir():
        assert (work / expected.name).read_bytes() == expected.read_bytes(), expected.name


def test_as_a_process_exit_status_is_what_ci_sees(work: Path) -> None:
    check = migrate_process("--check", ".", cwd=work)
    assert check.returncode == 1, check.stderr
    assert "orchestrator.toml:15: max_off_policy_steps -> max_staleness" in check.stdout
    write = migrate_process("--write", "--drop-removed", ".", cwd=work)
    assert write.returncode == 0, write.stderr
    assert "updated orchestrator.toml" in write.stdout.replace("./", "")
    assert migrate_process("--check", ".", cwd=work).returncode == 0


def test_the_migrated_config_loads_in_the_project_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "staleness.toml"
    config.write_text('# sink settings\n[staleness]\npolicy = "token"\nmax_off_policy_steps = 6  # bound\n')
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessConfig.from_mapping(load_config(config.read_text(), "toml")["staleness"])
    assert migrate(capsys, "--write", str(config)).code == 0
    loaded = StalenessConfig.from_mapping(load_config(config.read_text(), "toml")["staleness"])
    assert loaded.max_staleness == 6
    assert config.read_text() == '# sink settings\n[staleness]\npolicy = "token"\nmax_staleness = 6  # bound\n'


@pytest.mark.integration
@requires_promtool
def test_promtool_accepts_the_migrated_rules(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    promtool = PROMTOOL or missing_program("promtool is not installed")
    assert migrate(capsys, "--write", "--drop-removed", str(work)).code == 0
    checked = subprocess.run([promtool, "check", "rules", str(work / "alerts.rules.yml")], capture_output=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert b"SUCCESS: 4 rules found" in checked.stdout


def _grafana_exprs(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "query", "definition") and isinstance(v, str)]
        return found + [e for v in node.values() for e in _grafana_exprs(v)]
    if isinstance(node, list):
        return [e for item in node for e in _grafana_exprs(item)]
    return []


def test_migrated_dashboard_queries_parse_and_name_only_current_series(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert migrate(capsys, "--write", "--drop-removed", str(work)).code == 0
    dashboard = json.loads((work / "rl-dashboard.json").read_text())
    exprs = [e for e in _grafana_exprs(dashboard) if e != "prometheus"]
    assert len(exprs) == 9
    recording_rules = {"job:rl_staleness_rollout_in_queue_mean_steps:avg5m"}
    for expr in exprs:
        expr = expr.replace("$__rate_interval", "1m").replace("$job", ".*")
        if expr.startswith("label_values("):
            expr = expr.removeprefix("label_values(").split(",")[0]
        promql_parser.parse(expr)  # raises on a syntax error
        for name in re.findall(r"[a-z_:]+(?=\{|\[|,|\)|$)", expr):
            if "staleness" in name:
                assert name in CURRENT_PROMETHEUS_NAMES or name in recording_rules, name


def test_trainer_code_is_reported_with_lines_and_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = BEFORE.parent / "text" / "train_loop.py"
    code = tmp_path / "train_loop.py"
    shutil.copy(source, code)
    run = migrate(capsys, "--write", str(tmp_path))
    assert run.code == 0
    assert code.read_bytes() == source.read_bytes()
    assert [line.split(" (")[0] for line in run.lines] == [
        f"{code}:7: off_policy/mean -> staleness/rollout/mean: not edited",
        f"{code}:7: off_policy/max -> staleness/rollout/max: not edited",
        f"{code}:8: Max Off-Policy -> Max Staleness: not edited",
    ]  # line 9 carries the ignore pragma
    assert migrate(capsys, "--check", str(code)).code == 1
