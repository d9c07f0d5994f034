"""Grafana dashboards as plain dicts, built from the metric table (the vLLM generator pattern):
``staleness`` (a few runs in detail) and ``staleness-fleet`` (many runs side by side), in the
panel language of :mod:`.panels` with queries from :mod:`.promql`.
"""

from __future__ import annotations

from .costs import choosing_the_bound, fleet_bounds, fleet_costs, what_staleness_costs
from .panels import (
    COUNT,
    NATS,
    PER_MINUTE,
    PER_SECOND,
    PER_STEP,
    RATIO,
    TOKENS,
    VERSIONS,
    Grid,
    Json,
    Target,
    bound_override,
    dashboard,
    heatmap,
    stat,
    table,
    timeseries,
)
from .promql import Scope

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
        (
            "Train step",
            "Train step of the last shipped batch.",
            "none",
            Target(s.gauge("train_step")),
            0,
        ),
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
        grid.add(stat(title, description, unit, target, decimals=decimals), (4, 4))


def _quantiles(s: Scope, histogram: str) -> list[Target]:
    return [Target(s.quantile(q, histogram), f"{{{{run}}}} {name}") for q, name in _QUANTILES]


def _token_staleness(grid: Grid, s: Scope, bound: Target) -> None:
    """Token staleness against the bound, its quantiles and distribution, and masking."""
    grid.row("Token staleness")
    grid.series(
        "Token staleness mean vs bound",
        "Mean token staleness of each shipped batch (overall series, every env), with the "
        "configured max_staleness drawn dashed.",
        VERSIONS,
        [Target(s.gauge("token_mean"), "{{run}} mean"), bound],
        overrides=[bound_override()],
    )
    grid.series(
        "Token staleness quantiles",
        "p50 / p90 / p99 of token staleness from the histogram over the rate "
        "window. PromQL interpolates inside integer buckets, so a value lies in "
        "(q-1, q] of the exact quantile q.",
        VERSIONS,
        _quantiles(s, "token_staleness"),
    )
    grid.add(
        heatmap(
            "Token staleness distribution",
            "Shipped sampled tokens per staleness bucket and rate window, summed over the selected "
            "runs. Cells above the bound are masked tokens.",
            VERSIONS,
            Target(s.bucket_increase("token_staleness"), "{{le}}", heatmap=True),
        )
    )
    grid.series(
        "Masked tokens",
        "Share of shipped sampled tokens masked for staleness: over the rate window from the "
        "counters, and for the last shipped batch.",
        RATIO,
        [
            Target(s.ratio("tokens_masked", "tokens_sampled"), "{{run}} over window"),
            Target(s.gauge("token_masked"), "{{run}} last ship"),
        ],
        maximum=1,
    )


def _rollout_staleness(grid: Grid, s: Scope, bound: Target) -> None:
    """Rollout staleness, where it comes from (in flight vs in queue), and held rollouts."""
    grid.row("Rollout staleness")
    grid.series(
        "Rollout staleness mean and max vs bound",
        "Rollout staleness R = T - min(version) of the last shipped batch: mean and max, with "
        "the configured max_staleness drawn dashed.",
        VERSIONS,
        [
            Target(s.gauge("rollout_mean"), "{{run}} mean"),
            Target(s.gauge("rollout_max"), "{{run}} max"),
            bound,
        ],
        overrides=[bound_override()],
    )
    grid.series(
        "Rollout staleness quantiles",
        "p50 / p90 / p99 of rollout staleness from the histogram over the rate window "
        "(interpolated inside integer buckets).",
        VERSIONS,
        _quantiles(s, "rollout_staleness"),
    )
    in_flight_vs_queue = timeseries(
        "In-flight vs in-queue staleness (mean) for $run",
        "Where the age of a rollout comes from: versions that passed while it was generated (in "
        "flight) and while it waited in the queue (in queue). Per rollout they add up to its "
        "staleness, so the stack is the rollout staleness mean. One panel per run.",
        VERSIONS,
        [
            Target(s.gauge("rollout_in_flight_mean"), "in flight"),
            Target(s.gauge("rollout_in_queue_mean"), "in queue"),
        ],
        stacked=True,
        minimum=0,
    )
    in_flight_vs_queue.update({"repeat": "run", "repeatDirection": "h", "maxPerRow": 4})
    grid.add(in_flight_vs_queue, (24, 8))
    grid.series(
        "In-flight vs in-queue staleness (max)",
        "Largest in-flight and in-queue staleness of the last shipped batch (maxima do not stack).",
        VERSIONS,
        [
            Target(s.gauge("rollout_in_flight_max"), "{{run}} in flight"),
            Target(s.gauge("rollout_in_queue_max"), "{{run}} in queue"),
        ],
    )
    grid.series(
        "Held rollouts",
        "Rollouts held back at the last ship while their group waits for re-rollouts (xtuner "
        "policy with retry_expired); always 0 for other policies.",
        COUNT,
        [Target(s.gauge("rollouts_held"))],
    )
    # By its oldest and by its newest token, for comparing frameworks' headlines.
    grid.series(
        "Rollout staleness: oldest vs newest token",
        "Rollout staleness of the last shipped batch by its oldest token (R = T - "
        "min(version), prime-rl's headline) and by its newest token (T - max(version), verl's "
        "trajectory staleness). The gap is how many versions one rollout spans.",
        VERSIONS,
        [
            Target(s.gauge("rollout_mean"), "{{run}} oldest mean"),
            Target(s.gauge("rollout_newest_mean"), "{{run}} newest mean"),
            Target(s.gauge("rollout_max"), "{{run}} oldest max"),
            Target(s.gauge("rollout_newest_max"), "{{run}} newest max"),
        ],
        (24, 8),
    )


