"""The metric catalogue (SPEC 6-8, 11, 12, 14) and the legacy names: every W&B key, Prometheus
family and OpenTelemetry instrument is named here and nowhere else; code names a key through
:mod:`.keys` (docs/INTERFACES.md: adding a metric)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .buckets import FLOOR_SOURCES, LAG_BUCKETS, LENGTH_BUCKETS


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
    # SPEC 11 sums, field <mismatch_field> of report.mismatch or (live) MismatchReport.delta
    MISMATCH = "mismatch"
    # SPEC 14 keys of the latest ship that reported the SPEC 11 family (the others leave them)
    BOUND = "bound"


# ---- the namespace of the W&B keys (SPEC 6) ----
KEY_PREFIX = "staleness/"
KEY_GLOB = "staleness/*"  # for define_metric
ENV_KEY_PREFIX = "staleness/env/"  # per-env breakdowns (env_key)
MISMATCH_KEY_PREFIX = "staleness/mismatch/"  # SPEC 11, and SPEC 14's floor, budget and curve
BOUND_KEY_PREFIX = "staleness/bound/"  # SPEC 14's advice


def env_key(env: str, key: str) -> str:
    """The per-env twin of the batch-wide ``key`` (``staleness/env/<env>/token/mean``)."""
    return f"{ENV_KEY_PREFIX}{env}/{key.removeprefix(KEY_PREFIX)}"


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """A bucket label of a family of series: ``buckets`` as W&B keys spell them, ``values`` as
    Prometheus and OpenTelemetry label them (``+Inf``), ``placeholder`` in a W&B key template."""

    label: str
    buckets: tuple[str, ...]
    values: tuple[str, ...]
    placeholder: str


LAG = Dimension(label="lag", buckets=LAG_BUCKETS, values=(*LAG_BUCKETS[:-1], "+Inf"), placeholder="{lag}")
# SPEC 14: the excess curve's buckets (lags 1..16) and the floor's source.
CURVE_LAG = Dimension(label="lag", buckets=LAG_BUCKETS[1:17], values=LAG_BUCKETS[1:17], placeholder="{lag}")
FLOOR_SOURCE = Dimension(label="source", buckets=FLOOR_SOURCES, values=FLOOR_SOURCES, placeholder="{source}")
LENGTH = Dimension(label="length", buckets=LENGTH_BUCKETS, values=LENGTH_BUCKETS, placeholder="{length}")


@dataclass(frozen=True, kw_only=True)
class MetricDef:
    """One metric as every exporter names it (keyword arguments only: a row reads as what it says);
    a name left ``None`` is one that exporter does not publish (quantiles come from the histogram in
    PromQL); ``labels`` are the Prometheus labels / OTel attributes."""

    name: str  # stable identifier used in code and docs
    wandb_key: str | None = None
    prometheus_name: str | None = None
    otel_name: str | None = None
    otel_unit: str
    kind: MetricKind = MetricKind.GAUGE
    source: Source = Source.METRIC
    description: str
    labels: tuple[str, ...] = ("run", "env")
    integer: bool = False  # values are integers (maxima, quantiles, counts)
    tally_field: str | None = None
    wandb_summary: str | None = None  # define_metric summary for W&B ("max" for maxima)
    legacy_keys: tuple[str, ...] = ()
    # a family of series, one per bucket (one W&B key each when ``wandb_key`` holds the placeholder)
    dimension: Dimension | None = None
    mismatch_field: str | None = None  # the MismatchSums field of a Source.MISMATCH row

    @property
    def wandb_keys(self) -> tuple[str, ...]:
        """The row's W&B key, or for a templated key one per bucket, in bucket order."""
        if self.wandb_key is None:
            return ()
        if self.dimension is None or self.dimension.placeholder not in self.wandb_key:
            return (self.wandb_key,)
        return tuple(self.wandb_key.replace(self.dimension.placeholder, b) for b in self.dimension.buckets)

    @property
    def keys_by_bucket(self) -> dict[str, str]:
        """A templated row's W&B key per bucket (``{"0": "staleness/mismatch/lag_0/k3", ...}``)."""
        assert self.dimension is not None and self.wandb_key is not None, f"{self.name} has no W&B key per bucket"
        return dict(zip(self.dimension.buckets, self.wandb_keys, strict=True))


