"""Grafana dashboards as plain dicts, built from the metric table (the vLLM generator pattern).

Two dashboards: ``staleness`` (one or a few runs in detail) and ``staleness-fleet`` (many runs side by
side). Every query comes from :mod:`.promql`, so the JSON follows the table. Panels are placed on the
24-column grid by :class:`Grid`, which also numbers them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..metrics import metric_table
from .promql import Scope, metric, prometheus_name

__all__ = ["DASHBOARDS", "Grid", "fleet_dashboard", "staleness_dashboard"]

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

# The selectors of every dashboard query; gauges pick env="" themselves (see promql.Scope).
SCOPE = Scope(
    matchers=('job=~"$job"', 'instance=~"$instance"', 'run=~"$run"'),
    env="$env",
    by=("run",),
    window="$__rate_interval",
)
FLEET_WIDE = Scope(matchers=SCOPE.matchers, env=SCOPE.env, by=(), window=SCOPE.window)

_QUANTILES = ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"))
_NO_ENV = "(no env)"


@dataclass(frozen=True)
class Target:
    """One query of a panel."""

    expr: str
    legend: str = "{{run}}"
    instant: bool = False
    table: bool = False
    heatmap: bool = False

    def render(self, ref_id: str) -> Json:
        fmt = "table" if self.table else "heatmap" if self.heatmap else "time_series"
        return {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "format": fmt,
            "instant": self.instant,
            "legendFormat": self.legend,
            "range": not self.instant,
            "refId": ref_id,
        }


def _families(targets: Sequence[Target]) -> list[str]:
    """The table's Prometheus families queried by ``targets``, in table order."""
    exprs = " ".join(t.expr for t in targets)
    return [
        row.prometheus_name
        for row in metric_table.METRICS
        if row.prometheus_name and re.search(rf"\b{row.prometheus_name}(_bucket)?\{{", exprs)
    ]


