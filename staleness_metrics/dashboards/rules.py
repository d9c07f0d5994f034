"""Prometheus recording and alerting rules, built from the metric table.

Recording rules follow ``level:metric:operations`` (level ``job_run``: the labels they keep); alerts
carry a ``severity`` label, ``summary`` / ``description`` annotations and a ``for:`` clause. The
thresholds are :class:`Thresholds`; the committed ``exporters/prometheus/staleness.rules.yml`` uses
the defaults.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from .promql import Scope, prometheus_name, recorded_name

__all__ = ["Thresholds", "render_rules", "rule_groups"]

Json = dict[str, Any]

WINDOW = "5m"
LEVEL = "job_run"
_SCOPE = Scope(by=("job", "run"), window=WINDOW)
_RATE = f"rate{WINDOW}"
_QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Thresholds:
    """When the alerts fire."""

    masked_ratio: float = 0.2  # share of shipped sampled tokens masked
    dropped_share: float = 0.1  # dropped / (dropped + shipped) live rollouts
    masked_for: str = "10m"
    dropped_for: str = "10m"
    at_bound_for: str = "30m"  # rollout staleness at or above max_staleness this long
    absent_window: str = "10m"  # no train step series for this long
    absent_for: str = "5m"


def _masked_ratio() -> str:
    return recorded_name(LEVEL, ("tokens_masked", "tokens_sampled"), f"ratio_{_RATE}")


def _rate(name: str) -> str:
    return recorded_name(LEVEL, (name,), _RATE)


def _recording_rules() -> list[Json]:
    rules: list[Json] = [
        {"record": _masked_ratio(), "expr": _SCOPE.ratio("tokens_masked", "tokens_sampled")},
        {
            "record": recorded_name(LEVEL, ("tokens_unlabelled", "tokens_sampled"), f"ratio_{_RATE}"),
            "expr": _SCOPE.ratio("tokens_unlabelled", "tokens_sampled"),
        },
    ]
    for counter in ("rollouts_dropped", "rollouts_shipped", "samples_dropped"):
        rules.append({"record": _rate(counter), "expr": _SCOPE.rate(counter)})
    for histogram in ("token_staleness", "rollout_staleness"):
        for q in _QUANTILES:
            rules.append(
                {
                    "record": recorded_name(f"{LEVEL}_quantile", (histogram,), f"histogram_quantile_{_RATE}"),
                    "expr": _SCOPE.quantile(q, histogram),
                    "labels": {"quantile": str(q)},
                }
            )
    return rules


def _alert(name: str, expr: str, duration: str, severity: str, summary: str, description: str) -> Json:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def _alerts(t: Thresholds) -> list[Json]:
    dropped, shipped = _rate("rollouts_dropped"), _rate("rollouts_shipped")
    where = "run {{ $labels.run }} (job {{ $labels.job }})"
    return [
        _alert(
            "RLStalenessMaskedRatioHigh",
            f"{_masked_ratio()} > {t.masked_ratio}",
            t.masked_for,
            "warning",
            "Run {{ $labels.run }} masks {{ $value | humanizePercentage }} of its tokens for staleness",
            f"Over the last {WINDOW}, {{{{ $value | humanizePercentage }}}} of the sampled tokens shipped "
            f"by {where} were masked for staleness (threshold {t.masked_ratio:.0%}). Inference runs too far "
            "behind the trainer: sync weights more often, lower the async level, or raise max_staleness.",
        ),
        _alert(
            "RLStalenessDroppedRolloutsHigh",
            f"{dropped} / ({dropped} + {shipped}) > {t.dropped_share}",
            t.dropped_for,
            "warning",
            "Run {{ $labels.run }} drops {{ $value | humanizePercentage }} of its rollouts for staleness",
            f"Over the last {WINDOW}, {{{{ $value | humanizePercentage }}}} of the live rollouts of {where} "
            f"were dropped for staleness instead of trained on (threshold {t.dropped_share:.0%}). The "
            "generation compute behind them is wasted.",
        ),
        _alert(
            "RLStalenessRolloutsAtBound",
            f"{_SCOPE.gauge('rollout_max')} >= {_SCOPE.gauge('max_staleness')}",
            t.at_bound_for,
            "warning",
            f"Rollouts of run {{{{ $labels.run }}}} have been at the staleness bound for {t.at_bound_for}",
            f"The stalest rollout of every batch shipped by {where} in the last {t.at_bound_for} was at or "
            "above max_staleness (now {{ $value }} versions): the pipeline runs at its staleness limit, so "
            "masking and drops are about to grow.",
        ),
        _alert(
            "RLStalenessMetricsAbsent",
            f"absent_over_time({prometheus_name('train_step')}[{t.absent_window}])",
            t.absent_for,
            "critical",
            "No staleness metrics for " + t.absent_window,
            f"Prometheus has scraped no {prometheus_name('train_step')} series for {t.absent_window}: the "
            "trainer's exporter is down, unreachable, or no run is training.",
        ),
    ]


def rule_groups(thresholds: Thresholds | None = None) -> Json:
    """The rules file as data: one group of recording rules, one of alerts."""
    t = thresholds or Thresholds()
    return {
        "groups": [
            {"name": "rl-staleness.recording", "rules": _recording_rules()},
            {"name": "rl-staleness.alerts", "rules": _alerts(t)},
        ]
    }


HEADER = (
    "# Generated by `staleness-metrics dashboards` from staleness_metrics/metric_table.py: do not edit.\n"
    "# Check with `promtool check rules` and `promtool test rules tests/*.yml`.\n"
)


def render_rules(thresholds: Thresholds | None = None) -> str:
    """The rules file as YAML text."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.width = 4096  # one line per expression: diffs stay readable
    yaml.indent(mapping=2, sequence=4, offset=2)
    out = io.StringIO()
    yaml.dump(rule_groups(thresholds), out)
    return HEADER + out.getvalue()
