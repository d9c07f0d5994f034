"""The W&B keys code writes or reads by name, read from the catalogue by each row's identifier (a
row with a bucket dimension gives a mapping bucket -> key)."""

from __future__ import annotations

from .metric_table import metric_named


def _key(name: str) -> str:
    key = metric_named(name).wandb_key
    assert key is not None, f"the row {name} has no W&B key"
    return key


# SPEC 6: the metrics of a ship
MAX_STALENESS = _key("max_staleness")
TOKEN_MEAN = _key("token_mean")
TOKEN_MASKED = _key("token_masked")
TOKEN_UNLABELLED = _key("token_unlabelled")
TOKEN_P50 = _key("token_p50")
TOKEN_P90 = _key("token_p90")
TOKEN_P99 = _key("token_p99")
ROLLOUT_MEAN = _key("rollout_mean")
ROLLOUT_MAX = _key("rollout_max")
ROLLOUT_IN_FLIGHT_MEAN = _key("rollout_in_flight_mean")
ROLLOUT_IN_FLIGHT_MAX = _key("rollout_in_flight_max")
ROLLOUT_IN_QUEUE_MEAN = _key("rollout_in_queue_mean")
ROLLOUT_IN_QUEUE_MAX = _key("rollout_in_queue_max")
ROLLOUT_NEWEST_MEAN = _key("rollout_newest_mean")
ROLLOUT_NEWEST_MAX = _key("rollout_newest_max")
ROLLOUTS_DROPPED = _key("rollouts_dropped")
SAMPLES_DROPPED = _key("samples_dropped")
ROLLOUTS_HELD = _key("rollouts_held")
TOKEN_HISTOGRAM = _key("token_staleness")

# SPEC 11: what staleness costs
MISMATCH_TOKENS_BY_LAG = metric_named("mismatch_tokens").keys_by_bucket
MISMATCH_K3_BY_LAG = metric_named("mismatch_k3_by_lag").keys_by_bucket
MISMATCH_ABS_LOG_RATIO_BY_LAG = metric_named("mismatch_abs_log_ratio_by_lag").keys_by_bucket
MISMATCH_OUT_OF_BAND_BY_LAG = metric_named("mismatch_out_of_band_by_lag").keys_by_bucket
MISMATCH_ESS_BY_LAG = metric_named("mismatch_ess_by_lag").keys_by_bucket
MISMATCH_EXCESS_K3_BY_LAG = metric_named("mismatch_excess_k3_by_lag").keys_by_bucket
MISMATCH_K3 = _key("mismatch_k3")
MISMATCH_EXCESS_K3 = _key("mismatch_excess_k3")
MISMATCH_COVERAGE = _key("mismatch_coverage")

# SPEC 14: choosing the bound
MISMATCH_FLOOR = _key("mismatch_floor")
MISMATCH_FLOOR_SOURCE = _key("mismatch_floor_source")
MISMATCH_FLOOR_AGE = _key("mismatch_floor_age")
MISMATCH_BUDGET = _key("mismatch_budget")
MISMATCH_CURVE_BY_LAG = metric_named("mismatch_curve").keys_by_bucket
BOUND_SUGGESTED = _key("bound_suggested")
BOUND_CROSSED = _key("bound_crossed")
BOUND_EXCESS_AT_BOUND = _key("bound_excess_at_bound")

# SPEC 12: length bias of masking and drops
LENGTH_SAMPLED_MEAN = _key("length_sampled_mean")
LENGTH_TRAINED_MEAN = _key("length_trained_mean")
LENGTH_REMOVED_SHARE_BY_LENGTH = metric_named("length_removed_share").keys_by_bucket
