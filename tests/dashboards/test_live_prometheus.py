"""The dashboards and rules against the real thing: the Prometheus exporter on loopback, scraped by a real
Prometheus 2.42 with the generated rules loaded, of a fully asynchronous run (no lag-0 token after step 1,
as the README's demo). Every panel query, with its variables filled in as Grafana would, must return data;
the numbers on the stat panels and the excess over SPEC 14's floor must be the core's (the JSONL rows)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.dashboards.rules import rule_groups
from staleness_metrics.exporters.base import ExportContext
from staleness_metrics.exporters.jsonl import JsonlExporter
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.metrics.metric_table import LAG
from staleness_metrics.metrics.report import StepReport
from tests.support.prometheus import PrometheusServer, RulesPrometheusServer, requires_prometheus

from .grafana_queries import dashboards, fill, label_values_query, metric_names, panels, targets
from .traffic import FLOOR_MAX_AGE, MAX_STALENESS, Traffic

JOB = "rl-trainer"
RUN = "e2e-run"
RATE_INTERVAL = "6s"  # what Grafana's $__rate_interval is at a 1 s scrape interval and a short range
SHIP_EVERY = 0.25  # seconds between ships of the simulated trainer

pytestmark = [pytest.mark.integration, requires_prometheus]


@dataclass
class Live:
    prometheus: PrometheusServer
    exporter: PrometheusExporter
    traffic: Traffic
    values: dict[str, str]  # Grafana variables as a user picking this run would have them
    jsonl: JsonlExporter  # the same ships' rows, as --metrics-out writes them
    last: StepReport | None = None

    def rows(self) -> dict[int, dict[str, Any]]:
        """The JSONL rows written so far, by step."""
        assert self.jsonl.flush(timeout=60)
        return {row["step"]: row for row in map(json.loads, self.jsonl.path.read_text().splitlines())}


def _drive(live: Live, stop: threading.Event) -> None:
    while not stop.wait(SHIP_EVERY):
        report = live.traffic.next_report()
        if report.step > 1:  # fully asynchronous: lag-0 tokens only at step 1
            assert report.mismatch is not None and int(report.mismatch.tokens[0]) == 0
        live.jsonl.export(report)
        live.exporter.export(report)
        live.last = report


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    exporter = PrometheusExporter(port=0)
    exporter.attach(ExportContext(run=RUN, env_breakdown=True))
    assert exporter.port is not None
    prometheus = RulesPrometheusServer(
        tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{exporter.port}"], job=JOB, scrape_interval="1s"
    )
    values = {
        "job": JOB,
        "instance": f"127.0.0.1:{exporter.port}",
        "run": RUN,
        "env": ".*",  # "All"
        "__rate_interval": RATE_INTERVAL,
    }
    jsonl = JsonlExporter(Path(tmp_path_factory.mktemp("jsonl")) / "metrics.jsonl")
    state = Live(prometheus, exporter, Traffic(), values, jsonl)
    stop = threading.Event()
    driver = threading.Thread(target=_drive, args=(state, stop), daemon=True)
    try:
        prometheus.start()
        driver.start()
        prometheus.wait_until(prometheus.targets_up)
        yield state
    finally:
        stop.set()
        driver.join()
        prometheus.stop()
        exporter.close()
        jsonl.close()


def _panel_queries() -> list[tuple[str, str, str]]:
    return [
        (name, panel["title"], target["expr"])
        for name, dashboard in dashboards().items()
        for panel, target in targets(dashboard)
    ]


def _empty(live: Live, queries: list[tuple[str, str, str]], values: dict[str, str]) -> list[str]:
    return [
        f"{name} / {title}: {fill(expr, values)}"
        for name, title, expr in queries
        if not live.prometheus.query(fill(expr, values))
    ]


def _excess_targets() -> list[tuple[str, str, str]]:
    """(dashboard, panel, expression) of every view of the excess k3 over the floor: the two panels of each
    dashboard and the fleet table's column."""
    found = []
    for name, dashboard in dashboards().items():
        for panel, target in targets(dashboard):
            if "rl_staleness_mismatch_floor_nats" in target["expr"] and "rl_staleness_mismatch_kl" in target["expr"]:
                found.append((name, panel["title"], target["expr"]))
    return found