def _panel(
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
    metrics = ", ".join(f"`{name}`" for name in _families(targets))
    defaults: Json = {
        "color": {"mode": "palette-classic"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
        "unit": unit,
    }
    if custom is not None:
        defaults["custom"] = custom
    for key, value in (("min", minimum), ("max", maximum), ("decimals", decimals)):
        if value is not None:
            defaults[key] = value
    return {
        "type": kind,
        "title": title,
        "description": f"{description} Metrics: {metrics}.",
        "datasource": DATASOURCE,
        "targets": [t.render(chr(ord("A") + i)) for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": options,
    }


_LEGEND = {"calcs": ["lastNotNull", "max"], "displayMode": "table", "placement": "bottom", "showLegend": True}


def timeseries(
    title: str,
    description: str,
    unit: str,
    targets: Sequence[Target],
    *,
    stacked: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    overrides: Sequence[Json] = (),
) -> Json:
    custom = {
        "drawStyle": "line",
        "lineInterpolation": "stepAfter",  # values change at ships, and hold in between
        "lineWidth": 1,
        "fillOpacity": 40 if stacked else 0,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stacked else "none"},
    }
    options = {"legend": _LEGEND, "tooltip": {"mode": "multi", "sort": "desc"}}
    return _panel(
        "timeseries",
        title,
        description,
        unit,
        targets,
        options=options,
        custom=custom,
        minimum=minimum,
        maximum=maximum,
        overrides=overrides,
    )


def stat(title: str, description: str, unit: str, target: Target, *, decimals: int | None = None) -> Json:
    options = {
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": "auto",
    }
    return _panel("stat", title, description, unit, [target], options=options, decimals=decimals)


def heatmap(title: str, description: str, y_unit: str, target: Target, *, rows: str = "auto") -> Json:
    """``rows="le"``: each series is one row, named by its bucket's upper bound (Grafana's "time series
    buckets"), for values that are not counts to de-accumulate."""
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
    return _panel("heatmap", title, description, COUNT, [target], options=options)


def table(title: str, description: str, columns: Sequence[tuple[str, str, Target]]) -> Json:
    """One row per run: each column is an instant query, joined on ``run`` by Grafana's merge."""
    targets = [target for _, _, target in columns]
    renames = {f"Value #{chr(ord('A') + i)}": name for i, (name, _, _) in enumerate(columns)}
    overrides = [
        {"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": unit}]}
        for name, unit, _ in columns
    ]
    panel = _panel(
        "table",
        title,
        description,
        COUNT,
        targets,
        options={"cellHeight": "sm", "showHeader": True, "sortBy": [{"displayName": "run", "desc": False}]},
        overrides=overrides,
    )
    panel["transformations"] = [
        {"id": "merge", "options": {}},
        {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": renames}},
    ]
    return panel


def _bound_override(suffix: str = "bound") -> Json:
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
    """Lays panels left to right on Grafana's 24-column grid, wrapping to a new line, and numbers them."""

    panels: list[Json] = field(default_factory=list)
    x: int = 0
    y: int = 0
    line_height: int = 0

    def _new_line(self) -> None:
        self.y += self.line_height
        self.x = 0
        self.line_height = 0

    def row(self, title: str) -> None:
        if self.x:
            self._new_line()
        self.add({"type": "row", "title": title, "collapsed": False, "panels": []}, w=24, h=1)

    def add(self, panel: Json, *, w: int, h: int) -> None:
        if self.x + w > 24:
            self._new_line()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        panel["id"] = len(self.panels) + 1
        self.panels.append(panel)
        self.x += w
        self.line_height = max(self.line_height, h)
        if self.x == 24:
            self._new_line()


def _variables() -> list[Json]:
    train_step = prometheus_name("train_step")
    tokens = prometheus_name("tokens_sampled")

    def query(name: str, label: str, definition: str, description: str) -> Json:
        return {
            "type": "query",
            "name": name,
            "label": label,
            "description": description,
            "datasource": DATASOURCE,
            "definition": definition,
            "query": {"query": definition, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
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

    return [
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
        },
        query("job", "Job", f"label_values({train_step}, job)", "Prometheus scrape job."),
        query(
            "instance",
            "Instance",
            f'label_values({train_step}{{job=~"$job"}}, instance)',
            "Scraped process.",
        ),
        query(
            "run",
            "Run",
            f'label_values({train_step}{{job=~"$job", instance=~"$instance"}}, run)',
            "Training run (the exporter's run name).",
        ),
        query(
            "env",
            "Env",
            f'label_values({tokens}{{job=~"$job", instance=~"$instance", run=~"$run"}}, env)',
            "Environment / task. Filters counter and histogram panels (All: every env, rollouts "
            "without one included) and picks the series of the per-env panels; the other gauge panels "
            "always show the overall value of the last ship.",
        ),
    ]


def _dashboard(uid: str, title: str, description: str, panels: list[Json], other: tuple[str, str]) -> Json:
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
        "templating": {"list": _variables()},
        "panels": panels,
    }


def _no_env_label(expr: str) -> str:
    """Names the rollouts without env in legends (their series have no env label)."""
    return f'label_replace({expr}, "env", "{_NO_ENV}", "env", "")'


def _ships_per_minute(scope: Scope) -> str:
    return f"{scope.steps_per_second()} * 60"


def _label_coverage(scope: Scope) -> str:
    return f"1 - ({scope.ratio('tokens_unlabelled', 'tokens_sampled')})"


def _export_errors(scope: Scope) -> str:
    return scope.rate("export_errors", extra_by=("exporter",))


_SHIPS_NOTE = (
    "Train steps per minute, from how fast the train step gauge advances; one ship per step makes it the ship rate."
)


def _overview(grid: Grid, s: Scope, bound: Target) -> None:
    """Stat panels: where the run is now."""
    grid.row("Overview")
    for title, description, unit, target, decimals in (
        ("Train step", "Train step of the last shipped batch.", "none", Target(s.gauge("train_step")), 0),
        ("Ships per minute", _SHIPS_NOTE, PER_MINUTE, Target(_ships_per_minute(s)), None),
        (
            "Token staleness (mean)",
            "Mean token staleness of the last shipped batch, in policy versions.",
            VERSIONS,
            Target(s.gauge("token_mean")),
            None,
        ),
        (
            "Masked tokens",
            "Share of shipped sampled tokens masked for staleness, over the dashboard's rate window.",
            RATIO,
            Target(s.ratio("tokens_masked", "tokens_sampled")),
            None,
        ),
        (
            "Rollout staleness (max)",
            "Largest rollout staleness of the last shipped batch (equals the largest token staleness).",
            VERSIONS,
            Target(s.gauge("rollout_max")),
            0,
        ),
        ("Staleness bound", "The configured max_staleness.", VERSIONS, bound, 0),
    ):
        grid.add(stat(title, description, unit, target, decimals=decimals), w=4, h=4)


def _token_staleness(grid: Grid, s: Scope, bound: Target) -> None:
    """Token staleness against the bound, its quantiles and distribution, and masking."""
    grid.row("Token staleness")
    grid.add(
        timeseries(
            "Token staleness mean vs bound",
            "Mean token staleness of each shipped batch (overall series, every env), with the configured "
            "max_staleness drawn dashed.",
            VERSIONS,
            [Target(s.gauge("token_mean"), "{{run}} mean"), bound],
            minimum=0,
            overrides=[_bound_override()],
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Token staleness quantiles",
            "p50 / p90 / p99 of token staleness from the histogram over the rate window. PromQL "
            "interpolates inside integer buckets, so a value lies in (q-1, q] of the exact quantile q.",
            VERSIONS,
            [Target(s.quantile(q, "token_staleness"), f"{{{{run}}}} {name}") for q, name in _QUANTILES],
            minimum=0,
        ),
        w=12,
        h=8,
    )
    grid.add(
        heatmap(
            "Token staleness distribution",
            "Shipped sampled tokens per staleness bucket and rate window, summed over the selected runs. "
            "Cells above the bound are masked tokens.",
            VERSIONS,
            Target(s.bucket_increase("token_staleness"), "{{le}}", heatmap=True),
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Masked tokens",
            "Share of shipped sampled tokens masked for staleness: over the rate window from the counters, "
            "and for the last shipped batch.",
            RATIO,
            [
                Target(s.ratio("tokens_masked", "tokens_sampled"), "{{run}} over window"),
                Target(s.gauge("token_masked"), "{{run}} last ship"),
            ],
            minimum=0,
            maximum=1,
        ),
        w=12,
        h=8,
    )


def _rollout_staleness(grid: Grid, s: Scope, bound: Target) -> None:
    """Rollout staleness, where it comes from (in flight vs in queue), and held rollouts."""
    grid.row("Rollout staleness")
    grid.add(
        timeseries(
            "Rollout staleness mean and max vs bound",
            "Rollout staleness R = T - min(version) of the last shipped batch: mean and max, with the "
            "configured max_staleness drawn dashed.",
            VERSIONS,
            [
                Target(s.gauge("rollout_mean"), "{{run}} mean"),
                Target(s.gauge("rollout_max"), "{{run}} max"),
                bound,
            ],
            minimum=0,
            overrides=[_bound_override()],
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Rollout staleness quantiles",
            "p50 / p90 / p99 of rollout staleness from the histogram over the rate window (interpolated "
            "inside integer buckets).",
            VERSIONS,
            [Target(s.quantile(q, "rollout_staleness"), f"{{{{run}}}} {name}") for q, name in _QUANTILES],
            minimum=0,
        ),
        w=12,
        h=8,
    )
    in_flight_vs_queue = timeseries(
        "In-flight vs in-queue staleness (mean) for $run",
        "Where the age of a rollout comes from: versions that passed while it was generated (in flight) "
        "and while it waited in the queue (in queue). Per rollout they add up to its staleness, so the "
        "stack is the rollout staleness mean. One panel per run.",
        VERSIONS,
        [
            Target(s.gauge("rollout_in_flight_mean"), "in flight"),
            Target(s.gauge("rollout_in_queue_mean"), "in queue"),
        ],
        stacked=True,
        minimum=0,
    )
    in_flight_vs_queue.update({"repeat": "run", "repeatDirection": "h", "maxPerRow": 4})
    grid.add(in_flight_vs_queue, w=24, h=8)
    grid.add(
        timeseries(
            "In-flight vs in-queue staleness (max)",
            "Largest in-flight and in-queue staleness of the last shipped batch (maxima do not stack).",
            VERSIONS,
            [
                Target(s.gauge("rollout_in_flight_max"), "{{run}} in flight"),
                Target(s.gauge("rollout_in_queue_max"), "{{run}} in queue"),
            ],
            minimum=0,
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Held rollouts",
            "Rollouts held back at the last ship while their group waits for re-rollouts (xtuner policy "
            "with retry_expired); always 0 for other policies.",
            COUNT,
            [Target(s.gauge("rollouts_held"))],
            minimum=0,
        ),
        w=12,
        h=8,
    )


def _oldest_vs_newest(grid: Grid, s: Scope) -> None:
    """Rollout staleness by its oldest and by its newest token, for comparing frameworks' headlines."""
    grid.add(
        timeseries(
            "Rollout staleness: oldest vs newest token",
            "Rollout staleness of the last shipped batch by its oldest token (R = T - min(version), "
            "prime-rl's headline) and by its newest token (T - max(version), verl's trajectory staleness). "
            "The gap is how many versions one rollout spans.",
            VERSIONS,
            [
                Target(s.gauge("rollout_mean"), "{{run}} oldest mean"),
                Target(s.gauge("rollout_newest_mean"), "{{run}} newest mean"),
                Target(s.gauge("rollout_max"), "{{run}} oldest max"),
                Target(s.gauge("rollout_newest_max"), "{{run}} newest max"),
            ],
            minimum=0,
        ),
        w=24,
        h=8,
    )


def _drops(grid: Grid, s: Scope) -> None:
    """What the policy threw away."""
    grid.row("Drops")
    grid.add(
        timeseries(
            "Dropped per step",
            "Live rollouts and samples dropped for staleness per train step, from the counters over the "
            "rate window (no point while the train step does not advance).",
            PER_STEP,
            [
                Target(s.per_step("rollouts_dropped"), "{{run}} rollouts"),
                Target(s.per_step("samples_dropped"), "{{run}} samples"),
            ],
            minimum=0,
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Token accounting",
            "Tokens per second: sampled tokens of shipped samples, those of them masked, and tokens "
            "of samples dropped whole.",
            PER_SECOND,
            [
                Target(s.rate("tokens_sampled"), "{{run}} shipped"),
                Target(s.rate("tokens_masked"), "{{run}} masked"),
                Target(s.rate("tokens_dropped"), "{{run}} dropped"),
            ],
            minimum=0,
        ),
        w=12,
        h=8,
    )


def _pipeline_health(grid: Grid, s: Scope) -> None:
    """Is the pipeline moving, labelled and exporting?"""
    grid.row("Pipeline health")
    grid.add(
        timeseries("Ships per minute", _SHIPS_NOTE, PER_MINUTE, [Target(_ships_per_minute(s))], minimum=0),
        w=8,
        h=8,
    )
    grid.add(
        timeseries(
            "Label coverage",
            "Share of shipped sampled tokens that carried a policy-version label; unlabelled ones take "
            "their rollout's dispatch version (the oldest, conservative choice).",
            RATIO,
            [Target(_label_coverage(s))],
            minimum=0,
            maximum=1,
        ),
        w=8,
        h=8,
    )
    grid.add(
        timeseries(
            "Export errors",
            "Failed exports per second, per exporter. Exporters never raise into training, so this is "
            "where failures show.",
            PER_SECOND,
            [Target(_export_errors(s), "{{run}} {{exporter}}")],
            minimum=0,
        ),
        w=8,
        h=8,
    )


def _per_env(grid: Grid, s: Scope) -> None:
    """The same views split by env."""
    grid.row("Per env")
    grid.add(
        timeseries(
            "Token staleness mean per env",
            "Mean token staleness of the last shipped batch per env (exported when the env breakdown is on).",
            VERSIONS,
            [Target(s.gauge("token_mean", per_env=True), "{{run}} {{env}}")],
            minimum=0,
        ),
        w=8,
        h=8,
    )
    grid.add(
        timeseries(
            "Masked tokens per env",
            "Share of shipped sampled tokens masked for staleness per env, over the rate window.",
            RATIO,
            [
                Target(
                    _no_env_label(s.ratio("tokens_masked", "tokens_sampled", extra_by=("env",))),
                    "{{run}} {{env}}",
                )
            ],
            minimum=0,
            maximum=1,
        ),
        w=8,
        h=8,
    )
    grid.add(
        timeseries(
            "Dropped rollouts per env",
            "Live rollouts dropped for staleness per second, per env.",
            PER_SECOND,
            [Target(_no_env_label(s.rate("rollouts_dropped", extra_by=("env",))), "{{run}} {{env}}")],
            minimum=0,
        ),
        w=8,
        h=8,
    )


_COST_NOTE = (
    "From rates of the trainer-vs-sampler mismatch sums (SPEC 11), summed over processes before dividing, "
    "so the value is the merged run's over the rate window."
)
_LENGTH_NOTE = (
    "Over shipped live samples plus samples dropped for staleness (SPEC 12), from rates of the length counters."
)


def _excess_heatmap(merged: Scope, whose: str) -> Json:
    """Excess k3 over the lag-0 floor: one row per lag bucket, one column per rate window."""
    return heatmap(
        "Excess k3 over the lag-0 floor by lag",
        f"Mean k3 of each lag bucket minus that of lag 0 ({whose}). Lag 0 is the numeric floor the engines "
        f"show with the same weights; the excess, lag by lag, is what staleness costs. {_COST_NOTE}",
        "short",
        Target(merged.excess_k3_by_lag(), "{{lag}}"),
        rows="le",  # lag buckets are named by their largest lag
    )


def _length_bias(grid: Grid, s: Scope, *, w: int, h: int, fleet: Scope | None = None) -> None:
    grid.add(
        timeseries(
            "Trained vs sampled mean length",
            "Mean sampled length of the samples per ship window, and the same with masked positions and "
            f"dropped samples counted as 0: a gap that grows is masking and drops cutting long responses. "
            f"{_LENGTH_NOTE}",
            TOKENS,
            [
                Target(s.sampled_length_mean(), "{{run}} sampled"),
                Target(s.trained_length_mean(), "{{run}} trained"),
            ],
            minimum=0,
        ),
        w=w,
        h=h,
    )
    by_length = fleet or s
    legend = "{{length}}" if fleet is not None else "{{run}} {{length}}"
    grid.add(
        timeseries(
            "Removed share by length bucket" + (" (fleet)" if fleet is not None else ""),
            "Share of sampled positions masked or dropped for staleness, over samples whose sampled length "
            "falls in each bucket (256, 1k, 4k, 16k, inf): staleness rules remove more of long responses. "
            f"{_LENGTH_NOTE}",
            RATIO,
            [Target(by_length.removed_share_by_length(), legend)],
            minimum=0,
            maximum=1,
        ),
        w=w,
        h=h,
    )


def _what_staleness_costs(grid: Grid, s: Scope, merged: Scope) -> None:
    """SPEC 11 and 12: the policy mismatch by token lag and the length bias of masking."""
    grid.row("What staleness costs")
    grid.add(
        timeseries(
            "Mismatch k3 by lag",
            "Mean k3 = r - 1 - log r (prime-rl's mismatch_kl) between trainer and sampler log-probabilities, "
            f"per token lag bucket. {_COST_NOTE}",
            NATS,
            [Target(s.per_lag_token("mismatch_kl"), "{{run}} lag {{lag}}")],
        ),
        w=12,
        h=8,
    )
    grid.add(_excess_heatmap(merged, "the selected runs merged"), w=12, h=8)
    grid.add(
        timeseries(
            "Excess k3 of stale tokens",
            "Mean k3 of every token at lag 1 or more minus the lag-0 floor: one number for what staleness "
            f"costs the run. {_COST_NOTE}",
            NATS,
            [Target(s.excess_k3(), "{{run}}")],
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Effective sample size by lag",
            "Normalised ESS (Σr)² / (n Σr²) of the importance ratios per lag bucket: 1 when trainer and "
            f"sampler agree, towards 0 when a few tokens dominate the corrected gradient. {_COST_NOTE}",
            RATIO,
            [Target(s.ess_by_lag(), "{{run}} lag {{lag}}")],
            minimum=0,
            maximum=1,
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Out-of-band share by lag",
            "Share of covered tokens whose importance ratio lies outside the mismatch band (default "
            f"[0.5, 2]), per lag bucket: the tokens a ratio clip or mask would cut. {_COST_NOTE}",
            RATIO,
            [Target(s.per_lag_token("mismatch_out_of_band"), "{{run}} lag {{lag}}")],
            minimum=0,
            maximum=1,
        ),
        w=12,
        h=8,
    )
    _length_bias(grid, s, w=12, h=8)


_BOUND_NOTE = (
    "SPEC 14, from the gauges of the last ship with trainer-vs-sampler sums: the curve is the excess k3 over the "
    "floor by lag, pooled over the last cost_window ships and made non-decreasing; the budget is "
    "mismatch_budget, or the floor."
)


def _curve_lags() -> tuple[str, ...]:
    dimension = metric("mismatch_curve").dimension
    assert dimension is not None
    return tuple(dimension.values)


def _choosing_the_bound(grid: Grid, s: Scope, bound: Target) -> None:
    """SPEC 14: the excess curve against the budget, the configured and suggested bounds, and the floor."""
    grid.row("Choosing the bound")
    grid.add(
        timeseries(
            "Excess curve by lag vs budget",
            "The excess curve at each lag (one line per lag), the budget drawn dashed red, and the curve at the "
            "two bounds: at the configured bound (what the bound lets train; above the budget, the bound is too "
            f"loose) and at the suggested bound (the largest lag within the budget). {_BOUND_NOTE}",
            NATS,
            [
                Target(s.gauge("mismatch_curve", extra_by=("lag",)), "{{run}} lag {{lag}}"),
                Target(s.gauge("mismatch_budget"), "{{run}} budget"),
                Target(s.gauge("bound_excess_at_bound"), "{{run}} at the configured bound"),
                Target(s.curve_at_suggested(_curve_lags()), "{{run}} at the suggested bound"),
            ],
            minimum=0,
            overrides=[_bound_override("budget"), *_marked_overrides()],
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Suggested vs configured bound",
            "The bound the curve suggests against the configured max_staleness (dashed red). Below it while the "
            "curve crosses the budget: the bound lets train tokens that cost more than the budget; 2 or more "
            f"above it while tokens are masked: the bound masks tokens that cost less. {_BOUND_NOTE}",
            VERSIONS,
            [Target(s.gauge("bound_suggested"), "{{run}} suggested"), bound],
            minimum=0,
            overrides=[_bound_override()],
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Floor by source",
            "The engines' numeric mismatch the excess is measured against, labelled by where it came from: "
            "lag0 (this ship's lag-0 tokens), carried (an earlier ship's, within floor_max_age) or min_lag (the "
            "smallest lag with enough tokens: an upper bound on the floor, so the excess is a lower bound).",
            NATS,
            [Target(s.gauge("mismatch_floor", extra_by=("source",)), "{{run}} {{source}}")],
            minimum=0,
        ),
        w=12,
        h=8,
    )
    grid.add(
        timeseries(
            "Floor age and budget crossed",
            "Steps since the ship that measured the floor (a carried floor ages until floor_max_age), and 1 when "
            "the curve crosses the budget at some lag (the suggestion is where), else 0 (the suggestion is only "
            "the largest lag seen).",
            COUNT,
            [
                Target(s.gauge("mismatch_floor_age"), "{{run}} floor age (steps)"),
                Target(s.gauge("bound_crossed"), "{{run}} crossed"),
            ],
            minimum=0,
        ),
        w=12,
        h=8,
    )


def _marked_overrides() -> list[Json]:
    """The curve at the two bounds drawn thick, in the colours of the report's bounds."""
    return [
        {
            "matcher": {"id": "byRegexp", "options": f".* at the {which} bound$"},
            "properties": [
                {"id": "custom.lineWidth", "value": 3},
                {"id": "color", "value": {"fixedColor": colour, "mode": "fixed"}},
            ],
        }
        for which, colour in (("configured", "dark-orange"), ("suggested", "green"))
    ]


def _fleet_bounds(grid: Grid, s: Scope) -> None:
    """SPEC 14 per run: suggested vs configured, and the curve at the configured bound against the budget."""
    grid.row("Choosing the bound")
    grid.add(
        timeseries(
            "Suggested vs configured bound per run",
            f"Each run's suggested bound and its configured max_staleness (dashed red). {_BOUND_NOTE}",
            VERSIONS,
            [
                Target(s.gauge("bound_suggested"), "{{run}} suggested"),
                Target(s.gauge("max_staleness"), "{{run}} bound"),
            ],
            minimum=0,
            overrides=[_bound_override()],
        ),
        w=12,
        h=7,
    )
    grid.add(
        timeseries(
            "Excess at the bound vs budget per run",
            "Each run's excess curve at its configured bound against its budget (dashed red): above it, the bound "
            f"lets train tokens that cost more than the budget. {_BOUND_NOTE}",
            NATS,
            [
                Target(s.gauge("bound_excess_at_bound"), "{{run}} at the configured bound"),
                Target(s.gauge("mismatch_budget"), "{{run}} budget"),
            ],
            minimum=0,
            overrides=[_bound_override("budget"), *_marked_overrides()[:1]],
        ),
        w=12,
        h=7,
    )


def _fleet_costs(grid: Grid, s: Scope) -> None:
    """What staleness costs across the fleet: per run, and merged over every selected run."""
    f = FLEET_WIDE
    grid.row("What staleness costs")
    grid.add(
        timeseries(
            "Excess k3 of stale tokens per run",
            f"Mean k3 of the tokens at lag 1 or more minus the lag-0 floor, per run. {_COST_NOTE}",
            NATS,
            [Target(s.excess_k3())],
        ),
        w=8,
        h=7,
    )
    grid.add(_excess_heatmap(f, "every selected run merged"), w=8, h=7)
    grid.add(
        timeseries(
            "Fleet mismatch k3 by lag",
            f"Mean k3 per lag bucket over every selected run. {_COST_NOTE}",
            NATS,
            [Target(f.per_lag_token("mismatch_kl"), "lag {{lag}}")],
        ),
        w=8,
        h=7,
    )
    grid.add(
        timeseries(
            "Fleet effective sample size by lag",
            f"Normalised ESS (Σr)² / (n Σr²) per lag bucket over every selected run. {_COST_NOTE}",
            RATIO,
            [Target(f.ess_by_lag(), "lag {{lag}}")],
            minimum=0,
            maximum=1,
        ),
        w=8,
        h=7,
    )
    grid.add(
        timeseries(
            "Fleet out-of-band share by lag",
            f"Share of covered tokens with an importance ratio outside the band, per lag bucket. {_COST_NOTE}",
            RATIO,
            [Target(f.per_lag_token("mismatch_out_of_band"), "lag {{lag}}")],
            minimum=0,
            maximum=1,
        ),
        w=8,
        h=7,
    )
    _length_bias(grid, s, w=8, h=7, fleet=f)


def staleness_dashboard() -> Json:
    """The detailed dashboard: one or a few runs, every view of the table."""
    s = SCOPE
    bound = Target(s.gauge("max_staleness"), "{{run}} bound")
    grid = Grid()
    _overview(grid, s, bound)
    _token_staleness(grid, s, bound)
    _rollout_staleness(grid, s, bound)
    _oldest_vs_newest(grid, s)
    _drops(grid, s)
    _pipeline_health(grid, s)
    _per_env(grid, s)
    _what_staleness_costs(grid, s, FLEET_WIDE)
    _choosing_the_bound(grid, s, bound)
    return _dashboard(
        "rl-staleness",
        "RL staleness",
        "How stale the data of asynchronous RL training is, where the age comes from and what the "
        "staleness policy masked and dropped. Generated by `staleness-metrics dashboards`.",
        grid.panels,
        ("rl-staleness-fleet", "RL staleness fleet"),
    )


def fleet_dashboard() -> Json:
    """The compact dashboard: many runs side by side."""
    s = SCOPE
    grid = Grid()
    columns: list[tuple[str, str, Target]] = [
        ("Train step", "none", Target(s.gauge("train_step"))),
        ("Ships/min", PER_MINUTE, Target(_ships_per_minute(s))),
        ("Bound", VERSIONS, Target(s.gauge("max_staleness"))),
        ("Token mean", VERSIONS, Target(s.gauge("token_mean"))),
        ("Token p99", VERSIONS, Target(s.quantile(0.99, "token_staleness"))),
        ("Masked", RATIO, Target(s.ratio("tokens_masked", "tokens_sampled"))),
        ("Rollout max", VERSIONS, Target(s.gauge("rollout_max"))),
        ("Dropped rollouts/step", PER_STEP, Target(s.per_step("rollouts_dropped"))),
        ("Held", COUNT, Target(s.gauge("rollouts_held"))),
        ("Label coverage", RATIO, Target(_label_coverage(s))),
        ("Export errors/s", PER_SECOND, Target(s.rate("export_errors"))),
        ("Excess k3", NATS, Target(s.excess_k3())),
        ("Suggested bound", VERSIONS, Target(s.gauge("bound_suggested"))),
        ("Excess at bound", NATS, Target(s.gauge("bound_excess_at_bound"))),
        ("Trained length", TOKENS, Target(s.trained_length_mean())),
    ]
    grid.add(
        table(
            "Runs",
            "One line per run: the last shipped batch's gauges and the rates over the dashboard's rate window.",
            [(name, unit, Target(t.expr, "", instant=True, table=True)) for name, unit, t in columns],
        ),
        w=24,
        h=9,
    )
    for title, description, unit, targets, top in (
        (
            "Token staleness mean",
            "Mean token staleness of each run's last shipped batch.",
            VERSIONS,
            [Target(s.gauge("token_mean"))],
            None,
        ),
        (
            "Masked tokens",
            "Share of shipped sampled tokens masked for staleness, per run, over the rate window.",
            RATIO,
            [Target(s.ratio("tokens_masked", "tokens_sampled"))],
            1.0,
        ),
        (
            "Rollout staleness max",
            "Largest rollout staleness of each run's last shipped batch.",
            VERSIONS,
            [Target(s.gauge("rollout_max"))],
            None,
        ),
        (
            "Dropped rollouts per step",
            "Live rollouts dropped for staleness per train step, per run.",
            PER_STEP,
            [Target(s.per_step("rollouts_dropped"))],
            None,
        ),
        ("Ships per minute", _SHIPS_NOTE, PER_MINUTE, [Target(_ships_per_minute(s))], None),
        (
            "Fleet token staleness quantiles",
            "p50 / p90 / p99 of token staleness over all selected runs, "
            "from summed histogram buckets (exact merge, never averaged per-run quantiles).",
            VERSIONS,
            [Target(FLEET_WIDE.quantile(q, "token_staleness"), name) for q, name in _QUANTILES],
            None,
        ),
    ):
        grid.add(timeseries(title, description, unit, targets, minimum=0, maximum=top), w=8, h=7)
    _fleet_costs(grid, s)
    _fleet_bounds(grid, s)
    return _dashboard(
        "rl-staleness-fleet",
        "RL staleness fleet",
        "Many asynchronous RL runs side by side: staleness, masking, drops and pipeline health per run. "
        "Generated by `staleness-metrics dashboards`.",
        grid.panels,
        ("rl-staleness", "RL staleness"),
    )


DASHBOARDS = {"staleness.json": staleness_dashboard, "staleness-fleet.json": fleet_dashboard}
