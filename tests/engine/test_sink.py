"""Sink and policy behaviour of SPEC 4 and 5, each on a small hand-checked case."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from staleness_metrics import RolloutBatch, Sink, StalenessConfig, TraceError
from staleness_metrics.replay.stream import Event, replay


def rollout(rid: str, dispatch: int, *samples: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": rid, "dispatch_version": dispatch, "samples": list(samples) or [{"mask": [1, 1]}], **extra}


def sink(policy: str = "token", max_staleness: int = 2, **extra: Any) -> Sink:
    return Sink(StalenessConfig(policy=policy, max_staleness=max_staleness, **extra))  # type: ignore[arg-type]


# --- token policy -------------------------------------------------------------------------------


def test_staleness_equal_to_the_bound_trains_one_more_is_masked() -> None:
    s = sink(max_staleness=2)
    s.add(rollout("r", 1, {"mask": [1, 1, 1], "weight_versions": [[1, 0], [2, 1], [3, 2]]}))
    shipment = s.ship(5)  # T = 4: versions 1, 2, 3 are 3, 2, 1 stale
    (record,) = shipment.batches_line()["shipped"]
    assert record["samples"][0]["mask"] == [0, 1, 1]
    assert shipment.metrics["staleness/token/masked"] == pytest.approx(1 / 3)


def test_stale_position_is_zeroed_in_all_four_arrays_and_mask0_weights_stay() -> None:
    s = sink(max_staleness=0)
    sample = {
        "mask": [1, 0, 1, 1],
        "weight_versions": [[0, 0], [1, 3]],
        "rl_weights": [0.5, 0.0, 0.25, 1.0],
        "ce_weights": [1.0, 3.0, 1.0, 1.0],
        "ref_kl_weights": [0.1, 0.2, 0.3, 0.4],
    }
    s.add(rollout("r", 0, sample))
    (record,) = s.ship(2).batches_line()["shipped"]  # T = 1: version 0 is stale
    out = record["samples"][0]
    assert out["mask"] == [0, 0, 0, 1]
    assert out["rl_weights"] == [0.0, 0.0, 0.0, 1.0]
    assert out["ce_weights"] == [0.0, 3.0, 0.0, 1.0]  # mask-0 position keeps its ce weight
    assert out["ref_kl_weights"] == [0.0, 0.2, 0.0, 0.4]


def test_unlabelled_positions_take_the_dispatch_version() -> None:
    s = sink(max_staleness=1)
    # positions 0..1 precede the first span; position 3 is an explicit -1 span
    s.add(rollout("r", 2, {"mask": [1, 1, 1, 1], "weight_versions": [[4, 2], [-1, 3]]}))
    shipment = s.ship(6)  # T = 5: dispatch 2 is 3 stale, label 4 is 1 stale
    (record,) = shipment.batches_line()["shipped"]
    assert record["samples"][0]["mask"] == [0, 0, 1, 0]
    assert shipment.metrics["staleness/token/unlabelled"] == 0.75
    assert shipment.metrics["staleness/token/mean"] == (3 + 3 + 1 + 3) / 4


def test_frozen_rollouts_are_never_masked_nor_counted() -> None:
    s = sink(max_staleness=0)
    s.add({"id": "f", "source": "frozen", "dispatch_version": 0, "samples": [{"mask": [1, 1]}]})
    s.add(rollout("live", 4))
    shipment = s.ship(5)
    assert shipment.ids == ["f", "live"]
    assert shipment.batches_line()["shipped"][0]["samples"][0]["mask"] == [1, 1]
    assert shipment.report.tally.tokens_sampled == 2
    assert shipment.report.tally.rollouts_frozen == 1
    assert shipment.metrics["staleness/rollout/max"] == 0


def test_sample_with_nothing_left_is_dropped_and_rollout_only_when_all_are() -> None:
    s = sink(max_staleness=0)
    s.add(rollout("half", 0, {"mask": [1, 1], "token_versions": [0, 0]}, {"mask": [1, 1], "token_versions": [0, 1]}))
    s.add(rollout("gone", 0, {"mask": [1], "token_versions": [0]}, {"mask": [1, 1], "token_versions": [0, 0]}))
    shipment = s.ship(2)
    assert shipment.ids == ["half"]
    assert shipment.dropped_rollouts == ("gone",)
    assert set(shipment.dropped_samples) == {("half", 0), ("gone", 0), ("gone", 1)}
    assert shipment.metrics["staleness/sample/dropped"] == 3
    assert shipment.metrics["staleness/rollout/dropped"] == 1
    assert [s_["mask"] for s_ in shipment.batches_line()["shipped"][0]["samples"]] == [[0, 1]]


def test_sample_with_nothing_to_train_from_the_start_is_not_dropped() -> None:
    s = sink(max_staleness=0)
    s.add(rollout("r", 0, {"mask": [1, 1], "rl_weights": [0.0, 0.0]}))
    shipment = s.ship(3)
    assert shipment.ids == ["r"]
    assert shipment.metrics["staleness/token/masked"] == 1.0


def test_ce_weight_on_a_mask0_position_keeps_the_sample() -> None:
    s = sink(max_staleness=0)
    s.add(rollout("r", 0, {"mask": [0, 1], "ce_weights": [1.0, 1.0]}))
    shipment = s.ship(3)
    assert shipment.ids == ["r"] and shipment.metrics["staleness/sample/dropped"] == 0


# --- sweeps, windows, monotonicity ---------------------------------------------------------------


def test_same_step_twice_changes_nothing_and_later_steps_only_mask_more() -> None:
    s = sink(max_staleness=1)
    masks = np.ones(6, dtype=np.float32)
    batch = RolloutBatch(
        ids=["r"],
        sample_offsets=np.array([0, 1]),
        position_offsets=np.array([0, 6]),
        mask=masks,
        dispatch_version=np.array([0]),
        span_offsets=np.array([0, 3]),
        span_versions=np.array([0, 1, 2]),
        span_starts=np.array([0, 2, 4]),
    )
    s.add(batch)
    s.sweep(3)  # T = 2, bound 1: version 0 stale
    after_first = masks.copy()
    s.sweep(3)
    np.testing.assert_array_equal(masks, after_first)
    s.sweep(4)  # T = 3: versions 0, 1 stale
    assert masks.tolist() == [0, 0, 0, 0, 1, 1]
    assert np.all(masks <= after_first)


def test_sweep_drops_are_reported_by_the_next_ship_and_an_empty_ship_reports_them() -> None:
    s = sink("episode", max_staleness=1)
    s.add(rollout("old", 0))
    s.sweep(5)
    assert s.queued == 0
    shipment = s.ship(5)
    assert shipment.ids == []
    assert shipment.metrics == {
        # SPEC 12: the dropped sample (2 sampled positions) is in the length population, wholly removed
        "staleness/length/sampled/mean": 2.0,
        "staleness/length/trained/mean": 0.0,
        "staleness/length/bucket_256/masked": 1.0,
        "staleness/rollout/dropped": 1,
        "staleness/sample/dropped": 1,
        "staleness/rollout/held": 0,
        "staleness/max_staleness": 1,
    }
    assert s.ship(5).metrics["staleness/rollout/dropped"] == 0  # the next window starts empty


def test_ship_with_ids_takes_only_those_and_ignores_unknown_ids() -> None:
    s = sink(max_staleness=8)
    s.add([rollout("a", 1), rollout("b", 1), rollout("c", 1)])
    shipment = s.ship(2, ids=["c", "nope", "a"])
    assert sorted(shipment.ids) == ["a", "c"]
    assert s.queued == 1
    assert s.ship(2).ids == ["b"]


def test_steps_never_decrease() -> None:
    s = sink()
    s.ship(4)
    with pytest.raises(ValueError, match="never decrease"):
        s.sweep(3)


def test_conservation_of_sampled_positions() -> None:
    s = sink(max_staleness=1)
    s.add(
        [
            rollout("a", 0, {"mask": [1, 1, 0]}),
            rollout("b", 2, {"mask": [1, 1, 1], "token_versions": [0, 2, 2]}),
        ]
    )
    s.add(rollout("c", 3, {"mask": [1, 1]}))
    s.ship(4, ids=["b"])
    queued_tokens = s.tokens_queued
    assert queued_tokens == 2  # "c" is still queued
    totals = s.totals
    assert s.tokens_entered == 7
    assert totals.tokens_sampled + totals.tokens_dropped + queued_tokens == s.tokens_entered
    trained = totals.tokens_sampled - totals.tokens_masked
    assert (trained, totals.tokens_masked, totals.tokens_dropped) == (2, 1, 2)


# --- episode: prime-rl's arithmetic --------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "dispatch", "completion", "expected"),
    [
        (5, 3, 3, (1, 0, 1)),
        (5, 3, 5, (1, 1, 0)),
        (5, 3, 6, (1, 1, 0)),
        (5, 4, 4, (0, 0, 0)),
        (10, 2, 7, (7, 5, 2)),
    ],
)
def test_episode_arithmetic_matches_prime_rl(
    step: int, dispatch: int, completion: int, expected: tuple[int, ...]
) -> None:
    s = sink("episode", max_staleness=8)
    s.add(rollout("e", dispatch, completion_version=completion))
    m = s.ship(step).metrics
    assert (
        m["staleness/rollout/max"],
        m["staleness/rollout/in_flight/max"],
        m["staleness/rollout/in_queue/max"],
    ) == expected


def test_episode_bound_at_step_12() -> None:
    s = sink("episode", max_staleness=8)
    s.add([rollout("d2", 2), rollout("d3", 3)])
    shipment = s.ship(12)
    assert shipment.ids == ["d3"] and shipment.dropped_rollouts == ("d2",)
    assert shipment.metrics["staleness/rollout/max"] == 8


def test_episode_judges_each_rollout_by_its_own_dispatch_not_its_group() -> None:
    s = sink("episode", max_staleness=1)
    s.add([rollout("old", 0, group_id="g"), rollout("new", 3, group_id="g")])
    assert s.ship(4).ids == ["new"]


# --- group ----------------------------------------------------------------------------------------


def test_group_drops_fresh_members_with_the_stale_one_and_frozen_stay() -> None:
    s = sink("group", max_staleness=1)
    s.add([
        rollout("old", 0, group_id="g"), rollout("fresh", 3, group_id="g"),
        {"id": "frozen", "group_id": "g", "source": "frozen", "samples": [{"mask": [1]}]},
        rollout("other", 3, group_id="h"), rollout("solo", 3),
    ])  # fmt: skip
    shipment = s.ship(4)
    assert sorted(shipment.dropped_rollouts) == ["fresh", "old"]
    assert sorted(shipment.ids) == ["frozen", "other", "solo"]


def test_group_ship_of_one_member_reaches_queued_members() -> None:
    s = sink("group", max_staleness=1)
    s.add([rollout("fresh", 3, group_id="g"), rollout("old", 0, group_id="g"), rollout("x", 3)])
    shipment = s.ship(4, ids=["x"])  # the sweep at 4 already judges group g
    assert shipment.ids == ["x"]
    assert sorted(shipment.dropped_rollouts) == ["fresh", "old"]


# --- xtuner ---------------------------------------------------------------------------------------


def xt(**extra: Any) -> Sink:
    return sink("xtuner", max_staleness=extra.pop("max_staleness", 1), **extra)


def test_xtuner_sequence_expiry_drops_the_whole_group_without_retry() -> None:
    s = xt(max_staleness=1)  # S = 2
    s.add([
        rollout("a", 3, {"mask": [1, 1], "token_versions": [2, 3]}, group_id="g"),
        rollout("b", 3, {"mask": [1, 1], "token_versions": [3, 4]}, group_id="g"),
    ])  # fmt: skip
    shipment = s.ship(5)  # T = 4: a's sequence staleness is 2 >= S
    assert sorted(shipment.dropped_rollouts) == ["a", "b"]


def test_xtuner_sequence_staleness_counts_labelled_mask0_positions() -> None:
    s = xt(max_staleness=1)
    s.add(rollout("a", 4, {"mask": [0, 1], "token_versions": [2, 4]}))
    assert s.ship(5).dropped_rollouts == ("a",)


def test_xtuner_token_masking_threshold_and_partial_sample_survives() -> None:
    s = xt(max_staleness=5, max_token_staleness=0, sync_interval=2)  # S_tok = 2, S = 12
    s.add(rollout("a", 2, {"mask": [1, 1, 1], "token_versions": [2, 3, 4]}))
    shipment = s.ship(6)  # T = 5: staleness 3, 2, 1 -> >= 2 masked
    assert shipment.batches_line()["shipped"][0]["samples"][0]["mask"] == [0, 0, 1]


def test_xtuner_agentic_group_is_never_token_masked() -> None:
    s = xt(max_staleness=5, max_token_staleness=0)
    s.add([
        rollout("a", 2, {"mask": [1, 1], "token_versions": [2, 4]}, group_id="g"),
        rollout("b", 4, {"mask": [1]}, group_id="g", agentic=True),
    ])  # fmt: skip
    shipment = s.ship(6)
    assert shipment.batches_line()["shipped"][0]["samples"][0]["mask"] == [1, 1]


def test_xtuner_fully_masked_sample_expires() -> None:
    s = xt(max_staleness=5, max_token_staleness=0)
    s.add(
        [
            rollout("a", 3, {"mask": [1, 1], "token_versions": [3, 3]}, group_id="g"),
            rollout("b", 4, group_id="g"),
        ]
    )
    assert sorted(s.ship(6).dropped_rollouts) == ["a", "b"]


def test_xtuner_retry_holds_the_group_until_replacements_arrive() -> None:
    s = xt(max_staleness=1, retry_expired=True)
    s.add([rollout("old", 2, group_id="g"), rollout("new", 4, group_id="g"), rollout("solo", 4)])
    first = s.ship(5)  # old expires (staleness 2 >= 2); new is held
    assert first.dropped_rollouts == ("old",) and first.held == ("new",) and first.ids == ["solo"]
    assert first.metrics["staleness/rollout/held"] == 1
    again = s.ship(5)
    assert again.held == ("new",) and again.ids == []
    s.add(rollout("retry", 4, group_id="g"))
    released = s.ship(5)
    assert sorted(released.ids) == ["new", "retry"] and released.held == ()


# --- metrics shape --------------------------------------------------------------------------------


def test_empty_population_omits_keys_but_keeps_counts() -> None:
    s = sink()
    s.add({"id": "f", "source": "frozen", "samples": [{"mask": [1]}]})
    assert set(s.ship(2).metrics) == {
        "staleness/rollout/dropped", "staleness/sample/dropped", "staleness/rollout/held", "staleness/max_staleness",
    }  # fmt: skip


def test_types_and_quantiles_are_nearest_rank() -> None:
    s = sink(max_staleness=20)
    versions = [10] * 5 + [8] * 4 + [0]  # staleness 0 x5, 2 x4, 10 x1 at T = 10
    s.add(rollout("r", 0, {"mask": [1] * 10, "token_versions": versions}))
    m = s.ship(11).metrics
    assert (m["staleness/token/p50"], m["staleness/token/p90"], m["staleness/token/p99"]) == (0, 2, 10)
    assert isinstance(m["staleness/token/mean"], float) and isinstance(m["staleness/rollout/max"], int)


def test_env_breakdown_keys() -> None:
    s = sink(max_staleness=2, env_breakdown=True)
    s.add(
        [
            rollout("a", 1, env="math"),
            rollout("b", 3, env="code"),
            rollout("c", 0, env="math"),
            rollout("d", 3),
        ]
    )
    m = s.ship(4).metrics
    assert m["staleness/env/math/rollout/max"] == 2
    assert m["staleness/env/math/rollout/dropped"] == 1
    assert m["staleness/env/code/token/mean"] == 0.0
    assert m["staleness/rollout/dropped"] == 1
    assert not any(k.startswith("staleness/env//") for k in m)


def test_columnar_batch_is_masked_in_place_without_copies() -> None:
    n = 8
    arrays = {name: np.ones(2 * n, dtype=np.float32) for name in ("mask", "rl_weights", "ce_weights", "ref_kl_weights")}
    batch = RolloutBatch(
        ids=["a", "b"], sample_offsets=np.array([0, 1, 2]), position_offsets=np.array([0, n, 2 * n]),
        dispatch_version=np.array([1, 4]), span_offsets=np.array([0, 2, 3]),
        span_versions=np.array([1, 3, 4]), span_starts=np.array([0, 5, 0]), **arrays,
    )  # fmt: skip
    s = sink(max_staleness=1)
    s.add(batch)
    shipment = s.ship(5)  # T = 4: version 1 is stale (positions 0..4 of sample 0)
    for values in arrays.values():
        assert values.tolist() == [0] * 5 + [1] * 3 + [1] * n
    assert shipment.metrics["staleness/token/masked"] == 5 / 16


@pytest.mark.parametrize("dtype", ["<i8", ">i8", ">i4", ">u2", ">u8", ">f4", "|b1", "<f2"])
@pytest.mark.parametrize("many", [False, True])  # a single add (staged) or a list (checked at once)
def test_a_mask_of_either_byte_order_is_decided_as_the_native_one_and_masked_in_place(dtype: str, many: bool) -> None:
    mask = np.array([0, 1, 1, 1, 1, 1], dtype=dtype)
    batch = RolloutBatch(ids=["r0"], sample_offsets=np.array([0, 1]), position_offsets=np.array([0, 6]), mask=mask,
                         dispatch_version=np.array([9]), token_versions=np.array([-1, 1, 1, 9, 9, 9]))  # fmt: skip
    s = sink(max_staleness=4)
    assert s.add([batch] if many else batch) == 1
    shipment = s.ship(11)  # T = 10: version 1 is stale, version 9 kept
    assert mask.dtype == np.dtype(dtype) and mask.tolist() == [0, 0, 0, 1, 1, 1]
    assert list(shipment.ids) == ["r0"] and shipment.metrics["staleness/token/masked"] == 2 / 5


def test_memory_stays_bounded_over_a_long_run_and_ids_stay_unique() -> None:
    s = Sink(StalenessConfig(max_staleness=2), compact_min_rows=64)
    for step in range(1, 201):
        s.add([rollout(f"{step}-{i}", step - 1) for i in range(20)])
        assert s.ship(step).metrics["staleness/rollout/max"] == 0
    assert s.tracked_rollouts <= 2 * 64
    with pytest.raises(TraceError, match="duplicate id"):
        s.add(rollout("1-0", 199))


def test_a_huge_staleness_keeps_exact_metrics_and_a_bounded_histogram() -> None:
    from staleness_metrics.metrics.buckets import HISTOGRAM_TOP

    s = sink(max_staleness=2**53)
    s.add([rollout("old", 0, {"mask": [1, 1, 1]}), rollout("new", 2**52, {"mask": [1]})])
    shipment = s.ship(2**52 + 1)
    m, tally = shipment.metrics, shipment.report.tally
    assert (m["staleness/token/p50"], m["staleness/token/p99"], m["staleness/rollout/max"]) == (2**52, 2**52, 2**52)
    assert m["staleness/token/mean"] == 3 * 2**52 / 4
    assert len(tally.token_histogram) == HISTOGRAM_TOP + 1
    assert tally.token_histogram[0] == 1 and tally.token_histogram[HISTOGRAM_TOP] == 3


def test_a_columnar_batch_names_each_duplicate_id_and_bad_env_and_keeps_the_rest() -> None:
    s = Sink(StalenessConfig(max_staleness=2, strict=False))
    s.add(
        RolloutBatch(ids=["old"], sample_offsets=[0, 1], position_offsets=[0, 2], dispatch_version=[0], mask=np.ones(2))
    )
    ids = ["a", "old", "a", "b", "c", "d", "e"]
    envs: list[Any] = ["math", None, "math", "", ["code"], 7, "code"]
    n = len(ids)
    added = s.add(
        RolloutBatch(
            ids=ids,
            envs=envs,
            sample_offsets=np.arange(n + 1),
            position_offsets=np.arange(n + 1) * 2,
            dispatch_version=np.zeros(n, dtype=np.int64),
            mask=np.ones(2 * n),
        )
    )
    reasons = sorted((e.rollout_id, e.field) for e in s.invalid)
    assert reasons == [("a", "id"), ("b", "env"), ("c", "env"), ("d", "env"), ("old", "id")]
    assert added == 2  # the first "a" and "e"
    assert s.ship(1).ids == ["old", "a", "e"]


def test_a_batch_is_let_go_once_its_last_rollout_left_and_not_before() -> None:
    import gc
    import weakref

    s = Sink(StalenessConfig(max_staleness=1), compact_min_rows=10_000)  # no compaction: release alone

    def batch(ids: list[str], dispatch: int) -> RolloutBatch:
        n = len(ids)
        return RolloutBatch(
            ids=ids, sample_offsets=np.arange(n + 1), position_offsets=np.arange(n + 1) * 2,
            dispatch_version=np.full(n, dispatch), mask=np.ones(2 * n),
        )  # fmt: skip

    first, second = batch(["a", "b"], 0), batch(["c"], 0)
    first_ref, second_ref = weakref.ref(first), weakref.ref(second)
    s.add(first)
    s.add(second)
    del first, second
    assert s.ship(1, ids=["a"]).ids == ["a"]
    gc.collect()
    assert first_ref() is not None and second_ref() is not None  # "b" still queued in the first batch
    assert s.ship(2, ids=["b"]).ids == ["b"]
    gc.collect()
    assert first_ref() is None and second_ref() is not None
    s.ship(4)  # "c" (version 0 at T = 3) is dropped by the sweep: its batch goes at this ship too
    gc.collect()
    assert second_ref() is None


@pytest.mark.parametrize("second_env", [None, "code"])
def test_one_env_s_report_is_the_whole_population_s(second_env: str | None) -> None:
    """With every rollout (shipped, dropped or held) in one env, that env's metrics and tally are the whole
    ship's; with a second env, each env's counts add up to the whole."""
    sink = Sink(StalenessConfig(policy="token", max_staleness=1))
    records = [
        {"id": f"r{i}", "env": second_env if (second_env and i % 3 == 0) else "math", "dispatch_version": i % 4,
         "samples": [{"mask": [0, 1, 1, 1], "token_versions": [-1, i % 4, -1, 3]},
                     {"mask": [1, 1], "rl_weights": [0.0, 0.0] if i == 5 else [1.0, 1.0]}]}
        for i in range(12)
    ]  # fmt: skip
    sink.add(records)
    report = sink.ship(5).report
    assert report.tally.tokens_sampled > 0 and report.tally.samples_dropped > 0
    if second_env is None:
        assert report.env_tally == {"math": report.tally}
        assert report.env_metrics["math"] == {k: v for k, v in report.metrics.items() if "/env/" not in k}
    else:
        assert set(report.env_tally) == {"math", "code"}
        for name in ("tokens_sampled", "tokens_masked", "samples_dropped", "rollouts_shipped"):
            assert sum(getattr(t, name) for t in report.env_tally.values()) == getattr(report.tally, name)


def test_an_id_refused_for_another_reason_stays_free_in_lenient_mode() -> None:
    """SPEC 3: an invalid rollout is set aside and everything else goes on. The second ``a`` follows
    one refused for its versions (and one refused for a mask value), so it is no duplicate: added
    alone, in one list, or replayed, it ships (the refused set aside in record order). Before, a
    batch held the refused one's id against it."""
    refused = [
        {"id": "a", "dispatch_version": 2, "completion_version": 1, "samples": [{"mask": [1]}]},
        {"id": "b", "dispatch_version": 0, "samples": [{"mask": [1, 2]}]},
    ]
    valid = [{"id": "a", "dispatch_version": 0, "samples": [{"mask": [1]}]}, rollout("b", 0)]
    records = [refused[0], refused[1], *valid]
    alone, together = sink(strict=False), sink(strict=False)
    for record in records:
        alone.add(record)
    together.add(records)
    replayed = replay([Event(line, "rollout", rollout=r) for line, r in enumerate(records, 1)] + [
        Event(5, "ship", step=3)], StalenessConfig(strict=False))[0]  # fmt: skip
    for shipment in (alone.ship(3), together.ship(3), replayed):
        assert [r.id for r in shipment.rollouts] == ["a", "b"]
        assert [error.field for error in shipment.invalid] == ["completion_version", "samples[0].mask[1]"]


