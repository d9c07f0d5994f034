"""What a Grafana user relies on in the generated dashboards, checked without a Grafana server."""

from __future__ import annotations

import datetime
import itertools
import re
from typing import Any

import promql_parser
import pytest

from staleness_metrics.dashboards.panels import DATASOURCE
from staleness_metrics.metrics import metric_table

from .grafana_queries import (
    dashboards,
    fill,
    label_values_query,
    metric_names,
    panels,
    selectors,
    targets,
    variables_used,
)

DASHBOARDS = dashboards()
REQUIRED_VARIABLES = ("datasource", "job", "instance", "run", "env")
RATE_WINDOW = "17s"  # stands for $__rate_interval: any other range in a query is hard-coded
PLACEHOLDERS = {
    "__rate_interval": RATE_WINDOW,
    "job": "VAR_job",
    "instance": "VAR_instance",
    "run": "VAR_run",
    "env": "VAR_env",
}
COUNTER_SUFFIXES = ("_total", "_bucket")

by_name = pytest.mark.parametrize("name", sorted(DASHBOARDS))


def all_targets() -> list[tuple[str, str, str]]:
    return [
        (name, panel["title"], target["expr"])
        for name, dashboard in DASHBOARDS.items()
        for panel, target in targets(dashboard)
    ]


by_target = pytest.mark.parametrize(("name", "panel", "expr"), all_targets())


def test_dashboards_have_distinct_uids_and_titles() -> None:
    assert len({d["uid"] for d in DASHBOARDS.values()}) == len(DASHBOARDS)
    assert len({d["title"] for d in DASHBOARDS.values()}) == len(DASHBOARDS)


@by_name
def test_panel_ids_are_unique(name: str) -> None:
    ids = [panel["id"] for panel in DASHBOARDS[name]["panels"]]
    assert len(ids) == len(set(ids)), ids


@by_name
def test_every_panel_uses_the_datasource_variable_and_has_unit_and_description(name: str) -> None:
    for panel in panels(DASHBOARDS[name]):
        assert panel["datasource"] == DATASOURCE == {"type": "prometheus", "uid": "${datasource}"}
        assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
        assert panel["title"].strip() and panel["description"].strip(), panel["title"]
        unit = panel["fieldConfig"]["defaults"]["unit"]
        assert unit in {"none", "short", "percentunit"} or re.fullmatch(r"suffix: \S.*", unit), unit
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


@by_name
def test_no_panel_overlaps_another_or_leaves_the_grid(name: str) -> None:
    boxes = [(p["title"], p["gridPos"]) for p in DASHBOARDS[name]["panels"]]
    for title, g in boxes:
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1, title
        assert g["x"] + g["w"] <= 24, title
    for (a, g), (b, h) in itertools.combinations(boxes, 2):
        apart = (
            g["x"] + g["w"] <= h["x"]
            or h["x"] + h["w"] <= g["x"]
            or g["y"] + g["h"] <= h["y"]
            or h["y"] + h["h"] <= g["y"]
        )
        assert apart, f"{a!r} overlaps {b!r}"


@by_name
def test_variables_for_datasource_job_instance_run_and_env(name: str) -> None:
    variables = {v["name"]: v for v in DASHBOARDS[name]["templating"]["list"]}
    assert set(REQUIRED_VARIABLES) <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for label in REQUIRED_VARIABLES[1:]:
        variable = variables[label]
        assert variable["type"] == "query"
        assert variable["datasource"] == DATASOURCE
        assert variable["refresh"] == 2, "new runs must appear when the time range changes"
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
        selector, queried = label_values_query(variable["definition"])
        assert queried == label
        # variables chain: each one filters by the ones before it
        assert variables_used(selector) == set(REQUIRED_VARIABLES[1 : REQUIRED_VARIABLES.index(label)])


@by_target
def test_queries_only_use_defined_variables(name: str, panel: str, expr: str) -> None:
    defined = {v["name"] for v in DASHBOARDS[name]["templating"]["list"]} | {"__rate_interval"}
    assert variables_used(expr) <= defined, panel


