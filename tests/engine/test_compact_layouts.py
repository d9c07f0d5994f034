"""Large inputs kept compact (issue 19: memory bounded by the size of what arrives) decide exactly as before.

A packed batch of many positions keeps its 0/1 mask as int8 instead of float64; a sample with more spans
than positions is refused while its record is parsed, before any span table is built; the span checks
run a piece of spans at a time. None of it may change a decision, a metric or the error a user reads.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import staleness_metrics.records.model as records_module
import staleness_metrics.records.validation as validation_module
from staleness_metrics import RolloutBatch, Sink, StalenessConfig, TraceError
from staleness_metrics.records.model import pack, parse_rollout
from staleness_metrics.records.validation import check_batch
from tests.engine.test_checkpoint import POLICIES, config_of
from tests.engine.test_small_adds import play
from tests.reference.streams import SeededChooser, generate_events, random_config


@pytest.mark.parametrize("policy", POLICIES)
def test_streams_decide_the_same_with_every_mask_kept_as_int8(policy: str) -> None:
    """Every packed batch with an int8 mask (the threshold at 0): the same outcomes, shipped arrays, counts
    and errors as with float64 masks, under every policy, strict and lenient, with defects."""
    for seed in range(4):
        chooser = SeededChooser(seed * 13 + len(policy))
        drawn = random_config(chooser, policy, lenient=seed % 2 == 1)
        config, events = config_of(drawn), generate_events(chooser, drawn, defects=seed % 3)
        as_float = play(config, events, random.Random(seed))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(records_module, "COMPACT_MASK_MIN_POSITIONS", 0)
            as_int8 = play(config, events, random.Random(seed))
        assert as_int8 == as_float


def _long_rollouts(positions: int) -> list[dict[str, Any]]:
    half = positions // 2
    return [
        {"id": "old", "dispatch_version": 1, "samples": [{"mask": [0] * 3 + [1] * (positions - 3)}]},
        {
            "id": "mixed",
            "dispatch_version": 2,
            "samples": [
                {"mask": [1] * positions, "weight_versions": [[2, 0], [4, half]], "rl_weights": [0.5] * positions}
            ],
        },
    ]


def _ship_twice(threshold: int) -> tuple[Any, ...]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(records_module, "COMPACT_MASK_MIN_POSITIONS", threshold)
        sink = Sink(StalenessConfig(max_staleness=1, policy="token"))
        sink.add(_long_rollouts(1 << 20))
        mask_dtype = sink.queue.chunks[0].mask.dtype
        shipment = sink.ship(5)
        return mask_dtype, dict(shipment.metrics), shipment.batches_line(), shipment.lags.tolist()


def test_a_long_mask_is_kept_as_int8_and_ships_what_float64_ships() -> None:
    compact, *decided = _ship_twice(records_module.COMPACT_MASK_MIN_POSITIONS)
    wide, *before = _ship_twice(1 << 40)
    assert (compact, wide) == (np.dtype(np.int8), np.dtype(np.float64))
    assert decided == before
    metrics = decided[0]
    assert metrics["staleness/token/masked"] == 0.5  # the old rollout and the first span were masked


def _record(mask_length: int, pairs: list[list[int]]) -> dict[str, Any]:
    return {"id": "r", "dispatch_version": 0, "samples": [{"mask": [1] * mask_length, "weight_versions": pairs}]}


def _columnar(lengths: list[int], spans: list[list[list[int]]]) -> RolloutBatch:
    """One rollout of the given samples, built as columns (no record parsing: the batch checks only)."""
    flat = [pair for sample in spans for pair in sample]
    return RolloutBatch(
        ids=["r"],
        sample_offsets=np.array([0, len(lengths)]),
        position_offsets=np.concatenate(([0], np.cumsum(lengths))),
        mask=np.ones(sum(lengths)),
        dispatch_version=np.array([0]),
        span_offsets=np.concatenate(([0], np.cumsum([len(s) for s in spans]))),
        span_versions=np.array([p[0] for p in flat], dtype=np.int64),
        span_starts=np.array([p[1] for p in flat], dtype=np.int64),
    )


pairs_strategy = st.lists(st.integers(-3, 9), min_size=2, max_size=2)


@settings(max_examples=200)
@given(data=st.data())
def test_more_spans_than_positions_are_refused_while_parsing_as_the_batch_checks_name_them(
    data: st.DataObject,
) -> None:
    length = data.draw(st.integers(1, 6), label="positions")
    pairs = data.draw(st.lists(pairs_strategy, min_size=length + 1, max_size=length + 8), label="spans")
    verdicts = check_batch(_columnar([length], [pairs]))
    expected = str(verdicts.errors[0])  # more spans than positions always break a rule
    for given_as in (pairs, np.array(pairs, dtype=np.int32), np.array(pairs, dtype=np.int64)):
        with pytest.raises(TraceError) as refused:
            parse_rollout(_record(length, given_as))  # type: ignore[arg-type]
        assert str(refused.value) == expected


def test_a_sample_of_millions_of_spans_is_refused_naming_the_span() -> None:
    """The hostile body of issue 19 (5.6M ``[0, 0]`` spans on a one-position sample), as the service reads
    it (an int32 array): refused by the parse, naming the second span, as the batch checks would."""
    pairs = np.zeros((5_600_000, 2), dtype=np.int32)
    with pytest.raises(TraceError) as refused:
        parse_rollout(_record(1, pairs))  # type: ignore[arg-type]
    assert (refused.value.field, refused.value.reason) == (
        "samples[0].weight_versions[1]",
        "span starts must strictly increase",
    )
    pairs[-1, 0] = -5  # a negative version is the first rule checked, wherever it is
    with pytest.raises(TraceError) as refused:
        parse_rollout(_record(1, pairs))  # type: ignore[arg-type]
    assert refused.value.field == "samples[0].weight_versions[5599999]"
    assert refused.value.reason == "version -5 is negative (only -1 marks unlabelled)"


@settings(max_examples=150)
@given(data=st.data())
def test_span_checks_in_pieces_name_what_one_pass_names(data: st.DataObject) -> None:
    n_rollouts = data.draw(st.integers(1, 4), label="rollouts")
    batches = []
    for _ in range(n_rollouts):
        lengths = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3), label="lengths")
        spans = [data.draw(st.lists(pairs_strategy, max_size=n + 2), label="spans") for n in lengths]
        batches.append((lengths, spans))
    parsed = [
        parse_rollout({"id": f"r{i}", "dispatch_version": 0, "samples": [{"mask": [1] * n} for n in lengths]})
        for i, (lengths, _) in enumerate(batches)
    ]
    batch = pack(parsed)
    flat = [pair for _, spans in batches for sample in spans for pair in sample]
    batch.span_offsets = np.concatenate(([0], np.cumsum([len(s) for _, spans in batches for s in spans])))
    batch.span_versions = np.array([p[0] for p in flat], dtype=np.int64)
    batch.span_starts = np.array([p[1] for p in flat], dtype=np.int64)
    batch.label_kind = np.where(np.diff(batch.span_offsets) > 0, 1, 0).astype(np.int8)
    one_pass = {i: str(e) for i, e in check_batch(batch).errors.items()}
    for piece in (1, 2, 3):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(validation_module, "_SPAN_PIECE", piece)
            assert {i: str(e) for i, e in check_batch(batch).errors.items()} == one_pass