@pytest.mark.parametrize("step_type", [int, np.int64, np.uint64])
def test_a_numpy_unsigned_step_ships_as_the_same_int_step(step_type: Any) -> None:
    # staleness 1 and 0 at step 5: within the bound (an unsigned step - bound used to wrap around)
    for call in ("ship", "sweep"):
        s = Sink(StalenessConfig(max_staleness=8))
        s.add([{"id": "a", "dispatch_version": 3, "samples": [{"mask": [1, 1]}]},
               {"id": "b", "dispatch_version": 4, "samples": [{"mask": [1, 1]}]}])  # fmt: skip
        if call == "sweep":
            s.sweep(step_type(5))
        shipment = s.ship(step_type(5))
        assert [r.id for r in shipment.rollouts] == ["a", "b"] and shipment.step == 5
        assert type(shipment.step) is int and shipment.metrics["staleness/rollout/dropped"] == 0


@pytest.mark.parametrize("strict", [True, False])
def test_a_batch_changed_by_its_caller_after_add_is_refused_by_name_and_leaves_the_queue(strict: bool) -> None:
    s = Sink(StalenessConfig(max_staleness=8, strict=strict))
    mask = np.ones(4, np.float32)
    s.add(RolloutBatch(ids=["x"], sample_offsets=np.array([0, 1]), position_offsets=np.array([0, 4]),
                       mask=mask, dispatch_version=np.array([3])))  # fmt: skip
    s.add({"id": "y", "dispatch_version": 4, "samples": [{"mask": [1]}]})
    mask[1] = 7.0  # a caller bug: the sink owns the arrays it was given
    if strict:
        with pytest.raises(TraceError) as found:
            s.ship(5)
        error = found.value
        assert s.step == 0  # refused before the step moved
        shipment = s.ship(5)
    else:
        shipment = s.ship(5)
        (error,) = shipment.invalid
        assert shipment.report.tally.rollouts_invalid == 1
    assert (error.rollout, error.field) == ("x", "samples[0].mask") and "position 1" in error.reason
    assert [r.id for r in shipment.rollouts] == ["y"] and s.queued == 0
    assert s.tokens_entered == 1  # x's positions never entered
    restored = Sink(StalenessConfig(max_staleness=8, strict=strict))
    restored.load_state_dict(s.state_dict())
    assert restored.queued == 0


