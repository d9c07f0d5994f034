"""The report page: one self-contained HTML file (inline CSS and SVG; no script, no fetch),
with its sections on what staleness costs (SPEC 11, 12) and on choosing the bound (SPEC 14)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from html import escape
from importlib import resources
from typing import Any, NamedTuple

import numpy as np

from .. import __version__
from ..metrics import keys
from ..metrics.buckets import HISTOGRAM_TOP, LAG_BUCKETS
from ..metrics.metric_table import MISMATCH_KEY_PREFIX
from ..replay.sources.prime_rl import ComparisonRow, comparison_summary
from ..replay.what_if import MAX_BOUNDS, RunCurve, WhatIfRow
from .data import ReportData
from .svg import PALETTE, Rule, Series, bar_chart, figure, heatmap, line_chart, message_chart, steps_per_column

# Nothing may load from anywhere: the page is readable offline and leaks nothing when opened.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # not UTF-8: a name's stray byte, a "\\ud800"

# the page's style (data/report.css), inlined: the page loads nothing
_STYLE = resources.files("staleness_metrics").joinpath("data/report.css").read_text(encoding="utf-8")


def _num(value: float | int | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{int(value):,}" if isinstance(value, int) or float(value).is_integer() else f"{value:.{digits}g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _quantile(histogram: np.ndarray, q: float, largest: int | None) -> str:
    """SPEC 6's nearest rank over the run's tokens. The last bucket holds every staleness from
    HISTOGRAM_TOP up: of those only the largest (the largest rollout staleness) is known."""
    total = int(histogram.sum())
    rank = max(1, math.ceil(q * total))
    index = int(np.searchsorted(np.cumsum(histogram), rank))
    if total == 0 or index < HISTOGRAM_TOP:
        return _num(index if total else None)
    return _num(largest) if rank == total and largest is not None else f"&ge; {HISTOGRAM_TOP:,}"


def _summary(data: ReportData) -> str:
    cells: list[tuple[str, str]] = [("steps shipped", _num(data.steps_shipped))]
    maxima = [r[keys.ROLLOUT_MAX] for r in data.rows if keys.ROLLOUT_MAX in r]
    if data.totals is not None:
        t = data.totals
        # the ships' own means by their tokens (the histogram stops at HISTOGRAM_TOP)
        ships = zip(data.rows, data.histograms or [], strict=True)
        weights = [(r[keys.TOKEN_MEAN], int(h.sum())) for r, h in ships if keys.TOKEN_MEAN in r]
        tokens = sum(n for _, n in weights)
        mean = sum(m * n for m, n in weights) / tokens if tokens else None
        masked = t.tokens_masked / t.tokens_sampled if t.tokens_sampled else None
        cells += [
            ("live rollouts shipped", _num(t.rollouts_shipped)),
            ("frozen rollouts shipped", _num(t.rollouts_frozen)),
            ("rollouts dropped", _num(t.rollouts_dropped)),
            ("sampled tokens shipped", _num(t.tokens_sampled)),
            ("tokens masked", _pct(masked)),
            ("token staleness mean", _num(mean)),
            ("token staleness p99", _quantile(t.token_histogram, 0.99, max(maxima, default=None))),
        ]
    else:
        dropped = sum(int(r.get(keys.ROLLOUTS_DROPPED, 0)) for r in data.rows)
        cells += [("rollouts dropped", _num(dropped))]
    cells.append(("largest rollout staleness", _num(max(maxima)) if maxima else "-"))
    return '<div class="summary">' + "".join(f"<div>{escape(k)}<b>{v}</b></div>" for k, v in cells) + "</div>"


class _Line(NamedTuple):
    name: str
    key: str
    colour: str
    dashed: bool = False


class _Chart(NamedTuple):
    """A figure over the steps: a bar chart when ``options`` say ``stacked``, else a line chart."""

    key: str  # the figure's id
    title: str  # its heading
    label: str  # the chart's aria-label
    lines: tuple[_Line, ...]
    caption: str
    options: dict[str, Any]


def _over_steps(data: ReportData, chart: _Chart, series: Sequence[Series] = (), **more: Any) -> str:
    """``chart`` drawn from the rows (``series`` instead of its lines when given)."""
    drawn = series or [Series(n, data.series(k), c, d) for n, k, c, d in chart.lines]
    draw: Callable[..., str] = bar_chart if "stacked" in chart.options else line_chart
    svg = draw(chart.label, data.steps, drawn, **chart.options, **more)
    return figure(chart.key, chart.title, chart.caption, svg)


_TOKEN_STALENESS = _Chart(
    "token-staleness",
    "Token staleness",
    "Token staleness over steps",
    (
        _Line("mean", keys.TOKEN_MEAN, PALETTE[0]),
        _Line("p50", keys.TOKEN_P50, PALETTE[2], dashed=True),
        _Line("p90", keys.TOKEN_P90, PALETTE[1], dashed=True),
        _Line("p99", keys.TOKEN_P99, PALETTE[4], dashed=True),
        # SPEC 6: the largest token staleness is the largest rollout staleness.
        _Line("max", keys.ROLLOUT_MAX, PALETTE[5]),
    ),
    "Staleness of the shipped sampled tokens (trained version minus the version that "
    "sampled them), masked ones included; the max is the oldest rollout's. Tokens above the "
    "dashed bound are masked.",
    dict(y_label="policy versions"),
)
_BOUND_LINE = _Line("max_staleness", keys.MAX_STALENESS, "#d62728", dashed=True)  # when it adapted
_MASKED = _Chart(
    "masked",
    "Masked ratio",
    "Masked ratio over steps",
    (_Line("masked share", keys.TOKEN_MASKED, PALETTE[3]),),
    "Share of each shipped batch's sampled tokens masked for staleness (<code>staleness/token/masked</code>).",
    dict(y_label="share of sampled tokens", percent=True),
)
_IN_FLIGHT = _Chart(
    "in-flight-queue",
    "In flight vs in queue",
    "Rollout staleness: in flight and in queue",
    (
        _Line("in flight (mean)", keys.ROLLOUT_IN_FLIGHT_MEAN, PALETTE[0]),
        _Line("in queue (mean)", keys.ROLLOUT_IN_QUEUE_MEAN, PALETTE[1]),
    ),
    "Where a shipped rollout's age comes from: versions that passed while it was generated (in "
    "flight) and while it waited in the queue after it finished (in queue). Together they make "
    "the rollout staleness mean.",
    dict(stacked=True, y_label="policy versions", empty_note="every shipped rollout was fresh"),
)
_DROPPED = _Chart(
    "dropped-held",
    "Dropped and held",
    "Dropped and held counts over steps",
    (
        _Line("rollouts dropped", keys.ROLLOUTS_DROPPED, PALETTE[3]),
        _Line("samples dropped", keys.SAMPLES_DROPPED, PALETTE[5]),
        _Line("rollouts held", keys.ROLLOUTS_HELD, PALETTE[6]),
    ),
    "Rollouts and samples dropped for staleness, and rollouts held back, in each ship's window.",
    dict(stacked=False, y_label="count per ship window", empty_note="nothing was dropped or held"),
)


def _bounds(data: ReportData) -> list[int]:
    """Every bound of the run: the configured one and each step's (more than one: it adapted)."""
    return sorted({int(v) for v in [*data.series(keys.MAX_STALENESS), data.bound] if v is not None})


