"""The report on inputs at the edges: several ships at one step, a run directory replayed at another
bound than it logged, near-zero costs, non-finite logged values, staleness past the histogram's top."""

from __future__ import annotations

import gc
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from staleness_metrics.cli import main
from staleness_metrics.config import StalenessConfig
from staleness_metrics.html_report import collect, render, write_report
from staleness_metrics.html_report.svg import Series, bar_chart, heatmap, line_chart, nice_ticks
from staleness_metrics.metrics.buckets import HISTOGRAM_TOP


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _rollout(rid: str, dispatch: int, tokens: int, **sample: Any) -> dict[str, Any]:
    samples = [{"mask": [1] * tokens, **sample}]
    return {"type": "rollout", "rollout": {"id": rid, "dispatch_version": dispatch, "samples": samples}}


def _run_dir(root: Path, events: list[dict[str, Any]], logged: list[dict[str, Any]], bound: int) -> Path:
    root.mkdir()
    _write(root / "events.jsonl", events)
    _write(root / "metrics.jsonl", logged)
    files = {"events": "events.jsonl", "metrics": "metrics.jsonl"}
    run = {"format": "staleness-metrics run", "version": 1, "config": {"max_staleness": bound}, "files": files}
    (root / "run.json").write_text(json.dumps(run))
    return root


def _cells(html: str) -> list[str]:
    return re.findall(r"<title>(step \d+, staleness \d+: [^<]*)</title>", html)


def _summary(html: str) -> dict[str, str]:
    return dict(re.findall(r"<div>([^<]*)<b>([^<]*)</b></div>", html))


def test_two_ships_at_one_step_each_keep_their_histogram(tmp_path: Path) -> None:
    """SPEC 4 allows several ships at one step: each is a column of the heatmap, with its own tokens."""
    events = [_rollout("old", 0, 2), _rollout("mid", 1, 3), {"type": "ship", "step": 3}]
    events += [_rollout("new", 2, 2), {"type": "ship", "step": 3}]
    logged = [{"step": 3, "staleness/token/mean": 1.0}, {"step": 3, "staleness/token/mean": 0.0}]
    data = collect(_run_dir(tmp_path / "run", events, logged, 1), StalenessConfig(max_staleness=1))
    assert data.steps == [3, 3] and data.histograms is not None
    assert [h.tolist() for h in data.histograms] == [[0, 3], [2]]
    html = render(data)
    assert _cells(html) == ["step 3, staleness 1: 3 tokens (100.0%)", "step 3, staleness 0: 2 tokens (100.0%)"]
    assert _summary(html)["token staleness mean"] == "0.6"  # (3 * 1 + 2 * 0) / 5
    assert _summary(html)["steps shipped"] == "1"


def test_a_logged_step_without_a_ship_does_not_shift_the_heatmap(tmp_path: Path) -> None:
    events = [_rollout("a", 0, 2), {"type": "ship", "step": 2}, _rollout("b", 3, 2), {"type": "ship", "step": 4}]
    # step 1: the trainer's sums, and a bound the replay must not take; step 2's logged sums join its ship
    logged = [
        {"step": 1, "staleness/max_staleness": 1, "staleness/mismatch/k3": 0.25},
        {"step": 2, "staleness/max_staleness": 1, "staleness/token/mean": 7.0, "staleness/mismatch/k3": 0.5},
        {"step": 4, "staleness/max_staleness": 1},
    ]
    data = collect(_run_dir(tmp_path / "run", events, logged, 1), StalenessConfig(max_staleness=1))
    assert data.steps == [1, 2, 4]
    assert data.rows[0] == {"step": 1, "staleness/mismatch/k3": 0.25}
    assert data.rows[1]["staleness/mismatch/k3"] == 0.5 and data.rows[1]["staleness/token/mean"] == 1.0
    html = render(data)
    assert _cells(html) == ["step 2, staleness 1: 2 tokens (100.0%)", "step 4, staleness 0: 2 tokens (100.0%)"]


