"""OTLP exporter: what arrives at a real receiver over HTTP (and gRPC), env variables, faults."""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import numpy as np
import pytest
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.test._otlp_test_server import OtlpProtoTestServer

from staleness_metrics.config import StalenessConfig
from staleness_metrics.exporters.base import ExportContext, ExportErrors, MismatchReport
from staleness_metrics.exporters.otlp import OtlpExporter
from staleness_metrics.exporters.state import bucket_counts
from staleness_metrics.metrics.buckets import BUCKETS
from staleness_metrics.metrics.metric_table import BATCH_WIDE_COUNTERS, METRICS, MetricKind, Source
from staleness_metrics.metrics.mismatch import MismatchSums, mismatch_sums
from staleness_metrics.metrics.report import Tally
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import CONFIG, FAR_CONFIG, FAR_SHIPS, far_records, far_staleness, hand_report, ship_script
from tests.support.otlp import OtlpReceiver, attributes_of, metrics_by_name
from tests.support.prometheus import free_port

RUN = "exp-otlp"
CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
DELTA = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
ROWS = {m.otel_name: m for m in METRICS if m.otel_name is not None}


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import os

    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    yield


def points_by_env(metric: Any) -> dict[str, Any]:
    data = getattr(metric, metric.WhichOneof("data"))
    return {attributes_of(p).get("env", ""): p for p in data.data_points}


def wait_for_errors(errors: ExportErrors, count: int, timeout: float = 60.0) -> None:
    """Wait until the exporter counted ``count`` failed attempts (a hang guard, never a speed check)."""
    deadline = time.monotonic() + timeout
    while errors.count("otlp") < count:
        assert time.monotonic() < deadline, f"{errors.count('otlp')} of {count} failures counted"
        time.sleep(0.02)


def value(point: Any) -> float:
    return float(point.as_int if point.WhichOneof("value") == "as_int" else point.as_double)


