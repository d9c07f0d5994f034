"""SPEC 14 over whole runs: the adaptive bound walking down and up through real ships (and what it masks),
the live path counting a step once, checkpoints in the middle of an adaptation, and old checkpoints."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from staleness_metrics import ConfigError, Sink, StalenessConfig, StalenessMonitor
from staleness_metrics.monitor import MISMATCH_STEPS_KEPT
from staleness_metrics.state_checks import digests_of
from tests.metrics.test_bound import sums_of

COSTLY = (0.01, 0.02, 0.3, 0.5)  # d = trainer - sampler log-prob at lags 0, 1, 2, 3
CHEAP = (0.01, 0.02, 0.03, 0.04)


def k3(d: float) -> float:
    return math.exp(d) - 1 - d


def rollout(step: int, drift: tuple[float, ...], tag: str = "") -> dict[str, Any]:
    """One rollout for ``step`` (trains version T = step - 1) with one position at each lag 0..3."""
    trained = step - 1
    return {
        "id": f"r{step}{tag}",
        "dispatch_version": trained - 3,
        "samples": [
            {
                "mask": [1, 1, 1, 1],
                "token_versions": [trained, trained - 1, trained - 2, trained - 3],
                "logprobs": [-1.0] * 4,
                "trainer_logprobs": [-1.0 + d for d in drift],
            }
        ],
    }


ADAPTIVE = StalenessConfig(
    max_staleness=3, floor_min_tokens=1, cost_window=1, mismatch_budget=0.01, adapt_every=1, adapt_low=1, adapt_high=3
)


def test_the_adaptive_bound_walks_down_to_its_floor_and_up_to_its_ceiling() -> None:
    sink = Sink(ADAPTIVE)
    # Costly ships: the excess at lag 1 is k3(0.02) - k3(0.01) ~ 1.5e-4 <= budget 0.01, at lag 2 k3(0.3) - ... ~ 0.05
    # above it: suggested 1, crossed. The bound steps 3 -> 2 -> 1 and stays at 1 (= the suggestion, and adapt_low).
    used, masks, advice = [], [], []
    for step, drift in [(4, COSTLY), (5, COSTLY), (6, COSTLY), (7, COSTLY), (8, CHEAP), (9, CHEAP), (10, CHEAP)]:
        sink.add([rollout(step, drift)])
        shipment = sink.ship(step)
        metrics = shipment.metrics
        used.append(metrics["staleness/max_staleness"])
        masks.append(shipment.rollouts[0].record()["samples"][0]["mask"])
        advice.append((metrics["staleness/bound/suggested"], metrics["staleness/bound/crossed"]))
    assert advice[:4] == [(1, 1)] * 4
    # Cheap ships: every lag within budget, the suggestion (3, the largest lag seen) reaches the bound: one step up
    # each ship until adapt_high 3 holds it.
    assert advice[4:] == [(3, 0)] * 3
    assert used == [3, 2, 1, 1, 1, 2, 3]
    # Each ship was masked with the bound it reports: lags above it (positions 3, then 2 and 3) are masked.
    assert masks == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert sink.bound_tracker.bound == 3 and sink.policy.max_staleness == 3


def _two_ships_at_one_step(sink: Sink, checkpoint: bool = False) -> tuple[Sink, list[int]]:
    """Ship one of two rollouts of step 4 (the bound then moves 3 -> 2), then the other at step 4."""
    sink.add([rollout(4, COSTLY), rollout(4, COSTLY, "b")])
    assert sink.ship(4, ["r4"]).metrics["staleness/max_staleness"] == 3
    assert sink.bound_tracker.bound == 2
    if checkpoint:
        state = json.loads(json.dumps(sink.state_dict()))
        assert state["bound_moved_at"] == 4
        sink = Sink(sink.config)
        sink.load_state_dict(state)
    shipment = sink.ship(4)
    assert shipment.metrics["staleness/max_staleness"] == 2
    return sink, shipment.rollouts[0].record()["samples"][0]["mask"]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_ship_after_the_bound_moved_judges_again_what_it_takes(checkpoint: bool) -> None:
    """SPEC 4: a ship applies the policy to what it takes; SPEC 14: a new bound applies from the next ship.
    The second rollout was judged at step 4 (by the first ship's sweep) under bound 3: the second ship
    masks its lag-3 position under bound 2, also when it runs in a process resumed between the two."""
    sink, mask = _two_ships_at_one_step(Sink(ADAPTIVE), checkpoint)
    assert mask == [1, 1, 1, 0]
    assert sink.ship(5).report.tally.tokens_sampled == 0  # (nothing left behind)


def test_a_trainer_s_sums_that_move_the_bound_apply_from_the_next_ship_at_the_same_step() -> None:
    """The live path: the sweep judged the rollout at step 4 under bound 3; the trainer's sums of step 4 then
    move the bound to 2, and the ship at step 4 masks the lag-3 position it had let through."""
    sink = Sink(ADAPTIVE)
    record = rollout(4, COSTLY)
    del record["samples"][0]["trainer_logprobs"]  # (the costs come from the trainer, not the records)
    sink.add([record])
    sink.sweep(4)
    sink.observe_mismatch(4, sums_of({0: (100, 0.001), 1: (100, 0.005), 2: (100, 0.05)}), merge=True)
    assert sink.bound_tracker.bound == 2
    shipment = sink.ship(4)
    assert shipment.metrics["staleness/max_staleness"] == 2
    assert shipment.rollouts[0].record()["samples"][0]["mask"] == [1, 1, 1, 0]


def test_a_checkpoint_names_where_the_bound_moved_only_if_it_did_and_never_past_its_step() -> None:
    sink = Sink(StalenessConfig(max_staleness=3, floor_min_tokens=1))
    sink.add([rollout(4, COSTLY)])
    sink.ship(4)
    assert "bound_moved_at" not in sink.state_dict()
    state = json.loads(json.dumps(Sink(ADAPTIVE).state_dict()))
    state["bound_moved_at"] = 5
    state["digests"] = digests_of({k: v for k, v in state.items() if k != "digests"})
    with pytest.raises(ConfigError, match=r"bound_moved_at: 5 is above 0"):
        Sink(ADAPTIVE).load_state_dict(state)


def test_excess_at_bound_follows_the_bound_each_ship_used() -> None:
    sink = Sink(ADAPTIVE)
    floor = k3(0.01)
    for step, bound, lag in [(4, 3, 3), (5, 2, 2), (6, 1, 1)]:
        sink.add([rollout(step, COSTLY)])
        metrics = sink.ship(step).metrics
        assert metrics["staleness/max_staleness"] == bound
        # The curve is increasing here (no pooling): the excess at the bound is the raw excess of its lag.
        assert metrics["staleness/bound/excess_at_bound"] == pytest.approx(k3(COSTLY[lag]) - floor, rel=1e-9)
        assert metrics[f"staleness/mismatch/curve/lag_{lag}"] == metrics["staleness/bound/excess_at_bound"]


def test_adapt_every_counts_ships_with_a_curve_and_the_live_path_counts_a_step_once() -> None:
    config = StalenessConfig(
        max_staleness=8, floor_min_tokens=100, mismatch_budget=0.01, adapt_every=2, cost_window=1
    )  # fmt: skip
    crossed = sums_of({0: (100, 0.001), 1: (100, 0.005), 2: (100, 0.05)})  # suggested 1, crossed
    no_curve = sums_of({0: (100, 0.001), 1: (10, 0.005)})  # lag 1 lacks tokens: no curve, not counted
    with StalenessMonitor(config) as monitor:
        for step in range(1, 6):
            monitor.ship(step)
        monitor.record_mismatch(1, crossed)
        monitor.record_mismatch(1, crossed)  # another rank of step 1: the step counts once
        assert (monitor.sink.bound_tracker.bound, monitor.sink.bound_tracker.toward_change) == (8, 1)
        monitor.record_mismatch(2, no_curve)
        assert monitor.sink.bound_tracker.toward_change == 1
        monitor.record_mismatch(3, crossed)  # the second ship with a curve: one step toward 1
        assert (monitor.sink.bound_tracker.bound, monitor.sink.bound_tracker.toward_change) == (7, 0)
        assert monitor.ship(6).metrics["staleness/max_staleness"] == 7  # from the next ship on
        published = monitor.mismatch_metrics(3)
        assert published is not None and published["staleness/bound/excess_at_bound"] == pytest.approx(0.049)


def test_a_step_whose_sums_come_after_a_later_steps_counts_and_a_rank_adding_a_curve_counts_once() -> None:
    """The live path: step 2's sums come before step 1's (ranks finish out of order); each step with a curve
    counts once toward ``adapt_every``, the late one too, and a step whose first post had no curve counts
    at the post that gives it one. Before, a step below the latest counted one never counted."""
    config = StalenessConfig(max_staleness=8, floor_min_tokens=100, mismatch_budget=0.01, adapt_every=2)
    crossed = sums_of({0: (100, 0.001), 1: (100, 0.005), 2: (100, 0.05)})
    part = sums_of({0: (100, 0.001), 1: (10, 0.005)})  # lag 1 lacks tokens: no curve yet
    rest = sums_of({1: (90, 0.005), 2: (100, 0.05)})
    with StalenessMonitor(config) as monitor:
        for step in range(1, 5):
            monitor.ship(step)
        monitor.record_mismatch(2, crossed)
        monitor.record_mismatch(1, crossed)  # late: the second ship with a curve
        assert (monitor.sink.bound_tracker.bound, monitor.sink.bound_tracker.toward_change) == (7, 0)
        monitor.record_mismatch(3, part)
        monitor.record_mismatch(3, rest)  # the other rank: now a curve, counted once
        monitor.record_mismatch(3, sums_of({0: (1, 0.001)}))
        assert monitor.sink.bound_tracker.toward_change == 1
        state = json.loads(json.dumps(monitor.state_dict()))
    with StalenessMonitor(config) as resumed:
        resumed.load_state_dict(state)
        resumed.record_mismatch(3, sums_of({0: (1, 0.001)}))  # still counted once after a restart
        assert resumed.sink.bound_tracker.toward_change == 1


def test_excess_at_bound_of_live_sums_is_at_the_bound_their_ship_used() -> None:
    """Ship 2 goes out at bound 3 before step 1's sums move the bound to 2: step 2's posts publish the
    excess at 3, the same on every post (before: at the bound in force when each arrived)."""
    config = StalenessConfig(max_staleness=3, floor_min_tokens=100, mismatch_budget=0.01, adapt_every=1)
    costly = sums_of({0: (100, 0.001), 1: (100, 0.005), 2: (100, 0.02), 3: (100, 0.05)})
    with StalenessMonitor(config) as monitor:
        assert [monitor.ship(step).metrics["staleness/max_staleness"] for step in (1, 2)] == [3, 3]
        monitor.record_mismatch(1, costly)
        assert monitor.ship(3).metrics["staleness/max_staleness"] == 2
        for _ in range(2):
            monitor.record_mismatch(2, costly)
            published = monitor.mismatch_metrics(2)
            assert published is not None and published["staleness/bound/excess_at_bound"] == pytest.approx(0.049)
        state = json.loads(json.dumps(monitor.state_dict()))
    with StalenessMonitor(config) as resumed:  # the bound each ship used is in the checkpoint
        resumed.load_state_dict(state)
        resumed.record_mismatch(2, costly)
        published = resumed.mismatch_metrics(2)
        assert published is not None and published["staleness/bound/excess_at_bound"] == pytest.approx(0.049)


def _inputs(step: int) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The run of the checkpoint test: ships with records, and trainer sums for every third step."""
    drift = COSTLY if (step // 7) % 2 == 0 else CHEAP
    live = sums_of({0: (2, 0.0001), 1: (3, 0.0002), 2: (2, 0.04)}).to_dict() if step % 3 == 0 else None
    return [rollout(step, drift), rollout(step, CHEAP, "b")], live


def _run(monitor: StalenessMonitor, steps: range) -> list[dict[str, Any]]:
    out = []
    for step in steps:
        records, live = _inputs(step)
        monitor.add(records)
        shipment = monitor.ship(step)
        row: dict[str, Any] = {"metrics": dict(shipment.metrics), "batch": [r.record() for r in shipment.rollouts]}
        if live is not None:
            monitor.record_mismatch(step, live)
            row["live"] = monitor.mismatch_metrics(step)
        out.append(row)
    return out


def test_a_checkpoint_in_the_middle_of_an_adaptation_continues_identically() -> None:
    config = StalenessConfig(
        max_staleness=3, floor_min_tokens=2, cost_window=3, mismatch_budget=0.02, adapt_every=3, adapt_low=0,
        adapt_high=4, floor_max_age=2,
    )  # fmt: skip
    first = StalenessMonitor(config)
    _run(first, range(4, 12))
    tracker = first.sink.bound_tracker
    assert tracker.toward_change not in (0,), "the checkpoint must fall between two changes"
    state = json.loads(json.dumps(first.state_dict()))
    assert state["sink"]["bound"]["toward_change"] == tracker.toward_change
    resumed = StalenessMonitor(config)
    resumed.load_state_dict(state)
    assert resumed.sink.bound_tracker.state_dict() == tracker.state_dict()
    later = _run(first, range(12, 30))
    assert _run(resumed, range(12, 30)) == later
    bounds = [row["metrics"]["staleness/max_staleness"] for row in later]
    assert len(set(bounds)) > 1, "the bound moved after the checkpoint"
    first.close()
    resumed.close()


def test_a_checkpoint_from_before_the_tracker_still_loads() -> None:
    config = StalenessConfig(max_staleness=3, floor_min_tokens=1)
    sink = Sink(config)
    sink.add([rollout(4, COSTLY)])
    sink.ship(4)
    state = json.loads(json.dumps(sink.state_dict()))
    del state["bound"]
    state["digests"] = digests_of({k: v for k, v in state.items() if k != "digests"})  # as an old version wrote it
    fresh = Sink(config)
    fresh.load_state_dict(state)
    assert fresh.step == 4 and fresh.bound_tracker.window == [] and fresh.bound_tracker.last_lag0 is None
    fresh.add([rollout(5, COSTLY)])
    assert fresh.ship(5).metrics["staleness/mismatch/floor_source"] == "lag0"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["bound"].update(bound=9), r"bound\.bound: 9 is outside adapt_low\.\.adapt_high 1\.\.3"),
        (lambda s: s["bound"].update(toward_change=1), r"bound\.toward_change: 1 is above 0"),
        (lambda s: s["bound"]["window"][0].__setitem__(0, 0), r"bound\.window\[0\]\[0\]: 0 is below 1"),
        (lambda s: s["bound"]["window"][0][1]["lags"]["1"].update(sum_k3=-1.0), r"bound\.window\[0\]\[1\].*sum_k3"),
        (lambda s: s["bound"].update(last_lag0=[float("nan"), 4]), r"bound\.last_lag0\[0\]: expected a finite"),
        (lambda s: s["bound"].update(format=7), r"bound\.format: unknown format 7"),
    ],
)
def test_a_bad_tracker_state_is_refused_by_key_and_changes_nothing(change: Any, message: str) -> None:
    sink = Sink(ADAPTIVE)
    for step in (4, 5):
        sink.add([rollout(step, COSTLY)])
        sink.ship(step)
    state = json.loads(json.dumps(sink.state_dict()))
    change(state)
    before = sink.bound_tracker.state_dict()
    with pytest.raises(ConfigError, match=message):
        sink.load_state_dict(state)
    assert sink.bound_tracker.state_dict() == before and sink.policy.max_staleness == 1