def _heatmap_chart(data: ReportData) -> str:
    label = "Token staleness histogram per step"
    if data.histograms is None:
        svg = message_chart(label, "needs rollouts: logged metrics carry no histogram")
    else:
        last, adapted = _bound_in_force(data), len(_bounds(data)) > 1  # the last step's bound
        svg = heatmap(label, data.steps, data.histograms, bound=last, adapted=adapted)
    per = steps_per_column(len(data.steps))
    span = "one step" if per == 1 else f"{per} consecutive steps summed (too many for one each)"
    caption = f"Each column is {span}; shaded by the share of its sampled tokens at each staleness."
    return figure("heatmap", "Token staleness histogram", caption, svg)


def _what_if_chart(data: ReportData) -> str:
    label = "What if the bound were different"
    rows = data.what_if
    if not rows:
        why = "needs rollouts: logged metrics cannot be replayed" if data.histograms is None else "no bounds given"
        svg = message_chart(label, why)
    else:
        not_trained = [None if r.kept_share is None else 1 - r.kept_share for r in rows]
        series = [
            Series("masked share of shipped tokens", [r.masked_ratio for r in rows], PALETTE[3]),
            Series("share not trained (masked or dropped)", not_trained, PALETTE[4]),
        ]
        marks = [Rule(data.bound, f"run: {data.bound}", "#56606b")] if data.bound is not None else []
        axes: dict[str, Any] = {"x_label": "max_staleness", "y_label": "share of sampled tokens"}
        svg = line_chart(label, [r.max_staleness for r in rows], series, percent=True, **axes, vertical_rules=marks)
    caption = "The same run replayed at each bound with the same policy: what would have been masked or dropped."
    return figure("what-if", "What-if: the bound", caption, svg) + _what_if_table(rows, data.bound)


