"""A ``RolloutBatch`` whose arrays do not fit together is a caller's bug: ``Sink.add`` raises a
``FieldError`` naming the array, small batch or large, strict or lenient, and queues nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from staleness_metrics import RolloutBatch, Sink, StalenessConfig
from staleness_metrics.errors import FieldError


def batch(n_rollouts: int, **changed: Any) -> RolloutBatch:
    """``n_rollouts`` rollouts of one sample of 4 positions (token versions 0), with ``changed`` arrays."""
    columns: dict[str, Any] = {
        "ids": [f"r{i}" for i in range(n_rollouts)],
        "sample_offsets": np.arange(n_rollouts + 1),
        "position_offsets": np.arange(n_rollouts + 1) * 4,
        "mask": np.tile([0.0, 1.0, 1.0, 1.0], n_rollouts),
        "dispatch_version": np.zeros(n_rollouts, dtype=np.int64),
        "token_versions": np.zeros(4 * n_rollouts, dtype=np.int64),
    }
    return RolloutBatch(**(columns | changed))


DEFECTS = {
    "dispatch_version": lambda n: {"dispatch_version": np.zeros((n, 1), dtype=np.int64)},
    "completion_version": lambda n: {"completion_version": np.full((1, n), -1)},
    "frozen": lambda n: {"frozen": np.zeros((n, 1), dtype=bool)},
    "label_kind": lambda n: {"label_kind": np.full((n, 1), 2, dtype=np.int8)},
    "mask": lambda n: {"mask": np.tile([0.0, 1.0, 1.0, 1.0], n).reshape(n, 4)},
    "rl_weights": lambda n: {"rl_weights": np.ones((4 * n, 1))},
    "token_versions": lambda n: {"token_versions": np.zeros((4 * n, 1), dtype=np.int64)},
    "position_offsets": lambda n: {"position_offsets": np.r_[0, 8, 4, np.arange(3, n + 1) * 4][: n + 1]},
    "sample_offsets": lambda n: {"sample_offsets": np.arange(n)},
}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("n_rollouts", [2, 20_000])  # a small batch (the quick check first) and a large one
@pytest.mark.parametrize("field", sorted(DEFECTS))
def test_an_array_that_does_not_fit_is_named(field: str, n_rollouts: int, strict: bool) -> None:
    sink = Sink(StalenessConfig(policy="token", max_staleness=1, strict=strict))
    with pytest.raises(FieldError) as raised:
        sink.add(batch(n_rollouts, **DEFECTS[field](n_rollouts)))
    assert raised.value.field == field
    assert sink.queued == 0 and sink.ship(2).report.tally.rollouts_shipped == 0
