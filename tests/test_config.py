"""The configuration model: the same validation everywhere the bound is set."""

from __future__ import annotations

import pytest

from staleness_metrics import ConfigError, StalenessConfig


def test_renamed_setting_names_the_new_one_and_the_migrate_command() -> None:
    with pytest.raises(ConfigError, match="max_staleness") as caught:
        StalenessConfig.from_mapping({"max_off_policy_steps": 8})
    assert "staleness-metrics migrate" in str(caught.value)


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