_STEP = "{step}"
_TOKEN = "{token}"
_ROLLOUT = "{rollout}"
_SAMPLE = "{sample}"
_NAT = "{nat}"  # natural units of information (log-ratios and KL)
_FLAG = "{flag}"  # a 0/1 gauge (unit "1" would make the collector name it ..._ratio)
_LAG_LABELS = ("run", "env", "lag")  # env: the per-env series of live sums given per env


def _published(wandb_key: str, suffix: str = "") -> dict[str, str]:
    """A row's W&B key and the names spelled after it (``staleness/token/mean`` with ``_steps``:
    ``rl_staleness_token_mean_steps``, and ``rl.staleness.token.mean`` in OpenTelemetry)."""
    path = wandb_key.split("/")
    prometheus, otel = "rl_" + "_".join(path) + suffix, "rl." + ".".join(path)
    return {"wandb_key": wandb_key, "prometheus_name": prometheus, "otel_name": otel}


def _family(**shared: Any) -> Callable[..., MetricDef]:
    """Rows sharing ``shared`` (each may override it); a tally row reads its name's Tally field and
    takes its names from it (``tokens_sampled``: ``rl_staleness_tokens_sampled_total``, and
    ``rl.staleness.tokens.sampled`` in OpenTelemetry)."""

    def row(**fields: Any) -> MetricDef:
        name = fields["name"]
        if shared.get("source") is Source.TALLY:
            otel = "rl.staleness." + name.replace("_", ".")
            named = {"prometheus_name": f"rl_staleness_{name}_total", "otel_name": otel}
            fields = {"tally_field": name, **named, **fields}
        return MetricDef(**{**shared, **fields})

    return row


_COUNTER: dict[str, Any] = {"kind": MetricKind.COUNTER, "source": Source.TALLY, "integer": True}
_sample_counter = _family(**_COUNTER, otel_unit=_SAMPLE)
_token_counter = _family(**_COUNTER, otel_unit=_TOKEN)
_rollout_counter = _family(**_COUNTER, otel_unit=_ROLLOUT)
_histogram = _family(kind=MetricKind.HISTOGRAM, otel_unit=_STEP)
_BY_LAG: dict[str, Any] = {"labels": _LAG_LABELS, "dimension": LAG}
_BY_LENGTH: dict[str, Any] = {"labels": ("run", "env", "length"), "dimension": LENGTH}
_lag_gauge = _family(**_BY_LAG)
_lag_sum = _family(kind=MetricKind.COUNTER, source=Source.MISMATCH, **_BY_LAG)
_lag_count = _family(kind=MetricKind.COUNTER, source=Source.MISMATCH, integer=True, otel_unit=_TOKEN, **_BY_LAG)
_bound_gauge = _family(source=Source.BOUND, labels=("run", "env"))
_steps = _family(otel_unit=_STEP)
_integer_steps = _family(otel_unit=_STEP, integer=True)
_staleness_max = _family(otel_unit=_STEP, integer=True, wandb_summary="max")
_run_k3 = _family(otel_unit=_NAT, labels=("run",), wandb_summary="max")
_share = _family(otel_unit="1")
_tokens = _family(otel_unit=_TOKEN)
_length_counter = _family(
    kind=MetricKind.COUNTER, source=Source.TALLY_BUCKETS, integer=True, otel_unit=_TOKEN, **_BY_LENGTH
)

