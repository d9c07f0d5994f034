"""What every exporter is, how export failures are counted and logged, and the bounded queue and
worker thread that keep a slow or failing exporter from blocking the training loop."""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from ..config import check_int
from ..errors import FieldError, FieldTypeError
from ..metrics.bound import ShipBound, mismatch_metrics
from ..metrics.metric_table import env_key
from ..metrics.mismatch import MismatchSums
from ..metrics.report import MetricValue, StepReport

logger = logging.getLogger("staleness_metrics.exporters")

DEFAULT_RUN = "default"
# objects whose ``_after_fork`` a forked child runs: new locks (another thread of the parent may
# have held one), and the parent's threads are not there
AFTER_FORK: weakref.WeakSet[Any] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [item._after_fork() for item in list(AFTER_FORK)])


class MissingExtra(ImportError):
    """An optional dependency is not installed: the message names the extra that brings it."""

    def __init__(self, user: str, package: str | None, extra: str) -> None:
        needs = f"{user} needs {package or 'a module'}: pip install 'staleness-metrics[{extra}]'"
        super().__init__(needs, name=package)


@runtime_checkable
class Exporter(Protocol):
    """Publishes each shipped step's report: ``export`` runs on the training thread once per ship,
    returns quickly (queues anything slow) and should not raise; ``close`` flushes."""

    @property
    def name(self) -> str: ...  # (read only: a frozen dataclass's field or a property will do)

    def export(self, report: StepReport) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MismatchReport:
    """Trainer-side SPEC 11 sums recorded for a shipped step: ``sums``, the step's total so far
    (what rows show); ``delta``, what this call added (what counters add)."""

    step: int
    sums: MismatchSums
    delta: MismatchSums
    bound: ShipBound | None = None  # SPEC 14 of ``sums``
    # with the env breakdown: the unprefixed keys of the env's merged total, and that env
    env_metrics: Mapping[str, Mapping[str, MetricValue]] = field(default_factory=dict)
    env: str | None = None

    @property
    def metrics(self) -> dict[str, MetricValue]:
        """The row of ``sums``: SPEC 11 keys, then SPEC 14's, then the env's."""
        out = mismatch_metrics(self.sums, self.bound)
        for env, keys in self.env_metrics.items():
            out.update({env_key(env, key): v for key, v in keys.items()})
        return out


@runtime_checkable
class MismatchAware(Protocol):
    """An exporter that publishes trainer-side sums (:meth:`StalenessMonitor.record_mismatch`)."""

    def export_mismatch(self, report: MismatchReport) -> None: ...


@runtime_checkable
class MonitorAware(Protocol):
    """An exporter that takes the monitor's run name, error counts and env breakdown setting."""

    def attach(self, context: ExportContext) -> None: ...


class ExportErrors:
    """Thread-safe count of failed exports (dropped reports included) per exporter, logged at most
    once per ``log_interval``; a monitor shares one with its exporters."""

    def __init__(self, log_interval: float = 30.0) -> None:
        self._log_interval = seconds(log_interval, "error_log_interval")  # (checked now)
        self._lock = threading.RLock()  # (re-entrant: a signal handler's close may record)
        AFTER_FORK.add(self)
        self._counts, self._suppressed = Counter[str](), Counter[str]()
        self._loaded = Counter[str]()  # the checkpoints' share of each count
        self._last_logged: dict[str, float] = {}

    def _after_fork(self) -> None:
        self._lock = threading.RLock()

    def register(self, exporter: str, counted: int = 0) -> None:
        """Expose ``exporter``'s count now (for ``rate()``), adding ``counted`` failures."""
        with self._lock:
            self._counts[exporter] += counted

    def record(self, exporter: str, message: str, exc: BaseException | None = None) -> None:
        """Count one failure of ``exporter``; log it unless it logged less than an interval ago."""
        now = time.monotonic()
        with self._lock:
            self._counts[exporter] += 1
            last = self._last_logged.get(exporter)
            if last is not None and now - last < self._log_interval:
                self._suppressed[exporter] += 1
                return
            self._last_logged[exporter] = now
            suppressed = self._suppressed.pop(exporter, 0)
        more = f" ({suppressed} similar failures not logged)" if suppressed else ""
        reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        logger.warning("exporter %s: %s%s%s", exporter, message, reason, more)

    def count(self, exporter: str) -> int:
        with self._lock:
            return self._counts[exporter]

    def snapshot(self) -> dict[str, int]:
        """All counts at once (exporter name -> failures)."""
        with self._lock:
            return dict(self._counts)

    def loaded(self) -> dict[str, int]:
        """The checkpoints' share of each count (what the run that saved them exported already)."""
        with self._lock:
            return dict(self._loaded)

    def restore(self, counts: Mapping[str, int]) -> None:
        """Continue the counts of the exporters named from a checkpoint's: its count plus what this
        process counted (never going down; a checkpoint loaded twice is counted once)."""
        with self._lock:
            for exporter, count in counts.items():
                here = self._counts[exporter] - self._loaded[exporter]
                self._counts[exporter] = max(self._counts[exporter], int(count) + here)
                self._loaded[exporter] = self._counts[exporter] - here


