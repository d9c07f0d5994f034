"""``trl.ship`` on samples shaped like TRL's slotted ``RolloutSample`` (the real package and ``AsyncGRPOTrainer``
run in tests/trainers): drops, held samples coming back, lags; ``ship_at_train_time``'s refusal of holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from staleness_metrics import ConfigError, StalenessConfig, StalenessMonitor, TraceError
from staleness_metrics.adapters import trl


@dataclass(slots=True)
class Sample:
    """The fields of trl.experimental.async_grpo's RolloutSample this adapter reads (a slotted dataclass)."""

    input_ids: np.ndarray
    completion_mask: np.ndarray
    old_log_probs: np.ndarray
    model_version: Any
    group_id: int
    metrics: dict[str, float] = field(default_factory=dict)


def sample(version: Any, group: int, prompt: int = 2, completion: int = 3) -> Sample:
    n = prompt + completion
    return Sample(
        input_ids=np.arange(n, dtype=np.int64),
        completion_mask=np.array([0] * prompt + [1] * completion, dtype=np.int64),
        old_log_probs=np.array([0.0] * prompt + [-0.5] * completion, dtype=np.float32),
        model_version=version,
        group_id=group,
    )


def test_stale_samples_go_and_the_kept_ones_carry_their_lag() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=1))
    samples = [sample(5, 0), sample(3, 1), sample(4, 2)]
    kept = trl.ship(monitor, samples, version=5)
    assert [id(s) for s in kept] == [id(samples[0]), id(samples[2])]
    assert trl.staleness_lag_of(samples[2].completion_mask).tolist() == [-1, -1, 1, 1, 1]
    with pytest.raises(KeyError, match="completion_mask"):
        trl.staleness_lag_of(samples[1].completion_mask)


def test_held_samples_come_back_with_the_call_that_ships_their_group() -> None:
    config = StalenessConfig(policy="xtuner", max_staleness=2, retry_expired=True)
    monitor = StalenessMonitor(config)
    expired, fresh = sample(1, 7), sample(5, 7)
    assert trl.ship(monitor, [expired, fresh], version=6) == []  # the group waits for its re-rollout
    again = sample(6, 7)
    back = trl.ship(monitor, [again], version=6)
    assert [id(s) for s in back] == [id(fresh), id(again)]  # the held one first, in ship order
    assert trl.staleness_lag_of(fresh.completion_mask).tolist() == [-1, -1, 1, 1, 1]


def test_a_version_above_the_trained_one_names_the_counter() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    with pytest.raises(TraceError) as caught:
        trl.ship(monitor, [sample(4, 0)], version=3)
    assert caught.value.field == "samples[0].model_version" and "self.model_version" in caught.value.reason
    with pytest.raises(TraceError, match="model_version"):
        trl.ship(monitor, [sample(None, 0)], version=3)
    with pytest.raises(TypeError, match=r"self\.model_version"):
        trl.ship(monitor, [sample(1, 0)], version=True)


def test_the_train_time_hook_refuses_a_policy_that_holds_rows_back() -> None:
    monitor = StalenessMonitor(StalenessConfig(policy="xtuner", max_staleness=2, retry_expired=True))
    with pytest.raises(ConfigError, match="retry_expired") as caught:
        trl.ship_at_train_time(object(), monitor)  # a packed micro-batch cannot take a held sample back later
    assert caught.value.field == "policy"