def test_xtuner_grows_its_per_group_counts_by_doubling_and_saves_one_per_group_seen() -> None:
    """A new group each add (a run's usual rollout without group_id): amortised constant time, not a copy of
    every group's count per new group; the state still holds one count per group seen."""
    from staleness_metrics.engine.policies import XtunerPolicy

    policy, copies, owed = XtunerPolicy(1, retry_expired=True), 0, None
    for group in range(5000):
        policy.observe_added(np.array([group]))
        copies, owed = copies + (policy._owed is not owed), policy._owed
    assert copies <= 14  # log2(5000) ~ 12.3
    assert policy.state_dict() == {"owed": [0] * 5000}
    policy.load_state_dict({"owed": [0, 2, 1]})
    policy.observe_added(np.array([1, 4]))
    assert policy.state_dict() == {"owed": [0, 1, 1, 0, 0]}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("parse_failure_first", [True, False])
def test_one_add_refuses_its_records_in_record_order_whichever_check_finds_them(
    strict: bool, parse_failure_first: bool
) -> None:
    """SPEC 3: a record the parse refuses (a wrong type) and one only the columnar check refuses
    (a token version below -1) in one add: strict mode raises the first record's error, lenient
    mode sets both aside in record order and queues the rest."""
    wrong_type = rollout("wrong-type", 0, dispatch_version="1")
    bad_version = rollout("bad-version", 0, {"mask": [1, 1], "token_versions": [0, -2]})
    refused = [wrong_type, bad_version] if parse_failure_first else [bad_version, wrong_type]
    s = sink(strict=strict)
    records = [rollout("a", 0), *refused, rollout("b", 0)]
    expected = [("wrong-type", "dispatch_version"), ("bad-version", "samples[0].token_versions")]
    expected = expected if parse_failure_first else expected[::-1]
    if strict:
        with pytest.raises(TraceError) as raised:
            s.add(records)
        assert (raised.value.rollout_id, raised.value.field) == expected[0]
        assert s.queued == 0 and s.invalid == ()
    else:
        assert s.add(records) == 2
        assert [(error.rollout_id, error.field) for error in s.invalid] == expected
        shipment = s.ship(1)
        assert shipment.ids == ["a", "b"] and shipment.report.tally.rollouts_invalid == 2


