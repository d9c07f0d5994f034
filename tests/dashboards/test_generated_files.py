"""`staleness-metrics dashboards` writes the generated files, and `--check` catches drift from the table."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import pytest

from staleness_metrics.cli.commands import dashboards as command
from staleness_metrics.dashboards import generated_files, stale_files
from staleness_metrics.metrics import metric_table

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> int:
    parser = argparse.ArgumentParser(prog="staleness-metrics")
    command.register(parser.add_subparsers())
    parsed = parser.parse_args(["dashboards", *args])
    code: int = parsed.func(parsed)
    return code


def rename(monkeypatch: pytest.MonkeyPatch, name: str, new_prometheus_name: str) -> None:
    rows = tuple(
        dataclasses.replace(m, prometheus_name=new_prometheus_name) if m.name == name else m
        for m in metric_table.METRICS
    )
    monkeypatch.setattr(metric_table, "METRICS", rows)


def test_committed_files_are_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    assert stale_files(ROOT) == []
    assert cli("--check", "--out", str(ROOT)) == 0
    assert "up to date" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("row", "new_name", "stale"),
    [
        # a gauge only the dashboards and the OTel rename read
        (
            "token_mean",
            "rl_staleness_token_mean_versions",
            {"dashboards/staleness.json", "dashboards/staleness-fleet.json", "exporters/otel/collector.yaml"},
        ),
        # a counter the dashboards and the recording rules read
        (
            "tokens_masked",
            "rl_staleness_masked_tokens_total",
            {
                "dashboards/staleness.json",
                "dashboards/staleness-fleet.json",
                "exporters/prometheus/staleness.rules.yml",
                "exporters/otel/collector.yaml",
            },
        ),
    ],
)
def test_check_fails_after_a_metric_is_renamed_in_the_table(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    row: str,
    new_name: str,
    stale: set[str],
) -> None:
    rename(monkeypatch, row, new_name)
    assert set(stale_files(ROOT)) == stale
    assert cli("--check", "--out", str(ROOT)) == 1
    err = capsys.readouterr().err
    assert "staleness-metrics dashboards" in err
    for path in stale:
        assert path in err
    assert any(new_name in generated_files()[path] for path in stale)


def test_a_renamed_w_and_b_key_makes_the_w_and_b_spec_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = tuple(
        dataclasses.replace(m, wandb_key="staleness/token/average") if m.name == "token_mean" else m
        for m in metric_table.METRICS
    )
    monkeypatch.setattr(metric_table, "METRICS", rows)
    assert stale_files(ROOT) == ["dashboards/wandb-workspace.json"]


def test_writes_every_file_into_a_fresh_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("--check", "--out", str(tmp_path)) == 1  # nothing there yet
    capsys.readouterr()
    assert cli("--out", str(tmp_path)) == 0
    written = capsys.readouterr().out
    for path, content in generated_files().items():
        assert (tmp_path / path).read_text(encoding="utf-8") == content
        assert path in written
    assert cli("--check", "--out", str(tmp_path)) == 0
    assert cli("--out", str(tmp_path)) == 0
    assert "up to date" in capsys.readouterr().out


def test_a_hand_edit_of_a_generated_file_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for path in generated_files():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    rules = tmp_path / "exporters/prometheus/staleness.rules.yml"
    rules.write_text(rules.read_text().replace("> 0.2", "> 0.5"))
    assert cli("--check", "--out", str(tmp_path)) == 1
    assert capsys.readouterr().err.splitlines()[1:] == ["  exporters/prometheus/staleness.rules.yml"]
    assert cli("--out", str(tmp_path)) == 0
    assert "> 0.2" in rules.read_text()


def test_rules_laid_out_differently_are_not_stale(tmp_path: Path) -> None:
    """Another YAML library version may format the same rules differently; only their content counts."""
    import yaml

    for path in generated_files():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    rules = tmp_path / "exporters/prometheus/staleness.rules.yml"
    rules.write_text(yaml.safe_dump(yaml.safe_load(rules.read_text()), indent=4, width=60))
    assert stale_files(tmp_path) == []


def test_an_unwritable_output_is_an_error_message_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli("--out", str(blocker)) == 2  # a file where the root directory should be
    assert capsys.readouterr().err.startswith("staleness-metrics dashboards: ")
