"""Runs in prime-rl's current layout, written from verifiers' own objects, replayed by ``staleness-metrics replay``
and checked step by step against a computation of this file's own from what the simulation wrote (SPEC 6, 9,
11, 14), in every shape a run directory takes; and the live monitor against the replay of the same run."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
import threading
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.adapters.prime_rl_monitor import PrimeRlMonitor
from tests.support.prime_rl_sim import SimConfig, SimRun, simulate
from tests.support.prime_rl_writer import loss_masks

BOUND = 8
SMALL = SimConfig(steps=12, chunk_bytes=60_000, frame_bytes=8_000)  # rolling chunks, several frames each


def _bucket(lag: int) -> str:
    return str(lag) if lag <= 16 else "32" if lag <= 32 else "64" if lag <= 64 else "inf"


def _replay(root: Path, out: Path, bound: int = BOUND, *extra: str) -> dict[int, dict[str, Any]]:
    """``staleness-metrics replay ROOT --metrics-out OUT``: its rows by step (without the step key)."""
    cmd = [
        sys.executable,
        "-m",
        "staleness_metrics",
        "replay",
        str(root),
        "--max-staleness",
        str(bound),
        "--metrics-out",
        str(out),
        *extra,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return {row.pop("step"): row for row in map(json.loads, out.read_text().splitlines())}


def _expected(run: SimRun) -> dict[int, dict[str, Any]]:
    """Each ship's numbers from the simulation's own objects: SPEC 6 over the shipped live traces (every
    position unlabelled: lag = T - policy.start), SPEC 11 per lag bucket from the trainer's streams against
    the record's rounded sampler log-probabilities, and the stale drops of traces never shipped."""
    out: dict[int, dict[str, Any]] = {}
    for step, ids in run.shipped.items():
        r, f, q, tokens, lag_sum = [], [], [], 0, 0
        covered: dict[str, int] = defaultdict(int)
        k3: dict[str, float] = defaultdict(float)
        for episode_id in ids:
            episode = run.episodes[episode_id].episode
            policy = episode.run.work.policy  # type: ignore[union-attr]
            if policy is None:
                continue
            lag = (step - 1) - policy.start
            for trace in episode.traces:
                masks = loss_masks(trace)
                if not any(any(m) for m in masks.values()):
                    continue
                r.append(lag)
                f.append(min(lag, max(0, policy.end - policy.start)))
                q.append(r[-1] - f[-1])
                for branch, mask in masks.items():
                    sampler = trace.branches[branch].logprobs
                    stream = run.trainer_streams.get((trace.id, branch), [])
                    for position in (i for i, m in enumerate(mask) if m):
                        tokens += 1
                        lag_sum += lag
                        if position < len(stream) and stream[position] is not None:
                            d = max(-20.0, min(20.0, stream[position] - round(sampler[position], 4)))
                            covered[_bucket(lag)] += 1
                            k3[_bucket(lag)] += math.exp(d) - 1 - d
        row: dict[str, Any] = {
            "staleness/rollout/mean": sum(r) / len(r),
            "staleness/rollout/max": max(r),
            "staleness/rollout/in_flight/mean": sum(f) / len(f),
            "staleness/rollout/in_flight/max": max(f),
            "staleness/rollout/in_queue/mean": sum(q) / len(q),
            "staleness/rollout/in_queue/max": max(q),
            "staleness/token/mean": lag_sum / tokens,
            "staleness/token/masked": 0.0,
            "staleness/mismatch/coverage": sum(covered.values()) / tokens,
        }
        for bucket, count in covered.items():
            row[f"staleness/mismatch/lag_{bucket}/tokens"] = count
            row[f"staleness/mismatch/lag_{bucket}/k3"] = k3[bucket] / count
        out[step] = row
    for step in out:
        out[step]["staleness/rollout/dropped"] = 0
    for sim in run.episodes.values():  # never shipped, stale at arrival under BOUND: dropped at the next ship
        episode = sim.episode
        policy = episode.run.work.policy  # type: ignore[union-attr]
        shipped = any(episode.id in ids for ids in run.shipped.values())
        if sim.kind != "train" or shipped or policy is None or not episode.ok:
            continue
        if (sim.arrival_step - 1) - policy.start > BOUND:
            ship = min(s for s in out if s >= sim.arrival_step)
            out[ship]["staleness/rollout/dropped"] += len(episode.traces)
    return out


