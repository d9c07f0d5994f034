"""The one table of metric definitions (SPEC 8).

Every exporter, dashboard, rule file and the migration tool read this table. No name is ever derived
from another at run time: each row spells out the W&B key, the Prometheus family, the OpenTelemetry
instrument and the legacy keys explicitly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .bound import FLOOR_SOURCES
from .mismatch import LAG_BUCKETS
from .report import LENGTH_BUCKETS

__all__ = [
    "BUCKETS",
    "CURVE_LAG",
    "FLOOR_SOURCE",
    "LAG",
    "LEGACY_KEYS",
    "LENGTH",
    "METRICS",
    "WANDB_KEYS",
    "Dimension",
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
    TALLY_BUCKETS = "tally_buckets"  # report.tally.<tally_field>, an array over the row's dimension
    # SPEC 11 sums: report.mismatch (sink path) or MismatchReport.delta (live path), field <mismatch_field>:
    # an array over the lag buckets (rows with a dimension) or the uncovered count
    MISMATCH = "mismatch"
    # SPEC 14 keys (report.metrics[wandb_key] or MismatchReport.metrics) of the latest ship that reported the
    # SPEC 11 family: a ship without it leaves them as they were (a live run's ships carry none themselves).
    BOUND = "bound"


# Integer staleness buckets: exact per-level counts for the common range, coarse tail.
BUCKETS: tuple[float, ...] = (*[float(b) for b in range(17)], 32.0, 64.0)


@dataclass(frozen=True)
class Dimension:
    """A bucket label of a family of series (SPEC 11 lag buckets, SPEC 12 length buckets).

    ``buckets`` are the core's bucket names, as the W&B keys spell them; ``values`` the label value
    Prometheus and OpenTelemetry carry for each (the same, except the open top bucket of the lags, which
    is ``+Inf`` there like ``le``). ``placeholder`` marks the bucket in a row's W&B key template.
    """

    label: str
    buckets: tuple[str, ...]
    values: tuple[str, ...]
    placeholder: str

    def __post_init__(self) -> None:
        assert len(self.buckets) == len(self.values)


LAG = Dimension("lag", LAG_BUCKETS, (*LAG_BUCKETS[:-1], "+Inf"), "{lag}")
# SPEC 14: the excess curve's buckets (lags 1..16) and the floor's source.
CURVE_LAG = Dimension("lag", LAG_BUCKETS[1:17], LAG_BUCKETS[1:17], "{lag}")
FLOOR_SOURCE = Dimension("source", FLOOR_SOURCES, FLOOR_SOURCES, "{source}")
LENGTH = Dimension("length", LENGTH_BUCKETS, LENGTH_BUCKETS, "{length}")


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
    # A family of series, one per bucket: its label (in ``labels`` too) and, when ``wandb_key`` holds
    # the dimension's placeholder, one W&B key per bucket (spelled out once, in :data:`WANDB_KEYS`).
    dimension: Dimension | None = None
    mismatch_field: str | None = None  # the MismatchSums field of a Source.MISMATCH row

    @property
    def wandb_keys(self) -> tuple[str, ...]:
        """The W&B keys of this row: its key, or for a templated key one per bucket, in bucket order."""
        if self.wandb_key is None:
            return ()
        if self.dimension is None or self.dimension.placeholder not in self.wandb_key:
            return (self.wandb_key,)
        return tuple(self.wandb_key.replace(self.dimension.placeholder, b) for b in self.dimension.buckets)


_STEP = "{step}"
_TOKEN = "{token}"
_ROLLOUT = "{rollout}"
_SAMPLE = "{sample}"
_NAT = "{nat}"  # natural units of information (log-ratios and KL)
_FLAG = "{flag}"  # a 0/1 gauge (unit "1" would make the collector name it ..._ratio)
_LAG_LABELS = ("run", "env", "lag")  # env: the per-env series of live sums given per env
_LENGTH_LABELS = ("run", "env", "length")

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
        "The staleness bound the ship was judged with (max_staleness, or where adaptation moved it), in policy "
        "versions.",
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
    # SPEC 11: what staleness costs. Counters are the mergeable sums; every ratio is derived from them
    # (PromQL over rates, the core for W&B), so the W&B-only rows below have no Prometheus / OTel name.
    MetricDef(
        "mismatch_tokens",
        "Covered sampled positions (trainer and sampler log-probabilities both known), per token lag bucket.",
        Source.MISMATCH,
        MetricKind.COUNTER,
        "staleness/mismatch/lag_{lag}/tokens",
        "rl_staleness_mismatch_tokens_total",
        "rl.staleness.mismatch.tokens",
        _TOKEN,
        labels=_LAG_LABELS,
        integer=True,
        dimension=LAG,
        mismatch_field="tokens",
    ),
    MetricDef(
        "mismatch_masked",
        "Covered sampled positions masked by the staleness policy, per token lag bucket.",
        Source.MISMATCH,
        MetricKind.COUNTER,
        None,
        "rl_staleness_mismatch_masked_tokens_total",
        "rl.staleness.mismatch.masked_tokens",
        _TOKEN,
        labels=_LAG_LABELS,
        integer=True,
        dimension=LAG,
        mismatch_field="masked",
    ),
    MetricDef(
        "mismatch_kl",
        "Sum of the k3 estimator r - 1 - log r of trainer/sampler mismatch (r = trainer/sampler probability), "
        "per token lag bucket, in nats.",
        Source.MISMATCH,
        MetricKind.COUNTER,
        None,
        "rl_staleness_mismatch_kl_nats_total",
        "rl.staleness.mismatch.kl",
        _NAT,
        labels=_LAG_LABELS,
        dimension=LAG,
        mismatch_field="sum_k3",
    ),
    MetricDef(
        "mismatch_abs_log_ratio",
        "Sum of |log r| of trainer/sampler mismatch, per token lag bucket, in nats.",
        Source.MISMATCH,
        MetricKind.COUNTER,
        None,
        "rl_staleness_mismatch_abs_log_ratio_nats_total",
        "rl.staleness.mismatch.abs_log_ratio",
        _NAT,
        labels=_LAG_LABELS,
        dimension=LAG,
        mismatch_field="sum_abs_log_ratio",
    ),
    MetricDef(
        "mismatch_ratio",
        "Sum of the importance ratios r = trainer/sampler probability, per token lag bucket.",
        Source.MISMATCH,
        MetricKind.COUNTER,
        None,
        "rl_staleness_mismatch_ratio_total",
        "rl.staleness.mismatch.ratio",
        "1",
        labels=_LAG_LABELS,
        dimension=LAG,
        mismatch_field="sum_ratio",
    ),
    MetricDef(
        "mismatch_ratio_squared",
        "Sum of the squared importance ratios r^2, per token lag bucket.",
        Source.MISMATCH,
        MetricKind.COUNTER,
        None,
        "rl_staleness_mismatch_ratio_squared_total",
        "rl.staleness.mismatch.ratio_squared",
        "1",
        labels=_LAG_LABELS,
        dimension=LAG,
        mismatch_field="sum_ratio_sq",
    ),
    MetricDef(
        "mismatch_out_of_band",
        "Covered sampled positions whose importance ratio lies outside the mismatch band, per token lag bucket.",
        Source.MISMATCH,
        MetricKind.COUNTER,
        None,
        "rl_staleness_mismatch_out_of_band_tokens_total",
        "rl.staleness.mismatch.out_of_band_tokens",
        _TOKEN,
        labels=_LAG_LABELS,
        integer=True,
        dimension=LAG,
        mismatch_field="out_of_band",
    ),
    MetricDef(
        "mismatch_uncovered",
        "Sampled positions lacking a trainer or sampler log-probability (left out of the mismatch sums).",
        Source.MISMATCH,
        MetricKind.COUNTER,
        None,
        "rl_staleness_mismatch_uncovered_tokens_total",
        "rl.staleness.mismatch.uncovered_tokens",
        _TOKEN,
        labels=("run", "env"),
        integer=True,
        mismatch_field="uncovered",
    ),
    MetricDef(
        "mismatch_k3_by_lag",
        "Mean k3 mismatch of the covered positions of a lag bucket (prime-rl's mismatch_kl, split by lag).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/mismatch/lag_{lag}/k3",
        None,
        None,
        _NAT,
        labels=_LAG_LABELS,
        wandb_summary="max",
        dimension=LAG,
    ),
    MetricDef(
        "mismatch_abs_log_ratio_by_lag",
        "Mean |log r| of the covered positions of a lag bucket.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/mismatch/lag_{lag}/abs_log_ratio",
        None,
        None,
        _NAT,
        labels=_LAG_LABELS,
        dimension=LAG,
    ),
    MetricDef(
        "mismatch_out_of_band_by_lag",
        "Share of the covered positions of a lag bucket whose ratio lies outside the mismatch band.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/mismatch/lag_{lag}/out_of_band",
        None,
        None,
        "1",
        labels=_LAG_LABELS,
        dimension=LAG,
    ),
    MetricDef(
        "mismatch_ess_by_lag",
        "Normalised effective sample size (sum r)^2 / (n sum r^2) of a lag bucket, in (0, 1].",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/mismatch/lag_{lag}/ess",
        None,
        None,
        "1",
        labels=_LAG_LABELS,
        dimension=LAG,
    ),
    MetricDef(
        "mismatch_excess_k3_by_lag",
        "Mean k3 of a lag bucket minus the floor (SPEC 14; lag 0 of the ship when it has enough tokens): what "
        "staleness costs at that lag.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/mismatch/lag_{lag}/excess_k3",
        None,
        None,
        _NAT,
        labels=_LAG_LABELS,
        wandb_summary="max",
        dimension=LAG,
    ),
    MetricDef(
        "mismatch_k3",
        "Mean k3 mismatch over every covered position.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/mismatch/k3",
        None,
        None,
        _NAT,
        labels=("run",),
        wandb_summary="max",
    ),
    MetricDef(
        "mismatch_excess_k3",
        "Mean k3 of the positions at lag 1 or more minus the floor (SPEC 14).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/mismatch/excess_k3",
        None,
        None,
        _NAT,
        labels=("run",),
        wandb_summary="max",
    ),
    MetricDef(
        "mismatch_coverage",
        "Share of sampled positions with both log-probabilities (covered by the mismatch sums).",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/mismatch/coverage",
        None,
        None,
        "1",
        labels=("run",),
    ),
    # SPEC 14: choosing the bound. Gauges of the latest ship that reported the SPEC 11 family.
    MetricDef(
        "mismatch_floor",
        "The engines' numeric mismatch floor (mean k3) the excess is measured against; source lag0 (this ship's "
        "lag-0 tokens), carried (an earlier ship's) or min_lag (the smallest lag with enough tokens: an upper "
        "bound on the floor).",
        Source.BOUND,
        MetricKind.GAUGE,
        "staleness/mismatch/floor",
        "rl_staleness_mismatch_floor_nats",
        "rl.staleness.mismatch.floor",
        _NAT,
        labels=("run", "env", "source"),
        dimension=FLOOR_SOURCE,
    ),
    MetricDef(
        "mismatch_floor_source",
        "Where the floor came from: lag0, carried or min_lag (a string; a label or attribute elsewhere).",
        Source.BOUND,
        MetricKind.GAUGE,
        "staleness/mismatch/floor_source",
        None,
        None,
        "1",
        labels=("run", "env"),
    ),
    MetricDef(
        "mismatch_floor_age",
        "Steps since the ship that measured the floor (0 for lag0 and min_lag).",
        Source.BOUND,
        MetricKind.GAUGE,
        "staleness/mismatch/floor_age",
        "rl_staleness_mismatch_floor_age_steps",
        "rl.staleness.mismatch.floor_age",
        _STEP,
        labels=("run", "env"),
        integer=True,
    ),
    MetricDef(
        "mismatch_budget",
        "The mismatch budget: the excess a token may cost (mismatch_budget, or the floor when none is set).",
        Source.BOUND,
        MetricKind.GAUGE,
        "staleness/mismatch/budget",
        "rl_staleness_mismatch_budget_nats",
        "rl.staleness.mismatch.budget",
        _NAT,
        labels=("run", "env"),
    ),
    MetricDef(
        "mismatch_curve",
        "Excess k3 over the floor by lag, pooled over the last cost_window ships and made non-decreasing in lag "
        "(weighted isotonic regression); lags 1..16 with at least floor_min_tokens tokens.",
        Source.BOUND,
        MetricKind.GAUGE,
        "staleness/mismatch/curve/lag_{lag}",
        "rl_staleness_mismatch_curve_nats",
        "rl.staleness.mismatch.curve",
        _NAT,
        labels=("run", "env", "lag"),
        dimension=CURVE_LAG,
    ),
    MetricDef(
        "bound_suggested",
        "The largest lag whose excess stays within the budget (0 when the first lag of the curve is above it).",
        Source.BOUND,
        MetricKind.GAUGE,
        "staleness/bound/suggested",
        "rl_staleness_bound_suggested",
        "rl.staleness.bound.suggested",
        _STEP,
        labels=("run", "env"),
        integer=True,
    ),
    MetricDef(
        "bound_crossed",
        "1 when some lag of the curve costs more than the budget (the suggestion is where), else 0 (the "
        "suggestion is only the largest lag seen).",
        Source.BOUND,
        MetricKind.GAUGE,
        "staleness/bound/crossed",
        "rl_staleness_bound_crossed",
        "rl.staleness.bound.crossed",
        _FLAG,
        labels=("run", "env"),
        integer=True,
    ),
    MetricDef(
        "bound_excess_at_bound",
        "The curve's excess at the largest lag not above the configured bound: what the bound lets train.",
        Source.BOUND,
        MetricKind.GAUGE,
        "staleness/bound/excess_at_bound",
        "rl_staleness_bound_excess_at_bound_nats",
        "rl.staleness.bound.excess_at_bound",
        _NAT,
        labels=("run", "env"),
        wandb_summary="max",
    ),
    # SPEC 12: length bias of masking and drops, over shipped plus dropped samples.
    MetricDef(
        "length_samples",
        "Samples behind the length-bias counters: shipped live samples plus samples dropped for staleness.",
        Source.TALLY,
        MetricKind.COUNTER,
        None,
        "rl_staleness_length_samples_total",
        "rl.staleness.length.samples",
        _SAMPLE,
        integer=True,
        tally_field="length_samples",
    ),
    MetricDef(
        "length_sampled_tokens",
        "Sampled positions of shipped and dropped live samples, by the sample's sampled length bucket.",
        Source.TALLY_BUCKETS,
        MetricKind.COUNTER,
        None,
        "rl_staleness_length_sampled_tokens_total",
        "rl.staleness.length.sampled_tokens",
        _TOKEN,
        labels=_LENGTH_LABELS,
        integer=True,
        tally_field="length_sampled",
        dimension=LENGTH,
    ),
    MetricDef(
        "length_removed_tokens",
        "Sampled positions of shipped and dropped live samples that were masked or dropped for staleness, "
        "by the sample's sampled length bucket.",
        Source.TALLY_BUCKETS,
        MetricKind.COUNTER,
        None,
        "rl_staleness_length_removed_tokens_total",
        "rl.staleness.length.removed_tokens",
        _TOKEN,
        labels=_LENGTH_LABELS,
        integer=True,
        tally_field="length_removed",
        dimension=LENGTH,
    ),
    MetricDef(
        "length_sampled_mean",
        "Mean sampled length (positions) of the shipped and dropped live samples of the window.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/length/sampled/mean",
        None,
        None,
        _TOKEN,
    ),
    MetricDef(
        "length_trained_mean",
        "The same mean with masked positions and dropped samples counted as 0: the length that trains.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/length/trained/mean",
        None,
        None,
        _TOKEN,
    ),
    MetricDef(
        "length_removed_share",
        "Share of the sampled positions masked or dropped, over samples of a length bucket.",
        Source.METRIC,
        MetricKind.GAUGE,
        "staleness/length/bucket_{length}/masked",
        None,
        None,
        "1",
        labels=_LENGTH_LABELS,
        dimension=LENGTH,
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

# Every W&B key spelled out, templated rows expanded once here (never derived from another name later).
WANDB_KEYS: dict[str, MetricDef] = {key: m for m in METRICS for key in m.wandb_keys}
_BY_KEY = WANDB_KEYS
_BY_PROM = {m.prometheus_name: m for m in METRICS if m.prometheus_name is not None}


def metric_by_key(key: str) -> MetricDef:
    """The row of a W&B key (``KeyError`` when the table has none)."""
    return _BY_KEY[key]


def metric_by_prometheus_name(name: str) -> MetricDef:
    """The row of a Prometheus family name (``KeyError`` when the table has none)."""
    return _BY_PROM[name]
