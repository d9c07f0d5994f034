"""``staleness-metrics demo``: the first command a newcomer runs, checked the way they would see it."""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.cli import main
from staleness_metrics.config import StalenessConfig
from staleness_metrics.demo import DriftModel, SimulatedTrainer, Simulation, _cost_caption, _paced, shipped_mask
from staleness_metrics.metrics.bound import BoundTracker
from staleness_metrics.metrics.mismatch import LAG_BUCKETS
from staleness_metrics.monitor import StalenessMonitor
from staleness_metrics.replay.run_dir import find_run
from staleness_metrics.replay.sources import as_replay_events
from staleness_metrics.replay.sources.events import read_event_file
from staleness_metrics.replay.stream import replay
from tests.exporters.wandb_reader import find_run_file, read_run
from tests.support.drift import expected_suggested_bound
from tests.support.otlp import OtlpReceiver, metrics_by_name

ROOT = Path(__file__).resolve().parents[1]


def _start_demo(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "staleness_metrics.cli", "demo", "--prometheus-port", "0",
               "--out-dir", str(tmp_path / "out"), *args]  # fmt: skip
    # No OTLP endpoint leaks in from the caller's environment: the tests that want one pass it.
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    environment.update({"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})})
    return subprocess.Popen(
        command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _lines(stream: IO[str]) -> Iterator[str]:
    for line in stream:
        yield line.rstrip("\n")


def _step_lines(lines: list[str]) -> list[str]:
    """The ship lines (the console may add a line per step with what staleness cost)."""
    return [line for line in lines if line.startswith("step ") and "| Max Staleness " in line]


def test_demo_prints_step_lines_and_serves_prometheus_while_it_runs(tmp_path: Path) -> None:
    # 15 steps at 2 a second: after step 4 the demo runs 5.5 s more, ample time for one scrape even on a
    # loaded machine (the scrape must happen while it runs; nothing here measures how fast). By step 4's
    # line, the simulated trainer has recorded the mismatch sums of steps 1 to 3 (lags 0, 1 and 2).
    demo = _start_demo(tmp_path, "--steps", "15", "--speed", "2", "--no-wandb")
    try:
        assert demo.stdout is not None
        seen: list[str] = []
        lines = _lines(demo.stdout)
        for line in lines:
            seen.append(line)
            if line.startswith("step 4 "):
                break
        url = next(line.split(": ", 1)[1] for line in seen if line.startswith("metrics URL: "))
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        with urllib.request.urlopen(url, timeout=30) as response:
            body = response.read().decode()
        assert demo.poll() is None
        assert 'rl_staleness_train_step{run="staleness-demo"}' in body
        assert "rl_staleness_token_steps_bucket" in body
        # What staleness cost the simulated trainer (SPEC 11), recorded through the live path.
        families = {f.name: f for f in text_string_to_metric_families(body)}
        tokens = families["rl_staleness_mismatch_tokens"].samples
        assert {s.labels["run"] for s in tokens} == {"staleness-demo"}
        assert sum(s.value for s in tokens if s.name.endswith("_total")) > 0
        by_lag = {s.labels["lag"]: s.value for s in tokens if s.name.endswith("_total") and s.value > 0}
        assert set(by_lag) >= {"0", "1", "2"}
        seen.extend(lines)
        assert demo.wait() == 0
    finally:
        demo.kill()
        demo.wait()
    steps = _step_lines(seen)
    assert [line.split(" | ")[0] for line in steps] == [f"step {i}" for i in range(1, 16)]
    rows = _rows_by_step(tmp_path / "out" / "metrics.jsonl")
    assert list(rows) == list(range(1, 16))
    assert all("staleness/rollout/max" in row and "staleness/env/math/token/mean" in row for row in rows.values())
    # The JSONL holds each step's cost, as the live path computes it (recomputed here in-process).
    costs = _live_path_family(15, StalenessConfig(env_breakdown=True))
    for step, row in rows.items():
        assert "staleness/mismatch/coverage" in row and _family(row) == pytest.approx(costs[step]), step
    assert all("staleness/mismatch/lag_3/ess" in rows[step] for step in range(4, 16))


def _rows_by_step(path: Path) -> dict[int, dict[str, Any]]:
    """The JSONL rows of each step merged in order (a step's mismatch row may follow its ship row)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


def _live_path_family(steps: int, config: StalenessConfig, seed: int = 0) -> dict[int, dict[str, float | int]]:
    """The demo's pipeline and simulated trainer re-run in-process: each step's SPEC 11 keys from its sums
    (the excess keys aside: their floor is SPEC 14's, checked on its own)."""
    monitor = StalenessMonitor(config)
    simulation, trainer = Simulation(seed), SimulatedTrainer(seed)
    family: dict[int, dict[str, float | int]] = {}
    for _, events in zip(range(steps), simulation.steps(), strict=False):
        monitor.add(events.rollouts)
        shipment = monitor.ship(events.step, events.ship_ids)
        simulation.forget(shipment.dropped_rollouts)
        trained = trainer.train(monitor, shipment)
        published = monitor.mismatch_metrics(events.step) if trained is not None else None
        family[events.step] = _family(published or {})
    return family


def _family(row: dict[str, Any]) -> dict[str, Any]:
    """The SPEC 11 keys of a row that depend on the step's sums alone."""
    whole = ("staleness/mismatch/k3", "staleness/mismatch/coverage")
    return {
        k: v
        for k, v in row.items()
        if k in whole or (k.startswith("staleness/mismatch/lag_") and not k.endswith("/excess_k3"))
    }


def test_a_taken_port_falls_back_to_a_free_one(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        demo = _start_demo(tmp_path, "--steps", "2", "--speed", "0", "--no-wandb", "--prometheus-port", str(port))
        out, err = demo.communicate()
    assert demo.returncode == 0, err
    assert f"port {port} is taken" in err and "is taken" not in out  # a warning: stdout is the run's lines
    url = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("metrics URL: "))
    assert url.startswith("http://127.0.0.1:") and f":{port}/" not in url
    assert len(_step_lines(out.splitlines())) == 2


def _stopped_after_step_3(tmp_path: Path, signum: int) -> tuple[list[str], str, int]:
    """The lines a demo printed when ``signum`` stopped it after step 3, its stderr and exit code."""
    demo = _start_demo(tmp_path, "--steps", "100000", "--speed", "5", "--no-wandb")
    try:
        assert demo.stdout is not None and demo.stderr is not None
        seen = []
        for line in _lines(demo.stdout):
            seen.append(line)
            if line.startswith("step 3 "):
                break
        demo.send_signal(signum)
        out, err = demo.communicate(timeout=120)
    finally:
        demo.kill()
        demo.wait()
    return [*seen, *out.splitlines()], err, demo.returncode


def test_ctrl_c_stops_the_demo_cleanly(tmp_path: Path) -> None:
    seen, err, code = _stopped_after_step_3(tmp_path, signal.SIGINT)
    assert code in (0, 130)
    assert "Traceback" not in err and "Traceback" not in "".join(seen)
    assert any(line.startswith("interrupted after") for line in seen)
    printed = len(_step_lines(seen))
    written = _rows_by_step(tmp_path / "out" / "metrics.jsonl")  # every line parses: written whole
    assert printed >= 3 and len(written) == printed  # every step shown was also written


def test_sigterm_stops_the_demo_like_ctrl_c_and_exits_143(tmp_path: Path) -> None:
    """`timeout`, `docker stop` and Slurm send SIGTERM: the step in progress finishes, every file
    holds the same steps and run.json says how many."""
    seen, err, code = _stopped_after_step_3(tmp_path, signal.SIGTERM)
    assert code == 143, err
    assert "Traceback" not in err and any(line.startswith("interrupted after") for line in seen)
    printed = len(_step_lines(seen))
    run = find_run(tmp_path / "out")
    assert run is not None and run.steps == printed >= 3
    assert len(_rows_by_step(tmp_path / "out" / "metrics.jsonl")) == printed
    assert [step for step, _ in run.posted_sums()] == list(range(1, printed + 1))


def _demo_in_process(out: Path, *args: str) -> int:
    """``staleness-metrics demo`` in this process (a KeyboardInterrupt let through: -1)."""
    argv = ["demo", "--out-dir", str(out), "--prometheus-port", "0", "--no-wandb", "--no-live"]
    try:
        return main([*argv, "--speed", "0", *args])
    except KeyboardInterrupt:
        return -1


def test_ctrl_c_before_the_first_step_leaves_this_runs_run_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted while it warms up (or starts W&B), the demo has emptied the last run's files: its
    run.json must be this run's (no steps), not the last one's over empty files."""
    out = tmp_path / "out"
    assert _demo_in_process(out, "--steps", "2", "--policy", "episode", "--max-staleness", "3") == 0

    def interrupted() -> None:
        raise KeyboardInterrupt  # what Ctrl-C does before the first step

    monkeypatch.setattr("staleness_metrics.demo.warm_up", interrupted)
    assert _demo_in_process(out, "--steps", "5") == 130
    run = find_run(out)
    assert run is not None and run.steps == 0
    config = run.staleness_config()
    assert (config.policy, config.max_staleness) == ("token", 8)
    assert all((out / name).read_text() == "" for name in ("events.jsonl", "metrics.jsonl"))


def test_ctrl_c_while_the_demo_is_imported_exits_130_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Importing(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            raise KeyboardInterrupt  # Ctrl-C in the middle of `from ...demo import ...`

    monkeypatch.setitem(sys.modules, "staleness_metrics.demo", Importing("staleness_metrics.demo"))
    assert _demo_in_process(tmp_path / "out", "--steps", "1") == 130
    assert capsys.readouterr() == ("", "")


def test_a_missing_extra_is_said_for_what_was_asked_for_not_skipped_in_silence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without rich, ``--live`` says why there is no table; without wandb, the W&B run (on by default)
    says once why it did not start. A terminal's default table and ``--no-wandb`` ask for nothing."""
    monkeypatch.setitem(sys.modules, "rich", None)  # an install without [cli]
    monkeypatch.setitem(sys.modules, "wandb", None)  # ... and without [wandb]
    for name in [name for name in os.environ if name.startswith("OTEL_EXPORTER_OTLP")]:
        monkeypatch.delenv(name)
    argv = ["demo", "--steps", "1", "--speed", "0", "--prometheus-port", "0"]
    assert main([*argv, "--out-dir", str(tmp_path / "asked"), "--live"]) == 0
    said = capsys.readouterr().err.splitlines()
    assert "no live table: --live needs rich: pip install 'staleness-metrics[cli]'" in said
    assert said.count("no W&B run: WandbExporter needs wandb: pip install 'staleness-metrics[wandb]'") == 1

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())  # the live table by default, had rich been there
    assert main([*argv, "--out-dir", str(tmp_path / "default"), "--no-wandb"]) == 0
    said = capsys.readouterr().err
    assert "live table" not in said and "W&B" not in said and "pip install" not in said


def test_the_command_the_demo_names_runs_as_printed_for_any_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "my run's (1)"  # a space, a quote, parentheses: pasted into a shell
    assert _demo_in_process(out, "--steps", "2") == 0
    named = capsys.readouterr().out.splitlines()[-1].split("Next: ", 1)[1]
    words = shlex.split(named)  # as a POSIX shell splits it
    assert words == ["staleness-metrics", "report", str(out)]
    assert main([*words[1:], "-o", str(tmp_path / "report.html")]) == 0


def test_a_folder_another_demo_uses_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _start_demo(tmp_path, "--steps", "100000", "--speed", "5", "--no-wandb")
    try:
        assert first.stdout is not None
        next(line for line in _lines(first.stdout) if line.startswith("step 1 "))
        assert _demo_in_process(tmp_path / "out", "--steps", "1", "--seed", "2") == 2
        assert capsys.readouterr().err == f"staleness-metrics demo: {tmp_path / 'out'} is in use by another demo\n"
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 130, err
    run = find_run(tmp_path / "out")  # the first demo's files, untouched by the second
    assert run is not None and run.steps is not None and run.steps >= 1
    assert list(_rows_by_step(tmp_path / "out" / "metrics.jsonl")) == list(range(1, run.steps + 1))
    assert _demo_in_process(tmp_path / "out", "--steps", "1") == 0  # let go on exit


def test_metrics_out_to_a_fifo_is_written_as_it_goes(tmp_path: Path) -> None:
    """A FIFO (or ``/dev/stdout`` piped on) takes the lines as they come; run.json names no file for them."""
    out, fifo = tmp_path / "out", tmp_path / "fifo"
    assert _demo_in_process(out, "--steps", "2") == 0
    before = (out / "metrics.jsonl").read_bytes()
    os.mkfifo(fifo)
    piped = list[str]()
    reader = threading.Thread(target=lambda: piped.append(fifo.read_text()), daemon=True)
    reader.start()
    assert _demo_in_process(out, "--steps", "3", "--seed", "1", "--metrics-out", str(fifo)) == 0
    reader.join(60)
    assert [json.loads(line)["step"] for line in piped[0].splitlines()] == [1, 1, 2, 2, 3, 3]
    run = find_run(out)
    assert run is not None and run.steps == 3 and run.metrics is None
    assert (out / "metrics.jsonl").read_bytes() == before  # (the last run's: not named)


def test_a_metrics_out_that_cannot_be_opened_leaves_the_last_run_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert _demo_in_process(out, "--steps", "2") == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    capsys.readouterr()
    (tmp_path / "folder").mkdir()
    assert _demo_in_process(out, "--steps", "2", "--seed", "1", "--metrics-out", str(tmp_path / "folder")) == 2
    assert capsys.readouterr().err == f"staleness-metrics demo: [Errno 21] Is a directory: '{tmp_path / 'folder'}'\n"
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


# In a child process whose files may not pass 700 kB (a full disk), SIGXFSZ ignored: a write fails with EFBIG.
_FULL_DISK = """
import resource, signal, sys
from staleness_metrics.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (700_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_is_said_naming_the_file_and_the_files_end_at_the_last_finished_step(tmp_path: Path) -> None:
    """Step 3's events do not fit: the error names events.jsonl, each file holds steps 1 and 2 whole, as
    run.json says, and the directory reports."""
    out = tmp_path / "out"
    argv = ["demo", "--steps", "5", "--speed", "0", "--prometheus-port", "0", "--no-wandb", "--out-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, *argv], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == f"staleness-metrics demo: [Errno 27] File too large: '{out / 'events.jsonl'}'\n"
    run = find_run(out)
    assert run is not None and run.steps == 2
    events = read_event_file(out / "events.jsonl")
    assert [e["step"] for e in events if e["type"] == "ship"] == [1, 2]
    assert [step for step, _ in run.posted_sums()] == [1, 2]
    logprobs = [json.loads(line) for line in (out / "trainer-logprobs.jsonl").read_text().splitlines()]
    assert {row["step"] for row in logprobs} == {1, 2}
    assert main(["report", str(out), "-o", str(tmp_path / "report.html")]) == 0


_OWN = " is one of the demo's files in {out}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "-1"], "seed: must be >= 0, got -1"),
        (["--speed", "nan"], "speed: must be a finite number >= 0, got nan"),
        (["--speed", "inf"], "speed: must be a finite number >= 0, got inf"),
        (["--metrics-out", "{out}/events.jsonl"], "metrics-out: {out}/events.jsonl" + _OWN),
        (["--metrics-out", "{out}/../out/run.json"], "metrics-out: {out}/../out/run.json" + _OWN),
    ],
)
def test_bad_values_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "out"
    assert _demo_in_process(out, "--steps", "1", *(arg.format(out=out) for arg in args)) == 2
    assert capsys.readouterr().err == f"staleness-metrics demo: {message.format(out=out)}\n"
    assert not out.exists()  # refused before anything is written


def test_a_tiny_speed_waits_instead_of_overflowing() -> None:
    stop = threading.Event()
    steps = _paced(2, 1e-300, stop)  # step 2's slot is 1e300 s away: past what a wait can take
    assert next(steps) == 1
    threading.Timer(0.2, stop.set).start()
    assert list(steps) == []


def test_demo_logs_an_offline_wandb_run_and_exports_otlp_when_configured(tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.endpoint, "WANDB_MODE": "offline"}
        demo = _start_demo(tmp_path, "--steps", "5", "--speed", "0", env=env)
        out, err = demo.communicate()
        assert demo.returncode == 0, err
        requests = receiver.wait_for(1)
    assert "OTLP:" in out and "W&B offline run:" in out
    steps = [p.as_int for r in requests for p in metrics_by_name(r)["rl.staleness.train.step"].gauge.data_points]
    assert max(steps) == 5
    history = read_run(find_run_file(tmp_path / "out" / "wandb")).history
    logged = [row for row in history if "staleness/rollout/max" in row]
    assert [row["trainer/step"] for row in logged] == [1, 2, 3, 4, 5]
    # The mismatch family in the W&B run file: the last row of each step holds the merged values.
    expected = _live_path_family(5, StalenessConfig(env_breakdown=True))
    costs: dict[int, dict[str, Any]] = {}
    for row in history:
        if "staleness/mismatch/k3" in row:
            costs[row["trainer/step"]] = _family(row)
    assert list(costs) == [1, 2, 3, 4, 5]
    for step, values in costs.items():
        assert values == pytest.approx(expected[step]), step
    # Bucket 3 is where this pipeline's tokens mostly are: the k3 of SPEC 11 from the drift model.
    assert all("staleness/mismatch/lag_3/k3" in costs[step] for step in (4, 5))


def test_the_simulation_is_an_async_pipeline_and_a_seed_replays_it() -> None:
    def first_steps(seed: int, count: int = 12) -> list[dict[str, Any]]:
        simulation = Simulation(seed)
        events = []
        for _, step in zip(range(count), simulation.steps(), strict=False):
            events.extend(step.events())
        return events

    events = first_steps(3)
    assert events == first_steps(3)
    assert events != first_steps(4)
    rollouts = [e["rollout"] for e in events if e["type"] == "rollout"]
    assert {r["env"] for r in rollouts} >= {"math", "code", "agent", "frozen-teacher"}
    frozen = [r for r in rollouts if r.get("source") == "frozen"]
    assert 0 < len(frozen) < len(rollouts) / 3
    groups: dict[object, int] = {}
    for r in rollouts:
        groups[r["group_id"]] = groups.get(r["group_id"], 0) + 1
    assert max(groups.values()) == 4  # GRPO groups of 4
    # Weights change in the middle of responses: some samples hold several version spans.
    assert any(len(s.get("weight_versions", [])) > 1 for r in rollouts for s in r["samples"])
    assert len({len(s["mask"]) for r in rollouts for s in r["samples"]}) > 50  # varying lengths


def test_the_demo_directory_replays_to_the_metrics_it_logged_costs_included(tmp_path: Path) -> None:
    demo = _start_demo(tmp_path, "--steps", "20", "--speed", "0", "--no-wandb", "--max-staleness", "4")
    out, err = demo.communicate()
    assert demo.returncode == 0, err
    directory = tmp_path / "out"
    # The demo names one command, and that command needs nothing but the directory.
    assert out.splitlines()[-1] == f"done: 20 steps. Next: staleness-metrics report {directory}"
    named = [line for line in out.splitlines() if re.search(r"staleness-metrics (report|what-if|replay)", line)]
    assert named == [out.splitlines()[-1]]
    logged = _rows_by_step(directory / "metrics.jsonl")
    run = find_run(directory)
    assert run is not None and run.steps == 20 and run.staleness_config().max_staleness == 4
    config = run.staleness_config()
    # The event stream alone (what the orchestrator saw) replays to every key the orchestrator logged.
    events = read_event_file(directory / "events.jsonl")
    replayed = [s.report.row() for s in replay(as_replay_events(events), config)]
    assert len(replayed) == 20
    for mine, theirs in zip(replayed, logged.values(), strict=True):
        assert set(mine) == {k for k in theirs if not k.startswith(("staleness/mismatch/", "staleness/bound/"))}
        for key, value in mine.items():
            assert theirs[key] == pytest.approx(value), key
    # Joined to the trainer's log-probabilities written beside them, the replay reports what staleness cost
    # exactly as the live path logged it: the directory holds everything the cost needs.
    with_costs = [s.report.row() for s in replay(run.events_with_costs(), config)]
    # `replay DIRECTORY` is that replay: the run's settings (bound 4), its records joined to the trainer's.
    assert main(["replay", str(directory), "--metrics-out", str(tmp_path / "rows.jsonl")]) == 0
    assert [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()] == with_costs
    costs = _live_path_family(20, config)
    for mine, theirs in zip(with_costs, logged.values(), strict=True):
        assert _family(mine) == pytest.approx(_family(theirs)), mine["step"]
        assert _family(theirs) == pytest.approx(costs[mine["step"]])
    # The sums the trainer posted are the ones behind the logged rows.
    posted = dict(run.posted_sums())
    assert list(posted) == list(range(1, 21))
    assert all(_family(posted[step].metrics()) == pytest.approx(_family(row)) for step, row in logged.items())
    assert any(row.get("staleness/token/masked", 0) > 0 for row in logged.values())  # the bound bit at 4


def test_the_floor_is_measured_at_the_start_and_carried_so_every_step_has_an_excess(tmp_path: Path) -> None:
    """Fully asynchronous: no step after the first has lag-0 tokens, yet SPEC 14 has a floor for each."""
    demo = _start_demo(tmp_path, "--steps", "25", "--speed", "0", "--no-wandb")
    _, err = demo.communicate()
    assert demo.returncode == 0, err
    run = find_run(tmp_path / "out")
    assert run is not None
    posted = run.posted_sums()
    lag0 = {step: int(sums.tokens[0]) for step, sums in posted}
    assert lag0[1] == posted[0][1].covered > 1000  # step 1 trains version 0 on version-0 tokens only
    assert all(count < 1000 for step, count in lag0.items() if step > 1)  # never enough again: asynchronous
    tracker = BoundTracker(run.staleness_config())
    sources = {}
    for step, sums in posted:
        judged = tracker.observe(step, sums, bound=8)
        assert judged is not None and judged.floor is not None
        sources[step] = (judged.floor.source, judged.floor.age)
    assert sources == {1: ("lag0", 0)} | {step: ("carried", step - 1) for step in range(2, 26)}
    # What the run logged says the same, and every step after the first reports its excess.
    rows = _rows_by_step(tmp_path / "out" / "metrics.jsonl")
    logged = {s: (r["staleness/mismatch/floor_source"], r["staleness/mismatch/floor_age"]) for s, r in rows.items()}
    assert logged == sources
    assert all("staleness/mismatch/excess_k3" in rows[step] for step in range(2, 26))


def test_the_suggested_bound_is_where_the_drift_model_puts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The suggestion docs/getting-started.md expects, from the drift model's formula, against the measured one."""
    model = DriftModel()
    expected = expected_suggested_bound(model)
    assert expected == math.floor(model.floor / model.drift_per_version) == 5  # docs/getting-started.md says 5
    demo = _start_demo(tmp_path, "--steps", "30", "--speed", "0", "--no-wandb")
    _, err = demo.communicate()
    assert demo.returncode == 0, err
    run = find_run(tmp_path / "out")
    assert run is not None
    tracker = BoundTracker(run.staleness_config())
    judged = [tracker.observe(step, sums, bound=8) for step, sums in run.posted_sums()]
    last = judged[-1]
    assert last is not None and last.advice is not None
    assert abs(last.advice.suggested - expected) <= 1
    # The demo's own measurement, as it logged it: the same suggestion.
    rows = _rows_by_step(tmp_path / "out" / "metrics.jsonl")
    assert rows[30]["staleness/bound/suggested"] == last.advice.suggested
    assert last.advice.crossed  # the data shows where the budget is crossed
    # Inside the demo's lag range: lags above the suggestion were shipped (and cost more than the budget).
    assert max(last.curve.lags) > last.advice.suggested
    # What-if on the directory (its settings from run.json, the trainer's log-probabilities joined) marks the
    # same bound, pooled over the run; --json carries it.
    assert main(["what-if", str(tmp_path / "out"), "--max-staleness", "0..10", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    (pooled,) = {row["suggested_bound"] for row in rows}
    assert abs(pooled - expected) <= 1
    assert [row["max_staleness"] for row in rows if row["suggested"]] == [pooled]
    assert [row["within_budget"] for row in rows] == [b <= pooled for b in range(11)]
    assert all(row["trained_k3"] is not None for row in rows)  # the cost columns, from the directory alone


def test_an_out_dir_that_cannot_be_made_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("")  # a file where the output directory should go
    demo = _start_demo(tmp_path, "--steps", "1", "--speed", "0", "--no-wandb")
    _, err = demo.communicate(timeout=120)
    assert demo.returncode == 2
    assert err == f"staleness-metrics demo: out-dir: {tmp_path / 'out'} is not a folder\n"


def test_the_drift_model_grows_with_lag_and_policy_speed() -> None:
    """The documented model, checked on its own numbers: floor at lag 0, excess (speed * lag)^2 / 2."""
    model = DriftModel(floor=0.05, drift_per_version=0.08, warmup_steps=10)
    lags = np.array([0, 1, 4, -1])
    assert model.sigma(lags, 20).tolist() == pytest.approx([0.05, np.hypot(0.05, 0.08), np.hypot(0.05, 0.32), 0.05])
    assert model.sigma(lags, 5)[2] == pytest.approx(np.hypot(0.05, 0.16))  # half speed during warm-up
    assert DriftModel().sigma(lags, 1)[2] == pytest.approx(np.hypot(0.05, 0.036))  # the default: no warm-up
    assert expected_suggested_bound(model) == 0  # 0.05 / 0.08 < 1: even lag 1 costs more than the floor
    assert expected_suggested_bound(model, budget=0.08**2 * 3**2 / 2) == 3

    monitor = StalenessMonitor(StalenessConfig(max_staleness=100))
    simulation, trainer = Simulation(0), SimulatedTrainer(0, model=model)
    for _, events in zip(range(12), simulation.steps(), strict=False):
        monitor.add(events.rollouts)
        shipment = monitor.ship(events.step, events.ship_ids)
        trained = trainer.train(monitor, shipment)
        assert trained is not None and trained.sums == monitor.mismatch(events.step)
        total = trained.sums
        assert total.sampled == shipment.report.tally.tokens_sampled  # every sampled position, covered
        assert len(shipped_mask(shipment)) == len(shipment.lags)
    assert total is not None
    k3 = total.sum_k3 / np.maximum(total.tokens, 1)
    filled = [i for i, n in enumerate(total.tokens.tolist()[:17]) if n > 2000]  # single-lag buckets
    assert len(filled) >= 2
    for i in filled:  # the expected k3 of a bucket is sigma^2 / 2 at its lag (step 12: full speed)
        lag = int(LAG_BUCKETS[i])
        assert k3[i] == pytest.approx(float(model.sigma(np.array([lag]), 12)[0]) ** 2 / 2, rel=0.15)
    assert all(k3[a] < k3[b] for a, b in itertools.pairwise(filled))


def test_the_live_caption_shows_the_excess_the_monitor_published() -> None:
    """The console caption reads what the monitor published for the step (SPEC 11 over SPEC 14's floor), so a
    fully asynchronous run shows its excess, the excess at the bound and the suggestion after step 1."""
    monitor = StalenessMonitor(StalenessConfig(env_breakdown=True))
    simulation, trainer = Simulation(0), SimulatedTrainer(0)
    captions = {}
    for _, events in zip(range(6), simulation.steps(), strict=False):
        monitor.add(events.rollouts)
        shipment = monitor.ship(events.step, events.ship_ids)
        trainer.train(monitor, shipment)
        published = monitor.mismatch_metrics(events.step)
        assert published is not None
        captions[events.step] = (_cost_caption(published), published)
    for step in range(2, 7):
        caption, published = captions[step]
        excess = published["staleness/mismatch/excess_k3"]
        assert isinstance(excess, float)
        assert f", excess {excess:.4g}" in caption and "(carried)" in caption, caption
        assert f", suggested bound {published['staleness/bound/suggested']}" in caption