def _check(expected: dict[int, dict[str, Any]], replayed: dict[int, dict[str, Any]]) -> None:
    assert sorted(replayed) == sorted(expected)
    for step, row in expected.items():
        for key, value in row.items():
            got = replayed[step].get(key)
            assert got == pytest.approx(value, rel=1e-9, abs=1e-12), f"step {step} {key}: {got} != {value}"
        lags = {k for k in replayed[step] if k.startswith("staleness/mismatch/lag_") and k.endswith("/tokens")}
        assert lags == {k for k in row if k.endswith("/tokens")}, f"step {step}: lag buckets differ"


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(SMALL, id="rolling-sealed-chunks"),
        pytest.param(replace(SMALL, layout="single"), id="single-file"),
        pytest.param(replace(SMALL, end="abandon"), id="plain-last-chunk"),
        pytest.param(replace(SMALL, end="tear"), id="torn-last-line"),
        pytest.param(replace(SMALL, relaunch_at=7), id="relaunch"),
        pytest.param(
            replace(SMALL, relaunch_at=7, tear_at_relaunch=True, metric_prefix="staleness"),
            id="relaunch-after-torn-line",
        ),
    ],
)  # fmt: skip
def test_replay_equals_an_independent_computation(tmp_path: Path, config: SimConfig) -> None:
    run = simulate(tmp_path / "run", config)
    _check(_expected(run), _replay(tmp_path / "run", tmp_path / "m.jsonl"))


def test_replay_of_the_run_root_and_of_monitors_file_agree(tmp_path: Path) -> None:
    simulate(tmp_path / "run", replace(SMALL, steps=4))
    root = _replay(tmp_path / "run", tmp_path / "a.jsonl")
    assert root == _replay(tmp_path / "run" / "monitors" / "file", tmp_path / "b.jsonl")


def test_the_example_suggests_the_bound_of_its_drift_model(tmp_path: Path) -> None:
    """k3 of lag l is the floor times 1 + 0.3 l: the excess stays within the floor (the default budget) up
    to lag 3, and the lag-0 floor is measured on the first batch."""
    from tests.support.prime_rl_example import EXAMPLE, EXAMPLE_DIR

    rows = _replay(EXAMPLE_DIR, tmp_path / "m.jsonl")
    last = rows[EXAMPLE.steps]
    assert last["staleness/bound/suggested"] == EXAMPLE.suggested_bound == 3
    assert last["staleness/bound/crossed"] == 1
    assert rows[1]["staleness/mismatch/floor_source"] == "lag0"
    floor = rows[1]["staleness/mismatch/floor"]
    assert floor == pytest.approx(math.cosh(EXAMPLE.floor_sigma) - 1, rel=2e-3)
    for lag in range(1, 6):
        assert last[f"staleness/mismatch/curve/lag_{lag}"] == pytest.approx(0.3 * lag * floor, rel=0.02)


def _assert_same(live: dict[str, Any], replayed: dict[str, Any], step: int) -> None:
    assert set(live) == set(replayed), f"step {step}: keys differ: {set(live) ^ set(replayed)}"
    for key, value in replayed.items():
        if isinstance(value, str):
            assert live[key] == value, f"step {step} {key}"
        else:
            assert live[key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"step {step} {key}"


@pytest.mark.parametrize(("bound", "async_level"), [(BOUND, 2), (3, 2), (1, 3), (0, 4)])
def test_the_live_monitor_equals_the_replay(tmp_path: Path, bound: int, async_level: int) -> None:
    """Handed what prime-rl hands its monitors (verifiers episodes as they arrive and ship, the trainer's
    updates), the monitor's numbers are the replay's of the files written from the same calls; also under a
    bound below prime-rl's async level, where prime-rl trains on traces the sink dropped at their arrival
    (the ship ignores their ids, as the replay's; they were added again and refused as duplicates)."""
    live = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=bound)))
    simulate(tmp_path / "run", replace(SMALL, async_level=async_level), observers=[live])
    replayed = _replay(tmp_path / "run", tmp_path / "m.jsonl", bound)
    assert sorted(live.shipments) == sorted(replayed)
    for step, shipment in live.shipments.items():
        _assert_same({**shipment.metrics, **(live.monitor.mismatch_metrics(step) or {})}, replayed[step], step)