@by_target
def test_queries_parse_as_promql_once_variables_are_filled(name: str, panel: str, expr: str) -> None:
    promql_parser.parse(fill(expr, PLACEHOLDERS))


@by_target
def test_every_range_is_the_rate_interval(name: str, panel: str, expr: str) -> None:
    ranges: list[datetime.timedelta] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.MatrixSelector):
            ranges.append(node.range)
        return True

    promql_parser.walk(promql_parser.parse(fill(expr, PLACEHOLDERS)), visit)
    assert set(ranges) <= {datetime.timedelta(seconds=17)}, f"{panel}: {expr}"


@by_target
def test_every_selector_filters_job_instance_and_run(name: str, panel: str, expr: str) -> None:
    for selector in selectors(fill(expr, PLACEHOLDERS)):
        matchers = {(m.name, m.value) for m in selector.matchers.matchers}
        for label in ("job", "instance", "run"):
            assert (label, f"VAR_{label}") in matchers, f"{panel}: {selector.name} lacks ${label}"


@by_target
def test_counters_and_buckets_are_only_read_through_rate_or_increase(name: str, panel: str, expr: str) -> None:
    """A cumulative count read as a value would plot the run's total since its start."""
    through_rate: list[str] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.Call) and node.func.name in {"rate", "increase"}:
            (matrix,) = node.args
            through_rate.append(matrix.vector_selector.name)
        return True

    tree = promql_parser.parse(fill(expr, PLACEHOLDERS))
    promql_parser.walk(tree, visit)
    counters = [n for n in metric_names(fill(expr, PLACEHOLDERS)) if n.endswith(COUNTER_SUFFIXES)]
    assert sorted(counters) == sorted(n for n in through_rate if n.endswith(COUNTER_SUFFIXES)), panel


@by_target
def test_queries_read_only_table_families(name: str, panel: str, expr: str) -> None:
    families = {m.prometheus_name for m in metric_table.METRICS if m.prometheus_name}
    for name in metric_names(fill(expr, PLACEHOLDERS)):
        assert name.removesuffix("_bucket") in families, f"{panel}: {name} is not in the metric table"


@by_name
def test_descriptions_name_the_metrics_a_panel_reads(name: str) -> None:
    for panel in panels(DASHBOARDS[name]):
        read = {
            n.removesuffix("_bucket") for t in panel["targets"] for n in metric_names(fill(t["expr"], PLACEHOLDERS))
        }
        for family in read:
            assert f"`{family}`" in panel["description"], (panel["title"], family)


@by_name
def test_series_overrides_match_a_legend(name: str) -> None:
    """An override (the dashed bound line) that matches no legend silently does nothing."""
    for panel in panels(DASHBOARDS[name]):
        legends = [t["legendFormat"].replace("{{run}}", "run-a") for t in panel["targets"]]
        for override in panel["fieldConfig"]["overrides"]:
            matcher = override["matcher"]
            if matcher["id"] == "byRegexp":
                assert any(re.fullmatch(matcher["options"], legend) for legend in legends), panel["title"]


def test_the_bound_is_drawn_where_staleness_is_plotted_against_it() -> None:
    bound = next(m.prometheus_name for m in metric_table.METRICS if m.name == "max_staleness")
    vs_bound = [p for p in panels(DASHBOARDS["staleness.json"]) if "vs bound" in p["title"]]
    assert len(vs_bound) == 2
    for panel in vs_bound:
        assert any(f"{bound}{{" in t["expr"] for t in panel["targets"]), panel["title"]
        assert any(o["matcher"]["id"] == "byRegexp" for o in panel["fieldConfig"]["overrides"])


