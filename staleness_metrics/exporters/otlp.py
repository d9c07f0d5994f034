"""OTLP exporter: the metric table as OpenTelemetry metrics, sent once per ship.

Default (owned pipeline): each ship becomes one OTLP export of gauges (``Gauge``), counters
(monotonic ``Sum``) and explicit-bucket histograms (``Histogram`` over
:data:`~staleness_metrics.metrics.metric_table.BUCKETS`), built from the cumulative run state:
the histograms come from the core's bucket counts, so a ship costs the same however many tokens
it had. Export runs on a bounded background queue; a failed export is counted and retried, and
since counters and histograms are cumulative (the default temporality) every later export carries
what an earlier one missed.

Transport: OTLP/HTTP protobuf by default, gRPC with ``protocol="grpc"``. The standard variables are
honoured by the OpenTelemetry exporters themselves (``OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT``,
``_HEADERS``, ``_TIMEOUT``, ``_COMPRESSION``, ``_PROTOCOL``,
``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``), and the resource takes
``OTEL_RESOURCE_ATTRIBUTES`` / ``OTEL_SERVICE_NAME``; ``service.name`` defaults to
``staleness-metrics``. ``run`` (and ``env``, for named envs) are metric attributes. The SPEC 12
length counters also have a batch-wide point (no ``env``) beside the per-env ones when the env
breakdown names envs, as in Prometheus.

Injected ``meter_provider``: the metrics are recorded through that provider's instruments
(observable gauges that report the latest ship's series only, counters, histograms with the table's
buckets as advisory boundaries) and its own readers export them. The OpenTelemetry API has no
weighted ``record``, so histograms then cost one ``record`` per token and rollout (done on the
background thread); prefer the owned pipeline for large batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import ConfigError
from ..metrics.metric_table import (
    BATCH_WIDE_COUNTERS,
    BUCKETS,
    METRICS,
    MetricDef,
    MetricKind,
    Source,
)
from ..metrics.report import Counts, StepReport
from .background import DEFAULT_CLOSE_TIMEOUT, DEFAULT_QUEUE_SIZE, QueuedExporter
from .base import DEFAULT_RUN, ExportContext, MismatchReport
from .state import (
    CumulativeState,
    HistogramPoint,
    LazySnapshot,
    Snapshot,
    batch_wide_buckets,
    batch_wide_counts,
    partition_by_env,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
    from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricsData
    from opentelemetry.sdk.resources import Resource

__all__ = ["DEFAULT_SERVICE_NAME", "OtlpExportError", "OtlpExporter", "build_metrics_data"]

DEFAULT_SERVICE_NAME = "staleness-metrics"
SCOPE_NAME = "staleness_metrics"
PROTOCOLS = ("http/protobuf", "grpc")

# The length counters' batch-wide series is the sum of the per-env ones; the mismatch family's
# already is the batch's sums (the per-env ones are the part recorded per env).
_SUMMED_BATCH_WIDE = frozenset(name for name in BATCH_WIDE_COUNTERS if name.startswith("length_"))
_PUBLISHED = tuple(m for m in METRICS if m.otel_name is not None and m.source is not Source.EXPORTER)
_ERRORS_ROW = next(m for m in METRICS if m.source is Source.EXPORTER)

# A queued ship: its snapshot, plus its histogram windows when recording
# through an injected provider.
_Payload = tuple[LazySnapshot, Mapping[str, Mapping[str, Counts]] | None]


class OtlpExportError(RuntimeError):
    """The OTLP exporter reported a failed export (the receiver is down, slow or refused it)."""


def _attributes(metric: MetricDef, run: str, env: str, bucket: str | None = None) -> dict[str, str]:
    attributes = {"run": run}
    if env and "env" in metric.labels:
        attributes["env"] = env
    if metric.dimension is not None and bucket is not None:
        attributes[metric.dimension.label] = bucket
    return attributes


def _number(metric: MetricDef, value: float) -> int | float:
    return int(value) if metric.integer else float(value)


def resolve_protocol(protocol: str | None) -> str:
    chosen = (
        protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if chosen not in PROTOCOLS:
        raise ConfigError(f"OTLP protocol: expected one of {', '.join(PROTOCOLS)}, got {chosen!r}")
    return chosen


def build_resource(service_name: str | None, attributes: Mapping[str, str] | None) -> Resource:
    """The resource; ``service.name`` is the argument, else ``OTEL_SERVICE_NAME`` /
    ``OTEL_RESOURCE_ATTRIBUTES``, else :data:`DEFAULT_SERVICE_NAME`."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    merged: dict[str, str] = dict(attributes or {})
    if service_name is not None:
        merged["service.name"] = service_name
    elif "service.name" not in merged and "service.name" not in OTELResourceDetector().detect().attributes:
        merged["service.name"] = DEFAULT_SERVICE_NAME
    merged.setdefault("service.version", __version__)
    return Resource.create(merged)


