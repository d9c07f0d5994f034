"""The report page: one self-contained HTML file (inline CSS and SVG; no script, no fetch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

import numpy as np

from .. import __version__
from ..metrics import keys
from ..replay.sources.prime_rl import ComparisonRow, comparison_summary
from ..replay.what_if import WhatIfRow
from .costs import render_choosing, render_costs
from .data import ReportData
from .svg import PALETTE, Rule, Series, bar_chart, figure, heatmap, line_chart, message_chart

# Nothing may load from anywhere: the page is readable offline and leaks nothing when opened.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2329; margin: 0;
       background: #f4f6f8; }
main { max-width: 980px; margin: 0 auto; padding: 24px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 0 0 2px; }
.meta { color: #56606b; margin: 0 0 16px; }
figure, section.panel { background: #fff; border: 1px solid #dde2e7; border-radius: 6px; margin: 0 0 18px;
                        padding: 14px 16px; }
figcaption p, section.panel p { color: #56606b; margin: 0 0 8px; }
svg { display: block; max-width: 100%; height: auto; font-size: 12px; fill: #39424b; }
svg .grid { stroke: #e7ebef; } svg .axis { stroke: #7d8791; }
svg .empty { fill: #f7f8fa; stroke: #dde2e7; } svg .note { font-size: 15px; fill: #56606b; }
svg .point-note { font-size: 10px; fill: #8a5a00; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { padding: 4px 8px; border-bottom: 1px solid #e7ebef; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.current td { background: #fff4e5; font-weight: 600; }
td.prime_rl_rule { color: #8a5a00; } td.mismatch, td.missing { color: #b00020; font-weight: 600; }
.summary { display: grid; grid-template-columns: repeat(4, 1fr); gap: 8px; }
.summary div { background: #fff; border: 1px solid #dde2e7; border-radius: 6px; padding: 8px 10px; }
.summary b { display: block; font-size: 18px; }
details summary { cursor: pointer; color: #1f5fa8; }
"""