def test_an_adapted_bound_does_not_load_into_a_config_without_adaptation() -> None:
    sink = Sink(ADAPTIVE)
    sink.add([rollout(4, COSTLY)])
    sink.ship(4)
    state = sink.state_dict()
    plain = Sink(StalenessConfig(max_staleness=3, floor_min_tokens=1, cost_window=1, mismatch_budget=0.01))
    with pytest.raises(ConfigError, match=r"bound\.bound: adapted to 2, but this config has max_staleness=3"):
        plain.load_state_dict(state)


def test_live_sums_given_per_env_report_each_env_under_its_prefix_and_add_to_the_batch() -> None:
    config = StalenessConfig(max_staleness=8, floor_min_tokens=100, env_breakdown=True, mismatch_budget=0.004)
    math_sums = sums_of({0: (100, 0.001), 1: (100, 0.003), 2: (100, 0.009)})
    code_sums = sums_of({0: (100, 0.002), 1: (100, 0.003)})
    with StalenessMonitor(config) as monitor:
        monitor.ship(1)
        monitor.ship(2)
        monitor.record_mismatch(1, math_sums, env="math")
        monitor.record_mismatch(2, math_sums, env="math")
        monitor.record_mismatch(2, code_sums, env="code")
        keys = monitor.mismatch_metrics(2)
        assert keys is not None
        # code: floor 0.002 (its own lag 0), curve lag 1 = 0.001 <= budget 0.004: suggested 1, not crossed
        assert keys["staleness/env/code/mismatch/floor"] == 0.002
        assert keys["staleness/env/code/mismatch/curve/lag_1"] == pytest.approx(0.001)
        assert (keys["staleness/env/code/bound/suggested"], keys["staleness/env/code/bound/crossed"]) == (1, 0)
        # the batch: both envs' sums of step 2 merged (lag 0: 200 tokens of k3 0.0015)
        assert keys["staleness/mismatch/lag_0/tokens"] == 200
        assert keys["staleness/mismatch/floor"] == pytest.approx(0.0015, rel=1e-12)
        state = json.loads(json.dumps(monitor.state_dict()))
        assert set(state["sink"]["bound_envs"]) == {"math", "code"}
        resumed = StalenessMonitor(config)
        resumed.load_state_dict(state)
        # more sums of math at step 2 merge with what it had: its window holds steps 1 and 2 (merged)
        monitor.record_mismatch(2, math_sums, env="math")
        resumed.record_mismatch(2, math_sums, env="math")
        assert resumed.mismatch_metrics(2) == monitor.mismatch_metrics(2)
        assert resumed.mismatch_metrics(2)["staleness/env/math/mismatch/lag_2/tokens"] == 200  # type: ignore[index]
        with pytest.raises(ValueError, match="env: expected a non-empty env name"):
            monitor.record_mismatch(2, math_sums, env="")
        resumed.close()