def test_a_run_directory_replayed_at_another_bound_shows_only_that_bound(tmp_path: Path) -> None:
    """The logged rows (bound 8) give only the trainer's sums; staleness is the replay's at bound 0."""
    events = [_rollout("a", 0, 3), {"type": "ship", "step": 3}]
    logged = [
        {"step": 3, "staleness/token/mean": 2.0, "staleness/rollout/max": 2, "staleness/rollout/dropped": 0,
         "staleness/max_staleness": 8, "staleness/mismatch/lag_2/tokens": 3, "staleness/mismatch/lag_2/k3": 0.5,
         "staleness/env/math/mismatch/k3": 0.5, "staleness/env/math/token/mean": 2.0},
    ]  # fmt: skip
    data = collect(_run_dir(tmp_path / "run", events, logged, 8), StalenessConfig(max_staleness=0))
    [row] = data.rows
    assert row["staleness/rollout/dropped"] == 1 and row["staleness/max_staleness"] == 0
    assert "staleness/token/mean" not in row and "staleness/rollout/max" not in row
    assert "staleness/env/math/token/mean" not in row and row["staleness/env/math/mismatch/k3"] == 0.5
    html = render(data)
    assert "<title>mean at 3:" not in html and "<title>max at 3:" not in html
    assert "<title>rollouts dropped at 3: 1</title>" in html and "<title>lag 2 at 3: 0.5</title>" in html
    assert _summary(html)["largest rollout staleness"] == "-"


def test_an_env_named_like_a_key_family_keeps_the_logged_sums(tmp_path: Path) -> None:
    """Per-env keys are told by their known suffix: the replay's staleness/env/tasks/bound/token/mean (env
    "tasks/bound") is not a SPEC 14 key, so the trainer's logged sums still fill the report, the env's too."""
    for env in ("tasks/bound", "x/mismatch"):
        rollouts = [_rollout(f"r{step}", 0, 3) for step in (1, 2)]
        events = [e for r, step in zip(rollouts, (1, 2)) for e in (r, {"type": "ship", "step": step})]
        for r in rollouts:
            r["rollout"]["env"] = env
        logged = [{"step": step, "staleness/mismatch/lag_1/tokens": 2000, "staleness/mismatch/lag_1/k3": 0.003,
                   f"staleness/env/{env}/mismatch/k3": 0.003} for step in (1, 2)]  # fmt: skip
        config = StalenessConfig(max_staleness=4, env_breakdown=True)
        data = collect(_run_dir(tmp_path / env.replace("/", "-"), events, logged, 4), config)
        assert any(f"staleness/env/{env}/token/mean" in row for row in data.rows)
        assert [row.get("staleness/mismatch/lag_1/k3") for row in data.rows] == [0.003, 0.003], env
        assert [row.get(f"staleness/env/{env}/mismatch/k3") for row in data.rows] == [0.003, 0.003]
        assert 'id="what-staleness-costs"' in render(data)


def test_ticks_at_any_scale() -> None:
    assert nice_ticks(0, 5e-13) == [0.0, 1e-13, 2e-13, 3e-13, 4e-13, 5e-13]
    assert nice_ticks(0, 0.3) == [0.0, 0.1, 0.2, 0.3]
    assert nice_ticks(7, 7) == [7.0, 7.2, 7.4, 7.6, 7.8, 8.0]  # flat: widened
    assert nice_ticks(1e20, 1e20) == [1e20, 1.0000002e20, 1.0000004e20, 1.0000006e20, 1.0000008e20, 1.000001e20]
    assert nice_ticks(0, 5e-324) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]  # too thin for floats to split
    svg = line_chart("tiny", [1, 2], [Series("k3", [5e-13, 0.0], "#000")])
    assert "<title>k3 at 1: 5e-13</title>" in svg and ">5e-13</text>" in svg


def test_a_near_zero_cost_is_drawn(tmp_path: Path) -> None:
    sample = {"logprobs": [-1.0], "trainer_logprobs": [-0.999999]}
    events = _write(tmp_path / "events.jsonl", [_rollout("a", 0, 1, **sample), {"type": "ship", "step": 1}])
    html = render(collect(events, StalenessConfig()))
    assert "<title>lag 0 at 1: 4.999e-13</title>" in html  # k3 = exp(d) - 1 - d, d = 1e-6


