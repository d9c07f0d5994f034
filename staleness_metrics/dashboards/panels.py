"""The panel language of the generated Grafana dashboards: units, query targets, panel kinds,
the 24-column :class:`Grid` that places them, and the dashboard frame."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..metrics import metric_table
from .promql import prometheus_name

Json = dict[str, Any]

DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}

# Staleness is a difference of policy versions (train steps); Grafana has no such unit, so a suffix.
VERSIONS = "suffix: versions"
RATIO = "percentunit"
COUNT = "short"
PER_STEP = "suffix: /step"
PER_MINUTE = "suffix: /min"
PER_SECOND = "suffix: /s"
NATS = "suffix: nats"  # k3 mismatch is a KL estimate in natural units
TOKENS = "suffix: tokens"


@dataclass(frozen=True)
class Target:
    """One query of a panel, in Grafana's ``fmt`` (``time_series``, ``table`` or ``heatmap``)."""

    expr: str
    legend: str = "{{run}}"
    instant: bool = False
    fmt: str = "time_series"

    def render(self, ref_id: str) -> Json:
        return {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "format": self.fmt,
            "instant": self.instant,
            "legendFormat": self.legend,
            "range": not self.instant,
            "refId": ref_id,
        }


def make_panel(
    kind: str,
    title: str,
    description: str,
    unit: str,
    targets: Sequence[Target],
    *,
    options: Json,
    custom: Json | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    decimals: int | None = None,
    overrides: Sequence[Json] = (),
) -> Json:
    exprs = " ".join(t.expr for t in targets)
    metrics = ", ".join(  # the table's families the targets query, in table order
        f"`{row.prometheus_name}`"
        for row in metric_table.METRICS
        if row.prometheus_name and re.search(rf"\b{row.prometheus_name}(_bucket)?\{{", exprs)
    )
    defaults: Json = {
        "color": {"mode": "palette-classic"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
        "unit": unit,
    }
    optional = {"custom": custom, "min": minimum, "max": maximum, "decimals": decimals}
    defaults.update({key: value for key, value in optional.items() if value is not None})
    return {
        "type": kind,
        "title": title,
        "description": f"{description} Metrics: {metrics}.",
        "datasource": DATASOURCE,
        "targets": [t.render(chr(ord("A") + i)) for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": options,
    }


LEGEND = {
    "calcs": ["lastNotNull", "max"],
    "displayMode": "table",
    "placement": "bottom",
    "showLegend": True,
}


def timeseries(
    title: str, description: str, unit: str, targets: Sequence[Target], *, stacked: bool = False, **fields: Any
) -> Json:
    """A line panel; ``fields`` go to :func:`make_panel`."""
    custom = {
        "drawStyle": "line",
        "lineInterpolation": "stepAfter",  # values change at ships, and hold in between
        "lineWidth": 1,
        "fillOpacity": 40 if stacked else 0,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stacked else "none"},
    }
    options = {"legend": LEGEND, "tooltip": {"mode": "multi", "sort": "desc"}}
    return make_panel("timeseries", title, description, unit, targets, options=options, custom=custom, **fields)


def stat(title: str, description: str, unit: str, target: Target, *, decimals: int | None = None) -> Json:
    options = {
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": "auto",
    }
    return make_panel("stat", title, description, unit, [target], options=options, decimals=decimals)


def heatmap(title: str, description: str, y_unit: str, target: Target, *, rows: str = "auto") -> Json:
    """``rows="le"``: one row per series, named by its bucket's upper bound (values, not counts)."""
    options = {
        "calculate": False,  # Prometheus buckets already are the cells
        "cellGap": 1,
        "color": {
            "mode": "scheme",
            "scheme": "Oranges",
            "scale": "exponential",
            "exponent": 0.5,
            "steps": 64,
        },
        "legend": {"show": True},
        "rowsFrame": {"layout": rows},
        "tooltip": {"mode": "single", "yHistogram": True},
        "yAxis": {"axisPlacement": "left", "unit": y_unit},
    }
    return make_panel("heatmap", title, description, COUNT, [target], options=options)


def table(title: str, description: str, columns: Sequence[tuple[str, str, Target]]) -> Json:
    """One row per run: each column is an instant query, joined on ``run`` by Grafana's merge."""
    renames = {f"Value #{chr(ord('A') + i)}": name for i, (name, _, _) in enumerate(columns)}
    units = [
        {"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": unit}]}
        for name, unit, _ in columns
    ]
    sort = [{"displayName": "run", "desc": False}]
    view = {"cellHeight": "sm", "showHeader": True, "sortBy": sort}
    targets = [target for _, _, target in columns]
    panel = make_panel("table", title, description, COUNT, targets, options=view, overrides=units)
    panel["transformations"] = [
        {"id": "merge", "options": {}},
        {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": renames}},
    ]
    return panel


def bound_override(suffix: str = "bound") -> Json:
    """Draws the configured bound as a dashed red line."""
    return {
        "matcher": {"id": "byRegexp", "options": f".* {suffix}$"},
        "properties": [
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "color", "value": {"fixedColor": "red", "mode": "fixed"}},
        ],
    }


