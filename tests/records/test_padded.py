"""``RolloutBatch.from_padded``: [B, L] rows, left or right padded, equal the same rollouts as SPEC 3 records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from staleness_metrics import RolloutBatch, Sink, StalenessConfig, TraceError
from staleness_metrics.engine.shipment import padded_shipment
from staleness_metrics.errors import FieldError
from tests.adapters.equivalence import compare_ships, shipped_records

WEIGHTS = ("rl_weights", "ce_weights")


@dataclass
class Rows:
    """Padded arrays plus the valid slice of every row (what a SPEC 3 record holds)."""

    ids: list[str]
    mask: np.ndarray
    versions: np.ndarray
    weights: dict[str, np.ndarray]
    valid: np.ndarray  # [B, L] bool
    lengths: np.ndarray
    side: str
    dispatch: np.ndarray
    groups: list[str | None]
    logprobs: np.ndarray | None = None  # sampler, [B, L]
    trainer_logprobs: np.ndarray | None = None  # NaN where missing (SPEC 11: uncovered)

    def records(self) -> list[dict[str, Any]]:
        out = []
        for i, rid in enumerate(self.ids):
            keep = self.valid[i]
            sample: dict[str, Any] = {
                "mask": self.mask[i][keep].astype(int).tolist(),
                "token_versions": self.versions[i][keep].clip(min=-1).tolist(),
            }
            for name, values in self.weights.items():
                sample[name] = values[i][keep].astype(float).tolist()
            if self.logprobs is not None and self.trainer_logprobs is not None:
                sample["logprobs"] = self.logprobs[i][keep].astype(float).tolist()
                trainer = self.trainer_logprobs[i][keep].astype(float)
                sample["trainer_logprobs"] = [None if np.isnan(x) else float(x) for x in trainer]
            record: dict[str, Any] = {"id": rid, "dispatch_version": int(self.dispatch[i]), "samples": [sample]}
            if self.groups[i] is not None:
                record["group_id"] = self.groups[i]
            out.append(record)
        return out


@st.composite
def padded_rows(draw: st.DrawFn) -> Rows:
    rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 10))
    side = draw(st.sampled_from(["right", "left"]))
    mask = np.zeros((rows, width), dtype=np.float32)
    versions = np.full((rows, width), draw(st.sampled_from([0, -1, 7])), dtype=np.int64)  # padding junk
    weights = {name: np.zeros((rows, width), dtype=np.float32) for name in WEIGHTS if draw(st.booleans())}
    lengths = np.zeros(rows, dtype=np.int64)
    dispatch = np.zeros(rows, dtype=np.int64)
    valid = np.zeros((rows, width), dtype=bool)
    for i in range(rows):
        n = draw(st.integers(0, width))
        lengths[i] = n
        cols = np.arange(n) if side == "right" else np.arange(width - n, width)
        valid[i, cols] = True
        d = draw(st.integers(0, 6))
        dispatch[i] = d
        prompt = draw(st.integers(0, n))
        row_mask = [0] * prompt + draw(st.lists(st.integers(0, 1), min_size=n - prompt, max_size=n - prompt))
        row_versions = [-1] * prompt + draw(
            st.lists(st.integers(d, d + 3) | st.sampled_from([-1, -5]), min_size=n - prompt, max_size=n - prompt)
        )
        mask[i, cols] = row_mask
        versions[i, cols] = row_versions
        for values in weights.values():  # padding keeps weight 0
            values[i, cols] = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    groups = [draw(st.sampled_from([None, "g1", "g2"])) for _ in range(rows)]
    out = Rows([f"r{i}" for i in range(rows)], mask, versions, weights, valid, lengths, side, dispatch, groups)
    if draw(st.booleans()):
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        out.logprobs = -rng.random((rows, width)).astype(np.float32)
        trainer = -rng.random((rows, width)).astype(np.float32)
        trainer[rng.random((rows, width)) < 0.3] = np.nan
        out.trainer_logprobs = trainer
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=padded_rows(), policy=st.sampled_from(["token", "episode", "group", "xtuner"]), bound=st.integers(0, 3))
def test_padded_rows_decide_measure_and_mask_like_records(rows: Rows, policy: str, bound: int) -> None:
    extra: dict[str, Any] = {"max_token_staleness": 1} if policy == "xtuner" else {}
    config = StalenessConfig(policy=policy, max_staleness=bound, **extra)
    records = rows.records()
    note(repr(records))
    original_mask = rows.mask.copy()
    by_lengths = RolloutBatch.from_padded(
        rows.ids,
        rows.mask,
        token_versions=rows.versions,
        dispatch_version=rows.dispatch,
        lengths=rows.lengths,
        padding_side=rows.side,  # type: ignore[arg-type]
        group_ids=rows.groups,
        logprobs=rows.logprobs,
        trainer_logprobs=rows.trainer_logprobs,
        **rows.weights,
    )
    step = int(rows.dispatch.max()) + 5  # every label (at most dispatch + 3) is <= T at both ships
    both = compare_ships(by_lengths, records, config, [step - 1, step])
    for adapter, reference in zip(both.adapter, both.records, strict=True):
        back = padded_shipment(adapter, by_lengths)
        shipped = shipped_records(reference)
        assert sorted(np.asarray(rows.ids)[back.shipped].tolist()) == sorted(shipped)
        for i, rid in enumerate(rows.ids):
            keep = rows.valid[i]
            if rid in shipped:
                sample = shipped[rid]["samples"][0]
                assert back.mask[i][keep].astype(int).tolist() == sample["mask"]
                assert not back.mask[i][~keep].any()
                for name in rows.weights:
                    assert getattr(back, name)[i][keep].tolist() == sample[name]
            else:
                assert not back.mask[i].any()
    # the caller's own array was masked in place (float32, contiguous): only sampled positions changed
    assert not (rows.mask > original_mask).any()
    assert not rows.mask[~rows.valid].any()


def labels_per_position(batch: RolloutBatch, width: int) -> np.ndarray:
    """The batch's version spans expanded back to one label per position, [B, L]."""
    assert batch.span_offsets is not None and batch.span_versions is not None and batch.span_starts is not None
    out = np.full((batch.n_samples, width), -2, dtype=np.int64)
    for row in range(batch.n_samples):
        a, b = int(batch.span_offsets[row]), int(batch.span_offsets[row + 1])
        starts = [*batch.span_starts[a:b].tolist(), width]
        for k in range(b - a):
            out[row, starts[k] : starts[k + 1]] = batch.span_versions[a + k]
    return out


