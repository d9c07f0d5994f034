"""Span summaries read the weight arrays once (a max over an unsigned view); every corner stays exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

from staleness_metrics import RolloutBatch, Sink, StalenessConfig, TraceError


def one_sample(rl: list[float], dtype: type = np.float32, mask: list[int] | None = None) -> RolloutBatch:
    n = len(rl)
    return RolloutBatch(
        ids=["r"],
        sample_offsets=np.array([0, 1]),
        position_offsets=np.array([0, n]),
        mask=np.array(mask or [1] * n, dtype=dtype),
        rl_weights=np.array(rl, dtype=dtype),
        dispatch_version=np.array([0]),
        token_versions=np.array([0] * (n - 1) + [1]),
    )


@pytest.mark.parametrize(
    ("dtype", "fresh_weight", "dropped"),
    [
        (dtype, weight, dropped)
        for dtype in (np.float32, np.float64, np.float16)
        for weight, dropped in ((1.0, False), (0.0, True), (-0.0, True), (-0.5, False), (2.0**-20, False))
    ],
)
def test_what_is_left_to_train_is_exact_for_every_sign(dtype: type, fresh_weight: float, dropped: bool) -> None:
    """Only the last position (version 1) survives max_staleness 0 at step 2; its weight decides."""
    sink = Sink(StalenessConfig(max_staleness=0))
    sink.add(one_sample([1.0, 1.0, fresh_weight], dtype))
    shipment = sink.ship(2)
    assert (shipment.metrics["staleness/sample/dropped"] == 1) is dropped


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -math.nan])
def test_non_finite_weights_are_found_even_beside_larger_values(dtype: type, bad: float) -> None:
    with pytest.raises(TraceError) as caught:
        Sink().add(one_sample([5.0, bad, 1.0], dtype))
    assert caught.value.field == "samples[0].rl_weights"
    assert caught.value.reason == "position 1: not a finite number"


def test_negative_weights_on_mask0_positions_keep_the_sample() -> None:
    batch = one_sample([1.0, 1.0, 0.0], mask=[1, 1, 0])
    batch.ce_weights = np.array([0.0, 0.0, -2.0], dtype=np.float32)
    batch.present["ce_weights"] = np.array([True])
    sink = Sink(StalenessConfig(max_staleness=0))
    sink.add(batch)
    shipment = sink.ship(3)
    assert shipment.metrics["staleness/sample/dropped"] == 0 and shipment.metrics["staleness/token/masked"] == 1.0
