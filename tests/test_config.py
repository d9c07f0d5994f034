"""The configuration model: the same validation everywhere the bound is set."""

from __future__ import annotations

import pytest

from staleness_metrics import ConfigError, Sink, StalenessConfig


def test_renamed_setting_names_the_new_one_and_the_migrate_command() -> None:
    with pytest.raises(ConfigError, match="max_staleness") as caught:
        StalenessConfig.from_mapping({"max_off_policy_steps": 8})
    assert "staleness-metrics migrate" in str(caught.value)


def test_the_constructor_refuses_the_renamed_setting_as_from_mapping_does() -> None:
    """SPEC 7: StalenessConfig(max_off_policy_steps=8) was a TypeError naming only the old name."""
    with pytest.raises(ConfigError) as from_mapping:
        StalenessConfig.from_mapping({"max_off_policy_steps": 8})
    old_and_new = {"max_staleness": 4, "max_off_policy_steps": 8}
    with pytest.raises(ConfigError, match="renamed to 'max_staleness'") as constructed:
        StalenessConfig(**old_and_new)
    assert str(constructed.value) == str(from_mapping.value)
    assert (constructed.value.field, constructed.value.reason) == (from_mapping.value.field, from_mapping.value.reason)


@pytest.mark.parametrize(
    "settings",
    [
        {"max_staleness": -1},
        {"max_staleness": 2**60},
        {"max_staleness": True},
        {"policy": "fifo"},
        {"policy": "token", "retry_expired": True},
        {"policy": "xtuner", "sync_interval": 0},
        {"unknown": 1},
    ],
)
def test_invalid_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        StalenessConfig.from_mapping(settings)


def test_xtuner_thresholds_that_overflow_int64_are_refused_and_those_that_fit_judge() -> None:
    """SPEC 5's ``(max_token_staleness + 1) * k``: each setting in range, the product not (before, the
    first ship raised OverflowError)."""
    settings = {"policy": "xtuner", "max_staleness": 0, "sync_interval": 2**32}
    with pytest.raises(ConfigError, match=r"max_token_staleness: \(max_token_staleness \+ 1\) \* sync_interval"):
        StalenessConfig(**settings, max_token_staleness=2**32)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_staleness: "):
        StalenessConfig(policy="xtuner", max_staleness=2**40, sync_interval=2**30)
    config = StalenessConfig(**settings, max_token_staleness=2**29)  # type: ignore[arg-type]
    sink = Sink(config)
    sink.add({"id": "a", "dispatch_version": 0, "samples": [{"mask": [1]}]})
    assert [r.id for r in sink.ship(1).rollouts] == ["a"]