@settings(max_examples=60, deadline=None)
@given(rows=padded_rows())
def test_labels_become_spans_equal_per_position_and_an_attention_mask_equals_lengths(rows: Rows) -> None:
    width = rows.mask.shape[1]
    one = RolloutBatch.from_padded(
        rows.ids, rows.mask.copy(), token_versions=rows.versions, lengths=rows.lengths,
        padding_side=rows.side, dispatch_version=rows.dispatch,  # type: ignore[arg-type]
    )  # fmt: skip
    two = RolloutBatch.from_padded(
        rows.ids, rows.mask.copy(), token_versions=rows.versions, attention_mask=rows.valid.astype(np.int64),
        dispatch_version=rows.dispatch,
    )  # fmt: skip
    expected = np.where(rows.valid, np.maximum(rows.versions, -1), -1)
    assert labels_per_position(one, width).tolist() == expected.tolist()
    assert labels_per_position(two, width).tolist() == expected.tolist()


def test_negative_zero_weights_on_padding_are_zero_and_a_positive_one_is_named() -> None:
    mask = np.array([[1, 1, 0], [1, 0, 0]], dtype=np.float32)
    ce = np.array([[0.0, 0.5, -0.0], [1.0, -0.0, 0.0]], dtype=np.float64)
    RolloutBatch.from_padded(["a", "b"], mask, dispatch_version=[0, 0], lengths=[2, 1], ce_weights=ce)
    ce[1, 2] = -1.0
    with pytest.raises(TraceError) as caught:
        RolloutBatch.from_padded(["a", "b"], mask, dispatch_version=[0, 0], lengths=[2, 1], ce_weights=ce)
    assert caught.value.rollout_id == "b" and caught.value.field == "samples[0].ce_weights"


