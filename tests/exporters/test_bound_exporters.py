"""SPEC 14's gauges as a user reads them: scraped by a real Prometheus and sent over OTLP, equal to the keys
the same run wrote to JSONL (the W&B keys), from the sink path and from the live path."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opentelemetry.test._otlp_test_server import OtlpProtoTestServer

from staleness_metrics.exporters.jsonl import JsonlExporter
from staleness_metrics.exporters.otlp import OtlpExporter
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.metrics.metric_table import METRICS, MetricDef, Source
from staleness_metrics.metrics.mismatch import MismatchSums, mismatch_sums
from staleness_metrics.metrics.report import MetricValue
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import CONFIG, ship_script
from tests.support.otlp import attributes_of
from tests.support.prometheus import PrometheusServer, requires_prometheus

pytestmark = pytest.mark.integration

COSTS = dataclasses.replace(CONFIG, floor_min_tokens=2, cost_window=2)
RUN = "bound-run"
BOUND_ROWS = tuple(m for m in METRICS if m.source is Source.BOUND and m.prometheus_name is not None)
FLOOR_SOURCE = "staleness/mismatch/floor_source"


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    yield


BATCH_KEYS = {key for row in METRICS if row.source is Source.BOUND for key in row.wandb_keys}


def is_spec14(key: str) -> bool:
    """A SPEC 14 key, batch-wide or of an env (``staleness/env/<env>/...``, the env breakdown)."""
    tails = {"/" + k.removeprefix("staleness/") for k in BATCH_KEYS}
    return key in BATCH_KEYS or (key.startswith("staleness/env/") and any(key.endswith(t) for t in tails))


def spec14(metrics: Mapping[str, MetricValue]) -> dict[str, MetricValue]:
    """The SPEC 14 keys of a row, numbers as floats (as Prometheus and OTLP carry them)."""
    return {k: v if isinstance(v, str) else float(v) for k, v in metrics.items() if is_spec14(k)}


def envs_of(metrics: Mapping[str, MetricValue]) -> dict[str, MetricValue]:
    return {k: v for k, v in metrics.items() if k.startswith("staleness/env/")}


def as_keys(row: MetricDef, points: list[tuple[dict[str, str], float]]) -> dict[str, MetricValue]:
    """Gauge points of a row back into W&B keys: the floor's ``source`` label is the floor source key."""
    assert row.wandb_key is not None
    out: dict[str, MetricValue] = {}
    for labels, value in points:
        env = labels.get("env", "")

        def key(batch_key: str, env: str = env) -> str:
            return f"staleness/env/{env}/{batch_key.removeprefix('staleness/')}" if env else batch_key

        if row.dimension is None:
            out[key(row.wandb_key)] = value
        elif row.dimension.label == "source":
            out[key(row.wandb_key)] = value
            out[key(FLOOR_SOURCE)] = labels["source"]
        else:
            out[key(row.wandb_key.replace(row.dimension.placeholder, labels[row.dimension.label]))] = value
    return out


def live_sums(seed: int) -> MismatchSums:
    """Trainer-side sums with lag-0 tokens (a floor) and a drift growing with the lag (a crossed curve)."""
    rng = np.random.default_rng(seed)
    lags = rng.integers(0, 12, 600)
    sampler = -rng.random(600) * 2
    trainer = sampler + rng.normal(0.0, 0.02, 600) + 0.03 * lags
    return mismatch_sums(lags, sampler, trainer, masked=lags > COSTS.max_staleness)


