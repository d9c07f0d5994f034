"""The legacy mapping (SPEC 7): what each old name is now, as data and as properties."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.config import RENAMED_SETTINGS, StalenessConfig
from staleness_metrics.errors import ConfigError
from staleness_metrics.metrics import metric_table
from staleness_metrics.metrics.metric_table import LEGACY_KEYS, METRICS
from staleness_metrics.migrate import legacy
from staleness_metrics.migrate.model import Action
from staleness_metrics.migrate.names import Context, Scanner

# SPEC 7, spelled out by hand: the table must say exactly this.
SPEC_RENAMES = {
    "off_policy/mean": "staleness/rollout/mean",
    "off_policy/max": "staleness/rollout/max",
    "off_policy/in_flight/mean": "staleness/rollout/in_flight/mean",
    "off_policy/in_flight/max": "staleness/rollout/in_flight/max",
    "off_policy/in_queue/mean": "staleness/rollout/in_queue/mean",
    "off_policy/in_queue/max": "staleness/rollout/in_queue/max",
    "off_policy/token/mean": "staleness/token/mean",
    "off_policy/token/masked": "staleness/token/masked",
    "off_policy/dropped": "staleness/rollout/dropped",
    "staleness/mean": "staleness/rollout/mean",
    "staleness/max": "staleness/rollout/max",
    "staleness/in_flight/mean": "staleness/rollout/in_flight/mean",
    "staleness/in_flight/max": "staleness/rollout/in_flight/max",
    "staleness/in_queue/mean": "staleness/rollout/in_queue/mean",
    "staleness/in_queue/max": "staleness/rollout/in_queue/max",
    "staleness/dropped": "staleness/rollout/dropped",
}
SPEC_REMOVED = [
    "off_policy/token/max",
    "dispatcher/off_policy/mean",
    "dispatcher/off_policy/max",
    "dispatcher/off_policy_level/mean",
    "dispatcher/off_policy_level/max",
    "dispatcher/staleness/mean",
    "dispatcher/staleness/max",
]


def test_the_table_holds_spec_7() -> None:
    for old, new in SPEC_RENAMES.items():
        assert legacy.migrate_key(old) == metric_table.LegacyKey(old, new, LEGACY_KEYS[old].reason)
    for old in SPEC_REMOVED:
        found = legacy.migrate_key(old)
        assert found is not None and found.new is None and found.reason, old
    assert "staleness/rollout/max" in LEGACY_KEYS["off_policy/token/max"].reason
    assert RENAMED_SETTINGS["max_off_policy_steps"] == "max_staleness"
    assert legacy.CONSOLE_LABELS["Max Off-Policy"] == "Max Staleness"


def test_a_removed_family_covers_keys_the_table_does_not_list() -> None:
    found = legacy.migrate_key("dispatcher/off_policy/p90")
    assert found is not None and found.new is None
    assert legacy.current_key("dispatcher/staleness/min") is None


def test_current_and_unknown_keys_are_not_legacy() -> None:
    for key in [*legacy.CURRENT_KEYS, "staleness/env/math/rollout/max", "train/agg/all/reward/mean"]:
        assert legacy.migrate_key(key) is None
        assert legacy.current_key(key) == key
    assert legacy.migrate_key("off_policy/custom") is None
    assert legacy.in_legacy_namespace("off_policy/custom")


def test_every_legacy_key_is_listed_once() -> None:
    listed = Counter(old for metric in METRICS for old in metric.legacy_keys)
    assert [old for old, count in listed.items() if count > 1] == []
    removed = {old for old, found in LEGACY_KEYS.items() if found.new is None}
    assert removed.isdisjoint(listed), "a key is both renamed and removed"


def test_no_new_key_is_shadowed_by_an_alias() -> None:
    assert legacy.CURRENT_KEYS.isdisjoint(LEGACY_KEYS)
    scanner = Scanner(prometheus=True)
    for name in [*legacy.CURRENT_KEYS, *legacy.CURRENT_PROMETHEUS_NAMES]:
        assert scanner.scan(name, Context.TEXT).hits == (), name
        assert scanner.scan(f"max({name})", Context.PROMQL).hits == (), name
    for name in legacy.CURRENT_PROMETHEUS_NAMES:
        assert legacy.migrate_prometheus_name(name, ("rl_", "rl_staleness_")) is None


def test_config_rejects_the_old_setting_and_names_the_way_out() -> None:
    with pytest.raises(ConfigError) as raised:
        StalenessConfig.from_mapping({"max_off_policy_steps": 8})
    assert "max_staleness" in str(raised.value)
    assert "staleness-metrics migrate" in str(raised.value)
    assert StalenessConfig.from_mapping({"max_staleness": 4}).max_staleness == 4


# -- Prometheus forms ---------------------------------------------------------------------------------


def test_legacy_prometheus_names_are_the_keys_with_slashes_as_underscores() -> None:
    """The data is spelled out in legacy.py; here it is checked against the rule it follows."""
    for bare, key in metric_table.LEGACY_PROMETHEUS_NAMES.items():
        if bare.startswith("orchestrator_off_policy_level_"):
            assert key.startswith("dispatcher/off_policy_level/")  # prime-rl's own exporter
            continue
        assert bare.removesuffix("_total") == key.replace("/", "_"), bare
    covered = set(metric_table.LEGACY_PROMETHEUS_NAMES.values())
    assert set(LEGACY_KEYS) <= covered


def test_prometheus_names_map_to_the_table() -> None:
    mean = legacy.migrate_prometheus_name("off_policy_mean")
    assert mean is not None and mean.new == "rl_staleness_rollout_mean_steps"
    prefixed = legacy.migrate_prometheus_name("orchestrator_off_policy_in_flight_max")
    assert prefixed is not None and prefixed.new == "rl_staleness_rollout_in_flight_max_steps"
    gauge = legacy.migrate_prometheus_name("off_policy_dropped")
    assert gauge is not None and gauge.new == "rl_staleness_rollouts_dropped_total"
    assert "increase()" in gauge.reason  # a per-step gauge became a counter
    level = legacy.migrate_prometheus_name("orchestrator_off_policy_level_max")
    assert level is not None and level.new is None
    assert legacy.migrate_prometheus_name("myteam_off_policy_mean") is None
    custom = legacy.migrate_prometheus_name("myteam_off_policy_mean", ("myteam_",))
    assert custom is not None and custom.new == "rl_staleness_rollout_mean_steps"


# -- properties ---------------------------------------------------------------------------------------

SEGMENTS = st.sampled_from(["off_policy", "staleness", "rollout", "token", "mean", "max", "in_flight", "x"])
ANY_KEY = st.one_of(
    st.sampled_from(sorted(LEGACY_KEYS)),
    st.sampled_from(sorted(legacy.CURRENT_KEYS)),
    st.lists(SEGMENTS, min_size=1, max_size=4).map("/".join),
)


@given(ANY_KEY)
def test_mapping_twice_is_mapping_once(key: str) -> None:
    once = legacy.current_key(key)
    if once is not None:
        assert legacy.current_key(once) == once
        assert legacy.migrate_key(once) is None


@given(st.sampled_from(sorted(LEGACY_KEYS)))
def test_every_legacy_key_has_exactly_one_fate(key: str) -> None:
    found = legacy.migrate_key(key)
    assert found is not None and found.old == key
    if found.new is None:
        assert found.reason  # removed: always with the reason
    else:
        assert found.new in legacy.CURRENT_KEYS


FILLER = st.sampled_from([" ", ", ", " | ", "\n", "(", ") ", "x", "rate ", "staleness_metrics "])
LEGACY_NAME = st.sampled_from(
    sorted(LEGACY_KEYS) + sorted(metric_table.LEGACY_PROMETHEUS_NAMES) + ["max_off_policy_steps", "Max Off-Policy"]
)


@settings(max_examples=200)
@given(st.lists(st.one_of(FILLER, LEGACY_NAME, st.sampled_from(sorted(legacy.CURRENT_KEYS))), max_size=12))
def test_rewriting_text_twice_changes_nothing_more(parts: list[str]) -> None:
    scanner = Scanner(prometheus=True)
    text = "".join(parts)
    once = scanner.scan(text, Context.TEXT)
    twice = scanner.scan(once.text, Context.TEXT)
    assert twice.text == once.text
    assert all(hit.action is not Action.RENAME for hit in twice.hits)


RENAMED_KEYS = sorted(k for k, v in LEGACY_KEYS.items() if v.new is not None)


@settings(max_examples=200)
@given(st.sets(st.sampled_from(sorted(LEGACY_KEYS)), min_size=1))
def test_a_regex_over_old_keys_becomes_one_over_their_new_keys(keys: set[str]) -> None:
    pattern = "^(?:" + "|".join(re.escape(k) for k in sorted(keys)) + ")$"
    rewrite = legacy.rewrite_key_regex(pattern)
    assert rewrite is not None
    expected = {new for k in keys if (new := LEGACY_KEYS[k].new) is not None}
    if not expected:
        assert rewrite.pattern is None and set(rewrite.removed) == keys
        return
    assert rewrite.pattern is not None
    universe = [*legacy.CURRENT_KEYS, *LEGACY_KEYS]
    assert {name for name in universe if re.search(rewrite.pattern, name)} == expected
    assert legacy.rewrite_key_regex(rewrite.pattern) is None  # idempotent


def test_a_namespace_regex_is_rewritten_and_a_current_one_left_alone() -> None:
    rewrite = legacy.rewrite_key_regex("off_policy/in_flight/.*")
    assert rewrite is not None and rewrite.pattern == "^staleness/rollout/in_flight/(?:max|mean)$"
    assert legacy.rewrite_key_regex("staleness/.*") is None  # matches the new keys already
    assert legacy.rewrite_key_regex(".*/mean") is None  # not about the rename
    prom = legacy.rewrite_key_regex("off_policy_in_queue_.*", "prometheus")
    assert prom is not None and prom.pattern is not None
    assert re.fullmatch(prom.pattern, "rl_staleness_rollout_in_queue_max_steps")
    assert not re.fullmatch(prom.pattern, "rl_staleness_rollout_in_flight_max_steps")
    with pytest.raises(ValueError):
        legacy.rewrite_key_regex("off_policy/(")