@pytest.mark.parametrize(
    ("config", "processes"),
    [
        pytest.param(replace(SMALL, async_level=4), 1, id="one-process"),
        pytest.param(replace(SMALL, async_level=4), 2, id="two-processes"),
        pytest.param(replace(SMALL, async_level=4, end="tear"), 2, id="torn-last-line"),
        pytest.param(replace(SMALL, async_level=4, relaunch_at=7, layout="single"), 2, id="relaunched-single-file"),
    ],
)
def test_what_if_reads_the_run_once_and_each_row_is_that_bounds_own_replay(
    tmp_path: Path, config: SimConfig, processes: int
) -> None:
    """The bounds run together over one read, each taking the never-shipped traces stale at arrival under
    it: every row and the curve are those of the bound replayed alone (a read of its own)."""
    from staleness_metrics.replay.what_if import what_if_with_curve

    simulate(tmp_path / "run", config)
    together = what_if_with_curve(tmp_path / "run", range(9), processes=processes)
    alone = [what_if_with_curve(tmp_path / "run", [bound], processes=1).rows[0] for bound in range(9)]
    curve_rows = [dataclasses.replace(row, excess_at_bound=None, within_budget=None, suggested=None,
                                      suggested_bound=None) for row in together.rows]  # fmt: skip
    assert curve_rows == [dataclasses.replace(row, excess_at_bound=None, within_budget=None, suggested=None,
                                              suggested_bound=None) for row in alone]  # fmt: skip
    dropped = [row.rollouts_dropped for row in together.rows]
    assert len(set(dropped)) > 2 and dropped == sorted(dropped, reverse=True), dropped  # the bound decides who enters
    assert together.curve == what_if_with_curve(tmp_path / "run", [8, 4], processes=1).curve


