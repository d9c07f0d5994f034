"""The one table of metric definitions (SPEC 8).

Every exporter, dashboard, rule file and the migration tool read this table. No name is ever derived
from another at run time: each row spells out the W&B key, the Prometheus family, the OpenTelemetry
instrument and the legacy keys explicitly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "BUCKETS",
    "LEGACY_KEYS",
    "METRICS",
    "LegacyKey",
    "MetricDef",
    "MetricKind",
    "Source",
    "metric_by_key",
    "metric_by_prometheus_name",
]


class MetricKind(str, enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


class Source(str, enum.Enum):
    """Where an exporter reads a row's value in a :class:`~staleness_metrics.StepReport`."""

    STEP = "step"  # report.step
    METRIC = "metric"  # report.metrics[wandb_key] (absent when its population is empty)
    TALLY = "tally"  # report.tally.<tally_field>, a per-ship increment or count
    TOKEN_HISTOGRAM = "token_histogram"  # report.tally.token_histogram
    ROLLOUT_HISTOGRAM = "rollout_histogram"  # report.tally.rollout_histogram
    EXPORTER = "exporter"  # kept by the exporter runtime itself (export errors)


# Integer staleness buckets: exact per-level counts for the common range, coarse tail.
BUCKETS: tuple[float, ...] = (*[float(b) for b in range(17)], 32.0, 64.0)


@dataclass(frozen=True)
class MetricDef:
    """One metric as every exporter names it.

    ``wandb_key`` is the SPEC 6 key (None: not logged to W&B). ``prometheus_name`` /``otel_name`` are
    None where that exporter does not publish the metric (quantiles, for instance, come from the
    histogram in PromQL). ``labels`` lists the Prometheus labels / OTel attributes besides none.
    """

    name: str  # stable identifier used in code and docs
    description: str
    source: Source
    kind: MetricKind
    wandb_key: str | None
    prometheus_name: str | None
    otel_name: str | None
    otel_unit: str
    labels: tuple[str, ...] = ("run", "env")
    integer: bool = False  # values are integers (maxima, quantiles, counts)
    tally_field: str | None = None
    wandb_summary: str | None = None  # define_metric summary for W&B ("max" for maxima)
    legacy_keys: tuple[str, ...] = ()


_STEP = "{step}"
_TOKEN = "{token}"
_ROLLOUT = "{rollout}"
_SAMPLE = "{sample}"

METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "train_step",
        "Train step of the last shipped batch.",
        Source.STEP,
        MetricKind.GAUGE,
        None,
        "rl_staleness_train_step",
        "rl.staleness.train.step",
        _STEP,
        labels=("run",),
        integer=True,
    ),
    MetricDef(
        "max_staleness",
        "Configured staleness bound (max_staleness), in policy versions.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/max_staleness",
        "rl_staleness_max_staleness",
        "rl.staleness.max_staleness",
        _STEP,
        labels=("run",),
        integer=True,
    ),
    MetricDef(
        "token_mean",
        "Mean token staleness over the sampled positions of the shipped batch, in policy versions.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/token/mean",
        "rl_staleness_token_mean_steps",
        "rl.staleness.token.mean",
        _STEP,
        legacy_keys=("off_policy/token/mean",),
    ),
    MetricDef(
        "token_masked",
        "Share of the shipped batch's sampled positions that are masked for staleness.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/token/masked",
        "rl_staleness_token_masked_ratio",
        "rl.staleness.token.masked_ratio",
        "1",
        legacy_keys=("off_policy/token/masked",),
    ),
    MetricDef(
        "token_unlabelled",
        "Share of the shipped batch's sampled positions that had no version label.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/token/unlabelled",
        None,
        None,
        "1",
    ),
    MetricDef(
        "token_p50",
        "Median token staleness (nearest rank).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/token/p50",
        None,
        None,
        _STEP,
        integer=True,
    ),
    MetricDef(
        "token_p90",
        "90th percentile token staleness (nearest rank).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/token/p90",
        None,
        None,
        _STEP,
        integer=True,
    ),
    MetricDef(
        "token_p99",
        "99th percentile token staleness (nearest rank).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/token/p99",
        None,
        None,
        _STEP,
        integer=True,
    ),
    MetricDef(
        "rollout_mean",
        "Mean rollout staleness R = T - min(version) over shipped live rollouts.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/rollout/mean",
        "rl_staleness_rollout_mean_steps",
        "rl.staleness.rollout.mean",
        _STEP,
        legacy_keys=("off_policy/mean", "staleness/mean"),
    ),
    MetricDef(
        "rollout_max",
        "Largest rollout staleness in the shipped batch (equals the largest token staleness).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/rollout/max",
        "rl_staleness_rollout_max_steps",
        "rl.staleness.rollout.max",
        _STEP,
        integer=True,
        wandb_summary="max",
        legacy_keys=("off_policy/max", "staleness/max"),
    ),
    MetricDef(
        "rollout_in_flight_mean",
        "Mean in-flight staleness (versions that passed while the rollout was generated).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/rollout/in_flight/mean",
        "rl_staleness_rollout_in_flight_mean_steps",
        "rl.staleness.rollout.in_flight.mean",
        _STEP,
        legacy_keys=("off_policy/in_flight/mean", "staleness/in_flight/mean"),
    ),
    MetricDef(
        "rollout_in_flight_max",
        "Largest in-flight staleness in the shipped batch.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/rollout/in_flight/max",
        "rl_staleness_rollout_in_flight_max_steps",
        "rl.staleness.rollout.in_flight.max",
        _STEP,
        integer=True,
        wandb_summary="max",
        legacy_keys=("off_policy/in_flight/max", "staleness/in_flight/max"),
    ),
    MetricDef(
        "rollout_in_queue_mean",
        "Mean in-queue staleness (versions that passed while the finished rollout waited).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/rollout/in_queue/mean",
        "rl_staleness_rollout_in_queue_mean_steps",
        "rl.staleness.rollout.in_queue.mean",
        _STEP,
        legacy_keys=("off_policy/in_queue/mean", "staleness/in_queue/mean"),
    ),
    MetricDef(
        "rollout_in_queue_max",
        "Largest in-queue staleness in the shipped batch.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/rollout/in_queue/max",
        "rl_staleness_rollout_in_queue_max_steps",
        "rl.staleness.rollout.in_queue.max",
        _STEP,
        integer=True,
        wandb_summary="max",
        legacy_keys=("off_policy/in_queue/max", "staleness/in_queue/max"),
    ),
    MetricDef(
        "rollout_newest_mean",
        "Mean newest-token rollout staleness T - max(version) over shipped live rollouts (verl's trajectory "
        "staleness; the rollout mean uses the oldest token).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/rollout/newest/mean",
        "rl_staleness_rollout_newest_mean_steps",
        "rl.staleness.rollout.newest.mean",
        _STEP,
    ),
    MetricDef(
        "rollout_newest_max",
        "Largest newest-token rollout staleness T - max(version) in the shipped batch.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/rollout/newest/max",
        "rl_staleness_rollout_newest_max_steps",
        "rl.staleness.rollout.newest.max",
        _STEP,
        integer=True,
        wandb_summary="max",
    ),
    MetricDef(
        "rollouts_dropped",
        "Live rollouts dropped for staleness (per ship window in W&B; cumulative elsewhere).",
        Source.TALLY,
        MetricKind.COUNTER,
        "staleness/rollout/dropped",
        "rl_staleness_rollouts_dropped_total",
        "rl.staleness.rollouts.dropped",
        _ROLLOUT,
        integer=True,
        tally_field="rollouts_dropped",
        legacy_keys=("off_policy/dropped", "staleness/dropped"),
    ),
    MetricDef(
        "samples_dropped",
        "Samples dropped for staleness (per ship window in W&B; cumulative elsewhere).",
        Source.TALLY,
        MetricKind.COUNTER,
        "staleness/sample/dropped",
        "rl_staleness_samples_dropped_total",
        "rl.staleness.samples.dropped",
        _SAMPLE,
        integer=True,
        tally_field="samples_dropped",
    ),
    MetricDef(
        "rollouts_held",
        "Rollouts held back at the last ship (xtuner policy with retry_expired).",
        Source.TALLY,
        MetricKind.GAUGE,
        "staleness/rollout/held",
        "rl_staleness_rollouts_held",
        "rl.staleness.rollouts.held",
        _ROLLOUT,
        integer=True,
        tally_field="rollouts_held",
    ),
    MetricDef(
        "token_staleness",
        "Token staleness of shipped sampled positions, in policy versions (integer buckets).",
        Source.TOKEN_HISTOGRAM,
        MetricKind.HISTOGRAM,
        "staleness/token/histogram",
        "rl_staleness_token_steps",
        "rl.staleness.token.steps",
        _STEP,
    ),
    MetricDef(
        "rollout_staleness",
        "Rollout staleness of shipped live rollouts, in policy versions (integer buckets).",
        Source.ROLLOUT_HISTOGRAM,
        MetricKind.HISTOGRAM,
        None,
        "rl_staleness_rollout_steps",
        "rl.staleness.rollout.steps",
        _STEP,
    ),
    MetricDef(
        "tokens_sampled",
        "Sampled positions of shipped live samples, masked ones included.",
        Source.TALLY,
        MetricKind.COUNTER,
        None,
        "rl_staleness_tokens_sampled_total",
        "rl.staleness.tokens.sampled",
        _TOKEN,
        integer=True,
        tally_field="tokens_sampled",
    ),
    MetricDef(
        "tokens_masked",
        "Shipped sampled positions masked for staleness.",
        Source.TALLY,
        MetricKind.COUNTER,
        None,
        "rl_staleness_tokens_masked_total",
        "rl.staleness.tokens.masked",
        _TOKEN,
        integer=True,
        tally_field="tokens_masked",
    ),
    MetricDef(
        "tokens_dropped",
        "Sampled positions of samples dropped for staleness.",
        Source.TALLY,
        MetricKind.COUNTER,
        None,
        "rl_staleness_tokens_dropped_total",
        "rl.staleness.tokens.dropped",
        _TOKEN,
        integer=True,
        tally_field="tokens_dropped",
    ),
    MetricDef(
        "tokens_unlabelled",
        "Shipped sampled positions without a version label (they take the dispatch version).",
        Source.TALLY,
        MetricKind.COUNTER,
        None,
        "rl_staleness_tokens_unlabelled_total",
        "rl.staleness.tokens.unlabelled",
        _TOKEN,
        integer=True,
        tally_field="tokens_unlabelled",
    ),
    MetricDef(
        "rollouts_shipped",
        "Live rollouts shipped to the trainer.",
        Source.TALLY,
        MetricKind.COUNTER,
        None,
        "rl_staleness_rollouts_shipped_total",
        "rl.staleness.rollouts.shipped",
        _ROLLOUT,
        integer=True,
        tally_field="rollouts_shipped",
    ),
    MetricDef(
        "rollouts_frozen",
        "Frozen-model rollouts shipped (never masked, left out of staleness statistics).",
        Source.TALLY,
        MetricKind.COUNTER,
        None,
        "rl_staleness_rollouts_frozen_total",
        "rl.staleness.rollouts.frozen",
        _ROLLOUT,
        integer=True,
        tally_field="rollouts_frozen",
    ),
    MetricDef(
        "rollouts_invalid",
        "Rollouts set aside as invalid (lenient mode).",
        Source.TALLY,
        MetricKind.COUNTER,
        None,
        "rl_staleness_rollouts_invalid_total",
        "rl.staleness.rollouts.invalid",
        _ROLLOUT,
        integer=True,
        tally_field="rollouts_invalid",
    ),
    MetricDef(
        "export_errors",
        "Failed exports, per exporter.",
        Source.EXPORTER,
        MetricKind.COUNTER,
        None,
        "rl_staleness_export_errors_total",
        "rl.staleness.export.errors",
        "{error}",
        labels=("run", "exporter"),
        integer=True,
    ),
)


