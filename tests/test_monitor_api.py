"""The monitor's public calls under signals, forks and wrong argument types."""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from staleness_metrics import StalenessConfig, StalenessError
from staleness_metrics.errors import FieldError, FieldTypeError
from staleness_metrics.exporters import BackgroundExporter, ConsoleExporter, JsonlExporter, PrometheusExporter
from staleness_metrics.exporters.base import DEFAULT_CLOSE_TIMEOUT
from staleness_metrics.metrics.report import StepReport
from staleness_metrics.monitor import CLOSE_GRACE, StalenessMonitor

ROOT = Path(__file__).resolve().parents[1]


def record(rid: str, version: int) -> dict[str, Any]:
    return {"id": rid, "dispatch_version": version, "samples": [{"mask": [1, 1]}]}


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (a deadlock there fails the test instead of hanging it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_signal_handler_closes_the_monitor_during_a_ship_and_may_not_checkpoint_half_of_it() -> None:
    # A real signal, raised while the main thread is inside ship (the exporter runs under its lock)
    found = run_python("""
        import signal
        from staleness_metrics import StalenessError, StalenessMonitor

        class Signalling:
            name = "signalling"
            exported = closed = 0
            def export(self, report):
                Signalling.exported += 1
                if Signalling.exported == 2:
                    signal.raise_signal(signal.SIGUSR1)  # the handler runs now, mid-ship
            def close(self):
                Signalling.closed += 1

        monitor = StalenessMonitor(exporters=[Signalling()])
        seen = []
        def handler(signum, frame):
            try:
                monitor.state_dict()
            except StalenessError as exc:
                seen.append(f"state_dict refused: {exc}")
            monitor.close(timeout=5)
            seen.append("closed")
        signal.signal(signal.SIGUSR1, handler)
        for step in (1, 2, 3):
            monitor.add({"id": f"r{step}", "dispatch_version": step - 1, "samples": [{"mask": [1]}]})
            monitor.ship(step)
        print(seen, Signalling.exported, Signalling.closed, monitor.export_errors.count("signalling"))
        print(sorted(monitor.state_dict()["shipped_steps"]))  # whole again once the handler returned
    """)
    assert found.returncode == 0, found.stderr
    handled, steps = found.stdout.splitlines()
    assert "state_dict refused: " in handled and "only close() may" in handled
    # closed in the handler; ship 3 (after it) exported nothing and was counted
    assert handled.endswith("'closed'] 2 1 1"), handled
    assert steps == "[[1, 3]]"


def test_a_ctrl_c_landing_anywhere_in_the_monitor_s_own_code_leaves_its_lock_free() -> None:
    """docs/checkpoints.md: set a flag in the handler, save when the loop sees it. A Ctrl-C raised
    at each point of an add where a signal's exception can land in monitor.py (as one of its
    functions starts, as a call it made returns: its lock taken, given back) leaves the loop that
    caught it free to save and ship, and another thread's call does not wait forever."""
    import staleness_metrics.monitor as monitor_module

    def in_monitor(frame: FrameType | None) -> bool:
        return frame is not None and frame.f_code.co_filename == monitor_module.__file__

    def interrupted_at(point: int) -> StalenessMonitor | None:
        """A monitor whose add a Ctrl-C interrupted at its ``point``-th such point (None: the add
        has fewer)."""
        monitor, points = StalenessMonitor(), itertools.count()

        def profiler(frame: FrameType, event: str, arg: object) -> None:
            owner = frame.f_back if event == "return" else frame  # (a call's: where it returns to)
            if event in ("call", "c_return", "return") and in_monitor(owner) and next(points) == point:
                raise KeyboardInterrupt  # (this turns the profiling off)

        sys.setprofile(profiler)
        try:
            monitor.add([record("a", 0)])
        except KeyboardInterrupt:
            return monitor
        finally:
            sys.setprofile(None)
        return None

    point = 0
    while (monitor := interrupted_at(point)) is not None:
        other = threading.Thread(target=monitor.state_dict, daemon=True)
        other.start()
        other.join(30)
        assert not other.is_alive(), f"interrupted at point {point}: another thread waits forever"
        monitor.add([record("b", 0)])  # (not "a" again: it may have been queued)
        assert "b" in monitor.ship(1).ids
        StalenessMonitor().load_state_dict(json.loads(json.dumps(monitor.state_dict())))
        point += 1
    assert point > 5


def test_a_child_forked_while_other_threads_hold_the_locks_uses_and_closes_its_monitor(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    jsonl = JsonlExporter(path)
    monitor = StalenessMonitor(exporters=[jsonl])
    monitor.add([record("a", 0)])
    monitor.ship(1)
    assert jsonl.flush(timeout=30)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:  # as a trainer thread inside add or ship at the moment of the fork
        with monitor._lock, monitor.export_errors._lock, jsonl.queue._cond:
            jsonl.queue.put(b"")  # pending at the fork (the worker waits for the lock held here)
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child: every call returns; it exports nothing of the parent's
            code = 1
            try:
                signal.alarm(60)
                monitor.add([record("b", 1)])
                started = time.monotonic()
                monitor.ship(2)
                monitor.close()
                jsonl.close()
                json.dumps(monitor.state_dict())
                code = 0 if time.monotonic() - started < 1 and jsonl.queue.pending == 0 else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 90
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the forked child hung or failed"
    finally:
        release.set()
        holder.join()
    monitor.add([record("c", 1)])
    monitor.ship(2)
    monitor.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] == [1, 2]


def test_the_run_label_must_be_a_string() -> None:
    with pytest.raises(FieldTypeError) as found:
        StalenessMonitor(run=42)  # type: ignore[arg-type]
    assert found.value.field == "run"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"config": {"max_staleness": 4}}, "config"),
        ({"exporters": [None]}, "exporters[0]"),
        ({"sink": StalenessConfig()}, "sink"),
        ({"error_log_interval": "30"}, "error_log_interval"),
    ],
)
def test_wrong_argument_types_are_named(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldTypeError) as found:
        StalenessMonitor(**kwargs)
    assert found.value.field == field