def test_what_arrives_over_http_matches_the_table_and_the_metrics_dict() -> None:
    with OtlpProtoTestServer() as server:
        exporter = OtlpExporter(endpoint=server.metrics_endpoint)
        monitor = StalenessMonitor(CONFIG, [exporter], run=RUN)
        totals = Tally()
        mismatch = MismatchSums.zero()
        for records, step in ship_script(2):
            monitor.add(records)
            shipment = monitor.ship(step)
            totals = totals + shipment.report.tally
            assert shipment.report.mismatch is not None  # the records carry trainer log-probs
            mismatch = mismatch + shipment.report.mismatch
        monitor.close()  # flushes
        recorded = server.drain_metrics()

    assert recorded, "nothing arrived"
    resource = {kv.key: kv.value.string_value for kv in recorded[0].resource.attributes}
    assert resource["service.name"] == "staleness-metrics"
    assert recorded[0].scope.name == "staleness_metrics"
    last: dict[str, Any] = {}
    for r in recorded:  # two exports; keep the last one of each metric
        last[r.metric.name] = r.metric
    assert set(last) <= set(ROWS)
    assert set(last) >= {n for n, m in ROWS.items() if m.kind is not MetricKind.GAUGE}

    metrics = shipment.metrics
    for name, metric in last.items():
        row = ROWS[name]
        assert metric.unit == row.otel_unit, name
        assert metric.description == row.description, name
        kind = metric.WhichOneof("data")
        assert kind == {"gauge": "gauge", "counter": "sum", "histogram": "histogram"}[row.kind.value], name
        points = points_by_env(metric)
        for point in getattr(metric, kind).data_points:
            attributes = attributes_of(point)
            assert attributes["run"] == RUN
            assert set(attributes) <= {"run", "env", "exporter", "lag", "length"}
            if row.dimension is not None:  # the bucket attribute is decoded with the table's values
                assert attributes[row.dimension.label] in row.dimension.values, name
        if row.dimension is not None:
            assert metric.sum.is_monotonic and metric.sum.aggregation_temporality == CUMULATIVE, name
            by_bucket: dict[str, float] = {}
            for point in metric.sum.data_points:
                if row.name in BATCH_WIDE_COUNTERS and "env" in attributes_of(point):
                    continue  # the point without env is the whole batch (test_length_counters_...)
                bucket = attributes_of(point)[row.dimension.label]
                by_bucket[bucket] = by_bucket.get(bucket, 0.0) + value(point)
            assert list(by_bucket) == list(row.dimension.values), name  # every bucket, in order
            if row.source is Source.MISMATCH:
                want = getattr(mismatch, row.mismatch_field or "")
            else:
                want = getattr(totals, row.tally_field or "")
            assert list(by_bucket.values()) == pytest.approx([float(v) for v in want], rel=1e-12, abs=0), name
        elif row.source is Source.MISMATCH:
            # the point without env is the batch; with the env breakdown each named env has its part of it
            assert value(points[""]) == getattr(mismatch, row.mismatch_field or ""), name
            assert sum(value(p) for env, p in points.items() if env) <= value(points[""]), name
        elif row.kind is MetricKind.GAUGE and row.source is Source.METRIC:
            assert row.wandb_key is not None
            assert value(points[""]) == metrics[row.wandb_key], name
            for env in ("math", "code"):
                key = f"staleness/env/{env}/{row.wandb_key.removeprefix('staleness/')}"
                if "env" in row.labels and key in metrics:
                    assert value(points[env]) == metrics[key], (name, env)
        elif row.kind is MetricKind.COUNTER and row.source is Source.TALLY:
            assert metric.sum.is_monotonic
            assert metric.sum.aggregation_temporality == CUMULATIVE
            if row.name in BATCH_WIDE_COUNTERS:
                assert value(points[""]) == getattr(totals, row.tally_field or ""), name
            else:  # counters partition rollouts by env; the sum is the run's total
                assert sum(value(p) for p in points.values()) == getattr(totals, row.tally_field or ""), name
        elif row.kind is MetricKind.HISTOGRAM:
            assert metric.histogram.aggregation_temporality == CUMULATIVE
            for point in points.values():
                assert list(point.explicit_bounds) == list(BUCKETS)
                assert len(point.bucket_counts) == len(BUCKETS) + 1
            hist = totals.token_histogram if row.source is Source.TOKEN_HISTOGRAM else totals.rollout_histogram
            merged = np.sum([np.array(p.bucket_counts) for p in points.values()], axis=0)
            assert merged.tolist() == list(bucket_counts(hist).bucket_counts), name
            assert sum(p.count for p in points.values()) == int(hist.sum())
            assert sum(p.sum for p in points.values()) == float(np.dot(np.arange(len(hist)), hist))
    assert value(points_by_env(last["rl.staleness.train.step"])[""]) == shipment.step


