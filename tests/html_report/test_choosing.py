"""One report of a run: ``staleness-metrics report DIR`` on the directory the demo writes, its "Choosing the
bound" figure read back from headless Chromium."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from staleness_metrics.cli import main
from staleness_metrics.demo import DriftModel
from staleness_metrics.html_report.svg import PALETTE
from staleness_metrics.metrics.mismatch import MismatchSums
from staleness_metrics.replay.run_dir import find_run
from staleness_metrics.replay.what_if import what_if_with_curve
from tests.support.drift import expected_suggested_bound

from .chromium import chart_boxes, probe, requires_chromium, screenshot
from .test_report import _count, _pixels

ROOT = Path(__file__).resolve().parents[2]

# The figure as the browser has it: every SVG text with its box, every point's hover title, the table's cells.
_FIGURE = """(() => {
  const figure = key => {
    const svg = document.querySelector(`figure[data-chart="${key}"] svg`);
    const r = svg.getBoundingClientRect();
    return {
      box: [r.left, r.top, r.right, r.bottom],
      texts: [...svg.querySelectorAll("text")].map(t => {
        const b = t.getBoundingClientRect();
        return {text: t.textContent, box: [b.left, b.top, b.right, b.bottom]};
      }),
      titles: [...svg.querySelectorAll("circle > title")].map(t => t.textContent),
    };
  };
  return {
    curve: figure("bound-curve"),
    kept: figure("bound-kept"),
    rows: [...document.querySelectorAll("#bound-table tr")].slice(1).map(
      tr => [...tr.querySelectorAll("td")].map(td => td.textContent)),
    sections: [...document.querySelectorAll("section[id]")].map(s => s.id),
  };
})()"""


@pytest.fixture(scope="module")
def demo_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "staleness-demo"
    command = [sys.executable, "-m", "staleness_metrics.cli", "demo", "--steps", "25", "--speed", "0",
               "--no-wandb", "--prometheus-port", "0", "--out-dir", str(out)]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"done: 25 steps. Next: staleness-metrics report {out}"
    return out


def _inside(inner: list[float], outer: list[float]) -> bool:
    return outer[0] <= inner[0] and inner[2] <= outer[2] and outer[1] <= inner[1] and inner[3] <= outer[3]


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@requires_chromium
def test_the_report_of_a_demo_directory_shows_how_to_choose_the_bound(demo_directory: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    assert main(["report", str(demo_directory), "-o", str(page)]) == 0  # the command the demo names, nothing else

    # What the figure must say, from the directory itself: the sums the trainer posted, pooled by hand.
    run = find_run(demo_directory)
    assert run is not None
    config = run.staleness_config()
    pooled = sum((sums for _, sums in run.posted_sums()), MismatchSums.zero())
    floor = pooled.sum_k3[0] / pooled.tokens[0]
    lags = [lag for lag in range(1, 17) if pooled.tokens[lag] >= config.floor_min_tokens]
    raw = {lag: pooled.sum_k3[lag] / pooled.tokens[lag] - floor for lag in lags}
    result = what_if_with_curve(demo_directory, range(9), config)  # the kept share the report puts beside it
    assert result.curve is not None
    suggested = result.curve.suggested
    assert suggested is not None and abs(suggested - expected_suggested_bound(DriftModel())) <= 1

    # Over steps, each ship's suggestion as the run logged it (its window of cost_window ships).
    logged = [json.loads(line) for line in (demo_directory / "metrics.jsonl").read_text().splitlines()]
    last_suggested = [row["staleness/bound/suggested"] for row in logged if "staleness/bound/suggested" in row][-1]
    assert f"<title>suggested (window of cost_window ships) at 25: {last_suggested}</title>" in page.read_text()

    seen = probe(page, _FIGURE)
    # Every section, from one directory: staleness, what the run cost, and choosing the bound.
    assert seen["sections"][:3] == ["what-if-table", "what-staleness-costs", "choosing-the-bound"]
    curve = seen["curve"]
    texts = {t["text"]: t["box"] for t in curve["texts"]}
    budget, configured, suggestion = f"budget {floor:.4g}", "configured bound 8", f"suggested bound {suggested}"
    for label in (budget, configured, suggestion, "raw excess e by lag", "curve ê (isotonic)"):
        assert label in texts and _inside(texts[label], curve["box"]), label
    assert not _overlap(texts[configured], texts[suggestion])
    # The raw excess of each lag with enough tokens, with its token count written beside the point.
    for lag in lags:
        tokens = int(pooled.tokens[lag])
        short = f"{tokens / 1000:.3g}k" if tokens < 1_000_000 else f"{tokens / 1e6:.3g}M"
        assert f"{short} tokens" in texts, lag
        assert f"raw excess e by lag at {lag}: {raw[lag]:.4g} ({short} tokens)" in curve["titles"]
    # The table beside it: lag, tokens, raw excess, curve, within budget, kept share at that bound.
    rows = {int(cells[0].split()[0]): cells for cells in seen["rows"]}
    assert sorted(rows) == lags
    kept = {row.max_staleness: row.kept_share for row in result.rows}
    for lag, cells in rows.items():
        assert cells[1] == f"{int(pooled.tokens[lag]):,}"
        assert float(cells[2]) == pytest.approx(raw[lag], rel=1e-3)
        assert cells[4] == ("yes" if float(cells[3]) <= floor * (1 + 1e-9) else "no")
        share = kept.get(lag)
        assert cells[5] == ("-" if share is None else f"{100 * share:.2f}%")
    assert rows[suggested][0] == f"{suggested} (suggested)" and rows[suggested][4] == "yes"
    assert rows[8][0] == "8 (configured)" and rows[suggested + 1][4] == "no"  # crossed right after it
    # Both charts on one axis: the suggested bound's line at the same x in each.
    kept_texts = {t["text"]: t["box"] for t in seen["kept"]["texts"]}
    assert kept_texts[suggestion][0] == pytest.approx(texts[suggestion][0], abs=0.5)

    # And drawn: the curve, the raw points and the kept share in their colours.
    height, boxes = chart_boxes(page)
    png = tmp_path / "report.png"
    assert screenshot(page, png, height) == []
    image = np.asarray(Image.open(png).convert("RGB"))
    by_key = {b.key: b for b in boxes}
    for key, colours in (("bound-curve", (PALETTE[0], PALETTE[1])), ("bound-kept", (PALETTE[2],))):
        pixels = _pixels(image, by_key[key])
        for colour in colours:
            assert _count(pixels, colour) >= 20, (key, colour)


def test_the_logged_rows_alone_give_the_same_curve(demo_directory: Path, tmp_path: Path) -> None:
    """A single file keeps working: the run's metrics.jsonl carries each step's k3 and tokens by lag, which
    pool into the same floor, curve and suggestion as the directory's sums."""
    run = find_run(demo_directory)
    assert run is not None
    config = run.staleness_config()
    result = what_if_with_curve(demo_directory, range(9), config)
    assert result.curve is not None
    page = tmp_path / "rows.html"
    assert main(["report", str(demo_directory / "metrics.jsonl"), "-o", str(page)]) == 0
    html = page.read_text()
    curve = result.curve
    assert (
        f"Floor {curve.floor.value:.4g} nats (lag0), budget {curve.budget:.4g} nats, configured bound 8, "
        f"suggested bound {curve.suggested}." in html
    )
    assert "from the logged k3 and tokens by lag" in html
    for lag, fitted in zip(curve.curve.lags, curve.curve.fitted, strict=True):
        assert f'<tr data-lag="{lag}">' in html or f'<tr class=current data-lag="{lag}">' in html
        assert f"<td>{fitted:.4g}</td>" in html


def test_an_adaptive_run_marks_the_bound_in_force_at_its_end(tmp_path: Path) -> None:
    """With --adapt-every, the demo's bound walks from 8 to the suggestion (SPEC 14); the report marks the bound
    the run ended with, and says where it started."""
    out = tmp_path / "adaptive"
    command = [sys.executable, "-m", "staleness_metrics.cli", "demo", "--steps", "30", "--speed", "0", "--no-wandb",
               "--prometheus-port", "0", "--adapt-every", "3", "--out-dir", str(out)]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    bounds = [row["staleness/max_staleness"] for row in logged if "staleness/max_staleness" in row]
    assert bounds[0] == 8 and bounds[-1] < 8  # it walked down
    page = tmp_path / "adaptive.html"
    assert main(["report", str(out), "-o", str(page)]) == 0
    html = page.read_text()
    assert f"bound in force {bounds[-1]} (adapted from 8)" in html
    assert f'data-lag="{bounds[-1]}"><td>{bounds[-1]} (bound in force' in html