def _drops(grid: Grid, s: Scope) -> None:
    """What the policy threw away."""
    grid.row("Drops")
    grid.series(
        "Dropped per step",
        "Live rollouts and samples dropped for staleness per train step, from the counters "
        "over the rate window (no point while the train step does not advance).",
        PER_STEP,
        [
            Target(s.per_step("rollouts_dropped"), "{{run}} rollouts"),
            Target(s.per_step("samples_dropped"), "{{run}} samples"),
        ],
    )
    grid.series(
        "Token accounting",
        "Tokens per second: sampled tokens of shipped samples, those of them masked, and "
        "tokens of samples dropped whole.",
        PER_SECOND,
        [
            Target(s.rate("tokens_sampled"), "{{run}} shipped"),
            Target(s.rate("tokens_masked"), "{{run}} masked"),
            Target(s.rate("tokens_dropped"), "{{run}} dropped"),
        ],
    )


def _pipeline_health(grid: Grid, s: Scope) -> None:
    """Is the pipeline moving, labelled and exporting?"""
    grid.row("Pipeline health", (8, 8))
    grid.series("Ships per minute", _SHIPS_NOTE, PER_MINUTE, [Target(_ships_per_minute(s))])
    grid.series(
        "Label coverage",
        "Share of shipped sampled tokens that carried a policy-version label; unlabelled ones "
        "take their rollout's dispatch version (the oldest, conservative choice).",
        RATIO,
        [Target(_label_coverage(s))],
        maximum=1,
    )
    grid.series(
        "Export errors",
        "Failed exports per second, per exporter. Exporters never raise into training, so this is where failures show.",
        PER_SECOND,
        [Target(_export_errors(s), "{{run}} {{exporter}}")],
    )


def _per_env(grid: Grid, s: Scope) -> None:
    """The same views split by env."""
    grid.row("Per env", (8, 8))
    grid.series(
        "Token staleness mean per env",
        "Mean token staleness of the last shipped batch per env (exported when the env breakdown is on).",
        VERSIONS,
        [Target(s.gauge("token_mean", per_env=True), "{{run}} {{env}}")],
    )
    masked = _no_env_label(s.ratio("tokens_masked", "tokens_sampled", extra_by=("env",)))
    grid.series(
        "Masked tokens per env",
        "Share of shipped sampled tokens masked for staleness per env, over the rate window.",
        RATIO,
        [Target(masked, "{{run}} {{env}}")],
        maximum=1,
    )
    dropped = _no_env_label(s.rate("rollouts_dropped", extra_by=("env",)))
    grid.series(
        "Dropped rollouts per env",
        "Live rollouts dropped for staleness per second, per env.",
        PER_SECOND,
        [Target(dropped, "{{run}} {{env}}")],
    )


def staleness_dashboard() -> Json:
    """The detailed dashboard: one or a few runs, every view of the table."""
    s = SCOPE
    bound = Target(s.gauge("max_staleness"), "{{run}} bound")
    grid = Grid()
    _overview(grid, s, bound)
    _token_staleness(grid, s, bound)
    _rollout_staleness(grid, s, bound)
    _drops(grid, s)
    _pipeline_health(grid, s)
    _per_env(grid, s)
    what_staleness_costs(grid, s, FLEET_WIDE)
    choosing_the_bound(grid, s, bound)
    return dashboard(
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
            "One line per run: the last shipped batch's gauges and the rates over the dashboard's "
            "rate window; the excess k3 is over each run's floor (SPEC 14: measured at lag 0, "
            "carried, or the smallest lag's).",
            [(name, unit, Target(t.expr, "", instant=True, table=True)) for name, unit, t in columns],
        ),
        (24, 9),
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
        grid.series(title, description, unit, targets, (8, 7), maximum=top)
    fleet_costs(grid, s, FLEET_WIDE)
    fleet_bounds(grid, s)
    return dashboard(
        "rl-staleness-fleet",
        "RL staleness fleet",
        "Many asynchronous RL runs side by side: staleness, masking, drops and pipeline health per "
        "run. Generated by `staleness-metrics dashboards`.",
        grid.panels,
        ("rl-staleness", "RL staleness"),
    )


DASHBOARDS = {"staleness.json": staleness_dashboard, "staleness-fleet.json": fleet_dashboard}
