"""A ``RolloutBatch`` whose arrays do not fit together is a caller's bug: ``Sink.add`` raises a
``FieldError`` naming the array, small batch or large, strict or lenient, and queues nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from staleness_metrics import RolloutBatch, Sink, StalenessConfig
from staleness_metrics.errors import FieldError, FieldTypeError


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


MISSHAPEN = {  # (field, changed columns, error): refused where the batch is built or added, never a bare error
    "mask 0-d": ("mask", lambda: {"mask": np.array(1.0)}, FieldError),
    "mask None": ("mask", lambda: {"mask": None}, FieldTypeError),
    "rl_weights 0-d": ("rl_weights", lambda: {"rl_weights": np.array(1.0)}, FieldError),
    "logprobs 0-d": ("logprobs", lambda: {"logprobs": np.array(-1.0)}, FieldError),
    "agentic 0-d": ("agentic", lambda: {"agentic": np.array(False)}, FieldError),
    "position_offsets 0-d": ("position_offsets", lambda: {"position_offsets": np.array(0)}, FieldError),
    "position_offsets empty": ("position_offsets", lambda: {"position_offsets": np.zeros(0, np.int64)}, FieldError),
    "span_offsets [S+1, 1]": ("span_offsets", lambda: {"span_offsets": np.zeros((3, 1), np.int64)}, FieldError),
    "span_versions [n, 1]": ("span_versions", lambda: {"span_versions": np.zeros((2, 1), np.int64)}, FieldError),
    "structured mask": ("mask", lambda: {"mask": np.zeros(8, dtype=[("a", "f4")])}, FieldTypeError),
    "np.ma mask": ("mask", lambda: {"mask": np.ma.array(np.ones(8), mask=[0, 1] * 4)}, FieldTypeError),
    "np.ma rl_weights": ("rl_weights", lambda: {"rl_weights": np.ma.array(np.ones(8), mask=[0] * 8)}, FieldTypeError),
    "np.ma trainer_logprobs": (
        "trainer_logprobs", lambda: {"trainer_logprobs": np.ma.array(np.zeros(8), mask=[1] * 8)}, FieldTypeError
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MISSHAPEN))
def test_a_misshapen_array_or_a_masked_one_is_named(case: str) -> None:
    field, changed, error = MISSHAPEN[case]
    columns = {"span_offsets": np.array([0, 1, 2]), "span_versions": np.zeros(2, np.int64),
               "span_starts": np.zeros(2, np.int64)} | changed()  # fmt: skip
    with pytest.raises(error) as raised:
        Sink().add(batch(2, token_versions=None, **columns))
    assert raised.value.field == field


def test_span_offsets_of_the_wrong_length_are_named_with_or_without_a_label_kind() -> None:
    spans = {"token_versions": None, "span_versions": np.zeros(2, np.int64), "span_starts": np.zeros(2, np.int64)}
    for span_offsets in (np.array([0, 1, 2, 2]), np.array([0, 2])):
        for label_kind in (None, np.ones(2, np.int8)):
            with pytest.raises(FieldError) as raised:
                Sink().add(batch(2, span_offsets=span_offsets, label_kind=label_kind, **spans))
            assert raised.value.field == "span_offsets"