def _what_if_table(rows: Sequence[WhatIfRow], bound: int | None) -> str:
    if not rows:
        return ""
    costs = any(r.trained_covered is not None for r in rows)  # trainer log-probs (SPEC 11)
    replayed = bound in {r.max_staleness for r in rows}
    head = (
        "<tr><th>max_staleness</th><th>masked</th><th>tokens kept</th><th>kept share</th>"
        "<th>rollouts dropped</th><th>samples dropped</th><th>rollouts shipped</th><th>held</th>"
        + ("<th>trained k3</th><th>trained excess k3</th>" if costs else "")
        + "</tr>"
    )
    body = "".join(
        f"<tr{' class=current' if r.max_staleness == bound else ''}><td>{r.max_staleness}</td>"
        f"<td>{_pct(r.masked_ratio)}</td><td>{_num(r.tokens_kept)}</td>"
        f"<td>{_pct(r.kept_share)}</td>"
        f"<td>{_num(r.rollouts_dropped)}</td><td>{_num(r.samples_dropped)}</td>"
        f"<td>{_num(r.rollouts_shipped)}</td><td>{_num(r.rollouts_held)}</td>"
        + (f"<td>{_num(r.trained_k3, 4)}</td><td>{_num(r.trained_excess_k3, 4)}</td>" if costs else "")
        + "</tr>"
        for r in rows
    )
    return (
        '<section class="panel" id="what-if-table"><h2>What-if table</h2>'
        "<p>Totals over the run"
        + ("; the highlighted row is the bound replayed above." if replayed else ".")
        + (
            " Trained k3: mean k3 of the covered tokens the bound lets train; excess: of those "
            "with lag &ge; 1 over the floor of the same tokens (SPEC 14: their lag-0 k3 when "
            "enough trained, else the k3 of the smallest lag with enough, an upper bound)."
            if costs
            else ""
        )
        + f"</p><table>{head}{body}</table></section>"
    )


def _comparison(rows: Sequence[ComparisonRow]) -> str:
    if not rows:
        return ""
    summary = comparison_summary(rows)
    steps = sorted({r.step for r in rows})
    approximate = any(r.legacy_key.startswith("mismatch_kl/") for r in rows)
    lines = [
        f"{len(summary['match'])} of {len(steps)} logged steps equal the recomputed values"
        + (" (mismatch_kl to within the rounding of the records)." if approximate else " exactly.")
    ]
    if summary["prime_rl_rule"]:
        notes = sorted({r.note for r in rows if r.status == "prime_rl_rule" and r.note})
        why = "; ".join(notes) or "prime-rl counts frozen-model episodes as staleness 0 (SPEC leaves them out)"
        steps_by_rule = ", ".join(map(str, summary["prime_rl_rule"]))
        lines.append(
            "Steps where the logged values differ only by prime-rl's own rule, recomputed from the "
            f"same records (column 'prime-rl rule'): {steps_by_rule}. Why: {why}."
        )
    for name, text in (("missing", "without a recomputed value"), ("mismatch", "that differ otherwise")):
        if summary[name]:
            lines.append(f"Steps {text}: {', '.join(map(str, summary[name]))}.")
    if approximate:
        lines.append(
            "mismatch_kl is prime-rl's trainer k3 per trained token (frozen samples included) from "
            "its full-precision log-probabilities; the records hold them rounded to 4 decimals, so "
            "these agree to within 5% (or 2e-5 nats), not exactly."
        )
    head = (
        "<tr><th>step</th><th>logged key</th><th>current key</th><th>logged</th><th>recomputed</th>"
        "<th>prime-rl rule</th><th>live / frozen</th><th>status</th></tr>"
    )

    def line(r: ComparisonRow) -> str:
        return (
            f"<tr><td>{r.step}</td><td>{escape(r.legacy_key)}</td><td>{escape(r.key)}</td>"
            f"<td>{_num(r.historical, 6)}</td><td>{_num(r.recomputed, 6)}</td>"
            f"<td>{_num(r.legacy_rule, 6)}</td>"
            f'<td>{r.live} / {r.frozen}</td><td class="{r.status}">{r.status.replace("_", " ")}</td></tr>'
        )

    differing = "".join(line(r) for r in rows if r.status != "match")
    return (
        '<section class="panel" id="comparison"><h2>Logged prime-rl values vs recomputed</h2>'
        + "".join(f"<p>{escape(t)}</p>" for t in lines)
        + (f"<table>{head}{differing}</table>" if differing else "")
        + f"<details><summary>All {len(rows)} values</summary>"
        + f"<table>{head}{''.join(line(r) for r in rows)}</table></details></section>"
    )


