"""The SkyRL mapping of its docs page: ``dispatch_version = global_step_when_scheduled - 1`` and a ship at step
``global_step`` reproduce SkyRL's ``async/staleness_mean`` / ``_max`` (``skyrl/train/fully_async_trainer.py``
@ a9564572, :997 and :1117-1118, computed per group; groups of one size here, so per rollout is the same)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.records.columnar import RolloutBatch


@given(
    global_step=st.integers(1, 40),
    lags=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    group_size=st.integers(1, 4),
)
def test_skyrl_staleness_is_ours_with_dispatch_one_below_the_scheduled_step(
    global_step: int, lags: list[int], group_size: int
) -> None:
    scheduled = [max(global_step - lag, 1) for lag in lags]  # each group's global_step_when_scheduled
    stalenesses = [global_step - s for s in scheduled]  # SkyRL's line, verbatim
    rows = len(scheduled) * group_size
    batch = RolloutBatch.from_padded(
        [f"r{i}" for i in range(rows)],
        np.ones((rows, 3), dtype=np.int64),
        dispatch_version=np.repeat(np.array(scheduled) - 1, group_size),
        group_ids=[f"g{i // group_size}" for i in range(rows)],
    )
    monitor = StalenessMonitor(StalenessConfig(max_staleness=64))
    monitor.add(batch)
    metrics = monitor.ship(global_step).metrics
    assert metrics["staleness/rollout/mean"] == pytest.approx(sum(stalenesses) / len(stalenesses), rel=1e-15)
    assert metrics["staleness/rollout/max"] == max(stalenesses)