def _query_at(live: Live, expr: str, at: float) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = live.prometheus.api("query", query=fill(expr, live.values), time=f"{at:.3f}")[
        "result"
    ]
    return result


@pytest.mark.parametrize("source", ["carried", "min_lag"])
def test_excess_over_the_floor_equals_the_jsonl_keys_of_the_ship_in_the_window(live: Live, source: str) -> None:
    """The excess views subtract SPEC 14's floor gauge, so a fully asynchronous run has them, whatever the
    floor's source: carried from step 1's lag-0 tokens, then (after floor_max_age steps) the smallest lag's.

    What they equal: over the rate window, (Σk3 / tokens of the window's increments) - the latest floor. Over a
    window holding one ship that is the ship's own ``excess_k3`` keys; over more ships, the token-weighted mean
    of their excess keys while the floor held (a carried floor), and the window's k3 over the newest floor
    otherwise. Here the trainer is held until the window has no increment, then one ship goes through: every
    excess view, evaluated at the scrape that has it, equals that ship's JSONL keys (float rounding only: every
    series of one target shares its scrape times, so a rate's extrapolation cancels in the ratio)."""
    first = 3 if source == "carried" else FLOOR_MAX_AGE + 3
    live.prometheus.wait_until(lambda: live.traffic.step >= first, timeout=120)
    views = _excess_targets()
    assert {(name, title) for name, title, _ in views} == {
        ("staleness.json", "Excess k3 over the floor by lag"),
        ("staleness.json", "Excess k3 of stale tokens"),
        ("staleness-fleet.json", "Excess k3 over the floor by lag"),
        ("staleness-fleet.json", "Excess k3 of stale tokens per run"),
        ("staleness-fleet.json", "Runs"),
    }
    quiet = f'sum(increase(rl_staleness_mismatch_tokens_total{{run="{RUN}"}}[{RATE_INTERVAL}]))'
    with _paused(live) as trainer:
        live.prometheus.wait_until(lambda: live.prometheus.query_value(quiet) == 0, timeout=120)
        report = trainer.step()
        step = f'rl_staleness_train_step{{run="{RUN}"}}'
        scraped = f"timestamp({step}) and {step} == {report.step}"
        live.prometheus.wait_until(lambda: live.prometheus.query_value(scraped) is not None)
        at = live.prometheus.query_value(scraped)
        assert at is not None
        shown = {(name, title): _query_at(live, expr, at) for name, title, expr in views}
        floor = _query_at(live, f'rl_staleness_mismatch_floor_nats{{run="{RUN}", env=""}}', at)
    row = live.rows()[report.step]
    assert row["staleness/mismatch/floor_source"] == source
    # one floor series, of the ship's source: the run's floor, read back exactly
    assert [(r["metric"]["source"], float(r["value"][1])) for r in floor] == [(source, row["staleness/mismatch/floor"])]
    by_lag = {
        value: row[f"staleness/mismatch/lag_{bucket}/excess_k3"]
        for bucket, value in zip(LAG.buckets, LAG.values, strict=True)
        if f"staleness/mismatch/lag_{bucket}/excess_k3" in row
    }
    assert len(by_lag) >= 2 and "0" not in by_lag
    for (name, title), result in shown.items():
        if "by lag" in title:
            got = {r["metric"]["lag"]: float(r["value"][1]) for r in result}
            assert got == pytest.approx(by_lag, rel=1e-9, abs=1e-12), (name, title)
        else:
            assert [float(r["value"][1]) for r in result] == pytest.approx(
                [row["staleness/mismatch/excess_k3"]], rel=1e-9, abs=1e-12
            ), (name, title)