MAX_LAG_LINES = 6  # one colour per line, and a legend that fits the chart's width


def has_costs(data: ReportData) -> bool:
    """True when some row carries a SPEC 11 key: the section is drawn only then."""
    return any(key.startswith(MISMATCH_KEY_PREFIX) for row in data.rows for key in row)


def lag_buckets_shown(data: ReportData) -> list[str]:
    """The lag buckets drawn: the :data:`MAX_LAG_LINES` with most covered tokens, in lag order."""
    tokens = {b: sum(row.get(keys.MISMATCH_TOKENS_BY_LAG[b], 0) for row in data.rows) for b in LAG_BUCKETS}
    busiest = sorted((b for b in LAG_BUCKETS if tokens[b] > 0), key=lambda b: -tokens[b])[:MAX_LAG_LINES]
    return [b for b in LAG_BUCKETS if b in busiest]


# the buckets past 16 hold several lags
_LAG_NAMES = {"32": "lag 17-32", "64": "lag 33-64", "inf": "lag > 64"}


def _by_lag(data: ReportData, buckets: list[str], stat: Mapping[str, str], skip: str | None = None) -> list[Series]:
    """One line per bucket; a bucket keeps its colour from chart to chart."""
    return [
        Series(_LAG_NAMES.get(b, f"lag {b}"), data.series(stat[b]), PALETTE[i % len(PALETTE)])
        for i, b in enumerate(buckets)
        if b != skip
    ]


_K3_BY_LAG = _Chart(
    "mismatch-k3",
    "Mismatch by lag",
    "Mismatch k3 by token lag over steps",
    (),
    "Mean k3 = r - 1 - log r of the covered tokens of each lag (r = trainer / sampler "
    "probability; the estimator of prime-rl's <code>mismatch_kl</code>). Lag 0, when a step "
    "has it, shows the engines' numeric floor.",
    dict(y_label="nats"),
)
_ESS_BY_LAG = _Chart(
    "mismatch-ess",
    "ESS by lag",
    "Effective sample size by token lag over steps",
    (),
    "(Σr)² / (n Σr²) of each lag's importance ratios: 1 when trainer and sampler agree, "
    "falling as a few tokens' ratios dominate.",
    dict(y_label="normalised ESS", y_max=1.0),
)
_LENGTH_BIAS = _Chart(
    "length-bias",
    "Length bias",
    "Mean response length: sampled vs trained",
    (
        _Line("sampled", keys.LENGTH_SAMPLED_MEAN, PALETTE[0]),
        _Line("trained (masked and dropped count 0)", keys.LENGTH_TRAINED_MEAN, PALETTE[3]),
    ),
    "Long responses span more weight updates, so masking and drops remove more of them: the "
    "gap between the lines is the length bias of the bound (SPEC 12).",
    dict(y_label="sampled positions per sample"),
)
_REMOVED_BY_LENGTH = _Chart(
    "length-removed",
    "Removed share by length",
    "Removed share by response length",
    tuple(
        _Line(f"length {'> 16k' if b == 'inf' else '≤ ' + b}", key, colour)
        for (b, key), colour in zip(keys.LENGTH_REMOVED_SHARE_BY_LENGTH.items(), PALETTE)
    ),
    "Share of each length bucket's sampled tokens masked or dropped for staleness, per step.",
    dict(y_label="share masked or dropped", percent=True),
)


