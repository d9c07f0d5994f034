"""Prometheus recording rules (``level:metric:operations``) and alerts, built from the metric
table (the committed ones use the default thresholds), and an example OpenTelemetry Collector
config: OTLP in, Prometheus out, renamed where the collector's naming differs from the table's."""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..metrics import metric_table
from ..metrics.buckets import LAG_UPPER_BOUNDS
from ..metrics.metric_table import LAG, MetricKind
from .promql import Scope, prometheus_name, recorded_name

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
    excess_k3: float = 0.01  # nats of mean k3 over the floor (SPEC 14), lag <= max_staleness
    excess_for: str = "15m"
    # SPEC 14: the bound against the run's excess curve and budget.
    bound_loose_for: str = "15m"  # excess_at_bound above the budget this long
    bound_tight_margin: int = 2  # the suggestion this many steps above max_staleness ...
    bound_tight_masked: float = 0.01  # ... while more than this share of the last batch is masked
    bound_tight_for: str = "30m"


# SPEC 11 / 12 derived series, one recording rule each: (level, the rows named, operation, expr).
# The level names the labels kept (job_run_lag keeps the lag bucket).
_LAG, _LENGTH_LEVEL = f"{LEVEL}_lag", f"{LEVEL}_length"
_K3 = ("mismatch_kl", "mismatch_tokens")
_LENGTH = ("length_sampled_tokens", "length_samples")
_OUT_OF_BAND = ("mismatch_out_of_band", "mismatch_tokens")
_REMOVED = ("length_removed_tokens", "length_sampled_tokens")


def _series() -> dict[str, tuple[str, tuple[str, ...], str, str]]:
    s = _SCOPE
    return {
        "k3_by_lag": (_LAG, _K3, "ratio", s.per_lag_token("mismatch_kl")),
        "excess_k3_by_lag": (_LAG, _K3, "excess_ratio", s.excess_k3(by_lag=True)),
        "ess_by_lag": (_LAG, ("mismatch_ratio",), "ess", s.ess_by_lag()),
        "out_of_band_by_lag": (_LAG, _OUT_OF_BAND, "ratio", s.per_lag_token(_OUT_OF_BAND[0])),
        "k3": (LEVEL, _K3, "ratio", s.per_lag_token("mismatch_kl", by_lag=False)),
        "excess_k3": (LEVEL, _K3, "excess_ratio", s.excess_k3()),
        "sampled_length_mean": (LEVEL, _LENGTH, "ratio", s.sampled_length_mean()),
        "trained_length_mean": (LEVEL, _LENGTH, "trained_ratio", s.trained_length_mean()),
        "removed_share_by_length": (_LENGTH_LEVEL, _REMOVED, "ratio", s.removed_share_by_length()),
    }


MISMATCH_RECORDS = {key: recorded_name(*d[:2], f"{d[2]}_{_RATE}") for key, d in _series().items()}
"""Recording rule name of each derived SPEC 11 / 12 series (keys as the :class:`Scope` methods)."""


def _within_bound(series: str, threshold: float) -> str:
    """``series`` above ``threshold`` in the lag buckets whose smallest lag is within the run's
    max_staleness: one term per bucket, as PromQL cannot read a number from a label."""
    bound = _SCOPE.gauge("max_staleness")
    lowest = [0, *(upper + 1 for upper in LAG_UPPER_BOUNDS)]  # smallest lag per bucket, "inf" last
    return " or ".join(
        f'({series}{{lag="{value}"}} > {threshold} and on (job, run) {bound} >= {low})'
        for value, low in zip(LAG.values, lowest, strict=True)
        if low > 0  # lag 0 has no excess: the floor is measured there
    )


def _sampled_ratio(name: str) -> str:
    return recorded_name(LEVEL, (name, "tokens_sampled"), f"ratio_{_RATE}")


def _rate(name: str) -> str:
    return recorded_name(LEVEL, (name,), _RATE)


def _recording_rules() -> list[Json]:
    rules: list[Json] = [
        {"record": _sampled_ratio(name), "expr": _SCOPE.ratio(name, "tokens_sampled")}
        for name in ("tokens_masked", "tokens_unlabelled")
    ]
    for counter in ("rollouts_dropped", "rollouts_shipped", "samples_dropped"):
        rules.append({"record": _rate(counter), "expr": _SCOPE.rate(counter)})
    rules += [
        {
            "record": recorded_name(f"{LEVEL}_quantile", (histogram,), f"histogram_quantile_{_RATE}"),
            "expr": _SCOPE.quantile(q, histogram),
            "labels": {"quantile": str(q)},
        }
        for histogram in ("token_staleness", "rollout_staleness")
        for q in _QUANTILES
    ]
    return rules + [{"record": MISMATCH_RECORDS[key], "expr": d[3]} for key, d in _series().items()]


