"""A gauge series that stops being current stops being exported, in Prometheus and over OTLP alike: SPEC 14's
floor when its source changes (lag0, carried, min_lag), a lag that leaves the excess curve, and an env the last
ship no longer has. Prometheus by its exact exposition text; OTLP over the wire, from the exporter's own
pipeline and through an injected MeterProvider (whose gauges are observable: a synchronous gauge would keep
reporting every attribute set it ever saw)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.config import StalenessConfig
from staleness_metrics.exporters.base import ExportContext
from staleness_metrics.exporters.otlp import OtlpExporter
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.metrics.metric_table import metric_by_prometheus_name
from staleness_metrics.metrics.mismatch import MismatchSums, mismatch_sums
from staleness_metrics.metrics.report import StepReport
from staleness_metrics.monitor import StalenessMonitor
from staleness_metrics.state_checks import digests_of
from tests.exporters.reports import hand_report
from tests.support.otlp import OtlpReceiver, attributes_of, metrics_by_name

RUN = "r"
# SPEC 14 on a handful of tokens: the floor is carried one step at most, the curve is this ship's alone.
CONFIG = StalenessConfig(max_staleness=3, floor_min_tokens=2, floor_max_age=1, cost_window=1)
SPEC14 = (
    "rl_staleness_mismatch_floor_nats",
    "rl_staleness_mismatch_floor_age_steps",
    "rl_staleness_mismatch_budget_nats",
    "rl_staleness_mismatch_curve_nats",
    "rl_staleness_bound_suggested",
    "rl_staleness_bound_crossed",
    "rl_staleness_bound_excess_at_bound_nats",
)

Points = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    yield


def sums(**buckets: tuple[int, float]) -> MismatchSums:
    """Trainer sums with ``lag<b>=(tokens, Σk3)`` (ratios of 1 elsewhere)."""
    data = MismatchSums.zero().to_dict()
    for name, (tokens, k3) in buckets.items():
        data["lags"][name.removeprefix("lag")].update(
            tokens=tokens, sum_k3=k3, sum_ratio=float(tokens), sum_ratio_sq=float(tokens)
        )
    return MismatchSums.from_dict(data)


# Step 1: lag 0 has 4 tokens of k3 1/8 (the floor, lag0); lags 1 and 2 are the curve. Step 2: lag 1 only, the
# floor carried (age 1); lag 2 left the curve. Step 3: the carried floor is too old: lag 1's k3 bounds it.
STEPS = (
    (1, sums(lag0=(4, 0.5), lag1=(2, 0.75), lag2=(2, 1.0))),
    (2, sums(lag1=(2, 0.5))),
    (3, sums(lag1=(2, 0.5))),
)
EXPOSED = {
    1: """\
rl_staleness_mismatch_floor_nats{env="",run="r",source="lag0"} 0.125
rl_staleness_mismatch_floor_age_steps{env="",run="r"} 0.0
rl_staleness_mismatch_budget_nats{env="",run="r"} 0.125
rl_staleness_mismatch_curve_nats{env="",lag="1",run="r"} 0.25
rl_staleness_mismatch_curve_nats{env="",lag="2",run="r"} 0.375
rl_staleness_bound_suggested{env="",run="r"} 0.0
rl_staleness_bound_crossed{env="",run="r"} 1.0
rl_staleness_bound_excess_at_bound_nats{env="",run="r"} 0.375
""",
    2: """\
rl_staleness_mismatch_floor_nats{env="",run="r",source="carried"} 0.125
rl_staleness_mismatch_floor_age_steps{env="",run="r"} 1.0
rl_staleness_mismatch_budget_nats{env="",run="r"} 0.125
rl_staleness_mismatch_curve_nats{env="",lag="1",run="r"} 0.125
rl_staleness_bound_suggested{env="",run="r"} 1.0
rl_staleness_bound_crossed{env="",run="r"} 0.0
rl_staleness_bound_excess_at_bound_nats{env="",run="r"} 0.125
""",
    3: """\
