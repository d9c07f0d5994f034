"""Prometheus exporters: a scrape endpoint (HTTP server or ASGI app) and a Pushgateway mode, both
serving the last ship's snapshot through one collector (a scrape sees one ship, never two)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest, make_asgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import delete_from_gateway, push_to_gateway
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from ..config import check_int
from ..metrics.buckets import BUCKETS
from ..metrics.metric_table import METRICS, MetricDef, MetricKind, Source
from ..metrics.report import StepReport
from .base import DEFAULT_CLOSE_TIMEOUT, DEFAULT_QUEUE_SIZE, QueuedExporter
from .state import CumulativeExporter, Snapshot

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

DEFAULT_PORT = 9487

_LE: list[str] = [floatToGoString(b) for b in BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
_PUBLISHED = tuple(m for m in METRICS if m.prometheus_name is not None)
_ERRORS_ROW = next(m for m in _PUBLISHED if m.source is Source.EXPORTER)
_SHOWN = tuple(m for m in _PUBLISHED if m is not _ERRORS_ROW)
_Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily
_FAMILY_OF: dict[MetricKind, type[_Family]] = {
    MetricKind.GAUGE: GaugeMetricFamily, MetricKind.COUNTER: CounterMetricFamily,
    MetricKind.HISTOGRAM: HistogramMetricFamily,
}  # fmt: skip


def _family(metric: MetricDef) -> _Family:
    assert metric.prometheus_name is not None
    labels = list(metric.labels)
    return _FAMILY_OF[metric.kind](metric.prometheus_name, metric.description, labels=labels)


def _label_values(metric: MetricDef, run: str, env: str, bucket: str = "") -> list[str]:
    values = {"run": run, "env": env}
    if metric.dimension is not None:
        values[metric.dimension.label] = bucket
    return [values[label] for label in metric.labels]


def _families(snapshot: Snapshot) -> Iterator[Metric]:
    """The ship's families that have samples (the rows with a Prometheus name but export errors)."""
    for metric in _SHOWN:
        family = _family(metric)
        if isinstance(family, HistogramMetricFamily):
            for env, point in snapshot.cumulative.histograms[metric.name].items():
                buckets = [(le, float(c)) for le, c in zip(_LE, point.cumulative(), strict=True)]
                family.add_metric(_label_values(metric, snapshot.run, env), buckets, sum_value=float(point.sum))
        else:
            for env, bucket, value in snapshot.points(metric, snapshot.cumulative):
                family.add_metric(_label_values(metric, snapshot.run, env, bucket or ""), float(value))
        if family.samples:
            yield family


