"""The dashboards' rows on what staleness costs and on choosing the bound (SPEC 11, 12 and 14)."""

from __future__ import annotations

from .panels import (
    COUNT,
    NATS,
    RATIO,
    TOKENS,
    VERSIONS,
    Grid,
    Json,
    Target,
    bound_override,
    heatmap,
)
from .promql import Scope

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
    """Excess k3 over the floor: one row per lag bucket from 1, one column per rate window."""
    return heatmap(
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
        TOKENS,
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
    """SPEC 14: the excess curve against the budget, the configured and suggested
    bounds, and the floor."""
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
        overrides=[bound_override("budget"), *_marked_overrides()],
    )
    grid.series(
        "Suggested vs configured bound",
        "The bound the curve suggests against the configured max_staleness (dashed red). Below "
        "it while the curve crosses the budget: the bound lets train tokens that cost more "
        "than the budget; 2 or more above it while tokens are masked: the bound masks tokens "
        f"that cost less. {_BOUND_NOTE}",
        VERSIONS,
        [Target(s.gauge("bound_suggested"), "{{run}} suggested"), bound],
        overrides=[bound_override()],
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
        COUNT,
        [
            Target(s.gauge("mismatch_floor_age"), "{{run}} floor age (steps)"),
            Target(s.gauge("bound_crossed"), "{{run}} crossed"),
        ],
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
    """SPEC 14 per run: suggested vs configured, and the curve at the configured
    bound against the budget."""
    grid.row("Choosing the bound", (12, 7))
    grid.series(
        "Suggested vs configured bound per run",
        f"Each run's suggested bound and its configured max_staleness (dashed red). {_BOUND_NOTE}",
        VERSIONS,
        [
            Target(s.gauge("bound_suggested"), "{{run}} suggested"),
            Target(s.gauge("max_staleness"), "{{run}} bound"),
        ],
        overrides=[bound_override()],
    )
    grid.series(
        "Excess at the bound vs budget per run",
        "Each run's excess curve at its configured bound against its budget (dashed red): "
        f"above it, the bound lets train tokens that cost more than the budget. {_BOUND_NOTE}",
        NATS,
        [
            Target(s.gauge("bound_excess_at_bound"), "{{run}} at the configured bound"),
            Target(s.gauge("mismatch_budget"), "{{run}} budget"),
        ],
        overrides=[bound_override("budget"), *_marked_overrides()[:1]],
    )


def fleet_costs(grid: Grid, s: Scope, fleet: Scope) -> None:
    """What staleness costs across the fleet: per run, and merged over every selected run."""
    f = fleet
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