def _num(value: float | int | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.{digits}g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _quantile(histogram: np.ndarray, q: float) -> int | None:
    total = int(histogram.sum())
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    return int(np.searchsorted(np.cumsum(histogram), rank))


def _summary(data: ReportData) -> str:
    cells: list[tuple[str, str]] = [("steps shipped", _num(len(data.rows)))]
    maxima = [r[keys.ROLLOUT_MAX] for r in data.rows if keys.ROLLOUT_MAX in r]
    if data.totals is not None:
        t = data.totals
        hist = t.token_histogram
        tokens = int(hist.sum())
        mean = float((np.arange(len(hist)) * hist).sum() / tokens) if tokens else None
        masked = t.tokens_masked / t.tokens_sampled if t.tokens_sampled else None
        cells += [
            ("live rollouts shipped", _num(t.rollouts_shipped)),
            ("frozen rollouts shipped", _num(t.rollouts_frozen)),
            ("rollouts dropped", _num(t.rollouts_dropped)),
            ("sampled tokens shipped", _num(t.tokens_sampled)),
            ("tokens masked", _pct(masked)),
            ("token staleness mean", _num(mean)),
            ("token staleness p99", _num(_quantile(hist, 0.99))),
        ]
    else:
        dropped = sum(int(r.get(keys.ROLLOUTS_DROPPED, 0)) for r in data.rows)
        cells += [("rollouts dropped", _num(dropped))]
    cells.append(("largest rollout staleness", _num(max(maxima)) if maxima else "-"))
    return '<div class="summary">' + "".join(f"<div>{escape(k)}<b>{v}</b></div>" for k, v in cells) + "</div>"


def _token_chart(data: ReportData) -> str:
    rules = [Rule(data.bound, f"max_staleness = {data.bound}")] if data.bound is not None else []
    svg = line_chart(
        "Token staleness over steps",
        data.steps,
        [
            Series("mean", data.series(keys.TOKEN_MEAN), PALETTE[0]),
            Series("p50", data.series(keys.TOKEN_P50), PALETTE[2], dashed=True),
            Series("p90", data.series(keys.TOKEN_P90), PALETTE[1], dashed=True),
            Series("p99", data.series(keys.TOKEN_P99), PALETTE[4], dashed=True),
            # SPEC 6: the largest token staleness is the largest rollout staleness.
            Series("max", data.series(keys.ROLLOUT_MAX), PALETTE[5]),
        ],
        y_label="policy versions",
        rules=rules,
    )
    caption = (
        "Staleness of the shipped sampled tokens (trained version minus the version that "
        "sampled them), masked ones included; the max is the oldest rollout's. Tokens above the "
        "dashed bound are masked."
    )
    return figure("token-staleness", "Token staleness", caption, svg)


def _masked_chart(data: ReportData) -> str:
    svg = line_chart(
        "Masked ratio over steps",
        data.steps,
        [Series("masked share", data.series(keys.TOKEN_MASKED), PALETTE[3])],
        y_label="share of sampled tokens",
        percent=True,
    )
    caption = "Share of each shipped batch's sampled tokens masked for staleness (<code>staleness/token/masked</code>)."
    return figure("masked", "Masked ratio", caption, svg)


def _in_flight_chart(data: ReportData) -> str:
    svg = bar_chart(
        "Rollout staleness: in flight and in queue",
        data.steps,
        [
            Series("in flight (mean)", data.series(keys.ROLLOUT_IN_FLIGHT_MEAN), PALETTE[0]),
            Series("in queue (mean)", data.series(keys.ROLLOUT_IN_QUEUE_MEAN), PALETTE[1]),
        ],
        stacked=True,
        y_label="policy versions",
        empty_note="every shipped rollout was fresh",
    )
    caption = (
        "Where a shipped rollout's age comes from: versions that passed while it was generated (in "
        "flight) and while it waited in the queue after it finished (in queue). Together they make "
        "the rollout staleness mean."
    )
    return figure("in-flight-queue", "In flight vs in queue", caption, svg)


def _dropped_chart(data: ReportData) -> str:
    svg = bar_chart(
        "Dropped and held counts over steps",
        data.steps,
        [
            Series("rollouts dropped", data.series(keys.ROLLOUTS_DROPPED), PALETTE[3]),
            Series("samples dropped", data.series(keys.SAMPLES_DROPPED), PALETTE[5]),
            Series("rollouts held", data.series(keys.ROLLOUTS_HELD), PALETTE[6]),
        ],
        stacked=False,
        y_label="count per ship window",
        empty_note="nothing was dropped or held",
    )
    caption = "Rollouts and samples dropped for staleness, and rollouts held back, in each ship's window."
    return figure("dropped-held", "Dropped and held", caption, svg)


def _heatmap_chart(data: ReportData) -> str:
    label = "Token staleness histogram per step"
    if data.histograms is None:
        svg = message_chart(label, "needs rollouts: logged metrics carry no histogram")
    else:
        svg = heatmap(label, data.steps, data.histograms, bound=data.bound)
    caption = "Each column is one step; the shade is the share of its sampled tokens at each staleness."
    return figure("heatmap", "Token staleness histogram", caption, svg)


def _what_if_chart(data: ReportData) -> str:
    label = "What if the bound were different"
    rows = data.what_if
    if not rows:
        why = "needs rollouts: logged metrics cannot be replayed" if data.histograms is None else "no bounds given"
        svg = message_chart(label, why)
    else:
        not_trained = [None if r.kept_share is None else 1 - r.kept_share for r in rows]
        marks = [Rule(data.bound, f"run: {data.bound}", "#56606b")] if data.bound is not None else []
        svg = line_chart(
            label,
            [r.max_staleness for r in rows],
            [
                Series("masked share of shipped tokens", [r.masked_ratio for r in rows], PALETTE[3]),
                Series("share not trained (masked or dropped)", not_trained, PALETTE[4]),
            ],
            x_label="max_staleness",
            y_label="share of sampled tokens",
            percent=True,
            vertical_rules=marks,
        )
    caption = "The same run replayed at each bound with the same policy: what would have been masked or dropped."
    return figure("what-if", "What-if: the bound", caption, svg) + _what_if_table(rows, data.bound)


def _what_if_table(rows: Sequence[WhatIfRow], bound: int | None) -> str:
    if not rows:
        return ""
    # the run has trainer log-probs (SPEC 11)
    costs = any(r.trained_covered is not None for r in rows)
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
        "<p>Totals over the run; the highlighted row is the bound replayed above."
        + (
            " Trained k3: mean k3 of the covered tokens the bound lets train; excess: of those "
            "with lag &ge; 1 over the floor of the same tokens (SPEC 14: their lag-0 k3 when "
            "enough trained, else the k3 of the smallest lag with enough, an upper bound)."
            if costs
            else ""
        )
        + f"</p><table>{head}{body}</table></section>"
    )


_FROZEN_RULE = "prime-rl counts frozen-model episodes as staleness 0 (SPEC leaves them out)"


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
        why = "; ".join(notes) or _FROZEN_RULE
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
    shown = [r for r in rows if r.status != "match"]
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

    differing = f"<table>{head}{''.join(line(r) for r in shown)}</table>" if shown else ""
    all_lines = "".join(line(r) for r in rows)
    summary_line = f"<summary>All {len(rows)} values</summary>"
    everything = f"<details>{summary_line}<table>{head}{all_lines}</table></details>"
    return (
        '<section class="panel" id="comparison"><h2>Logged prime-rl values vs recomputed</h2>'
        + "".join(f"<p>{escape(t)}</p>" for t in lines)
        + differing
        + everything
        + "</section>"
    )


def render(data: ReportData, title: str = "Staleness report") -> str:
    """The whole page."""
    meta = [f"source: {escape(data.source)} ({data.kind})"]
    if data.policy is not None:
        meta.append(f"policy: {escape(data.policy)}")
    if data.bound is not None:
        meta.append(f"max_staleness: {data.bound}")
    charts = [
        _token_chart(data),
        _masked_chart(data),
        _in_flight_chart(data),
        _dropped_chart(data),
        _heatmap_chart(data),
        _what_if_chart(data),
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body><main>"
        f'<h1>{escape(title)}</h1><p class="meta">{" · ".join(meta)}</p>'
        + "".join(f'<p class="meta">prime-rl run: {escape(note)}</p>' for note in data.read_notes)
        + f"{_summary(data)}<p></p>{''.join(charts)}{render_costs(data)}{render_choosing(data)}"
        f"{_comparison(data.comparison)}"
        f'<p class="meta">Made by staleness-metrics {__version__}. Definitions: SPEC sections 6, 9, 11, 12 and 14.</p>'
        "</main></body></html>\n"
    )
