"""SPEC 13: a monitor saved and loaded elsewhere continues exactly like one never stopped.

Held groups, the open window, a new process, strict JSON, refused formats and configs. Cuts at every
call of random streams are in test_checkpoint_cuts.py; damaged checkpoints in test_checkpoint_damage.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from staleness_metrics import ConfigError, Sink, StalenessConfig, StalenessMonitor
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.state_checks import arrays_left_as_numpy, json_pieces
from tests.reference.streams import ReplayConfig, random_stream

POLICIES = ("token", "episode", "group", "xtuner")
ROOT = Path(__file__).resolve().parents[2]


def config_of(c: ReplayConfig) -> StalenessConfig:
    return StalenessConfig(
        policy=c.policy,  # type: ignore[arg-type]
        max_staleness=c.max_staleness,
        max_token_staleness=c.max_token_staleness,
        sync_interval=c.sync_interval,
        retry_expired=c.retry_expired,
        strict=not c.lenient,
        env_breakdown=c.env_breakdown,
    )


def new_monitor(config: StalenessConfig) -> StalenessMonitor:
    return StalenessMonitor(config, [PrometheusExporter(port=None)], run="ckpt")


def play(monitor: StalenessMonitor, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run events; one output per ship: its metrics dict and its ``--batches-out`` line."""
    out = []
    for event in events:
        if event["type"] == "rollout":
            monitor.add(event["rollout"])
        elif event["type"] == "sweep":
            monitor.sweep(event["step"])
        else:
            shipment = monitor.ship(event["step"], event.get("ids"))
            out.append({"metrics": dict(shipment.metrics), "batch": shipment.batches_line()})
    return out


def final_state(monitor: StalenessMonitor) -> dict[str, Any]:
    """What a user reads at the end: counters, histograms, queue and the exporter's cumulative series."""
    sink = monitor.sink
    exporter = monitor.exporters[0]
    assert isinstance(exporter, PrometheusExporter)
    snapshot = exporter.last_snapshot
    return {
        "totals": {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in vars(sink.totals).items()},
        "queued": sink.queued,
        "tokens_queued": sink.tokens_queued,
        "tokens_entered": sink.tokens_entered,
        "step": sink.step,
        # (env, bucket) keys as JSON has them: a new process prints this
        "counters": None if snapshot is None else {k: [*v.items()] for k, v in snapshot.cumulative.counters.items()},
        "histograms": None if snapshot is None else snapshot.cumulative.histograms,
    }


def test_checkpoint_keeps_held_groups_and_the_open_window() -> None:
    """xtuner with retry: a group held at the save still waits for its re-rollout after the load, and drops
    swept after the last ship are reported by the first ship after the load."""
    config = StalenessConfig(policy="xtuner", max_staleness=1, retry_expired=True)
    sink = Sink(config)
    sink.add([
        {"id": "old", "group_id": "g", "dispatch_version": 0, "samples": [{"mask": [1]}]},
        {"id": "new", "group_id": "g", "dispatch_version": 2, "samples": [{"mask": [1]}]},
        {"id": "lone", "dispatch_version": 0, "samples": [{"mask": [1, 1]}]},
    ])  # fmt: skip
    first = sink.ship(3)
    assert first.held == ("new",) and set(first.dropped_rollouts) == {"old", "lone"}
    sink.add({"id": "x", "dispatch_version": 1, "samples": [{"mask": [1]}]})
    sink.sweep(4)  # x expires: reported with the next ship
    resumed = Sink(config)
    resumed.load_state_dict(json.loads(json.dumps(sink.state_dict())))
    assert resumed.queued == 1  # "new", still held
    held_again = resumed.ship(4)
    assert held_again.held == ("new",) and held_again.dropped_rollouts == ("x",)
    resumed.add({"id": "retry", "group_id": "g", "dispatch_version": 3, "samples": [{"mask": [1]}]})
    assert sorted(resumed.ship(4).ids) == ["new", "retry"]
    with pytest.raises(Exception, match="duplicate id"):
        resumed.add({"id": "x", "dispatch_version": 3, "samples": [{"mask": [1]}]})  # ids stay unique


def _cycled(monitor: StalenessMonitor, config: StalenessConfig) -> tuple[StalenessMonitor, dict[str, Any]]:
    state = json.loads(json.dumps(monitor.state_dict()))
    resumed = StalenessMonitor(config)
    resumed.load_state_dict(state)
    return resumed, state


