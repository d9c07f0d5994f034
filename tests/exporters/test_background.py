"""The bounded background queue: never blocks the caller, retries, drops the oldest, flushes on close."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics import StalenessMonitor
from staleness_metrics.errors import ConfigError, StalenessError
from staleness_metrics.exporters import JsonlExporter
from staleness_metrics.exporters.base import BackgroundExporter, ExportContext, ExportErrors, ExportQueue
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.metrics.report import StepReport, Tally


class Target:
    """A send function that can block (``gate``), fail (``fail`` more attempts) and refuse payloads."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.attempts = 0
        self.fail = 0
        self.refused: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def __call__(self, payload: int) -> None:
        self.started.set()
        self.gate.wait()
        self.attempts += 1
        if self.fail:
            self.fail -= 1
            raise ConnectionError("receiver down")
        if payload in self.refused:  # a payload the receiver always rejects
            raise ValueError("400 Bad Request")
        self.sent.append(payload)


def make_queue(target: Target, errors: ExportErrors, **options: float) -> ExportQueue[int]:
    return ExportQueue(
        "test",
        target,
        lambda message, exc: errors.record("test", message, exc),
        **{"retry_initial": 0.01, **options},
    )  # type: ignore[arg-type]


def test_put_never_waits_for_a_blocked_send_and_order_is_kept() -> None:
    target, errors = Target(), ExportErrors()
    target.gate.clear()
    queue = make_queue(target, errors)
    queue.put(0)
    assert target.started.wait(60)  # the worker is stuck in send(0)
    for i in range(1, 50):
        assert queue.put(i)  # returns while send(0) is still blocked
    assert target.sent == [] and queue.pending == 50
    target.gate.set()
    assert queue.flush(timeout=60)
    assert target.sent == list(range(50))
    assert queue.close() and errors.count("test") == 0


def test_a_full_queue_drops_the_oldest_waiting_payload_and_counts_it() -> None:
    target, errors = Target(), ExportErrors()
    target.gate.clear()
    queue = make_queue(target, errors, max_size=3)
    queue.put(0)
    assert target.started.wait(60)  # 0 is in flight; 1..5 wait in a queue of 3
    for i in range(1, 6):
        queue.put(i)
    target.gate.set()
    assert queue.flush(timeout=60)
    assert target.sent == [0, 3, 4, 5]
    assert queue.dropped == 2 and errors.count("test") == 2


def test_failed_sends_are_counted_and_retried_until_they_succeed() -> None:
    target, errors = Target(), ExportErrors()
    target.fail = 4
    queue = make_queue(target, errors, retry_max=0.02)
    queue.put(1)
    queue.put(2)
    assert queue.flush(timeout=60)
    assert target.sent == [1, 2]
    assert target.attempts == 6 and errors.count("test") == 4
    queue.close()


def test_a_payload_failing_for_ever_is_dropped_once_max_size_newer_ones_wait() -> None:
    """Retried while within the bound: once ``max_size`` newer payloads wait behind it, it is given up
    (counted) and the newer ones go out."""
    target, errors = Target(), ExportErrors()
    target.refused = {0}
    queue = make_queue(target, errors, max_size=3, retry_initial=60, retry_max=60)
    queue.put(0)
    assert target.started.wait(60)  # 0 is refused; its retry would wait 60 s ...
    for i in range(1, 4):
        queue.put(i)  # ... until the third newer payload puts it out of the bound
    assert queue.flush(timeout=60)
    assert target.sent == [1, 2, 3] and queue.dropped == 1
    assert errors.count("test") == 2  # the failed attempt and the drop


def test_close_flushes_then_gives_up_and_counts_what_is_left() -> None:
    target, errors = Target(), ExportErrors()
    target.fail = 10**9  # never recovers
    queue = make_queue(target, errors, retry_max=0.02)
    for i in range(3):
        queue.put(i)
    assert target.started.wait(60)
    assert queue.close(timeout=0.2) is False
    queue.join(60)  # the worker gave up the payload it was retrying
    assert queue.dropped == 3  # what waited, and the one in flight
    # every failed attempt, the payloads left waiting (one failure) and the one given up in flight
    assert errors.count("test") == target.attempts + 2
    assert queue.put(99) is False  # closed: refused, counted
    assert queue.dropped == 4 and errors.count("test") == target.attempts + 3
    assert target.sent == []


def test_close_waits_for_everything_queued() -> None:
    target, errors = Target(), ExportErrors()
    queue = make_queue(target, errors)
    for i in range(20):
        queue.put(i)
    assert queue.close(timeout=60)
    assert target.sent == list(range(20)) and queue.dropped == 0