@requires_prometheus
def test_scraped_gauges_equal_the_jsonl_keys_of_the_sink_and_of_the_live_path(tmp_path: Path) -> None:
    exporter = PrometheusExporter(port=0)
    path = tmp_path / "metrics.jsonl"
    monitor = StalenessMonitor(COSTS, [exporter, JsonlExporter(path)], run=RUN)
    expected: list[dict[str, MetricValue]] = []
    try:
        assert exporter.port is not None
        with PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{exporter.port}"]) as prom:

            def scraped() -> dict[str, MetricValue]:
                out: dict[str, MetricValue] = {}
                for row in BOUND_ROWS:
                    result = prom.query(f'{row.prometheus_name}{{run="{RUN}"}}')
                    for series in result:
                        # the batch's series have env "": no label; each env's carry it (the env breakdown)
                        labels = set(series["metric"]) - {"__name__", "job", "instance"}
                        assert labels == set(row.labels) - ({"env"} if "env" not in series["metric"] else set())
                    out.update(as_keys(row, [(r["metric"], float(r["value"][1])) for r in result]))
                return out

            for records, step in ship_script(3):
                monitor.add(records)
                shipment = monitor.ship(step)
            expected.append(spec14(shipment.metrics))
            assert {FLOOR_SOURCE, "staleness/bound/suggested"} <= set(expected[-1])  # the sink path
            assert "staleness/env/math/mismatch/floor" in expected[-1]  # and per env, from the records
            prom.wait_until(lambda: scraped() == expected[-1])

            monitor.record_mismatch(shipment.step, live_sums(1))
            monitor.record_mismatch(shipment.step, live_sums(2))  # a second rank: the step's merged sums
            live = monitor.mismatch_metrics(shipment.step)
            assert live is not None
            # The trainer's sums (no env) replace the batch's gauges; the envs' stay those of the ship.
            expected.append({**envs_of(expected[-1]), **spec14(live)})
            assert expected[-1] != expected[-2] and expected[-1]["staleness/bound/crossed"] == 1.0
            prom.wait_until(lambda: scraped() == expected[-1])
            # Only the curve's lags are exposed: none left over from the sink path's curve.
            assert {k for k in scraped() if "/curve/" in k} == {k for k in expected[-1] if "/curve/" in k}
    finally:
        monitor.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    with_spec14 = [spec14(row) for row in rows if FLOOR_SOURCE in row]
    assert with_spec14[-1] == spec14(live)  # the live line of the merged step
    assert expected[0] in with_spec14  # the ship's line
    assert all(isinstance(row[FLOOR_SOURCE], str) for row in rows if FLOOR_SOURCE in row)


def test_otlp_gauges_over_the_wire_equal_the_latest_keys() -> None:
    with OtlpProtoTestServer() as server:
        monitor = StalenessMonitor(COSTS, [OtlpExporter(endpoint=server.metrics_endpoint)], run=RUN)
        for records, step in ship_script(3):
            monitor.add(records)
            shipment = monitor.ship(step)
        from_ship = spec14(shipment.metrics)
        monitor.record_mismatch(shipment.step, live_sums(3))
        live = monitor.mismatch_metrics(shipment.step)
        # a trainer that gives its sums per env too: that env's gauges follow them
        monitor.record_mismatch(shipment.step, live_sums(4), env="code")
        both = monitor.mismatch_metrics(shipment.step)
        monitor.close()  # flushes
        recorded = server.drain_metrics()
    assert live is not None and from_ship != spec14(live)
    last: dict[str, Any] = {}
    for r in recorded:  # one export per ship and per trainer post: keep the last of each metric
        last[r.metric.name] = r.metric
    got: dict[str, MetricValue] = {}
    for row in BOUND_ROWS:
        assert row.otel_name is not None
        metric = last[row.otel_name]
        assert metric.WhichOneof("data") == "gauge" and metric.unit == row.otel_unit, row.name
        points = []
        for point in metric.gauge.data_points:
            attributes = attributes_of(point)
            expected_attributes = set(row.labels) - ({"env"} if "env" not in attributes else set())
            assert attributes["run"] == RUN and set(attributes) == expected_attributes, row.name
            value = float(point.as_int if point.WhichOneof("value") == "as_int" else point.as_double)
            points.append((attributes, value))
        got.update(as_keys(row, points))
    assert live is not None and both is not None
    assert "staleness/env/code/mismatch/floor" in both and "staleness/env/math/mismatch/floor" not in both
    math_keys = {k: v for k, v in envs_of(from_ship).items() if k.startswith("staleness/env/math/")}
    assert got == {**math_keys, **spec14(both)}


def test_an_injected_meter_provider_gets_the_same_gauges() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    exporter = OtlpExporter(meter_provider=provider)
    monitor = StalenessMonitor(COSTS, [exporter], run=RUN)
    for records, step in ship_script(2):
        monitor.add(records)
        shipment = monitor.ship(step)
    assert exporter.flush(timeout=60)
    data = reader.get_metrics_data()
    assert data is not None
    metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    got: dict[str, MetricValue] = {}
    for row in BOUND_ROWS:
        assert row.otel_name is not None
        points = [(dict(p.attributes), float(p.value)) for p in metrics[row.otel_name].data.data_points]
        got.update(as_keys(row, points))
    assert got == spec14(shipment.metrics)
    monitor.close()
    provider.shutdown()