def _alert(name: str, expr: str, duration: str, summary: str, description: str, severity: str = "warning") -> Json:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def _alerts(t: Thresholds) -> list[Json]:
    dropped, shipped = _rate("rollouts_dropped"), _rate("rollouts_shipped")
    at_bound, budget = _SCOPE.gauge("bound_excess_at_bound"), _SCOPE.gauge("mismatch_budget")
    suggested, crossed = _SCOPE.gauge("bound_suggested"), _SCOPE.gauge("bound_crossed")
    bound, masked = _SCOPE.gauge("max_staleness"), _SCOPE.gauge("token_masked")
    where = "run {{ $labels.run }} (job {{ $labels.job }})"
    return [
        _alert(
            "RLStalenessMaskedRatioHigh",
            f"{_sampled_ratio('tokens_masked')} > {t.masked_ratio}",
            t.masked_for,
            "Run {{ $labels.run }} masks {{ $value | humanizePercentage }} of its tokens for staleness",
            f"Over the last {WINDOW}, {{{{ $value | humanizePercentage }}}} of the sampled tokens "
            f"shipped by {where} were masked for staleness (threshold {t.masked_ratio:.0%}). "
            "Inference runs too far behind the trainer: sync weights more often, lower the async "
            "level, or raise max_staleness.",
        ),
        _alert(
            "RLStalenessDroppedRolloutsHigh",
            f"{dropped} / ({dropped} + {shipped}) > {t.dropped_share}",
            t.dropped_for,
            "Run {{ $labels.run }} drops {{ $value | humanizePercentage }} of its rollouts for staleness",
            f"Over the last {WINDOW}, {{{{ $value | humanizePercentage }}}} of the live rollouts "
            f"of {where} were dropped for staleness instead of trained on (threshold "
            f"{t.dropped_share:.0%}). The generation compute behind them is wasted.",
        ),
        _alert(
            "RLStalenessRolloutsAtBound",
            f"{_SCOPE.gauge('rollout_max')} >= {bound} and {_SCOPE.shipping(t.at_bound_for)}",
            t.at_bound_for,
            f"Rollouts of run {{{{ $labels.run }}}} have been at the staleness bound for {t.at_bound_for}",
            f"The stalest rollout of every batch shipped by {where} in the last {t.at_bound_for} "
            "was at or above max_staleness (now {{ $value }} versions): the pipeline runs at its "
            "staleness limit, so masking and drops are about to grow.",
        ),
        _alert(
            "RLStalenessMismatchExcessHigh",
            _within_bound(MISMATCH_RECORDS["excess_k3_by_lag"], t.excess_k3),
            t.excess_for,
            'Staleness costs run {{ $labels.run }} {{ printf "%.4f" $value }} nats of mismatch '
            "at lag {{ $labels.lag }}",
            f"Over the last {WINDOW}, tokens of {where} at lag {{{{ $labels.lag }}}}, which "
            "max_staleness lets train, show a mean k3 mismatch between trainer and sampler "
            '{{ printf "%.4f" $value }} nats '
            "above the run's floor (the engines' numeric mismatch: measured at lag 0, carried from "
            "an earlier ship, or the smallest lag's, an upper bound; threshold "
            f"{t.excess_k3:g}). The policy moves too far within the bound: lower max_staleness, "
            "sync weights more often, or lower the learning rate.",
        ),
        # SPEC 14: the bound against the run's excess curve and budget
        _alert(
            "RLStalenessBoundTooLoose",
            f"{at_bound} > on (job, run) {budget}",
            t.bound_loose_for,
            "The staleness bound of run {{ $labels.run }} lets train tokens that cost more than its mismatch budget",
            f"For {t.bound_loose_for}, the excess mismatch curve of {where} has stood at "
            '{{ printf "%.4g" $value }} nats at the largest lag max_staleness lets train, '
            "above the budget (mismatch_budget, or the engines' floor when none is set). Lower "
            f"max_staleness to the suggested bound ({prometheus_name('bound_suggested')}), or turn "
            "on the adaptive bound (adapt_every).",
        ),
        _alert(
            "RLStalenessBoundTooTight",
            f"({suggested} >= on (job, run) {bound} + {t.bound_tight_margin}) and on (job, run) "
            f"({crossed} == 1) and on (job, run) ({masked} > {t.bound_tight_masked})",
            t.bound_tight_for,
            "The staleness bound of run {{ $labels.run }} masks tokens that cost less than its mismatch budget",
            f"For {t.bound_tight_for}, the excess curve of {where} has stayed within the budget "
            f"up to lag {{{{ $value }}}}, at least {t.bound_tight_margin} above max_staleness, "
            f"while more than {t.bound_tight_masked:.0%} of the last batch's tokens were masked: "
            "the bound throws away tokens staleness does not make costly. Raise max_staleness "
            "toward the suggested bound.",
        ),
        _alert(
            "RLStalenessMetricsAbsent",
            f"absent_over_time({prometheus_name('train_step')}[{t.absent_window}])",
            t.absent_for,
            "No staleness metrics for " + t.absent_window,
            f"Prometheus has scraped no {prometheus_name('train_step')} series "
            f"for {t.absent_window}: the trainer's exporter is down, "
            "unreachable, or no run is training.",
            severity="critical",
        ),
    ]