@dataclass(frozen=True)
class LegacyKey:
    """What an old W&B key became: a new key, or ``None`` with the reason it was removed."""

    old: str
    new: str | None
    reason: str = ""


def _legacy_table() -> dict[str, LegacyKey]:
    table: dict[str, LegacyKey] = {}
    for metric in METRICS:
        for old in metric.legacy_keys:
            assert metric.wandb_key is not None
            table[old] = LegacyKey(old, metric.wandb_key)
    removed = {
        "off_policy/token/max": "equals staleness/rollout/max (rollout staleness includes masked positions)",
        "staleness/token/max": "equals staleness/rollout/max (rollout staleness includes masked positions)",
    }
    dispatcher = "live dispatcher gauge with no replacement"
    for stem in ("dispatcher/off_policy", "dispatcher/off_policy_level", "dispatcher/staleness"):
        for stat in ("mean", "max"):
            removed[f"{stem}/{stat}"] = dispatcher
    for old, reason in removed.items():
        table[old] = LegacyKey(old, None, reason)
    return table


LEGACY_KEYS: dict[str, LegacyKey] = _legacy_table()

_BY_KEY = {m.wandb_key: m for m in METRICS if m.wandb_key is not None}
_BY_PROM = {m.prometheus_name: m for m in METRICS if m.prometheus_name is not None}


def metric_by_key(key: str) -> MetricDef:
    """The row of a W&B key (``KeyError`` when the table has none)."""
    return _BY_KEY[key]


def metric_by_prometheus_name(name: str) -> MetricDef:
    """The row of a Prometheus family name (``KeyError`` when the table has none)."""
    return _BY_PROM[name]