def test_non_finite_logged_values_are_left_out_and_said(tmp_path: Path) -> None:
    logged = tmp_path / "metrics.jsonl"
    logged.write_text(
        '{"step": 1, "staleness/rollout/dropped": Infinity, "staleness/max_staleness": Infinity,'
        ' "staleness/mismatch/lag_0/tokens": 1e30, "staleness/mismatch/lag_0/k3": 0.001}\n'
        '{"step": 2, "staleness/token/mean": 1.0, "staleness/rollout/in_flight/mean": NaN,'
        ' "staleness/rollout/in_queue/mean": 1.0, "staleness/rollout/dropped": 2}\n'
    )
    data = collect(logged, StalenessConfig())
    assert data.rows == [
        {"step": 1, "staleness/mismatch/lag_0/k3": 0.001},
        {
            "step": 2,
            "staleness/token/mean": 1.0,
            "staleness/rollout/in_queue/mean": 1.0,
            "staleness/rollout/dropped": 2,
        },
    ]
    assert data.bound is None
    html = render(data)
    assert (
        f'<p class="meta">{logged}: left out, not finite or past 2^63: line 1 staleness/rollout/dropped '
        "(inf), line 1 staleness/max_staleness (inf), line 1 staleness/mismatch/lag_0/tokens (1e+30) and 1 more</p>"
    ) in html
    assert _summary(html)["rollouts dropped"] == "2"
    assert not re.search(r'="[^"]*(nan|inf)', html, re.IGNORECASE)


def test_no_nan_reaches_a_bar_chart() -> None:
    svg = bar_chart("bars", [1, 2], [Series("a", [float("nan"), 2.0], "#000")], stacked=True)
    assert not re.search(r'="[^"]*(nan|inf)', svg, re.IGNORECASE) and "<title>a at 2: 2</title>" in svg


def test_the_summary_is_exact_past_the_histogram_top(tmp_path: Path) -> None:
    """The token histogram counts every staleness from 4096 up in its last bucket: the mean comes from the
    ships' own means, and a quantile in that bucket is the largest staleness when it is the largest rank."""
    events = _write(tmp_path / "far.jsonl", [_rollout("a", 0, 2), {"type": "ship", "step": 10001}])
    summary = _summary(render(collect(events, StalenessConfig(max_staleness=20000))))
    assert (summary["token staleness mean"], summary["token staleness p99"]) == ("10,000", "10,000")
    more = [_rollout("a", 0, 2), _rollout("b", 5000, 198), {"type": "ship", "step": 10001}]
    summary = _summary(render(collect(_write(tmp_path / "more.jsonl", more), StalenessConfig(max_staleness=20000))))
    assert summary["token staleness mean"] == "5,050"  # (2 * 10000 + 198 * 5000) / 200
    assert summary["token staleness p99"] == "&ge; 4,096"  # the 198th of 200: past the top, not the largest


