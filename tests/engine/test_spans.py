"""Span summaries read the weight arrays once (a max over an unsigned view); every corner stays exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

from staleness_metrics import FieldTypeError, RolloutBatch, Sink, StalenessConfig, TraceError


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


@pytest.mark.parametrize("missing", [math.nan, math.inf, -math.inf])
def test_a_batch_s_non_finite_sampler_logprobs_are_uncovered_and_change_no_decision(missing: float) -> None:
    """SPEC 11: NaN or ±inf in a batch's ``logprobs`` is an uncovered position, never an error (as in its
    ``trainer_logprobs``); log-probabilities never decide what is masked. A non-finite weight still is one."""
    outcomes = []
    for sampler in ([-1.0, -1.0, -1.0], [-1.0, missing, -1.0]):
        batch = one_sample([1.0, 1.0, 1.0], np.float64)
        batch.logprobs, batch.trainer_logprobs = np.array(sampler), np.array([-1.1, -1.0, -1.0])
        batch.present.update(logprobs=np.array([True]), trainer_logprobs=np.array([True]))
        sink = Sink(StalenessConfig(max_staleness=0))
        sink.add(batch)
        shipment = sink.ship(2)  # version 0 masked, version 1 trained
        mask = [s["mask"] for r in shipment.rollouts for s in r.record()["samples"]]
        outcomes.append((mask, shipment.lags.tolist(), shipment.metrics["staleness/mismatch/coverage"]))
    assert outcomes == [([[0, 0, 1]], [1, 1, 0], 1.0), ([[0, 0, 1]], [1, 1, 0], 2 / 3)]
    with pytest.raises(TraceError, match="rl_weights: position 1: not a finite number"):
        Sink().add(one_sample([1.0, math.nan, 1.0]))


def test_sampler_logprobs_of_no_numbers_are_refused_where_the_batch_is_built() -> None:
    with pytest.raises(FieldTypeError, match="logprobs: expected numbers, got dtype <U2"):
        RolloutBatch(ids=["r"], sample_offsets=np.array([0, 1]), position_offsets=np.array([0, 1]),
                     mask=np.ones(1), dispatch_version=np.array([0]), logprobs=np.array(["-1"]))  # fmt: skip


def test_negative_weights_on_mask0_positions_keep_the_sample() -> None:
    batch = one_sample([1.0, 1.0, 0.0], mask=[1, 1, 0])
    batch.ce_weights = np.array([0.0, 0.0, -2.0], dtype=np.float32)
    batch.present["ce_weights"] = np.array([True])
    sink = Sink(StalenessConfig(max_staleness=0))
    sink.add(batch)
    shipment = sink.ship(3)
    assert shipment.metrics["staleness/sample/dropped"] == 0 and shipment.metrics["staleness/token/masked"] == 1.0


def test_token_versions_below_minus_one_are_named_as_the_separate_check_names_them() -> None:
    """The sink checks token versions in the pass that cuts them; the first error of each rollout is the one
    the checks in their usual order name (a bad version before a bad span start or a bad mask value)."""
    from staleness_metrics.engine.spans import build_spans, checked_spans
    from staleness_metrics.records.validation import check_batch, mark_duplicates

    # r0 fine; r1 a version -3; r2 a span starting past its sample and (next sample) a version -2;
    # r3 a mask value 0.5 and a version -5; r4 a duplicate id only.
    lengths = [3, 3, 2, 3, 3, 3]
    tokens = np.array([0, 1, 1, 0, -3, 1, 0, 0, 0, -2, 0, 0, -5, 1, 0, 0, 0], dtype=np.int64)
    mask = np.ones(17, dtype=np.float32)
    mask[11] = 0.5
    batch = RolloutBatch(
        ids=["r0", "r1", "r2", "r3", "r0"],
        sample_offsets=np.array([0, 1, 2, 4, 5, 6]),
        position_offsets=np.concatenate(([0], np.cumsum(lengths))),
        mask=mask,
        rl_weights=np.ones(17, dtype=np.float32),
        dispatch_version=np.zeros(5, dtype=np.int64),
        token_versions=tokens,
        span_offsets=np.array([0, 0, 0, 1, 1, 1, 1]),
        span_versions=np.array([0]),
        span_starts=np.array([5]),
        label_kind=np.array([2, 2, 1, 2, 2, 2], dtype=np.int8),
    )
    verdicts, spans = checked_spans(batch)
    old = check_batch(batch)
    old_spans = build_spans(batch, old)
    mark_duplicates(old, set())
    assert {i: str(e) for i, e in verdicts.errors.items()} == {i: str(e) for i, e in old.errors.items()}
    assert verdicts.errors[1].field == "samples[0].token_versions"
    assert verdicts.errors[2].field == "samples[1].token_versions"
    assert verdicts.errors[3].field == "samples[0].token_versions"
    assert verdicts.errors[4].field == "id"
    assert spans.lo.tolist() == old_spans.lo.tolist() and spans.version.tolist() == old_spans.version.tolist()

    clean = RolloutBatch(
        ids=["a", "b"], sample_offsets=np.array([0, 1, 2]), position_offsets=np.array([0, 3, 6]),
        mask=np.ones(6, dtype=np.float32), dispatch_version=np.zeros(2, dtype=np.int64),
        token_versions=np.array([0, -1, 1, 1, 1, -1]),
    )  # fmt: skip
    wild = RolloutBatch(
        ids=["a", "b"], sample_offsets=np.array([0, 1, 2]), position_offsets=np.array([0, 3, 6]),
        mask=np.array([1, 1, 0.5, 1, 1, 1], dtype=np.float32), dispatch_version=np.zeros(2, dtype=np.int64),
        token_versions=np.array([0, -1, -4, 1, 1, -1]),
    )  # fmt: skip
    verdicts, spans = checked_spans(wild)  # only the cutting pass sees the -4: the checks run again in order
    assert [str(e) for e in verdicts.errors.values()] == [str(e) for e in check_batch(wild).errors.values()]
    assert verdicts.errors[0].field == "samples[0].token_versions" and list(verdicts.errors) == [0]
    verdicts, spans = checked_spans(clean)
    assert not verdicts.errors and spans.lo.tolist() == build_spans(clean, check_batch(clean)).lo.tolist()
    assert [(e.field, e.reason) for e in checked_spans(clean, {"b"})[0].errors.values()] == [
        ("id", "duplicate id: a rollout with this id was already added")
    ]
