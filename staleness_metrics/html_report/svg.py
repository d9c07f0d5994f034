"""Inline SVG charts, drawn server-side, each one ``<svg>`` string: ``None`` values are gaps, and
every mark carries a ``<title>`` that shows its value on hover."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

import numpy as np
import numpy.typing as npt

from ..metrics.buckets import HISTOGRAM_TOP

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf")
WIDTH, HEIGHT = 920, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 34, 44
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
MAX_HEATMAP_COLUMNS = 400
MAX_HEATMAP_ROWS = 400  # rows added only to show the bound (each row is a matrix column per step)


@dataclass(frozen=True)
class Series:
    name: str
    values: Sequence[float | None]
    color: str
    dashed: bool = False
    notes: Sequence[str | None] | None = None  # per value, added to its hover title (token counts)
    show_notes: bool = False  # also write each note beside its point


@dataclass(frozen=True)
class Rule:
    """A reference line across the plot (the bound, the run's setting)."""

    value: float
    label: str
    color: str = "#d62728"


def nice_ticks(low: float, high: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round tick values covering ``low .. high``, at any scale (whole numbers only when
    ``integer``: a step apart, however large); a range too thin for floats to split is widened."""
    if not math.isfinite(low) or not math.isfinite(high):
        return [0.0, 1.0]
    if integer or not high - low > 1e-9 * max(abs(low), abs(high), 1e-300):
        high = max(high, low + (1.0 if integer else max(1.0, abs(low) * 1e-6)))
    raw = (high - low) / max(count, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1.0, float(math.ceil(step)))
    first, last = math.floor(low / step), math.ceil(high / step - 1e-9)
    # 3 * 0.1 is not 0.3; whole numbers are exact to 2**53
    return [k * step if integer else float(f"{k * step:.15g}") for k in range(first, last + 1)]


def _fmt(value: float, percent: bool = False, digits: int | None = None) -> str:
    """``value`` in full, or to ``digits`` (a whole number past 1e6 too: 1.5e9)."""
    if percent:
        return f"{100 * value:.3g}%"
    if float(value).is_integer() and (digits is None or abs(value) < 1e6):
        return str(int(value))
    return f"{value:.{digits or 3}g}".replace("e+0", "e").replace("e+", "e")


def _tick_labels(ticks: Sequence[float], percent: bool = False) -> list[str]:
    """The shortest labels that still tell the ticks apart (an axis of 1e9 fits its margin)."""
    tries = ([_fmt(t, percent, digits) for t in ticks] for digits in range(3, 18))
    return next((ls for ls in tries if len(set(ls)) == len(ls)), [_fmt(t, percent) for t in ticks])


class _Frame:
    def __init__(self, x_range: tuple[float, float], y_ticks: list[float], x_data: Sequence[float]) -> None:
        self.x0, self.x1 = x_range
        if self.x1 <= self.x0:
            self.x0, self.x1 = self.x0 - 1, self.x1 + 1
        self.y_ticks, self.y0, self.y1 = y_ticks, y_ticks[0], y_ticks[-1]
        low, high = min(x_data), max(x_data)
        self.x_ticks = [t for t in nice_ticks(low, high, 8, integer=True) if low <= t <= high]

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * PLOT_W

    def py(self, y: float) -> float:
        return TOP + PLOT_H - (y - self.y0) / (self.y1 - self.y0) * PLOT_H

    def axes(self, x_label: str, y_label: str, percent: bool = False) -> list[str]:
        out = []
        for t, text in zip(self.y_ticks, _tick_labels(self.y_ticks, percent), strict=True):
            y = self.py(t)
            out.append(f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{text}</text>')
        base = TOP + PLOT_H
        for t, text in zip(self.x_ticks, _tick_labels(self.x_ticks), strict=True):
            x = self.px(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{base}" y2="{base + 4}" class="axis"/>')
            out.append(f'<text x="{x:.1f}" y="{base + 16}" text-anchor="{_anchor(x, text, 7.2)}">{text}</text>')
        out.append(f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{base}" y2="{base}" class="axis"/>')
        out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{base}" class="axis"/>')
        out += [_x_title(LEFT + PLOT_W / 2, x_label), _y_title(TOP + PLOT_H / 2, y_label)]
        return out

    def vertical(self, rule: Rule, row: int) -> list[str]:
        x = self.px(rule.value)
        label_y = TOP + 12 + 15 * row  # a line of labels per rule: two near rules stay readable
        # near the right edge the label goes on the line's left side
        label_x, anchor = (x - 4, ' text-anchor="end"') if x > LEFT + PLOT_W - 80 else (x + 4, "")
        line = f'x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + PLOT_H}"'
        return _dashed(rule, line, f'x="{label_x:.1f}" y="{label_y}"{anchor}')


def _dashed(rule: Rule, line: str, label: str) -> list[str]:
    """``rule`` drawn: its dashed line (``line``: the ends) and its label (``label``: where)."""
    return [
        f'<line {line} stroke="{rule.color}" stroke-dasharray="6 4" stroke-width="1.5"/>',
        f'<text {label} fill="{rule.color}">{escape(rule.label)}</text>',
    ]


def _across(y: float, plot_w: int, rule: Rule) -> list[str]:
    """A dashed line across a plot at height ``y``, labelled at its right end."""
    line = f'x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}"'
    return _dashed(rule, line, f'x="{LEFT + plot_w - 4}" y="{y - 5:.1f}" text-anchor="end"')


def _anchor(x: float, text: str, char_w: float) -> str:
    """A label centred on ``x``, or ending there where centred it would run off the right edge."""
    return "end" if x + char_w / 2 * len(text) > WIDTH else "middle"


def _x_title(x: float, text: str) -> str:
    return f'<text x="{x:.1f}" y="{HEIGHT - 8}" text-anchor="middle">{escape(text)}</text>'


def _y_title(mid: float, text: str) -> str:
    return f'<text x="14" y="{mid:.1f}" text-anchor="middle" transform="rotate(-90 14 {mid:.1f})">{escape(text)}</text>'


def _svg(label: str, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
        f'height="{HEIGHT}" role="img" aria-label="{escape(label)}">' + "".join(body) + "</svg>"
    )


def _legend(series: Sequence[tuple[str, str]]) -> list[str]:
    out = []
    x = float(LEFT)
    for name, color in series:
        out.append(f'<rect x="{x:.1f}" y="10" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 16:.1f}" y="20">{escape(name)}</text>')
        x += 28 + 7.2 * len(name)
    return out


def _polyline(points: list[str], color: str, dash: str) -> list[str]:
    line = f'<polyline points="{" ".join(points)}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
    return [line] if len(points) >= 2 else []


def figure(key: str, title: str, caption: str, svg: str) -> str:
    """A chart of the report with its title and caption (``key`` names it for the page's script)."""
    return (
        f'<figure class="chart" id="chart-{key}" data-chart="{key}">'
        f"<figcaption><h2>{escape(title)}</h2><p>{caption}</p></figcaption>{svg}</figure>"
    )


def message_chart(label: str, message: str) -> str:
    """A framed placeholder saying why a chart has nothing to draw."""
    frame = f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" class="empty"/>'
    note = f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="note">{escape(message)}</text>'
    return _svg(label, [frame, note])


def line_chart(
    label: str,
    x: Sequence[float],
    series: Sequence[Series],
    *,
    x_label: str = "step",
    y_label: str = "",
    percent: bool = False,
    rules: Sequence[Rule] = (),
    vertical_rules: Sequence[Rule] = (),
    y_max: float | None = None,
) -> str:
    """Lines over ``x`` (gaps where a value is None); a dot marks every value."""
    values = [float(v) for s in series for v in s.values if v is not None and math.isfinite(v)]
    if not x or not values:
        return message_chart(label, "this input has no values for this chart")
    top = max([*values, *(r.value for r in rules), y_max or 0.0])
    # An all-zero series still gets a readable axis: up to 5% for shares, 1 otherwise.
    y_ticks = nice_ticks(min(0.0, min(values)), top if top > 0 else (0.05 if percent else 1.0))
    frame = _Frame((min(x), max(x)), y_ticks, x)
    body = [*frame.axes(x_label, y_label, percent), *_legend([(s.name, s.color) for s in series])]
    radius = 3.5 if len(x) <= 40 else 2.5
    for s in series:
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        run: list[str] = []
        dots = []
        notes = s.notes if s.notes is not None else [None] * len(x)
        for xi, v, note in zip(x, s.values, notes, strict=True):
            if v is None or not math.isfinite(v):
                body.extend(_polyline(run, s.color, dash))
                run = []
                continue
            px, py = frame.px(xi), frame.py(v)
            run.append(f"{px:.1f},{py:.1f}")
            shown = (_fmt(v, percent) if percent else f"{v:.4g}") + (f" ({note})" if note else "")
            dots.append(
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="{radius}" fill="{s.color}">'
                f"<title>{escape(s.name)} at {_fmt(xi)}: {escape(shown)}</title></circle>"
            )
            if s.show_notes and note:
                dots.append(
                    f'<text x="{px:.1f}" y="{py - 9:.1f}" text-anchor="{_anchor(px, note, 5.6)}" '
                    f'class="point-note">{escape(note)}</text>'
                )
        body.extend(_polyline(run, s.color, dash))
        body.extend(dots)
    for r in rules:
        body.extend(_across(frame.py(r.value), PLOT_W, r))
    for row, r in enumerate(r for r in vertical_rules if frame.x0 <= r.value <= frame.x1):
        body.extend(frame.vertical(r, row))
    return _svg(label, body)


def bar_chart(
    label: str,
    x: Sequence[float],
    series: Sequence[Series],
    *,
    stacked: bool,
    y_label: str = "",
    empty_note: str = "all zero",
) -> str:
    """Bars per ``x``: stacked (parts of one whole) or side by side (separate counts)."""
    if not x:
        return message_chart(label, "no values to plot")
    columns = [[v if v and math.isfinite(v) else 0.0 for v in s.values] for s in series]
    tops = [sum(c[i] for c in columns) if stacked else max(c[i] for c in columns) for i in range(len(x))]
    y_ticks = nice_ticks(0.0, max(tops) if tops and max(tops) > 0 else 1.0)
    gap = min((b - a for a, b in itertools.pairwise(x)), default=1.0) or 1.0
    frame = _Frame((min(x) - gap / 2, max(x) + gap / 2), y_ticks, x)
    body = [*frame.axes("step", y_label), *_legend([(s.name, s.color) for s in series])]
    if not any(tops):
        body.append(
            f'<text x="{WIDTH / 2}" y="{TOP + PLOT_H / 2}" text-anchor="middle" class="note">'
            f"{escape(empty_note)}</text>"
        )
    slot = PLOT_W * gap / (frame.x1 - frame.x0) * 0.8
    width = slot if stacked else slot / max(len(series), 1)
    for i, xi in enumerate(x):
        base = 0.0
        for k, s in enumerate(series):
            v = columns[k][i]
            if v <= 0:
                continue
            lo, hi = (base, base + v) if stacked else (0.0, v)
            left = frame.px(xi) - slot / 2 + (0 if stacked else k * width)
            y_top = frame.py(hi)
            body.append(
                f'<rect x="{left:.1f}" y="{y_top:.1f}" width="{max(width, 1.0):.1f}" '
                f'height="{max(frame.py(lo) - y_top, 0.5):.1f}" fill="{s.color}">'
                f"<title>{escape(s.name)} at {_fmt(xi)}: {v:.4g}</title></rect>"
            )
            base += v  # read only when stacked
    return _svg(label, body)


def _shade(share: float) -> str:
    """White to dark blue; square-root scale so a small share still shows."""
    t = math.sqrt(max(0.0, min(1.0, share)))
    r, g, b = (round(a + (c - a) * t) for a, c in zip((247, 251, 255), (8, 48, 107), strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def steps_per_column(steps: int) -> int:
    """How many consecutive steps a heatmap column sums: one, unless there are too many."""
    return max(1, math.ceil(steps / MAX_HEATMAP_COLUMNS))


def _level(staleness: int) -> str:
    """A histogram bucket's staleness: the last holds all from HISTOGRAM_TOP up."""
    return f"≥ {staleness}" if staleness >= HISTOGRAM_TOP else str(staleness)


def heatmap(
    label: str,
    x: Sequence[int],
    histograms: Sequence[npt.NDArray[np.int64]],
    *,
    bound: int | None = None,
    adapted: bool = False,
) -> str:
    """Columns are steps, rows staleness levels, the shade the share of the step's tokens; the line
    at ``bound`` (the last step's when it ``adapted``)."""
    if not x or not any(int(h.sum()) for h in histograms):
        return message_chart(label, "no sampled tokens shipped")
    trimmed = [np.trim_zeros(h, "b") for h in histograms]
    levels = max(map(len, trimmed))
    if bound is not None and bound + 2 <= max(levels, MAX_HEATMAP_ROWS):
        levels = max(levels, bound + 2)  # room for the bound's line, unless far above the data
    matrix = np.zeros((len(x), levels), dtype=np.int64)
    for i, h in enumerate(trimmed):
        matrix[i, : len(h)] = h
    per = steps_per_column(len(x))
    matrix = np.add.reduceat(matrix, np.arange(0, len(x), per), axis=0)
    spans = [(x[i], x[min(i + per, len(x)) - 1]) for i in range(0, len(x), per)]
    columns = [first for first, _ in spans]
    plot_w, plot_h = PLOT_W - 70, PLOT_H
    cell_w, cell_h = plot_w / len(columns), plot_h / levels
    body = []
    for i, (first, last) in enumerate(spans):
        steps = f"step {first}" if first == last else f"steps {first}–{last}"
        total = int(matrix[i].sum())
        for level in range(levels):
            count = int(matrix[i, level])
            if count == 0:
                continue
            share = count / total
            cx, cy = LEFT + i * cell_w, TOP + plot_h - (level + 1) * cell_h
            body.append(
                f'<rect x="{cx:.2f}" y="{cy:.2f}" width="{cell_w + 0.3:.2f}" '
                f'height="{cell_h + 0.3:.2f}" fill="{_shade(share)}"><title>{steps}, '
                f"staleness {_level(level)}: {count} tokens ({100 * share:.1f}%)</title></rect>"
            )
    base = TOP + plot_h
    body.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{base}" y2="{base}" class="axis"/>')
    body.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{base}" class="axis"/>')
    shown = list(range(0, levels, max(1, math.ceil(levels / 12))))
    if levels > HISTOGRAM_TOP:
        shown[-1] = HISTOGRAM_TOP  # the top's label ("≥ 4096") in place of the one below it
    for row in shown:
        y = base - (row + 0.5) * cell_h
        body.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_level(row)}</text>')
    low, high = min(columns), max(columns)
    ticks = [t for t in nice_ticks(low, high, 8, integer=True) if low <= t <= high]
    for t, text in zip(ticks, _tick_labels(ticks), strict=True):
        cx = LEFT + (min(range(len(columns)), key=lambda j: abs(columns[j] - t)) + 0.5) * cell_w
        body.append(f'<text x="{cx:.1f}" y="{base + 16}" text-anchor="middle">{text}</text>')
    body += [_x_title(LEFT + plot_w / 2, "step"), _y_title(TOP + plot_h / 2, "token staleness")]
    if bound is not None and bound + 1 <= levels:
        said = f"masked above max_staleness = {bound}" + (" at the last step" if adapted else "")
        body.extend(_across(base - (bound + 1) * cell_h, plot_w, Rule(bound, said)))
    key_x = LEFT + plot_w + 24  # the colour key: share of a step's tokens
    for k in range(20):  # from 100% down
        body.append(
            f'<rect x="{key_x}" y="{TOP + k * plot_h / 20:.1f}" width="14" '
            f'height="{plot_h / 20 + 0.5:.1f}" fill="{_shade(1 - k / 19)}"/>'
        )
    body.append(f'<text x="{key_x + 18}" y="{TOP + 10}">100%</text>')
    body.append(f'<text x="{key_x + 18}" y="{base}">0%</text>')
    return _svg(label, body)
