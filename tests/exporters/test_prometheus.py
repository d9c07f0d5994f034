"""Prometheus exporter: exposition values, promtool, ASGI, port conflicts, Pushgateway, real scrapes."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.config import StalenessConfig
from staleness_metrics.errors import ConfigError
from staleness_metrics.exporters.base import ExportContext, ExportErrors
from staleness_metrics.exporters.prometheus import PrometheusExporter, PrometheusPushExporter
from staleness_metrics.metrics.buckets import BUCKETS
from staleness_metrics.metrics.metric_table import (
    BATCH_WIDE_COUNTERS,
    METRICS,
    MetricKind,
    Source,
    metric_by_prometheus_name,
)
from staleness_metrics.metrics.report import StepReport, Tally
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import (
    CONFIG,
    FAR_CONFIG,
    FAR_SHIPS,
    far_records,
    far_staleness,
    hand_report,
    nearest_rank,
    ship_script,
)
from tests.support.prometheus import (
    PrometheusServer,
    PushgatewayServer,
    promtool_check_metrics,
    requires_prometheus,
    requires_promtool,
    requires_pushgateway,
)

RUN = "exp-1"
GAUGE_ROWS = [m for m in METRICS if m.kind is MetricKind.GAUGE and m.prometheus_name is not None]
COUNTER_ROWS = [m for m in METRICS if m.kind is MetricKind.COUNTER and m.source is Source.TALLY]


def exporter(env_breakdown: bool = True, **options: object) -> PrometheusExporter:
    exp = PrometheusExporter(port=None, **options)  # type: ignore[arg-type]
    exp.attach(ExportContext(run=RUN, env_breakdown=env_breakdown))
    return exp


def sample(exp: PrometheusExporter, name: str, **labels: str) -> float | None:
    return exp.registry.get_sample_value(name, {"run": RUN, **labels})


def expected_gauge(row_name: str, report: StepReport, env: str = "") -> float | None:
    row = next(m for m in METRICS if m.name == row_name)
    if row.source is Source.STEP:
        return float(report.step)
    if row.source is Source.TALLY:
        tally = report.tally if not env else report.env_tally[env]
        return float(getattr(tally, row.tally_field or ""))
    metrics = report.metrics if not env else report.env_metrics[env]
    assert row.wandb_key is not None
    return float(metrics[row.wandb_key]) if row.wandb_key in metrics else None


def test_gauges_counters_and_histograms_equal_the_report() -> None:
    exp = exporter()
    first = hand_report(1, {"": [[0, 1, 1]], "math": [[2, 2], [0]]}, masked={"math": 1}, dropped={"code": 2})
    second = hand_report(2, {"": [[3, 3, 40]], "code": [[1]]}, dropped={"": 1})
    exp.export(first)
    exp.export(second)

    for row in GAUGE_ROWS:
        assert sample(exp, row.prometheus_name or "", **({"env": ""} if "env" in row.labels else {})) == (
            expected_gauge(row.name, second)
        ), row.name
    # named envs get their own gauge series; "math" shipped nothing at step 2, so it has none now
    assert sample(exp, "rl_staleness_token_mean_steps", env="code") == 1.0
    assert sample(exp, "rl_staleness_token_mean_steps", env="math") is None

    total = first.tally + second.tally
    for row in COUNTER_ROWS:
        if row.name in BATCH_WIDE_COUNTERS:  # env="" is the whole batch (test_length_counters_...)
            assert sample(exp, row.prometheus_name or "", env="") == getattr(total, row.tally_field or ""), row.name
            continue
        values = [
            sample(exp, row.prometheus_name or "", env=env) or 0.0 for env in ("", "math", "code")
        ]  # counters partition rollouts by env; the sum is the run's total
        assert sum(values) == getattr(total, row.tally_field or ""), row.name
    assert sample(exp, "rl_staleness_rollouts_dropped_total", env="code") == 2
    assert sample(exp, "rl_staleness_rollouts_dropped_total", env="") == 1

    # histogram buckets are the core's counts, cumulative over le, exactly
    token_counts = np.zeros(65, dtype=np.int64)
    for report in (first, second):
        hist = report.env_tally[""].token_histogram
        token_counts[: len(hist)] += hist
    for bound in BUCKETS:
        le = f"{bound:.1f}"
        expected = int(token_counts[: int(bound) + 1].sum())
        assert sample(exp, "rl_staleness_token_steps_bucket", env="", le=le) == expected, le
    assert sample(exp, "rl_staleness_token_steps_bucket", env="", le="+Inf") == 6
    assert sample(exp, "rl_staleness_token_steps_count", env="") == 6
    assert sample(exp, "rl_staleness_token_steps_sum", env="") == 0 + 1 + 1 + 3 + 3 + 40
    assert sample(exp, "rl_staleness_token_steps_bucket", env="", le="32.0") == 5  # 40 is above 32


def test_without_env_breakdown_every_series_covers_the_whole_run() -> None:
    exp = exporter(env_breakdown=False)
    report = hand_report(3, {"": [[0, 1]], "math": [[2, 2, 2]]}, masked={"math": 2})
    exp.export(report)
    families = {f.name: f for f in text_string_to_metric_families(exp.exposition().decode())}
    for family in families.values():
        assert {s.labels.get("env", "") for s in family.samples} <= {""}, family.name
    assert sample(exp, "rl_staleness_tokens_sampled_total", env="") == 5
    assert sample(exp, "rl_staleness_tokens_masked_total", env="") == 2
    assert sample(exp, "rl_staleness_token_mean_steps", env="") == report.metrics["staleness/token/mean"]


def _length_lines(exp: PrometheusExporter) -> list[str]:
    return [line for line in exp.exposition().decode().splitlines() if line.startswith("rl_staleness_length_")]


def test_length_counters_have_a_batch_wide_series_beside_the_per_env_ones() -> None:
    """SPEC 12 with the env breakdown: env="" is the whole batch, as for the gauges and the mismatch family (a
    query over every env selects it instead of summing the envs); each named env has its own series."""
    exp = PrometheusExporter(port=None)
    monitor = StalenessMonitor(StalenessConfig(max_staleness=0, env_breakdown=True), [exp], run=RUN)
    monitor.add([
        # lag 1 at step 2 (T = 1): masked by the bound 0; 3 and 2 sampled positions removed
        {"id": "a", "env": "math", "dispatch_version": 0,
         "samples": [{"mask": [1, 1, 1], "token_versions": [0, 0, 0]}]},
        {"id": "c", "dispatch_version": 0, "samples": [{"mask": [1, 1], "token_versions": [0, 0]}]},
        # lag 0: kept; 4 sampled positions after a prompt position
        {"id": "b", "env": "code", "dispatch_version": 1,
         "samples": [{"mask": [0, 1, 1, 1, 1], "token_versions": [-1, 1, 1, 1, 1]}]},
    ])  # fmt: skip
    monitor.ship(2)
    monitor.close()
    zero = ("4k", "16k", "inf")

    def family(name: str, per_env: dict[str, dict[str, int]]) -> list[str]:
        return [
            f'rl_staleness_length_{name}_total{{env="{env}",length="{bucket}",run="{RUN}"}} {float(value)}'
            for env, by_bucket in per_env.items()
            for bucket, value in {**by_bucket, **dict.fromkeys(zero, 0)}.items()
        ]

    assert _length_lines(exp) == [
        f'rl_staleness_length_samples_total{{env="",run="{RUN}"}} 3.0',
        f'rl_staleness_length_samples_total{{env="code",run="{RUN}"}} 1.0',
        f'rl_staleness_length_samples_total{{env="math",run="{RUN}"}} 1.0',
        *family("sampled_tokens", {"": {"256": 9, "1k": 0}, "code": {"256": 4, "1k": 0}, "math": {"256": 3, "1k": 0}}),
        *family("removed_tokens", {"": {"256": 5, "1k": 0}, "code": {"256": 0, "1k": 0}, "math": {"256": 3, "1k": 0}}),
    ]
    # Without a named env, env="" already is the whole batch: one series, as before.
    plain = PrometheusExporter(port=None)
    monitor = StalenessMonitor(StalenessConfig(max_staleness=0, env_breakdown=True), [plain], run=RUN)
    monitor.add([{"id": "c", "dispatch_version": 0, "samples": [{"mask": [1, 1], "token_versions": [0, 0]}]}])
    monitor.ship(2)
    monitor.close()
    assert _length_lines(plain)[:2] == [
        f'rl_staleness_length_samples_total{{env="",run="{RUN}"}} 1.0',
        f'rl_staleness_length_sampled_tokens_total{{env="",length="256",run="{RUN}"}} 2.0',
    ]


def test_a_gauge_of_an_empty_population_is_not_exposed() -> None:
    exp = exporter()
    exp.export(hand_report(4, {"": [[1, 2]]}))
    assert sample(exp, "rl_staleness_rollout_max_steps", env="") == 2
    exp.export(hand_report(5, {}, dropped={"": 1}))  # nothing shipped: only drops
    assert sample(exp, "rl_staleness_rollout_max_steps", env="") is None
    assert sample(exp, "rl_staleness_token_mean_steps", env="") is None
    assert sample(exp, "rl_staleness_train_step") == 5
    assert sample(exp, "rl_staleness_rollouts_dropped_total", env="") == 1
    assert sample(exp, "rl_staleness_tokens_sampled_total", env="") == 2


def test_every_series_has_the_run_label_and_every_family_is_in_the_table() -> None:
    exp = exporter()
    with StalenessMonitor(CONFIG, [exp], run=RUN) as monitor:
        for records, step in ship_script(3):
            monitor.add(records)
            monitor.ship(step)
        families = list(text_string_to_metric_families(exp.exposition().decode()))
    # SPEC 14's gauges need SPEC 11 sums, which this script has none of (tests/exporters/test_bound_exporters.py).
    published = {m.prometheus_name for m in METRICS if m.prometheus_name is not None and m.source is not Source.BOUND}
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert exposed == published
    for family in families:
        row = metric_by_prometheus_name(family.name + ("_total" if family.type == "counter" else ""))
        assert family.type == row.kind.value
        assert family.documentation == row.description
        for s in family.samples:
            assert s.labels["run"] == RUN
            assert set(s.labels) - {"le"} == set(row.labels), (family.name, s.labels)
    assert not any(s.name.endswith("_created") for f in families for s in f.samples)


@pytest.mark.integration
@requires_promtool
def test_promtool_check_metrics_is_clean() -> None:
    exp = exporter()
    with StalenessMonitor(CONFIG, [exp], run=RUN) as monitor:
        for records, step in ship_script(3):
            monitor.add(records)
            monitor.ship(step)
        monitor.export_errors.record("otlp", "pretend failure")  # the errors family too
        result = promtool_check_metrics(exp.exposition())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


def test_asgi_app_mounted_in_fastapi_serves_the_same_exposition() -> None:
    exp = exporter()
    exp.export(hand_report(6, {"": [[1, 1, 2]]}))
    app = FastAPI()
    app.mount("/metrics", exp.asgi_app())
    with TestClient(app) as client:
        response = client.get("/metrics/")
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert families["rl_staleness_train_step"].samples[0].value == 6
    assert families["rl_staleness_tokens_sampled"].samples[0].value == 3


def test_http_server_binds_loopback_and_serves() -> None:
    exp = PrometheusExporter(port=0)
    try:
        exp.attach(ExportContext(run=RUN))
        exp.export(hand_report(7, {"": [[0, 3]]}))
        assert exp.url is not None and exp.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(exp.url, timeout=10) as response:
            text = response.read().decode()
        assert f'rl_staleness_train_step{{run="{RUN}"}} 7.0' in text
    finally:
        exp.close()
    assert exp.url is None


def test_close_in_a_forked_child_returns_and_the_parent_still_serves() -> None:
    """A child forked while the server runs (a DataLoader worker) has its socket, not its serving thread."""
    exp = PrometheusExporter(port=0)
    try:
        exp.export(hand_report(7, {"": [[0, 3]]}))
        pid = os.fork()
        if pid == 0:  # the child: close() on a daemon thread, so that a hang cannot keep it alive
            try:
                closing = threading.Thread(target=exp.close, daemon=True)
                closing.start()
                closing.join(60)
            finally:
                os._exit(1 if closing.is_alive() else 0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert exp.url is not None
        with urllib.request.urlopen(exp.url, timeout=10) as response:
            assert response.status == 200
    finally:
        exp.close()


def test_port_already_taken_is_counted_not_raised_and_binding_is_retried() -> None:
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    errors = ExportErrors()
    exp = PrometheusExporter(port=port, bind_retry_interval=0.0)  # constructing it does not raise
    try:
        exp.attach(ExportContext(run=RUN, errors=errors))
        assert exp.url is None
        assert errors.count("prometheus") == 1  # the failure at construction survives the attach
        exp.export(hand_report(8, {"": [[1]]}))  # neither does exporting; it tries to bind again
        assert errors.count("prometheus") >= 1
        assert sample(exp, "rl_staleness_train_step") == 8  # still serves through its registry
        assert sample(exp, "rl_staleness_export_errors_total", exporter="prometheus") == errors.count("prometheus")
        blocker.close()
        exp.export(hand_report(9, {"": [[1]]}))  # the port is free now: bound on this export
        assert exp.port == port
        with urllib.request.urlopen(exp.url or "", timeout=10) as response:
            assert f'rl_staleness_train_step{{run="{RUN}"}} 9.0' in response.read().decode()
    finally:
        blocker.close()
        exp.close()


@pytest.mark.parametrize("port", [70000, 65536, -1, "0", True, 1.5])
def test_an_impossible_port_is_refused_at_construction_naming_port(port: object) -> None:
    """Not a raw OverflowError from bind(), nor a bind failure retried forever with /metrics never served."""
    registry = CollectorRegistry()
    with pytest.raises(ConfigError) as caught:
        PrometheusExporter(port=port, registry=registry)  # type: ignore[arg-type]
    assert caught.value.field == "port"
    assert "0..65535" in str(caught.value) or "expected an integer" in str(caught.value)
    assert list(registry.collect()) == []  # nothing registered by the refused exporter


def test_port_65535_and_none_are_accepted() -> None:
    for port in (None, 65535):
        PrometheusExporter(port=port, bind_retry_interval=3600).close()  # (65535 may be taken: counted)


def test_close_takes_the_collector_out_of_the_callers_registry_so_a_rerun_can_register() -> None:
    """A sweep (or a re-run notebook cell) exposing the metrics through prometheus_client's REGISTRY."""
    exporters: list[PrometheusExporter | PrometheusPushExporter] = []
    try:
        for trial in ("trial0", "trial1"):
            exp = PrometheusExporter(port=None, registry=REGISTRY)  # trial1: no DuplicateTimeseries
            exporters.append(exp)
            with StalenessMonitor(StalenessConfig(max_staleness=2), [exp], run=trial) as monitor:
                monitor.add({"id": "a", "dispatch_version": 0, "samples": [{"mask": [1]}]})
                monitor.ship(1)
                assert REGISTRY.get_sample_value("rl_staleness_train_step", {"run": trial}) == 1
            # closed: no old value left looking current
            assert REGISTRY.get_sample_value("rl_staleness_train_step", {"run": trial}) is None
        exporters[-1].close()  # closing twice is harmless
        exporters.append(push := PrometheusPushExporter("127.0.0.1:9", registry=REGISTRY, delete_on_close=False))
        push.close()  # the push exporter leaves the registry too
        exporters.append(again := PrometheusExporter(port=None, registry=REGISTRY))
        again.close()
    finally:
        for exp in exporters:
            with contextlib.suppress(KeyError):
                REGISTRY.unregister(exp)


