"""A ``RolloutBatch`` the sink cannot take as given is refused when it is added (or built), naming the
rollout, the field and the reason; lenient mode sets its rollouts aside; nothing is read as another
number, and a valid rollout beside it still ships."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from staleness_metrics import RolloutBatch, Sink, StalenessConfig, TraceError
from staleness_metrics.errors import FieldError
from staleness_metrics.records.columnar import as_int64


def one(rid: str = "stale", **changed: Any) -> RolloutBatch:
    """One rollout of one sample of 4 positions, dispatched under version 0, two of them labelled 3."""
    columns: dict[str, Any] = {
        "ids": [rid],
        "sample_offsets": np.array([0, 1]),
        "position_offsets": np.array([0, 4]),
        "mask": np.ones(4),
        "dispatch_version": np.array([0]),
        "token_versions": np.array([0, 0, 3, 3]),
    }
    return RolloutBatch(**(columns | changed))


def read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


UNMASKABLE = {
    "read-only mask": ("mask", lambda: {"mask": read_only(np.ones(4))}, "read-only: the sink masks it in place"),
    "read-only rl_weights": (
        "rl_weights",
        lambda: {"rl_weights": read_only(np.ones(4))},
        "read-only: the sink masks it in place",
    ),
    "frombuffer ce_weights": (
        "ce_weights",
        lambda: {"ce_weights": np.frombuffer(np.zeros(4).tobytes())},
        "read-only: the sink masks it in place",
    ),
    "object mask": ("mask", lambda: {"mask": np.ones(4, dtype=object)}, "unsupported dtype object"),
    "longdouble mask": ("mask", lambda: {"mask": np.ones(4, dtype=np.longdouble)}, "unsupported dtype float128"),
    "complex rl_weights": (
        "rl_weights",
        lambda: {"rl_weights": np.full(4, 1 + 5j)},
        "unsupported dtype complex128",
    ),
    "string rl_weights": ("rl_weights", lambda: {"rl_weights": np.array(["x"] * 4)}, "unsupported dtype <U1"),
}


@pytest.mark.filterwarnings("error")  # (a complex array is not even read: no ComplexWarning)
@pytest.mark.parametrize("case", list(UNMASKABLE))
@pytest.mark.parametrize("strict", [True, False])
def test_an_array_the_sink_cannot_mask_is_refused_at_add_and_the_rest_ships(case: str, strict: bool) -> None:
    field, arrays, reason = UNMASKABLE[case]
    sink = Sink(StalenessConfig(max_staleness=1, strict=strict))
    sink.add({"id": "good", "dispatch_version": 3, "samples": [{"mask": [1, 1]}]})
    batch = one(**arrays())
    if strict:
        with pytest.raises(TraceError) as raised:
            sink.add(batch)
        assert str(raised.value) == f"rollout 'stale': field {field}: {reason}"
    else:
        assert sink.add(batch) == 0
    assert sink.queued == 1
    shipment = sink.ship(4)  # the stale positions would be masked: nothing of the batch is queued
    assert list(shipment.ids) == ["good"]
    assert [str(e) for e in shipment.invalid] == ([] if strict else [f"rollout 'stale': field {field}: {reason}"])
    assert shipment.report.tally.rollouts_invalid == (0 if strict else 1)
    assert list(sink.ship(5).ids) == []


def test_a_rollout_of_no_sample_is_refused_as_its_record_is() -> None:
    columns = {"ids": ["empty", "full"], "sample_offsets": np.array([0, 0, 1]), "position_offsets": np.array([0, 4]),
               "mask": np.ones(4), "dispatch_version": np.array([3, 3])}  # fmt: skip
    with pytest.raises(TraceError, match=r"^rollout 'empty': field samples: must hold at least one sample$"):
        Sink(StalenessConfig(policy="episode")).add(RolloutBatch(**columns))
    with pytest.raises(TraceError, match=r"^rollout 'empty': field samples: must hold at least one sample$"):
        Sink().add({"id": "empty", "dispatch_version": 3, "samples": []})
    lenient = Sink(StalenessConfig(strict=False))
    assert lenient.add(RolloutBatch(**columns)) == 1
    shipment = lenient.ship(4)
    assert list(shipment.ids) == ["full"] and shipment.dropped_rollouts == ()
    assert [e.rollout_id for e in shipment.invalid] == ["empty"]


def two(ids: list[Any], **changed: Any) -> RolloutBatch:
    return RolloutBatch(ids=ids, sample_offsets=np.arange(3), position_offsets=np.arange(3) * 2, mask=np.ones(4),
                        dispatch_version=np.full(2, 2), **changed)  # fmt: skip


@pytest.mark.parametrize(
    ("ids", "changed", "message"),
    [
        ([None, "b"], {}, "rollout None: field id: required non-empty string"),
        (["", "b"], {}, "rollout '': field id: required non-empty string"),
        ([b"x", "b"], {}, "rollout \"b'x'\": field id: required non-empty string"),
        ([1, "b"], {}, "rollout '1': field id: required non-empty string"),
        (["a", "b"], {"group_ids": ["g", 7]}, "rollout 'b': field group_id: expected a string, got 7"),
        (["a", "b"], {"group_ids": ["g", ["h"]]}, "rollout 'b': field group_id: expected a string, got ['h']"),
        ([["x"], "b"], {}, "rollout \"['x']\": field id: required non-empty string"),
    ],
)
def test_ids_and_group_ids_are_checked_as_a_record_s_before_anything_changes(
    ids: list[Any], changed: dict[str, Any], message: str
) -> None:
    sink = Sink()
    before = sink.state_dict()
    with pytest.raises(TraceError) as raised:
        sink.add(two(ids, **changed))
    assert str(raised.value) == message
    assert sink.state_dict() == before
    lenient = Sink(StalenessConfig(strict=False))
    assert lenient.add(two(ids, **changed)) == 1
    assert [str(e) for e in lenient.ship(3).invalid] == [message]
    Sink().load_state_dict(lenient.state_dict())  # the sink's own checkpoint loads


def test_single_rollout_ids_are_checked_too() -> None:
    with pytest.raises(TraceError, match=r"^rollout None: field id: required non-empty string$"):
        Sink().add(one(None))
    with pytest.raises(TraceError, match=r"^rollout 'r': field group_id: expected a string, got 7$"):
        Sink().add(one("r", group_ids=[7]))


ROLLOUT_FIELDS = {  # a per-rollout field: TraceError naming the rollout
    "dispatch 2.9": ({"dispatch_version": np.array([2.9])}, "dispatch_version", "2.9"),
    "dispatch True": ({"dispatch_version": np.array([True])}, "dispatch_version", "True"),
    "dispatch NaN": ({"dispatch_version": np.array([np.nan])}, "dispatch_version", "nan"),
    "dispatch 2**63 + 5": (
        {"dispatch_version": np.array([2**63 + 5], dtype=np.uint64)},
        "dispatch_version",
        "9223372036854775813",
    ),
    "dispatch 1.5 object": ({"dispatch_version": np.array([1.5], dtype=object)}, "dispatch_version", "1.5"),
    "completion 4.5": ({"completion_version": np.array([4.5])}, "completion_version", "4.5"),
}


@pytest.mark.parametrize("case", list(ROLLOUT_FIELDS))
def test_a_version_no_integer_is_refused_naming_its_rollout_and_the_value_as_given(case: str) -> None:
    changed, field, shown = ROLLOUT_FIELDS[case]
    with pytest.raises(TraceError) as raised:
        one(**changed)
    assert str(raised.value) == f"rollout 'stale': field {field}: expected an integer, got {shown}"


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"token_versions": np.full(4, 2.5)}, "token_versions[0]: expected an integer, got 2.5"),
        ({"position_offsets": np.array([0, 4.5])}, "position_offsets[1]: expected an integer, got 4.5"),
        ({"span_offsets": np.array([0, 1]), "span_versions": np.array([2.5]), "span_starts": np.array([0])},
         "span_versions[0]: expected an integer, got 2.5"),
        ({"span_offsets": np.array([0, 1]), "span_versions": np.array([2]), "span_starts": np.array([0.7])},
         "span_starts[0]: expected an integer, got 0.7"),
    ],
)  # fmt: skip
def test_a_position_or_offset_no_integer_is_refused_naming_its_index(changed: dict[str, Any], message: str) -> None:
    with pytest.raises(FieldError) as raised:
        one(**changed)
    assert str(raised.value) == message


def test_whole_numbers_of_any_numeric_dtype_are_read_as_before() -> None:
    exact = one(dispatch_version=np.array([3.0]), completion_version=np.array([4], dtype=np.uint64),
                token_versions=np.array([3, 3, 3, 4], dtype=object))  # fmt: skip
    assert exact.dispatch_version.dtype == np.int64 and exact.dispatch_version.tolist() == [3]
    assert exact.completion_version is not None and exact.completion_version.tolist() == [4]
    assert exact.token_versions is not None and exact.token_versions.tolist() == [3, 3, 3, 4]
    assert Sink().add(exact) == 1


def test_an_empty_batch_adds_nothing_as_an_empty_list_does() -> None:
    sink = Sink()
    empty = RolloutBatch(ids=[], sample_offsets=np.array([0]), position_offsets=np.array([0]), mask=np.zeros(0),
                         dispatch_version=np.zeros(0, dtype=np.int64))  # fmt: skip
    assert sink.add([]) == 0
    assert sink.add(empty) == 0
    assert sink.add(RolloutBatch.from_padded([], np.zeros((0, 4)), dispatch_version=np.zeros(0))) == 0
    assert sink.queued == 0 and list(sink.ship(1).ids) == []


@pytest.mark.parametrize("strict", [True, False])
def test_a_list_of_batches_is_added_all_or_nothing(strict: bool) -> None:
    sink = Sink(StalenessConfig(strict=strict))
    sink.add({"id": "old", "dispatch_version": 0, "samples": [{"mask": [1]}]})
    bad = one("bad", mask=np.array([1.0, 2.0, 1.0, 1.0]))
    batches = [one("a", dispatch_version=np.array([3])), bad, one("old"), one("a")]
    if strict:
        with pytest.raises(TraceError, match=r"^rollout 'bad': field samples\[0\]\.mask: position 1: expected 0 or 1$"):
            sink.add(batches)
        assert sink.queued == 1
        assert sink.add(batches[:1]) == 1
    else:
        assert sink.add(batches) == 1
        assert [str(e) for e in sink.invalid] == [
            "rollout 'bad': field samples[0].mask: position 1: expected 0 or 1",
            "rollout 'old': field id: duplicate id: a rollout with this id was already added",
            "rollout 'a': field id: duplicate id: a rollout with this id was already added",
        ]
    assert sorted(sink.ship(4).ids) == ["a", "old"]


@pytest.mark.parametrize("name", ["mask", "frozen", "rl_weights"])
def test_a_list_where_the_sink_needs_a_numpy_array_is_named(name: str) -> None:
    from staleness_metrics.errors import FieldTypeError

    columns: dict[str, Any] = dict(ids=["a"], sample_offsets=np.array([0, 1]), position_offsets=np.array([0, 2]),
                                   dispatch_version=np.array([0]), mask=np.ones(2))  # fmt: skip
    columns[name] = [False] if name == "frozen" else [1.0, 1.0]
    with pytest.raises(FieldTypeError) as found:
        RolloutBatch(**columns)
    assert found.value.field == name and "list" in found.value.reason


def test_a_rollout_object_takes_sample_records_as_dicts() -> None:
    from staleness_metrics import Rollout

    s = Sink(StalenessConfig(strict=False))
    s.add([Rollout(id="a", samples=[{"mask": [1]}], dispatch_version=0),  # type: ignore[list-item]
           Rollout(id="b", samples=[{"mask": [3]}], dispatch_version=0)])  # type: ignore[list-item]  # fmt: skip
    assert s.queued == 1 and [(e.rollout, e.field) for e in s.invalid] == [("b", "samples[0].mask[0]")]


def test_a_version_past_int64_is_refused_by_the_bound_of_records_versions() -> None:
    message = rf"^rollout 'stale': field dispatch_version: must be in 0\.\.{2**53}, got {2**70}$"
    with pytest.raises(TraceError, match=message):
        one(dispatch_version=np.array([2**70], dtype=object))
    with pytest.raises(FieldError, match=r"^token_versions\[1\]: must be in 0\.\."):
        as_int64([1, 2**64], "token_versions")


def kept_by_token_labels(label_kind: Any) -> tuple[list[str], list[float], list[float]]:
    """One rollout dispatched under 2, its positions labelled 9: kept at step 11 only if the labels are read."""
    mask, ce = np.array([0.0, 1, 1, 1]), np.array([0.0, 0, 1, 0])
    batch = one("r0", mask=mask, ce_weights=ce, dispatch_version=np.array([2]),
                token_versions=np.array([-1, 9, 9, 9]), label_kind=label_kind)  # fmt: skip
    assert batch.label_kind is not None and batch.label_kind.dtype == np.dtype(np.int8)  # (native order)
    sink = Sink(StalenessConfig(max_staleness=4))
    sink.add(batch)
    return list(sink.ship(11).ids), mask.tolist(), ce.tolist()


def test_label_kind_is_read_as_native_int8_whatever_its_dtype_or_byte_order() -> None:
    kept = (["r0"], [0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0])
    # the native int64 first: the loop compiled for it once read a '>i8' array's bytes as they lay
    for label_kind in (np.array([2]), np.array([2], dtype=">i8"), [2], np.array([2], dtype=">i2"), (2,)):
        assert kept_by_token_labels(label_kind) == kept


@pytest.mark.parametrize(
    ("label_kind", "reason"),
    [
        (np.array([3], dtype=np.int8), "values are 0 (none), 1 (spans) or 2 (token versions)"),
        (np.array([-1], dtype=np.int8), "values are 0 (none), 1 (spans) or 2 (token versions)"),
        (np.array([2, 2], dtype=np.int8), "expected one integer per sample (1), got int64 (2,)"),
        (np.array([], dtype=np.int8), "expected one integer per sample (1), got int64 (0,)"),
    ],
)
def test_a_label_kind_out_of_range_or_of_another_length_is_refused_by_name(label_kind: Any, reason: str) -> None:
    with pytest.raises(FieldError) as raised:
        one(label_kind=label_kind)
    assert (raised.value.field, raised.value.reason) == ("label_kind", reason)


def test_a_label_kind_naming_labels_the_batch_lacks_is_refused_at_add() -> None:
    batch = one(token_versions=None, label_kind=np.array([2]))
    with pytest.raises(FieldError, match=r"^label_kind: a sample labelled by token versions, in a batch without"):
        Sink().add(batch)


def test_a_present_flag_array_has_one_entry_per_sample() -> None:
    with pytest.raises(FieldError) as raised:
        one(rl_weights=np.ones(4), present={"rl_weights": np.ones(2, dtype=bool)})
    assert (raised.value.field, raised.value.reason) == ("present.rl_weights", "expected one entry per sample (1)")


FLAGS_REFUSED = {
    "strings": (np.array(["False", "False"]), None, "expected bools (or 0 and 1), got dtype <U5"),
    "a NaN": (np.array([0.0, np.nan]), None, "expected bools (or 0 and 1), got dtype float64"),
    "a half": (np.array([0.5, 0.0]), None, "expected bools (or 0 and 1), got dtype float64"),
    "a 2": (np.array([0, 2]), "b", "expected a bool, 0 or 1, got 2"),
    "a -1": (np.array([-1, 0], dtype=np.int8), "a", "expected a bool, 0 or 1, got -1"),
}


@pytest.mark.parametrize("name", ["frozen", "agentic"])
@pytest.mark.parametrize("case", list(FLAGS_REFUSED))
def test_frozen_and_agentic_take_bools_or_0_and_1_never_a_truthy_value(case: str, name: str) -> None:
    values, rollout, reason = FLAGS_REFUSED[case]
    with pytest.raises((FieldError, TraceError)) as raised:
        two(["a", "b"], **{name: values})
    assert (raised.value.field, raised.value.reason, raised.value.rollout) == (name, reason, rollout)
    with pytest.raises((FieldError, TraceError)) as padded:
        RolloutBatch.from_padded(["a", "b"], np.ones((2, 2)), dispatch_version=[2, 2], **{name: values})
    assert (padded.value.field, padded.value.reason, padded.value.rollout) == (name, reason, rollout)


def test_integer_flags_0_and_1_read_as_bools() -> None:
    batch = two(["a", "b"], frozen=np.array([1, 0], dtype=np.uint8), agentic=np.array([0, 1]))
    assert batch.frozen is not None and batch.frozen.tolist() == [True, False] and batch.frozen.dtype == bool
    assert batch.agentic is not None and batch.agentic.tolist() == [False, True]
    assert Sink(StalenessConfig(max_staleness=1)).add(batch) == 2


@pytest.mark.parametrize("field", ["dispatch_version", "completion_version"])
def test_a_version_past_records_bound_is_refused_as_its_record_is(field: str) -> None:
    versions = {"dispatch_version": np.array([0]), "completion_version": np.array([2**53])}
    assert Sink().add(one(**versions)) == 1  # the bound itself: taken, as a record's
    record = {"id": "stale", "dispatch_version": 0, "samples": [{"mask": [1]}], field: 2**53 + 1}
    with pytest.raises(TraceError) as as_record:
        Sink().add([record])
    with pytest.raises(TraceError) as as_batch:
        one(**(versions | {field: np.array([2**53 + 1], dtype=np.int64)}))
    assert str(as_batch.value) == str(as_record.value)
    assert str(as_batch.value) == f"rollout 'stale': field {field}: must be in 0..{2**53}, got {2**53 + 1}"


@pytest.mark.parametrize("column", ["group_ids", "envs"])
@pytest.mark.parametrize("dtype", [None, object])
def test_numpy_string_columns_are_read_as_the_lists_of_str_they_hold(column: str, dtype: Any) -> None:
    values = np.array(["g", "h"], dtype=dtype)
    batch = two(np.array(["a", "b"], dtype=dtype), **{column: values})
    assert batch.ids == ["a", "b"] and all(type(rid) is str for rid in batch.ids)
    assert getattr(batch, column) == ["g", "h"] and all(type(v) is str for v in getattr(batch, column))
    sink = Sink(StalenessConfig(env_breakdown=True))
    assert sink.add(batch) == 2
    assert [type(rid) for rid in sink.ship(3).ids] == [str, str]


def test_ids_of_a_numpy_integer_array_are_refused_as_a_record_s_ids_are() -> None:
    with pytest.raises(TraceError, match=r"^rollout '0': field id: required non-empty string$"):  # (as [0, 1])
        Sink().add(two(np.array([0, 1])))
    with pytest.raises(TraceError, match=r"^rollout 'b': field group_id: expected a string, got 7$"):
        Sink().add(two(["a", "b"], group_ids=np.array(["g", 7], dtype=object)))