def test_a_compressed_stream_or_one_with_a_bom_is_drawn_as_the_plain_one(tmp_path: Path) -> None:
    """``report`` reads what ``replay`` and ``what-if`` read."""
    plain = _write(tmp_path / "plain.jsonl", [_rollout("a", 0, 3), {"type": "ship", "step": 2}])
    (tmp_path / "gzipped.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    expected = collect(plain, StalenessConfig(), [0, 1]).rows
    for name in ("gzipped.jsonl.gz", "bom.jsonl"):
        assert collect(tmp_path / name, StalenessConfig(), [0, 1]).rows == expected


def test_a_what_if_bound_far_past_the_run_draws_only_the_bounds_tried(tmp_path: Path) -> None:
    """The curves' x axis holds every lag up to the largest drawn only while that is a what-if's size."""
    costs = {"logprobs": [-0.5, -0.5], "trainer_logprobs": [-0.4, -0.6]}
    lags = [_rollout("now", 1, 2, **costs), _rollout("late", 0, 2, **costs), {"type": "ship", "step": 2}]
    html = render(collect(_write(tmp_path / "s.jsonl", lags), StalenessConfig(floor_min_tokens=1), [0, 10**8]))
    points = re.findall(r"<title>share of sampled tokens that trains at (\d+): ", html)
    assert points == ["0", "100000000"]


def test_two_ships_at_one_step_of_a_metrics_file_stay_two_rows(tmp_path: Path) -> None:
    """``replay --metrics-out`` writes a row per ship (SPEC 4: two at step 5, each dropping one rollout);
    a row of the trainer's sums alone joins its step's last ship."""
    events = [_rollout("fresh", 4, 3), _rollout("stale1", 0, 3), {"type": "ship", "step": 5, "ids": ["fresh"]}]
    events += [_rollout("stale2", 0, 3), {"type": "ship", "step": 5}]
    logged = tmp_path / "m.jsonl"
    assert main(["replay", str(_write(tmp_path / "ev.jsonl", events)), "--max-staleness", "1",
                 "--metrics-out", str(logged)]) == 0  # fmt: skip
    with logged.open("a") as handle:
        handle.write(json.dumps({"step": 5, "staleness/mismatch/k3": 0.5}) + "\n")
    ships = [json.loads(line) for line in logged.read_text().splitlines()[:2]]
    data = collect(logged, StalenessConfig())
    assert data.rows == [ships[0], {**ships[1], "staleness/mismatch/k3": 0.5}]
    html = render(data)
    assert _summary(html)["rollouts dropped"] == "2" and _summary(html)["steps shipped"] == "1"


def test_a_logged_step_without_a_ship_is_not_counted_as_shipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = [_rollout("a", 0, 2), {"type": "ship", "step": 2}, _rollout("b", 3, 2), {"type": "ship", "step": 4}]
    logged = [{"step": step, "staleness/mismatch/k3": 0.5} for step in (1, 3, 2, 4)]
    run = _run_dir(tmp_path / "run", events, logged, 1)
    data = collect(run, StalenessConfig(max_staleness=1))
    assert data.steps == [1, 2, 3, 4] and data.steps_shipped == 2
    assert _summary(render(data))["steps shipped"] == "2"
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().err.endswith("(steps shipped: 2)\n")


def test_text_that_is_not_utf8_is_replaced_on_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file name with a Latin-1 byte, a title with a bad byte, a logged key with a lone surrogate: the
    page is written, each bad character a U+FFFD, as `replay` reads the same file."""
    name = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9.jsonl")
    _write(Path(name), [_rollout("a", 0, 3), {"type": "ship", "step": 1}])
    page = tmp_path / "r.html"
    assert main(["report", name, "-o", str(page), "--title", os.fsdecode(b"run-\xff")]) == 0
    assert "wrote" in capsys.readouterr().err
    html = page.read_text(encoding="utf-8")
    assert "<h1><bdi>run-\ufffd</bdi></h1>" in html and "caf\ufffd.jsonl" in html
    logged = tmp_path / "metrics.jsonl"
    logged.write_text('{"step": 1, "staleness/token/mean": 1.0}\n{"step": 2, "staleness/x\\ud800y": Infinity}\n')
    html = write_report(logged, tmp_path / "m.html").read_text(encoding="utf-8")
    assert "line 2 staleness/x\ufffdy (inf)" in html


# In a child process whose files may not pass 8 KiB (a full disk), SIGXFSZ ignored: a write fails with EFBIG.
_WRITE_FULL = """
import resource, signal, sys
from staleness_metrics.html_report import write_report
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
write_report(sys.argv[1], sys.argv[2])
"""


def test_write_report_on_a_full_disk_leaves_the_last_page_whole(tmp_path: Path) -> None:
    events = [e for s in range(1, 30) for e in (_rollout(f"r{s}", s - 1, 4), {"type": "ship", "step": s})]
    source, page = _write(tmp_path / "events.jsonl", events), tmp_path / "r.html"
    page.write_text("<html>the last page</html>\n")
    command = [sys.executable, "-c", _WRITE_FULL, str(source), str(page)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "File too large" in done.stderr
    assert page.read_text() == "<html>the last page</html>\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "r.html"]  # no temp file left
    assert write_report(source, page) == page and page.read_text().rstrip().endswith("</html>")


def test_the_heatmap_names_the_steps_a_column_sums_and_the_top_bucket() -> None:
    svg = heatmap("h", list(range(1, 803)), [np.array([3])] * 802)  # 3 steps a column
    titles = re.findall(r"<title>([^<]*)</title>", svg)
    assert titles[0] == "steps 1–3, staleness 0: 9 tokens (100.0%)" and len(titles) == 268
    assert titles[-1] == "step 802, staleness 0: 3 tokens (100.0%)"
    top = np.zeros(HISTOGRAM_TOP + 1, dtype=np.int64)
    top[[0, HISTOGRAM_TOP]] = 1
    svg = heatmap("h", [10001], [top])
    assert re.findall(r"<title>([^<]*)</title>", svg)[-1] == "step 10001, staleness ≥ 4096: 1 tokens (50.0%)"
    assert re.findall(r'text-anchor="end">([^<]*)</text>', svg)[-2:] == ["3420", "≥ 4096"]  # (3762 gives way)


def test_the_heatmap_caption_says_when_steps_are_summed(tmp_path: Path) -> None:
    events = [e for s in range(1, 402) for e in (_rollout(f"r{s}", s - 1, 1), {"type": "ship", "step": s})]
    html = render(collect(_write(tmp_path / "ev.jsonl", events), StalenessConfig()))
    assert "Each column is 2 consecutive steps summed" in html


def test_an_adaptive_bound_is_drawn_step_by_step(tmp_path: Path) -> None:
    """The bound each step logged, not the first one over every step."""
    steps = [(1, 8), (2, 8), (3, 5)]
    logged = [{"step": s, "staleness/max_staleness": b, "staleness/rollout/max": 6} for s, b in steps]
    html = render(collect(_write(tmp_path / "m.jsonl", logged), StalenessConfig()))
    assert "max_staleness: adapted within 5..8, 5 at the last step" in html
    chart = re.search(r'id="chart-token-staleness".*?</svg>', html, re.S)
    assert chart is not None and "max_staleness = " not in chart.group(0)
    bounds = re.findall(r"<title>max_staleness at (\d): (\d)</title>", chart.group(0))
    assert bounds == [("1", "8"), ("2", "8"), ("3", "5")]
    svg = heatmap("h", [1, 2], [np.array([1, 1])] * 2, bound=1, adapted=True)
    assert "masked above max_staleness = 1 at the last step" in svg


def test_axes_of_large_numbers_label_every_tick_briefly() -> None:
    """Steps up to 2**53 get their own ticks (a step apart); a staleness of 1e9 reads 1e9, within the margin."""
    assert nice_ticks(2**53 - 1, 2**53, 8, integer=True) == [2**53 - 1, 2**53]
    assert nice_ticks(10**9 + 1, 10**9 + 2, 8, integer=True) == [10**9 + 1, 10**9 + 2]
    svg = line_chart("big", [2**53 - 1, 2**53], [Series("max", [1.5e9, 2e9], "#000")])
    assert re.findall(r'y="272" text-anchor="\w+">(\d+)</text>', svg) == ["9007199254740991", "9007199254740992"]
    assert re.findall(r'text-anchor="end">([^<]*)</text>', svg)[:5] == ["0", "5e8", "1e9", "1.5e9", "2e9"]


def test_a_bound_outside_the_what_if_range_is_neither_drawn_nor_said_highlighted(tmp_path: Path) -> None:
    events = _write(tmp_path / "ev.jsonl", [_rollout("a", 0, 3), _rollout("b", 1, 3), {"type": "ship", "step": 2}])
    html = render(collect(events, StalenessConfig(max_staleness=8), [0, 1, 2, 3]))
    chart = re.search(r'id="chart-what-if".*?</svg>', html, re.S)
    assert chart is not None and "run: 8" not in chart.group(0) and "<tr class=current>" not in html
    assert "Totals over the run.</p>" in html
    html = render(collect(events, StalenessConfig(max_staleness=2), [0, 1, 2, 3]))
    assert ">run: 2</text>" in html and "the highlighted row is the bound replayed above" in html


@pytest.mark.parametrize("as_run_directory", [False, True])
def test_the_report_lets_each_shipment_go_as_it_replays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         as_run_directory: bool) -> None:  # fmt: skip
    """A shipment holds the queue's arrays (about 30 KB a ship): the report keeps each ship's report only, so
    its memory stays flat over a long run (it kept every shipment: 2 GB at 50,000 ships)."""
    from staleness_metrics.engine.shipment import Shipment
    from staleness_metrics.replay import stream

    alive: list[int] = []
    run_steps = stream.run_steps

    def counted(*args: Any) -> Any:
        for number, shipment in enumerate(run_steps(*args)):
            if number % 10 == 9:
                gc.collect()
                alive.append(sum(type(o) is Shipment for o in gc.get_objects()))
            yield shipment

    monkeypatch.setattr(stream, "run_steps", counted)
    events = [event for i in range(40) for event in (_rollout(f"r{i}", i, 3), {"type": "ship", "step": i + 1})]
    source = _run_dir(tmp_path / "run", events, [], 8) if as_run_directory else _write(tmp_path / "e.jsonl", events)
    data = collect(source, StalenessConfig())
    assert len(data.rows) == 40 and data.totals is not None and data.totals.rollouts_shipped == 40
    assert alive and max(alive) <= 2, alive  # (the one just made, and the last one let go)