def _excess_chart(data: ReportData, buckets: list[str]) -> str:
    label = "Excess k3 over the floor, by lag"
    if not any(keys.MISMATCH_EXCESS_K3 in row for row in data.rows):
        svg = message_chart(label, "no step had a floor: too few tokens at lag 0 or at any lag (floor_min_tokens)")
    else:
        series = [
            Series("all stale tokens", data.series(keys.MISMATCH_EXCESS_K3), "#1d2329", dashed=True),
            *_by_lag(data, buckets, keys.MISMATCH_EXCESS_K3_BY_LAG, skip="0"),
        ]
        svg = line_chart(label, data.steps, series, y_label="nats above the floor")
    caption = (
        "What staleness costs: each lag's k3 minus the run's floor at that step (SPEC 14): the "
        "k3 of the step's lag-0 tokens, carried from an earlier step that had them (at most "
        "floor_max_age steps), or else the k3 of the smallest lag with enough tokens, an upper "
        "bound on the floor (the excess is then a lower bound). Near zero, stale tokens cost "
        "nothing beyond numerics; growing with the lag, the bound is letting in tokens the "
        "policy has moved away from."
    )
    return figure("mismatch-excess", "Excess mismatch by lag", caption, svg)


def render_costs(data: ReportData) -> str:
    """The section, or ``""`` when the run has no trainer log-probabilities."""
    if not has_costs(data):
        return ""
    buckets = lag_buckets_shown(data)
    charts = [
        _over_steps(data, _K3_BY_LAG, _by_lag(data, buckets, keys.MISMATCH_K3_BY_LAG)),
        _excess_chart(data, buckets),
        _over_steps(data, _ESS_BY_LAG, _by_lag(data, buckets, keys.MISMATCH_ESS_BY_LAG)),
        _over_steps(data, _LENGTH_BIAS),
        _over_steps(data, _REMOVED_BY_LENGTH),
    ]
    intro = (
        "Trainer and sampler log-probabilities compared token by token, split by token lag (SPEC "
        "11): the engines' numeric floor (SPEC 14: measured on lag-0 tokens, carried, or bounded "
        "by the smallest lag) and the excess over it, which is what staleness costs. Below, what "
        "the bound removed, by response length (SPEC 12)."
    )
    return (
        '<section id="what-staleness-costs"><h2>What staleness costs</h2>'
        f'<p class="meta">{intro}</p>{"".join(charts)}</section>'
    )


# -- Choosing the bound: the floor, the curve against the budget, what each bound keeps --

BUDGET_COLOUR = "#b00020"
CONFIGURED_COLOUR = "#56606b"
SUGGESTED_COLOUR = "#2ca02c"


def _bound_in_force(data: ReportData) -> int | None:
    """The bound of the run's last step (not the configured one when the bound adapted)."""
    used = [v for v in data.series(keys.MAX_STALENESS) if isinstance(v, (int, float))]
    return int(used[-1]) if used else data.bound


def _bound_label(data: ReportData) -> str:
    last = _bound_in_force(data)
    if last is not None and data.bound is not None and last != data.bound:
        return f"bound in force {last} (adapted from {data.bound})"
    return f"configured bound {last}"


def _bound_rules(data: ReportData, suggested: int | None) -> list[Rule]:
    bound = _bound_in_force(data)
    rules = [] if bound is None else [Rule(bound, _bound_label(data), CONFIGURED_COLOUR)]
    if suggested is not None:
        rules.append(Rule(suggested, f"suggested bound {suggested}", SUGGESTED_COLOUR))
    return rules


def _x_range(curve: RunCurve, bound: int | None, rows: list[WhatIfRow]) -> list[int]:
    """Every lag up to the largest drawn; past what a what-if may try, only those drawn."""
    drawn = {0, *curve.curve.lags, *(r.max_staleness for r in rows), bound or 0}
    return list(range(max(drawn) + 1)) if max(drawn) < MAX_BOUNDS else sorted(drawn)


