"""The metric table covers SPEC 6 and 8, and no exporter publishes a name that is not in it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.exporters.base import QueuedExporter
from staleness_metrics.exporters.jsonl import JsonlExporter
from staleness_metrics.exporters.otlp import OtlpExporter
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.exporters.wandb import WandbExporter
from staleness_metrics.metrics import metric_table
from staleness_metrics.metrics.metric_table import LEGACY_KEYS, METRICS, MetricKind
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import CONFIG, ship_script

# SPEC 6, the metrics of a ship (W&B keys)
SPEC6_KEYS = [
    "staleness/token/mean",
    "staleness/token/masked",
    "staleness/token/unlabelled",
    "staleness/token/p50",
    "staleness/token/p90",
    "staleness/token/p99",
    "staleness/rollout/mean",
    "staleness/rollout/max",
    "staleness/rollout/in_flight/mean",
    "staleness/rollout/in_flight/max",
    "staleness/rollout/in_queue/mean",
    "staleness/rollout/in_queue/max",
    "staleness/rollout/newest/mean",
    "staleness/rollout/newest/max",
    "staleness/rollout/dropped",
    "staleness/sample/dropped",
    "staleness/rollout/held",
    "staleness/max_staleness",
]
# SPEC 6, the counters (as Tally fields)
SPEC6_COUNTERS = [
    "tokens_sampled",
    "tokens_masked",
    "tokens_dropped",
    "samples_dropped",
    "rollouts_dropped",
    "rollouts_shipped",
    "rollouts_frozen",
    "rollouts_invalid",
]
# SPEC 8, Prometheus families and their types
SPEC8_PROMETHEUS = {
    "rl_staleness_train_step": "gauge",
    "rl_staleness_max_staleness": "gauge",
    "rl_staleness_token_mean_steps": "gauge",
    "rl_staleness_token_masked_ratio": "gauge",
    "rl_staleness_rollout_mean_steps": "gauge",
    "rl_staleness_rollout_max_steps": "gauge",
    "rl_staleness_rollout_in_flight_mean_steps": "gauge",
    "rl_staleness_rollout_in_flight_max_steps": "gauge",
    "rl_staleness_rollout_in_queue_mean_steps": "gauge",
    "rl_staleness_rollout_in_queue_max_steps": "gauge",
    "rl_staleness_rollout_newest_mean_steps": "gauge",
    "rl_staleness_rollout_newest_max_steps": "gauge",
    "rl_staleness_token_steps": "histogram",
    "rl_staleness_rollout_steps": "histogram",
    "rl_staleness_tokens_sampled_total": "counter",
    "rl_staleness_tokens_masked_total": "counter",
    "rl_staleness_tokens_dropped_total": "counter",
    "rl_staleness_rollouts_shipped_total": "counter",
    "rl_staleness_rollouts_dropped_total": "counter",
    "rl_staleness_samples_dropped_total": "counter",
    "rl_staleness_rollouts_frozen_total": "counter",
    "rl_staleness_rollouts_invalid_total": "counter",
    "rl_staleness_tokens_unlabelled_total": "counter",
    "rl_staleness_rollouts_held": "gauge",
    "rl_staleness_export_errors_total": "counter",
}
# SPEC 11 and 12 counters, with their bucket label (None: no bucket label)
# SPEC 14: gauges, with the label besides run each carries.
SPEC14_PROMETHEUS = {
    "rl_staleness_mismatch_floor_nats": "source",
    "rl_staleness_mismatch_floor_age_steps": None,
    "rl_staleness_mismatch_budget_nats": None,
    "rl_staleness_mismatch_curve_nats": "lag",
    "rl_staleness_bound_suggested": None,
    "rl_staleness_bound_crossed": None,
    "rl_staleness_bound_excess_at_bound_nats": None,
}
SPEC11_12_PROMETHEUS = {
    "rl_staleness_mismatch_tokens_total": "lag",
    "rl_staleness_mismatch_masked_tokens_total": "lag",
    "rl_staleness_mismatch_kl_nats_total": "lag",
    "rl_staleness_mismatch_abs_log_ratio_nats_total": "lag",
    "rl_staleness_mismatch_ratio_total": "lag",
    "rl_staleness_mismatch_ratio_squared_total": "lag",
    "rl_staleness_mismatch_out_of_band_tokens_total": "lag",
    "rl_staleness_mismatch_uncovered_tokens_total": None,
    "rl_staleness_length_sampled_tokens_total": "length",
    "rl_staleness_length_removed_tokens_total": "length",
    "rl_staleness_length_samples_total": None,  # extension: makes the mean lengths exact in PromQL
}
SPEC11_LAGS = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16", "32", "64")
UCUM = {"{step}", "1", "{token}", "{rollout}", "{sample}", "{error}", "{nat}", "{flag}"}

WANDB_KEYS = set(metric_table.WANDB_KEYS)


def is_table_wandb_key(key: str) -> bool:
    """A table key, or its per-env form ``staleness/env/<env>/<rest of the key>``."""
    if key in WANDB_KEYS:
        return True
    parts = key.split("/")
    return key.startswith("staleness/env/") and "staleness/" + "/".join(parts[3:]) in WANDB_KEYS


def test_every_spec6_metric_is_in_the_table() -> None:
    missing = [key for key in SPEC6_KEYS if key not in WANDB_KEYS]
    assert not missing
    counters = {m.tally_field for m in METRICS if m.kind is MetricKind.COUNTER}
    assert not [f for f in SPEC6_COUNTERS if f not in counters]
    histograms = {m.source.value for m in METRICS if m.kind is MetricKind.HISTOGRAM}
    assert histograms == {"token_histogram", "rollout_histogram"}


def test_every_spec8_prometheus_family_is_in_the_table_with_its_type() -> None:
    table = {m.prometheus_name: m.kind.value for m in METRICS if m.prometheus_name is not None}
    assert table == {
        **SPEC8_PROMETHEUS,
        **dict.fromkeys(SPEC11_12_PROMETHEUS, "counter"),
        **dict.fromkeys(SPEC14_PROMETHEUS, "gauge"),
    }


def test_spec14_gauges_carry_their_label_with_the_spec_values() -> None:
    rows = {m.prometheus_name: m for m in METRICS if m.prometheus_name in SPEC14_PROMETHEUS}
    for name, label in SPEC14_PROMETHEUS.items():
        row = rows[name]
        # env: each env's keys with the env breakdown (the batch's series have env "": no label in Prometheus)
        if label is None:
            assert row.dimension is None and row.labels == ("run", "env"), name
        else:
            assert row.dimension is not None and row.dimension.label == label and row.labels == ("run", "env", label)
    assert rows["rl_staleness_mismatch_floor_nats"].dimension.values == ("lag0", "carried", "min_lag")  # type: ignore[union-attr]
    assert rows["rl_staleness_mismatch_curve_nats"].dimension.values == tuple(str(b) for b in range(1, 17))  # type: ignore[union-attr]


def test_spec11_and_12_counters_carry_their_bucket_label_with_the_spec_values() -> None:
    rows = {m.prometheus_name: m for m in METRICS if m.prometheus_name in SPEC11_12_PROMETHEUS}
    for name, label in SPEC11_12_PROMETHEUS.items():
        row = rows[name]
        assert row.kind is MetricKind.COUNTER and name.endswith("_total"), name
        if label is None:
            assert row.dimension is None, name
            continue
        assert row.dimension is not None and row.dimension.label == label and label in row.labels, name
        if label == "lag":  # SPEC 11: 0..16, 32, 64, +Inf; env: the per-env series of sums given per env
            assert row.dimension.values == (*SPEC11_LAGS, "+Inf") and row.labels == ("run", "env", "lag"), name
        else:  # SPEC 12: the length bucket names themselves
            assert row.dimension.values == ("256", "1k", "4k", "16k", "inf") and "env" in row.labels, name
    assert rows["rl_staleness_mismatch_uncovered_tokens_total"].labels == ("run", "env")


def test_templated_wandb_keys_spell_out_every_bucket_and_cover_what_the_core_writes() -> None:
    assert "staleness/mismatch/lag_{lag}/k3" not in WANDB_KEYS  # templates are not keys
    for lag in (*SPEC11_LAGS, "inf"):
        for stat in ("tokens", "k3", "abs_log_ratio", "out_of_band", "ess", "excess_k3"):
            assert f"staleness/mismatch/lag_{lag}/{stat}" in WANDB_KEYS, (lag, stat)
    for key in ("staleness/mismatch/k3", "staleness/mismatch/excess_k3", "staleness/mismatch/coverage"):
        assert key in WANDB_KEYS
    for bucket in ("256", "1k", "4k", "16k", "inf"):
        assert f"staleness/length/bucket_{bucket}/masked" in WANDB_KEYS
    assert {"staleness/length/sampled/mean", "staleness/length/trained/mean"} <= set(WANDB_KEYS)
    # every key a ship with trainer log-probs writes is a table key (the env keys in their per-env form)
    with StalenessMonitor(CONFIG, [], run="keys") as monitor:
        written: set[str] = set()
        for records, step in ship_script(4):
            monitor.add(records)
            written |= set(monitor.ship(step).metrics)
    assert any(k.startswith("staleness/mismatch/lag_") for k in written)
    assert any(k.startswith("staleness/length/bucket_") for k in written)
    assert all(is_table_wandb_key(k) for k in written), sorted(k for k in written if not is_table_wandb_key(k))


def test_otel_names_are_dotted_with_ucum_units_and_unique() -> None:
    names = [m.otel_name for m in METRICS if m.otel_name is not None]
    assert len(names) == len(set(names))
    for m in METRICS:
        if m.otel_name is not None:
            assert m.otel_name.startswith("rl.staleness.") and "total" not in m.otel_name, m.otel_name
            assert m.otel_unit in UCUM, (m.name, m.otel_unit)


def test_legacy_keys_map_to_table_keys() -> None:
    for old, entry in LEGACY_KEYS.items():
        assert entry.new is None or entry.new in WANDB_KEYS, old


class CapturingMetricExporter(MetricExporter):
    """An OTel MetricExporter that keeps what it is given (in place of the OTLP transport)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[MetricsData] = []

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