# The order of the rows is the order of every exporter's output and of the generated files.
METRICS: tuple[MetricDef, ...] = (
    # ---- SPEC 6: the metrics of a ship (W&B keys), with their Prometheus / OpenTelemetry names (SPEC 8)
    _integer_steps(
        name="train_step",
        prometheus_name="rl_staleness_train_step",
        otel_name="rl.staleness.train.step",
        source=Source.STEP,
        labels=("run",),
        description="Train step of the last shipped batch.",
    ),
    _integer_steps(
        name="max_staleness",
        **_published("staleness/max_staleness"),
        labels=("run",),
        description=(
            "The staleness bound the ship was judged with (max_staleness, or where adaptation "
            "moved it), in policy versions."
        ),
    ),
    _steps(
        name="token_mean",
        **_published("staleness/token/mean", "_steps"),
        legacy_keys=("off_policy/token/mean",),
        description="Mean token staleness over the sampled positions of the shipped batch, in policy versions.",
    ),
    _share(
        name="token_masked",
        wandb_key="staleness/token/masked",
        prometheus_name="rl_staleness_token_masked_ratio",
        otel_name="rl.staleness.token.masked_ratio",
        legacy_keys=("off_policy/token/masked",),
        description="Share of the shipped batch's sampled positions that are masked for staleness.",
    ),
    _share(
        name="token_unlabelled",
        wandb_key="staleness/token/unlabelled",
        description="Share of the shipped batch's sampled positions that had no version label.",
    ),
    _integer_steps(
        name="token_p50",
        wandb_key="staleness/token/p50",
        description="Median token staleness (nearest rank).",
    ),
    _integer_steps(
        name="token_p90",
        wandb_key="staleness/token/p90",
        description="90th percentile token staleness (nearest rank).",
    ),
    _integer_steps(
        name="token_p99",
        wandb_key="staleness/token/p99",
        description="99th percentile token staleness (nearest rank).",
    ),
    _steps(
        name="rollout_mean",
        **_published("staleness/rollout/mean", "_steps"),
        legacy_keys=("off_policy/mean", "staleness/mean"),
        description="Mean rollout staleness R = T - min(version) over shipped live rollouts.",
    ),
    _staleness_max(
        name="rollout_max",
        **_published("staleness/rollout/max", "_steps"),
        legacy_keys=("off_policy/max", "staleness/max"),
        description="Largest rollout staleness in the shipped batch (equals the largest token staleness).",
    ),
    _steps(
        name="rollout_in_flight_mean",
        **_published("staleness/rollout/in_flight/mean", "_steps"),
        legacy_keys=("off_policy/in_flight/mean", "staleness/in_flight/mean"),
        description="Mean in-flight staleness (versions that passed while the rollout was generated).",
    ),
    _staleness_max(
        name="rollout_in_flight_max",
        **_published("staleness/rollout/in_flight/max", "_steps"),
        legacy_keys=("off_policy/in_flight/max", "staleness/in_flight/max"),
        description="Largest in-flight staleness in the shipped batch.",
    ),
    _steps(
        name="rollout_in_queue_mean",
        **_published("staleness/rollout/in_queue/mean", "_steps"),
        legacy_keys=("off_policy/in_queue/mean", "staleness/in_queue/mean"),
        description="Mean in-queue staleness (versions that passed while the finished rollout waited).",
    ),
    _staleness_max(
        name="rollout_in_queue_max",
        **_published("staleness/rollout/in_queue/max", "_steps"),
        legacy_keys=("off_policy/in_queue/max", "staleness/in_queue/max"),
        description="Largest in-queue staleness in the shipped batch.",
    ),
    _steps(
        name="rollout_newest_mean",
        **_published("staleness/rollout/newest/mean", "_steps"),
        description=(
            "Mean newest-token rollout staleness T - max(version) over shipped live rollouts "
            "(verl's trajectory staleness; the rollout mean uses the oldest token)."
        ),
    ),
    _staleness_max(
        name="rollout_newest_max",
        **_published("staleness/rollout/newest/max", "_steps"),
        description="Largest newest-token rollout staleness T - max(version) in the shipped batch.",
    ),
    _rollout_counter(
        name="rollouts_dropped",
        wandb_key="staleness/rollout/dropped",
        legacy_keys=("off_policy/dropped", "staleness/dropped"),
        description="Live rollouts dropped for staleness (per ship window in W&B; cumulative elsewhere).",
    ),
    _sample_counter(
        name="samples_dropped",
        wandb_key="staleness/sample/dropped",
        description="Samples dropped for staleness (per ship window in W&B; cumulative elsewhere).",
    ),
    MetricDef(
        name="rollouts_held",
        wandb_key="staleness/rollout/held",
        prometheus_name="rl_staleness_rollouts_held",
        otel_name="rl.staleness.rollouts.held",
        otel_unit=_ROLLOUT,
        source=Source.TALLY,
        integer=True,
        tally_field="rollouts_held",
        description="Rollouts held back at the last ship (xtuner policy with retry_expired).",
    ),
    # ---- SPEC 8: the histograms and counters behind SPEC 6 (Prometheus / OpenTelemetry; mergeable sums)
    _histogram(
        name="token_staleness",
        wandb_key="staleness/token/histogram",
        prometheus_name="rl_staleness_token_steps",
        otel_name="rl.staleness.token.steps",
        source=Source.TOKEN_HISTOGRAM,
        description="Token staleness of shipped sampled positions, in policy versions (integer buckets).",
    ),
    _histogram(
        name="rollout_staleness",
        prometheus_name="rl_staleness_rollout_steps",
        otel_name="rl.staleness.rollout.steps",
        source=Source.ROLLOUT_HISTOGRAM,
        description="Rollout staleness of shipped live rollouts, in policy versions (integer buckets).",
    ),
    _token_counter(
        name="tokens_sampled",
        description="Sampled positions of shipped live samples, masked ones included.",
    ),
    _token_counter(
        name="tokens_masked",
        description="Shipped sampled positions masked for staleness.",
    ),
    _token_counter(
        name="tokens_dropped",
        description="Sampled positions of samples dropped for staleness.",
    ),
    _token_counter(
        name="tokens_unlabelled",
        description="Shipped sampled positions without a version label (they take the dispatch version).",
    ),
    _rollout_counter(name="rollouts_shipped", description="Live rollouts shipped to the trainer."),
    _rollout_counter(
        name="rollouts_frozen",
        description="Frozen-model rollouts shipped (never masked, left out of staleness statistics).",
    ),
    _rollout_counter(
        name="rollouts_invalid",
        description="Rollouts set aside as invalid (lenient mode).",
    ),
    # ---- SPEC 11: what staleness costs. Counters are the mergeable sums; each ratio derives from
    # them (PromQL over rates, the core for W&B), so W&B-only rows below lack Prometheus/OTel names.
    _lag_count(
        name="mismatch_tokens",
        wandb_key="staleness/mismatch/lag_{lag}/tokens",
        prometheus_name="rl_staleness_mismatch_tokens_total",
        otel_name="rl.staleness.mismatch.tokens",
        mismatch_field="tokens",
        description=(
            "Covered sampled positions (trainer and sampler log-probabilities both known), per token lag bucket."
        ),
    ),
    _lag_count(
        name="mismatch_masked",
        prometheus_name="rl_staleness_mismatch_masked_tokens_total",
        otel_name="rl.staleness.mismatch.masked_tokens",
        mismatch_field="masked",
        description="Covered sampled positions masked by the staleness policy, per token lag bucket.",
    ),
    _lag_sum(
        name="mismatch_kl",
        prometheus_name="rl_staleness_mismatch_kl_nats_total",
        otel_name="rl.staleness.mismatch.kl",
        otel_unit=_NAT,
        mismatch_field="sum_k3",
        description=(
            "Sum of the k3 estimator r - 1 - log r of trainer/sampler mismatch (r = "
            "trainer/sampler probability), per token lag bucket, in nats."
        ),
    ),
    _lag_sum(
        name="mismatch_abs_log_ratio",
        prometheus_name="rl_staleness_mismatch_abs_log_ratio_nats_total",
        otel_name="rl.staleness.mismatch.abs_log_ratio",
        otel_unit=_NAT,
        mismatch_field="sum_abs_log_ratio",
        description="Sum of |log r| of trainer/sampler mismatch, per token lag bucket, in nats.",
    ),
    _lag_sum(
        name="mismatch_ratio",
        prometheus_name="rl_staleness_mismatch_ratio_total",
        otel_name="rl.staleness.mismatch.ratio",
        otel_unit="1",
        mismatch_field="sum_ratio",
        description="Sum of the importance ratios r = trainer/sampler probability, per token lag bucket.",
    ),
    _lag_sum(
        name="mismatch_ratio_squared",
        prometheus_name="rl_staleness_mismatch_ratio_squared_total",
        otel_name="rl.staleness.mismatch.ratio_squared",
        otel_unit="1",
        mismatch_field="sum_ratio_sq",
        description="Sum of the squared importance ratios r^2, per token lag bucket.",
    ),
    _lag_count(
        name="mismatch_out_of_band",
        prometheus_name="rl_staleness_mismatch_out_of_band_tokens_total",
        otel_name="rl.staleness.mismatch.out_of_band_tokens",
        mismatch_field="out_of_band",
        description=(
            "Covered sampled positions whose importance ratio lies outside the mismatch band, per token lag bucket."
        ),
    ),
    _lag_count(
        name="mismatch_uncovered",
        prometheus_name="rl_staleness_mismatch_uncovered_tokens_total",
        otel_name="rl.staleness.mismatch.uncovered_tokens",
        labels=("run", "env"),
        dimension=None,
        mismatch_field="uncovered",
        description="Sampled positions lacking a trainer or sampler log-probability (left out of the mismatch sums).",
    ),
    _lag_gauge(
        name="mismatch_k3_by_lag",
        wandb_key="staleness/mismatch/lag_{lag}/k3",
        otel_unit=_NAT,
        wandb_summary="max",
        description="Mean k3 mismatch of the covered positions of a lag bucket (prime-rl's mismatch_kl, split by lag).",
    ),
    _lag_gauge(
        name="mismatch_abs_log_ratio_by_lag",
        wandb_key="staleness/mismatch/lag_{lag}/abs_log_ratio",
        otel_unit=_NAT,
        description="Mean |log r| of the covered positions of a lag bucket.",
    ),
    _lag_gauge(
        name="mismatch_out_of_band_by_lag",
        wandb_key="staleness/mismatch/lag_{lag}/out_of_band",
        otel_unit="1",
        description="Share of the covered positions of a lag bucket whose ratio lies outside the mismatch band.",
    ),
    _lag_gauge(
        name="mismatch_ess_by_lag",
        wandb_key="staleness/mismatch/lag_{lag}/ess",
        otel_unit="1",
        description="Normalised effective sample size (sum r)^2 / (n sum r^2) of a lag bucket, in (0, 1].",
    ),
    _lag_gauge(
        name="mismatch_excess_k3_by_lag",
        wandb_key="staleness/mismatch/lag_{lag}/excess_k3",
        otel_unit=_NAT,
        wandb_summary="max",
        description=(
            "Mean k3 of a lag bucket minus the run's floor (SPEC 14: this ship's lag-0 k3, carried "
            "from an earlier ship, or the smallest lag's): what staleness costs at that lag."
        ),
    ),
    _run_k3(
        name="mismatch_k3",
        wandb_key="staleness/mismatch/k3",
        description="Mean k3 mismatch over every covered position.",
    ),
    _run_k3(
        name="mismatch_excess_k3",
        wandb_key="staleness/mismatch/excess_k3",
        description="Mean k3 of the positions at lag 1 or more minus the floor (SPEC 14).",
    ),
    _share(
        name="mismatch_coverage",
        wandb_key="staleness/mismatch/coverage",
        labels=("run",),
        description="Share of sampled positions with both log-probabilities (covered by the mismatch sums).",
    ),
    # ---- SPEC 14: choosing the bound. Gauges of the latest ship that reported the SPEC 11 family
    _bound_gauge(
        name="mismatch_floor",
        **_published("staleness/mismatch/floor", "_nats"),
        otel_unit=_NAT,
        labels=("run", "env", "source"),
        dimension=FLOOR_SOURCE,
        description=(
            "The engines' numeric mismatch floor (mean k3) the excess is measured against; source "
            "lag0 (this ship's lag-0 tokens), carried (an earlier ship's) or min_lag (the smallest "
            "lag with enough tokens: an upper bound on the floor)."
        ),
    ),
    _bound_gauge(
        name="mismatch_floor_source",
        wandb_key="staleness/mismatch/floor_source",
        otel_unit="1",
        description="Where the floor came from: lag0, carried or min_lag (a string; a label or attribute elsewhere).",
    ),
    _bound_gauge(
        name="mismatch_floor_age",
        **_published("staleness/mismatch/floor_age", "_steps"),
        otel_unit=_STEP,
        integer=True,
        description="Steps since the ship that measured the floor (0 for lag0 and min_lag).",
    ),
    _bound_gauge(
        name="mismatch_budget",
        **_published("staleness/mismatch/budget", "_nats"),
        otel_unit=_NAT,
        description=(
            "The mismatch budget: the excess a token may cost (mismatch_budget, or the floor when none is set)."
        ),
    ),
    _bound_gauge(
        name="mismatch_curve",
        wandb_key="staleness/mismatch/curve/lag_{lag}",
        prometheus_name="rl_staleness_mismatch_curve_nats",
        otel_name="rl.staleness.mismatch.curve",
        otel_unit=_NAT,
        labels=("run", "env", "lag"),
        dimension=CURVE_LAG,
        description=(
            "Excess k3 over the floor by lag, pooled over the last cost_window ships and made "
            "non-decreasing in lag (weighted isotonic regression); lags 1..16 with at least "
            "floor_min_tokens tokens."
        ),
    ),
    _bound_gauge(
        name="bound_suggested",
        **_published("staleness/bound/suggested"),
        otel_unit=_STEP,
        integer=True,
        description=(
            "The largest lag whose excess stays within the budget (0 when the first lag of the curve is above it)."
        ),
    ),
    _bound_gauge(
        name="bound_crossed",
        **_published("staleness/bound/crossed"),
        otel_unit=_FLAG,
        integer=True,
        description=(
            "1 when some lag of the curve costs more than the budget (the suggestion is where), "
            "else 0 (the suggestion is only the largest lag seen)."
        ),
    ),
    _bound_gauge(
        name="bound_excess_at_bound",
        **_published("staleness/bound/excess_at_bound", "_nats"),
        otel_unit=_NAT,
        wandb_summary="max",
        description="The curve's excess at the largest lag not above the configured bound: what the bound lets train.",
    ),
    # ---- SPEC 12: length bias of masking and drops, over shipped plus dropped samples ----
    _sample_counter(
        name="length_samples",
        description="Samples behind the length-bias counters: shipped live samples plus samples dropped for staleness.",
    ),
    _length_counter(
        name="length_sampled_tokens",
        prometheus_name="rl_staleness_length_sampled_tokens_total",
        otel_name="rl.staleness.length.sampled_tokens",
        tally_field="length_sampled",
        description="Sampled positions of shipped and dropped live samples, by the sample's sampled length bucket.",
    ),
    _length_counter(
        name="length_removed_tokens",
        prometheus_name="rl_staleness_length_removed_tokens_total",
        otel_name="rl.staleness.length.removed_tokens",
        tally_field="length_removed",
        description=(
            "Sampled positions of shipped and dropped live samples that were masked or dropped for "
            "staleness, by the sample's sampled length bucket."
        ),
    ),
    _tokens(
        name="length_sampled_mean",
        wandb_key="staleness/length/sampled/mean",
        description="Mean sampled length (positions) of the shipped and dropped live samples of the window.",
    ),
    _tokens(
        name="length_trained_mean",
        wandb_key="staleness/length/trained/mean",
        description="The same mean with masked positions and dropped samples counted as 0: the length that trains.",
    ),
    _share(
        name="length_removed_share",
        wandb_key="staleness/length/bucket_{length}/masked",
        **_BY_LENGTH,
        description="Share of the sampled positions masked or dropped, over samples of a length bucket.",
    ),
    # ---- SPEC 8: the exporters' own health ----
    MetricDef(
        name="export_errors",
        prometheus_name="rl_staleness_export_errors_total",
        otel_name="rl.staleness.export.errors",
        otel_unit="{error}",
        kind=MetricKind.COUNTER,
        source=Source.EXPORTER,
        labels=("run", "exporter"),
        integer=True,
        description="Failed exports, per exporter.",
    ),
)