@pytest.mark.parametrize("timeout", [None, math.inf])
def test_close_without_a_bound_waits_until_everything_is_sent(timeout: float | None) -> None:
    """None or inf: no bound (inf is not handed to ``join`` or ``wait``, which refuse it)."""
    target, errors = Target(), ExportErrors()
    target.gate.clear()
    queue = make_queue(target, errors)
    for payload in range(3):
        queue.put(payload)
    results: list[bool] = []
    closing = threading.Thread(target=lambda: results.append(queue.close(timeout)), daemon=True)
    closing.start()
    assert target.started.wait(60)
    closing.join(0.3)
    assert closing.is_alive()  # still waiting for the receiver
    target.gate.set()
    closing.join(60)
    assert results == [True] and target.sent == [0, 1, 2] and queue.dropped == 0 and errors.count("test") == 0


@pytest.mark.parametrize(("timeout", "kind"), [(math.nan, ValueError), (-1.0, ValueError), ("2", TypeError)])
def test_a_bad_timeout_is_refused_before_anything_is_closed(timeout: Any, kind: type[Exception]) -> None:
    """The same rule for ``ExportQueue.close``/``flush``, an exporter's ``close`` and its ``close_timeout``."""
    target, errors = Target(), ExportErrors()
    queue = make_queue(target, errors)
    for call in (queue.flush, queue.close):
        with pytest.raises(kind) as found:
            call(timeout)
        assert isinstance(found.value, StalenessError) and found.value.field == "timeout"
    assert queue.put(1) and queue.close(60) and target.sent == [1]  # (nothing was closed)
    with pytest.raises(kind) as found:
        BackgroundExporter(SlowExporter(), close_timeout=timeout)
    assert isinstance(found.value, StalenessError) and found.value.field == "close_timeout"
    inner = SlowExporter()
    inner.gate.set()
    exporter = BackgroundExporter(inner)
    exporter.export(StepReport(1, 2, {}, Tally()))
    with pytest.raises(kind) as found:
        exporter.close(timeout)
    assert isinstance(found.value, StalenessError) and found.value.field == "timeout" and not inner.closed
    exporter.close()
    assert inner.steps == [1] and inner.closed


def test_an_infinite_close_timeout_closes_without_a_bound(tmp_path: Path) -> None:
    exporter = JsonlExporter(tmp_path / "a.jsonl", close_timeout=math.inf)
    assert exporter.close_timeout == math.inf
    exporter.export(StepReport(1, 2, {}, Tally()))
    exporter.close()
    assert exporter.queue.sent == 1 and exporter.queue.dropped == 0 and not exporter.queue.worker_alive


def test_failures_are_logged_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    errors = ExportErrors(log_interval=3600)
    with caplog.at_level(logging.WARNING, logger="staleness_metrics.exporters"):
        for _ in range(5):
            errors.record("otlp", "export failed", ConnectionError("refused"))
        errors.record("wandb", "log failed")
    assert errors.count("otlp") == 5
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["exporter otlp: export failed: ConnectionError: refused", "exporter wandb: log failed"]
    quiet = ExportErrors(log_interval=0)
    with caplog.at_level(logging.WARNING, logger="staleness_metrics.exporters"):
        caplog.clear()
        quiet.record("otlp", "a")
        quiet.record("otlp", "b")
    assert len(caplog.records) == 2


class SlowExporter:
    name = "slow"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.steps: list[int] = []
        self.closed = False
        self.context: ExportContext | None = None

    def attach(self, context: ExportContext) -> None:
        self.context = context

    def export(self, report: StepReport) -> None:
        self.gate.wait()
        self.steps.append(report.step)

    def close(self) -> None:
        self.closed = True


def test_background_exporter_wraps_any_slow_exporter() -> None:
    inner = SlowExporter()
    wrapped = BackgroundExporter(inner)
    context = ExportContext(run="r")
    wrapped.attach(context)
    assert inner.context is context
    for step in range(1, 4):
        wrapped.export(StepReport(step, 2, {}, Tally()))  # returns while inner.export blocks
    assert inner.steps == []
    inner.gate.set()
    wrapped.close()
    assert inner.steps == [1, 2, 3] and inner.closed


class BlockingExporter:
    """An exporter whose ``export`` and ``close`` block until released (a receiver that never answers)."""

    name = "blocking"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exporting = threading.Event()
        self.closing = threading.Event()

    def export(self, report: StepReport) -> None:
        self.exporting.set()
        self.release.wait()

    def close(self) -> None:
        self.closing.set()
        self.release.wait()