class RecordingRun:
    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.defined: set[str] = set()

    def define_metric(self, name: str, **options: Any) -> None:
        self.defined.add(name)

    def log(self, row: dict[str, Any], commit: bool = True) -> None:
        self.keys |= set(row)


def run_all(tmp_path: Path, exporters: Sequence[Any]) -> None:
    with StalenessMonitor(CONFIG, exporters, run="names") as monitor:
        for records, step in ship_script(3):
            monitor.add(records)
            monitor.ship(step)
        monitor.export_errors.record("otlp", "pretend failure")
        # Read what the queued exporters sent, not what a close bounded in seconds got through: under CPU
        # load W&B's first row waits for ``import wandb``, which can outlast the close timeout.
        for exporter in exporters:
            if isinstance(exporter, QueuedExporter):
                assert exporter.flush()


def test_no_exporter_publishes_a_name_outside_the_table(tmp_path: Path) -> None:
    prometheus = PrometheusExporter(port=None)
    otel_capture = CapturingMetricExporter()
    otlp = OtlpExporter(metric_exporter=otel_capture)
    run = RecordingRun()
    wandb_exporter = WandbExporter(run, legacy_keys=True)
    jsonl = JsonlExporter(tmp_path / "m.jsonl")
    run_all(tmp_path, [prometheus, otlp, wandb_exporter, jsonl])

    prometheus_names = {m.prometheus_name for m in METRICS if m.prometheus_name is not None}
    exposed = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(prometheus.exposition().decode())
    }
    assert "rl_staleness_train_step" in exposed and "rl_staleness_export_errors_total" in exposed
    assert exposed <= prometheus_names, sorted(exposed - prometheus_names)

    otel_names = {m.otel_name for m in METRICS if m.otel_name is not None}
    sent = {
        metric.name
        for batch in otel_capture.batches
        for rm in batch.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    }
    assert sent and sent <= otel_names

    axis = {"trainer/step"}
    assert {"trainer/step", "staleness/rollout/max", "off_policy/max"} <= run.keys  # it did log
    assert any(k.startswith("staleness/env/") for k in run.keys)
    unknown = {k for k in run.keys if not is_table_wandb_key(k) and k not in LEGACY_KEYS and k not in axis}
    assert not unknown, sorted(unknown)
    assert not {k for k in run.defined if k not in axis | {"staleness/*"} and not is_table_wandb_key(k)} - set(
        LEGACY_KEYS
    )

    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == 3  # one per ship
    for line in lines:
        assert all(k == "step" or is_table_wandb_key(k) for k in json.loads(line))