@dataclass
class Grid:
    """Lays panels left to right on Grafana's 24-column grid, wrapping, and numbers them."""

    panels: list[Json] = field(default_factory=list)
    x: int = 0
    y: int = 0
    line_height: int = 0
    size: tuple[int, int] = (12, 8)  # (w, h) of the panels added without one

    def _new_line(self) -> None:
        self.y += self.line_height
        self.x = 0
        self.line_height = 0

    def row(self, title: str, size: tuple[int, int] = (12, 8)) -> None:
        """A row header; the panels after it take ``size`` unless they say otherwise."""
        self.add({"type": "row", "title": title, "collapsed": False, "panels": []}, (24, 1))
        self.size = size

    def add(self, panel: Json, size: tuple[int, int] | None = None) -> None:
        w, h = size or self.size
        if self.x + w > 24:
            self._new_line()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        panel["id"] = len(self.panels) + 1
        self.panels.append(panel)
        self.x += w
        self.line_height = max(self.line_height, h)
        if self.x == 24:
            self._new_line()

    def series(
        self,
        title: str,
        description: str,
        unit: str,
        targets: Sequence[Target],
        size: tuple[int, int] | None = None,
        **fields: Any,
    ) -> None:
        """Adds a :func:`timeseries` panel (``minimum`` 0 unless given)."""
        self.add(timeseries(title, description, unit, targets, **{"minimum": 0, **fields}), size)


def variables() -> list[Json]:
    """The data source, then job, instance, run and env, each narrowed by the ones before it."""
    found: list[Json] = [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Data source",
            "query": "prometheus",
            "current": {},
            "options": [],
            "refresh": 1,
            "regex": "",
            "hide": 0,
        }
    ]
    matchers: list[str] = []
    for name, label, family, description in (
        ("job", "Job", "train_step", "Prometheus scrape job."),
        ("instance", "Instance", "train_step", "Scraped process."),
        ("run", "Run", "train_step", "Training run (the exporter's run name)."),
        (
            "env",
            "Env",
            "tokens_sampled",
            "Environment / task. Filters counter and histogram panels (All: every env, rollouts "
            "without one included) and picks the series of the per-env panels; the other gauge "
            "panels always show the overall value of the last ship.",
        ),
    ):
        narrowed = f"{{{', '.join(matchers)}}}" if matchers else ""
        definition = f"label_values({prometheus_name(family)}{narrowed}, {name})"
        query = {"query": definition, "refId": "PrometheusVariableQueryEditor-VariableQuery"}
        found.append(
            {
                "type": "query",
                "name": name,
                "label": label,
                "description": description,
                "datasource": DATASOURCE,
                "definition": definition,
                "query": query,
                "refresh": 2,  # on time range change: new runs appear without a reload
                "includeAll": True,
                "allValue": ".*",
                "multi": True,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "options": [],
                "regex": "",
                "sort": 1,
                "hide": 0,
            }
        )
        matchers.append(f'{name}=~"${name}"')
    return found


def dashboard(uid: str, title: str, description: str, panels: list[Json], other: tuple[str, str]) -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["rl", "staleness", "staleness-metrics"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: a step lines up across panels
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "refresh": "30s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "links": [
            {
                "type": "link",
                "title": other[1],
                "url": f"/d/{other[0]}",
                "keepTime": True,
                "includeVars": True,
                "icon": "dashboard",
                "asDropdown": False,
                "targetBlank": False,
                "tags": [],
                "tooltip": "",
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": variables()},
        "panels": panels,
    }