@pytest.mark.parametrize("policy", POLICIES)
def test_a_save_and_load_with_nothing_between_gives_the_same_checkpoint(policy: str) -> None:
    """Queued rollouts without a group, named groups (one agentic) and groups long gone: the checkpoint keeps
    the named groups only, so cycles do not grow it, and what comes after is what comes without them."""
    config = StalenessConfig(policy=policy, max_staleness=1)  # type: ignore[arg-type]

    def run(cycles: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        monitor, states, out = StalenessMonitor(config), [], []
        for step in range(1, 6):
            monitor.add([
                *({"id": f"u{step}-{i}", "dispatch_version": step - 1, "samples": [{"mask": [1, 1]}]}
                  for i in range(3)),
                {"id": f"g{step}", "group_id": f"g{step % 2}", "agentic": step == 2, "dispatch_version": step - 1,
                 "samples": [{"mask": [1]}]},
            ])  # fmt: skip
            out.append(dict(monitor.ship(step, [f"u{step}-0", f"g{step - 1}"]).metrics))
            for _ in range(cycles):
                monitor, state = _cycled(monitor, config)
                states.append(state)
        return out, states

    steady, _ = run(0)
    cycled, states = run(3)
    assert cycled == steady
    for first, *again in zip(*[iter(states)] * 3):
        assert all(state == first for state in again)  # the same checkpoint, cycle after cycle
    queue = states[-1]["sink"]["queue"]
    assert [name for name, _ in queue["groups"]] == ["g1", "g0"] and len(queue["group_agentic"]) == 2
    assert queue["group_agentic"] == [False, True]


def test_saving_leaves_the_live_queue_as_it_was() -> None:
    monitor = StalenessMonitor(StalenessConfig(policy="group", max_staleness=1))
    monitor.add([{"id": f"r{i}", "group_id": None if i % 2 else f"g{i}", "dispatch_version": 0,
                  "samples": [{"mask": [1]}]} for i in range(6)])  # fmt: skip
    monitor.ship(1, ["r0", "r1", "r2"])
    queue = monitor.sink.queue
    before = (queue.rollouts.group.copy(), dict(queue.groups), queue.n_groups, queue.group_agentic.copy())
    monitor.state_dict()
    assert np.array_equal(before[0], queue.rollouts.group) and before[1:3] == (queue.groups, queue.n_groups)
    assert np.array_equal(before[3], queue.group_agentic)


def test_xtuner_s_owed_re_rollouts_follow_their_group_when_groups_are_numbered_anew() -> None:
    """A group without a name dropped (its count is dead), a named group owing a re-rollout and one owing
    none: after a checkpoint, the one owing holds its member until the re-rollout comes, the other ships."""
    config = StalenessConfig(policy="xtuner", max_staleness=3, retry_expired=True)

    def run(save: bool) -> list[tuple[str, ...]]:
        monitor = StalenessMonitor(config)
        monitor.add([
            {"id": "lone", "dispatch_version": 0, "samples": [{"mask": [1]}]},
            {"id": "x", "group_id": "h", "dispatch_version": 0, "samples": [{"mask": [1]}]},
            {"id": "b", "group_id": "g", "dispatch_version": 3, "samples": [{"mask": [1]}]},
            {"id": "y", "group_id": "h", "dispatch_version": 3, "samples": [{"mask": [1]}]},
        ])  # fmt: skip
        first = monitor.ship(5, ["y"])
        if save:
            monitor, state = _cycled(monitor, config)
            assert state["sink"]["policy"] == {"owed": [1, 0]}  # h, g: numbered in the order they came
        second = monitor.ship(6, ["b", "y"])
        monitor.add({"id": "z", "group_id": "h", "dispatch_version": 5, "samples": [{"mask": [1]}]})
        third = monitor.ship(7)
        return [first.held, first.dropped_rollouts, second.ids, second.held, third.ids]

    assert run(True) == run(False) == [("y",), ("lone", "x"), ["b"], ("y",), ["y", "z"]]


def test_resume_in_a_new_process(tmp_path: Path) -> None:
    """The checkpoint file is all a new interpreter needs (the way a trainer resumes)."""
    config, events = random_stream(7, "xtuner")
    ships = [i for i, e in enumerate(events) if e["type"] == "ship"]
    cut = ships[len(ships) // 2] + 1
    whole = new_monitor(config_of(config))
    expected = play(whole, events)[len(ships) // 2 + 1 :]
    first = new_monitor(config_of(config))
    play(first, events[:cut])
    checkpoint = tmp_path / "staleness.json"
    checkpoint.write_text(json.dumps(first.state_dict()))
    (tmp_path / "rest.json").write_text(json.dumps(events[cut:]))
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from tests.engine.test_checkpoint import new_monitor, play, final_state
from staleness_metrics import StalenessConfig
monitor = new_monitor(StalenessConfig(**{json.dumps(vars(config_of(config)))}))
monitor.load_state_dict(json.load(open({str(checkpoint)!r})))
out = play(monitor, json.load(open({str(tmp_path / "rest.json")!r})))
print(json.dumps({{"ships": out, "final": final_state(monitor)}}, default=str))
"""
    script = script.replace("true", "True").replace("false", "False").replace("null", "None")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["ships"] == json.loads(json.dumps(expected))
    assert result["final"] == json.loads(json.dumps(final_state(whole), default=str))


def test_unknown_format_and_config_mismatch_are_clear_errors() -> None:
    monitor = StalenessMonitor(StalenessConfig(policy="group", max_staleness=4))
    state = monitor.state_dict()
    reads = "this version reads formats 1, 2, 3: a later one needs an upgrade"
    with pytest.raises(ConfigError, match=rf"unknown monitor checkpoint format 99 \({reads}\)$"):
        StalenessMonitor(StalenessConfig(policy="group", max_staleness=4)).load_state_dict({**state, "format": 99})
    with pytest.raises(ConfigError, match="no 'format' field"):
        Sink().load_state_dict({})
    other = StalenessMonitor(StalenessConfig(policy="token", max_staleness=8))
    with pytest.raises(ConfigError) as caught:
        other.load_state_dict(state)
    message = str(caught.value)
    assert "policy='group', max_staleness=4" in message and "policy='token', max_staleness=8" in message
    # how input is read may change on resume; how it is judged may not
    StalenessMonitor(StalenessConfig(policy="group", max_staleness=4, strict=False)).load_state_dict(state)


def test_checkpoint_lacking_a_field_is_refused_by_name_and_a_field_added_since_is_not_needed() -> None:
    sink = Sink()
    sink.add({"id": "a", "dispatch_version": 0, "samples": [{"mask": [1]}]})
    state = sink.state_dict()
    for key, named in (("mask_below", r"queue\.mask_below: missing"), ("batches", r"queue\.batches: missing")):
        damaged = json.loads(json.dumps(state))
        del damaged["queue"][key]
        with pytest.raises(ConfigError, match=named):
            Sink().load_state_dict(damaged)
    damaged = json.loads(json.dumps(state))
    del damaged["queue"]["batches"][0]["mask"]
    with pytest.raises(
        ConfigError, match=r"queue\.batches\[0\]: missing required key 'mask'|queue\.batches\[0\]\.mask"
    ):
        Sink().load_state_dict(damaged)
    # a checkpoint saved before an optional batch field existed: loaded as an add without it (no format change)
    from staleness_metrics.state_checks import digests_of

    older = json.loads(json.dumps(state))
    del older["queue"]["batches"][0]["trainer_logprobs"]
    older["digests"] = digests_of({k: v for k, v in older.items() if k != "digests"})
    resumed = Sink()
    resumed.load_state_dict(older)
    assert resumed.ship(1).batches_line() == sink.ship(1).batches_line()


def test_missing_trainer_logprobs_stay_missing_across_a_checkpoint() -> None:
    """NaN marks a missing trainer log-probability (SPEC 11); JSON has no NaN, the checkpoint keeps it."""
    record = {
        "id": "a",
        "dispatch_version": 0,
        "samples": [{"mask": [1, 1, 1], "trainer_logprobs": [None, -0.5, None]}],
    }
    sink = Sink()
    sink.add(record)
    text = json.dumps(sink.state_dict(), allow_nan=False)  # strict JSON
    resumed = Sink()
    resumed.load_state_dict(json.loads(text))
    [shipped] = resumed.ship(1).rollouts
    assert shipped.record()["samples"][0]["trainer_logprobs"] == [None, -0.5, None]


def test_mismatch_sums_and_shipped_steps_survive_a_checkpoint() -> None:
    from staleness_metrics.metrics.mismatch import MismatchSums

    monitor = StalenessMonitor(StalenessConfig())
    monitor.add({"id": "a", "dispatch_version": 0, "samples": [{"mask": [1]}]})
    monitor.ship(1)
    monitor.record_mismatch(1, MismatchSums.zero())
    resumed = StalenessMonitor(StalenessConfig())
    resumed.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
    assert resumed.mismatch(1) == MismatchSums.zero()
    resumed.record_mismatch(1, MismatchSums.zero())  # a rank reporting late for a step shipped before the save
    with pytest.raises(ValueError, match="no batch was shipped for step 2"):
        resumed.record_mismatch(2, MismatchSums.zero())


def _resigned(state: dict[str, Any]) -> dict[str, Any]:
    """A state changed and then given fresh digests, as if it had been saved that way (built wrongly)."""
    from staleness_metrics.state_checks import digests_of

    sink = state["sink"]
    sink["digests"] = digests_of({k: v for k, v in sink.items() if k != "digests"})
    state["digests"] = digests_of({k: v for k, v in state.items() if k != "digests"}, skip=("sink",))
    return state


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda s: s["sink"].pop("window"), r"sink\.window: missing"),
        (lambda s: s["sink"]["queue"].update(tokens_entered=-5), r"sink\.queue\.tokens_entered: -5 is below 0"),
        (lambda s: s["sink"].update(step=-3), r"sink\.step: -3 is below 0"),
        (
            lambda s: s["sink"]["queue"]["batches"][0]["mask"]["array"]["data"].__setitem__(1, 7),
            r"sink\.queue\.batches\[0\]: rollout 'a': field samples\[0\]\.mask",
        ),
        (
            lambda s: s["sink"]["queue"]["batches"][0]["dispatch_version"]["array"].update(dtype="<f8"),
            r"sink\.queue\.batches\[0\]\.dispatch_version\.array",
        ),
        (lambda s: s["sink"]["queue"]["judged"].pop(), r"sink\.queue\.judged: "),
        (lambda s: s["sink"]["queue"].pop("batches"), r"sink\.queue\.batches: missing"),
        (lambda s: s["sink"]["queue"]["mask_below"].pop(), r"sink\.queue\.mask_below: "),
        (lambda s: s["sink"]["queue"]["mask_below"].__setitem__(0, 99), r"sink\.queue\.mask_below\[0\]: 99"),
        (lambda s: s["sink"]["queue"]["seen_ids"].remove("a"), r"sink\.queue\.seen_ids: lacks the queued id 'a'"),
        (lambda s: s["sink"]["queue"].update(groups=[]), r"sink\.queue\.groups: lacks the group 'g'"),
        (lambda s: s["sink"]["queue"]["batches"].append(s["sink"]["queue"]["batches"][0]), r"batches\[1\]: .*'a'"),
        (lambda s: s["exporters"]["prometheus"].pop("totals"), r"exporters\.prometheus\.totals: missing"),
        (lambda s: s["sink"]["policy"].update(owed=[10**30]), r"sink\.policy\.owed\[0\]: 1000.* is above"),
        (
            lambda s: s["sink"]["queue"]["dropped"].__setitem__(0, True),
            r"sink\.queue\.dropped: every sample of a queued rollout is dropped",
        ),
        (
            lambda s: s["sink"]["queue"]["batches"][0]["echo"]["list"][1].update(id="a"),
            r"batches\[0\]\.echo\.list\[1\]: its id or dispatch_version is not the batch.s",
        ),
        (
            lambda s: s["sink"]["queue"]["batches"][0]["echo"]["list"][0].update(x=json.loads("[" * 700 + "]" * 700)),
            r"echo\.list\[0\]\.x(\[0\])+: nested deeper than 128 levels",
        ),
        (
            lambda s: s["sink"]["queue"]["batches"][0]["mask"]["array"].update(dtype="01"),
            r"batches\[0\]\.mask\.array\.dtype: '01' is not a numpy dtype",
        ),
    ],
)
def test_a_bad_checkpoint_is_refused_by_key_and_leaves_the_monitor_as_it_was(damage: Any, named: str) -> None:
    """The damages seen in the wild (issue 19), each with fresh digests so that the checks, not the digests,
    must find it: refused by name, and the monitor it was loaded into ships like one never touched."""
    config = StalenessConfig(policy="xtuner", max_staleness=2, retry_expired=True)

    def monitor_with(ids: list[str]) -> StalenessMonitor:
        monitor = new_monitor(config)
        monitor.add([{"id": i, "group_id": "g", "dispatch_version": 1, "samples": [{"mask": [0, 1, 1]}]} for i in ids])
        return monitor

    state = json.loads(json.dumps(monitor_with(["a", "b"]).state_dict()))
    damage(state)
    target, untouched = monitor_with(["x"]), monitor_with(["x"])
    with pytest.raises(ConfigError, match=named):
        target.load_state_dict(_resigned(state))
    assert play(target, [{"type": "ship", "step": 3}]) == play(untouched, [{"type": "ship", "step": 3}])
    assert final_state(target) == final_state(untouched)
    state = json.loads(json.dumps(monitor_with(["a", "b"]).state_dict()))
    state["sink"]["step"] = 2  # plausible (the last step a sweep or ship used): only the digest can tell
    with pytest.raises(ConfigError, match=r"sink\.step: differs from the digest saved with it"):
        target.load_state_dict(state)


def test_a_big_endian_dtype_loads_as_the_machine_s_own() -> None:
    """A dtype is a name beside JSON numbers: ``>i8`` holds the same numbers as ``<i8`` (compiled loops take
    only the machine's byte order, where a big-endian array stopped a ship with numba's typing error)."""
    config = StalenessConfig(policy="token", max_staleness=1)
    monitor = new_monitor(config)
    monitor.add([{"id": "a", "dispatch_version": 1, "samples": [{"mask": [0, 1, 1], "token_versions": [1, 1, 2]}]}])
    state = json.loads(json.dumps(monitor.state_dict()))
    for name in ("dispatch_version", "token_versions", "sample_offsets"):
        state["sink"]["queue"]["batches"][0][name]["array"]["dtype"] = ">i8"
    restored = new_monitor(config)
    restored.load_state_dict(_resigned(state))
    assert play(restored, [{"type": "ship", "step": 4}]) == play(monitor, [{"type": "ship", "step": 4}])


def test_a_queue_of_millions_of_positions_is_saved_without_a_copy_or_an_index_of_them() -> None:
    """The service's snapshots (``arrays_left_as_numpy``, written a piece at a time): a queued batch
    costs neither a copy of its positions nor an int64 index of them (8 bytes a position: 13x the
    body of a 32 MiB mask, tests/server/test_hostile.py), and the state loads back the same."""
    positions = 4 * 2**20
    monitor = StalenessMonitor(StalenessConfig())
    for name in ("a", "b"):
        monitor.add([{"id": name, "dispatch_version": 0, "samples": [{"mask": np.ones(positions, dtype=np.int8)}]}])
    monitor.ship(1, ["a"])  # the queue's other rows, shipped: what stays is saved alone
    monitor.add([{"id": f"c{i}", "dispatch_version": 0, "samples": [{"mask": [1, 0, 1]}]} for i in range(3)])
    monitor.ship(2, ["c1"])  # a batch queued in part
    tracemalloc.start()
    try:
        with arrays_left_as_numpy():
            state = monitor.state_dict()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # (a float64 mask here: the finite check's flag a position, but no copy of 8 bytes a position)
    assert peak < 2 * positions, f"{peak / positions:.2f} bytes a queued position"
    text = b"".join(json_pieces(state, orjson.OPT_SERIALIZE_NUMPY))
    loaded = StalenessMonitor(StalenessConfig())
    loaded.load_state_dict(orjson.loads(text))
    shipped, expected = loaded.ship(3), monitor.ship(3)
    assert list(shipped.ids) == ["b", "c0", "c2"]
    assert shipped.batches_line() == expected.batches_line() and dict(shipped.metrics) == dict(expected.metrics)


def test_a_state_is_plain_json_values_so_a_json_round_trip_gives_it_back() -> None:
    """SPEC 13: ints, floats, strings and lists (no tuple, no numpy value), for a fresh sink and for a
    monitor with a queue, held groups, a window and its exporter's series."""
    replay_config, events = random_stream(3, "xtuner")
    monitor = new_monitor(config_of(replay_config))
    play(monitor, events[: len(events) // 2])

    def not_plain(value: Any, path: str = "") -> list[str]:
        if isinstance(value, dict):
            return [bad for k, v in value.items() for bad in not_plain(v, f"{path}/{k}")]
        if type(value) is list:
            return [bad for i, v in enumerate(value) for bad in not_plain(v, f"{path}[{i}]")]
        return [] if value is None or type(value) in (str, int, float, bool) else [f"{path}: {type(value).__name__}"]

    for state in (Sink().state_dict(), monitor.state_dict()):
        assert not_plain(state) == []
        assert json.loads(json.dumps(state)) == state