def test_what_if_of_a_damaged_run_raises_what_the_replay_of_a_bound_raises(tmp_path: Path) -> None:
    """One read feeds every bound: a line the strict reader refuses fails the what-if as it fails a replay."""
    from staleness_metrics.errors import EventError
    from staleness_metrics.replay.sources import read_run_events
    from staleness_metrics.replay.what_if import what_if_with_curve

    simulate(tmp_path / "run", replace(SMALL, layout="single", compress=False))
    (stream,) = (tmp_path / "run").rglob("stream.jsonl")
    lines = stream.read_bytes().splitlines(keepends=True)
    stream.write_bytes(b"".join([*lines[: len(lines) // 2], b"{not json\n", *lines[len(lines) // 2 :]]))
    with pytest.raises(EventError) as replayed:
        list(read_run_events(tmp_path / "run", max_staleness=0))
    for processes in (1, 2):
        with pytest.raises(EventError) as raised:
            what_if_with_curve(tmp_path / "run", range(9), processes=processes)
        assert str(raised.value) == str(replayed.value)


class _UpdatesPiecemeal:
    """A monitor handed each branch's trainer update in a call of its own, and with ``revised``, first a
    stream of wrong values the real one then replaces (a later write wins, as in prime-rl's files)."""

    def __init__(self, monitor: PrimeRlMonitor, *, revised: bool) -> None:
        self.monitor, self.revised = monitor, revised

    def __getattr__(self, name: str) -> Any:
        return getattr(self.monitor, name)

    def log_annotations(self, updates: list[dict[str, Any]]) -> Any:
        for update in updates:
            if not any("trainer_logprobs" in branch for branch in update.get("branches") or []):
                self.monitor.log_annotations([update])  # (the orchestrator's ship updates)
                continue
            for branch in update["branches"]:
                values = branch["trainer_logprobs"]
                if self.revised:
                    wrong = [None if v is None else v + 1.0 for v in values]
                    self.monitor.log_annotations([{**update, "branches": [{**branch, "trainer_logprobs": wrong}]}])
                self.monitor.log_annotations([{**update, "branches": [branch]}])
        return self.monitor.log_annotations([])


@pytest.mark.parametrize("revised", [False, True], ids=["one-branch-a-call", "revised-streams"])
def test_the_live_monitor_equals_the_replay_when_updates_come_piecemeal(tmp_path: Path, revised: bool) -> None:
    """A step's trainer updates spread over many calls (micro-batches, ranks, a rewrite) count in full."""
    live = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=BOUND)))
    simulate(tmp_path / "run", SMALL, observers=[_UpdatesPiecemeal(live, revised=revised)])
    replayed = _replay(tmp_path / "run", tmp_path / "m.jsonl")
    assert sorted(live.shipments) == sorted(replayed)
    for step in live.shipments:
        expected = {k: v for k, v in replayed[step].items() if k.startswith("staleness/mismatch/")}
        got = live.monitor.mismatch_metrics(step) or {}
        _assert_same({k: v for k, v in got.items() if k.startswith("staleness/mismatch/")}, expected, step)


def test_per_env_costs_of_piecemeal_updates_equal_the_replays(tmp_path: Path) -> None:
    """With the env breakdown, each env's SPEC 11 keys as the live monitor last published them (its JSON
    lines, one per call) equal the replay's, and so do the batch's."""
    from staleness_metrics.exporters.jsonl import JsonlExporter

    config = StalenessConfig(max_staleness=BOUND, env_breakdown=True)
    live = PrimeRlMonitor(StalenessMonitor(config, [JsonlExporter(tmp_path / "live.jsonl")]))
    simulate(tmp_path / "run", SMALL, observers=[_UpdatesPiecemeal(live, revised=True)])
    live.finalize()
    published: dict[int, dict[str, Any]] = defaultdict(dict)
    for row in map(json.loads, (tmp_path / "live.jsonl").read_text().splitlines()):
        published[row.pop("step")].update(row)
    replayed = _replay(tmp_path / "run", tmp_path / "m.jsonl", BOUND, "--env-breakdown")
    costs = 0
    for step, row in replayed.items():
        expected = {k: v for k, v in row.items() if "/mismatch/" in k}
        costs += sum(k.startswith("staleness/env/") for k in expected)
        _assert_same({k: v for k, v in published[step].items() if "/mismatch/" in k}, expected, step)
    assert costs > 0


def test_the_live_monitor_takes_dicts_and_ignores_what_is_not_its_business() -> None:
    """Episodes as plain records (``model_dump`` dicts), eval cohorts, metrics rows and the orchestrator's
    ship updates: only train episodes move the sink."""
    from tests.support.prime_rl_writer import NodeSpec, make_episode, make_trace

    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    live = PrimeRlMonitor(monitor)
    fresh = make_episode("a", [make_trace("a-t0", [NodeSpec(None, 2), NodeSpec(0, 1, (-0.5, -0.25))])],
                         env="gsm8k", step=4, policy=(3, 3), group="g")  # fmt: skip
    stale = make_episode("b", [make_trace("b-t0", [NodeSpec(None, 2), NodeSpec(0, 1, (-0.5,))])],
                         env="gsm8k", step=1, policy=(0, 1), group="g")  # fmt: skip
    evaluation = make_episode("c", [make_trace("c-t0", [NodeSpec(None, 2), NodeSpec(0, 1, (-0.5,))])],
                              env="gsm8k", step=4, policy=(3, 3), kind="eval")  # fmt: skip
    live.log([e.to_record() for e in (fresh, stale)], 5, "train", "all")
    live.log([evaluation], 5, "eval", "all")
    live.log({"off_policy/mean": 1.0}, 5)
    live.log_annotations([{"version": 1, "trace_id": "a-t0", "info": {"effective": True}, "branches": []}])
    live.log([fresh.model_dump(mode="json", exclude_none=True)], 5, "train", "effective")
    shipment = live.shipments[5]
    assert shipment.ids == ["a-t0"]
    assert shipment.metrics["staleness/rollout/dropped"] == 1  # b: (5 - 1) - 0 > 2, added at arrival
    assert shipment.metrics["staleness/rollout/mean"] == 1.0
    live.finalize()


def _two_episodes(step: int = 6) -> tuple[Any, Any]:
    """Two train episodes of one trace each (two sampled tokens after a 3-token prompt) arriving at
    ``step``: 'good' fresh, 'bad' stale at its arrival under the bound 0 (added then)."""
    from tests.support.prime_rl_writer import NodeSpec, make_episode, make_trace

    def one(name: str, start: int) -> Any:
        trace = make_trace(f"{name}-t0", [NodeSpec(None, 3), NodeSpec(0, 0, (-0.1, -0.2))])
        return make_episode(name, [trace], env="gsm8k", step=step, policy=(start, start), group="g")

    return one("good", step - 1), one("bad", step - 3)


def test_the_live_monitor_keeps_shipments_and_traces_keep_steps_back_and_forgets_what_the_sink_dropped() -> None:
    """A long run: ``shipments`` holds the last KEEP_STEPS steps (as the shipped traces), and a trace stale at
    its arrival, added then and dropped by the sink, is forgotten (not kept, nor checkpointed, for ever)."""
    from staleness_metrics.adapters.prime_rl_monitor import KEEP_STEPS
    from tests.support.prime_rl_writer import NodeSpec, make_episode, make_trace

    def one(name: str, step: int, start: int) -> Any:
        trace = make_trace(f"{name}-t0", [NodeSpec(None, 3), NodeSpec(0, 0, (-0.1, -0.2))])
        return make_episode(name, [trace], env="gsm8k", step=step, policy=(start, start), group=f"g{step}")

    live = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=0)))
    steps = range(4, 4 + KEEP_STEPS + 10)
    for step in steps:
        good, bad = one(f"good{step}", step, step - 1), one(f"bad{step}", step, step - 3)
        live.log([good, bad], step, "train", "all")  # bad: (step - 1) - (step - 3) > 0, added now
        live.log([good], step, "train", "effective")
        assert live.shipments[step].ids == [f"good{step}-t0"]
        assert live.shipments[step].dropped_rollouts == (f"bad{step}-t0",)
        assert live.state_dict()["prime_rl"]["added"] == {}
    assert sorted(live.shipments) == list(steps[-KEEP_STEPS - 1 :])
    live.finalize()


