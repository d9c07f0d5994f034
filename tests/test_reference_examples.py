"""Pins the SPEC reference (tests/reference/spec_reference.py) to hand-computed examples.

The cross-check against ``staleness-metrics replay`` is only as good as the reference, so every number
here was worked out by hand from SPEC.md (and the prime-rl arithmetic quoted in issue #2).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tests.reference.spec_reference import (
    ReferenceEventError,
    ReferenceTraceError,
    replay_reference,
    replay_reference_lines,
)
from tests.reference.streams import random_stream


def rollout(rid: str, dispatch: int | None, *samples: dict[str, Any], **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"id": rid, **fields}
    if dispatch is not None:
        record["dispatch_version"] = dispatch
    record["samples"] = list(samples) or [{"mask": [1, 1]}]
    return {"type": "rollout", "rollout": record}


def ship(step: int, ids: list[str] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "ship", "step": step}
    if ids is not None:
        event["ids"] = ids
    return event


def sweep(step: int) -> dict[str, Any]:
    return {"type": "sweep", "step": step}


# ---------------------------------------------------------------------------------------------- prime-rl


@pytest.mark.parametrize(
    ("dispatch", "completion", "expected"),
    [
        (3, 3, (1, 0, 1)),
        (3, 5, (1, 1, 0)),  # completion above T is valid
        (3, 6, (1, 1, 0)),  # in-flight clipped to R
        (4, 4, (0, 0, 0)),
    ],
)
def test_prime_rl_episode_arithmetic_at_step_5(dispatch: int, completion: int, expected: tuple[int, int, int]) -> None:
    events = [rollout("a", dispatch, completion_version=completion), ship(5)]
    (metrics,), _ = replay_reference(events, policy="episode", max_staleness=8)
    got = (
        metrics["staleness/rollout/max"],
        metrics["staleness/rollout/in_flight/max"],
        metrics["staleness/rollout/in_queue/max"],
    )
    assert got == expected
    assert metrics["staleness/rollout/mean"] == float(expected[0])
    assert metrics["staleness/token/mean"] == float(expected[0])
    assert metrics["staleness/token/unlabelled"] == 1.0


def test_prime_rl_episode_arithmetic_at_step_10() -> None:
    (metrics,), _ = replay_reference([rollout("a", 2, completion_version=7), ship(10)], policy="episode")
    assert metrics["staleness/rollout/max"] == 7
    assert metrics["staleness/rollout/in_flight/max"] == 5
    assert metrics["staleness/rollout/in_queue/max"] == 2
    assert metrics["staleness/rollout/in_flight/mean"] == 5.0


def test_prime_rl_episode_drop_at_step_12_with_bound_8() -> None:
    events = [rollout("old", 2), rollout("edge", 3), ship(12)]
    (metrics,), (batch,) = replay_reference(events, policy="episode", max_staleness=8)
    assert batch["dropped_rollouts"] == ["old"]
    assert batch["dropped_samples"] == [["old", 0]]
    assert [r["id"] for r in batch["shipped"]] == ["edge"]
    assert metrics["staleness/rollout/dropped"] == 1
    assert metrics["staleness/sample/dropped"] == 1
    assert metrics["staleness/rollout/max"] == 8  # staleness exactly 8 trains
    assert metrics["staleness/max_staleness"] == 8


def test_episode_uses_each_rollouts_own_dispatch_not_its_groups() -> None:
    events = [rollout("old", 0, group_id="g"), rollout("new", 3, group_id="g"), ship(4)]
    (_metrics,), (batch,) = replay_reference(events, policy="episode", max_staleness=2)
    assert batch["dropped_rollouts"] == ["old"]
    assert [r["id"] for r in batch["shipped"]] == ["new"]


# ---------------------------------------------------------------------------------------------- token policy


def test_token_bound_trains_and_stale_position_is_zeroed_in_all_four_arrays() -> None:
    # step 6 -> T = 5, max_staleness 2 -> B = 3: version 3 (staleness 2) trains, version 2 is masked.
    sample = {
        "mask": [0, 1, 1, 1],
        "token_versions": [2, 3, 2, 4],
        "rl_weights": [0.0, 1.0, 0.5, 2.0],
        "ce_weights": [1.0, 1.0, 1.0, 1.0],
        "ref_kl_weights": [0.5, 0.5, 0.5, 0.5],
    }
    (metrics,), (batch,) = replay_reference([rollout("a", 2, sample), ship(6)], policy="token", max_staleness=2)
    (shipped,) = batch["shipped"]
    out = shipped["samples"][0]
    assert out["mask"] == [0, 1, 0, 1]
    assert out["rl_weights"] == [0.0, 1.0, 0.0, 2.0]
    assert out["ce_weights"] == [1.0, 1.0, 0.0, 1.0]  # the mask-0 position keeps its ce weight
    assert out["ref_kl_weights"] == [0.5, 0.5, 0.0, 0.5]
    assert out["token_versions"] == [2, 3, 2, 4]
    # sampled positions: staleness 2, 3, 1 (the mask-0 label is not a sampled position)
    assert metrics["staleness/token/mean"] == pytest.approx(2.0)
    assert metrics["staleness/token/masked"] == pytest.approx(1 / 3)
    assert metrics["staleness/token/unlabelled"] == 0.0
    assert (metrics["staleness/token/p50"], metrics["staleness/token/p90"]) == (2, 3)
    assert metrics["staleness/rollout/max"] == 3  # R includes masked positions
    assert metrics["staleness/sample/dropped"] == 0


def test_unlabelled_positions_take_the_dispatch_version() -> None:
    # Spans start at 2: positions 0-1 are unlabelled (dispatch 1), 2-3 have version 4, 4 is -1.
    sample = {"mask": [1, 1, 1, 1, 1], "weight_versions": [[4, 2], [-1, 4]]}
    (metrics,), (batch,) = replay_reference([rollout("a", 1, sample), ship(6)], policy="token", max_staleness=3)
    # T = 5, B = 2: unlabelled positions are version 1 -> staleness 4 -> masked; version 4 trains.
    assert batch["shipped"][0]["samples"][0]["mask"] == [0, 0, 1, 1, 0]
    assert metrics["staleness/token/unlabelled"] == pytest.approx(3 / 5)
    assert metrics["staleness/token/mean"] == pytest.approx((4 + 4 + 1 + 1 + 4) / 5)
    # completion defaults to the newest sampled version (4): R = 4, F = 4 - 1 = 3, Q = 1
    assert metrics["staleness/rollout/in_flight/max"] == 3
    assert metrics["staleness/rollout/in_queue/max"] == 1


def test_token_sample_and_rollout_drops() -> None:
    stale = {"mask": [1, 1], "token_versions": [0, 0]}
    fresh_and_stale = {"mask": [1, 1], "token_versions": [0, 5]}
    nothing_to_train = {"mask": [1, 1], "token_versions": [0, 0], "rl_weights": [0.0, 0.0]}
    ce_on_prompt = {"mask": [0, 1], "token_versions": [0, 0], "ce_weights": [1.0, 0.0]}
    events = [
        rollout("a", 0, stale, fresh_and_stale, nothing_to_train, ce_on_prompt),
        rollout("b", 0, stale, stale),
        ship(7),
    ]
    (metrics,), (batch,) = replay_reference(events, policy="token", max_staleness=2)
    assert sorted(batch["dropped_samples"]) == [["a", 0], ["b", 0], ["b", 1]]
    assert batch["dropped_rollouts"] == ["b"]
    (shipped,) = batch["shipped"]
    # a sample with nothing to train as it arrived is never dropped; a mask-0 ce weight still trains
    assert [s["mask"] for s in shipped["samples"]] == [[0, 1], [0, 0], [0, 0]]
    assert shipped["samples"][2]["ce_weights"] == [1.0, 0.0]
    assert metrics["staleness/sample/dropped"] == 3
    assert metrics["staleness/rollout/dropped"] == 1


def test_masking_is_monotonic_and_sweep_drops_count_in_the_next_ship() -> None:
    sample = {"mask": [1, 1, 1], "token_versions": [1, 2, 3]}
    events = [
        rollout("a", 1, sample),
        rollout("b", 1, {"mask": [1], "token_versions": [1]}),
        sweep(5),  # T = 4, B = 2: version 1 masked; b dropped
        sweep(5),  # changes nothing
        ship(6, ids=["nobody"]),  # names nothing: still reports the window's drops
        ship(6),  # T = 5, B = 3: versions 1 and 2 masked now
    ]
    metrics, batches = replay_reference(events, policy="token", max_staleness=2)
    assert metrics[0]["staleness/rollout/dropped"] == 1
    assert metrics[0]["staleness/sample/dropped"] == 1
    assert "staleness/rollout/mean" not in metrics[0]  # empty population: key left out
    assert "staleness/token/mean" not in metrics[0]
    assert batches[0]["shipped"] == []
    assert metrics[1]["staleness/rollout/dropped"] == 0  # its own window
    assert batches[1]["shipped"][0]["samples"][0]["mask"] == [0, 0, 1]
    assert metrics[1]["staleness/token/masked"] == pytest.approx(2 / 3)


def test_quantiles_are_nearest_rank() -> None:
    # 10 sampled positions, staleness 0..9: p50 = 5th smallest (4), p90 = 9th (8), p99 = 10th (9).
    sample = {"mask": [1] * 10, "token_versions": list(range(9, -1, -1))}
    (metrics,), _ = replay_reference([rollout("a", 0, sample), ship(10)], policy="token", max_staleness=20)
    assert (
        metrics["staleness/token/p50"],
        metrics["staleness/token/p90"],
        metrics["staleness/token/p99"],
    ) == (
        4,
        8,
        9,
    )


# ---------------------------------------------------------------------------------------------- frozen


@pytest.mark.parametrize("policy", ["token", "episode", "group", "xtuner"])
def test_frozen_rollouts_are_never_masked_dropped_or_counted(policy: str) -> None:
    frozen_sample = {"mask": [1, 1], "token_versions": [0, 0]}
    events = [
        rollout("frozen", 0, frozen_sample, source="frozen", group_id="g"),
        rollout("live", 9, group_id="g"),
        ship(10),
    ]
    (metrics,), (batch,) = replay_reference(events, policy=policy, max_staleness=0)
    assert sorted(r["id"] for r in batch["shipped"]) == ["frozen", "live"]
    frozen = next(r for r in batch["shipped"] if r["id"] == "frozen")
    assert frozen["samples"][0]["mask"] == [1, 1]
    assert metrics["staleness/rollout/max"] == 0  # only the live rollout counts
    assert metrics["staleness/token/mean"] == 0.0
    assert metrics["staleness/rollout/dropped"] == 0


# ---------------------------------------------------------------------------------------------- group


def test_group_drops_fresh_members_and_keeps_frozen_ones() -> None:
    events = [
        rollout("old", 1, group_id="g"),
        rollout("fresh", 5, group_id="g"),
        rollout("frozen", None, source="frozen", group_id="g"),
        rollout("alone", 3),
        ship(6),  # T = 5, bound 2: group version 1 -> 4 > 2 -> drop; alone: 2 -> trains
    ]
    (metrics,), (batch,) = replay_reference(events, policy="group", max_staleness=2)
    assert sorted(batch["dropped_rollouts"]) == ["fresh", "old"]
    assert sorted(r["id"] for r in batch["shipped"]) == ["alone", "frozen"]
    assert metrics["staleness/rollout/dropped"] == 2


def test_group_drop_reaches_members_the_ship_did_not_name() -> None:
    events = [rollout("old", 1, group_id="g"), rollout("fresh", 5, group_id="g"), ship(6, ids=["fresh"])]
    (metrics,), (batch,) = replay_reference(events, policy="group", max_staleness=2)
    assert sorted(batch["dropped_rollouts"]) == ["fresh", "old"]
    assert batch["shipped"] == []
    assert metrics["staleness/rollout/dropped"] == 2


# ---------------------------------------------------------------------------------------------- xtuner


def test_xtuner_thresholds_scale_with_sync_interval() -> None:
    # k = 2, max_staleness 1 -> S = 4; max_token_staleness 0 -> S_tok = 2. Step 7 -> T = 6.
    partly = {"mask": [1, 1, 1], "token_versions": [4, 5, 6]}  # seq staleness 2 < 4; version 4 masked
    old = {"mask": [1], "token_versions": [2]}  # seq staleness 4 >= S: expires
    events = [rollout("partly", 4, partly), rollout("old", 2, old), ship(7)]
    options: dict[str, Any] = {
        "policy": "xtuner",
        "max_staleness": 1,
        "max_token_staleness": 0,
        "sync_interval": 2,
    }
    (metrics,), (batch,) = replay_reference(events, **options)
    assert batch["dropped_rollouts"] == ["old"]
    assert batch["shipped"][0]["samples"][0]["mask"] == [0, 1, 1]  # partly masked: does not expire
    assert metrics["staleness/token/masked"] == pytest.approx(1 / 3)


def test_xtuner_labels_on_mask_0_positions_count_for_sequence_staleness() -> None:
    sample = {"mask": [0, 1], "token_versions": [0, 5]}
    (metrics,), (batch,) = replay_reference([rollout("a", 5, sample), ship(6)], policy="xtuner", max_staleness=3)
    assert batch["dropped_rollouts"] == ["a"]  # T - 0 = 5 >= (3 + 1) * 1
    assert metrics["staleness/sample/dropped"] == 1


def test_xtuner_token_masking_of_every_sampled_position_expires_the_sample() -> None:
    events = [
        rollout("a", 3, {"mask": [1, 1], "token_versions": [3, 3]}, group_id="g"),
        rollout("b", 5, group_id="g"),
        ship(6),  # T = 5: staleness 2 >= S_tok = 2 on every position -> a expires -> group dropped
    ]
    (metrics,), (batch,) = replay_reference(events, policy="xtuner", max_staleness=5, max_token_staleness=1)
    assert sorted(batch["dropped_rollouts"]) == ["a", "b"]
    assert metrics["staleness/sample/dropped"] == 2


def test_xtuner_agentic_group_is_never_token_masked() -> None:
    events = [
        rollout("a", 3, {"mask": [1, 1], "token_versions": [3, 3]}, group_id="g"),
        rollout("b", 5, group_id="g", agentic=True),
        ship(6),
    ]
    (metrics,), (batch,) = replay_reference(events, policy="xtuner", max_staleness=5, max_token_staleness=1)
    assert batch["dropped_rollouts"] == []
    assert metrics["staleness/token/masked"] == 0.0


def test_xtuner_retry_holds_the_group_until_re_rollouts_arrive() -> None:
    options: dict[str, Any] = {"policy": "xtuner", "max_staleness": 1, "retry_expired": True}
    events = [
        rollout("old", 1, group_id="g"),
        rollout("fresh", 4, group_id="g"),
        rollout("frozen", None, source="frozen", group_id="g"),
        rollout("other", 4),
        ship(5),  # T = 4, S = 2: old (3) expires; fresh and frozen are held; other ships
        ship(6, ids=["fresh"]),  # still owed one re-rollout: held again, counted again
        rollout("old-retry", 5, group_id="g"),
        ship(6),  # paid back: the group ships (fresh: T - 4 = 1 < 2)
    ]
    metrics, batches = replay_reference(events, **options)
    assert batches[0]["dropped_rollouts"] == ["old"]
    assert sorted(batches[0]["held"]) == ["fresh", "frozen"]
    assert [r["id"] for r in batches[0]["shipped"]] == ["other"]
    assert metrics[0]["staleness/rollout/held"] == 2
    assert batches[1]["held"] == ["fresh"]
    assert metrics[1]["staleness/rollout/held"] == 1
    assert sorted(r["id"] for r in batches[2]["shipped"]) == ["fresh", "frozen", "old-retry"]
    assert metrics[2]["staleness/rollout/held"] == 0


def test_xtuner_without_retry_drops_the_whole_group() -> None:
    events = [rollout("old", 1, group_id="g"), rollout("fresh", 4, group_id="g"), ship(5)]
    (metrics,), (batch,) = replay_reference(events, policy="xtuner", max_staleness=1)
    assert sorted(batch["dropped_rollouts"]) == ["fresh", "old"]
    assert metrics["staleness/rollout/held"] == 0


# ---------------------------------------------------------------------------------------------- errors


def test_strict_errors_name_line_rollout_and_field() -> None:
    events = [rollout("a", 0), rollout("b", 0, {"mask": [1, 1], "rl_weights": [1.0]}), ship(1)]
    with pytest.raises(ReferenceTraceError) as caught:
        replay_reference(events)
    assert str(caught.value) == "line 2: rollout 'b': field samples[0].rl_weights: wrong length"


def test_versions_above_t_are_accepted_by_sweeps_and_rejected_by_ships() -> None:
    events = [rollout("a", 0, {"mask": [1], "token_versions": [3]}), sweep(2), ship(3)]
    with pytest.raises(ReferenceTraceError) as caught:
        replay_reference(events)
    assert (caught.value.line, caught.value.rollout_id) == (3, "a")
    metrics, batches = replay_reference(events, lenient=True)  # set aside, everything else goes on
    assert batches[0]["shipped"] == [] and metrics[0]["staleness/rollout/dropped"] == 0


def test_completion_above_t_is_valid_at_ship() -> None:
    (metrics,), _ = replay_reference([rollout("a", 0, completion_version=9), ship(2)])
    assert metrics["staleness/rollout/in_flight/max"] == 1


@pytest.mark.parametrize(
    "lines",
    [
        ['{"type": "ship", "step": 3}', '{"type": "ship", "step": 2}'],
        ['{"type": "ship", "step": 3}', "{not json"],
        ['{"type": "ship", "step": 3}', '{"type": "train", "step": 4}'],
    ],
)
@pytest.mark.parametrize("lenient", [False, True])
def test_malformed_event_lines_fail_in_either_mode(lines: list[str], lenient: bool) -> None:
    with pytest.raises(ReferenceEventError) as caught:
        replay_reference_lines(lines, lenient=lenient)
    assert caught.value.line == 2


# ---------------------------------------------------------------------------------------------- conservation


def _sampled(sample: dict[str, Any]) -> int:
    return sum(int(x) for x in sample["mask"])


@pytest.mark.parametrize("policy", ["token", "episode", "group", "xtuner"])
def test_conservation_and_batches_agree_with_metrics(policy: str) -> None:
    """Every live sampled position is trained, masked, dropped or still queued, exactly once."""
    for seed in range(40):
        config, events = random_stream(seed, policy)
        metrics, batches = replay_reference(events, **config.reference_options())
        added = {e["rollout"]["id"]: e["rollout"] for e in events if e["type"] == "rollout"}
        live = {rid for rid, r in added.items() if r.get("source", "live") == "live"}
        total = sum(_sampled(s) for rid in live for s in added[rid]["samples"])
        dropped_pairs: Counter[tuple[str, int]] = Counter()
        shipped_ids: Counter[str] = Counter()
        trained = masked = dropped = 0
        for line, batch in zip(metrics, batches, strict=True):
            dropped_pairs.update((rid, i) for rid, i in batch["dropped_samples"])
            dropped += sum(_sampled(added[rid]["samples"][i]) for rid, i in batch["dropped_samples"])
            assert line["staleness/sample/dropped"] == len(batch["dropped_samples"])
            assert line["staleness/rollout/dropped"] == len(batch["dropped_rollouts"])
            assert line["staleness/rollout/held"] == len(batch["held"])
            window_sampled = window_masked = 0
            for shipped in batch["shipped"]:
                rid = shipped["id"]
                shipped_ids[rid] += 1
                kept = [i for i in range(len(added[rid]["samples"])) if (rid, i) not in dropped_pairs]
                assert len(kept) == len(shipped["samples"])
                for i, out in zip(kept, shipped["samples"], strict=True):
                    arrived = [int(x) for x in added[rid]["samples"][i]["mask"]]
                    now = out["mask"]
                    assert all(n <= a for n, a in zip(now, arrived, strict=True))  # only sampled positions get masked
                    if rid not in live:
                        assert now == arrived  # frozen rollouts are never masked
                    if rid in live:
                        window_sampled += sum(arrived)
                        window_masked += sum(a - n for a, n in zip(arrived, now, strict=True))
            if window_sampled:
                assert line["staleness/token/masked"] == pytest.approx(window_masked / window_sampled)
            trained += window_sampled - window_masked
            masked += window_masked
        assert max(dropped_pairs.values(), default=1) == 1 and max(shipped_ids.values(), default=1) == 1
        gone = set(shipped_ids) | {rid for batch in batches for rid in batch["dropped_rollouts"]}
        queued = sum(
            _sampled(s)
            for rid in live - gone
            for i, s in enumerate(added[rid]["samples"])
            if (rid, i) not in dropped_pairs
        )
        assert trained + masked + dropped + queued == total