def _curve_chart(data: ReportData, curve: RunCurve) -> str:
    label = "Excess mismatch by lag, pooled over the run"
    xs = _x_range(curve, _bound_in_force(data), data.what_if)
    at = {lag: i for i, lag in enumerate(curve.curve.lags)}

    def by_lag(values: tuple[float, ...]) -> list[float | None]:
        return [values[at[x]] if x in at else None for x in xs]

    notes = [f"{_tokens(curve.curve.tokens[at[x]])} tokens" if x in at else None for x in xs]
    fitted = Series("curve ê (isotonic)", by_lag(curve.curve.fitted), PALETTE[0], notes=notes)
    e = by_lag(curve.curve.raw)  # the measured points: drawn last, on top, each with its tokens
    raw = Series("raw excess e by lag", e, PALETTE[1], dashed=True, notes=notes, show_notes=True)
    budget = Rule(curve.budget, f"budget {curve.budget:.4g}", BUDGET_COLOUR)
    axes: dict[str, Any] = {"x_label": "token lag", "y_label": "nats above the floor"}
    bounds = _bound_rules(data, curve.suggested)
    svg = line_chart(label, xs, [fitted, raw], **axes, rules=[budget], vertical_rules=bounds)
    crossed = (
        "The curve crosses the budget: the suggestion is the largest lag within it."
        if curve.crossed
        else "The curve stays within the budget at every lag seen: the suggestion is only the "
        "largest lag seen, and a looser bound may be as good."
    )
    caption = (
        f"Each lag's k3 minus the run's floor ({curve.floor.value:.4g} nats, "
        f"{escape(curve.floor.source)}), over the run's sums pooled (from "
        f"{escape(data.curve_source)}); dashed, the raw excess of each lag with at least "
        "floor_min_tokens tokens, with the tokens behind it; solid, its isotonic fit (more lag "
        f"cannot make a token cheaper). The budget is {curve.budget:.4g} nats. {crossed}"
    )
    return figure("bound-curve", "Choosing the bound", caption, svg)


def _kept_chart(data: ReportData, curve: RunCurve) -> str:
    label = "Kept share per bound"
    rows = data.what_if
    if not rows:
        svg = message_chart(label, "needs rollouts: logged metrics cannot be replayed at other bounds")
    else:
        xs = _x_range(curve, _bound_in_force(data), rows)
        share = {r.max_staleness: r.kept_share for r in rows}
        kept = Series("share of sampled tokens that trains", [share.get(x) for x in xs], PALETTE[2])
        axes: dict[str, Any] = {"x_label": "max_staleness", "y_label": "kept share"}
        bounds = _bound_rules(data, curve.suggested)
        svg = line_chart(label, xs, [kept], **axes, percent=True, vertical_rules=bounds)
    caption = (
        "Beside the curve, on the same axis: the share of the run's sampled tokens each bound lets "
        "train (the run replayed at that bound). Between the bounds, the trade: what a looser "
        "bound keeps against what its tokens cost."
    )
    return figure("bound-kept", "What each bound keeps", caption, svg)


def _tokens(count: int) -> str:
    """A token count in a few characters: 950, 12.3k, 1.2M."""
    if count >= 1_000_000:
        return f"{count / 1_000_000:.3g}M"
    return f"{count / 1000:.3g}k" if count >= 1000 else str(count)


def _table(data: ReportData, curve: RunCurve) -> str:
    kept = {r.max_staleness: r.kept_share for r in data.what_if}
    suggested, bound = curve.suggested, _bound_in_force(data)
    bound_mark = "configured" if bound == data.bound else "bound in force"
    head = (
        "<tr><th>lag</th><th>tokens</th><th>raw excess e</th><th>curve ê</th>"
        "<th>within budget</th><th>kept share at this bound</th></tr>"
    )
    body = []
    for lag, tokens, raw, fitted in zip(
        curve.curve.lags, curve.curve.tokens, curve.curve.raw, curve.curve.fitted, strict=True
    ):
        marks = [m for m, on in ((bound_mark, lag == bound), ("suggested", lag == suggested)) if on]
        body.append(
            f'<tr{" class=current" if marks else ""} data-lag="{lag}"><td>{lag}'
            f"{' (' + ', '.join(marks) + ')' if marks else ''}</td>"
            f"<td>{tokens:,}</td><td>{raw:.4g}</td><td>{fitted:.4g}</td><td>"
            f"{'yes' if fitted <= curve.budget else 'no'}</td><td>{_pct(kept.get(lag))}</td></tr>"
        )
    return (
        '<section class="panel" id="bound-table"><h2>The curve, lag by lag</h2><p>'
        f"Floor {curve.floor.value:.4g} nats ({escape(curve.floor.source)}), "
        f"budget {curve.budget:.4g} nats, "
        f"{_bound_label(data) if bound is not None else 'configured bound -'}, suggested bound "
        f"{suggested if suggested is not None else '-'}.</p>"
        f"<table>{head}{''.join(body)}</table></section>"
    )


