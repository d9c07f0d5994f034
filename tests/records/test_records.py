"""Every invalid-input rule of SPEC 3: strict mode names rollout, field and reason; lenient sets aside."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest

from staleness_metrics import FieldError, FieldTypeError, RolloutBatch, Sink, StalenessConfig, TraceError


def good(rid: str = "r1", **extra: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": rid,
        "dispatch_version": 2,
        "samples": [{"mask": [0, 1, 1, 1], "weight_versions": [[2, 1], [3, 3]], "rl_weights": [0, 1, 1, 1]}],
    }
    record.update(extra)
    return record


def with_sample(**fields: Any) -> dict[str, Any]:
    record = good()
    record["samples"][0].update(fields)
    return record


INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("wrong length", with_sample(rl_weights=[1, 1]), "samples[0].rl_weights", "length 2 differs"),
    (
        "unsorted spans",
        with_sample(weight_versions=[[3, 2], [2, 1]]),
        "samples[0].weight_versions[1]",
        "increase",
    ),
    (
        "repeated span start",
        with_sample(weight_versions=[[2, 1], [3, 1]]),
        "samples[0].weight_versions[1]",
        "increase",
    ),
    (
        "negative span version",
        with_sample(weight_versions=[[-2, 0]]),
        "samples[0].weight_versions[0]",
        "negative",
    ),
    (
        "negative token version",
        with_sample(weight_versions=None, token_versions=[-1, 2, -3, 2]),
        "samples[0].token_versions",
        "position 2",
    ),
    (
        "completion below dispatch",
        good(completion_version=1),
        "completion_version",
        "below dispatch_version 2",
    ),
    (
        "NaN weight",
        with_sample(rl_weights=[0, 1, math.nan, 1]),
        "samples[0].rl_weights",
        "position 2: not a finite",
    ),
    ("infinite ce weight", with_sample(ce_weights=[0, math.inf, 1, 1]), "samples[0].ce_weights", "finite"),
    (
        "missing dispatch",
        {k: v for k, v in good().items() if k != "dispatch_version"},
        "dispatch_version",
        "required on a live rollout",
    ),
    ("both version fields", with_sample(token_versions=[2, 2, 2, 2]), "samples[0].token_versions", "both"),
    ("mask not 0/1", with_sample(mask=[0, 1, 2, 1]), "samples[0].mask[2]", "expected 0, 1"),
    ("mask of strings", with_sample(mask=["a", 1, 1, 1]), "samples[0].mask[0]", "expected"),
    ("float mask", with_sample(mask=[0.0, 1.0, 1.0, 1.0]), "samples[0].mask[0]", "expected"),
    ("dispatch as string", good(dispatch_version="2"), "dispatch_version", "expected an integer"),
    ("negative dispatch", good(dispatch_version=-1), "dispatch_version", "must be in 0.."),
    ("samples not a list", good(samples={"mask": [1]}), "samples", "list"),
    ("empty samples", good(samples=[]), "samples", "at least one"),
    (
        "span start past the end",
        with_sample(weight_versions=[[2, 0], [3, 4]]),
        "samples[0].weight_versions[1]",
        "outside 0..3",
    ),
    (
        "negative span start",
        with_sample(weight_versions=[[2, -1]]),
        "samples[0].weight_versions[0]",
        "outside",
    ),
    (
        "weights of strings",
        with_sample(ref_kl_weights=["x", 0, 0, 0]),
        "samples[0].ref_kl_weights[0]",
        "number",
    ),
    ("unknown source", good(source="other"), "source", "'live' or 'frozen'"),
    ("agentic not bool", good(agentic="yes"), "agentic", "boolean"),
    ("unknown field", good(policy_version=3), "policy_version", "unknown field"),
    ("empty env", good(env=""), "env", "must be a non-empty string when present"),
    ("env not a string", good(env=3), "env", "expected a string"),
]


@pytest.mark.parametrize(("case", "record", "field", "reason"), INVALID, ids=[c[0] for c in INVALID])
def test_strict_names_rollout_field_and_reason(case: str, record: dict[str, Any], field: str, reason: str) -> None:
    sink = Sink(StalenessConfig(strict=True))
    with pytest.raises(TraceError) as caught:
        sink.add(record)
    assert caught.value.rollout_id == "r1"
    assert caught.value.field == field
    assert reason in caught.value.reason
    assert str(caught.value).startswith(f"rollout 'r1': field {field}: ")
    assert sink.queued == 0


@pytest.mark.parametrize(("case", "record", "field", "reason"), INVALID, ids=[c[0] for c in INVALID])
def test_lenient_sets_invalid_aside_and_keeps_the_rest(
    case: str, record: dict[str, Any], field: str, reason: str
) -> None:
    sink = Sink(StalenessConfig(strict=False))
    valid_before, valid_after = good("before"), good("after")
    assert sink.add([valid_before, copy.deepcopy(record), valid_after]) == 2
    assert [e.field for e in sink.invalid] == [field]
    shipment = sink.ship(5)
    assert shipment.ids == ["before", "after"]
    assert shipment.report.tally.rollouts_invalid == 1
    assert len(shipment.invalid) == 1


def test_duplicate_ids_within_a_batch_and_across_adds() -> None:
    sink = Sink()
    sink.add(good("a"))
    with pytest.raises(TraceError, match="duplicate id"):
        sink.add(good("a"))
    with pytest.raises(TraceError, match="duplicate id") as caught:
        sink.add([good("b"), good("b")])
    assert caught.value.rollout_id == "b"
    assert sink.queued == 1  # strict: nothing of a rejected add is applied


def test_version_above_trained_is_rejected_at_ship_but_accepted_by_sweep() -> None:
    sink = Sink()
    sink.add(good("ahead", dispatch_version=2))  # label 3 at positions 3..
    sink.sweep(3)  # T = 2: a sweep accepts the version-3 label
    assert sink.queued == 1
    with pytest.raises(TraceError) as caught:
        sink.ship(3)
    assert caught.value.rollout_id == "ahead"
    assert caught.value.field == "samples[0].weight_versions"
    assert "above the trained version 2" in caught.value.reason
    assert sink.queued == 1  # the failed ship changed nothing
    assert sink.ship(4).ids == ["ahead"]


def test_dispatch_above_trained_is_rejected_at_ship() -> None:
    sink = Sink(StalenessConfig(strict=False))
    sink.add({"id": "early", "dispatch_version": 5, "samples": [{"mask": [1]}]})
    sink.add(good("fine"))
    shipment = sink.ship(5)
    assert shipment.ids == ["fine"]
    assert shipment.report.tally.rollouts_invalid == 1
    assert shipment.invalid[0].field == "dispatch_version"


def test_labels_older_than_dispatch_are_valid() -> None:
    sink = Sink()
    sink.add({"id": "old", "dispatch_version": 4, "samples": [{"mask": [1, 1], "token_versions": [2, 3]}]})
    assert sink.ship(5).metrics["staleness/token/mean"] == 1.5


def test_columnar_batch_errors_name_the_rollout() -> None:
    batch = RolloutBatch(
        ids=["ok", "bad"],
        sample_offsets=np.array([0, 1, 2]),
        position_offsets=np.array([0, 2, 4]),
        mask=np.array([1, 1, 1, 0.5], dtype=np.float32),
        dispatch_version=np.array([1, 1]),
    )
    with pytest.raises(TraceError) as caught:
        Sink().add(batch)
    assert (caught.value.rollout_id, caught.value.field) == ("bad", "samples[0].mask")
    assert "position 1" in caught.value.reason


def test_frozen_rollout_needs_no_dispatch_version() -> None:
    sink = Sink()
    sink.add({"id": "f", "source": "frozen", "samples": [{"mask": [1, 1]}]})
    shipment = sink.ship(3)
    assert shipment.ids == ["f"]
    assert shipment.report.tally.rollouts_frozen == 1


def test_typed_records_are_validated_like_dicts() -> None:
    from staleness_metrics import Rollout, Sample

    sink = Sink()
    typed = Rollout("t", [Sample(mask=np.array([1, 1]), weight_versions=[(2, 0), (3, 1)])], dispatch_version=2)
    assert sink.add(typed) == 1
    assert sink.ship(5).batches_line()["shipped"][0]["samples"][0]["weight_versions"] == [[2, 0], [3, 1]]
    with pytest.raises(TraceError) as caught:
        sink.add(Rollout("bad", [Sample(mask=[1, 2])], dispatch_version=1))
    assert (caught.value.rollout_id, caught.value.field) == ("bad", "samples[0].mask[1]")


@pytest.mark.parametrize("agentic", ["false", "no", 1, 0, 0.5, np.True_])
def test_a_typed_records_agentic_is_checked_like_a_dicts(agentic: Any) -> None:
    """Not read by truthiness: ``Rollout(agentic="false")`` was queued as agentic (SPEC 3: nothing coerced)."""
    from staleness_metrics import Rollout, Sample

    for record in ({"id": "a", "dispatch_version": 0, "agentic": agentic, "samples": [{"mask": [1]}]},
                   Rollout("a", [Sample(mask=[1])], dispatch_version=0, agentic=agentic)):  # fmt: skip
        with pytest.raises(TraceError) as caught:
            Sink().add(record)
        assert (caught.value.rollout_id, caught.value.field) == ("a", "agentic")
    sink = Sink()
    assert sink.add([Rollout("t", [Sample(mask=[1])], dispatch_version=0, agentic=True),
                     Rollout("f", [Sample(mask=[1])], dispatch_version=0, agentic=False)]) == 2  # fmt: skip
    assert [r.record().get("agentic", False) for r in sink.ship(1).rollouts] == [True, False]


@pytest.mark.parametrize(
    ("record", "field"),
    [
        (good(completion_version=-1), "completion_version"),
        ({"id": "r1", "source": "frozen", "dispatch_version": -1, "samples": [{"mask": [1]}]}, "dispatch_version"),
        (good(dispatch_version=2**70), "dispatch_version"),
        (with_sample(weight_versions=[[2**70, 0]]), "samples[0].weight_versions[0]"),
        (with_sample(weight_versions=None, token_versions=[2**70, 1, 1, 1]), "samples[0].token_versions[0]"),
    ],
)
def test_explicit_negative_and_huge_versions_are_refused(record: dict[str, Any], field: str) -> None:
    with pytest.raises(TraceError) as caught:
        Sink().add(record)
    assert caught.value.field == field


def test_a_huge_step_is_refused_and_leaves_the_sink_usable() -> None:
    sink = Sink()
    with pytest.raises(FieldError, match="step: must be") as caught:
        sink.ship(10**30)
    assert caught.value.field == "step" and isinstance(caught.value, ValueError)
    assert sink.ship(3).step == 3
    with pytest.raises(FieldError, match="never decrease") as caught:
        sink.ship(2)
    assert caught.value.field == "step"


@pytest.mark.parametrize(
    ("sample", "field"),
    [
        ({"mask": [1, 1], "token_versions": [True, 0]}, "samples[0].token_versions[0]"),
        ({"mask": [1, 1], "rl_weights": [0.5, True]}, "samples[0].rl_weights[1]"),
        ({"mask": [1, 1], "logprobs": [-0.5, False]}, "samples[0].logprobs[1]"),
    ],
)
def test_booleans_are_not_numbers(sample: dict[str, Any], field: str) -> None:
    with pytest.raises(TraceError) as caught:
        Sink().add({"id": "r1", "dispatch_version": 0, "samples": [sample]})
    assert caught.value.field == field


def test_ship_refuses_a_single_string_of_ids() -> None:
    sink = Sink()
    sink.add(good("r-1"))
    with pytest.raises(FieldTypeError, match="not one string") as caught:
        sink.ship(5, ids="r-1")
    assert caught.value.field == "ids" and isinstance(caught.value, TypeError)
    assert sink.queued == 1


def test_columnar_live_rollout_without_dispatch_version_is_refused() -> None:
    """The columnar form has no "missing": -1 is "none", valid only on a frozen rollout."""
    batch = RolloutBatch(
        ids=["frozen", "live"],
        sample_offsets=np.array([0, 1, 2]),
        position_offsets=np.array([0, 2, 4]),
        mask=np.ones(4),
        dispatch_version=np.array([-1, -1]),
        frozen=np.array([True, False]),
    )
    with pytest.raises(TraceError) as caught:
        Sink().add(batch)
    assert (caught.value.rollout_id, caught.value.field) == ("live", "dispatch_version")
    assert "must be >= 0 on a live rollout" in caught.value.reason
    lenient = Sink(StalenessConfig(strict=False))
    assert lenient.add(batch) == 1 and [e.rollout_id for e in lenient.invalid] == ["live"]


def test_columnar_empty_env_is_refused() -> None:
    batch = RolloutBatch(
        ids=["a", "b"],
        sample_offsets=np.array([0, 1, 2]),
        position_offsets=np.array([0, 1, 2]),
        mask=np.ones(2),
        dispatch_version=np.array([0, 0]),
        envs=["math", ""],
    )
    with pytest.raises(TraceError) as caught:
        Sink().add(batch)
    assert (caught.value.rollout_id, caught.value.field) == ("b", "env")
    assert "non-empty" in caught.value.reason


@pytest.mark.parametrize(
    "config",
    [StalenessConfig(policy="group", max_staleness=2), StalenessConfig(policy="xtuner", max_staleness=2)],
    ids=["group", "xtuner"],
)
def test_group_policies_judge_every_queued_member_of_a_touched_group(config: StalenessConfig) -> None:
    """SPEC 4: a group drop reaches queued members the ship did not name, and members judged earlier.

    "b" was judged (kept) by a sweep at this step before its stale group mate "a" arrived; the ship names
    only "b", and the sweep inside it judges only "a" (the one not judged yet). Judging "a" alone would
    drop "a" and ship "b"; judging the group drops both.
    """
    sink = Sink(config)
    sink.add({"id": "b", "group_id": "g", "dispatch_version": 5, "samples": [{"mask": [1, 1]}]})
    sink.add({"id": "other", "dispatch_version": 5, "samples": [{"mask": [1]}]})
    sink.sweep(6)
    sink.add({"id": "a", "group_id": "g", "dispatch_version": 0, "samples": [{"mask": [1]}]})
    shipment = sink.ship(6, ids=["b"])
    assert shipment.ids == []
    assert set(shipment.dropped_rollouts) == {"a", "b"}
    assert sink.queued == 1  # "other" (another group) is untouched


# ---------------------------------------------------------------- what no store keeps (issue 19)


@pytest.mark.parametrize("field", ["id", "group_id", "env"])
def test_lone_surrogates_are_refused_naming_the_field(field: str) -> None:
    record = {"id": "r", "dispatch_version": 0, "samples": [{"mask": [1]}], field: "x\ud800"}
    with pytest.raises(TraceError) as caught:
        Sink().add(record)
    assert caught.value.field == field and "lone surrogate U+D800 at character 1" in caught.value.reason
    assert caught.value.rollout_id == ("x\\ud800" if field == "id" else "r")  # printable in any log
    lenient = Sink(StalenessConfig(strict=False))
    assert lenient.add(record) == 0 and lenient.invalid[0].field == field
    assert lenient.ship(1).report.tally.rollouts_invalid == 1


def test_typed_records_with_lone_surrogates_are_refused() -> None:
    from staleness_metrics import Rollout, Sample

    with pytest.raises(TraceError) as caught:
        Sink().add(Rollout("t", [Sample(mask=[1])], dispatch_version=0, env="\udfff"))
    assert caught.value.field == "env"


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**70])
def test_integers_beyond_64_bits_in_float_lists_are_refused(value: int) -> None:
    record = {"id": "r", "dispatch_version": 0, "samples": [{"mask": [1, 1], "rl_weights": [0.5, value]}]}
    with pytest.raises(TraceError) as caught:
        Sink().add(record)
    assert caught.value.field == "samples[0].rl_weights[1]" and "signed 64-bit" in caught.value.reason
    lenient = Sink(StalenessConfig(strict=False))
    assert lenient.add(record) == 0 and len(lenient.invalid) == 1


def test_the_storable_check_replay_and_the_service_share() -> None:
    from staleness_metrics.records.validation import lone_surrogate, unstorable

    assert lone_surrogate("fine é 😀") is None and lone_surrogate("ab\udc00") == 2
    assert unstorable({"id": "r", "samples": [{"mask": [1, 2**64]}]}) == (
        "samples[0].mask[1]",
        "integer outside the signed 64-bit range",
    )
    assert unstorable({"id": "r", "x": [2**63 - 1, -(2**63)]}) is None
    deep: list[object] = []
    for _ in range(200):
        deep = [deep]
    assert unstorable({"id": "r", "samples": deep}) is not None


@pytest.mark.parametrize("missing", [None, math.nan, math.inf, -math.inf])
def test_a_sampler_logprob_lacking_a_value_is_uncovered_never_an_error(missing: float | None) -> None:
    """SPEC 11: a position lacking either value (null, NaN, ±inf) is uncovered, the sampler's ``logprobs``
    as the trainer's: the record is read (null as NaN), kept in lenient mode, and costs coverage only."""
    from staleness_metrics.records.model import parse_rollout

    def record(sampler: list[Any], trainer: list[Any]) -> dict[str, Any]:
        sample = {"mask": [1, 1], "logprobs": sampler, "trainer_logprobs": trainer}
        return {"id": "r1", "dispatch_version": 0, "samples": [sample]}

    [sample] = parse_rollout(record([-1.0, missing], [-1.1, -1.0])).samples
    assert sample.logprobs is not None and sample.logprobs[0] == -1.0 and not math.isfinite(sample.logprobs[1])
    for strict in (True, False):
        sink = Sink(StalenessConfig(max_staleness=4, strict=strict))
        assert sink.add(record([-1.0, missing], [-1.1, -1.0])) == 1 and not sink.invalid
        metrics = sink.ship(1).metrics
        assert metrics["staleness/mismatch/coverage"] == 0.5 and metrics["staleness/mismatch/lag_0/tokens"] == 1
    # the other rules stand: a string, a boolean and a wrong length are still errors
    # a wrong value after a null is named by its own index (it was counted among the non-nulls)
    wrong = (
        ([-1.0, "-1"], "logprobs[1]"),
        ([-1.0, True], "logprobs[1]"),
        ([None], "logprobs"),
        ([None, "x"], "logprobs[1]"),
    )
    for bad, field in wrong:
        with pytest.raises(TraceError) as caught:
            Sink().add(record(bad, [-1.1, -1.0]))
        assert caught.value.field == f"samples[0].{field}"
