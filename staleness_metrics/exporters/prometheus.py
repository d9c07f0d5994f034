"""Prometheus exporters: a scrape endpoint (HTTP server or ASGI app) and a Pushgateway mode.

Both render the metric table through one custom collector that holds the last ship's immutable
snapshot, swapped under a lock on each export and built and rendered at scrape time: a scrape
sees one ship, never two, and a ship costs only folding in what it changed (no series computed,
no rendering). Histograms are built from the core's bucket counts, never by observing each
token. Every series has a ``run`` label; see :mod:`staleness_metrics.exporters.state` for the
``env`` label conventions.

Port already taken: the exporter logs it, counts an export error and keeps working (the registry and
the ASGI app still serve); it tries to bind again on a later export, at most once per
``bind_retry_interval`` seconds. It never raises into the training loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import delete_from_gateway, push_to_gateway
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from ..metrics.metric_table import (
    BATCH_WIDE_COUNTERS,
    BUCKETS,
    METRICS,
    MetricDef,
    MetricKind,
    Source,
)
from ..metrics.report import StepReport
from .background import DEFAULT_CLOSE_TIMEOUT, DEFAULT_QUEUE_SIZE, QueuedExporter
from .base import DEFAULT_RUN, ExportContext, ExportErrors, MismatchReport
from .state import CumulativeState, LazySnapshot, Snapshot, batch_wide_buckets, batch_wide_counts

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

__all__ = [
    "BATCH_WIDE_COUNTERS",
    "DEFAULT_PORT",
    "PrometheusExporter",
    "PrometheusPushExporter",
    "StalenessCollector",
]

DEFAULT_PORT = 9487

_LE: list[str] = [floatToGoString(b) for b in BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
# The length counters' batch-wide series is the sum of the per-env ones; the mismatch family's
# already is the batch's sums (the per-env ones are the part recorded per env).
_SUMMED_BATCH_WIDE = frozenset(name for name in BATCH_WIDE_COUNTERS if name.startswith("length_"))
_PUBLISHED = tuple(m for m in METRICS if m.prometheus_name is not None)


def _family(metric: MetricDef) -> Metric:
    assert metric.prometheus_name is not None
    labels = list(metric.labels)
    if metric.kind is MetricKind.GAUGE:
        return GaugeMetricFamily(metric.prometheus_name, metric.description, labels=labels)
    if metric.kind is MetricKind.COUNTER:
        return CounterMetricFamily(metric.prometheus_name, metric.description, labels=labels)
    return HistogramMetricFamily(metric.prometheus_name, metric.description, labels=labels)


def _label_values(metric: MetricDef, run: str, env: str, bucket: str = "") -> list[str]:
    values = {"run": run, "env": env}
    if metric.dimension is not None:
        values[metric.dimension.label] = bucket
    return [values[label] for label in metric.labels]


def render_families(snapshot: Snapshot) -> tuple[Metric, ...]:
    """The ship's metric families (all table rows with a Prometheus name, export errors aside)."""
    families: list[Metric] = []
    for metric in _PUBLISHED:
        if metric.source is Source.EXPORTER:
            continue
        family = _family(metric)
        if isinstance(family, GaugeMetricFamily) and metric.dimension is not None:
            for (env, bucket), value in snapshot.bucketed_gauges.get(metric.name, {}).items():
                family.add_metric(_label_values(metric, snapshot.run, env, bucket), float(value))
        elif isinstance(family, GaugeMetricFamily):
            for env, value in snapshot.gauges[metric.name].items():
                family.add_metric(_label_values(metric, snapshot.run, env), float(value))
        elif isinstance(family, CounterMetricFamily) and metric.dimension is not None:
            bucketed = snapshot.bucketed.get(metric.name, {})
            if metric.name in _SUMMED_BATCH_WIDE:
                bucketed = batch_wide_buckets(bucketed)
            for (env, bucket), total in bucketed.items():
                family.add_metric(_label_values(metric, snapshot.run, env, bucket), float(total))
        elif isinstance(family, CounterMetricFamily):
            counts = snapshot.counters.get(metric.name, {})
            if metric.name in _SUMMED_BATCH_WIDE:
                counts = batch_wide_counts(counts)
            for env, count in counts.items():
                family.add_metric(_label_values(metric, snapshot.run, env), float(count))
        else:
            assert isinstance(family, HistogramMetricFamily)
            for env, point in snapshot.histograms[metric.name].items():
                buckets = [(le, float(c)) for le, c in zip(_LE, point.cumulative(), strict=True)]
                family.add_metric(_label_values(metric, snapshot.run, env), buckets, sum_value=float(point.sum))
        if family.samples:
            families.append(family)
    return tuple(families)