def test_the_detailed_dashboard_has_every_view_of_the_issue() -> None:
    kinds = {p["title"]: p["type"] for p in panels(DASHBOARDS["staleness.json"])}
    for title in (
        "Token staleness mean vs bound",
        "Token staleness quantiles",
        "Masked tokens",
        "Rollout staleness mean and max vs bound",
        "In-flight vs in-queue staleness (mean) for $run",
        "Dropped per step",
        "Held rollouts",
        "Label coverage",
        "Ships per minute",
        "Export errors",
    ):
        assert kinds.get(title) == "timeseries", title
    assert kinds["Token staleness distribution"] == "heatmap"
    stacked = next(
        p
        for p in panels(DASHBOARDS["staleness.json"])
        if p["title"].startswith("In-flight vs in-queue staleness (mean)")
    )
    assert stacked["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert stacked["repeat"] == "run", "a stack of several runs' means would add unrelated runs"


def test_quantile_panels_read_all_three_quantiles_from_the_histogram() -> None:
    quantiles = next(p for p in panels(DASHBOARDS["staleness.json"]) if p["title"] == "Token staleness quantiles")
    exprs = [t["expr"] for t in quantiles["targets"]]
    assert [e.split(",")[0] for e in exprs] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.9",
        "histogram_quantile(0.99",
    ]
    assert all("by (run, le)" in e for e in exprs), "buckets of every env and process must be summed"


def test_fleet_table_columns_are_renamed_and_have_units() -> None:
    table = next(p for p in panels(DASHBOARDS["staleness-fleet.json"]) if p["type"] == "table")
    refs = {t["refId"] for t in table["targets"]}
    organize = next(t for t in table["transformations"] if t["id"] == "organize")
    renames = organize["options"]["renameByName"]
    assert {key.removeprefix("Value #") for key in renames} == refs
    units = {o["matcher"]["options"] for o in table["fieldConfig"]["overrides"]}
    assert units == set(renames.values())
    assert all(t["instant"] and t["format"] == "table" for t in table["targets"])


COST_PANELS = {  # SPEC 11 / 12 views on each dashboard, and their panel type
    "staleness.json": {
        "Mismatch k3 by lag": "timeseries",
        "Excess k3 over the floor by lag": "heatmap",
        "Excess k3 of stale tokens": "timeseries",
        "Effective sample size by lag": "timeseries",
        "Out-of-band share by lag": "timeseries",
        "Trained vs sampled mean length": "timeseries",
        "Removed share by length bucket": "timeseries",
    },
    "staleness-fleet.json": {
        "Excess k3 of stale tokens per run": "timeseries",
        "Excess k3 over the floor by lag": "heatmap",
        "Fleet mismatch k3 by lag": "timeseries",
        "Fleet effective sample size by lag": "timeseries",
        "Fleet out-of-band share by lag": "timeseries",
        "Trained vs sampled mean length": "timeseries",
        "Removed share by length bucket (fleet)": "timeseries",
    },
}


EXCESS_PANELS = {  # the panels that show the excess k3 over the floor
    "staleness.json": ("Excess k3 over the floor by lag", "Excess k3 of stale tokens"),
    "staleness-fleet.json": ("Excess k3 over the floor by lag", "Excess k3 of stale tokens per run"),
}


