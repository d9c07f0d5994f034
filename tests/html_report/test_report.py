"""``staleness-metrics report``: one self-contained page whose every chart renders in a real browser."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from staleness_metrics.cli.commands import report as report_command
from staleness_metrics.config import StalenessConfig
from staleness_metrics.demo import Simulation
from staleness_metrics.html_report.svg import PALETTE, Series, heatmap, line_chart
from staleness_metrics.replay.sources import as_replay_events
from staleness_metrics.replay.sources.events import read_event_file
from staleness_metrics.replay.stream import replay
from staleness_metrics.replay.what_if import what_if
from tests.support.examples import EXAMPLES

from .chromium import Box, chart_boxes, probe, requires_chromium, screenshot

CHARTS = ["token-staleness", "masked", "in-flight-queue", "dropped-held", "heatmap", "what-if"]
# The data marks each chart draws (solid fills and strokes in the report's palette).
DATA_COLOURS = {
    "token-staleness": [PALETTE[0]],
    "masked": [PALETTE[3]],
    "in-flight-queue": [PALETTE[0], PALETTE[1]],
    "dropped-held": [PALETTE[3], PALETTE[5]],
    "what-if": [PALETTE[3], PALETTE[4]],
}


def _report(tmp_path: Path, run: Path, *argv: str) -> Path:
    out = tmp_path / "report.html"
    parser = argparse.ArgumentParser(prog="staleness-metrics")
    report_command.register(parser.add_subparsers())
    args = parser.parse_args(["report", str(run), "-o", str(out), *argv])
    assert args.func(args) == 0
    return out


def _demo_events(path: Path, steps: int = 15) -> Path:
    with path.open("w") as handle:
        for _, step in zip(range(steps), Simulation(2).steps(), strict=False):
            handle.writelines(json.dumps(e) + "\n" for e in step.events())
    return path


def _rgb(colour: str) -> npt.NDArray[np.int16]:
    return np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)


def _pixels(image: npt.NDArray[np.uint8], box: Box) -> npt.NDArray[np.int16]:
    return image[box.y : box.y + box.h, box.x : box.x + box.w].astype(np.int16).reshape(-1, 3)


def _count(pixels: npt.NDArray[np.int16], colour: str) -> int:
    return int((np.abs(pixels - _rgb(colour)).max(axis=1) <= 6).sum())


def _blue_shades(pixels: npt.NDArray[np.int16]) -> int:
    blue = pixels[(pixels[:, 2] - pixels[:, 0] > 30) & (pixels[:, 2] < 250)]
    return len({tuple(p) for p in blue.tolist()})


def _render(page: Path, tmp_path: Path) -> tuple[npt.NDArray[np.uint8], dict[str, Box]]:
    height, boxes = chart_boxes(page)
    png = tmp_path / "report.png"
    assert screenshot(page, png, height) == []  # no script error, nothing refused, nothing logged
    image = np.asarray(Image.open(png).convert("RGB"))
    assert image.shape[0] >= max(b.y + b.h for b in boxes)
    return image, {b.key: b for b in boxes}


def _assert_drawn(image: npt.NDArray[np.uint8], box: Box) -> None:
    pixels = _pixels(image, box)
    assert box.w > 600 and box.h > 150, box
    ink = (pixels < 235).any(axis=1).mean()
    assert ink > 0.01, f"{box.key} is blank"
    if box.key == "heatmap":
        assert _blue_shades(pixels) >= 5, "the heatmap has no shaded cells"
    else:
        for colour in DATA_COLOURS[box.key]:
            assert _count(pixels, colour) >= 20, f"{box.key}: no marks in {colour}"


@requires_chromium
def test_every_chart_renders_in_headless_chromium(tmp_path: Path) -> None:
    events = _demo_events(tmp_path / "events.jsonl")
    # A tight bound, so that masking, drops and the what-if curve all have something to show.
    page = _report(tmp_path, events, "--bound", "2", "--max-staleness", "0..6")
    image, boxes = _render(page, tmp_path)
    assert list(boxes) == CHARTS
    for key in CHARTS:
        _assert_drawn(image, boxes[key])


@requires_chromium
def test_a_logged_metrics_file_says_what_it_cannot_draw(tmp_path: Path) -> None:
    page = _report(tmp_path, EXAMPLES / "prime-rl-run" / "metrics.jsonl")
    html = page.read_text()
    assert "needs rollouts: logged metrics carry no histogram" in html
    image, boxes = _render(page, tmp_path)
    _assert_drawn(image, boxes["in-flight-queue"])  # legacy off_policy/* keys, renamed
    for key in ("heatmap", "what-if"):
        pixels = _pixels(image, boxes[key])
        assert (pixels < 235).any(axis=1).mean() > 0.001  # the placeholder text is there...
        assert _blue_shades(pixels) < 5 and _count(pixels, PALETTE[3]) == 0  # ...and no data marks


def test_the_page_fetches_nothing(tmp_path: Path) -> None:
    html = _report(tmp_path, EXAMPLES / "xtuner-states.jsonl", "--bound", "1").read_text()
    assert 'http-equiv="Content-Security-Policy" content="default-src \'none\'' in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "url(" not in html and "@import" not in html and "<script" not in html
    # The only URL in the page is the SVG namespace, which is a name, not a fetch.
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}


def test_a_prime_rl_report_puts_the_logged_values_beside_the_recomputed_ones(tmp_path: Path) -> None:
    html = _report(tmp_path, EXAMPLES / "prime-rl-run", "--policy", "episode").read_text()
    assert "20 of 20 logged steps equal the recomputed values exactly." in html
    assert "All 140 values" in html
    what_if_rows = re.findall(r"<tr(?: class=current)?><td>(\d+)</td>", html)
    assert what_if_rows[:9] == [str(b) for b in range(9)]  # default what-if range 0..8
    assert re.search(r"<tr class=current><td>8</td>", html)  # the replayed bound is highlighted


def test_report_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="staleness-metrics")
    report_command.register(parser.add_subparsers())
    args = parser.parse_args(["report", str(EXAMPLES / "xtuner-states.jsonl"), "-o", str(tmp_path / "r.html"),
                              "--max-staleness", "4..1"])  # fmt: skip
    assert args.func(args) == 2
    assert "start is above the end" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_the_page_gets_the_usual_mode_or_keeps_the_one_it_replaces(tmp_path: Path) -> None:
    """Written through a temp file (mkstemp's 0600), the page still gets what a new file gets under
    the umask, or the mode of the page it replaces (`replay --metrics-out` writes the same way)."""
    umask = os.umask(0o022)
    try:
        page = _report(tmp_path, EXAMPLES / "xtuner-states.jsonl")
        assert stat.S_IMODE(page.stat().st_mode) == 0o644
        page.chmod(0o640)
        assert stat.S_IMODE(_report(tmp_path, EXAMPLES / "xtuner-states.jsonl").stat().st_mode) == 0o640
        os.umask(0o077)
        (tmp_path / "report.html").unlink()
        assert stat.S_IMODE(_report(tmp_path, EXAMPLES / "xtuner-states.jsonl").stat().st_mode) == 0o600
    finally:
        os.umask(umask)


def test_a_logged_value_that_is_not_a_number_names_its_line_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logged = tmp_path / "metrics.jsonl"
    logged.write_text('{"step": 1, "off_policy/max": 2}\n{"step": 2, "off_policy/max": "3"}\n')
    parser = argparse.ArgumentParser(prog="staleness-metrics")
    report_command.register(parser.add_subparsers())
    args = parser.parse_args(["report", str(logged), "-o", str(tmp_path / "r.html")])
    assert args.func(args) == 2
    assert capsys.readouterr().err.strip() == f"line 2: {logged}: off_policy/max: expected a number, got '3'"


def test_a_bound_far_above_the_data_does_not_size_the_heatmap() -> None:
    svg = heatmap("histogram", [1, 2], [np.array([3, 1]), np.array([0, 2, 2])], bound=10**12)  # 8 TB of rows before
    assert svg.count("<rect") > 4 and "masked above max_staleness" not in svg  # data drawn, the bound is off-chart
    assert "masked above max_staleness = 1" in heatmap("histogram", [1], [np.array([3, 1])], bound=1)


COST_CHARTS = ["mismatch-k3", "mismatch-excess", "mismatch-ess", "length-bias", "length-removed"]


def _events_with_trainer_logprobs(path: Path, steps: int = 15) -> Path:
    """The demo pipeline's events with sampler and trainer log-probabilities on every live sample, and one
    fresh (lag-0) rollout in each ship, so that every step has the numeric floor."""
    rng = np.random.default_rng(5)
    with path.open("w") as handle:
        for _, step in zip(range(steps), Simulation(2).steps(), strict=False):
            events = step.events()
            fresh = {
                "id": f"fresh-{step.step}",
                "dispatch_version": step.step - 1,
                "samples": [{"mask": [0] + [1] * 40, "token_versions": [-1] + [step.step - 1] * 40}],
            }
            events.insert(-1, {"type": "rollout", "rollout": fresh})
            events[-1]["ids"] = [*events[-1]["ids"], fresh["id"]]
            for event in events[:-1]:
                record = event["rollout"]
                if record.get("source") == "frozen":
                    continue
                for sample in record["samples"]:
                    n = len(sample["mask"])
                    sampler = -rng.exponential(0.7, n)
                    sample["logprobs"] = sampler.tolist()
                    sample["trainer_logprobs"] = (sampler + rng.normal(0, 0.2, n)).tolist()
            handle.writelines(json.dumps(e) + "\n" for e in events)
    return path


@requires_chromium
def test_a_run_with_trainer_logprobs_shows_what_staleness_costs(tmp_path: Path) -> None:
    events = _events_with_trainer_logprobs(tmp_path / "events.jsonl")
    page = _report(tmp_path, events, "--bound", "2", "--max-staleness", "0..4")
    html = page.read_text()
    assert '<section id="what-staleness-costs"><h2>What staleness costs</h2>' in html
    image, boxes = _render(page, tmp_path)
    # With enough tokens per lag for a floor and a curve, "Choosing the bound" follows (test_choosing.py).
    assert list(boxes) == CHARTS + COST_CHARTS + ["bound-curve", "bound-kept", "bound-over-steps"]
    for key in COST_CHARTS:
        pixels = _pixels(image, boxes[key])
        assert boxes[key].w > 600 and boxes[key].h > 150
        # The first two lag lines (lag 0 has no excess: the excess chart starts at the second colour), or
        # the two length lines, are drawn in their colours.
        colours = {"length-bias": [PALETTE[0], PALETTE[3]], "mismatch-excess": [PALETTE[1], PALETTE[2]]}.get(
            key, [PALETTE[0], PALETTE[1]]
        )
        for colour in colours:
            assert _count(pixels, colour) >= 20, f"{key}: no marks in {colour}"
    # The marks carry the replayed values: step 3's lag-0 k3 is the replay's.
    rows = [s.metrics for s in replay(as_replay_events(read_event_file(events)), StalenessConfig(max_staleness=2))]
    k3 = rows[2]["staleness/mismatch/lag_0/k3"]
    assert f"<title>lag 0 at 3: {k3:.4g}</title>" in html
    # The what-if table prices each bound: the k3 of what it lets train.
    [at_two] = what_if(events, [2], StalenessConfig(max_staleness=2))
    assert at_two.trained_k3 is not None and at_two.trained_excess_k3 is not None
    row = re.search(r"<tr class=current><td>2</td>.*?</tr>", html)
    assert row is not None and row.group(0).endswith(
        f"<td>{at_two.trained_k3:.4g}</td><td>{at_two.trained_excess_k3:.4g}</td></tr>"
    )


def test_logged_metrics_with_the_family_show_the_section_and_a_missing_floor_says_so(tmp_path: Path) -> None:
    logged = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 1, "staleness/mismatch/lag_2/tokens": 10, "staleness/mismatch/lag_2/k3": 0.01,
         "staleness/mismatch/lag_2/ess": 0.99, "staleness/mismatch/k3": 0.01},
        {"step": 2, "staleness/mismatch/lag_3/tokens": 12, "staleness/mismatch/lag_3/k3": 0.02,
         "staleness/mismatch/lag_3/ess": 0.97, "staleness/mismatch/k3": 0.02},
    ]  # fmt: skip
    logged.write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = _report(tmp_path, logged).read_text()
    assert 'id="what-staleness-costs"' in html
    assert "no step had a floor: too few tokens at lag 0 or at any lag (floor_min_tokens)" in html
    assert "<title>lag 3 at 2: 0.02</title>" in html and "<title>lag 2 at 1: 0.01</title>" in html


def test_a_run_without_trainer_logprobs_has_no_cost_section(tmp_path: Path) -> None:
    html = _report(tmp_path, _demo_events(tmp_path / "events.jsonl", steps=4), "--bound", "2").read_text()
    assert "What staleness costs" not in html and "mismatch-k3" not in html and "trained k3" not in html


@requires_chromium
def test_a_right_to_left_override_in_a_name_reorders_only_that_name(tmp_path: Path) -> None:
    """U+202E in a file name or title: the page's own words after it still read left to right."""
    events = tmp_path / "run\u202e.jsonl"
    events.write_text(json.dumps({"type": "ship", "step": 1}) + "\n")
    page = _report(tmp_path, events, "--bound", "4", "--title", "Run \u202eevil")
    # the left edge of each letter of "max_staleness" on the line under the title
    lefts = probe(
        page,
        """(() => { const p = document.querySelector("p.meta"), w = document.createTreeWalker(p, 4);
        for (let n; (n = w.nextNode());) { const i = n.data.indexOf("max_staleness"); if (i < 0) continue;
          return [...Array(13).keys()].map(k => { const r = document.createRange();
            r.setStart(n, i + k); r.setEnd(n, i + k + 1); return r.getBoundingClientRect().left; }); } })()""",
    )
    assert lefts == sorted(lefts) and len(set(lefts)) == 13
    assert "<h1><bdi>Run \u202eevil</bdi></h1>" in page.read_text(encoding="utf-8")


@requires_chromium
def test_long_names_wrap_and_point_notes_stay_inside_their_chart(tmp_path: Path) -> None:
    """A name without spaces wraps within the page; the token count beside the last point of a curve is
    not cut off at the chart's right edge."""
    events = tmp_path / ("r" * 240 + ".jsonl")
    events.write_text(json.dumps({"type": "ship", "step": 1}) + "\n")
    page = _report(tmp_path, events, "--title", "T" * 400)
    assert probe(page, "document.documentElement.scrollWidth") <= 1100
    notes = [f"{1.14 + lag / 100:.3g}k tokens" for lag in range(17)]
    svg = line_chart("curve", list(range(17)), [Series("e", [0.01 * lag for lag in range(17)], "#000", notes=notes,
                                                        show_notes=True)])  # fmt: skip
    style = "svg { font-size: 12px; } svg .point-note { font-size: 10px; }"  # the page's
    (tmp_path / "curve.html").write_text(f"<!DOCTYPE html><html><style>{style}</style><body>{svg}</body></html>")
    chart, boxes = probe(
        tmp_path / "curve.html",
        """[document.querySelector("svg").getBoundingClientRect(),
        [...document.querySelectorAll("text.point-note")].map(t => t.getBoundingClientRect())]""",
    )
    assert len(boxes) == 17 and all(chart["left"] <= b["left"] and b["right"] <= chart["right"] for b in boxes)