rl_staleness_mismatch_floor_nats{env="",run="r",source="min_lag"} 0.25
rl_staleness_mismatch_floor_age_steps{env="",run="r"} 0.0
rl_staleness_mismatch_budget_nats{env="",run="r"} 0.25
rl_staleness_mismatch_curve_nats{env="",lag="1",run="r"} 0.0
rl_staleness_bound_suggested{env="",run="r"} 1.0
rl_staleness_bound_crossed{env="",run="r"} 0.0
rl_staleness_bound_excess_at_bound_nats{env="",run="r"} 0.0
""",
}

# An env the last ship no longer has: step 1 has math, step 2 only rollouts without env.
ENV_REPORTS = (
    hand_report(1, {"": [[0, 1]], "math": [[2, 2, 5]]}, env_breakdown=True),
    hand_report(2, {"": [[1]]}, env_breakdown=True),
)
TOKEN_MEAN = {
    1: 'rl_staleness_token_mean_steps{env="",run="r"} 2.0\nrl_staleness_token_mean_steps{env="math",run="r"} 3.0\n',
    2: 'rl_staleness_token_mean_steps{env="",run="r"} 1.0\n',
}


def lines(exposition: bytes, families: tuple[str, ...]) -> str:
    """The sample lines of ``families``, in exposition order (HELP and TYPE left out)."""
    return "".join(line + "\n" for line in exposition.decode().splitlines() if line.split("{")[0] in families)


def expected_points(text: str) -> Points:
    """Prometheus sample lines as OTLP points: the table's instrument name, the labels as attributes (an empty
    env is no attribute)."""
    out: Points = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            row = metric_by_prometheus_name(sample.name)
            assert row.otel_name is not None
            attributes = frozenset((k, v) for k, v in sample.labels.items() if v)
            out[(row.otel_name, attributes)] = sample.value
    return out


def otlp_points(request: Any, names: set[str]) -> Points:
    """The gauge points of ``names`` in one OTLP export request."""
    out: Points = {}
    for name, metric in metrics_by_name(request).items():
        if name not in names:
            continue
        assert metric.WhichOneof("data") == "gauge", name
        for point in metric.gauge.data_points:
            value = point.as_int if point.WhichOneof("value") == "as_int" else point.as_double
            out[(name, frozenset(attributes_of(point).items()))] = float(value)
    return out


class _Wire:
    """A Prometheus exporter and two OTLP paths to one receiver: the exporter's own pipeline, and an injected
    MeterProvider whose reader exports when flushed."""

    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver
        self.prometheus = PrometheusExporter(port=None)
        self.owned = OtlpExporter(endpoint=receiver.endpoint)
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=receiver.endpoint), export_interval_millis=3_600_000
        )
        self.provider = MeterProvider(metric_readers=[reader])
        self.injected = OtlpExporter(meter_provider=self.provider)

    @property
    def exporters(self) -> list[Any]:
        return [self.prometheus, self.owned, self.injected]

    def sent(self, names: set[str]) -> tuple[Points, Points]:
        """What each OTLP path exports now: the owned pipeline's last export, and a collection of the
        provider's (every request carries one path's metrics: the resources differ)."""
        assert self.owned.flush(timeout=60) and self.injected.flush(timeout=60)
        owned_count = len(self.receiver.wait_for(0))
        assert self.provider.force_flush(timeout_millis=60_000)
        requests = self.receiver.wait_for(owned_count + 1)
        owned = [r for r in requests if _service(r) == "staleness-metrics"]
        injected = [r for r in requests if _service(r) != "staleness-metrics"]
        return otlp_points(owned[-1], names), otlp_points(injected[-1], names)

    def close(self) -> None:
        self.owned.close()
        self.injected.close()
        self.provider.shutdown()


def _service(request: Any) -> str:
    for resource_metrics in request.resource_metrics:
        for kv in resource_metrics.resource.attributes:
            if kv.key == "service.name":
                return str(kv.value.string_value)
    return ""


def test_spec14_series_that_stop_being_current_disappear_everywhere() -> None:
    names = {metric_by_prometheus_name(f).otel_name or "" for f in SPEC14}
    with OtlpReceiver() as receiver:
        wire = _Wire(receiver)
        monitor = StalenessMonitor(CONFIG, wire.exporters, run=RUN)
        try:
            for step, trainer_sums in STEPS:
                monitor.ship(step)
                monitor.record_mismatch(step, trainer_sums)
                assert lines(wire.prometheus.exposition(), SPEC14) == EXPOSED[step], step
                expected = expected_points(EXPOSED[step])
                owned, injected = wire.sent(names)
                assert owned == expected, step
                assert injected == expected, step
            # with no new ship, the injected provider keeps exporting the current series (and only them)
            assert wire.sent(names)[1] == expected_points(EXPOSED[3])
        finally:
            monitor.close()
            wire.close()


def test_an_env_the_last_ship_does_not_have_is_no_longer_exported() -> None:
    family = ("rl_staleness_token_mean_steps",)
    names = {"rl.staleness.token.mean"}
    with OtlpReceiver() as receiver:
        wire = _Wire(receiver)
        try:
            for exporter in wire.exporters:
                exporter.attach(ExportContext(run=RUN, env_breakdown=True))
            report: StepReport
            for report in ENV_REPORTS:
                for exporter in wire.exporters:
                    exporter.export(report)
                assert lines(wire.prometheus.exposition(), family) == TOKEN_MEAN[report.step]
                expected = expected_points(TOKEN_MEAN[report.step])
                assert wire.sent(names) == (expected, expected), report.step
        finally:
            wire.close()


def test_an_envs_spec14_gauges_go_when_later_steps_post_sums_without_it() -> None:
    """Live sums posted per env: ``code`` posts at step 1 only, ``math`` at 2 and 3; after step 3 only
    the batch's and ``math``'s floor are exported (as on the records' path), not step 1's of ``code``."""
    config = StalenessConfig(max_staleness=4, env_breakdown=True, floor_min_tokens=2)
    family, names = ("rl_staleness_mismatch_floor_nats",), {"rl.staleness.mismatch.floor"}
    sampler, trainer = np.full(3, -1.0), np.array([-0.9, -1.1, -1.05])
    with OtlpReceiver() as receiver:
        wire = _Wire(receiver)
        monitor = StalenessMonitor(config, wire.exporters, run=RUN)
        try:
            for step, env in ((1, "code"), (2, "math"), (3, "math")):
                sample = {"mask": [1, 1, 1], "logprobs": sampler.tolist()}
                monitor.add([{"id": f"r{step}", "env": env, "dispatch_version": 0, "samples": [sample]}])
                monitor.record_mismatch(step, mismatch_sums(monitor.ship(step).lags, sampler, trainer), env=env)
            exposed = lines(wire.prometheus.exposition(), family)
            assert [line.split(",")[0] for line in exposed.splitlines()] == [
                'rl_staleness_mismatch_floor_nats{env=""',
                'rl_staleness_mismatch_floor_nats{env="math"',
            ]
            assert wire.sent(names) == (expected_points(exposed), expected_points(exposed))
        finally:
            monitor.close()
            wire.close()


def test_a_rank_posting_an_older_step_late_leaves_the_latest_steps_spec14_gauges() -> None:
    """Step 3's sums arrive whole, then a rank's part of step 2: the floor gauge stays step 3's (the
    latest ship's, docs/exporters.md); before, it went back to step 2's."""
    config = StalenessConfig(max_staleness=4, floor_min_tokens=2)
    prometheus = PrometheusExporter(port=None)
    monitor = StalenessMonitor(config, [prometheus], run=RUN)
    parts: dict[int, list[MismatchSums]] = {}
    try:
        for step in (1, 2, 3):
            monitor.add([{"id": f"r{step}", "dispatch_version": 0, "samples": [{"mask": [1] * 4}]}])
            lags = monitor.ship(step).lags
            trainer = np.full(4, -1.0 - 0.01 * step)  # each step its own floor
            parts[step] = [
                mismatch_sums(lags[half], np.full(2, -1.0), trainer[half]) for half in (slice(2), slice(2, 4))
            ]
        monitor.record_mismatch(2, parts[2][0])
        for part in parts[3]:
            monitor.record_mismatch(3, part)
        latest = lines(prometheus.exposition(), SPEC14)
        assert f"{monitor.mismatch_metrics(3)['staleness/mismatch/floor']!r}" in latest
        monitor.record_mismatch(2, parts[2][1])  # the other rank of step 2, late
        assert lines(prometheus.exposition(), SPEC14) == latest
    finally:
        monitor.close()


def test_a_checkpoint_saved_before_bound_step_keeps_the_latest_steps_spec14_gauges_after_a_late_rank() -> None:
    """An exporter state written before ``bound_step`` was saved (December 6th's and older): restored, a late
    rank's sums of an older step left the latest step's SPEC 14 gauges only in the uninterrupted run."""
    config = StalenessConfig(max_staleness=4, floor_min_tokens=2)
    runs = [StalenessMonitor(config, [PrometheusExporter(port=None)], run=RUN) for _ in range(2)]
    uninterrupted, resumed = runs
    parts: dict[int, list[MismatchSums]] = {}
    try:
        for step in (1, 2, 3):
            uninterrupted.add([{"id": f"r{step}", "dispatch_version": 0, "samples": [{"mask": [1] * 4}]}])
            lags = uninterrupted.ship(step).lags
            trainer = np.full(4, -1.0 - 0.01 * step)
            parts[step] = [
                mismatch_sums(lags[half], np.full(2, -1.0), trainer[half]) for half in (slice(2), slice(2, 4))
            ]
        uninterrupted.record_mismatch(2, parts[2][0])
        for part in parts[3]:
            uninterrupted.record_mismatch(3, part)
        state = uninterrupted.state_dict()
        (exporter_state,) = state["exporters"].values()
        assert exporter_state.pop("bound_step") == 3 and exporter_state["bound_metrics"]
        del state["digests"]
        state["digests"] = digests_of(state, skip=("sink",))  # (sealed as that version sealed it)
        resumed.load_state_dict(state)
        for monitor in runs:
            monitor.record_mismatch(2, parts[2][1])  # the other rank of step 2, late
        shown = [lines(monitor.exporters[0].exposition(), SPEC14) for monitor in runs]
        assert shown[0] == shown[1] and f"{uninterrupted.mismatch_metrics(3)['staleness/mismatch/floor']!r}" in shown[1]
    finally:
        for monitor in runs:
            monitor.close()
