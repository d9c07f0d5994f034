"""Recording rules and alerts: promtool checks them and runs their unit tests; and the scrape config."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from staleness_metrics.dashboards.rules import Thresholds, render_rules, rule_groups

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "exporters" / "prometheus"
RULES = PROMETHEUS_DIR / "staleness.rules.yml"
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install the Debian package `prometheus`")
    return path


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", "--lint=all", "--lint-fatal", RULES.name, cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    assert RULE_TESTS
    result = run(promtool, "test", "rules", *(str(p) for p in RULE_TESTS), cwd=PROMETHEUS_DIR / "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_catch_a_wrong_threshold(promtool: str, tmp_path: Path) -> None:
    """The unit tests pin the alerts' behaviour: rules with another threshold fail them."""
    (tmp_path / "tests").mkdir()
    (tmp_path / RULES.name).write_text(render_rules(Thresholds(masked_ratio=0.5)))
    for test in RULE_TESTS:
        shutil.copy(test, tmp_path / "tests" / test.name)
    result = run(promtool, "test", "rules", *(p.name for p in RULE_TESTS), cwd=tmp_path / "tests")
    assert result.returncode == 1
    assert "RLStalenessMaskedRatioHigh" in result.stdout + result.stderr


def test_promtool_unit_tests_catch_a_wrong_excess_threshold(promtool: str, tmp_path: Path) -> None:
    """The mismatch alert's tests pin its threshold: at 0.05 nats the firing scenario stays quiet."""
    (tmp_path / "tests").mkdir()
    (tmp_path / RULES.name).write_text(render_rules(Thresholds(excess_k3=0.05)))
    for test in RULE_TESTS:
        shutil.copy(test, tmp_path / "tests" / test.name)
    result = run(promtool, "test", "rules", *(p.name for p in RULE_TESTS), cwd=tmp_path / "tests")
    assert result.returncode == 1
    assert "RLStalenessMismatchExcessHigh" in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("thresholds", "alert"),
    [
        (Thresholds(bound_tight_margin=3), "RLStalenessBoundTooTight"),  # r1's suggestion 10 is only 2 above
        (Thresholds(bound_tight_masked=0.05), "RLStalenessBoundTooTight"),  # r1 masks 5%: not above 0.05
        (Thresholds(bound_loose_for="25m"), "RLStalenessBoundTooLoose"),  # still pending at 20m
    ],
)
def test_promtool_unit_tests_pin_the_bound_alerts(
    promtool: str, tmp_path: Path, thresholds: Thresholds, alert: str
) -> None:
    """SPEC 14's alerts: their firing scenarios are the near side of each threshold."""
    (tmp_path / "tests").mkdir()
    (tmp_path / RULES.name).write_text(render_rules(thresholds))
    for test in RULE_TESTS:
        shutil.copy(test, tmp_path / "tests" / test.name)
    result = run(promtool, "test", "rules", *(p.name for p in RULE_TESTS), cwd=tmp_path / "tests")
    assert result.returncode == 1
    assert alert in result.stdout + result.stderr


def test_the_mismatch_alert_only_looks_at_lags_within_the_bound() -> None:
    """One term per lag bucket above 0, each gated by the run's max_staleness at the bucket's smallest lag."""
    (alert,) = (a for a in rule_groups()["groups"][1]["rules"] if a["alert"] == "RLStalenessMismatchExcessHigh")
    terms = alert["expr"].split(" or ")
    lags = [re.search(r'lag="([^"]+)"', t).group(1) for t in terms]  # type: ignore[union-attr]
    assert lags == [str(lag) for lag in range(1, 17)] + ["32", "64", "+Inf"]
    lowest = [int(t.rsplit(">=", 1)[1].strip(" )")) for t in terms]
    assert lowest == [*range(1, 17), 17, 33, 65]
    assert all("rl_staleness_max_staleness" in t for t in terms)


def test_promtool_accepts_the_example_scrape_config(promtool: str) -> None:
    result = run(promtool, "check", "config", "prometheus.yml", cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == [RULES.name]
    targets = [t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]]
    assert all(t.startswith("127.0.0.1:") for t in targets)


def test_recording_rules_are_named_level_metric_operations() -> None:
    records = [r["record"] for r in rule_groups()["groups"][0]["rules"]]
    assert records
    for record in records:
        assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", record), record
        level, metric, _ = record.split(":")
        assert metric.startswith("rl_staleness_") and not metric.endswith("_total"), record
        assert level.split("_")[:2] == ["job", "run"], record


def test_alerts_have_severity_summary_description_and_for() -> None:
    alerts = rule_groups()["groups"][1]["rules"]
    assert {a["alert"] for a in alerts} == {
        "RLStalenessMaskedRatioHigh",
        "RLStalenessDroppedRolloutsHigh",
        "RLStalenessRolloutsAtBound",
        "RLStalenessMismatchExcessHigh",
        "RLStalenessBoundTooLoose",
        "RLStalenessBoundTooTight",
        "RLStalenessMetricsAbsent",
    }
    for alert in alerts:
        assert alert["labels"]["severity"] in {"warning", "critical"}, alert["alert"]
        assert set(alert["annotations"]) == {"summary", "description"}, alert["alert"]
        assert re.fullmatch(r"\d+m", alert["for"]), alert["alert"]
    absent = next(a for a in alerts if a["alert"] == "RLStalenessMetricsAbsent")
    assert absent["expr"].startswith("absent_over_time(")


def test_every_alert_has_a_firing_and_a_quiet_scenario_and_every_record_a_test() -> None:
    scenarios = [t for path in RULE_TESTS for t in yaml.safe_load(path.read_text())["tests"]]
    alerts = {a["alert"] for a in rule_groups()["groups"][1]["rules"]}
    for alert in alerts:
        cases = [c for s in scenarios for c in s.get("alert_rule_test", []) if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in cases), f"{alert} never fires in the tests"
        quiet = [s for s in scenarios if all(not c["exp_alerts"] for c in s.get("alert_rule_test", []))]
        assert any(c["alertname"] == alert for s in quiet for c in s.get("alert_rule_test", [])), (
            f"{alert} has no scenario where it stays quiet"
        )
    tested = {c["expr"].split("{")[0] for s in scenarios for c in s.get("promql_expr_test", [])}
    records = {r["record"] for r in rule_groups()["groups"][0]["rules"]}
    assert records <= tested
