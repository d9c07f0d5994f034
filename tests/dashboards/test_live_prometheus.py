"""The dashboards and rules against the real thing: the Prometheus exporter on loopback, scraped by a real
Prometheus 2.42 with the generated rules loaded. Every panel query, with its variables filled in as
Grafana would, must return data; the numbers on the stat panels must be the core's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.dashboards.rules import rule_groups
from staleness_metrics.exporters.base import ExportContext
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.metrics.report import StepReport
from tests.support.prometheus import PrometheusServer, RulesPrometheusServer, requires_prometheus

from .grafana_queries import dashboards, fill, label_values_query, metric_names, panels, targets
from .traffic import MAX_STALENESS, Traffic

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
    last: StepReport | None = None


def _drive(live: Live, stop: threading.Event) -> None:
    while not stop.wait(SHIP_EVERY):
        report = live.traffic.next_report()
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
    state = Live(prometheus, exporter, Traffic(), values)
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
    """Holds the traffic driver between ships (it owns the exporter's next export)."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.original = live.exporter.export
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def __enter__(self) -> None:
        def blocked(report: StepReport) -> None:
            self.waiting.set()
            self.gate.wait()
            self.original(report)

        self.live.exporter.export = blocked  # type: ignore[method-assign]
        # the ship in progress, if any, is done: live.last stays put (the timeout only guards a hang)
        assert self.waiting.wait(120), "the traffic driver stopped shipping"

    def __exit__(self, *exc: object) -> None:
        self.live.exporter.export = self.original  # type: ignore[method-assign]
        self.gate.set()


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
