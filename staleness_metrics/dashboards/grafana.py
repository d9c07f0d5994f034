"""The Grafana dashboards as plain dicts, built from the metric table: ``staleness`` (a few runs in
detail) and ``staleness-fleet`` (many runs side by side)."""

from __future__ import annotations

from collections.abc import Callable

from . import panels
from .panels import NATS, PER_MINUTE, PER_SECOND, PER_STEP, RATIO, VERSIONS, Grid, Json, Target
from .promql import Scope

SCOPE = Scope(  # every dashboard query's selectors; gauges pick env="" themselves (promql.Scope)
    matchers=('job=~"$job"', 'instance=~"$instance"', 'run=~"$run"'),
    env="$env",
    by=("run",),
    window="$__rate_interval",
)
FLEET_WIDE = Scope(matchers=SCOPE.matchers, env=SCOPE.env, by=(), window=SCOPE.window)

_QUANTILES = ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"))


def _no_env_label(expr: str) -> str:
    """Names the rollouts without env in legends (``_NO_ENV_LEGEND``): their series have no env label, and
    a label of its own keeps them apart from an env a user called "(no env)"."""
    return f'label_replace({expr}, "no_env", "(no env)", "env", "")'


_NO_ENV_LEGEND = "{{run}} {{env}}{{no_env}}"


def _ships_per_minute(scope: Scope) -> str:
    return f"{scope.steps_per_second()} * 60"


def _label_coverage(scope: Scope) -> str:
    return f"1 - ({scope.ratio('tokens_unlabelled', 'tokens_sampled')})"


_SHIPS_NOTE = (
    "Train steps per minute, from how fast the train step gauge advances; one ship per step makes it the ship rate."
)


def _overview(grid: Grid, s: Scope, bound: Target) -> None:
    grid.row("Overview")

    def stat(title: str, about: str, unit: str, target: Target, decimals: int | None = None) -> None:
        grid.add(panels.stat(title, about, unit, target, decimals=decimals), (4, 4))

    step = Target(s.gauge("train_step"))
    stat("Train step", "Train step of the last shipped batch.", "none", step, 0)
    stat("Ships per minute", _SHIPS_NOTE, PER_MINUTE, Target(_ships_per_minute(s)))
    stat(
        "Token staleness (mean)",
        "Mean token staleness of the last shipped batch, in policy versions.",
        VERSIONS,
        Target(s.gauge("token_mean")),
    )
    stat(
        "Masked tokens",
        "Share of shipped sampled tokens masked for staleness, over the dashboard's rate window.",
        RATIO,
        Target(s.ratio("tokens_masked", "tokens_sampled")),
    )
    stat(
        "Rollout staleness (max)",
        "Largest rollout staleness of the last shipped batch (equals the largest token staleness).",
        VERSIONS,
        Target(s.gauge("rollout_max")),
        0,
    )
    stat("Staleness bound", "The configured max_staleness.", VERSIONS, bound, 0)


def _runs(query: Callable[[str], str], **legends: str) -> list[Target]:
    """A target per ``row=legend``, the row read by ``query``, the legend after the run's name."""
    return [Target(query(name), f"{{{{run}}}} {legend}") for name, legend in legends.items()]


def _quantiles(s: Scope, histogram: str) -> list[Target]:
    return [Target(s.quantile(q, histogram), f"{{{{run}}}} {name}") for q, name in _QUANTILES]


