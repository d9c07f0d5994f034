"""Reading the generated Grafana dashboards as a Grafana user's browser would: targets and variables."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import promql_parser

from staleness_metrics.dashboards.grafana import DASHBOARDS

Json = dict[str, Any]

VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def dashboards() -> dict[str, Json]:
    return {name: build() for name, build in DASHBOARDS.items()}


def panels(dashboard: Json) -> Iterator[Json]:
    """Every panel that draws something (rows left out)."""
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            yield panel


def targets(dashboard: Json) -> Iterator[tuple[Json, Json]]:
    for panel in panels(dashboard):
        for target in panel["targets"]:
            yield panel, target


def fill(expr: str, values: Mapping[str, str]) -> str:
    """Substitutes Grafana variables the way Grafana does before it sends a query (KeyError if unknown)."""
    return VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)


def variables_used(expr: str) -> set[str]:
    return {m.group(1) or m.group(2) for m in VARIABLE.finditer(expr)}


def selectors(expr: str) -> Iterator[promql_parser.VectorSelector]:
    """Every vector selector in a (variable-free) PromQL expression."""
    found: list[promql_parser.VectorSelector] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    yield from found


def metric_names(expr: str) -> list[str]:
    """The metric name of every selector (every query here names its metric)."""
    names = [selector.name for selector in selectors(expr)]
    assert all(names), expr
    return [name for name in names if name]


def label_values_query(definition: str) -> tuple[str, str]:
    """``label_values(selector, label)`` -> (selector, label)."""
    match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition)
    assert match, definition
    return match.group(1), match.group(2)