def test_every_panel_query_returns_data(live: Live) -> None:
    queries = _panel_queries()
    missing: list[str] = []

    def all_have_data() -> bool:
        missing[:] = _empty(live, queries, live.values)
        return not missing

    try:
        live.prometheus.wait_until(all_have_data)
    except AssertionError:
        pytest.fail("panel queries without data:\n" + "\n".join(missing))


@pytest.mark.parametrize("env", ["math", "code"])
def test_picking_one_env_still_fills_every_panel(live: Live, env: str) -> None:
    queries = _panel_queries()
    values = {**live.values, "env": env}
    missing: list[str] = []

    def all_have_data() -> bool:
        missing[:] = _empty(live, queries, values)
        return not missing

    try:
        live.prometheus.wait_until(all_have_data)
    except AssertionError:
        pytest.fail("panel queries without data:\n" + "\n".join(missing))
    per_env = next(p for p in panels(dashboards()["staleness.json"]) if p["title"] == "Token staleness mean per env")
    result = live.prometheus.query(fill(per_env["targets"][0]["expr"], values))
    assert {r["metric"]["env"] for r in result} == {env}


def test_variables_list_the_run_its_job_instance_and_envs(live: Live) -> None:
    for dashboard in dashboards().values():
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            selector, label = label_values_query(variable["definition"])
            found = live.prometheus.api(f"label/{label}/values", **{"match[]": fill(selector, live.values)})
            expected = {"env": {"math", "code"}}.get(label, {live.values.get(label)})
            assert expected <= set(found), (variable["name"], found)