def _token_staleness(grid: Grid, s: Scope, bound: Target) -> None:
    grid.row("Token staleness")
    grid.series(
        "Token staleness mean vs bound",
        "Mean token staleness of each shipped batch (overall series, every env), with the "
        "configured max_staleness drawn dashed.",
        VERSIONS,
        [Target(s.gauge("token_mean"), "{{run}} mean"), bound],
        overrides=[panels.bound_override()],
    )
    grid.series(
        "Token staleness quantiles",
        "p50 / p90 / p99 of token staleness from the histogram over the rate window. PromQL "
        "interpolates inside integer buckets, so a value lies in (q-1, q] of the exact quantile q.",
        VERSIONS,
        _quantiles(s, "token_staleness"),
    )
    grid.add(
        panels.heatmap(
            "Token staleness distribution",
            "Shipped sampled tokens per staleness bucket and rate window, summed over the selected "
            "runs. Cells above the bound are masked tokens.",
            VERSIONS,
            Target(s.bucket_increase("token_staleness"), "{{le}}", fmt="heatmap"),
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
    grid.row("Rollout staleness")
    grid.series(
        "Rollout staleness mean and max vs bound",
        "Rollout staleness R = T - min(version) of the last shipped batch: mean and max, with "
        "the configured max_staleness drawn dashed.",
        VERSIONS,
        [*_runs(s.gauge, rollout_mean="mean", rollout_max="max"), bound],
        overrides=[panels.bound_override()],
    )
    grid.series(
        "Rollout staleness quantiles",
        "p50 / p90 / p99 of rollout staleness from the histogram over the rate window "
        "(interpolated inside integer buckets).",
        VERSIONS,
        _quantiles(s, "rollout_staleness"),
    )
    in_flight_vs_queue = panels.timeseries(
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
        _runs(s.gauge, rollout_in_flight_max="in flight", rollout_in_queue_max="in queue"),
    )
    grid.series(
        "Held rollouts",
        "Rollouts held back at the last ship while their group waits for re-rollouts (xtuner "
        "policy with retry_expired); always 0 for other policies.",
        panels.COUNT,
        [Target(s.gauge("rollouts_held"))],
    )
    grid.series(  # by its oldest and by its newest token, to compare frameworks' headlines
        "Rollout staleness: oldest vs newest token",
        "Rollout staleness of the last shipped batch by its oldest token (R = T - "
        "min(version), prime-rl's headline) and by its newest token (T - max(version), verl's "
        "trajectory staleness). The gap is how many versions one rollout spans.",
        VERSIONS,
        [
            *_runs(s.gauge, rollout_mean="oldest mean", rollout_newest_mean="newest mean"),
            *_runs(s.gauge, rollout_max="oldest max", rollout_newest_max="newest max"),
        ],
        (24, 8),
    )


def _drops(grid: Grid, s: Scope) -> None:
    grid.row("Drops")
    grid.series(
        "Dropped per step",
        "Live rollouts and samples dropped for staleness per train step, from the counters "
        "over the rate window (no point while the train step does not advance).",
        PER_STEP,
        _runs(s.per_step, rollouts_dropped="rollouts", samples_dropped="samples"),
    )
    grid.series(
        "Token accounting",
        "Tokens per second: sampled tokens of shipped samples, those of them masked, and "
        "tokens of samples dropped whole.",
        PER_SECOND,
        _runs(s.rate, tokens_sampled="shipped", tokens_masked="masked", tokens_dropped="dropped"),
    )


def _pipeline_health(grid: Grid, s: Scope) -> None:
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
        [Target(s.rate("export_errors", extra_by=("exporter",)), "{{run}} {{exporter}}")],
    )


def _per_env(grid: Grid, s: Scope) -> None:
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
        [Target(masked, _NO_ENV_LEGEND)],
        maximum=1,
    )
    grid.series(
        "Dropped rollouts per env",
        "Live rollouts dropped for staleness per second, per env.",
        PER_SECOND,
        [Target(_no_env_label(s.rate("rollouts_dropped", extra_by=("env",))), _NO_ENV_LEGEND)],
    )


# -- the rows on what staleness costs and on choosing the bound (SPEC 11, 12 and 14) --

_COST_NOTE = (
    "From rates of the trainer-vs-sampler mismatch sums (SPEC 11), summed over processes before "
    "dividing, so the value is the merged run's over the rate window."
)
_FLOOR_NOTE = (
    "The floor is each run's SPEC 14 floor (rl_staleness_mismatch_floor_nats, its latest ship's): "
    "the k3 of that ship's lag-0 tokens, carried from an earlier ship that had them, or the k3 of "
    "the smallest lag with enough tokens (an upper bound, so the excess is then a lower bound). "
    "Over one ship this is the ship's excess_k3 key; over a longer window, the token-weighted mean "
    "of its ships' excess over the latest floor."
)
_LENGTH_NOTE = (
    "Over shipped live samples plus samples dropped for staleness (SPEC 12), from rates of the length counters."
)


