"""SPEC 11 / 12 in every exporter: both sources (a ship's records, the trainer's live sums) feed the same
counters; exact exposition text for a hand-made report; OTLP decodes the ``lag`` attribute; JSONL and
console rows; nothing raises into the trainer."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from staleness_metrics.exporters.base import BackgroundExporter, ExportContext, ExportErrors, MismatchReport
from staleness_metrics.exporters.console import ConsoleExporter, format_line, format_mismatch_line
from staleness_metrics.exporters.jsonl import JsonlExporter
from staleness_metrics.exporters.otlp import OtlpExporter
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.metrics.bound import BoundTracker, mismatch_metrics
from staleness_metrics.metrics.metric_table import LAG, METRICS, Source
from staleness_metrics.metrics.mismatch import LAG_BUCKETS, MismatchSums, mismatch_sums
from staleness_metrics.metrics.report import StepReport, Tally
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import CONFIG, hand_report, ship_script
from tests.support.otlp import OtlpReceiver, attributes_of, metrics_by_name
from tests.support.prometheus import promtool_check_metrics, requires_promtool

RUN = "exp-1"
MISMATCH_ROWS = [m for m in METRICS if m.source is Source.MISMATCH]


COSTS = dataclasses.replace(CONFIG, floor_min_tokens=2)  # SPEC 14 from hand_sums' few tokens


def hand_sums() -> MismatchSums:
    """Lag 0: 4 tokens; lag 1: 2 tokens, 1 masked and out of band; above 64: 1 token; 3 uncovered."""
    data = MismatchSums.zero().to_dict()
    data["uncovered"] = 3
    data["lags"]["0"].update(
        tokens=4, sum_k3=0.5, sum_abs_log_ratio=1.5, sum_log_ratio=0.5, sum_ratio=4.25, sum_ratio_sq=5.0
    )
    data["lags"]["1"].update(
        tokens=2, masked=1, out_of_band=1, sum_k3=0.75, sum_abs_log_ratio=1.25, sum_log_ratio=-0.25,
        sum_ratio=2.5, sum_ratio_sq=4.5,
    )  # fmt: skip
    data["lags"]["inf"].update(
        tokens=1, masked=1, out_of_band=1, sum_k3=2.0, sum_abs_log_ratio=3.0, sum_log_ratio=-3.0,
        sum_ratio=0.0625, sum_ratio_sq=0.00390625,
    )  # fmt: skip
    return MismatchSums.from_dict(data)


def hand_made_report(step: int = 5, mismatch: MismatchSums | None = None) -> StepReport:
    """3 samples: 10 sampled positions in the 256 bucket (2 removed), 300 in the 1k bucket (100 removed)."""
    tally = Tally(
        tokens_sampled=310,
        length_samples=3,
        length_sampled=np.array([10, 300, 0, 0, 0], dtype=np.int64),
        length_removed=np.array([2, 100, 0, 0, 0], dtype=np.int64),
    )
    metrics = {"staleness/max_staleness": 4, **(mismatch.metrics() if mismatch is not None else {})}
    return StepReport(step, 4, metrics, tally, mismatch=mismatch)


def family_text(exposition: str, family: str) -> str:
    """The HELP, TYPE and sample lines of one family, as they appear in the exposition."""
    heads = (f"# HELP {family} ", f"# TYPE {family} ", f"{family}{{", f"{family} ")
    return "\n".join(line for line in exposition.splitlines() if line.startswith(heads))


def zero_lags(family: str, skip: tuple[str, ...]) -> list[str]:
    return [f'{family}{{env="",lag="{v}",run="{RUN}"}} 0.0' for v in LAG.values if v not in skip]


def test_exposition_text_of_a_hand_made_report() -> None:
    exporter = PrometheusExporter(port=None)
    exporter.attach(ExportContext(run=RUN))
    exporter.export(hand_made_report(mismatch=hand_sums()))
    text = exporter.exposition().decode()

    tokens = "rl_staleness_mismatch_tokens_total"
    assert family_text(text, tokens) == "\n".join(
        [
            f"# HELP {tokens} Covered sampled positions (trainer and sampler log-probabilities both known), "
            "per token lag bucket.",
            f"# TYPE {tokens} counter",
            f'{tokens}{{env="",lag="0",run="{RUN}"}} 4.0',
            f'{tokens}{{env="",lag="1",run="{RUN}"}} 2.0',
            *zero_lags(tokens, ("0", "1", "+Inf")),
            f'{tokens}{{env="",lag="+Inf",run="{RUN}"}} 1.0',
        ]
    )
    for family, lag0, lag1, top in (
        ("rl_staleness_mismatch_masked_tokens_total", "0.0", "1.0", "1.0"),
        ("rl_staleness_mismatch_kl_nats_total", "0.5", "0.75", "2.0"),
        ("rl_staleness_mismatch_abs_log_ratio_nats_total", "1.5", "1.25", "3.0"),
        ("rl_staleness_mismatch_ratio_total", "4.25", "2.5", "0.0625"),
        ("rl_staleness_mismatch_ratio_squared_total", "5.0", "4.5", "0.00390625"),
        ("rl_staleness_mismatch_out_of_band_tokens_total", "0.0", "1.0", "1.0"),
    ):
        lines = family_text(text, family).splitlines()
        assert lines[1] == f"# TYPE {family} counter"
        assert lines[2:] == [
            f'{family}{{env="",lag="0",run="{RUN}"}} {lag0}',
            f'{family}{{env="",lag="1",run="{RUN}"}} {lag1}',
            *zero_lags(family, ("0", "1", "+Inf")),
            f'{family}{{env="",lag="+Inf",run="{RUN}"}} {top}',
        ], family
    uncovered = "rl_staleness_mismatch_uncovered_tokens_total"
    assert family_text(text, uncovered) == (
        f"# HELP {uncovered} Sampled positions lacking a trainer or sampler log-probability (left out of the "
        "mismatch sums).\n"
        f"# TYPE {uncovered} counter\n"
        f'{uncovered}{{env="",run="{RUN}"}} 3.0'
    )
    samples = "rl_staleness_length_samples_total"
    assert family_text(text, samples).splitlines()[2:] == [f'{samples}{{env="",run="{RUN}"}} 3.0']
    for family, values in (
        ("rl_staleness_length_sampled_tokens_total", ("10.0", "300.0", "0.0", "0.0", "0.0")),
        ("rl_staleness_length_removed_tokens_total", ("2.0", "100.0", "0.0", "0.0", "0.0")),
    ):
        assert family_text(text, family).splitlines()[2:] == [
            f'{family}{{env="",length="{bucket}",run="{RUN}"}} {value}'
            for bucket, value in zip(("256", "1k", "4k", "16k", "inf"), values, strict=True)
        ], family


def test_a_run_without_trainer_logprobs_exposes_no_mismatch_family() -> None:
    exporter = PrometheusExporter(port=None)
    exporter.attach(ExportContext(run=RUN))
    exporter.export(hand_made_report(mismatch=None))
    text = exporter.exposition().decode()
    assert "rl_staleness_mismatch_" not in text
    assert 'rl_staleness_length_samples_total{env="",run="exp-1"} 3.0' in text


def counter(exporter: PrometheusExporter, family: str, **labels: str) -> float | None:
    batch_wide = {"env": ""} if family.startswith("rl_staleness_mismatch_") else {}  # the batch's series
    return exporter.registry.get_sample_value(family, {"run": RUN, **batch_wide, **labels})


def test_both_sources_add_to_the_same_counters_and_gauges_stay() -> None:
    """The sink path (a ship's records) and the live path (trainer sums for a shipped step) add up."""
    exporter = PrometheusExporter(port=None)
    with StalenessMonitor(CONFIG, [exporter], run=RUN) as monitor:
        sink_total = MismatchSums.zero()
        for records, step in ship_script(2):
            monitor.add(records)
            shipment = monitor.ship(step)
            assert shipment.report.mismatch is not None
            sink_total = sink_total + shipment.report.mismatch
        gauge_before = counter(exporter, "rl_staleness_train_step")
        live = mismatch_sums([0, 1, 1, 3, 70], [-1.0] * 5, [-1.0, -0.5, np.nan, -2.0, -1.0], masked=[0, 0, 0, 1, 1])
        monitor.record_mismatch(shipment.step, live)
        monitor.record_mismatch(shipment.step, live.to_dict())  # a second rank, as the small dict
    total = sink_total + live + live
    for row in MISMATCH_ROWS:
        field = getattr(total, row.mismatch_field or "")
        if row.dimension is None:
            assert counter(exporter, row.prometheus_name or "") == field, row.name
            continue
        got = [counter(exporter, row.prometheus_name or "", lag=v) for v in row.dimension.values]
        assert got == pytest.approx([float(x) for x in field], rel=1e-12, abs=0), row.name
    assert counter(exporter, "rl_staleness_mismatch_uncovered_tokens_total") == sink_total.uncovered + 2
    assert counter(exporter, "rl_staleness_train_step") == gauge_before == shipment.step  # gauges stay


@pytest.mark.integration
@requires_promtool
def test_promtool_check_metrics_is_clean_with_both_sources() -> None:
    exporter = PrometheusExporter(port=None)
    with StalenessMonitor(CONFIG, [exporter], run=RUN) as monitor:
        for records, step in ship_script(2):
            monitor.add(records)
            monitor.ship(step)
        monitor.record_mismatch(step, hand_sums())
        result = promtool_check_metrics(exporter.exposition())
    assert "rl_staleness_mismatch_kl_nats_total" in exporter.exposition().decode()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


def test_otlp_over_http_carries_the_live_sums_with_the_lag_attribute() -> None:
    with OtlpReceiver() as receiver:
        exporter = OtlpExporter(endpoint=receiver.endpoint)
        with StalenessMonitor(CONFIG, [exporter], run=RUN) as monitor:
            monitor.ship(1)  # nothing queued: an empty ship, so step 1 may receive sums
            monitor.record_mismatch(1, hand_sums())
        requests = receiver.wait_for(2)
    first, last = (metrics_by_name(r) for r in requests)
    assert "rl.staleness.mismatch.tokens" not in first  # no sums yet: no family
    tokens = last["rl.staleness.mismatch.tokens"]
    assert tokens.unit == "{token}" and tokens.sum.is_monotonic
    by_lag = {attributes_of(p)["lag"]: p.as_int for p in tokens.sum.data_points}
    assert list(by_lag) == list(LAG.values)  # decoded: "0".."16", "32", "64", "+Inf"
    assert by_lag["0"] == 4 and by_lag["1"] == 2 and by_lag["+Inf"] == 1 and by_lag["64"] == 0
    assert all(set(attributes_of(p)) == {"run", "lag"} for p in tokens.sum.data_points)
    kl = {attributes_of(p)["lag"]: p.as_double for p in last["rl.staleness.mismatch.kl"].sum.data_points}
    assert last["rl.staleness.mismatch.kl"].unit == "{nat}"
    assert (kl["0"], kl["1"], kl["+Inf"]) == (0.5, 0.75, 2.0)
    uncovered = last["rl.staleness.mismatch.uncovered_tokens"].sum.data_points
    assert [(attributes_of(p), p.as_int) for p in uncovered] == [({"run": RUN}, 3)]
    step = last["rl.staleness.train.step"].gauge.data_points
    assert [p.as_int for p in step] == [1]  # the last ship's gauges are re-sent unchanged


def test_otlp_meter_provider_path_adds_each_increment_once() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    exporter = OtlpExporter(meter_provider=provider)
    exporter.attach(ExportContext(run=RUN, env_breakdown=True))
    exporter.export(hand_made_report(1, mismatch=hand_sums()))
    exporter.export_mismatch(MismatchReport(1, sums=hand_sums() + hand_sums(), delta=hand_sums()))
    exporter.export(hand_made_report(2))  # no sums in this ship: the counters keep their totals
    assert exporter.flush(timeout=60)
    data = reader.get_metrics_data()
    assert data is not None
    metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    tokens = {p.attributes["lag"]: p.value for p in metrics["rl.staleness.mismatch.tokens"].data.data_points}
    assert (tokens["0"], tokens["1"], tokens["+Inf"], tokens["2"]) == (8, 4, 2, 0)
    ratio_sq = {p.attributes["lag"]: p.value for p in metrics["rl.staleness.mismatch.ratio_squared"].data.data_points}
    assert ratio_sq["+Inf"] == 2 * 0.00390625
    sampled = {p.attributes["length"]: p.value for p in metrics["rl.staleness.length.sampled_tokens"].data.data_points}
    assert sampled == {"256": 20, "1k": 600, "4k": 0, "16k": 0, "inf": 0}
    samples = metrics["rl.staleness.length.samples"].data.data_points
    assert [p.value for p in samples] == [6]
    exporter.close()
    provider.shutdown()


def test_jsonl_writes_a_row_per_live_report(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    exporter = JsonlExporter(path)
    with StalenessMonitor(COSTS, [exporter], run=RUN) as monitor:
        monitor.ship(1)
        monitor.record_mismatch(1, hand_sums())
        monitor.record_mismatch(1, hand_sums())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 1, 1]
    # The floor is lag 0's k3 (4 tokens >= floor_min_tokens 2): 0.5 / 4; lag 1 (k3 0.375) is the curve.
    spec14 = {
        "staleness/mismatch/floor": 0.125, "staleness/mismatch/floor_age": 0,
        "staleness/mismatch/floor_source": "lag0", "staleness/mismatch/budget": 0.125,
        "staleness/mismatch/curve/lag_1": 0.25, "staleness/bound/suggested": 0, "staleness/bound/crossed": 1,
        "staleness/bound/excess_at_bound": 0.25,
    }  # fmt: skip
    assert lines[1] == {"step": 1, **hand_sums().metrics(floor=0.125), **spec14}
    # The step's merged sums (they replace the step's entry in the window: the same means).
    assert lines[2] == {"step": 1, **(hand_sums() + hand_sums()).metrics(floor=0.125), **spec14}
    assert lines[2]["staleness/mismatch/lag_inf/tokens"] == 2
    assert lines[2]["staleness/mismatch/excess_k3"] == pytest.approx((0.75 + 2.0) / 3 - 0.5 / 4)


def test_console_shows_excess_k3_when_present_and_a_line_for_live_sums() -> None:
    report = hand_report(12, {"": [[3, 1, 0], [2]]}, masked={"": 1}, dropped={"": 2})
    bound = BoundTracker(COSTS).observe(12, hand_sums())
    with_cost = StepReport(**{**report.__dict__, "metrics": {**report.metrics, **mismatch_metrics(hand_sums(), bound)}})
    excess = (0.75 + 2.0) / 3 - 0.5 / 4
    spec14 = "floor 0.125 lag0 | at bound 0.25 | suggested 0 (budget crossed)"
    assert format_line(with_cost) == (
        f"step 12 | Max Staleness 3 | token mean 1.50 | masked 25.0% | dropped 2 rollouts | excess k3 {excess:.4g}"
        f" | {spec14}"
    )
    assert format_line(report).endswith("dropped 2 rollouts")  # no trainer log-probs: no column
    live = MismatchReport(7, sums=hand_sums(), delta=hand_sums(), bound=bound)
    assert format_mismatch_line(live) == (
        f"step 7 | mismatch k3 {3.25 / 7:.4g} | excess k3 {excess:.4g} | coverage 70.0% | {spec14}"
    )
    no_floor = MismatchReport(7, sums=hand_sums(), delta=hand_sums())
    assert format_mismatch_line(no_floor) == f"step 7 | mismatch k3 {3.25 / 7:.4g} | excess k3 - | coverage 70.0%"
    only_floor = mismatch_sums([0, 0], [-1.0, -1.0], [-1.0, -1.1])
    assert format_mismatch_line(MismatchReport(8, only_floor, only_floor)).split(" | ")[2] == "excess k3 -"
    stream = io.StringIO()
    with StalenessMonitor(CONFIG, [ConsoleExporter(stream)], run=RUN) as monitor:
        monitor.ship(1)
        monitor.record_mismatch(1, hand_sums())
    assert stream.getvalue().splitlines()[-1] == format_mismatch_line(MismatchReport(1, hand_sums(), hand_sums()))


class Broken:
    """A MismatchReport whose sums blow up when read: what a bug or a bad object would do."""

    step = 3

    @property
    def sums(self) -> Any:
        raise RuntimeError("corrupt sums")

    @property
    def delta(self) -> Any:
        raise RuntimeError("corrupt sums")


def test_no_exporter_raises_into_the_trainer(tmp_path: Path) -> None:
    errors = ExportErrors()
    context = ExportContext(run=RUN, errors=errors)
    prometheus = PrometheusExporter(port=None)
    jsonl = JsonlExporter(tmp_path / "m.jsonl")
    otlp = OtlpExporter(meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]))
    exporters: list[Any] = [prometheus, jsonl, otlp]
    for exporter in exporters:
        exporter.attach(context)
        exporter.export_mismatch(Broken())  # type: ignore[arg-type]  # returns; counted
    assert {name: errors.count(name) for name in ("prometheus", "jsonl", "otlp")} == {
        "prometheus": 1,
        "jsonl": 1,
        "otlp": 1,
    }
    for exporter in exporters:
        exporter.close()