@by_name
def test_what_staleness_costs_panels_divide_rates_of_sums(name: str) -> None:
    """Every mismatch and length panel divides summed rates (exact across processes), never averages a
    per-process ratio, and the heatmap has one row per lag bucket."""
    by_title = {p["title"]: p for p in panels(DASHBOARDS[name])}
    for title, kind in COST_PANELS[name].items():
        panel = by_title[title]
        assert panel["type"] == kind, title
        for target in panel["targets"]:
            expr = fill(target["expr"], PLACEHOLDERS)
            assert "avg" not in expr and " / " in expr, (title, expr)
            families = metric_names(expr)
            assert families and all(f.startswith(("rl_staleness_mismatch_", "rl_staleness_length_")) for f in families)
    heatmap = by_title["Excess k3 over the floor by lag"]
    (target,) = heatmap["targets"]
    assert target["legendFormat"] == "{{lag}}" and target["format"] == "time_series"
    assert heatmap["options"]["rowsFrame"]["layout"] == "le" and heatmap["options"]["calculate"] is False
    # SPEC 14's floor gauge, whatever its source, not the lag-0 counters (absent in a fully asynchronous run)
    for title in EXCESS_PANELS[name]:
        for target in by_title[title]["targets"]:
            expr = target["expr"]
            assert "rl_staleness_mismatch_floor_nats" in expr and "group_left" in expr, (title, expr)
            assert 'lag="0"' not in expr and 'lag!="0"' in expr, (title, expr)
    ess = by_title["Effective sample size by lag" if name == "staleness.json" else "Fleet effective sample size by lag"]
    assert (
        "^ 2" in ess["targets"][0]["expr"] and "rl_staleness_mismatch_ratio_squared_total" in ess["targets"][0]["expr"]
    )


def test_choosing_the_bound_row_draws_the_curve_against_the_budget_with_both_bounds() -> None:
    """SPEC 14's row: the curve by lag, the budget dashed red, the curve at the configured and at the suggested
    bound drawn thick; the suggestion against the configured bound over time; the floor by its source."""
    detailed = DASHBOARDS["staleness.json"]
    assert "Choosing the bound" in [p["title"] for p in detailed["panels"] if p["type"] == "row"]
    by_title = {p["title"]: p for p in panels(detailed)}
    curve = by_title["Excess curve by lag vs budget"]
    assert [t["legendFormat"] for t in curve["targets"]] == [
        "{{run}} lag {{lag}}",
        "{{run}} budget",
        "{{run}} at the configured bound",
        "{{run}} at the suggested bound",
    ]
    families = [metric_names(fill(t["expr"], PLACEHOLDERS)) for t in curve["targets"]]
    assert families[:3] == [
        ["rl_staleness_mismatch_curve_nats"],
        ["rl_staleness_mismatch_budget_nats"],
        ["rl_staleness_bound_excess_at_bound_nats"],
    ]
    assert "by (run, lag)" in curve["targets"][0]["expr"]
    # The curve at the suggested bound: one term per lag of the curve, kept where the suggestion equals it.
    terms = curve["targets"][3]["expr"].split(" or ")
    assert [re.search(r'lag="(\d+)"', t).group(1) for t in terms] == [str(lag) for lag in range(1, 17)]  # type: ignore[union-attr]
    assert all(t.endswith(f"== {lag})") and "rl_staleness_bound_suggested{" in t for lag, t in enumerate(terms, 1))
    overrides = {o["matcher"]["options"]: o["properties"] for o in curve["fieldConfig"]["overrides"]}
    assert {"id": "color", "value": {"fixedColor": "red", "mode": "fixed"}} in overrides[".* budget$"]
    for which in ("configured", "suggested"):
        assert {"id": "custom.lineWidth", "value": 3} in overrides[f".* at the {which} bound$"]
    bounds = by_title["Suggested vs configured bound"]
    assert [metric_names(t["expr"]) for t in bounds["targets"]] == [
        ["rl_staleness_bound_suggested"],
        ["rl_staleness_max_staleness"],
    ]
    assert [o["matcher"]["options"] for o in bounds["fieldConfig"]["overrides"]] == [".* bound$"]
    floor = by_title["Floor by source"]
    assert (
        floor["targets"][0]["legendFormat"] == "{{run}} {{source}}"
        and "by (run, source)" in floor["targets"][0]["expr"]
    )
    # The fleet: per run, and two columns of the runs table.
    fleet = {p["title"]: p for p in panels(DASHBOARDS["staleness-fleet.json"])}
    assert {"Suggested vs configured bound per run", "Excess at the bound vs budget per run"} <= set(fleet)
    organize = next(t for t in fleet["Runs"]["transformations"] if t["id"] == "organize")
    assert {"Suggested bound", "Excess at bound"} <= set(organize["options"]["renameByName"].values())