@dataclass(frozen=True)
class ExportContext:
    """What a monitor shares with its exporters: ``run`` label, failure count, ``env_breakdown``."""

    run: str = DEFAULT_RUN
    errors: ExportErrors = field(default_factory=ExportErrors)
    env_breakdown: bool = False
    exporter: str | None = None  # its own ``exporter`` label (a second "jsonl" is "jsonl#2")


class CountingExporter:
    """Base of the built-in exporters: their own failure count, until a monitor shares its own."""

    name: str

    def __init__(self) -> None:
        self._errors = ExportErrors()
        self._errors.register(self.name)
        AFTER_FORK.add(self)

    def attach(self, context: ExportContext) -> None:
        name = context.exporter or self.name
        if self._errors is not context.errors:  # what was counted before, counted on
            context.errors.register(name, self._errors.count(self.name))
        self._errors, self.name = context.errors, name

    def _after_fork(self) -> None: ...  # (in a forked child: the parent's exporter)


P = TypeVar("P")

DEFAULT_QUEUE_SIZE = 1024
DEFAULT_CLOSE_TIMEOUT = 2.0  # seconds close() may take, shutdown included: the trainer is waiting


def seconds(value: object, field: str) -> float:
    """A timeout checked: seconds >= 0; None and inf are no bound (inf)."""
    if value is None:
        return math.inf
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise FieldTypeError(field, f"expected seconds or None, got {value!r}")
    if not value >= 0:  # (NaN too)
        raise FieldError(field, f"expected seconds >= 0 (inf: no bound), got {value!r}")
    return float(value)


def time_left(deadline: float) -> float | None:
    """Seconds until a ``time.monotonic()`` deadline, >= 0; None for inf (``join`` refuses inf)."""
    return None if deadline == math.inf else max(deadline - time.monotonic(), 0.0)