def test_background_exporter_forwards_live_sums_to_a_mismatch_aware_exporter(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    wrapped = BackgroundExporter(JsonlExporter(path))
    console_only = BackgroundExporter(_ShipsOnly())
    with StalenessMonitor(CONFIG, [wrapped, console_only], run=RUN) as monitor:
        monitor.ship(1)
        monitor.record_mismatch(1, hand_sums())
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1]
    assert monitor.export_errors.count(console_only.name) == 0  # not mismatch-aware: skipped, not failed


class _ShipsOnly:
    name = "ships-only"

    def __init__(self) -> None:
        self.reports: list[StepReport] = []

    def export(self, report: StepReport) -> None:
        self.reports.append(report)

    def close(self) -> None:
        pass


def test_lag_buckets_of_the_table_are_the_cores() -> None:
    assert LAG.buckets == LAG_BUCKETS
    assert LAG.values[-1] == "+Inf" and LAG.buckets[-1] == "inf"


@settings(max_examples=40, deadline=None)
@given(
    lags=st.lists(st.integers(0, 100), min_size=1, max_size=60),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_counters_of_two_processes_add_up_to_those_of_the_whole(
    lags: list[int], seed: int, data: st.DataObject
) -> None:
    """Positions split at random between two processes (runs): the exposed counters summed over the runs are
    the whole's (the PromQL over them is checked against a real Prometheus in test_mismatch_prometheus)."""
    rng = np.random.default_rng(seed)
    n = len(lags)
    sampler = -rng.random(n) * 4
    trainer = sampler + rng.normal(0, 0.3, n) * np.asarray(lags) / 50
    trainer[rng.random(n) < 0.1] = np.nan
    masked = np.asarray(lags) > 8
    side = np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    exporters = []
    for run, part in (("a", ~side), ("b", side)):
        exporter = PrometheusExporter(port=None)
        exporter.attach(ExportContext(run=run))
        exporter.export(hand_made_report(1))
        sums = mismatch_sums(np.asarray(lags)[part], sampler[part], trainer[part], masked=masked[part])
        exporter.export_mismatch(MismatchReport(1, sums=sums, delta=sums))
        exporters.append((run, exporter))
    whole = mismatch_sums(lags, sampler, trainer, masked=masked)
    for row in MISMATCH_ROWS:
        values = row.dimension.values if row.dimension is not None else ("",)
        for i, value in enumerate(values):
            labels = {row.dimension.label: value} if row.dimension is not None else {}
            got = sum(
                e.registry.get_sample_value(row.prometheus_name or "", {"run": r, "env": "", **labels}) or 0.0
                for r, e in exporters
            )
            field = getattr(whole, row.mismatch_field or "")
            want = float(field[i] if row.dimension is not None else field)
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (row.name, value)


def _per_env_monitor(exporters: list[Any]) -> StalenessMonitor:
    """Step 2 shipped (no trainer log-probs in the records), then sums recorded per env and without one:
    math lags 0, 1, 1 (one uncovered), code lag 2, and a lag-1 position of no env."""
    monitor = StalenessMonitor(dataclasses.replace(CONFIG, env_breakdown=True), exporters, run=RUN)
    monitor.add([
        {"id": "m", "env": "math", "dispatch_version": 1, "samples": [{"mask": [1], "token_versions": [1]}]},
        {"id": "c", "env": "code", "dispatch_version": 1, "samples": [{"mask": [1], "token_versions": [1]}]},
    ])  # fmt: skip
    monitor.ship(2)
    monitor.record_mismatch(2, mismatch_sums([0, 1, 1, 1], [-1.0] * 4, [-1.0, -1.5, -0.5, np.nan]), env="math")
    monitor.record_mismatch(2, mismatch_sums([2], [-1.0], [-2.0]), env="code")
    monitor.record_mismatch(2, mismatch_sums([1], [-1.0], [-1.0]))
    return monitor


# (env, lag) -> tokens: env "" is the batch (every call), each env only the sums recorded for it.
PER_ENV_TOKENS = {("", "0"): 1, ("", "1"): 3, ("", "2"): 1, ("code", "2"): 1, ("math", "0"): 1, ("math", "1"): 2}


def test_sums_recorded_per_env_get_their_own_counter_series_beside_the_batch_wide_one() -> None:
    """Issue 22 item 6 (SPEC 11 with the env breakdown): an ``env`` label on the mismatch counters, the
    batch-wide series (env="") carrying every call's sums."""
    exporter = PrometheusExporter(port=None)
    _per_env_monitor([exporter]).close()
    text = exporter.exposition().decode()
    tokens = "rl_staleness_mismatch_tokens_total"
    nonzero = [line for line in family_text(text, tokens).splitlines()[2:] if not line.endswith(" 0.0")]
    assert nonzero == [
        f'{tokens}{{env="{env}",lag="{lag}",run="{RUN}"}} {float(n)}' for (env, lag), n in PER_ENV_TOKENS.items()
    ]
    uncovered = "rl_staleness_mismatch_uncovered_tokens_total"
    assert family_text(text, uncovered).splitlines()[2:] == [
        f'{uncovered}{{env="",run="{RUN}"}} 1.0',
        f'{uncovered}{{env="code",run="{RUN}"}} 0.0',
        f'{uncovered}{{env="math",run="{RUN}"}} 1.0',
    ]
    # every lag bucket of each series is there (a rate over it never starts from a missing series)
    assert len(family_text(text, tokens).splitlines()[2:]) == 3 * len(LAG.values)


def test_otlp_sends_the_per_env_mismatch_points_beside_the_batch_wide_ones() -> None:
    with OtlpReceiver() as receiver:  # the owned pipeline, over the wire
        _per_env_monitor([OtlpExporter(endpoint=receiver.endpoint)]).close()
        requests = receiver.wait_for(4)  # the ship and the three calls
    metric = metrics_by_name(requests[-1])["rl.staleness.mismatch.tokens"]
    sent = [(attributes_of(p), p.as_int) for p in metric.sum.data_points]
    assert {(a.get("env", ""), a["lag"]): n for a, n in sent if n} == PER_ENV_TOKENS
    assert all(a["run"] == RUN for a, _ in sent)

    reader = InMemoryMetricReader()  # an injected provider: its instruments add each call's increments
    provider = MeterProvider(metric_readers=[reader])
    exporter = OtlpExporter(meter_provider=provider)
    monitor = _per_env_monitor([exporter])
    assert exporter.flush(timeout=60)
    data = reader.get_metrics_data()
    assert data is not None
    [recorded] = [
        m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        if m.name == "rl.staleness.mismatch.tokens"
    ]  # fmt: skip
    points = {(p.attributes.get("env", ""), p.attributes["lag"]): p.value for p in recorded.data.data_points}
    assert {key: n for key, n in points.items() if n} == PER_ENV_TOKENS
    monitor.close()
    provider.shutdown()


def test_records_with_trainer_logprobs_give_each_env_its_counter_series() -> None:
    """From records (the sink path), each named env's SPEC 11 sums feed its series; env="" stays the batch."""
    exporter = PrometheusExporter(port=None)
    batch, per_env = MismatchSums.zero(), dict[str, MismatchSums]()
    with StalenessMonitor(CONFIG, [exporter], run=RUN) as monitor:
        for records, step in ship_script(3):
            monitor.add(records)
            report = monitor.ship(step).report
            assert report.mismatch is not None
            batch = batch + report.mismatch
            for env, sums in report.env_mismatch.items():
                per_env[env] = per_env.get(env, MismatchSums.zero()) + sums
    assert set(per_env) == {"math", "code"}
    for env, sums in {"": batch, **per_env}.items():
        got = [counter(exporter, "rl_staleness_mismatch_tokens_total", env=env, lag=v) for v in LAG.values]
        assert got == [float(n) for n in sums.tokens], env
        assert counter(exporter, "rl_staleness_mismatch_uncovered_tokens_total", env=env) == sums.uncovered, env