# ---- SPEC 7: legacy keys and the rename ----
@dataclass(frozen=True)
class LegacyKey:
    """What an old W&B key became: a new key, or ``None`` with the reason it was removed."""

    old: str
    new: str | None
    reason: str = ""


LEGACY_NAMESPACE = "off_policy/"  # a key under it not in the table: legacy, unmapped

_EQUALS_ROLLOUT_MAX = "equals staleness/rollout/max (rollout staleness includes masked positions)"
_DISPATCHER = "live dispatcher gauge with no replacement"

REMOVED_KEY_FAMILIES: Mapping[str, str] = {
    "dispatcher/off_policy/": _DISPATCHER,
    "dispatcher/off_policy_level/": _DISPATCHER,
    "dispatcher/staleness/": _DISPATCHER,
}
"""Prefixes whose keys are all removed (``dispatcher/off_policy/*``: no replacement), and why."""

REMOVED_KEYS: tuple[LegacyKey, ...] = (
    LegacyKey(old="off_policy/token/max", new=None, reason=_EQUALS_ROLLOUT_MAX),
    LegacyKey(old="staleness/token/max", new=None, reason=_EQUALS_ROLLOUT_MAX),
    *(
        LegacyKey(old=family + stat, new=None, reason=_DISPATCHER)
        for family in REMOVED_KEY_FAMILIES
        for stat in ("mean", "max")
    ),
)
"""Legacy W&B keys with no replacement, and why (the renamed ones are the rows' ``legacy_keys``)."""