def test_add_and_ship_refuse_wrong_types_and_change_nothing() -> None:
    monitor = StalenessMonitor()
    with pytest.raises(FieldTypeError, match="rollouts"):
        monitor.add(None)  # type: ignore[arg-type]
    monitor.add([record("a", 0)])
    for ids in (7, [["a"]]):
        with pytest.raises(FieldTypeError) as found:
            monitor.ship(1, ids=ids)  # type: ignore[arg-type]
        assert found.value.field == "ids"
    assert monitor.sink.step == 0 and monitor.sink.queued == 1  # (the step did not advance)
    assert [r.id for r in monitor.ship(1, ids=("a",)).rollouts] == ["a"]


def test_close_with_a_bad_timeout_raises_before_closing_anything() -> None:
    closed = []

    class Exporter:
        name = "rec"

        def export(self, report: StepReport) -> None:
            pass

        def close(self) -> None:
            closed.append(1)

    monitor = StalenessMonitor(exporters=[Exporter()])
    with pytest.raises(FieldTypeError) as found:
        monitor.close("2")  # type: ignore[arg-type]
    assert found.value.field == "timeout" and not closed
    monitor.close()
    assert closed == [1]


@pytest.mark.parametrize("timeout", [math.nan, -1.0])
def test_close_refuses_a_nan_or_negative_timeout_before_closing_anything(timeout: float, tmp_path: Path) -> None:
    jsonl = JsonlExporter(tmp_path / "a.jsonl")
    monitor = StalenessMonitor(exporters=[jsonl])
    monitor.add([record("a", 0)])
    monitor.ship(1)
    with pytest.raises(FieldError) as found:
        monitor.close(timeout)
    assert found.value.field == "timeout"
    monitor.add([record("b", 1)])
    monitor.ship(2)  # the refused call closed nothing: this ship is exported
    monitor.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "a.jsonl").read_text().splitlines()] == [1, 2]
    assert monitor.export_errors.count("jsonl") == 0


@pytest.mark.parametrize("interval", [math.nan, -1.0])
def test_a_nan_or_negative_error_log_interval_is_named(interval: float) -> None:
    with pytest.raises(FieldError) as found:
        StalenessMonitor(error_log_interval=interval)
    assert found.value.field == "error_log_interval"


def test_close_with_an_infinite_timeout_waits_for_the_exporters(tmp_path: Path) -> None:
    """inf is no bound: the monitor's own (``close(inf)``), or an exporter's ``close_timeout``."""
    jsonl = JsonlExporter(tmp_path / "a.jsonl")
    monitor = StalenessMonitor(exporters=[jsonl])
    monitor.add([record("a", 0)])
    monitor.ship(1)
    monitor.close(math.inf)
    assert [json.loads(line)["step"] for line in (tmp_path / "a.jsonl").read_text().splitlines()] == [1]
    assert not jsonl.queue.worker_alive and monitor.export_errors.count("jsonl") == 0

    release, steps = threading.Event(), []

    class Slow:
        name = "slow"

        def export(self, report: StepReport) -> None:
            release.wait()
            steps.append(report.step)

        def close(self) -> None:
            pass

    monitor = StalenessMonitor(exporters=[BackgroundExporter(Slow(), close_timeout=math.inf)])
    for step in (1, 2):
        monitor.add([record(f"b{step}", 0)])
        monitor.ship(step)
    closing = threading.Thread(target=monitor.close, daemon=True)
    closing.start()
    closing.join(DEFAULT_CLOSE_TIMEOUT + CLOSE_GRACE + 0.25)
    assert closing.is_alive()  # past the default bound: still waiting for the exporter
    release.set()
    closing.join(60)
    assert not closing.is_alive() and steps == [1, 2] and monitor.export_errors.count("slow") == 0