def _histogram_point(metric: MetricDef, run: str, env: str, point: HistogramPoint, start_ns: int, time_ns: int) -> Any:
    from opentelemetry.sdk.metrics.export import HistogramDataPoint

    return HistogramDataPoint(
        attributes=_attributes(metric, run, env),
        start_time_unix_nano=start_ns,
        time_unix_nano=time_ns,
        count=point.count,
        sum=point.sum,
        bucket_counts=list(point.bucket_counts),
        explicit_bounds=list(BUCKETS),
        min=point.min,  # type: ignore[arg-type]  # None = unset (empty histogram)
        max=point.max,  # type: ignore[arg-type]
    )


def build_metrics_data(
    snapshot: Snapshot,
    resource: Resource,
    errors: Mapping[str, int],
    temporality: AggregationTemporality | None = None,
) -> MetricsData:
    """One OTLP export of a snapshot; counters and histograms cumulative unless
    ``temporality`` is DELTA."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Histogram,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    temporality = temporality or AggregationTemporality.CUMULATIVE
    delta = temporality is AggregationTemporality.DELTA
    start_ns = snapshot.previous_time_ns if delta else snapshot.start_time_ns
    now = snapshot.time_ns
    run = snapshot.run
    metrics: list[Metric] = []
    for row in _PUBLISHED:
        assert row.otel_name is not None
        data: Any
        if row.kind is MetricKind.GAUGE and row.dimension is not None:
            points = [
                NumberDataPoint(_attributes(row, run, env, bucket), start_ns, now, value)
                for (env, bucket), value in sorted(snapshot.bucketed_gauges.get(row.name, {}).items())
            ]
            data = Gauge(data_points=points)
        elif row.kind is MetricKind.GAUGE:
            values = snapshot.gauges[row.name]
            points = [
                NumberDataPoint(_attributes(row, run, env), start_ns, now, value)
                for env, value in sorted(values.items())
            ]
            data = Gauge(data_points=points)
        elif row.kind is MetricKind.COUNTER and row.dimension is not None:
            buckets = (snapshot.bucketed_deltas if delta else snapshot.bucketed).get(row.name, {})
            if row.name in _SUMMED_BATCH_WIDE:
                buckets = batch_wide_buckets(buckets)
            points = [
                NumberDataPoint(_attributes(row, run, env, bucket), start_ns, now, _number(row, total))
                for (env, bucket), total in buckets.items()
            ]
            data = Sum(data_points=points, aggregation_temporality=temporality, is_monotonic=True)
        elif row.kind is MetricKind.COUNTER:
            counts = (snapshot.counter_deltas if delta else snapshot.counters).get(row.name, {})
            if row.name in _SUMMED_BATCH_WIDE:
                counts = batch_wide_counts(counts)
            points = [
                NumberDataPoint(_attributes(row, run, env), start_ns, now, count)
                for env, count in sorted(counts.items())
            ]
            data = Sum(data_points=points, aggregation_temporality=temporality, is_monotonic=True)
        else:
            histograms = (snapshot.histogram_deltas if delta else snapshot.histograms)[row.name]
            hist_points = [
                _histogram_point(row, run, env, point, start_ns, now) for env, point in sorted(histograms.items())
            ]
            data = Histogram(data_points=hist_points, aggregation_temporality=temporality)
        if data.data_points:
            metrics.append(Metric(row.otel_name, row.description, row.otel_unit, data))
    if errors:
        assert _ERRORS_ROW.otel_name is not None
        # Export errors are cumulative in-process counts; they are sent cumulative
        # whatever the preference.
        error_points = [
            NumberDataPoint({"run": run, "exporter": name}, snapshot.start_time_ns, now, count)
            for name, count in sorted(errors.items())
        ]
        metrics.append(
            Metric(
                _ERRORS_ROW.otel_name,
                _ERRORS_ROW.description,
                _ERRORS_ROW.otel_unit,
                Sum(error_points, AggregationTemporality.CUMULATIVE, is_monotonic=True),
            )
        )
    scope = InstrumentationScope(SCOPE_NAME, __version__)
    return MetricsData(
        resource_metrics=[
            ResourceMetrics(
                resource=resource,
                scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")],
                schema_url="",
            )
        ]
    )


def _make_metric_exporter(
    protocol: str, endpoint: str | None, headers: Mapping[str, str] | None, timeout: float | None
) -> MetricExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )

        return GrpcMetricExporter(endpoint=endpoint, headers=dict(headers) if headers else None, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=endpoint, headers=headers, timeout=timeout)


class _InstrumentRecorder:
    """Records snapshots through a caller's MeterProvider (the injected-provider path).

    Gauges are observable: their callbacks yield the latest recorded snapshot's series and nothing
    else, so a series that stopped being current (a floor source that changed, a lag that left the
    curve, an env the last ship did not have) is no longer exported. A synchronous gauge would
    keep reporting its last value for every attribute set it ever saw (the SDK keeps it under
    cumulative temporality).
    """

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter(SCOPE_NAME, __version__)
        self._instruments: dict[str, Any] = {}
        self._latest: Snapshot | None = None  # swapped whole: a collection reads one snapshot
        for row in _PUBLISHED:
            assert row.otel_name is not None
            if row.kind is MetricKind.GAUGE:
                instrument: Any = meter.create_observable_gauge(
                    row.otel_name, [self._observer(row)], row.otel_unit, row.description
                )
            elif row.kind is MetricKind.COUNTER:
                instrument = meter.create_counter(row.otel_name, row.otel_unit, row.description)
            else:
                instrument = meter.create_histogram(
                    row.otel_name, row.otel_unit, row.description,
                    explicit_bucket_boundaries_advisory=list(BUCKETS),
                )  # fmt: skip
            self._instruments[row.name] = instrument

    def _observer(self, row: MetricDef) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            from opentelemetry.metrics import Observation

            snapshot = self._latest
            if snapshot is None:
                return []
            run = snapshot.run
            if row.dimension is not None:
                labelled = snapshot.bucketed_gauges.get(row.name, {})
                return [Observation(v, _attributes(row, run, env, bucket)) for (env, bucket), v in labelled.items()]
            return [Observation(v, _attributes(row, run, env)) for env, v in snapshot.gauges[row.name].items()]

        return observe

    def record(self, snapshot: Snapshot, histograms: Mapping[str, Mapping[str, Counts]]) -> None:
        run = snapshot.run
        for row in _PUBLISHED:
            instrument = self._instruments[row.name]
            if row.kind is MetricKind.GAUGE:
                continue  # observed at collection time, from self._latest
            if row.kind is MetricKind.COUNTER and row.dimension is not None:
                amounts = snapshot.bucketed_deltas.get(row.name, {})
                if row.name in _SUMMED_BATCH_WIDE:
                    amounts = batch_wide_buckets(amounts)
                for (env, bucket), amount in amounts.items():
                    instrument.add(amount, _attributes(row, run, env, bucket))
            elif row.kind is MetricKind.COUNTER:
                deltas = snapshot.counter_deltas.get(row.name, {})
                if row.name in _SUMMED_BATCH_WIDE:
                    deltas = batch_wide_counts(deltas)
                for env, count in deltas.items():
                    instrument.add(count, _attributes(row, run, env))
            else:
                for env, counts in histograms.get(row.name, {}).items():
                    attributes = _attributes(row, run, env)
                    for staleness, count in enumerate(counts):
                        for _ in range(int(count)):
                            instrument.record(staleness, attributes)
        self._latest = snapshot  # the gauges show this ship from the next collection on


class OtlpExporter(QueuedExporter[_Payload]):
    """Sends each ship's metrics over OTLP (HTTP protobuf by default), on a background queue."""

    name = "otlp"

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        protocol: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        service_name: str | None = None,
        resource_attributes: Mapping[str, str] | None = None,
        metric_exporter: MetricExporter | None = None,
        meter_provider: MeterProvider | None = None,
        max_queue: int = DEFAULT_QUEUE_SIZE,
        retry_initial: float = 0.5,
        retry_max: float = 10.0,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    ) -> None:
        super().__init__()
        self._meter_provider = meter_provider
        self._recorder: _InstrumentRecorder | None = None
        self._metric_exporter: MetricExporter | None = None
        self._temporality: AggregationTemporality | None = None
        self.resource: Resource | None = None
        if meter_provider is not None:
            self._recorder = _InstrumentRecorder(meter_provider)
        else:
            self.resource = build_resource(service_name, resource_attributes)
            self._metric_exporter = metric_exporter or _make_metric_exporter(
                resolve_protocol(protocol), endpoint, headers, timeout
            )
            self._temporality = self._counter_temporality(self._metric_exporter)
        self._state = CumulativeState(DEFAULT_RUN, deltas=self._needs_deltas())
        self._start_queue(
            self._send,
            max_queue=max_queue,
            retry_initial=retry_initial,
            retry_max=retry_max,
            close_timeout=close_timeout,
        )

    def _needs_deltas(self) -> bool:
        from opentelemetry.sdk.metrics.export import AggregationTemporality

        return self._recorder is not None or self._temporality is AggregationTemporality.DELTA

    @staticmethod
    def _counter_temporality(exporter: MetricExporter) -> AggregationTemporality:
        from opentelemetry.sdk.metrics import Counter
        from opentelemetry.sdk.metrics.export import AggregationTemporality

        # The OTLP exporters resolve OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE into this
        # mapping (the SDK's own readers read it the same way).
        preferred = getattr(exporter, "_preferred_temporality", {}) or {}
        chosen = preferred.get(Counter, AggregationTemporality.CUMULATIVE)
        assert isinstance(chosen, AggregationTemporality)
        return chosen

    def attach(self, context: ExportContext) -> None:
        """Take the monitor's run attribute, shared export error counts and
        env breakdown setting."""
        if (context.run, context.env_breakdown) != (self._state.run, self._state.by_env):
            self._state = CumulativeState(context.run, context.env_breakdown, deltas=self._state.deltas)
        super().attach(context)

    def state_dict(self) -> dict[str, Any]:
        """The cumulative series of the run (a monitor checkpoint holds them)."""
        return self._state.state_dict()

    def check_state_dict(self, state: Any, path: str) -> None:
        """Refuse a state :meth:`load_state_dict` would not take (``ConfigError``
        naming the key path)."""
        CumulativeState.check_state_dict(state, path)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the cumulative series (same start time) from ``state``."""
        self._state.load_state_dict(state)

    def absorb(self, report: StepReport) -> None:
        """Fold a report exported before a restart into the run totals, without sending it again."""
        self._state.fold(report)  # never read: no series computed

    def absorb_mismatch(self, report: MismatchReport) -> None:
        """Fold trainer-side sums exported before a restart into the run totals,
        without sending them again."""
        self._state.fold_mismatch(report.delta, report.metrics, report.env)

    def export(self, report: StepReport) -> None:
        snapshot = self._state.fold(report)  # cheap: the series are computed and encoded on send
        if self._recorder is not None:
            windows = {
                row.name: {
                    env: (t.token_histogram if row.source is Source.TOKEN_HISTOGRAM else t.rollout_histogram)
                    for env, t in partition_by_env(report, self._state.by_env).items()
                }
                for row in _PUBLISHED
                if row.kind is MetricKind.HISTOGRAM
            }
            self._queue.put((snapshot, windows))
        else:
            self._queue.put((snapshot, None))

    def export_mismatch(self, report: MismatchReport) -> None:
        """Add trainer-side SPEC 11 sums (the live path) to the mismatch counters and send."""
        try:
            snapshot = self._state.fold_mismatch(report.delta, report.metrics, report.env)
        except Exception as exc:  # never into the trainer
            self._errors.record(self.name, "mismatch sums not exported", exc)
            return
        self._queue.put((snapshot, {} if self._recorder is not None else None))

    def _send(self, payload: _Payload) -> None:
        pending, windows = payload
        snapshot = pending.get()  # on this worker thread, off the training loop
        if self._recorder is not None:
            assert windows is not None
            self._recorder.record(snapshot, windows)
            return
        from opentelemetry.sdk.metrics.export import MetricExportResult

        assert self._metric_exporter is not None and self.resource is not None
        # Built at send time so the export error counts are current (they
        # include this send's retries).
        data = build_metrics_data(snapshot, self.resource, self._errors.snapshot(), self._temporality)
        result = self._metric_exporter.export(data)
        if result is not MetricExportResult.SUCCESS:
            raise OtlpExportError(f"OTLP export returned {result.name}")

    # once only: the OpenTelemetry exporter warns on a second shutdown
    def _close_resources(self) -> None:
        try:
            if self._metric_exporter is not None:
                self._metric_exporter.shutdown()
            elif self._meter_provider is not None:
                force_flush = getattr(self._meter_provider, "force_flush", None)
                if force_flush is not None:
                    force_flush()
        except Exception as exc:
            self._errors.record(self.name, "shutdown failed", exc)