class StalenessCollector:
    """A ``prometheus_client`` collector that serves the last ship's snapshot as one unit."""

    def __init__(self, errors: Callable[[], ExportErrors], run: Callable[[], str]) -> None:
        self._errors = errors
        self._run = run
        self._lock = threading.Lock()
        self._snapshot: LazySnapshot | None = None

    def update(self, snapshot: LazySnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            snapshot = self._snapshot
        # immutable inputs: building and rendering it outside the lock is safe
        if snapshot is not None:
            yield from render_families(snapshot.get())
        yield self._error_family()

    def describe(self) -> Iterable[Metric]:
        """Every family this collector may expose (lets a registry reject duplicate names)."""
        return [_family(m) for m in _PUBLISHED]

    def _error_family(self) -> Metric:
        metric = next(m for m in _PUBLISHED if m.source is Source.EXPORTER)
        family = _family(metric)
        assert isinstance(family, CounterMetricFamily)
        run = self._run()
        for exporter, count in sorted(self._errors().snapshot().items()):
            family.add_metric([{"run": run, "exporter": exporter}[label] for label in metric.labels], count)
        return family


class _PrometheusBase:
    """Shared by the scrape and push exporters: run state, collector and own registry."""

    name: str

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._run = DEFAULT_RUN
        self._errors = ExportErrors()
        self._errors.register(self.name)
        self._lock = threading.Lock()
        self._state = CumulativeState(self._run)
        self._last: LazySnapshot | None = None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.collector = StalenessCollector(lambda: self._errors, lambda: self._run)
        self.registry.register(self.collector)

    def attach(self, context: ExportContext) -> None:
        """Take the monitor's run label, shared export error counts and env breakdown setting."""
        with self._lock:
            if (context.run, context.env_breakdown) != (self._state.run, self._state.by_env):
                self._state = CumulativeState(context.run, context.env_breakdown)
            self._run = context.run
            self._errors = context.share_errors(self.name, self._errors)

    @property
    def errors(self) -> ExportErrors:
        return self._errors

    @property
    def last_snapshot(self) -> Snapshot | None:
        """What the last export published (None before the first)."""
        last = self._last
        return None if last is None else last.get()

    def _apply(self, report: StepReport | MismatchReport) -> None:
        with self._lock:  # reports are folded in order, one at a time
            if isinstance(report, MismatchReport):
                # Counters add what this call brought (the env's keys too); SPEC 14's gauges show
                # the step's merged sums.
                snapshot = self._state.fold_mismatch(report.delta, report.metrics, report.env)
            else:
                snapshot = self._state.fold(report)
            self.collector.update(snapshot)
            self._last = snapshot

    def state_dict(self) -> dict[str, Any]:
        """The cumulative counters and histograms of the run (a monitor checkpoint holds them)."""
        with self._lock:
            return self._state.state_dict()

    def check_state_dict(self, state: Any, path: str) -> None:
        """Refuse a state :meth:`load_state_dict` would not take (``ConfigError``
        naming the key path)."""
        CumulativeState.check_state_dict(state, path)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the counters from ``state`` and show its last ship again until the next one."""
        with self._lock:
            snapshot = self._state.load_state_dict(state)
            if snapshot is not None:
                self.collector.update(snapshot)
                self._last = snapshot

    def absorb(self, report: StepReport) -> None:
        """Fold a report exported before a restart into the run totals, without sending it again."""
        self._apply(report)

    def absorb_mismatch(self, report: MismatchReport) -> None:
        """Fold trainer-side sums exported before a restart into the run totals,
        without sending them again."""
        self._apply(report)

    def exposition(self) -> bytes:
        """The text exposition (classic Prometheus format), as a scrape would get it."""
        return generate_latest(self.registry)


class PrometheusExporter(_PrometheusBase):
    """Serves the metrics for Prometheus to scrape.

    ``port``: HTTP server on ``addr`` (loopback by default; 0 picks a free port; None starts no
    server, e.g. when you mount :meth:`asgi_app` in your own FastAPI app). Export is an in-memory
    swap, done on the caller's thread.
    """

    name = "prometheus"

    def __init__(
        self,
        port: int | None = DEFAULT_PORT,
        addr: str = "127.0.0.1",
        *,
        registry: CollectorRegistry | None = None,
        bind_retry_interval: float = 30.0,
    ) -> None:
        super().__init__(registry)
        self._requested_port = port
        self._addr = addr
        self._bind_retry_interval = bind_retry_interval
        self._server: WSGIServer | None = None
        self._server_thread: threading.Thread | None = None
        self._last_bind_attempt = float("-inf")
        if port is not None:
            self._bind()

    @property
    def port(self) -> int | None:
        """The port actually serving (None while not bound)."""
        return None if self._server is None else int(self._server.server_address[1])

    @property
    def url(self) -> str | None:
        """``http://addr:port/metrics`` while serving, else None."""
        port = self.port
        if port is None:
            return None
        host = f"[{self._addr}]" if ":" in self._addr else self._addr
        return f"http://{host}:{port}/metrics"

    def _bind(self) -> None:
        from prometheus_client import start_http_server

        assert self._requested_port is not None
        self._last_bind_attempt = time.monotonic()
        try:
            server, thread = start_http_server(self._requested_port, addr=self._addr, registry=self.registry)
        except OSError as exc:
            self._errors.record(
                self.name,
                f"cannot serve on {self._addr}:{self._requested_port}; will retry every "
                f"{self._bind_retry_interval:g} s (the ASGI app and registry still work)",
                exc,
            )
            return
        self._server, self._server_thread = server, thread

    def export(self, report: StepReport) -> None:
        self._apply(report)
        if (
            self._requested_port is not None
            and self._server is None
            and time.monotonic() - self._last_bind_attempt >= self._bind_retry_interval
        ):
            self._bind()

    def export_mismatch(self, report: MismatchReport) -> None:
        """Add trainer-side SPEC 11 sums (the live path) to the mismatch counters."""
        try:
            self._apply(report)
        except Exception as exc:  # never into the trainer
            self._errors.record(self.name, "mismatch sums not exported", exc)

    def asgi_app(self) -> Callable[..., Any]:
        """An ASGI app serving this exporter's registry
        (``app.mount("/metrics", exporter.asgi_app())``; Starlette then serves it at ``/metrics/``
        and redirects ``/metrics`` there)."""
        from prometheus_client import make_asgi_app

        return make_asgi_app(registry=self.registry)

    def close(self) -> None:
        server, thread = self._server, self._server_thread
        self._server = self._server_thread = None
        self._requested_port = None  # no re-binding after close
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()


class PrometheusPushExporter(_PrometheusBase, QueuedExporter[int]):
    """Pushes the metrics to a Prometheus Pushgateway after each ship, and
    deletes its group on close.

    For jobs Prometheus cannot scrape. The group is ``job`` plus ``grouping_key`` plus ``run``.
    Pushes happen on a background queue; after an outage only the newest state is pushed (it carries
    all counters and histograms).

    The error counter and ``attach`` come from ``_PrometheusBase`` (shared with the scrape exporter,
    its ``attach`` also swaps the run state); the queue, ``flush`` and ``close`` from
    :class:`QueuedExporter`.
    """

    name = "pushgateway"

    def __init__(
        self,
        gateway: str,
        *,
        job: str = "staleness-metrics",
        grouping_key: Mapping[str, str] | None = None,
        timeout: float = 5.0,
        delete_on_close: bool = True,
        registry: CollectorRegistry | None = None,
        max_queue: int = DEFAULT_QUEUE_SIZE,
        retry_initial: float = 0.5,
        retry_max: float = 10.0,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    ) -> None:
        super().__init__(registry)
        self._gateway = gateway
        self._job = job
        self._extra_grouping = dict(grouping_key or {})
        self._timeout = timeout
        self._delete_on_close = delete_on_close
        self._version = 0
        self._pushed_version = 0
        self._start_queue(
            self._push,
            max_queue=max_queue,
            retry_initial=retry_initial,
            retry_max=retry_max,
            close_timeout=close_timeout,
        )

    @property
    def grouping_key(self) -> dict[str, str]:
        return {**self._extra_grouping, "run": self._run}

    def export(self, report: StepReport) -> None:
        self._apply(report)
        self._queue_push()

    def export_mismatch(self, report: MismatchReport) -> None:
        """Add trainer-side SPEC 11 sums (the live path) to the mismatch counters and push."""
        try:
            self._apply(report)
        except Exception as exc:  # never into the trainer
            self._errors.record(self.name, "mismatch sums not exported", exc)
            return
        self._queue_push()

    def _queue_push(self) -> None:
        with self._lock:
            self._version += 1
            version = self._version
        self._queue.put(version)

    def _push(self, version: int) -> None:
        with self._lock:
            current = self._version
        if version <= self._pushed_version:
            return  # a later push already carried this ship
        push_to_gateway(
            self._gateway, job=self._job, registry=self.registry, grouping_key=self.grouping_key,
            timeout=self._timeout,
        )  # fmt: skip
        self._pushed_version = current

    # once only: a new pusher may own the group by a second close
    def _close_resources(self) -> None:
        if not self._delete_on_close:
            return
        try:
            delete_from_gateway(self._gateway, job=self._job, grouping_key=self.grouping_key, timeout=self._timeout)
        except Exception as exc:  # close must not raise into the caller either
            self._errors.record(self.name, "could not delete the group from the Pushgateway", exc)