class ExportQueue(Generic[P]):
    """Sends payloads in order on a worker thread; ``put`` never blocks nor raises, and a full queue
    drops the oldest payload. A ``send`` that raises is retried with the same payload, backing off
    from ``retry_initial`` seconds doubling up to ``retry_max``, until ``max_size`` newer ones wait
    (it is dropped); ``prepare`` (say, starting a W&B run) runs first on the worker, retried until
    it returns, while payloads wait."""

    def __init__(self, name: str, send: Callable[[P], None],
                 on_failure: Callable[[str, BaseException | None], None], *,
                 max_size: int = DEFAULT_QUEUE_SIZE, retry_initial: float = 0.5,
                 retry_max: float = 10.0,
                 prepare: Callable[[], None] | None = None) -> None:  # fmt: skip
        check_int("max_size", max_size, 1)
        limit = threading.TIMEOUT_MAX  # (a longer backoff raises in the worker; 0 would spin)
        if not 0 < seconds(retry_initial, "retry_initial") <= limit:
            raise FieldError("retry_initial", f"must be in (0, {limit:g}], got {retry_initial!r}")
        if not retry_initial <= seconds(retry_max, "retry_max") <= limit:
            raise FieldError("retry_max", f"must be in retry_initial..{limit:g}, got {retry_max!r}")
        self.name, self._send, self._prepare, self._on_failure = name, send, prepare, on_failure
        self._max_size, self._retry_initial, self._retry_max = max_size, retry_initial, retry_max
        self._cond = threading.Condition()
        self._pending: deque[P] = deque(maxlen=max_size)
        self._in_flight = prepare is not None  # flush() waits for the preparation too
        self._sending = False  # a payload is in flight, its outcome the worker's to count
        self._closing = False  # no new payloads
        self._stopping = False  # worker exits after the current attempt
        self._sent = self._dropped = 0
        self._worker = threading.Thread(target=self._run, name=f"staleness-export-{name}", daemon=True)
        self._worker.start()
        AFTER_FORK.add(self)

    def _after_fork(self) -> None:  # in a forked child the parent sends: nothing pending, no worker
        self._cond = threading.Condition()
        self._pending.clear()
        self._in_flight, self._closing, self._stopping = False, True, True

    @property
    def sent(self) -> int:
        """Payloads sent successfully so far."""
        with self._cond:
            return self._sent

    @property
    def dropped(self) -> int:
        """Payloads given up (queue full, or queued or in flight when ``close`` timed out)."""
        with self._cond:
            return self._dropped

    @property
    def pending(self) -> int:
        """Payloads waiting or being sent."""
        with self._cond:
            return len(self._pending) + int(self._in_flight)

    def put(self, payload: P) -> bool:
        """Queue ``payload``; returns False when it could not be queued (closed)."""
        with self._cond:
            closed, full = self._closing, len(self._pending) == self._max_size
            self._dropped += closed or full
            if not closed:
                self._pending.append(payload)  # when full, the deque drops the oldest
                self._cond.notify_all()
        if closed:
            self._on_failure("exporter is closed; report dropped", None)
        elif full:
            self._on_failure(f"queue full ({self._max_size} reports); dropped the oldest", None)
        return not closed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is sent; False when ``timeout`` passed first."""
        wait = time_left(time.monotonic() + seconds(timeout, "timeout"))
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._in_flight, wait)

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Stop accepting payloads, send what is queued within ``timeout`` (None: no bound; a send
        stuck in I/O is counted dropped, left to the daemon worker); True when nothing was lost."""
        deadline = time.monotonic() + seconds(timeout, "timeout")
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        flushed = self.flush(time_left(deadline))
        with self._cond:
            self._stopping = True
            left, given_up = len(self._pending), not flushed and self._sending
            self._pending.clear()
            self._dropped += left + given_up
            self._sending &= flushed  # (counted here: not again by the worker)
            self._cond.notify_all()
        if left:
            self._on_failure(f"closed with {left} reports unsent; dropped", None)
        if given_up:
            self._on_failure("closed while a report was being sent; dropped", None)
        self.join(time_left(deadline))
        return flushed

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker to exit (after ``close``: once its last attempt returned)."""
        self._worker.join(timeout)

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread still runs (a send stuck in I/O after ``close`` timed out)."""
        return self._worker.is_alive()

    @property
    def worker_is_daemon(self) -> bool:
        return self._worker.daemon

    def _run(self) -> None:
        if self._prepare is not None:
            try:
                self._retry(self._prepare, "could not start; will retry")
            finally:
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stopping or self._closing)
                if self._stopping or not self._pending:  # not pending: closing
                    return
                payload = self._pending.popleft()
                self._in_flight = self._sending = True
            try:
                attempt = functools.partial(self._send, payload)
                sent = self._retry(attempt, "export failed; will retry", bounded=True)
                with self._cond:
                    mine = self._sending  # (False: close() gave it up and counted it)
                    self._sent += mine and sent
                    self._dropped += mine and not sent
                if mine and not sent:  # out of the bound, or the queue stopped
                    self._on_failure("report given up while being retried; dropped", None)
            finally:  # even after a BaseException, flush() and close() must not wait on it
                with self._cond:
                    self._in_flight = self._sending = False
                    self._cond.notify_all()

    def _retry(self, attempt: Callable[[], None], failure: str, bounded: bool = False) -> bool:
        """Call ``attempt`` until it returns (True), the queue stops or, ``bounded``, ``max_size``
        newer payloads wait behind it: it is out of the bound (False)."""
        backoff = self._retry_initial

        def given_up() -> bool:
            return self._stopping or (bounded and len(self._pending) == self._max_size)

        while True:
            try:
                attempt()
            except Exception as exc:
                if not bounded or self._sending:  # (a payload close() gave up: counted there)
                    self._on_failure(failure, exc)
            else:
                return True
            with self._cond:
                if self._cond.wait_for(given_up, backoff):  # close() and put() wake us up early
                    return False
            backoff = min(backoff * 2, self._retry_max)


