"""Prometheus exporters: a scrape endpoint (HTTP server or ASGI app) and a Pushgateway mode.

Both serve the last ship's immutable snapshot through one custom collector, rendered at scrape
time: a scrape sees one ship, never two, and histograms come from the core's bucket counts. A port
already taken is counted and retried on a later export (docs/exporters.md).
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

from ..metrics.buckets import BUCKETS
from ..metrics.metric_table import (
    BATCH_WIDE_COUNTERS,
    METRICS,
    MetricDef,
    MetricKind,
    Source,
)
from ..metrics.report import StepReport
from .background import DEFAULT_CLOSE_TIMEOUT, DEFAULT_QUEUE_SIZE, QueuedExporter
from .base import ExportErrors
from .state import CumulativeExporter, Snapshot

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
_PUBLISHED = tuple(m for m in METRICS if m.prometheus_name is not None)
_ERRORS_ROW = next(m for m in _PUBLISHED if m.source is Source.EXPORTER)


def _family(metric: MetricDef) -> GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily:
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
        if isinstance(family, HistogramMetricFamily):
            for env, point in snapshot.cumulative.histograms[metric.name].items():
                buckets = [(le, float(c)) for le, c in zip(_LE, point.cumulative(), strict=True)]
                family.add_metric(_label_values(metric, snapshot.run, env), buckets, sum_value=float(point.sum))
        else:
            for env, bucket, value in snapshot.points(metric, snapshot.cumulative):
                labels = _label_values(metric, snapshot.run, env, bucket or "")
                family.add_metric(labels, float(value))
        if family.samples:
            families.append(family)
    return tuple(families)


class StalenessCollector:
    """A ``prometheus_client`` collector that serves the last ship's snapshot as one unit (swapped
    whole: a scrape reads one)."""

    def __init__(self, errors: Callable[[], ExportErrors], run: Callable[[], str]) -> None:
        self._errors = errors
        self._run = run
        self.snapshot: Snapshot | None = None

    def collect(self) -> Iterable[Metric]:
        snapshot = self.snapshot
        if snapshot is not None:
            yield from render_families(snapshot)
        yield self._error_family()

    def describe(self) -> Iterable[Metric]:
        """Every family this collector may expose (lets a registry reject duplicate names)."""
        return [_family(m) for m in _PUBLISHED]

    def _error_family(self) -> Metric:
        metric = _ERRORS_ROW
        family = _family(metric)
        assert isinstance(family, CounterMetricFamily)
        run = self._run()
        for exporter, count in sorted(self._errors().snapshot().items()):
            family.add_metric([{"run": run, "exporter": exporter}[label] for label in metric.labels], count)
        return family


class _PrometheusBase(CumulativeExporter):
    """Shared by the scrape and push exporters: run state, collector and own registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        super().__init__()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.collector = StalenessCollector(lambda: self._errors, lambda: self._state.run)
        self.registry.register(self.collector)

    @property
    def last_snapshot(self) -> Snapshot | None:
        """What the last export published (None before the first)."""
        return self.collector.snapshot

    def _show(self, snapshot: Snapshot) -> None:
        self.collector.snapshot = snapshot

    def exposition(self) -> bytes:
        """The text exposition (classic Prometheus format), as a scrape would get it."""
        return generate_latest(self.registry)


class PrometheusExporter(_PrometheusBase):
    """Serves the metrics for Prometheus to scrape: an HTTP server on ``addr:port`` (0 picks a free
    port; None starts none, e.g. to mount :meth:`asgi_app`). Export is an in-memory swap."""

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
        super().export(report)
        if (
            self._requested_port is not None
            and self._server is None
            and time.monotonic() - self._last_bind_attempt >= self._bind_retry_interval
        ):
            self._bind()

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
    """Pushes the metrics to a Prometheus Pushgateway after each ship (on a background queue; after
    an outage only the newest state), and deletes its group (``job``, ``grouping_key`` and
    ``run``) on close."""

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
        self._start_queue(self._push, max_queue, retry_initial, retry_max, close_timeout)

    @property
    def grouping_key(self) -> dict[str, str]:
        return {**self._extra_grouping, "run": self._state.run}

    def _publish(self, snapshot: Snapshot) -> None:
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