def test_standard_environment_variables_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer-7")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=ci")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
        exporter = OtlpExporter()
        exporter.attach(ExportContext(run=RUN))
        exporter.export(hand_report(1, {"": [[1, 2]]}))
        exporter.export(hand_report(2, {"": [[3]]}))
        exporter.close()
        requests = receiver.wait_for(2)
    resource = {kv.key: kv.value.string_value for kv in requests[0].resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "trainer-7"
    assert resource["deployment.environment.name"] == "ci"
    second = metrics_by_name(requests[1])
    tokens = second["rl.staleness.tokens.sampled"]
    assert tokens.sum.aggregation_temporality == DELTA
    assert [p.as_int for p in tokens.sum.data_points] == [1]  # this ship's increment only
    hist = second["rl.staleness.token.steps"].histogram
    assert hist.aggregation_temporality == DELTA
    assert hist.data_points[0].count == 1 and hist.data_points[0].sum == 3


def test_service_name_argument_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
        exporter = OtlpExporter(endpoint=receiver.endpoint, service_name="from-code")
        exporter.export(hand_report(1, {"": [[1]]}))
        exporter.close()
        (request,) = receiver.wait_for(1)
    resource = {kv.key: kv.value.string_value for kv in request.resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "from-code"


def test_receiver_down_then_back_nothing_within_the_bound_is_lost() -> None:
    port = free_port()  # nothing listens yet
    errors = ExportErrors()
    # The request timeout must not be so short that a slow answer on a loaded machine makes the queue
    # re-send a request the receiver already recorded (the order check below would see it twice).
    exporter = OtlpExporter(
        endpoint=f"http://127.0.0.1:{port}/v1/metrics", timeout=5, retry_initial=0.05, retry_max=0.2
    )
    exporter.attach(ExportContext(run=RUN, errors=errors))
    monitor_steps = [1, 2, 3]
    for step in monitor_steps:
        exporter.export(hand_report(step, {"": [[step]]}))  # returns although the receiver is down
    receiver = None
    try:
        wait_for_errors(errors, 1)  # a failed attempt was counted while nothing listened
        receiver = OtlpReceiver(port)
        assert exporter.flush(timeout=60)
        requests = receiver.wait_for(3)
        steps = [metrics_by_name(r)["rl.staleness.train.step"].gauge.data_points[0].as_int for r in requests]
        assert steps == monitor_steps  # every queued ship, in order
        last = metrics_by_name(requests[-1])
        assert last["rl.staleness.tokens.sampled"].sum.data_points[0].as_int == 3
        errors_metric = last["rl.staleness.export.errors"].sum.data_points
        assert {attributes_of(p)["exporter"]: p.as_int for p in errors_metric}["otlp"] >= 1
    finally:
        exporter.close()
        if receiver is not None:
            receiver.stop()


def test_slow_receiver_does_not_hold_up_ships_and_receives_everything() -> None:
    with OtlpReceiver() as receiver:
        receiver.release.clear()  # requests hang until released
        exporter = OtlpExporter(endpoint=receiver.endpoint, timeout=120)
        monitor = StalenessMonitor(CONFIG, [exporter], run=RUN)
        script = list(ship_script(5))
        monitor.add(script[0][0])
        monitor.ship(script[0][1])
        assert receiver.arrived.wait(60)  # the first export is now stuck in the receiver
        for records, step in script[1:]:
            monitor.add(records)
            monitor.ship(step)  # each returns while the receiver still holds the first request
        assert receiver.release.is_set() is False and receiver.requests == []
        receiver.release.set()
        assert exporter.flush(timeout=60)
        requests = receiver.wait_for(5)
        monitor.close()
    steps = [metrics_by_name(r)["rl.staleness.train.step"].gauge.data_points[0].as_int for r in requests]
    assert steps == [step for _, step in script]


def test_receiver_errors_are_counted_and_retried() -> None:
    with OtlpReceiver() as receiver:
        receiver.status = 400  # not retried by the OTel exporter itself: our queue retries
        errors = ExportErrors()
        exporter = OtlpExporter(endpoint=receiver.endpoint, retry_initial=0.05, retry_max=0.1)
        exporter.attach(ExportContext(run=RUN, errors=errors))
        exporter.export(hand_report(1, {"": [[2]]}))
        wait_for_errors(errors, 2)  # refused twice, still queued
        assert receiver.requests == []
        receiver.status = 200
        assert exporter.flush(timeout=60)
        (request,) = receiver.wait_for(1)
        exporter.close()
    assert metrics_by_name(request)["rl.staleness.train.step"].gauge.data_points[0].as_int == 1


def test_with_the_delta_preference_export_errors_are_sent_as_delta_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Delta-only backends drop a cumulative series: each export carries the failures counted since the
    previous one, over the window the other delta sums use (from the previous export's time)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    with OtlpReceiver() as receiver:
        errors = ExportErrors()
        exporter = OtlpExporter(endpoint=receiver.endpoint, retry_initial=0.05, retry_max=0.1)
        exporter.attach(ExportContext(run=RUN, errors=errors))
        for step in (1, 2, 3):
            receiver.status = 400 if step != 2 else 200  # ships 1 and 3 are refused (counted) at first
            exporter.export(hand_report(step, {"": [[1, 1]]}))
            if step != 2:
                wait_for_errors(errors, errors.count("otlp") + 2)
            receiver.status = 200
            assert exporter.flush(timeout=60)
        requests = receiver.wait_for(3)
        exporter.close()
    sent = []
    for request in requests:
        metrics = metrics_by_name(request)
        (tokens,) = metrics["rl.staleness.tokens.sampled"].sum.data_points
        (failures,) = metrics["rl.staleness.export.errors"].sum.data_points
        assert metrics["rl.staleness.export.errors"].sum.aggregation_temporality == DELTA
        assert (failures.start_time_unix_nano, failures.time_unix_nano) == (
            tokens.start_time_unix_nano, tokens.time_unix_nano)  # fmt: skip
        sent.append((failures.start_time_unix_nano, failures.time_unix_nano, failures.as_int))
    assert sent[1][0] == sent[0][1] and sent[2][0] == sent[1][1]  # each window starts at the previous export
    assert sent[0][2] >= 2 and sent[1][2] == 0 and sent[2][2] >= 2  # ship 2 was never refused
    assert sum(count for _, _, count in sent) == errors.count("otlp")  # no failure sent twice


def test_with_the_delta_preference_a_resume_does_not_send_the_restored_error_counts_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SPEC 13: the restored counts were sent before the restart; a delta backend adding them again would
    count each failure twice (the cumulative series continues from them instead)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    record = {"id": "a", "dispatch_version": 0, "samples": [{"mask": [1]}]}
    with OtlpReceiver() as receiver:
        receiver.status = 400  # the first ship is refused (counted) at first
        exporter = OtlpExporter(endpoint=receiver.endpoint, retry_initial=0.05, retry_max=0.1)
        with StalenessMonitor(CONFIG, [exporter], run=RUN) as before:
            before.add(record)
            before.ship(1)
            wait_for_errors(before.export_errors, 2)
            receiver.status = 200
            assert exporter.flush(timeout=60)
            state = before.state_dict()
        (first,) = receiver.wait_for(1)
        exporter = OtlpExporter(endpoint=receiver.endpoint)
        with StalenessMonitor(CONFIG, [exporter], run=RUN) as after:
            after.load_state_dict(state)
            after.add({**record, "id": "b", "dispatch_version": 1})
            after.ship(2)
        _, second = receiver.wait_for(2)
    restored = after.export_errors.count("otlp")
    sent = [metrics_by_name(r)["rl.staleness.export.errors"].sum.data_points for r in (first, second)]
    assert [{attributes_of(p)["exporter"]: p.as_int for p in points}["otlp"] for points in sent] == [restored, 0]


def test_grpc_protocol_reaches_a_grpc_receiver() -> None:
    import grpc  # installed with the otlp-grpc extra, which the test extra pulls in
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

    received: list[Any] = []

    class Servicer(metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        exporter = OtlpExporter(endpoint=f"http://127.0.0.1:{port}", protocol="grpc", timeout=10)
        exporter.attach(ExportContext(run=RUN))
        exporter.export(hand_report(4, {"": [[1, 3]]}))
        assert exporter.flush(timeout=60)
        exporter.close()
    finally:
        server.stop(None)
    assert len(received) == 1
    names = metrics_by_name(received[0])
    assert names["rl.staleness.train.step"].gauge.data_points[0].as_int == 4
    assert names["rl.staleness.tokens.sampled"].sum.data_points[0].as_int == 2


def test_injected_meter_provider_records_through_its_instruments() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    exporter = OtlpExporter(meter_provider=provider)
    exporter.attach(ExportContext(run=RUN, env_breakdown=True))
    exporter.export(hand_report(1, {"": [[0, 1]], "math": [[2, 2, 5]]}))
    exporter.export(hand_report(2, {"": [[1]]}))
    assert exporter.flush(timeout=60)
    data = reader.get_metrics_data()
    assert data is not None
    metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert set(metrics) <= set(ROWS)
    step = metrics["rl.staleness.train.step"].data.data_points
    assert [p.value for p in step] == [2]
    sampled = {p.attributes.get("env", ""): p.value for p in metrics["rl.staleness.tokens.sampled"].data.data_points}
    assert sampled == {"": 3, "math": 3}
    hist = {p.attributes.get("env", ""): p for p in metrics["rl.staleness.token.steps"].data.data_points}
    assert list(hist["math"].explicit_bounds) == list(BUCKETS)
    assert hist["math"].bucket_counts[2] == 2 and hist["math"].bucket_counts[5] == 1
    assert hist[""].count == 3
    exporter.close()
    provider.shutdown()


def test_exporters_made_one_after_another_on_one_provider_each_report_their_own_gauges() -> None:
    """A sweep (or monitors side by side) on the app's MeterProvider: its meter keeps a name's first
    observable gauge, so every open exporter's latest ship is reported there, and a closed one's no longer."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])

    def max_staleness() -> dict[str, float]:
        data = reader.get_metrics_data()
        assert data is not None
        metrics = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
        found = [m for m in metrics if m.name == "rl.staleness.max_staleness"]
        return {str(p.attributes["run"]): p.value for m in found for p in m.data.data_points}

    def trial(run: str, bound: int) -> StalenessMonitor:
        exporter = OtlpExporter(meter_provider=provider)
        monitor = StalenessMonitor(StalenessConfig(max_staleness=bound), [exporter], run=run)
        monitor.add({"id": "r", "dispatch_version": 0, "samples": [{"mask": [1, 1]}]})
        monitor.ship(1)
        assert exporter.flush(timeout=60)
        return monitor

    try:
        first = trial("trial0", 2)
        assert max_staleness() == {"trial0": 2}
        first.close()
        assert max_staleness() == {}  # closed: its gauges are no longer current
        second = trial("trial1", 7)
        assert max_staleness() == {"trial1": 7}  # the new exporter's, not the closed one's
        beside = trial("beside", 5)
        assert max_staleness() == {"trial1": 7, "beside": 5}
        second.close()
        assert max_staleness() == {"beside": 5}
        beside.close()
    finally:
        provider.shutdown()


def provider_points(reader: InMemoryMetricReader, name: str) -> dict[tuple[str, str], Any]:
    """The points of metric ``name`` a reader collected, by env and lag ("": none)."""
    data = reader.get_metrics_data()
    assert data is not None
    found = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name]
    return {(p.attributes.get("env", ""), p.attributes.get("lag", "")): p for m in found for p in m.data.data_points}


def test_through_a_meter_provider_a_dropped_report_loses_no_increment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each recorded report adds what the run's totals gained since the last recorded one: reports the full
    queue drops (the provider momentarily slow) leave the counters and histograms at the run's totals."""
    reader = InMemoryMetricReader()
    exporter = OtlpExporter(meter_provider=MeterProvider(metric_readers=[reader]), max_queue=2)
    exporter.attach(ExportContext(run=RUN, env_breakdown=True))
    gate, record = threading.Event(), exporter._record
    monkeypatch.setattr(exporter, "_record", lambda snapshot: (gate.wait(60), record(snapshot)))
    for step in range(1, 11):
        exporter.export(hand_report(step, {"": [[step % 3]], "math": [[1, step]]}))
    gate.set()
    assert exporter.flush(timeout=60) and exporter.queue.dropped >= 7
    sampled = provider_points(reader, "rl.staleness.tokens.sampled")
    assert {env: p.value for (env, _), p in sampled.items()} == {"": 10, "math": 20}
    hist = provider_points(reader, "rl.staleness.token.steps")
    assert (hist["", ""].count, hist["", ""].sum) == (10, sum(step % 3 for step in range(1, 11)))
    assert (hist["math", ""].count, hist["math", ""].sum) == (20, sum(1 + step for step in range(1, 11)))
    exporter.close()


def test_through_a_meter_provider_the_series_continue_from_the_restored_totals() -> None:
    """SPEC 13: after ``load_state_dict``, a new process's provider starts from the restored totals."""
    sums = mismatch_sums([0, 1, 1], [-1.0] * 3, [-1.0, -1.5, -0.5])
    before = OtlpExporter(meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]))
    before.attach(ExportContext(run=RUN))
    for step in (1, 2, 3):
        before.export(hand_report(step, {"": [[1, step]]}))
    before.export_mismatch(MismatchReport(3, sums, sums))
    assert before.flush(timeout=60)
    state = before.state_dict()
    before.close()
    reader = InMemoryMetricReader()
    after = OtlpExporter(meter_provider=MeterProvider(metric_readers=[reader]))
    after.attach(ExportContext(run=RUN))
    after.load_state_dict(state)
    after.export(hand_report(4, {"": [[2]]}))
    assert after.flush(timeout=60)
    assert provider_points(reader, "rl.staleness.tokens.sampled")["", ""].value == 7
    hist = provider_points(reader, "rl.staleness.token.steps")["", ""]
    assert (hist.count, hist.sum) == (7, 1 + 1 + 1 + 1 + 2 + 3 + 2)
    mismatch = provider_points(reader, "rl.staleness.mismatch.tokens")
    assert (mismatch["", "0"].value, mismatch["", "1"].value, mismatch["", "2"].value) == (1, 2, 0)
    after.close()


def exact(values: list[int]) -> tuple[int, int, int, int]:
    return len(values), sum(values), min(values), max(values)


def test_histograms_from_4096_up_have_their_exact_sum_min_and_max_over_the_wire() -> None:
    """The last bucket (+Inf) holds every staleness from 4096 up; the points' sum, min and max are the
    exact staleness, per env, cumulative across ships."""
    with OtlpReceiver() as receiver:
        exporter = OtlpExporter(endpoint=receiver.endpoint)
        monitor = StalenessMonitor(FAR_CONFIG, [exporter], run=RUN)
        for ship, (step, _) in enumerate(FAR_SHIPS):
            monitor.add(far_records(ship))
            monitor.ship(step)
        monitor.close(timeout=60)
        requests = receiver.wait_for(len(FAR_SHIPS))
    for ship, request in enumerate(requests):
        metrics = metrics_by_name(request)
        for name, of in (("rl.staleness.token.steps", 0), ("rl.staleness.rollout.steps", 1)):
            for env, point in points_by_env(metrics[name]).items():
                assert (point.count, point.sum, point.min, point.max) == exact(far_staleness(ship + 1, env)[of])
                assert point.bucket_counts[-1] == (point.count if env == "far" else 0)


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_through_a_meter_provider_staleness_from_4096_up_is_recorded_exactly(delta: bool) -> None:
    """The instruments take one value per token: those the histograms fold from 4096 up are recorded to
    their exact sum, lowest and highest (cumulative over the run, a value below 4096 beside them). A
    delta point is the ship's own values: its lowest and highest from 4096 up even when neither is the
    run's (they were spread evenly between the run's extremes), as the exporter's own path sends."""
    preferred = {Histogram: AggregationTemporality.DELTA} if delta else None
    reader = InMemoryMetricReader(preferred_temporality=preferred)
    exporter = OtlpExporter(meter_provider=MeterProvider(metric_readers=[reader]))
    with StalenessMonitor(FAR_CONFIG, [exporter], run=RUN) as monitor:
        for ship, (step, _) in enumerate(FAR_SHIPS):
            monitor.add(far_records(ship))
            monitor.ship(step)
            assert exporter.flush(timeout=60)
            for name, of in (("rl.staleness.token.steps", 0), ("rl.staleness.rollout.steps", 1)):
                for (env, _), point in provider_points(reader, name).items():
                    before, after = far_staleness(ship, env)[of], far_staleness(ship + 1, env)[of]
                    assert (point.count, point.sum, point.min, point.max) == exact(after[len(before) if delta else 0 :])


LENGTH_RECORDS = [
    # lag 1 at step 2 (T = 1): masked by the bound 0; 3 and 2 sampled positions removed
    {"id": "a", "env": "math", "dispatch_version": 0, "samples": [{"mask": [1, 1, 1], "token_versions": [0, 0, 0]}]},
    {"id": "c", "dispatch_version": 0, "samples": [{"mask": [1, 1], "token_versions": [0, 0]}]},
    # lag 0: kept; 4 sampled positions after a prompt position
    {"id": "b", "env": "code", "dispatch_version": 1,
     "samples": [{"mask": [0, 1, 1, 1, 1], "token_versions": [-1, 1, 1, 1, 1]}]},
]  # fmt: skip
# (metric, env, length bucket) -> value; env "" is the whole batch, the buckets not listed are 0
LENGTH_EXPECTED = {
    ("rl.staleness.length.samples", "", None): 3,
    ("rl.staleness.length.samples", "code", None): 1,
    ("rl.staleness.length.samples", "math", None): 1,
    ("rl.staleness.length.sampled_tokens", "", "256"): 9,
    ("rl.staleness.length.sampled_tokens", "code", "256"): 4,
    ("rl.staleness.length.sampled_tokens", "math", "256"): 3,
    ("rl.staleness.length.removed_tokens", "", "256"): 5,
    ("rl.staleness.length.removed_tokens", "math", "256"): 3,
}


def _length_points(points: list[tuple[str, dict[str, str], float]]) -> dict[tuple[str, str, str | None], float]:
    return {
        (name, attributes.get("env", ""), attributes.get("length")): number
        for name, attributes, number in points
        if name.startswith("rl.staleness.length.") and number
    }


def test_length_counters_have_a_batch_wide_point_beside_the_per_env_ones() -> None:
    """SPEC 12 with the env breakdown, as in Prometheus: the point without env is the whole batch (a query over
    every env selects it instead of summing), each named env has its own; over a real OTLP receiver and
    through an injected meter provider."""
    config = StalenessConfig(max_staleness=0, env_breakdown=True)
    with OtlpProtoTestServer() as server:
        monitor = StalenessMonitor(config, [OtlpExporter(endpoint=server.metrics_endpoint)], run=RUN)
        monitor.add(LENGTH_RECORDS)
        monitor.ship(2)
        monitor.close()
        recorded = server.drain_metrics()
    last: dict[str, Any] = {r.metric.name: r.metric for r in recorded}
    sent = [
        (name, attributes_of(p), value(p)) for name, metric in last.items() if metric.WhichOneof("data") == "sum"
        for p in metric.sum.data_points
    ]  # fmt: skip
    assert _length_points(sent) == LENGTH_EXPECTED
    for name, attributes, _ in sent:
        if name == "rl.staleness.length.sampled_tokens" and "env" not in attributes:  # every bucket is there
            assert attributes["length"] in ("256", "1k", "4k", "16k", "inf")

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    exporter = OtlpExporter(meter_provider=provider)
    monitor = StalenessMonitor(config, [exporter], run=RUN)
    monitor.add(LENGTH_RECORDS)
    monitor.ship(2)
    assert exporter.flush(timeout=60)
    data = reader.get_metrics_data()
    assert data is not None
    recorded_points = [
        (m.name, dict(p.attributes), p.value)
        for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        if m.name.startswith("rl.staleness.length.") for p in m.data.data_points
    ]  # fmt: skip
    assert _length_points(recorded_points) == LENGTH_EXPECTED
    monitor.close()
    provider.shutdown()

    # Without a named env, the point without env already is the whole batch: one point, as before.
    capture = InMemoryMetricReader()
    plain_provider = MeterProvider(metric_readers=[capture])
    monitor = StalenessMonitor(config, [OtlpExporter(meter_provider=plain_provider)], run=RUN)
    monitor.add([LENGTH_RECORDS[1]])
    monitor.ship(2)
    monitor.close()
    plain = capture.get_metrics_data()
    assert plain is not None
    samples = [
        (dict(p.attributes), p.value)
        for rm in plain.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        if m.name == "rl.staleness.length.samples" for p in m.data.data_points
    ]  # fmt: skip
    assert samples == [({"run": RUN}, 1)]
    plain_provider.shutdown()


def test_invalid_protocol_is_a_config_error() -> None:
    from staleness_metrics.errors import ConfigError

    with pytest.raises(ConfigError, match="http/protobuf"):
        OtlpExporter(protocol="http/json")


def test_a_missing_otlp_dependency_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    grpc = "opentelemetry.exporter.otlp.proto.grpc.metric_exporter"
    monkeypatch.setitem(sys.modules, grpc, None)  # installed with [otlp] only: no gRPC transport
    with pytest.raises(ImportError, match=re.escape("pip install 'staleness-metrics[otlp-grpc]'")) as caught:
        OtlpExporter(endpoint="http://127.0.0.1:9", protocol="grpc")
    assert str(caught.value).startswith("OtlpExporter(protocol='grpc') needs ") and caught.value.name == grpc
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")  # the protocol chosen by the environment
    with pytest.raises(ImportError, match=re.escape("pip install 'staleness-metrics[otlp-grpc]'")):
        OtlpExporter(endpoint="http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.metrics", None)  # no [otlp] at all
    needs_otlp = "OtlpExporter needs opentelemetry.sdk.metrics: pip install 'staleness-metrics[otlp]'"
    with pytest.raises(ImportError, match=re.escape(needs_otlp)):
        OtlpExporter(endpoint="http://127.0.0.1:9")


def test_closing_twice_shuts_the_otlp_exporter_down_once() -> None:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class CountsShutdowns(MetricExporter):
        def __init__(self) -> None:
            super().__init__()
            self.shutdowns = 0

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            self.shutdowns += 1

    inner = CountsShutdowns()
    monitor = StalenessMonitor(CONFIG, [OtlpExporter(metric_exporter=inner)], run=RUN)
    monitor.close()
    monitor.exporters[0].close()  # e.g. a finally block after the monitor's own close
    assert inner.shutdowns == 1  # a second shutdown makes the SDK log a warning


# What close() took against a refusing receiver before it was bounded: the OpenTelemetry exporter's own
# retry schedule (its 10 s default timeout). A bounded close must return well before that.
UNBOUNDED_CLOSE = 10.0


@pytest.mark.parametrize("behaviour", ["refusing", "blackholing", "slow"])
def test_close_returns_within_its_timeout_whatever_the_receiver_does(behaviour: str) -> None:
    import socket

    listener: socket.socket | None = None
    receiver: OtlpReceiver | None = None
    if behaviour == "refusing":
        endpoint = f"http://127.0.0.1:{free_port()}/v1/metrics"  # nothing listens: connection refused
    elif behaviour == "blackholing":
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/metrics"
    else:
        receiver = OtlpReceiver()
        receiver.release.clear()  # reads the request, answers only when released
        endpoint = receiver.endpoint
    errors = ExportErrors()
    exporter = OtlpExporter(endpoint=endpoint)  # the OpenTelemetry exporter's own 10 s timeout and retries
    exporter.attach(ExportContext(run=RUN, errors=errors))
    try:
        exporter.export(hand_report(1, {"": [[1]]}))
        if receiver is not None:
            assert receiver.arrived.wait(60)
        started = time.monotonic()
        exporter.close(timeout=0.5)
        took = time.monotonic() - started
        assert took < UNBOUNDED_CLOSE / 2, f"close took {took:.1f} s"
        assert exporter.queue.sent == 0 and exporter.queue.worker_is_daemon  # the send was left behind
    finally:
        if listener is not None:
            listener.close()
        if receiver is not None:
            receiver.release.set()
            receiver.stop()


def test_default_close_timeout_is_at_most_two_seconds_and_bounds_close() -> None:
    from staleness_metrics.exporters.base import DEFAULT_CLOSE_TIMEOUT

    assert DEFAULT_CLOSE_TIMEOUT <= 2.0
    exporter = OtlpExporter(endpoint=f"http://127.0.0.1:{free_port()}/v1/metrics")
    monitor = StalenessMonitor(CONFIG, [exporter], run=RUN)
    for records, step in ship_script(2):
        monitor.add(records)
        monitor.ship(step)
    started = time.monotonic()
    monitor.close()  # as a trainer's finally block does
    took = time.monotonic() - started
    assert took < UNBOUNDED_CLOSE / 2, f"close took {took:.1f} s"
    assert monitor.export_errors.count("otlp") >= 1  # the reports it could not send are counted, not lost silently


def test_a_receiver_down_is_logged_once_not_at_each_of_otels_own_retries(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    errors = ExportErrors()
    # OTel retries within an export's timeout, warning at each retry; the failure is ours to log
    exporter = OtlpExporter(
        endpoint=f"http://127.0.0.1:{free_port()}/v1/metrics", timeout=3, retry_initial=30, retry_max=30
    )
    exporter.attach(ExportContext(run=RUN, errors=errors))
    try:
        exporter.export(hand_report(1, {"": [[1]]}))
        wait_for_errors(errors, 1)
        deadline = time.monotonic() + 60  # (the worker counts the failure, then logs it)
        while not any(r.levelno >= logging.WARNING for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        exporter.close(timeout=0)
    assert [r.name for r in caplog.records if r.levelno >= logging.WARNING] == ["staleness_metrics.exporters"]
    logging.getLogger("opentelemetry.exporter.otlp.proto.http.metric_exporter").warning("the caller's own")
    assert caplog.records[-1].getMessage() == "the caller's own"  # (other threads' records pass)