def test_a_close_interrupted_by_ctrl_c_is_finished_by_the_next_close_and_a_late_exporter_counted_once() -> None:
    """docs/exporters.md: close "is safe to call twice"; after a Ctrl-C in the first, the second one
    still waits for the flush (its own timeout), and counts an exporter still closing once."""
    found = run_python("""
        import signal, time
        from staleness_metrics import StalenessMonitor
        from staleness_metrics.exporters import BackgroundExporter

        class Slow:
            name = "slow"
            def __init__(self):
                self.sent = []
            def export(self, report):
                time.sleep(0.1)
                self.sent.append(report.step)
            def close(self):
                pass

        signal.signal(signal.SIGALRM, signal.default_int_handler)  # what Ctrl-C does
        for second_timeout in (None, 0.05):
            slow = Slow()
            monitor = StalenessMonitor(exporters=[BackgroundExporter(slow, close_timeout=60)])
            for step in range(1, 11):
                monitor.add({"id": f"r{step}", "dispatch_version": step - 1, "samples": [{"mask": [1]}]})
                monitor.ship(step)
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # during the flush (10 x 0.1 s)
            try:
                monitor.close()
            except KeyboardInterrupt:
                interrupted = len(slow.sent)
            monitor.close(second_timeout)
            counted = monitor.export_errors.count("slow")
            started = time.monotonic()
            monitor.close()  # done, or the late one left to the background: at once
            print(interrupted < 10, slow.sent == list(range(1, 11)), counted, time.monotonic() - started < 0.05)
    """)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines() == ["True True 0 True", "True False 1 True"]


class Named:
    """An exporter whose ``name``, ``export`` or ``close`` may be of the wrong type."""

    def __init__(self, **attributes: Any) -> None:
        self.name, self.export, self.close = "mine", lambda report: None, lambda: None
        self.__dict__.update(attributes)


@pytest.mark.parametrize(
    ("attributes", "field"),
    [({"name": 5}, "exporters[0].name"), ({"name": None}, "exporters[0].name"),
     ({"export": 3}, "exporters[0].export"), ({"close": "x"}, "exporters[0].close")],
)  # fmt: skip
def test_an_exporter_of_the_wrong_type_is_refused_when_the_monitor_is_built(
    attributes: dict[str, Any], field: str
) -> None:
    """A name not a string would break every scrape and checkpoint later; ``export=3``, every ship."""
    prometheus = PrometheusExporter(port=None)
    with pytest.raises(FieldTypeError) as found:
        StalenessMonitor(exporters=[Named(**attributes), prometheus])
    assert found.value.field == field
    monitor = StalenessMonitor(exporters=[Named(), prometheus])  # the scrape and checkpoint work
    monitor.add([record("a", 0)])
    monitor.ship(1)
    assert b'exporter="mine"' in prometheus.exposition() and json.dumps(monitor.state_dict())


def test_a_single_exporter_not_in_a_list_is_named() -> None:
    with pytest.raises(FieldTypeError) as found:
        StalenessMonitor(StalenessConfig(), ConsoleExporter(io.StringIO()))  # type: ignore[arg-type]
    assert found.value.field == "exporters"


def test_loading_a_checkpoint_sets_the_export_error_counts(caplog: pytest.LogCaptureFixture) -> None:
    class Down:
        name = "down"

        def export(self, report: StepReport) -> None:
            raise RuntimeError("backend down")

        def close(self) -> None:
            pass

    caplog.set_level(logging.CRITICAL)
    monitor = StalenessMonitor(exporters=[Down()])
    for step in (1, 2, 3):
        monitor.add([record(f"a{step}", step - 1)])
        monitor.ship(step)
    checkpoint = json.loads(json.dumps(monitor.state_dict()))
    prometheus = PrometheusExporter(port=None)
    resumed = StalenessMonitor(exporters=[Down(), prometheus])
    for _ in range(2):  # loaded twice (a retried resume): the checkpoint's count, not twice it
        resumed.load_state_dict(checkpoint)
        assert resumed.export_errors.snapshot() == {"down": 3, "prometheus": 0}
    assert b'rl_staleness_export_errors_total{exporter="down",run="default"} 3.0' in prometheus.exposition()


def test_a_signal_handler_may_still_call_anything_between_calls() -> None:
    monitor = StalenessMonitor()
    monitor.add([record("a", 0)])
    monitor.ship(1)
    with monitor._lock, pytest.raises(StalenessError):  # (the lock is free again after a refused call)
        monitor.state_dict()
    assert monitor.state_dict()["shipped_steps"] == [[1, 1]]
