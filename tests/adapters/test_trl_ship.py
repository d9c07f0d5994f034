"""``trl.ship`` and ``ShippingQueue`` on samples shaped like TRL's slotted ``RolloutSample`` (the real package
runs in tests/trainers): drops, held samples coming back, lags, and one ship per step behind the queue."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from staleness_metrics import StalenessConfig, StalenessMonitor, TraceError
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


def test_the_queue_ships_once_per_step_and_never_across_a_weight_sync() -> None:
    inner: queue.Queue[Any] = queue.Queue()
    for s in [sample(2, 0), sample(0, 1), sample(2, 2), sample(2, 3), sample(3, 4), sample(3, 5), sample(3, 6)]:
        inner.put(s)
    exports: list[int] = []

    class Steps:
        name = "steps"

        def export(self, report: Any) -> None:
            exports.append(report.step)

        def close(self) -> None:
            pass

    trainer = {"model_version": 2}
    shipping = trl.ShippingQueue(
        inner, StalenessMonitor(StalenessConfig(max_staleness=1), [Steps()]), lambda: trainer["model_version"],
        samples_per_step=3,
    )  # fmt: skip
    first_step = [shipping.get(timeout=0) for _ in range(3)]
    assert [s.group_id for s in first_step] == [0, 2, 3]  # group 1 (version 0) dropped, a second ship refills
    trainer["model_version"] = 3  # a weight sync between steps
    second_step = [shipping.get(timeout=0) for _ in range(3)]
    assert [s.model_version for s in second_step] == [3, 3, 3]
    assert exports == [3, 3, 4]
    with pytest.raises(queue.Empty):
        shipping.get(timeout=0)
    assert shipping.qsize() == 0 and shipping.empty()