def _excess_heatmap(merged: Scope, whose: str) -> Json:
    """Excess k3 over the floor: a row per lag bucket from 1, a column per rate window."""
    return panels.heatmap(
        "Excess k3 over the floor by lag",
        f"Mean k3 of each lag bucket from 1 up minus the floor ({whose}, each run's tokens over "
        "its own floor): the engines' numeric mismatch, present with the same weights; the excess, "
        f"lag by lag, is what staleness costs. {_FLOOR_NOTE} {_COST_NOTE}",
        "short",
        Target(merged.excess_k3(by_lag=True), "{{lag}}"),
        rows="le",  # lag buckets are named by their largest lag
    )


def _length_bias(grid: Grid, s: Scope, fleet: Scope | None = None) -> None:
    grid.series(
        "Trained vs sampled mean length",
        "Mean sampled length of the samples per ship window, and the same with masked "
        "positions and dropped samples counted as 0: a gap that grows is masking and drops "
        f"cutting long responses. {_LENGTH_NOTE}",
        panels.TOKENS,
        [
            Target(s.sampled_length_mean(), "{{run}} sampled"),
            Target(s.trained_length_mean(), "{{run}} trained"),
        ],
    )
    by_length = fleet or s
    legend = "{{length}}" if fleet is not None else "{{run}} {{length}}"
    grid.series(
        "Removed share by length bucket" + (" (fleet)" if fleet is not None else ""),
        "Share of sampled positions masked or dropped for staleness, over samples whose "
        "sampled length falls in each bucket (256, 1k, 4k, 16k, inf): staleness rules remove "
        f"more of long responses. {_LENGTH_NOTE}",
        RATIO,
        [Target(by_length.removed_share_by_length(), legend)],
        maximum=1,
    )


def what_staleness_costs(grid: Grid, s: Scope, merged: Scope) -> None:
    """SPEC 11 and 12: the policy mismatch by token lag and the length bias of masking."""
    grid.row("What staleness costs")
    grid.series(
        "Mismatch k3 by lag",
        "Mean k3 = r - 1 - log r (prime-rl's mismatch_kl) between trainer and sampler "
        f"log-probabilities, per token lag bucket. {_COST_NOTE}",
        NATS,
        [Target(s.per_lag_token("mismatch_kl"), "{{run}} lag {{lag}}")],
        minimum=None,
    )
    grid.add(_excess_heatmap(merged, "the selected runs merged"))
    grid.series(
        "Excess k3 of stale tokens",
        "Mean k3 of every token at lag 1 or more minus the run's floor: one number for what "
        f"staleness costs the run. {_FLOOR_NOTE} {_COST_NOTE}",
        NATS,
        [Target(s.excess_k3(), "{{run}}")],
        minimum=None,
    )
    grid.series(
        "Effective sample size by lag",
        "Normalised ESS (Σr)² / (n Σr²) of the importance ratios per lag bucket: 1 "
        "when trainer and sampler agree, towards 0 when a few tokens dominate the "
        f"corrected gradient. {_COST_NOTE}",
        RATIO,
        [Target(s.ess_by_lag(), "{{run}} lag {{lag}}")],
        maximum=1,
    )
    grid.series(
        "Out-of-band share by lag",
        "Share of covered tokens whose importance ratio lies outside the "
        "mismatch band (default [0.5, 2]), per lag bucket: the tokens a ratio "
        f"clip or mask would cut. {_COST_NOTE}",
        RATIO,
        [Target(s.per_lag_token("mismatch_out_of_band"), "{{run}} lag {{lag}}")],
        maximum=1,
    )
    _length_bias(grid, s)