# --- a ship interrupted (Ctrl-C) ----------------------------------------------------------------


def with_costs(rid: str, step: int, env: str) -> dict[str, Any]:
    """A rollout for ``step`` with one position at each lag 0..3 and the trainer's log-probs (a
    cost rising with the lag: SPEC 14's bound moves)."""
    trained = step - 1
    sample = {"mask": [1, 1, 1, 1], "token_versions": [trained - lag for lag in range(4)],
              "logprobs": [-1.0] * 4, "trainer_logprobs": [-0.99, -0.98, -0.7, -0.5]}  # fmt: skip
    return {"id": rid, "dispatch_version": trained - 3, "env": env, "samples": [sample]}


ADAPTIVE = {"max_staleness": 3, "floor_min_tokens": 1, "cost_window": 2, "mismatch_budget": 0.01,
            "adapt_every": 1, "adapt_low": 1, "adapt_high": 3, "env_breakdown": True}  # fmt: skip
INTERRUPTED_SHIPS = {  # policy, config, the rollouts before the interrupted ship(5), those before ship(6)
    "token": ("token", {"max_staleness": 1}, [rollout("a", 4), rollout("b", 2)], [rollout("c", 5)]),
    "held": (
        "xtuner", {"max_staleness": 1, "retry_expired": True},
        [rollout("old", 2, group_id="g"), rollout("new", 4, group_id="g"), rollout("solo", 4)],
        [rollout("retry", 5, group_id="g")],
    ),
    "costs": ("token", ADAPTIVE, [with_costs("a", 5, "math"), with_costs("b", 5, "code")],
              [with_costs("c", 6, "math")]),
}  # fmt: skip