def test_live_env_totals_are_kept_by_step_as_the_batch_total_however_many_envs() -> None:
    """docs/bound.md "Per env": one call per env and rank. Each env's step total is kept as long as the
    batch-wide one (the last MISMATCH_STEPS_KEPT steps), not the last that many (step, env) pairs: a rank's
    late sums merge with the earlier rank's, and so across a checkpoint."""
    config = StalenessConfig(max_staleness=8, floor_min_tokens=100, env_breakdown=True)
    rank = sums_of({0: (100, 0.001)})
    envs = [f"env{i:02d}" for i in range(64)]
    steps = MISMATCH_STEPS_KEPT // len(envs) + 1  # more (step, env) pairs than steps kept
    with StalenessMonitor(config) as monitor:
        for step in range(1, steps + 1):
            monitor.ship(step)
            for env in envs:  # rank 0
                monitor.record_mismatch(step, rank, env=env)
        state = json.loads(json.dumps(monitor.state_dict()))
        assert len(state["env_mismatch"]) == steps * len(envs)
        resumed = StalenessMonitor(config)
        resumed.load_state_dict(state)
        for live in (monitor, resumed):
            live.record_mismatch(1, rank, env="env00")  # rank 1, after every later step
            keys = live.mismatch_metrics(1)
            assert keys is not None and keys["staleness/mismatch/lag_0/tokens"] == 100 * (len(envs) + 1)
            assert keys["staleness/env/env00/mismatch/lag_0/tokens"] == 200
        resumed.close()
    # one step of more envs than steps kept: every env's second rank merges with its first
    with StalenessMonitor(config) as monitor:
        monitor.ship(1)
        many = [f"e{i:04d}" for i in range(MISMATCH_STEPS_KEPT + 1)]
        totals = [monitor.record_mismatch(1, rank, env=env) for _ in range(2) for env in many]
        assert totals[-1].covered == 2 * 100 * len(many)
        keys = monitor.mismatch_metrics(1)
        assert keys is not None and keys[f"staleness/env/{many[-1]}/mismatch/lag_0/tokens"] == 200
        assert [int(sums.tokens[0]) for _, sums in monitor.sink.env_trackers[many[0]].window] == [200]