_SUGGESTED_OVER_STEPS = _Chart(
    "bound-over-steps",
    "Suggested vs configured over steps",
    "Suggested vs configured bound over steps",
    (
        _Line("suggested (window of cost_window ships)", keys.BOUND_SUGGESTED, SUGGESTED_COLOUR),
        _Line("configured", keys.MAX_STALENESS, CONFIGURED_COLOUR, dashed=True),
    ),
    "SPEC 14 per ship: the suggestion of the curve over the last cost_window ships, and the "
    "bound the ship used (it moves only with the adaptive bound).",
    dict(y_label="policy versions"),
)


def render_choosing(data: ReportData) -> str:
    """The section, or ``""`` when the run says nothing about what staleness cost."""
    curve = data.curve
    if curve is None and not has_costs(data):
        return ""
    if curve is None or not curve.curve:
        why = "no lag 1..16 has" if curve is not None else "no floor: no lag has"
        why += " floor_min_tokens covered tokens over the run"
        label, caption = "Choosing the bound", "SPEC 14 over the whole run."
        charts = figure("bound-curve", label, caption, message_chart(label, why))
    else:
        charts = _curve_chart(data, curve) + _kept_chart(data, curve) + _table(data, curve)
    intro = (
        "What a token of each lag costs in this run, against the budget (SPEC 14): the suggested "
        "bound is the largest lag whose cost stays within it."
    )
    if any(v is not None for v in data.series(keys.BOUND_SUGGESTED)):
        charts += _over_steps(data, _SUGGESTED_OVER_STEPS)
    heading = '<section id="choosing-the-bound"><h2>Choosing the bound</h2>'
    return f'{heading}<p class="meta">{intro}</p>{charts}</section>'


def render(data: ReportData, title: str = "Staleness report") -> str:
    """The whole page, any text that UTF-8 cannot carry replaced (U+FFFD)."""
    meta = [f"source: <bdi>{escape(data.source)}</bdi> ({data.kind})"]  # (its bidi marks stay in)
    meta += [f"policy: {escape(data.policy)}"] if data.policy is not None else []
    bounds, last = _bounds(data), _bound_in_force(data)
    adapted = len(bounds) > 1  # then drawn step by step
    said = f"adapted within {bounds[0]}..{bounds[-1]}, {last} at the last step" if adapted else last
    meta += [f"max_staleness: {said}"] if bounds else []
    lines = (*_TOKEN_STALENESS.lines, _BOUND_LINE) if adapted else _TOKEN_STALENESS.lines
    rules = [Rule(last, f"max_staleness = {last}")] if last is not None and not adapted else []
    charts = [
        _over_steps(data, _TOKEN_STALENESS._replace(lines=lines), rules=rules),
        _over_steps(data, _MASKED),
        _over_steps(data, _IN_FLIGHT),
        _over_steps(data, _DROPPED),
        _heatmap_chart(data),
        _what_if_chart(data),
    ]
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body><main>"
        f'<h1><bdi>{escape(title)}</bdi></h1><p class="meta">{" · ".join(meta)}</p>'
        + "".join(f'<p class="meta">{escape(note)}</p>' for note in data.read_notes)
        + f"{_summary(data)}<p></p>{''.join(charts)}{render_costs(data)}{render_choosing(data)}"
        f"{_comparison(data.comparison)}"
        f'<p class="meta">Made by staleness-metrics {__version__}. Definitions: SPEC sections 6, 9, 11, 12 and 14.</p>'
        "</main></body></html>\n"
    )
    return _LONE_SURROGATE.sub("\ufffd", page)