def test_close_returns_with_a_send_stuck_in_io_and_leaves_it_to_a_daemon_worker() -> None:
    """``close(timeout)`` bounds the whole close: the stuck send's payload is dropped, the worker abandoned."""
    target, errors = Target(), ExportErrors()
    target.gate.clear()
    queue = make_queue(target, errors)
    queue.put(0)
    queue.put(1)
    assert target.started.wait(60)  # send(0) is stuck
    assert queue.close(timeout=0.05) is False  # returned although send(0) never will by itself
    assert queue.worker_alive and queue.worker_is_daemon  # the process can still exit
    assert queue.dropped == 2  # payload 1, never attempted, and 0, given up while being sent
    target.gate.set()  # the stuck send completes at last, and the worker exits instead of sending more
    queue._worker.join(60)
    assert not queue.worker_alive and target.sent == [0] and queue.dropped == 2 and queue.sent == 0


class FailingClose(SlowExporter):
    def close(self) -> None:
        raise OSError("flush failed")


def test_a_wrapped_exporter_raising_from_close_is_counted() -> None:
    errors = ExportErrors()
    exporter = BackgroundExporter(FailingClose())
    exporter.attach(ExportContext(errors=errors))
    exporter.close(timeout=60)
    assert errors.count("slow") == 1


def test_exporter_close_is_bounded_even_when_its_shutdown_blocks() -> None:
    inner, errors = BlockingExporter(), ExportErrors()
    exporter = BackgroundExporter(inner, retry_initial=0.01)
    exporter.attach(ExportContext(errors=errors))
    exporter.export(StepReport(1, 2, {}, Tally()))
    assert inner.exporting.wait(60)
    exporter.close(timeout=0.2)  # export and shutdown both blocked: close returns anyway
    assert inner.closing.wait(60)  # the shutdown was started (on its own daemon thread)
    assert errors.count("blocking") == 2  # the report given up and the unfinished shutdown (logged)
    assert exporter.queue.worker_is_daemon
    inner.release.set()


class StuckThenRefused(SlowExporter):
    """A receiver that holds the request until ``gate`` is set, then fails it (a blackholing collector)."""

    def __init__(self) -> None:
        super().__init__()
        self.exporting = threading.Event()

    def export(self, report: StepReport) -> None:
        self.exporting.set()
        self.gate.wait()
        raise ConnectionError("timed out")


def test_close_giving_up_a_stuck_send_counts_and_logs_it_once(caplog: pytest.LogCaptureFixture) -> None:
    """docs/exporters.md: close counts what is left as dropped, the report being sent too: when close returns
    (a script exiting right after still counted it), and not again when the stuck send fails later."""
    inner = StuckThenRefused()
    exporter = BackgroundExporter(inner, close_timeout=0.2)
    monitor = StalenessMonitor(exporters=[exporter])
    monitor.add([{"id": "a", "dispatch_version": 0, "samples": [{"mask": [1]}]}])
    monitor.ship(1)
    assert inner.exporting.wait(60)
    with caplog.at_level(logging.WARNING, logger="staleness_metrics.exporters"):
        monitor.close()
    assert exporter.queue.dropped == 1 and monitor.export_errors.count("slow") == 1
    assert [r.getMessage() for r in caplog.records] == ["exporter slow: closed while a report was being sent; dropped"]
    inner.gate.set()  # the stuck send fails at last: the same report, not counted again
    exporter.queue.join(60)
    assert not exporter.queue.worker_alive
    assert exporter.queue.dropped == 1 and exporter.queue.sent == 0 and monitor.export_errors.count("slow") == 1


def test_close_after_everything_was_sent_counts_nothing() -> None:
    target, errors = Target(), ExportErrors()
    queue = make_queue(target, errors)
    queue.put(0)
    assert queue.flush(timeout=60)
    assert queue.close(timeout=0.05) and queue.dropped == 0 and errors.count("test") == 0 and queue.sent == 1


def _make(kind: str, tmp_path: Path, **settings: Any) -> object:
    if kind == "queue":
        return ExportQueue("test", Target(), lambda message, exc: None, **settings)
    if kind == "background":
        return BackgroundExporter(SlowExporter(), **settings)
    return JsonlExporter(tmp_path / "a.jsonl", **settings)


BAD_QUEUE_SETTINGS = [
    ({"retry_initial": math.nan}, "retry_initial", ValueError),
    ({"retry_initial": -1.0}, "retry_initial", ValueError),
    ({"retry_initial": 0}, "retry_initial", ValueError),  # a failing exporter would retry in a tight loop
    ({"retry_initial": math.inf}, "retry_initial", ValueError),
    ({"retry_initial": None}, "retry_initial", ValueError),
    ({"retry_initial": "1"}, "retry_initial", TypeError),
    ({"retry_initial": True}, "retry_initial", TypeError),
    ({"retry_max": math.nan}, "retry_max", ValueError),
    ({"retry_initial": 5.0, "retry_max": 1.0}, "retry_max", ValueError),
    ({"retry_max": math.inf}, "retry_max", ValueError),
    ({"retry_max": 1e12}, "retry_max", ValueError),  # finite, but no wait takes it: the worker would die
]