class QueuedExporter(CountingExporter, Generic[P]):
    """Base of the exporters sending on an :class:`ExportQueue`: :meth:`_start_queue` comes last in
    a constructor (one that raises leaves no worker); ``close`` (once) runs :meth:`_close_resources`
    on a daemon thread once the queue drained: a hung shutdown cannot hold it past its timeout."""

    def _start_queue(self, send: Callable[[P], None], max_queue: int, retry_initial: float,
                     retry_max: float, close_timeout: float,
                     prepare: Callable[[], None] | None = None) -> None:  # fmt: skip
        self._close_timeout, self._closed = seconds(close_timeout, "close_timeout"), False
        self._queue: ExportQueue[P] = ExportQueue(self.name, send,
            lambda message, exc: self._errors.record(self.name, message, exc),
            max_size=check_int("max_queue", max_queue, 1), retry_initial=retry_initial,
            retry_max=retry_max, prepare=prepare)  # fmt: skip

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is sent (False when ``timeout`` passed first)."""
        return self._queue.flush(timeout)

    @property
    def close_timeout(self) -> float:
        """Seconds ``close()`` may take (the monitor waits that long for it)."""
        return self._close_timeout

    @property
    def queue(self) -> ExportQueue[P]:
        """The queue and its worker (sent, dropped and pending counts)."""
        return self._queue

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued and shut down within ``timeout`` seconds (default: ``close_timeout``)
        whatever the receiver does; what is left unsent is counted dropped."""
        budget = seconds(self._close_timeout if timeout is None else timeout, "timeout")
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + budget
        self._queue.close(time_left(deadline))
        shutdown = threading.Thread(target=self._close_resources, name=f"staleness-close-{self.name}", daemon=True)
        shutdown.start()
        shutdown.join(time_left(deadline))
        if shutdown.is_alive():
            late = f"shutdown did not finish within {budget:g} s"
            self._errors.record(self.name, f"{late}; left to finish in the background")

    def _after_fork(self) -> None:
        super()._after_fork()
        self._closed = True  # (the parent's to close: a child would flush or delete its output)

    def _close_resources(self) -> None: ...


class BackgroundExporter(QueuedExporter["StepReport | MismatchReport"]):
    """Runs your own slow exporter's ``export`` on a worker thread behind an :class:`ExportQueue`
    (the built-in ones queue by themselves); a failed ``export`` is retried with the same report."""

    def __init__(self, exporter: Exporter, *, max_queue: int = DEFAULT_QUEUE_SIZE,
                 retry_initial: float = 0.5, retry_max: float = 10.0,
                 close_timeout: float = DEFAULT_CLOSE_TIMEOUT) -> None:  # fmt: skip
        self.name = exporter.name
        super().__init__()
        self._exporter = exporter
        self._start_queue(self._send, max_queue, retry_initial, retry_max, close_timeout)

    def attach(self, context: ExportContext) -> None:
        super().attach(context)
        if isinstance(self._exporter, MonitorAware):
            self._exporter.attach(context)

    def export(self, report: StepReport) -> None:
        self._queue.put(report)

    def export_mismatch(self, report: MismatchReport) -> None:
        """Queued like a ship, for a wrapped exporter that publishes mismatch sums."""
        if isinstance(self._exporter, MismatchAware):
            self._queue.put(report)

    def _send(self, report: StepReport | MismatchReport) -> None:
        if isinstance(report, MismatchReport):
            assert isinstance(self._exporter, MismatchAware)
            self._exporter.export_mismatch(report)
        else:
            self._exporter.export(report)

    def _close_resources(self) -> None:
        try:
            self._exporter.close()
        except Exception as exc:  # counted, as the monitor counts an exporter's own close
            self._errors.record(self.name, "close raised", exc)