class _PrometheusBase(CumulativeExporter):
    """The run state and registry the scrape and push exporters share, and their collector: a
    scrape reads the last ship's snapshot, swapped whole, and the error counts."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        super().__init__()
        self.last_snapshot: Snapshot | None = None  # what the last export published
        self._shared_registry = registry is not None  # (its own stays readable after close)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)

    def _show(self, snapshot: Snapshot) -> None:
        self.last_snapshot = snapshot

    def _unregister(self) -> None:  # from the caller's registry: a next run can register there
        with contextlib.suppress(KeyError):  # closed before, or the caller unregistered it
            if self._shared_registry:
                self.registry.unregister(self)

    def describe(self) -> Iterable[Metric]:
        return [_family(m) for m in _PUBLISHED]

    def collect(self) -> Iterable[Metric]:
        if (snapshot := self.last_snapshot) is not None:
            yield from _families(snapshot)
        errors, run = _family(_ERRORS_ROW), self._state.run
        assert isinstance(errors, CounterMetricFamily)
        for exporter, count in sorted(self._errors.snapshot().items()):
            labels = {"run": run, "exporter": exporter}
            errors.add_metric([labels[label] for label in _ERRORS_ROW.labels], count)
        yield errors

    def exposition(self) -> bytes:
        """The text exposition (classic Prometheus format), as a scrape would get it."""
        return generate_latest(self.registry)


class PrometheusExporter(_PrometheusBase):
    """Serves the metrics for Prometheus to scrape: an HTTP server on ``addr:port`` (0 picks a free
    port; None starts none, e.g. to mount :meth:`asgi_app`); a port already taken is counted and
    retried on a later export. Export is an in-memory swap."""

    name = "prometheus"

    def __init__(self, port: int | None = DEFAULT_PORT, addr: str = "127.0.0.1", *,
                 registry: CollectorRegistry | None = None,
                 bind_retry_interval: float = 30.0) -> None:  # fmt: skip
        self._requested_port = None if port is None else check_int("port", port, 0, 65535)
        super().__init__(registry)
        self._addr, self._bind_retry_interval = addr, bind_retry_interval
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
        host = f"[{self._addr}]" if ":" in self._addr else self._addr
        return None if (port := self.port) is None else f"http://{host}:{port}/metrics"

    def _bind(self) -> None:
        assert self._requested_port is not None
        self._last_bind_attempt = time.monotonic()
        try:
            server, thread = start_http_server(self._requested_port, addr=self._addr, registry=self.registry)
        except OSError as exc:
            retry = f"will retry every {self._bind_retry_interval:g} s"
            message = f"cannot serve on {self._addr}:{self._requested_port}; {retry}"
            self._errors.record(self.name, f"{message} (the ASGI app and registry still work)", exc)
            return
        self._server, self._server_thread = server, thread
        self._server_pid = os.getpid()  # a forked child has the socket, not the serving thread

    def export(self, report: StepReport) -> None:
        super().export(report)
        due = time.monotonic() - self._last_bind_attempt >= self._bind_retry_interval
        if self._requested_port is not None and self._server is None and due:
            self._bind()

    def asgi_app(self) -> Callable[..., Any]:
        """An ASGI app serving this registry: ``app.mount("/metrics", exporter.asgi_app())``
        (Starlette then serves it at ``/metrics/`` and redirects ``/metrics`` there)."""
        return make_asgi_app(registry=self.registry)

    def close(self) -> None:
        server, thread = self._server, self._server_thread
        self._server = self._server_thread = None
        self._requested_port = None  # no re-binding after close
        self._unregister()
        if server is not None and thread is not None:  # (bound together)
            if self._server_pid == os.getpid():  # shutdown() waits for the serving thread
                server.shutdown()
                thread.join()
            server.server_close()


class PrometheusPushExporter(_PrometheusBase, QueuedExporter[int]):
    """Pushes the metrics to a Pushgateway after each ship (on a background queue; after an outage
    only the newest state); on close, deletes its group (``job``, ``grouping_key`` and ``run``)."""

    name = "pushgateway"

    def __init__(self, gateway: str, *, job: str = "staleness-metrics",
                 grouping_key: Mapping[str, str] | None = None, timeout: float = 5.0,
                 delete_on_close: bool = True, registry: CollectorRegistry | None = None,
                 max_queue: int = DEFAULT_QUEUE_SIZE, retry_initial: float = 0.5,
                 retry_max: float = 10.0, close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
                 ) -> None:  # fmt: skip
        super().__init__(registry)
        self._gateway, self._job, self._timeout = gateway, job, timeout
        self._extra_grouping = dict(grouping_key or {})
        self._delete_on_close = delete_on_close
        self._version = self._pushed_version = 0
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
        push_to_gateway(self._gateway, job=self._job, registry=self.registry,
                        grouping_key=self.grouping_key, timeout=self._timeout)  # fmt: skip
        self._pushed_version = current

    def _close_resources(self) -> None:
        self._queue.join()  # a push still in flight lands first (it has a timeout): delete after it
        self._unregister()
        if not self._delete_on_close:
            return
        try:
            delete_from_gateway(self._gateway, job=self._job, grouping_key=self.grouping_key, timeout=self._timeout)
        except Exception as exc:  # close must not raise into the caller either
            self._errors.record(self.name, "could not delete the group from the Pushgateway", exc)