@pytest.mark.parametrize("kind", ["queue", "background", "jsonl"])
@pytest.mark.parametrize(("settings", "field", "error"), BAD_QUEUE_SETTINGS)
def test_bad_retry_settings_are_refused_naming_the_setting(
    kind: str, settings: dict[str, Any], field: str, error: type[Exception], tmp_path: Path
) -> None:
    before = set(threading.enumerate())
    with pytest.raises(error) as found:
        _make(kind, tmp_path, **settings)
    assert isinstance(found.value, StalenessError) and found.value.field == field and field in str(found.value)
    started = set(threading.enumerate()) - before
    assert not [t for t in started if t.name.startswith("staleness-")]  # no worker left behind


@pytest.mark.parametrize("kind", ["background", "jsonl", "queue"])
@pytest.mark.parametrize("size", [0, -5, True, 2.5, "8"])
def test_a_bad_queue_size_is_refused_by_the_name_it_was_given(kind: str, size: Any, tmp_path: Path) -> None:
    name = "max_size" if kind == "queue" else "max_queue"
    with pytest.raises(ConfigError) as found:
        _make(kind, tmp_path, **{name: size})
    assert found.value.field == name and str(found.value).startswith(f"{name}: ")


@pytest.mark.parametrize("kind", ["queue", "background", "jsonl"])
def test_the_edges_of_the_queue_settings_are_accepted(kind: str, tmp_path: Path) -> None:
    made = _make(kind, tmp_path, **{"max_size" if kind == "queue" else "max_queue": 1}, retry_initial=2, retry_max=2)
    made.close()  # type: ignore[attr-defined]


def test_loading_a_checkpoint_adds_its_error_counts_to_this_processs(caplog: pytest.LogCaptureFixture) -> None:
    """rl_staleness_export_errors_total never goes down: a resumed job whose port is taken counted 1; loading
    its checkpoint continues from the checkpoint's count plus that 1 (loading twice counts it once)."""
    caplog.set_level(logging.CRITICAL)
    with StalenessMonitor(exporters=[PrometheusExporter(port=None), SlowExporter()]) as saved:
        saved.export_errors.record("slow", "pretend failure")
        checkpoint = json.loads(json.dumps(saved.state_dict()))
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    prometheus = PrometheusExporter(port=blocker.getsockname()[1], addr="127.0.0.1")
    resumed = StalenessMonitor(exporters=[prometheus, SlowExporter()])
    try:
        assert exported_errors(prometheus) == {"prometheus": 1.0, "slow": 0.0}
        for _ in range(2):
            resumed.load_state_dict(checkpoint)
            assert exported_errors(prometheus) == {"prometheus": 1.0, "slow": 1.0}
        resumed.export_errors.record("slow", "pretend failure")
        resumed.load_state_dict(checkpoint)
        assert resumed.export_errors.snapshot() == {"prometheus": 1, "slow": 2}
    finally:
        resumed.close()
        blocker.close()


def exported_errors(prometheus: PrometheusExporter) -> dict[str, float]:
    families = text_string_to_metric_families(prometheus.exposition().decode())
    found = next(f for f in families if f.name == "rl_staleness_export_errors")
    return {s.labels["exporter"]: s.value for s in found.samples if s.name.endswith("_total")}


def test_restored_error_counts_continue_and_never_go_down() -> None:
    errors = ExportErrors()
    errors.record("otlp", "before the load")
    errors.restore({"otlp": 5, "jsonl": 2})
    assert errors.snapshot() == {"otlp": 6, "jsonl": 2}
    errors.restore({"otlp": 3})  # an older checkpoint: still this process's 1 on top, never below 6
    assert errors.count("otlp") == 6
    errors.record("otlp", "after")
    errors.restore({"otlp": 10})
    assert errors.count("otlp") == 12  # 10 and this process's 2
    errors.restore({"otlp": 10})
    assert errors.count("otlp") == 12


def test_an_exporters_own_count_joins_the_monitors_on_attach() -> None:
    exporter = BackgroundExporter(SlowExporter())
    exporter._errors.record("slow", "before the monitor")
    errors = ExportErrors()
    errors.record("slow", "counted by the monitor")
    exporter.attach(ExportContext(errors=errors))
    errors.restore({"slow": 4})
    assert errors.count("slow") == 4 + 2
    exporter.close()