def test_without_prometheus_client_the_exporters_name_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import staleness_metrics.exporters as exporters

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # not installed
    monkeypatch.delitem(sys.modules, "staleness_metrics.exporters.prometheus")  # imported afresh
    for name in ("PrometheusExporter", "PrometheusPushExporter"):
        with pytest.raises(ImportError) as caught:
            getattr(exporters, name)  # (what `from staleness_metrics.exporters import ...` runs)
        needs = f"{name} needs prometheus_client: pip install 'staleness-metrics[prometheus]'"
        assert (str(caught.value), caught.value.name) == (needs, "prometheus_client")


def test_concurrent_scrapes_never_mix_two_ships() -> None:
    """Every value of a ship encodes its step; each scrape must be one step's values throughout."""
    exp = PrometheusExporter(port=0)
    exp.attach(ExportContext(run=RUN))
    ships = 400
    done = threading.Event()
    problems: list[str] = []
    scrapes = [0]

    def report_of(step: int) -> StepReport:
        metrics = {
            "staleness/token/mean": step + 0.5,
            "staleness/token/masked": step / (ships + 1),
            "staleness/rollout/mean": step + 0.25,
            "staleness/rollout/max": step,
            "staleness/rollout/in_flight/mean": step + 0.125,
            "staleness/rollout/in_flight/max": step,
            "staleness/rollout/in_queue/mean": step + 0.0625,
            "staleness/rollout/in_queue/max": step,
            "staleness/rollout/dropped": 1,
            "staleness/sample/dropped": 1,
            "staleness/rollout/held": step,
            "staleness/max_staleness": step,
        }
        hist = np.zeros(3, dtype=np.int64)
        hist[step % 3] = 1
        tally = Tally(tokens_sampled=1, rollouts_dropped=1, rollouts_held=step, token_histogram=hist)
        return StepReport(step, step, metrics, tally)

    def check(text: str) -> None:
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + ("" if "le" not in s.labels else f"[{s.labels['le']}]")
                values[key] = s.value
        if "rl_staleness_train_step" not in values:
            return  # before the first ship
        step = int(values["rl_staleness_train_step"])
        expected = {
            "rl_staleness_max_staleness": step,
            "rl_staleness_token_mean_steps": step + 0.5,
            "rl_staleness_token_masked_ratio": step / (ships + 1),
            "rl_staleness_rollout_mean_steps": step + 0.25,
            "rl_staleness_rollout_max_steps": step,
            "rl_staleness_rollout_in_flight_mean_steps": step + 0.125,
            "rl_staleness_rollout_in_queue_max_steps": step,
            "rl_staleness_rollouts_held": step,
            "rl_staleness_tokens_sampled_total": step,  # one token per ship, cumulative
            "rl_staleness_rollouts_dropped_total": step,
            "rl_staleness_token_steps_count": step,
            "rl_staleness_token_steps_bucket[0.0]": (step) // 3,
        }
        for name, value in expected.items():
            if values.get(name) != value:
                problems.append(f"step {step}: {name} = {values.get(name)}, expected {value}")

    scraped = threading.Condition()

    def scraper() -> None:
        assert exp.url is not None
        try:
            while not done.is_set():
                with urllib.request.urlopen(exp.url, timeout=30) as response:
                    check(response.read().decode())
                with scraped:
                    scrapes[0] += 1
                    scraped.notify_all()
        except Exception as exc:  # a failed scrape fails the test (a dead thread alone would not)
            problems.append(f"scrape failed: {exc!r}")

    threads = [threading.Thread(target=scraper) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for step in range(1, ships + 1):
            exp.export(report_of(step))
            if step % 20 == 0:  # make sure scrapes happen all along the ships, not only before or after
                with scraped:
                    seen = scrapes[0]
                    # the timeout only turns dead scrapers into a failure instead of a hang
                    assert scraped.wait_for(lambda seen=seen: scrapes[0] >= seen + 2, timeout=120), problems[:5]
    finally:
        done.set()
        for t in threads:
            t.join()
        exp.close()
    assert not problems, problems[:5]
    assert scrapes[0] >= 2 * ships // 20


@pytest.mark.integration
@requires_prometheus
def test_real_prometheus_scrape_returns_the_metrics_dict_of_the_same_step(tmp_path: Path) -> None:
    exp = PrometheusExporter(port=0)
    monitor = StalenessMonitor(CONFIG, [exp], run=RUN)
    token_total = np.zeros(0, dtype=np.int64)
    totals = Tally()
    try:
        assert exp.port is not None
        with PrometheusServer(tmp_path, [f"127.0.0.1:{exp.port}"]) as prom:
            for records, step in ship_script(3, seed=11):
                monitor.add(records)
                shipment = monitor.ship(step)
                report = shipment.report
                totals = totals + report.tally
                token_total = (Tally(token_histogram=token_total) + report.tally).token_histogram
                prom.wait_until(lambda s=step: prom.query_value(f'rl_staleness_train_step{{run="{RUN}"}}') == s)

                # gauges: the whole batch (env="") and each named env, exactly as in the metrics dict
                for row in GAUGE_ROWS:
                    if row.source is not Source.METRIC:
                        continue
                    assert row.wandb_key is not None
                    selector = f'{row.prometheus_name}{{run="{RUN}"}}'
                    got = prom.query_values(selector, by="env")
                    want = {"": shipment.metrics.get(row.wandb_key)}
                    if "env" in row.labels:
                        for env in ("math", "code"):
                            key = f"staleness/env/{env}/{row.wandb_key.removeprefix('staleness/')}"
                            want[env] = shipment.metrics.get(key)
                    assert got == {e: float(v) for e, v in want.items() if v is not None}, row.name
                assert (
                    prom.query_value(f'rl_staleness_rollouts_held{{run="{RUN}",env=""}}')
                    == (shipment.metrics["staleness/rollout/held"])
                )

                # counters: cumulative over the run; summed over env they are the totals (the length
                # counters' batch-wide env="" series is the total itself)
                for row in COUNTER_ROWS:
                    env = ',env=""' if row.name in BATCH_WIDE_COUNTERS else ""
                    got_total = prom.query_value(f'sum(({row.prometheus_name}{{run="{RUN}"{env}}}))')
                    assert got_total == getattr(totals, row.tally_field or ""), row.name

                # histogram quantiles: PromQL interpolates inside a 1-wide bucket, so ceil() = nearest rank
                tokens = np.repeat(np.arange(len(token_total)), token_total).tolist()
                for p, key in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
                    buckets = f'rl_staleness_token_steps_bucket{{run="{RUN}"}}'
                    q = prom.query_value(f"histogram_quantile({p}, sum by (le) ({buckets}))")
                    assert q is not None and math.ceil(q) == nearest_rank(tokens, p), (step, p)
                    if step == 8:  # one ship so far: the cumulative histogram is this step's
                        assert math.ceil(q) == shipment.metrics[f"staleness/token/{key}"]
            assert prom.targets_up()
    finally:
        monitor.close()


@pytest.mark.integration
@requires_prometheus
def test_real_prometheus_histogram_sums_are_the_exact_staleness_from_4096_up(tmp_path: Path) -> None:
    """The histograms' last bucket folds every staleness from 4096 up; their ``_sum`` does not: the
    fleet-wide mean of docs/service.md (``_sum`` over ``_count``) is the metrics dict's, per env too."""
    exp = PrometheusExporter(port=0)
    monitor = StalenessMonitor(FAR_CONFIG, [exp], run=RUN)
    try:
        assert exp.port is not None
        with PrometheusServer(tmp_path, [f"127.0.0.1:{exp.port}"]) as prom:
            for ship, (step, _) in enumerate(FAR_SHIPS):
                monitor.add(far_records(ship))
                shipment = monitor.ship(step)
                prom.wait_until(lambda s=step: prom.query_value(f'rl_staleness_train_step{{run="{RUN}"}}') == s)
                if ship == 0:  # one ship so far: the run's mean is this ship's
                    total, count = (f'sum(rl_staleness_token_steps_{part}{{run="{RUN}"}})' for part in ("sum", "count"))
                    mean = prom.query_value(f"{total} / {count}")
                    assert mean == shipment.metrics["staleness/token/mean"] == np.mean(far_staleness(1)[0])
                for name, of in (("rl_staleness_token_steps_sum", 0), ("rl_staleness_rollout_steps_sum", 1)):
                    got = prom.query_values(f'{name}{{run="{RUN}"}}', by="env")
                    assert got == {env: sum(far_staleness(ship + 1, env)[of]) for env in ("far", "near")}, name
    finally:
        monitor.close()


@pytest.mark.integration
@requires_pushgateway
def test_pushgateway_receives_pushes_survives_an_outage_and_deletes_its_group(tmp_path: Path) -> None:
    gateway = PushgatewayServer(tmp_path / "gw")  # not started yet: the first pushes fail
    errors = ExportErrors()
    exp = PrometheusPushExporter(gateway.address, job="trainer", retry_initial=0.05, retry_max=0.2)
    exp.attach(ExportContext(run=RUN, errors=errors))
    try:
        exp.export(hand_report(1, {"": [[1, 2]]}))
        exp.export(hand_report(2, {"": [[0]]}))  # returns at once although nothing listens
        deadline = time.monotonic() + 60  # a hang guard, not a speed check
        while errors.count("pushgateway") == 0:  # the failed attempt is counted, and the push kept
            assert time.monotonic() < deadline, "no failed push was counted while the gateway was down"
            time.sleep(0.02)
        gateway.start()
        assert exp.flush(timeout=60)
        families = {f.name: f for f in text_string_to_metric_families(gateway.metrics_text())}
        step = [s for s in families["rl_staleness_train_step"].samples if s.labels.get("run") == RUN]
        assert [s.value for s in step] == [2.0]
        assert step[0].labels["job"] == "trainer"
        tokens = families["rl_staleness_tokens_sampled"].samples
        assert [s.value for s in tokens if s.labels.get("run") == RUN] == [3.0]  # nothing lost
    finally:
        exp.close()
        if gateway._process is not None:
            # close() deleted the group; the Pushgateway answers a DELETE with 202 and applies it a moment
            # later, so wait for it (a hang guard, not a speed check).
            deadline = time.monotonic() + 60
            while "rl_staleness_train_step" in (remaining := gateway.metrics_text()):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            gateway.stop()
            assert "rl_staleness_train_step" not in remaining, "close() did not delete the group"


class HoldingProxy:
    """Forwards requests to a Pushgateway; holds each push (PUT) in flight for ``hold`` seconds, or until a
    DELETE went through; ``forwarded`` lists the methods in the order the gateway answered them."""

    def __init__(self, gateway: str, hold: float) -> None:
        self.holding, deleted = threading.Event(), threading.Event()
        self.forwarded: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "PUT":
                    proxy.holding.set()
                    deleted.wait(hold)
                headers = {"Content-Type": self.headers.get("Content-Type", "")}
                request = urllib.request.Request(
                    f"http://{gateway}{self.path}", body or None, headers, method=self.command
                )
                with urllib.request.urlopen(request, timeout=60) as response:
                    status, answer = response.status, response.read()
                proxy.forwarded.append(self.command)
                if self.command == "DELETE":
                    deleted.set()
                self.send_response(status)
                self.end_headers()
                self.wfile.write(answer)

            do_PUT = do_DELETE = _forward

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.integration
@requires_pushgateway
def test_close_deletes_the_group_only_after_a_push_still_in_flight_landed(tmp_path: Path) -> None:
    """A slow push outlives close(): the DELETE goes after it, so the push cannot re-create the group."""
    gateway = PushgatewayServer(tmp_path / "gw").start()
    proxy = HoldingProxy(gateway.address, hold=1.0)  # a DELETE sent at close would pass the held push
    exp = PrometheusPushExporter(proxy.address, job="trainer", timeout=60)
    exp.attach(ExportContext(run=RUN))
    try:
        exp.export(hand_report(1, {"": [[1, 2]]}))
        assert proxy.holding.wait(60)  # the push is in flight
        exp.close(timeout=0.1)  # returns while it is
        deadline = time.monotonic() + 60  # a hang guard, not a speed check
        while len(proxy.forwarded) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.forwarded == ["PUT", "DELETE"]
        while "rl_staleness_train_step" in gateway.metrics_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the Pushgateway applies a DELETE a moment after answering it
        assert "rl_staleness_train_step" not in gateway.metrics_text()
    finally:
        proxy.server.shutdown()
        gateway.stop()