def test_recording_rules_produce_series_and_metrics_are_not_reported_absent(live: Live) -> None:
    records = sorted({r["record"] for r in rule_groups()["groups"][0]["rules"]})

    def recorded() -> bool:
        return all(live.prometheus.query(f'{record}{{run="{RUN}", job="{JOB}"}}') for record in records)

    live.prometheus.wait_until(recorded)
    quantiles = live.prometheus.query_values(
        f'job_run_quantile:rl_staleness_token_steps:histogram_quantile_rate5m{{run="{RUN}"}}', "quantile"
    )
    assert set(quantiles) == {"0.5", "0.9", "0.99"}
    assert quantiles["0.5"] <= quantiles["0.9"] <= quantiles["0.99"]

    # Prometheus loaded every generated rule and evaluates each without error; with metrics flowing the
    # absent alert is quiet (not even pending).
    def loaded_rules() -> list[dict[str, Any]]:
        return [rule for group in live.prometheus.api("rules")["groups"] for rule in group["rules"]]

    live.prometheus.wait_until(lambda: all(not r["lastEvaluation"].startswith("0001-") for r in loaded_rules()))
    rules = loaded_rules()
    generated = [r.get("record") or r.get("alert") for g in rule_groups()["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(generated)
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
    (absent,) = (r for r in rules if r["name"] == "RLStalenessMetricsAbsent")
    assert absent["state"] == "inactive"
    assert not live.prometheus.query('ALERTS{alertname="RLStalenessMetricsAbsent"}')


def test_every_metric_a_dashboard_or_rule_reads_is_in_the_exposition(live: Live) -> None:
    exposed = {
        sample.name
        for family in text_string_to_metric_families(live.exporter.exposition().decode())
        for sample in family.samples
    }
    read = {name for _, _, expr in _panel_queries() for name in metric_names(fill(expr, live.values))}
    for group in rule_groups()["groups"]:
        for rule in group["rules"]:
            read |= {name for name in metric_names(rule["expr"]) if ":" not in name}
    assert read, "no selectors found"
    assert read <= exposed, sorted(read - exposed)


def test_stat_panels_show_the_core_numbers_once_the_trainer_stops(live: Live) -> None:
    """Gauges select the run's overall series (env absent) and per-env panels the env's own."""
    live.prometheus.wait_until(lambda: live.last is not None and live.traffic.step >= 3)
    stat_panels = {p["title"]: p["targets"][0]["expr"] for p in panels(dashboards()["staleness.json"])}
    per_env = stat_panels["Token staleness mean per env"]
    # Pause the trainer: the exporter then keeps serving the last ship.
    with _paused(live):
        last = live.last
        assert last is not None
        last_step = last.step

        def scraped() -> bool:
            return live.prometheus.query_value(fill(stat_panels["Train step"], live.values)) == last_step

        live.prometheus.wait_until(scraped)
        shown = {
            title: live.prometheus.query_value(fill(stat_panels[title], live.values))
            for title in ("Staleness bound", "Token staleness (mean)", "Rollout staleness (max)")
        }
        env_values = live.prometheus.query_values(fill(per_env, live.values), "env")
    assert shown["Staleness bound"] == MAX_STALENESS
    assert shown["Token staleness (mean)"] == pytest.approx(last.metrics["staleness/token/mean"])
    assert shown["Rollout staleness (max)"] == last.metrics["staleness/rollout/max"]
    assert env_values == pytest.approx(
        {env: m["staleness/token/mean"] for env, m in last.env_metrics.items() if env and "staleness/token/mean" in m}
    )


class _paused:
    """Holds the traffic driver between ships (it owns the exporter's next export); :meth:`step` lets one
    more ship through."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.original = live.exporter.export
        self.permits = threading.Semaphore(0)
        self.waiting = threading.Event()

    def __enter__(self) -> _paused:
        def blocked(report: StepReport) -> None:
            self.waiting.set()
            self.permits.acquire()
            self.original(report)

        self.live.exporter.export = blocked  # type: ignore[method-assign]
        # the ship in progress, if any, is done: live.last stays put (the timeout only guards a hang)
        assert self.waiting.wait(120), "the traffic driver stopped shipping"
        return self

    def step(self) -> StepReport:
        """Export the ship that waits; returns it once the driver waits with the next one."""
        self.waiting.clear()
        self.permits.release()
        assert self.waiting.wait(120), "the traffic driver stopped shipping"
        last = self.live.last
        assert last is not None
        return last

    def __exit__(self, *exc: object) -> None:
        self.live.exporter.export = self.original  # type: ignore[method-assign]
        self.permits.release()


def test_choosing_the_bound_panels_draw_the_last_ships_curve_budget_and_bounds(live: Live) -> None:
    """SPEC 14's row: the curve by lag against the budget, the curve at the configured and at the suggested
    bound, and the suggestion beside the bound: the numbers of the ship the exporter serves."""
    by_title = {p["title"]: p for p in panels(dashboards()["staleness.json"])}
    curve_panel, bounds_panel = by_title["Excess curve by lag vs budget"], by_title["Suggested vs configured bound"]
    live.prometheus.wait_until(lambda: live.last is not None and "staleness/bound/suggested" in live.last.metrics)
    with _paused(live):
        last = live.last
        assert last is not None

        def scraped() -> bool:
            step = live.prometheus.query_value(f'rl_staleness_train_step{{run="{RUN}"}}')
            return step == last.step

        live.prometheus.wait_until(scraped)
        curve, budget, at_bound, at_suggested = (
            live.prometheus.query(fill(t["expr"], live.values)) for t in curve_panel["targets"]
        )
        suggested_shown, bound_shown = (
            live.prometheus.query_value(fill(t["expr"], live.values)) for t in bounds_panel["targets"]
        )
    metrics = last.metrics
    expected_curve = {
        key.rsplit("lag_", 1)[1]: value for key, value in metrics.items() if key.startswith("staleness/mismatch/curve/")
    }
    assert {r["metric"]["lag"]: float(r["value"][1]) for r in curve} == pytest.approx(expected_curve)
    assert [float(r["value"][1]) for r in budget] == pytest.approx([metrics["staleness/mismatch/budget"]])
    assert [float(r["value"][1]) for r in at_bound] == pytest.approx([metrics["staleness/bound/excess_at_bound"]])
    suggested = metrics["staleness/bound/suggested"]
    assert suggested_shown == suggested and bound_shown == MAX_STALENESS
    assert [float(r["value"][1]) for r in at_suggested] == pytest.approx([expected_curve[str(suggested)]])
