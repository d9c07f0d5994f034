"""The report's "What staleness costs" section (SPEC 11 and 12), drawn when the run's rows carry
the mismatch family: k3, excess k3 and ESS by lag, and the length bias, all over steps.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..metrics import keys
from ..metrics.buckets import LAG_BUCKETS, LENGTH_BUCKETS
from ..metrics.metric_table import MISMATCH_KEY_PREFIX
from .data import ReportData
from .svg import PALETTE, Series, figure, line_chart, message_chart

MAX_LAG_LINES = 6  # one colour per line, and a legend that fits the chart's width


def has_costs(data: ReportData) -> bool:
    """True when some row carries a SPEC 11 key: the section is drawn only then."""
    return any(key.startswith(MISMATCH_KEY_PREFIX) for row in data.rows for key in row)


def lag_buckets_shown(data: ReportData) -> list[str]:
    """The lag buckets drawn: the :data:`MAX_LAG_LINES` with the most covered
    tokens, in lag order."""
    tokens = {b: sum(row.get(keys.MISMATCH_TOKENS_BY_LAG[b], 0) for row in data.rows) for b in LAG_BUCKETS}
    busiest = sorted((b for b in LAG_BUCKETS if tokens[b] > 0), key=lambda b: -tokens[b])[:MAX_LAG_LINES]
    return [b for b in LAG_BUCKETS if b in busiest]


def _lag_name(bucket: str) -> str:
    if bucket == "32":
        return "lag 17-32"
    if bucket == "64":
        return "lag 33-64"
    return "lag > 64" if bucket == "inf" else f"lag {bucket}"


def _by_lag(data: ReportData, buckets: list[str], stat: Mapping[str, str], skip: str | None = None) -> list[Series]:
    """One line per bucket; a bucket keeps its colour from chart to chart."""
    return [
        Series(_lag_name(b), data.series(stat[b]), PALETTE[i % len(PALETTE)])
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
