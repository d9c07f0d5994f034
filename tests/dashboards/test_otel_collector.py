"""The example OpenTelemetry Collector config: OTLP in, Prometheus out, under the dashboards' names.

No collector can be installed here (not on PyPI, Debian or npm), so the collector's Prometheus naming is
modelled by ``collector_prometheus_name`` (checked below against the translator's documented cases), and
the OTLP side is the real exporter sending over the wire to a loopback receiver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.dashboards.rules import collector_prometheus_name
from staleness_metrics.exporters.base import ExportContext
from staleness_metrics.exporters.otlp import OtlpExporter
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.metrics.metric_table import MetricKind
from tests.support.otlp import OtlpReceiver, attributes_of, metrics_by_name

from .traffic import ENVS, Traffic

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "exporters" / "otel" / "collector.yaml"
RUN = "otel-run"


def load_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    return config


@pytest.mark.parametrize(
    ("name", "unit", "kind", "expected"),
    [
        ("system.cpu.time", "s", MetricKind.COUNTER, "system_cpu_time_seconds_total"),
        ("http.server.duration", "ms", MetricKind.HISTOGRAM, "http_server_duration_milliseconds"),
        ("system.memory.utilization", "1", MetricKind.GAUGE, "system_memory_utilization_ratio"),
        ("queue.size", "{item}", MetricKind.GAUGE, "queue_size"),
        ("requests", "1", MetricKind.COUNTER, "requests_total"),
        ("network.io", "By/s", MetricKind.GAUGE, "network_io_bytes_per_second"),
        ("jobs.total", "{job}", MetricKind.COUNTER, "jobs_total"),
    ],
)
def test_collector_naming_model(name: str, unit: str, kind: MetricKind, expected: str) -> None:
    assert collector_prometheus_name(name, unit, kind) == expected


def test_pipeline_wires_otlp_through_the_rename_to_prometheus_on_loopback() -> None:
    config = load_config()
    pipeline = config["service"]["pipelines"]["metrics"]
    for section in ("receivers", "processors", "exporters"):
        assert set(pipeline[section]) <= set(config[section]), section
    assert pipeline["receivers"] == ["otlp"] and pipeline["exporters"] == ["prometheus"]
    assert any(p.startswith("metricstransform") for p in pipeline["processors"])
    endpoints = [p["endpoint"] for p in config["receivers"]["otlp"]["protocols"].values()]
    endpoints.append(config["exporters"]["prometheus"]["endpoint"])
    assert all(e.startswith("127.0.0.1:") for e in endpoints)


@pytest.fixture(scope="module")
def received() -> dict[str, Any]:
    """The metrics of the last OTLP request the real exporter sent, after a few ships."""
    traffic = Traffic()
    with OtlpReceiver() as receiver:
        exporter = OtlpExporter(endpoint=receiver.endpoint)
        exporter.attach(ExportContext(run=RUN, env_breakdown=True))
        for _ in range(5):
            exporter.export(traffic.next_report())
        assert exporter.flush(60)
        exporter.close()
        requests = receiver.requests
    assert requests
    return metrics_by_name(requests[-1])


def _kind(metric: Any) -> MetricKind:
    data = metric.WhichOneof("data")
    if data == "sum":
        assert metric.sum.is_monotonic
        return MetricKind.COUNTER
    return {"gauge": MetricKind.GAUGE, "histogram": MetricKind.HISTOGRAM}[data]


def test_otlp_through_the_collector_gives_the_scrape_exporters_names(received: dict[str, Any]) -> None:
    transforms = next(
        p["transforms"] for name, p in load_config()["processors"].items() if name.startswith("metricstransform")
    )
    renamed = {t["include"]: t["new_name"] for t in transforms if t["match_type"] == "strict"}
    via_collector = {
        collector_prometheus_name(renamed.get(name, name), metric.unit, _kind(metric))
        for name, metric in received.items()
    }

    scrape = PrometheusExporter(port=None)
    scrape.attach(ExportContext(run=RUN, env_breakdown=True))
    traffic = Traffic()
    for _ in range(5):
        scrape.export(traffic.next_report())
    scraped = {
        f.name + ("_total" if f.type == "counter" else "")
        for f in text_string_to_metric_families(scrape.exposition().decode())
    }
    assert via_collector == scraped


def test_points_carry_run_and_named_envs(received: dict[str, Any]) -> None:
    envs: set[str] = set()
    for metric in received.values():
        points = getattr(metric, metric.WhichOneof("data")).data_points
        for point in points:
            attributes = attributes_of(point)
            assert attributes["run"] == RUN
            envs.add(attributes.get("env", ""))
    assert envs == {"", *filter(None, ENVS)}