def test_dispatch_defaults_to_the_oldest_label_and_a_row_without_any_is_an_error() -> None:
    mask = np.array([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=np.float32)
    versions = np.array([[-1, 5, 4, 0], [-1, -1, -1, -1]])
    with pytest.raises(ValueError, match="shape"):
        RolloutBatch.from_padded(["a", "b"], mask, token_versions=versions[:1])
    batch = RolloutBatch.from_padded(["a"], mask[:1], token_versions=versions[:1], lengths=[3])
    assert batch.dispatch_version.tolist() == [4]  # the padded 0 is not a label
    with pytest.raises(TraceError) as caught:
        RolloutBatch.from_padded(["a", "b"], mask, token_versions=versions, lengths=[3, 4])
    assert caught.value.rollout_id == "b" and caught.value.field == "dispatch_version"


def test_a_sampled_padding_position_names_the_row_and_field() -> None:
    mask = np.array([[1, 1, 1], [0, 1, 1]], dtype=np.float32)
    with pytest.raises(TraceError) as caught:
        RolloutBatch.from_padded(["a", "b"], mask, dispatch_version=[0, 0], lengths=[2, 2], padding_side="left")
    assert caught.value.rollout_id == "a" and caught.value.field == "samples[0].mask"
    assert "padding" in caught.value.reason


def test_rows_of_a_list_input_are_read_back_although_they_could_not_be_masked_in_place() -> None:
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    versions = [[0, 1, 3, -1], [3, 3, -1, -1]]
    batch = RolloutBatch.from_padded(["a", "b"], mask, token_versions=versions, lengths=[3, 2])
    sink = Sink(StalenessConfig(max_staleness=1))
    sink.add(batch)
    shipment = sink.ship(4)  # T = 3, bound 2: versions 0 and 1 are masked
    back = padded_shipment(shipment, batch)
    assert back.shipped.tolist() == [True, True]
    assert back.mask.tolist() == [[0, 0, 1, 0], [1, 1, 0, 0]]
    assert mask == [[1, 1, 1, 0], [1, 1, 0, 0]]  # a list cannot be written: padded_shipment is the way back


def test_a_cpu_tensor_like_buffer_is_masked_in_place() -> None:
    # np.asarray over an object exposing __array__ shares memory, as CPU torch tensors do.
    class TensorLike:
        def __init__(self, data: np.ndarray) -> None:
            self.data = data

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            return self.data

    storage = np.array([[0, 1, 1, 1]], dtype=np.float32)
    batch = RolloutBatch.from_padded(
        ["a"], TensorLike(storage), token_versions=TensorLike(np.array([[-1, 0, 2, 3]])), lengths=[4]
    )
    sink = Sink(StalenessConfig(max_staleness=1))
    sink.add(batch)
    sink.ship(4)
    assert storage.tolist() == [[0, 0, 1, 1]]


def test_a_uint64_label_past_int64_is_refused_as_rolloutbatch_refuses_it() -> None:
    mask = np.array([[0, 1, 1, 1]], dtype=np.float32)
    labels = np.array([[0, 9, 2**63 + 5, 9]], dtype=np.uint64)  # (wrapped, it read as -1: unlabelled)
    message = r"^token_versions\[2\]: expected an integer, got 9223372036854775813$"
    with pytest.raises(FieldError, match=message):
        RolloutBatch.from_padded(["a"], mask, token_versions=labels)
    with pytest.raises(FieldError, match=message):
        RolloutBatch(ids=["a"], sample_offsets=[0, 1], position_offsets=[0, 4], mask=mask.reshape(-1),
                     dispatch_version=[9], token_versions=labels.reshape(-1))  # fmt: skip
    batch = RolloutBatch.from_padded(["a"], mask, token_versions=np.array([[0, 9, 8, 9]], dtype=np.uint64))
    assert batch.span_versions is not None and batch.span_versions.tolist() == [0, 9, 8, 9]


@pytest.mark.parametrize(("lengths", "shown"), [([5.9], "5.9"), ([4.5], "4.5"), ([True], "True")])
def test_lengths_no_integer_holds_are_refused_never_truncated(lengths: list[Any], shown: str) -> None:
    mask = np.array([[0, 1, 1, 1, 1, 0]], dtype=np.float32)
    with pytest.raises(FieldError, match=rf"^lengths\[0\]: expected an integer, got {shown}$"):
        RolloutBatch.from_padded(["a"], mask, dispatch_version=[9], lengths=np.array(lengths))
    batch = RolloutBatch.from_padded(["a"], mask, dispatch_version=[9], lengths=np.array([5.0]))
    assert batch.mask.tolist() == mask.reshape(-1).tolist()  # a whole float: read as the integer
