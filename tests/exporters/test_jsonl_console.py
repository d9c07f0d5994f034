"""JSONL and console exporters."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from staleness_metrics.exporters.console import ConsoleExporter, format_line
from staleness_metrics.exporters.jsonl import JsonlExporter
from staleness_metrics.metrics.report import StepReport, Tally
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import CONFIG, hand_report, ship_script


def test_jsonl_writes_one_metrics_out_line_per_ship(tmp_path: Path) -> None:
    path = tmp_path / "out" / "metrics.jsonl"
    exporter = JsonlExporter(path)
    rows = []
    with StalenessMonitor(CONFIG, [exporter]) as monitor:
        for records, step in ship_script(3):
            monitor.add(records)
            rows.append(monitor.ship(step).report.row())
        assert exporter.flush(timeout=60)
        # flushed line by line: readable while the run goes on
        assert len(path.read_text().splitlines()) == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


def test_jsonl_append_continues_a_file_and_numpy_numbers_are_plain(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    exporter = JsonlExporter(path, append=True)
    report = StepReport(2, 4, {"staleness/rollout/max": np.int64(3), "staleness/token/mean": np.float64(1.5)}, Tally())
    exporter.export(report)
    exporter.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1}, {"step": 2, "staleness/rollout/max": 3, "staleness/token/mean": 1.5}]


def test_jsonl_append_cuts_a_line_torn_by_a_process_that_died_in_it(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "staleness/tok')  # killed mid-line
    exporter = JsonlExporter(path, append=True)
    exporter.export(StepReport(3, 4, {}, Tally()))
    exporter.export(StepReport(4, 4, {}, Tally()))
    exporter.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": s} for s in (1, 3, 4)]


def test_jsonl_writes_to_a_pipe_and_a_fifo_as_it_goes(tmp_path: Path) -> None:
    """``/dev/stdout`` piped into another program, or a FIFO: no seek, each line as it comes."""
    read, write = os.pipe()
    fifo, from_fifo = tmp_path / "fifo", list[str]()
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: from_fifo.append(fifo.read_text()), daemon=True)
    reader.start()  # (the writer's open waits for a reader)
    for path in (f"/dev/fd/{write}", fifo):
        exporter = JsonlExporter(path)
        with StalenessMonitor(CONFIG, [exporter]) as monitor:
            for records, step in ship_script(2):
                monitor.add(records)
                monitor.ship(step)
        assert (exporter.queue.sent, exporter.queue.dropped) == (2, 0)
    os.close(write)
    reader.join(60)
    with open(read) as piped:
        texts = [piped.read(), *from_fifo]
    assert [[json.loads(line)["step"] for line in text.splitlines()] for text in texts] == [[8, 9]] * 2


# Runs in a child process: the file size limit applies to every file the process writes.
_DISK_FULL = """
import os, resource, signal, sys, time
from staleness_metrics.exporters.jsonl import JsonlExporter
from staleness_metrics.metrics.report import StepReport, Tally

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
exporter = JsonlExporter(sys.argv[1], retry_initial=0.01, retry_max=0.01)
exporter.export(StepReport(1, 4, {}, Tally()))
assert exporter.flush(60)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(sys.argv[1]) + 5, hard))  # full mid-line
exporter.export(StepReport(2, 4, {"staleness/token/mean": 1.5}, Tally()))
while exporter._errors.count("jsonl") < 3:  # the first attempt and two retries failed part-way
    time.sleep(0.01)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again
exporter.close(timeout=60)
"""


def test_jsonl_a_write_retried_after_a_full_disk_leaves_each_line_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", _DISK_FULL, str(path)], check=True, timeout=120, env=env)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1}, {"step": 2, "staleness/token/mean": 1.5}]


def test_console_line_shows_max_staleness() -> None:
    report = hand_report(12, {"": [[3, 1, 0], [2]]}, masked={"": 1}, dropped={"": 2})
    line = format_line(report)
    assert line == "step 12 | Max Staleness 3 | token mean 1.50 | masked 25.0% | dropped 2 rollouts"
    assert "Off-Policy" not in line


def test_console_line_for_an_empty_batch_and_held_rollouts() -> None:
    report = StepReport(
        5,
        2,
        {"staleness/rollout/dropped": 1, "staleness/rollout/held": 4, "staleness/max_staleness": 2},
        Tally(),
    )
    assert format_line(report) == (
        "step 5 | Max Staleness - | token mean - | masked - | dropped 1 rollouts | held 4 rollouts"
    )


def test_console_prints_one_line_per_step() -> None:
    stream = io.StringIO()
    with StalenessMonitor(CONFIG, [ConsoleExporter(stream)]) as monitor:
        for records, step in ship_script(3):
            monitor.add(records)
            monitor.ship(step)
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 8", "step 9", "step 10"]
    assert all(" | Max Staleness " in line for line in lines)


def test_console_through_rich_keeps_the_text() -> None:
    stream = io.StringIO()
    ConsoleExporter(stream, use_rich=True).export(hand_report(3, {"": [[2]]}))
    assert stream.getvalue().strip() == format_line(hand_report(3, {"": [[2]]}))


# The disk stays full: the line is given up when the exporter closes.
_GIVEN_UP = """
import os, resource, signal, sys, time
from staleness_metrics.exporters.jsonl import JsonlExporter
from staleness_metrics.metrics.report import StepReport, Tally

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
exporter = JsonlExporter(sys.argv[1], retry_initial=0.01, retry_max=0.01)
exporter.export(StepReport(1, 4, {}, Tally()))
assert exporter.flush(60)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(sys.argv[1]) + 5, resource.RLIM_INFINITY))
exporter.export(StepReport(2, 4, {"staleness/token/mean": 1.5}, Tally()))
while exporter._errors.count("jsonl") < 2:
    time.sleep(0.01)
exporter.close(timeout=0.1)  # gives the line up, its time spent retrying
while exporter.queue.worker_alive:  # (its last attempt, if one was under way)
    time.sleep(0.01)
assert exporter.queue.dropped == 1
"""


def test_jsonl_a_line_given_up_on_a_full_disk_is_not_left_torn(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", _GIVEN_UP, str(path)], check=True, timeout=120, env=env)
    assert path.read_text() == '{"step":1}\n'