def _damaged(kind: str) -> Any:
    """The 'bad' episode, damaged as ``kind`` says (verifiers' own classes where they allow it)."""
    _, bad = _two_episodes()
    if kind == "episode id ''":
        return bad.model_copy(update={"id": ""})  # (verifiers accepts it)
    if kind == "trace id ''":
        bad.traces[0].id = ""
        return bad
    record = bad.to_record(float_decimals=4)
    nodes = record["traces"][0]["nodes"]
    if kind == "parents in a loop":  # (verifiers' to_record hangs on one: only a record carries it)
        nodes.append({**nodes[1], "parent": 1})
        nodes[0]["parent"] = 1
    else:
        nodes[1]["logprobs"] = [-0.1]  # one log-probability for two sampled tokens
    return record


@pytest.mark.parametrize("kind", ["episode id ''", "trace id ''", "parents in a loop", "logprobs too short"])
def test_the_live_monitor_sets_aside_once_what_cannot_be_a_rollout_and_ships_the_rest(kind: str) -> None:
    """Lenient, an episode that is none, or a trace that cannot be a rollout, is set aside and counted once
    (as the replay's line) though prime-rl hands it at arrival and at its ship; strict refuses it by name."""
    from staleness_metrics import TraceError

    good = _two_episodes()[0]
    live = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=0, strict=False)))
    live.log([good, _damaged(kind)], 6, "train", "all")
    live.log([good, _damaged(kind)], 6, "train", "effective")
    shipment = live.shipments[6]
    assert shipment.ids == ["good-t0"] and len(shipment.invalid) == 1
    assert live.monitor.sink.totals.rollouts_invalid == 1
    strict = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=0)))
    with pytest.raises(TraceError, match=r"episodes\[1\]|rollout 'bad-t0'"):
        strict.log([good, _damaged(kind)], 6, "train", "effective")


def test_a_sampler_logprob_lacking_a_value_is_uncovered_not_a_refusal() -> None:
    """SPEC 11: a null or non-finite sampler log-prob is uncovered, as a trainer one; the trace ships."""
    record = _two_episodes()[0].to_record(float_decimals=4)
    record["traces"][0]["nodes"][1]["logprobs"] = [None, float("-inf")]
    live = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=0)))
    live.log([record], 6, "train", "effective")
    assert live.shipments[6].ids == ["good-t0"] and live.shipments[6].invalid == ()


def test_the_live_monitor_sets_aside_under_the_monitors_lock() -> None:
    """A set-aside waits for the monitor's lock, as an add does (a scrape in another thread holds it)."""
    live = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=0, strict=False)))
    lock, release = live.monitor._lock, threading.Event()
    holder = threading.Thread(target=lambda: (lock.__enter__(), release.wait(), lock.__exit__()))
    holder.start()
    caller = threading.Thread(target=live.log, args=([_damaged("logprobs too short")], 6, "train", "effective"))
    caller.start()
    caller.join(0.5)
    assert live.monitor.sink.invalid == ()  # (waiting, as the ship after it)
    release.set()
    holder.join()
    caller.join(10)
    assert len(live.shipments[6].invalid) == 1 and live.monitor.sink.totals.rollouts_invalid == 1


