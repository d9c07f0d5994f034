"""OTLP exporter: each ship as one OTLP export of the metric table's rows, or recorded through
an injected ``meter_provider``'s instruments (settings and environment: docs/exporters.md)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from importlib import import_module
from typing import TYPE_CHECKING, Any, cast
from weakref import WeakKeyDictionary, WeakSet

from .. import __version__
from ..errors import ConfigError
from ..metrics.buckets import BUCKETS, HISTOGRAM_TOP
from ..metrics.metric_table import METRICS, MetricDef, MetricKind, Source
from ..metrics.report import Tally
from .base import DEFAULT_CLOSE_TIMEOUT, DEFAULT_QUEUE_SIZE, MissingExtra, QueuedExporter
from .state import CumulativeExporter, Snapshot, histogram_of

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
    from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricsData
    from opentelemetry.sdk.resources import Resource

DEFAULT_SERVICE_NAME = "staleness-metrics"
SCOPE_NAME = "staleness_metrics"
PROTOCOLS = ("http/protobuf", "grpc")

_ERRORS_ROW = next(m for m in METRICS if m.source is Source.EXPORTER)
_PUBLISHED = tuple(m for m in METRICS if m.otel_name is not None and m is not _ERRORS_ROW)
# A meter keeps a name's first observable gauge, dropping later callbacks: its gauges are made once,
# observing the exporters on it not closed yet (a sweep's next trial, monitors side by side).
_OPEN_ON: WeakKeyDictionary[Meter, WeakSet[OtlpExporter]] = WeakKeyDictionary()


class OtlpExportError(RuntimeError):
    """The OTLP exporter reported a failed export (the receiver is down, slow or refused it)."""


def _not_on_our_threads(record: logging.LogRecord) -> bool:
    """OTel's warnings of each retry, but on our queue's threads: its failure is ours to log."""
    return not (record.threadName or "").startswith("staleness-")


def _attributes(metric: MetricDef, run: str, env: str, bucket: str | None = None) -> dict[str, str]:
    attributes = {"run": run}
    if env and "env" in metric.labels:
        attributes["env"] = env
    if metric.dimension is not None and bucket is not None:
        attributes[metric.dimension.label] = bucket
    return attributes


def _gained_values(gained: list[int], beyond: int, new_extremes: list[int]) -> Iterator[int]:
    """The staleness of ``gained`` counts (index = staleness); at the last index its new lowest and
    highest, the rest as even as integers allow to ``beyond`` it in all: sum, min and max exact."""
    yield from itertools.chain.from_iterable(map(itertools.repeat, range(HISTOGRAM_TOP), gained))
    n = max([0, *gained[HISTOGRAM_TOP:]])  # (none when a new state's totals are below the recorded)
    ends = new_extremes[:n]
    even, extra = divmod(n * HISTOGRAM_TOP + beyond - sum(ends), max(n - len(ends), 1))
    yield from [*ends, *[even + 1] * extra, *[even] * (n - len(ends) - extra)]


def build_metrics_data(snapshot: Snapshot, resource: Resource, errors: Mapping[str, int],
                       temporality: AggregationTemporality | None = None,
                       errors_sent: Mapping[str, int] | None = None) -> MetricsData:  # fmt: skip
    """One OTLP export of a snapshot, cumulative unless ``temporality`` is DELTA (the error
    counts then less ``errors_sent``, those of the previous export)."""
    from opentelemetry.sdk.metrics import export as otel
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    temporality = temporality or otel.AggregationTemporality.CUMULATIVE
    delta = temporality is otel.AggregationTemporality.DELTA
    start_ns = snapshot.previous_time_ns if delta else snapshot.start_time_ns
    now, run = snapshot.time_ns, snapshot.run
    series = snapshot.delta if delta else snapshot.cumulative
    metrics: list[otel.Metric] = []
    for row in _PUBLISHED:
        assert row.otel_name is not None
        data: Any
        if row.kind is MetricKind.HISTOGRAM:
            hist_points = [
                otel.HistogramDataPoint(
                    attributes=_attributes(row, run, env), start_time_unix_nano=start_ns,
                    time_unix_nano=now, count=point.count, sum=point.sum,
                    bucket_counts=list(point.bucket_counts), explicit_bounds=list(BUCKETS),
                    min=point.min, max=point.max,  # type: ignore[arg-type]
                )  # (min and max None: unset, an empty histogram)
                for env, point in sorted(series.histograms[row.name].items())
            ]  # fmt: skip
            data = otel.Histogram(data_points=hist_points, aggregation_temporality=temporality)
        else:
            found = snapshot.points(row, series)
            if not (row.dimension and row.kind is MetricKind.COUNTER):
                found.sort()  # (a counter's buckets keep the dimension's order)
            points = [
                otel.NumberDataPoint(_attributes(row, run, env, bucket), start_ns, now, value)
                for env, bucket, value in found
            ]
            if row.kind is MetricKind.GAUGE:
                data = otel.Gauge(data_points=points)
            else:
                data = otel.Sum(points, temporality, is_monotonic=True)
        if data.data_points:
            metrics.append(otel.Metric(row.otel_name, row.description, row.otel_unit, data))
    if errors:
        row = _ERRORS_ROW
        assert row.otel_name is not None
        sent = (errors_sent or {}) if delta else {}
        counts = sorted((name, count - sent.get(name, 0)) for name, count in errors.items())
        error_points = [otel.NumberDataPoint({"run": run, "exporter": name}, start_ns, now, count)
                        for name, count in counts]  # fmt: skip
        error_sum = otel.Sum(error_points, temporality, is_monotonic=True)
        metrics.append(otel.Metric(row.otel_name, row.description, row.otel_unit, error_sum))
    scope = otel.ScopeMetrics(InstrumentationScope(SCOPE_NAME, __version__), metrics, schema_url="")
    return otel.MetricsData([otel.ResourceMetrics(resource, [scope], schema_url="")])


def _make_metric_exporter(protocol: str | None, endpoint: str | None,
                          headers: Mapping[str, str] | None,
                          timeout: float | None) -> MetricExporter:  # fmt: skip
    variables = ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    chosen = protocol or next(filter(None, map(os.environ.get, variables)), "http/protobuf")
    chosen = chosen.strip()
    if chosen not in PROTOCOLS:
        raise ConfigError(f"OTLP protocol: expected one of {', '.join(PROTOCOLS)}, got {chosen!r}")
    transport, extra = ("grpc", "otlp-grpc") if chosen == "grpc" else ("http", "otlp")
    try:
        module = import_module(f"opentelemetry.exporter.otlp.proto.{transport}.metric_exporter")
    except ModuleNotFoundError as exc:
        raise MissingExtra(f"OtlpExporter(protocol={chosen!r})", exc.name, extra) from exc
    options = dict(endpoint=endpoint, headers=dict(headers) if headers else None, timeout=timeout)
    return cast("MetricExporter", module.OTLPMetricExporter(**options))


def _observe(exporters: WeakSet[OtlpExporter], row: MetricDef,
             options: CallbackOptions) -> list[Observation]:  # fmt: skip
    """The gauge's series of each exporter's latest ship (swapped whole: a collection reads one)."""
    from opentelemetry.metrics import Observation

    latest = [s for exporter in list(exporters) if (s := exporter._latest) is not None]
    return [Observation(value, _attributes(row, s.run, env, bucket))
            for s in latest for env, bucket, value in s.points(row, s.cumulative)]  # fmt: skip


class OtlpExporter(CumulativeExporter, QueuedExporter[Snapshot]):
    """Sends each ship's metrics over OTLP (HTTP protobuf by default), on a background queue; with
    ``meter_provider``, records them through its instruments instead, for its readers to export."""

    name = "otlp"

    def __init__(self, *, endpoint: str | None = None, protocol: str | None = None,
                 headers: Mapping[str, str] | None = None, timeout: float | None = None,
                 service_name: str | None = None,
                 resource_attributes: Mapping[str, str] | None = None,
                 metric_exporter: MetricExporter | None = None,
                 meter_provider: MeterProvider | None = None, max_queue: int = DEFAULT_QUEUE_SIZE,
                 retry_initial: float = 0.5, retry_max: float = 10.0,
                 close_timeout: float = DEFAULT_CLOSE_TIMEOUT) -> None:  # fmt: skip
        super().__init__()
        self._meter_provider = meter_provider
        self._instruments: dict[str, Any] = {}
        self._recorded: dict[tuple[str, str, str | None], Any] = {}  # what they hold, by series
        self._latest: Snapshot | None = None  # what the observable gauges show
        self._open_on_meter: WeakSet[OtlpExporter] = WeakSet()  # the exporters its gauges observe
        self._metric_exporter: MetricExporter | None = None
        self._temporality: AggregationTemporality | None = None
        self._errors_sent: Mapping[str, int] = {}  # the error counts last exported (delta)
        self.resource: Resource | None = None
        if meter_provider is not None:
            self._create_instruments(meter_provider.get_meter(SCOPE_NAME, __version__))
        else:
            try:
                from opentelemetry.sdk.metrics import Counter
                from opentelemetry.sdk.resources import OTELResourceDetector, Resource
            except ModuleNotFoundError as exc:
                raise MissingExtra("OtlpExporter", exc.name, "otlp") from exc

            # service.name: the argument, else the OTEL_* variables, else ours
            attributes = dict(resource_attributes or {})
            if service_name is not None:
                attributes["service.name"] = service_name
            elif "service.name" not in attributes and (
                "service.name" not in OTELResourceDetector().detect().attributes
            ):
                attributes["service.name"] = DEFAULT_SERVICE_NAME
            attributes.setdefault("service.version", __version__)
            self.resource = Resource.create(attributes)
            chosen = metric_exporter or _make_metric_exporter(protocol, endpoint, headers, timeout)
            # OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE, as the exporter resolved it
            self._temporality = (getattr(chosen, "_preferred_temporality", {}) or {}).get(Counter)
            self._metric_exporter = chosen
            for module in ("http.metric_exporter", "grpc.exporter"):  # (a filter is added once)
                logger = logging.getLogger(f"opentelemetry.exporter.otlp.proto.{module}")
                logger.addFilter(_not_on_our_threads)
        self._start_queue(self._send, max_queue, retry_initial, retry_max, close_timeout)

    def _create_instruments(self, meter: Meter) -> None:
        # observable gauges: the latest series only (a synchronous one keeps every attribute set)
        first_on_meter = meter not in _OPEN_ON
        self._open_on_meter = _OPEN_ON.setdefault(meter, WeakSet())
        self._open_on_meter.add(self)
        for row in _PUBLISHED:
            assert row.otel_name is not None
            name, unit, about = row.otel_name, row.otel_unit, row.description
            if row.kind is MetricKind.GAUGE and first_on_meter:
                observe = functools.partial(_observe, self._open_on_meter, row)
                meter.create_observable_gauge(name, [observe], unit, about)
            elif row.kind is MetricKind.COUNTER:
                self._instruments[row.name] = meter.create_counter(name, unit, about)
            elif row.kind is MetricKind.HISTOGRAM:
                self._instruments[row.name] = meter.create_histogram(
                    name, unit, about, explicit_bucket_boundaries_advisory=list(BUCKETS)
                )

    def _record(self, snapshot: Snapshot) -> None:
        """Add what the run's totals gained since the last recorded report (a dropped one, a
        resume's restored totals): the instruments' cumulative series are the run's."""
        run, recorded, window = snapshot.run, self._recorded, snapshot.window
        for row in _PUBLISHED:
            instrument: Any = self._instruments.get(row.name)  # (none for a gauge: observed)
            if row.kind is MetricKind.COUNTER:
                for env, bucket, total in snapshot.points(row, snapshot.cumulative):
                    added = total - recorded.get((row.name, env, bucket), 0)
                    instrument.add(added, _attributes(row, run, env, bucket))
                    recorded[row.name, env, bucket] = total
            elif row.kind is MetricKind.HISTOGRAM:
                for env, tally in snapshot.totals.items():
                    counts, beyond, *extremes = histogram_of(row, tally)
                    key = (row.name, env, None)
                    seen, seen_beyond, *seen_extremes = recorded.get(key, ((), 0, 0, 0))
                    pairs = itertools.zip_longest(counts.tolist(), seen, fillvalue=0)
                    gained = [count - done for count, done in pairs]
                    new_extremes = [v for v, was in zip(extremes, seen_extremes) if v != was]
                    # what this report alone added (no gap): its own lowest and highest from 4096 up
                    ship, ship_beyond, *ship_extremes = histogram_of(row, window.get(env, Tally()))
                    alone = ship_beyond == beyond - seen_beyond and len(ship) == len(gained) > 0
                    if alone and gained[-1] and ship[-1] == gained[-1]:
                        new_extremes = ship_extremes
                    for staleness in _gained_values(gained, beyond - seen_beyond, new_extremes):
                        instrument.record(staleness, _attributes(row, run, env))
                    recorded[key] = counts.tolist(), beyond, *extremes
        self._latest = snapshot  # the gauges (observed at collection) show this ship from now on

    def _publish(self, snapshot: Snapshot) -> None:
        self._queue.put(snapshot)  # cheap: the series are computed and encoded on send

    def _send(self, snapshot: Snapshot) -> None:
        if self._meter_provider is not None:
            self._record(snapshot)
            return
        from opentelemetry.sdk.metrics.export import MetricExportResult

        assert self._metric_exporter is not None and self.resource is not None
        errors = self._errors.snapshot()  # at send time: with this send's retries
        sent = self._errors_sent or self._errors.loaded()  # (none yet: a resume's were sent before)
        data = build_metrics_data(snapshot, self.resource, errors, self._temporality, sent)
        if (result := self._metric_exporter.export(data)) is not MetricExportResult.SUCCESS:
            raise OtlpExportError(f"OTLP export returned {result.name}")
        self._errors_sent = errors

    def _close_resources(self) -> None:
        try:
            if self._metric_exporter is not None:
                self._metric_exporter.shutdown()
            elif (force_flush := getattr(self._meter_provider, "force_flush", None)) is not None:
                force_flush()  # (the SDK's provider has one, the API's need not)
        except Exception as exc:
            self._errors.record(self.name, "shutdown failed", exc)
        self._open_on_meter.discard(self)  # flushed with its last gauges: no longer current