_BOUND_NOTE = (
    "SPEC 14, from the gauges of the last ship with trainer-vs-sampler sums: the curve is the "
    "excess k3 over the floor by lag, pooled over the last cost_window ships and made "
    "non-decreasing; the budget is mismatch_budget, or the floor."
)


def choosing_the_bound(grid: Grid, s: Scope, bound: Target) -> None:
    """SPEC 14: the excess curve against the budget, the configured and suggested bounds."""
    grid.row("Choosing the bound")
    grid.series(
        "Excess curve by lag vs budget",
        "The excess curve at each lag (one line per lag), the budget drawn dashed red, and the "
        "curve at the two bounds: at the configured bound (what the bound lets train; above "
        "the budget, the bound is too loose) and at the suggested bound (the largest lag "
        f"within the budget). {_BOUND_NOTE}",
        NATS,
        [
            Target(s.gauge("mismatch_curve", extra_by=("lag",)), "{{run}} lag {{lag}}"),
            Target(s.gauge("mismatch_budget"), "{{run}} budget"),
            Target(s.gauge("bound_excess_at_bound"), "{{run}} at the configured bound"),
            Target(s.curve_at_suggested(), "{{run}} at the suggested bound"),
        ],
        overrides=[panels.bound_override("budget"), *_marked_overrides()],
    )
    grid.series(
        "Suggested vs configured bound",
        "The bound the curve suggests against the configured max_staleness (dashed red). Below "
        "it while the curve crosses the budget: the bound lets train tokens that cost more "
        "than the budget; 2 or more above it while tokens are masked: the bound masks tokens "
        f"that cost less. {_BOUND_NOTE}",
        VERSIONS,
        [Target(s.gauge("bound_suggested"), "{{run}} suggested"), bound],
        overrides=[panels.bound_override()],
    )
    grid.series(
        "Floor by source",
        "The engines' numeric mismatch the excess is measured against, labelled by where it "
        "came from: lag0 (this ship's lag-0 tokens), carried (an earlier ship's, within "
        "floor_max_age) or min_lag (the smallest lag with enough tokens: an upper bound on the "
        "floor, so the excess is a lower bound).",
        NATS,
        [Target(s.gauge("mismatch_floor", extra_by=("source",)), "{{run}} {{source}}")],
    )
    grid.series(
        "Floor age and budget crossed",
        "Steps since the ship that measured the floor (a carried floor ages until "
        "floor_max_age), and 1 when the curve crosses the budget at some lag (the suggestion "
        "is where), else 0 (the suggestion is only the largest lag seen).",
        panels.COUNT,
        _runs(s.gauge, mismatch_floor_age="floor age (steps)", bound_crossed="crossed"),
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


def fleet_bounds(grid: Grid, s: Scope) -> None:
    """SPEC 14 per run: suggested vs configured, and the excess at the bound vs the budget."""
    grid.row("Choosing the bound", (12, 7))
    grid.series(
        "Suggested vs configured bound per run",
        f"Each run's suggested bound and its configured max_staleness (dashed red). {_BOUND_NOTE}",
        VERSIONS,
        _runs(s.gauge, bound_suggested="suggested", max_staleness="bound"),
        overrides=[panels.bound_override()],
    )
    grid.series(
        "Excess at the bound vs budget per run",
        "Each run's excess curve at its configured bound against its budget (dashed red): "
        f"above it, the bound lets train tokens that cost more than the budget. {_BOUND_NOTE}",
        NATS,
        _runs(s.gauge, bound_excess_at_bound="at the configured bound", mismatch_budget="budget"),
        overrides=[panels.bound_override("budget"), *_marked_overrides()[:1]],
    )


def fleet_costs(grid: Grid, s: Scope, f: Scope) -> None:
    """What staleness costs: per run (``s``), and merged over every selected run (``f``)."""
    grid.row("What staleness costs", (8, 7))
    grid.series(
        "Excess k3 of stale tokens per run",
        f"Mean k3 of the tokens at lag 1 or more minus the run's floor, per run. {_FLOOR_NOTE} {_COST_NOTE}",
        NATS,
        [Target(s.excess_k3())],
        minimum=None,
    )
    grid.add(_excess_heatmap(f, "every selected run merged"))
    grid.series(
        "Fleet mismatch k3 by lag",
        f"Mean k3 per lag bucket over every selected run. {_COST_NOTE}",
        NATS,
        [Target(f.per_lag_token("mismatch_kl"), "lag {{lag}}")],
        minimum=None,
    )
    grid.series(
        "Fleet effective sample size by lag",
        f"Normalised ESS (Σr)² / (n Σr²) per lag bucket over every selected run. {_COST_NOTE}",
        RATIO,
        [Target(f.ess_by_lag(), "lag {{lag}}")],
        maximum=1,
    )
    grid.series(
        "Fleet out-of-band share by lag",
        f"Share of covered tokens with an importance ratio outside the band, per lag bucket. {_COST_NOTE}",
        RATIO,
        [Target(f.per_lag_token("mismatch_out_of_band"), "lag {{lag}}")],
        maximum=1,
    )
    _length_bias(grid, s, f)


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
    return panels.dashboard(
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
        ("Held", panels.COUNT, Target(s.gauge("rollouts_held"))),
        ("Label coverage", RATIO, Target(_label_coverage(s))),
        ("Export errors/s", PER_SECOND, Target(s.rate("export_errors"))),
        ("Excess k3", NATS, Target(s.excess_k3())),
        ("Suggested bound", VERSIONS, Target(s.gauge("bound_suggested"))),
        ("Excess at bound", NATS, Target(s.gauge("bound_excess_at_bound"))),
        ("Trained length", panels.TOKENS, Target(s.trained_length_mean())),
    ]
    grid.add(
        panels.table(
            "Runs",
            "One line per run: the last shipped batch's gauges and the rates over the dashboard's "
            "rate window; the excess k3 is over each run's floor (SPEC 14: measured at lag 0, "
            "carried, or the smallest lag's).",
            [(name, unit, Target(t.expr, "", instant=True, fmt="table")) for name, unit, t in columns],
        ),
        (24, 9),
    )
    grid.size = (8, 7)  # the panels under the table, three to a line
    grid.series(
        "Token staleness mean",
        "Mean token staleness of each run's last shipped batch.",
        VERSIONS,
        [Target(s.gauge("token_mean"))],
    )
    grid.series(
        "Masked tokens",
        "Share of shipped sampled tokens masked for staleness, per run, over the rate window.",
        RATIO,
        [Target(s.ratio("tokens_masked", "tokens_sampled"))],
        maximum=1.0,
    )
    grid.series(
        "Rollout staleness max",
        "Largest rollout staleness of each run's last shipped batch.",
        VERSIONS,
        [Target(s.gauge("rollout_max"))],
    )
    grid.series(
        "Dropped rollouts per step",
        "Live rollouts dropped for staleness per train step, per run.",
        PER_STEP,
        [Target(s.per_step("rollouts_dropped"))],
    )
    grid.series("Ships per minute", _SHIPS_NOTE, PER_MINUTE, [Target(_ships_per_minute(s))])
    grid.series(
        "Fleet token staleness quantiles",
        "p50 / p90 / p99 of token staleness over all selected runs, "
        "from summed histogram buckets (exact merge, never averaged per-run quantiles).",
        VERSIONS,
        [Target(FLEET_WIDE.quantile(q, "token_staleness"), name) for q, name in _QUANTILES],
    )
    fleet_costs(grid, s, FLEET_WIDE)
    fleet_bounds(grid, s)
    return panels.dashboard(
        "rl-staleness-fleet",
        "RL staleness fleet",
        "Many asynchronous RL runs side by side: staleness, masking, drops and pipeline health per "
        "run. Generated by `staleness-metrics dashboards`.",
        grid.panels,
        ("rl-staleness", "RL staleness"),
    )


DASHBOARDS = {"staleness.json": staleness_dashboard, "staleness-fleet.json": fleet_dashboard}