def test_the_live_monitor_refuses_updates_it_cannot_read_by_name_and_lenient_counts_them() -> None:
    from staleness_metrics import TraceError

    bad_stream = {"trace_id": "good-t0", "branches": [{"index": 0, "trainer_logprobs": "-0.1"}]}
    nested = {"trace_id": "good-t0", "branches": [{"index": 0, "trainer_logprobs": [[-0.1], -0.2]}]}
    for update, field in [("x", "updates[0]"), (bad_stream, "updates[0].branches[0].trainer_logprobs"),
                          (nested, "updates[0].branches[0].trainer_logprobs")]:  # fmt: skip
        for strict in (True, False):
            live = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=0, strict=strict)))
            live.log([_two_episodes()[0]], 6, "train", "effective")
            if strict:
                with pytest.raises(TraceError) as refused:
                    live.log_annotations([update])
                assert refused.value.field == field
            else:
                live.log_annotations([update])
                assert live.updates_set_aside == 1


class _RestoredAfterEachCall:
    """A monitor checkpointed after every call prime-rl makes and restored into new objects (SPEC 13)."""

    def __init__(self, config: StalenessConfig) -> None:
        self.config, self.live, self.shipments = config, PrimeRlMonitor(StalenessMonitor(config)), {}

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            done = getattr(self.live, name)(*args)
            self.shipments.update(self.live.shipments)
            state = json.loads(json.dumps(self.live.state_dict()))
            self.live = PrimeRlMonitor(StalenessMonitor(self.config))
            self.live.load_state_dict(state)
            return done

        return call


def test_the_live_monitor_restored_after_every_call_continues_exactly(tmp_path: Path) -> None:
    """Traces added at arrival and shipped after a checkpoint, and trainer updates of traces shipped
    before it, count as without the checkpoint."""
    config = StalenessConfig(max_staleness=1)
    straight, restored = PrimeRlMonitor(StalenessMonitor(config)), _RestoredAfterEachCall(config)
    observers = [_UpdatesPiecemeal(straight, revised=True), _UpdatesPiecemeal(restored, revised=True)]  # type: ignore[arg-type]
    simulate(tmp_path / "run", replace(SMALL, steps=8), observers=observers)
    assert sorted(restored.shipments) == sorted(straight.shipments)
    for step, shipment in straight.shipments.items():
        assert restored.shipments[step].metrics == shipment.metrics
    assert sum(s.metrics["staleness/rollout/dropped"] for s in straight.shipments.values()) > 0
    costs = straight.monitor.state_dict()["mismatch"]  # SPEC 11's sums per step
    assert len(costs) > 2 and restored.live.monitor.state_dict()["mismatch"] == costs


def test_a_hostile_live_monitor_state_is_refused_by_key_path_and_changes_nothing() -> None:
    from staleness_metrics.errors import ConfigError

    good = _two_episodes()[0]
    live = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=0)))
    live.log([good], 6, "train", "effective")
    saved = json.loads(json.dumps(live.state_dict()))
    shorter = good.to_record(float_decimals=4)["traces"][0]
    shorter["nodes"][1] = {**shorter["nodes"][1], "mask": [True], "token_ids": [1], "logprobs": [-0.1]}
    for damage, path in [
        (lambda s: s.pop("prime_rl"), "prime_rl"),
        (lambda s: s["prime_rl"]["added"].update({"x": 1}), "prime_rl.added.x"),
        (lambda s: s["prime_rl"]["shipped"][0].__setitem__(4, "6"), "prime_rl.shipped[0][4]"),
        (lambda s: s["prime_rl"]["shipped"][0][8][0].update({"data": ["x"]}), "prime_rl.shipped[0][8][0].data"),
        (lambda s: s["prime_rl"]["shipped"][0].__setitem__(6, shorter), "prime_rl.shipped[0][6]"),
        (lambda s: s["prime_rl"]["shipped"][0].pop(), "prime_rl.shipped[0]"),
        (lambda s: s["sink"].pop("queue"), "sink.queue"),
    ]:
        state = json.loads(json.dumps(saved))
        damage(state)
        before = live.state_dict()
        with pytest.raises(ConfigError, match=f"^checkpoint: {re.escape(path)}:"):
            live.load_state_dict(state)
        assert json.dumps(live.state_dict()) == json.dumps(before)
