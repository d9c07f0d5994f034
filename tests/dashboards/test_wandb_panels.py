"""The W&B "Staleness" section: built offline with wandb-workspaces, over keys the core really logs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest

from staleness_metrics.cli.commands import wandb_workspace as command
from staleness_metrics.dashboards.wandb_panels import (
    SECTION,
    MissingApiKey,
    build_workspace,
    panels,
    save,
    workspace_spec,
)
from staleness_metrics.exporters.wandb import DEFAULT_STEP_KEY
from staleness_metrics.metrics.metric_table import METRICS, Source

from .traffic import ENVS, Traffic

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def logged_keys() -> set[str]:
    """Every key the metrics core wrote over a run with masking, drops and the env breakdown."""
    traffic = Traffic()
    keys: set[str] = set()
    for _ in range(12):
        keys |= set(traffic.next_report().metrics)
    # the W&B exporter also logs the histograms, from the report's bucket counts
    histograms = (Source.TOKEN_HISTOGRAM, Source.ROLLOUT_HISTOGRAM)
    return keys | {m.wandb_key for m in METRICS if m.source in histograms and m.wandb_key}


def test_workspace_has_a_staleness_section_with_the_spec_panels() -> None:
    workspace = build_workspace("my-team", "async-rl", x_axis=DEFAULT_STEP_KEY)
    (section,) = workspace.sections
    assert section.name == SECTION and section.is_open
    built = dataclasses.asdict(workspace)["sections"][0]["panels"]
    specs = panels()
    assert [p["title"] for p in built] == [s.title for s in specs]
    for panel, spec in zip(built, specs, strict=True):
        if spec.kind == "scalar":
            assert panel["metric"] == spec.keys[0]
            continue
        assert panel["x"] == DEFAULT_STEP_KEY, "steps must line up with the trainer's, not W&B's own"
        assert panel["y"] == list(spec.keys)
        assert panel["metric_regex"] == spec.metric_regex
        assert panel["plot_type"] == ("stacked-area" if spec.stacked else "line")


def test_line_plots_show_keys_the_core_logs(logged_keys: set[str]) -> None:
    for spec in panels():
        for key in spec.keys:
            assert key in logged_keys, f"{spec.title}: {key} is never logged"


def test_per_bucket_panels_match_the_bucket_keys_the_core_logs(logged_keys: set[str]) -> None:
    """SPEC 11 / 12 families: one key per lag or length bucket, matched by the row's template."""
    bucket_panels = {s.title: s for s in panels() if s.metric_regex and "per env" not in s.title}
    assert set(bucket_panels) == {
        "Excess k3 over the floor by lag",
        "Mismatch k3 by lag",
        "Effective sample size by lag",
        "Out-of-band share by lag",
        "Removed share by length bucket",
    }
    for spec in bucket_panels.values():
        assert spec.metric_regex is not None
        matched = {k for k in logged_keys if re.search(spec.metric_regex, k)}
        # several lags had tokens; the traffic's samples all fall in the 256 length bucket
        assert len(matched) >= (1 if "length" in spec.title else 2), spec.title
        assert not any(k.startswith("staleness/env/") for k in matched), spec.title
    excess = {k for k in logged_keys if re.search(bucket_panels["Mismatch k3 by lag"].metric_regex or "", k)}
    assert "staleness/mismatch/lag_0/k3" in excess and "staleness/mismatch/lag_3/k3" in excess


def test_per_env_panels_match_only_per_env_keys(logged_keys: set[str]) -> None:
    regex_panels = [s for s in panels() if s.metric_regex and "per env" in s.title]
    assert regex_panels
    for spec in regex_panels:
        assert spec.metric_regex is not None
        matched = {k for k in logged_keys if re.search(spec.metric_regex, k)}
        assert {k.split("/")[2] for k in matched} == set(filter(None, ENVS)), spec.title
        assert all(k.startswith("staleness/env/") for k in matched)


def test_the_bound_is_plotted_with_staleness() -> None:
    vs_bound = [spec for spec in panels() if "vs bound" in spec.title]
    assert [spec.title for spec in vs_bound] == [
        "Token staleness mean vs bound",
        "Rollout staleness mean and max vs bound",
    ]
    for spec in vs_bound:
        assert "staleness/max_staleness" in spec.keys, spec.title


def test_committed_spec_matches_the_built_panels() -> None:
    committed = json.loads((ROOT / "dashboards" / "wandb-workspace.json").read_text())
    assert committed == json.loads(json.dumps(workspace_spec(DEFAULT_STEP_KEY)))
    assert committed["x_axis"] == DEFAULT_STEP_KEY


def test_saving_without_an_api_key_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(MissingApiKey, match="WANDB_API_KEY"):
        save("my-team", "async-rl", x_axis=DEFAULT_STEP_KEY)

    parser = argparse.ArgumentParser(prog="staleness-metrics")
    command.register(parser.add_subparsers())
    args = parser.parse_args(["wandb-workspace", "--entity", "my-team", "--project", "async-rl"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("staleness-metrics wandb-workspace: ")  # as every command says why it stops
    assert "WANDB_API_KEY" in err and "API key" in err
