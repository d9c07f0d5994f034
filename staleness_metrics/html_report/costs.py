"""The report's sections on what staleness costs (SPEC 11 and 12: mismatch and length bias by
lag over steps) and on choosing the bound (SPEC 14 over the whole run)."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape

from ..metrics import keys
from ..metrics.buckets import LAG_BUCKETS, LENGTH_BUCKETS
from ..metrics.metric_table import MISMATCH_KEY_PREFIX
from ..replay.what_if import RunCurve, WhatIfRow
from .data import ReportData
from .svg import PALETTE, Rule, Series, figure, line_chart, message_chart

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


def _k3_chart(data: ReportData, buckets: list[str]) -> str:
    svg = line_chart(
        "Mismatch k3 by token lag over steps",
        data.steps,
        _by_lag(data, buckets, keys.MISMATCH_K3_BY_LAG),
        y_label="nats",
    )
    caption = (
        "Mean k3 = r - 1 - log r of the covered tokens of each lag (r = trainer / sampler "
        "probability; the estimator of prime-rl's <code>mismatch_kl</code>). Lag 0, when a step "
        "has it, shows the engines' numeric floor."
    )
    return figure("mismatch-k3", "Mismatch by lag", caption, svg)


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


def _ess_chart(data: ReportData, buckets: list[str]) -> str:
    svg = line_chart(
        "Effective sample size by token lag over steps",
        data.steps,
        _by_lag(data, buckets, keys.MISMATCH_ESS_BY_LAG),
        y_label="normalised ESS",
        y_max=1.0,
    )
    caption = (
        "(Σr)² / (n Σr²) of each lag's importance ratios: 1 when trainer and sampler agree, "
        "falling as a few tokens' ratios dominate."
    )
    return figure("mismatch-ess", "ESS by lag", caption, svg)


def _length_chart(data: ReportData) -> str:
    svg = line_chart(
        "Mean response length: sampled vs trained",
        data.steps,
        [
            Series("sampled", data.series(keys.LENGTH_SAMPLED_MEAN), PALETTE[0]),
            Series(
                "trained (masked and dropped count 0)",
                data.series(keys.LENGTH_TRAINED_MEAN),
                PALETTE[3],
            ),
        ],
        y_label="sampled positions per sample",
    )
    caption = (
        "Long responses span more weight updates, so masking and drops remove more of them: the "
        "gap between the lines is the length bias of the bound (SPEC 12)."
    )
    return figure("length-bias", "Length bias", caption, svg)


def _removed_chart(data: ReportData) -> str:
    series = [
        Series(
            f"length {'> 16k' if b == 'inf' else '≤ ' + b}",
            data.series(keys.LENGTH_REMOVED_SHARE_BY_LENGTH[b]),
            c,
        )
        for b, c in zip(LENGTH_BUCKETS, PALETTE, strict=False)
    ]
    svg = line_chart(
        "Removed share by response length",
        data.steps,
        series,
        y_label="share masked or dropped",
        percent=True,
    )
    caption = "Share of each length bucket's sampled tokens masked or dropped for staleness, per step."
    return figure("length-removed", "Removed share by length", caption, svg)


def render_costs(data: ReportData) -> str:
    """The section, or ``""`` when the run has no trainer log-probabilities."""
    if not has_costs(data):
        return ""
    buckets = lag_buckets_shown(data)
    charts = [_k3_chart(data, buckets), _excess_chart(data, buckets), _ess_chart(data, buckets)]
    charts += [_length_chart(data), _removed_chart(data)]
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
    rules = []
    bound = _bound_in_force(data)
    if bound is not None:
        rules.append(Rule(bound, _bound_label(data), CONFIGURED_COLOUR))
    if suggested is not None:
        rules.append(Rule(suggested, f"suggested bound {suggested}", SUGGESTED_COLOUR))
    return rules


def _x_range(curve: RunCurve, bound: int | None, rows: list[WhatIfRow]) -> list[int]:
    top = max([*curve.curve.lags, *(r.max_staleness for r in rows), bound or 0])
    return list(range(top + 1))


def _curve_chart(data: ReportData, curve: RunCurve) -> str:
    label = "Excess mismatch by lag, pooled over the run"
    suggested = curve.suggested
    xs = _x_range(curve, _bound_in_force(data), data.what_if)
    at = {lag: i for i, lag in enumerate(curve.curve.lags)}

    def by_lag(values: tuple[float, ...]) -> list[float | None]:
        return [values[at[x]] if x in at else None for x in xs]

    notes = [f"{_tokens(curve.curve.tokens[at[x]])} tokens" if x in at else None for x in xs]
    svg = line_chart(
        label,
        xs,
        [
            Series("curve ê (isotonic)", by_lag(curve.curve.fitted), PALETTE[0], notes=notes),
            # Drawn last, on top: the measured points with the tokens behind each.
            Series(
                "raw excess e by lag",
                by_lag(curve.curve.raw),
                PALETTE[1],
                dashed=True,
                notes=notes,
                show_notes=True,
            ),
        ],
        x_label="token lag",
        y_label="nats above the floor",
        rules=[Rule(curve.budget, f"budget {curve.budget:.4g}", BUDGET_COLOUR)],
        vertical_rules=_bound_rules(data, suggested),
    )
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
        kept = {r.max_staleness: r.kept_share for r in rows}
        svg = line_chart(
            label,
            xs,
            [Series("share of sampled tokens that trains", [kept.get(x) for x in xs], PALETTE[2])],
            x_label="max_staleness",
            y_label="kept share",
            percent=True,
            vertical_rules=_bound_rules(data, curve.suggested),
        )
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


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _table(data: ReportData, curve: RunCurve) -> str:
    kept = {r.max_staleness: r for r in data.what_if}
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
        row = kept.get(lag)
        share = "-" if row is None or row.kept_share is None else f"{100 * row.kept_share:.2f}%"
        body.append(
            f'<tr{" class=current" if marks else ""} data-lag="{lag}"><td>{lag}'
            f"{' (' + ', '.join(marks) + ')' if marks else ''}</td>"
            f"<td>{tokens:,}</td><td>{_num(raw)}</td><td>{_num(fitted)}</td>"
            f"<td>{'yes' if fitted <= curve.budget else 'no'}</td><td>{share}</td></tr>"
        )
    return (
        '<section class="panel" id="bound-table"><h2>The curve, lag by lag</h2><p>'
        f"Floor {curve.floor.value:.4g} nats ({escape(curve.floor.source)}), "
        f"budget {curve.budget:.4g} nats, "
        f"{_bound_label(data) if bound is not None else 'configured bound -'}, suggested bound "
        f"{suggested if suggested is not None else '-'}.</p>"
        f"<table>{head}{''.join(body)}</table></section>"
    )


def _over_steps(data: ReportData) -> str:
    """Each ship's suggestion against the bound it used, when the rows carry them."""
    suggested = data.series(keys.BOUND_SUGGESTED)
    if not any(v is not None for v in suggested):
        return ""
    svg = line_chart(
        "Suggested vs configured bound over steps",
        data.steps,
        [
            Series("suggested (window of cost_window ships)", suggested, SUGGESTED_COLOUR),
            Series("configured", data.series(keys.MAX_STALENESS), CONFIGURED_COLOUR, dashed=True),
        ],
        y_label="policy versions",
    )
    caption = (
        "SPEC 14 per ship: the suggestion of the curve over the last cost_window ships, and the "
        "bound the ship used (it moves only with the adaptive bound)."
    )
    return figure("bound-over-steps", "Suggested vs configured over steps", caption, svg)


def render_choosing(data: ReportData) -> str:
    """The section, or ``""`` when the run says nothing about what staleness cost."""
    curve = data.curve
    if curve is None and not has_costs(data):
        return ""
    if curve is None or not curve.curve:
        why = (
            "no lag 1..16 has floor_min_tokens covered tokens over the run"
            if curve is not None
            else "no floor: no lag has floor_min_tokens covered tokens over the run"
        )
        charts = figure(
            "bound-curve",
            "Choosing the bound",
            "SPEC 14 over the whole run.",
            message_chart("Choosing the bound", why),
        )
    else:
        charts = _curve_chart(data, curve) + _kept_chart(data, curve) + _table(data, curve)
    intro = (
        "What a token of each lag costs in this run, against the budget (SPEC 14): the suggested "
        "bound is the largest lag whose cost stays within it."
    )
    return (
        f'<section id="choosing-the-bound"><h2>Choosing the bound</h2><p class="meta">{intro}</p>'
        f"{charts}{_over_steps(data)}</section>"
    )