def interrupt_once(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, when: Any = None) -> None:
    """The first call of ``owner.name`` (for which ``when(*args)`` holds) raises KeyboardInterrupt
    after it ran, as a Ctrl-C landing at its end."""
    real, fired = getattr(owner, name), []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        if not fired and (when is None or when(*args)):
            fired.append(True)
            raise KeyboardInterrupt
        return found

    monkeypatch.setattr(owner, name, interrupted)


@pytest.mark.parametrize("case", INTERRUPTED_SHIPS)
@pytest.mark.parametrize("at", ["compute_report", "leave"])
def test_a_ship_interrupted_by_ctrl_c_did_not_happen_and_the_next_one_ships_as_in_an_uninterrupted_run(
    case: str, at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC 6 conservation and a checkpoint that loads, whichever point of the ship a Ctrl-C reaches
    (its report computed, or its rollouts left the queue): the sink is as if only its sweep ran."""
    import staleness_metrics.engine.sink as sink_module
    from staleness_metrics.engine.queue import SHIPPED, RolloutQueue

    policy, config, before, after = INTERRUPTED_SHIPS[case]
    interrupted, reference = sink(policy, **config), sink(policy, **config)
    for s in (interrupted, reference):
        s.add(json.loads(json.dumps(before)))
    if at == "leave":  # (not a sweep's drops: the ship's own rollouts leaving)
        interrupt_once(monkeypatch, RolloutQueue, "leave", lambda queue, rows, status: status == SHIPPED)
    else:
        interrupt_once(monkeypatch, sink_module, "compute_report")
    with pytest.raises(KeyboardInterrupt):
        interrupted.ship(5)
    reference.sweep(5)
    assert interrupted.state_dict() == reference.state_dict()
    sink(policy, **config).load_state_dict(json.loads(json.dumps(interrupted.state_dict())))  # (conserved)
    shipments = []
    for s in (interrupted, reference):  # the new ones first: the batches of the others stay needed
        s.add(json.loads(json.dumps(after)))
        shipments += [s.ship(6, [record["id"] for record in after]), s.ship(7)]
    for shipment, same in zip(shipments[:2], shipments[2:]):
        assert (shipment.metrics, shipment.ids, shipment.held) == (same.metrics, same.ids, same.held)
    assert interrupted.state_dict() == reference.state_dict()
    totals = interrupted.totals
    assert interrupted.tokens_entered == totals.tokens_sampled + totals.tokens_dropped + interrupted.tokens_queued


def test_a_compaction_interrupted_by_ctrl_c_leaves_the_queue_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    from staleness_metrics.engine.queue import RolloutQueue

    s = Sink(StalenessConfig(max_staleness=4), compact_min_rows=4)
    s.add([rollout(f"a{i}", 1) for i in range(30)])
    interrupt_once(monkeypatch, RolloutQueue, "_repack_windows")  # (a compaction's last step)
    with pytest.raises(KeyboardInterrupt):
        s.ship(3, [f"a{i}" for i in range(20)])  # (it shipped: the queue compacts after)
    assert s.totals.rollouts_shipped == 20 and s.tokens_entered == s.totals.tokens_sampled + s.tokens_queued
    Sink(StalenessConfig(max_staleness=4)).load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert s.ship(4).ids == [f"a{i}" for i in range(20, 30)]