LEGACY_PROMETHEUS_NAMES: Mapping[str, str] = {
    # old Prometheus name -> the legacy W&B key it published
    "off_policy_mean": "off_policy/mean",
    "off_policy_max": "off_policy/max",
    "off_policy_in_flight_mean": "off_policy/in_flight/mean",
    "off_policy_in_flight_max": "off_policy/in_flight/max",
    "off_policy_in_queue_mean": "off_policy/in_queue/mean",
    "off_policy_in_queue_max": "off_policy/in_queue/max",
    "off_policy_token_mean": "off_policy/token/mean",
    "off_policy_token_masked": "off_policy/token/masked",
    "off_policy_token_max": "off_policy/token/max",
    "off_policy_dropped": "off_policy/dropped",
    "off_policy_dropped_total": "off_policy/dropped",
    "dispatcher_off_policy_mean": "dispatcher/off_policy/mean",
    "dispatcher_off_policy_max": "dispatcher/off_policy/max",
    "dispatcher_off_policy_level_mean": "dispatcher/off_policy_level/mean",
    "dispatcher_off_policy_level_max": "dispatcher/off_policy_level/max",
    "staleness_mean": "staleness/mean",
    "staleness_max": "staleness/max",
    "staleness_in_flight_mean": "staleness/in_flight/mean",
    "staleness_in_flight_max": "staleness/in_flight/max",
    "staleness_in_queue_mean": "staleness/in_queue/mean",
    "staleness_in_queue_max": "staleness/in_queue/max",
    "staleness_token_max": "staleness/token/max",
    "staleness_dropped": "staleness/dropped",
    "staleness_dropped_total": "staleness/dropped",
    "dispatcher_staleness_mean": "dispatcher/staleness/mean",
    "dispatcher_staleness_max": "dispatcher/staleness/max",
    # prime-rl's orchestrator exporter (gauges fed from its off_policy_level/all/* dispatcher stats)
    "orchestrator_off_policy_level_min": "dispatcher/off_policy_level/min",
    "orchestrator_off_policy_level_mean": "dispatcher/off_policy_level/mean",
    "orchestrator_off_policy_level_max": "dispatcher/off_policy_level/max",
}
"""Legacy Prometheus names (bare, without a namespace prefix) -> the legacy W&B key each one published."""


LEGACY_KEYS: dict[str, LegacyKey] = {
    **{old: LegacyKey(old, metric.wandb_key) for metric in METRICS for old in metric.legacy_keys},
    **{removed.old: removed for removed in REMOVED_KEYS},
}
"""Every legacy W&B key: what it is now (a row's key) or why it was removed."""

# ---- lookups: every W&B key spelled out, templated rows expanded once here ----
WANDB_KEYS: dict[str, MetricDef] = {key: m for m in METRICS for key in m.wandb_keys}
_BY_PROM = {m.prometheus_name: m for m in METRICS if m.prometheus_name is not None}
# the row of a stable identifier, a W&B key, a Prometheus family name (KeyError for none)
metric_named = {m.name: m for m in METRICS}.__getitem__
metric_by_key = WANDB_KEYS.__getitem__
metric_by_prometheus_name = _BY_PROM.__getitem__


# Counters with a batch-wide series (env="") beside the per-env ones: SPEC 12's length counters
# and SPEC 11's mismatch family (per env when the trainer's sums are given per env).
BATCH_WIDE_COUNTERS = frozenset(
    {"length_samples", "length_sampled_tokens", "length_removed_tokens"}
    | {row.name for row in METRICS if row.source is Source.MISMATCH}
)