def rule_groups(thresholds: Thresholds | None = None) -> Json:
    """The rules file as data: one group of recording rules, one of alerts."""
    return {
        "groups": [
            {"name": "rl-staleness.recording", "rules": _recording_rules()},
            {"name": "rl-staleness.alerts", "rules": _alerts(thresholds or Thresholds())},
        ]
    }


HEADER = (
    "# Generated by `staleness-metrics dashboards` from staleness_metrics/metrics/metric_table.py: "
    "do not edit.\n# Check with `promtool check rules` and `promtool test rules tests/*.yml`.\n"
)


def render_rules(thresholds: Thresholds | None = None) -> str:
    return to_yaml(HEADER, rule_groups(thresholds))


def to_yaml(header: str, data: Json) -> str:
    """``data`` as YAML after ``header``, one line per expression."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.width = 4096
    yaml.indent(mapping=2, sequence=4, offset=2)
    out = io.StringIO()
    yaml.dump(data, out)
    return header + out.getvalue()


# The collector's OTLP unit -> Prometheus unit word (UCUM subset it knows; others are used as is).
_UNIT_WORDS = dict(
    d="days", h="hours", min="minutes", s="seconds", ms="milliseconds", us="microseconds", ns="nanoseconds",
    By="bytes", KiBy="kibibytes", MiBy="mebibytes", GiBy="gibibytes", TiBy="tibibytes",
    KBy="kilobytes", MBy="megabytes", GBy="gigabytes", TBy="terabytes",
    m="meters", V="volts", A="amperes", J="joules", W="watts", g="grams", Cel="celsius", Hz="hertz",
)  # fmt: skip
_UNIT_WORDS.update({"1": "", "%": "percent"})
_PER_UNIT_WORDS = dict(s="second", m="minute", h="hour", d="day", w="week", mo="month", y="year")


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[^0-9A-Za-z]+", text) if w]


def collector_prometheus_name(otel_name: str, unit: str, kind: MetricKind) -> str:
    """The name the collector's Prometheus exporter gives a metric (default translation)."""
    words = _words(otel_name)
    main_unit, _, per_unit = (part.strip() for part in unit.partition("/"))
    parts = ((main_unit, _UNIT_WORDS, ()), (per_unit, _PER_UNIT_WORDS, ("per",)))
    for part, table, before in parts:
        # a unit in braces is an annotation, not a unit
        word = "" if re.search(r"[{}]", part) else "_".join(_words(table.get(part, part)))
        if word and word not in words:
            words += [*before, word]
    if kind is MetricKind.COUNTER:
        words = [w for w in words if w != "total"] + ["total"]
    if unit == "1" and kind is MetricKind.GAUGE:
        words = [w for w in words if w != "ratio"] + ["ratio"]
    return "_".join(words)


def renames() -> list[tuple[str, str]]:
    """(OTLP name, table Prometheus name) of every row the collector would name differently."""
    return [
        (row.otel_name, row.prometheus_name)
        for row in metric_table.METRICS
        if row.otel_name is not None and row.prometheus_name is not None
        if collector_prometheus_name(row.otel_name, row.otel_unit, row.kind) != row.prometheus_name
    ]


def collector_config() -> dict[str, Any]:
    """The collector's config (data/collector.json: OTLP in, Prometheus out, with ``honor_labels``
    service.name becomes ``job`` and service.instance.id ``instance``), renamed as the table names."""
    config: dict[str, Any] = json.loads(
        resources.files("staleness_metrics").joinpath("data/collector.json").read_text(encoding="utf-8")
    )
    config["processors"]["metricstransform/staleness-names"]["transforms"] = [
        {"include": otel, "match_type": "strict", "action": "update", "new_name": prom} for otel, prom in renames()
    ]
    return config


_COLLECTOR_HEADER = """\
# Example OpenTelemetry Collector (otelcol-contrib) config for staleness-metrics; see README.md.
# Generated by `staleness-metrics dashboards` from staleness_metrics/metrics/metric_table.py: do not edit.
#
# OTLP exporter -> this collector (OTLP/HTTP 127.0.0.1:4318, gRPC 127.0.0.1:4317)
#   -> Prometheus exporter on 127.0.0.1:8889 -> Prometheus scrapes it with honor_labels: true.
# The rename processor gives every metric the table's Prometheus name, so the generated Grafana
# dashboards and rules work on this path too.
"""


def render_collector_config() -> str:
    return to_yaml(_COLLECTOR_HEADER, collector_config())
