"""SPEC 13: a checkpoint may be taken after any call, and taking it changes nothing.

One run of a random event stream (tests/reference/streams.py; rollouts added in batches of 1-8, trainer-side
mismatch sums recorded after some ships) saves ``state_dict()`` after every call: that run must ship
exactly what a run that never saved ships. Monitors restored from those states (through JSON) and fed
the rest of the calls must ship the same ``--batches-out`` lines and metrics, and end with the same
counters, histograms, queue and exporter series. The runs restart from a checkpoint before every call
(seeded streams) or before calls drawn among all of them (hypothesis), under every policy, strict and
lenient, with invalid rollouts: a call made right after a restore is made by a monitor loaded from a
checkpoint taken right before it, whatever the previous call was.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from staleness_metrics import Sink, StalenessConfig, StalenessMonitor
from staleness_metrics.errors import StalenessError
from staleness_metrics.metrics.mismatch import mismatch_sums
from tests.engine.test_checkpoint import POLICIES, config_of, final_state, new_monitor
from tests.reference.streams import DrawChooser, SeededChooser, generate_events, random_config

Call = dict[str, Any]


def calls_of(events: list[dict[str, Any]], rng: random.Random) -> list[Call]:
    """The events as monitor calls: consecutive rollouts added in batches of 1-8 (single adds among them; a
    batch is one call, so one cut point: fewer restarts per stream, the same kinds of cut), and after some
    ships the trainer's mismatch sums for that step (once or twice: ranks report separately)."""
    calls: list[Call] = []
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        while pending:
            size = rng.randint(1, 8)
            calls.append({"call": "add", "rollouts": pending[:size]})
            del pending[:size]

    for event in events:
        if event["type"] == "rollout":
            pending.append(event["rollout"])
            continue
        flush()
        if event["type"] == "sweep":
            calls.append({"call": "sweep", "step": event["step"]})
        else:
            calls.append({"call": "ship", "step": event["step"], "ids": event.get("ids")})
            for rank in range(rng.choice((0, 0, 1, 2))):
                calls.append({"call": "record_mismatch", "step": event["step"], "rank": rank})
    flush()
    return calls


def trainer_sums(step: int, rank: int) -> Any:
    """Deterministic SPEC 11 sums standing in for a trainer rank's."""
    positions = np.arange(4 + (step + rank) % 5)
    lags = (positions + rank) % 4 - 1  # -1: not a sampled position
    sampler = -0.125 * (positions % 7)
    trainer = sampler + 0.0625 * ((positions * (step + 1)) % 3)
    return mismatch_sums(lags, sampler, trainer)


def apply(monitor: StalenessMonitor, call: Call) -> Any:
    """One call and what the user sees of it (a refused call's error message included)."""
    try:
        if call["call"] == "add":
            return monitor.add(call["rollouts"])
        if call["call"] == "sweep":
            monitor.sweep(call["step"])
            return None
        if call["call"] == "record_mismatch":
            return monitor.record_mismatch(call["step"], trainer_sums(call["step"], call["rank"])).to_dict()
        shipment = monitor.ship(call["step"], call["ids"])
        return {"metrics": dict(shipment.metrics), "batch": shipment.batches_line(), "lags": shipment.lags.tolist()}
    except (StalenessError, ValueError) as exc:  # strict mode refuses invalid rollouts; so do late mismatch sums
        return f"{type(exc).__name__}: {exc}"


def run(
    config: StalenessConfig, calls: list[Call], restart_before: set[int] | None = None, save: bool = False
) -> tuple[list[Any], dict[str, Any]]:
    """The calls' outputs and the final state. ``save``: take a checkpoint after every call and carry on with
    the live monitor. ``restart_before``: before each of those calls, save, and carry on with a new monitor
    loaded from the (JSON) checkpoint instead: every call in it is made by a monitor that was just restored."""
    monitor = new_monitor(config)
    outputs = []
    for index, call in enumerate(calls):
        if restart_before is not None and index in restart_before:
            text = json.dumps(monitor.state_dict(), allow_nan=False)  # strict JSON
            monitor = new_monitor(config)
            monitor.load_state_dict(json.loads(text))
        outputs.append(apply(monitor, call))
        if save:
            monitor.state_dict()
    return outputs, final_state(monitor)


def check_cuts(config: StalenessConfig, calls: list[Call], restart_before: set[int], saving: bool = True) -> None:
    expected = run(config, calls)
    if saving:
        assert run(config, calls, save=True) == expected, "saving a checkpoint changed what the run did"
    restarted, final = run(config, calls, restart_before)
    for index, (got, wanted) in enumerate(zip(restarted, expected[0])):
        assert got == wanted, f"call {index} ({calls[index]['call']}) after restarts before {sorted(restart_before)}"
    assert final == expected[1]


@pytest.mark.parametrize("policy", POLICIES)
def test_restarting_before_every_call_changes_nothing(policy: str) -> None:
    """Every call of each stream is a cut point; strict and lenient, with invalid rollouts mixed in."""
    for seed in range(8):
        chooser = SeededChooser(seed * 7 + len(policy))
        lenient = seed % 2 == 1
        config = random_config(chooser, policy, lenient)
        events = generate_events(chooser, config, defects=seed % 3)
        calls = calls_of(events, random.Random(seed))
        check_cuts(config_of(config), calls, set(range(len(calls) + 1)))


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_restarts_at_drawn_calls_of_drawn_streams_change_nothing(policy: str, data: st.DataObject) -> None:
    chooser = DrawChooser(data.draw)
    lenient = data.draw(st.booleans(), label="lenient")
    config = random_config(chooser, policy, lenient)
    events = generate_events(chooser, config, defects=data.draw(st.integers(0, 2), label="defects"))
    calls = calls_of(events, random.Random(data.draw(st.integers(0, 2**16), label="batching")))
    restarts = data.draw(st.sets(st.integers(0, len(calls)), min_size=1, max_size=6), label="restart before calls")
    note(f"config={config}")
    check_cuts(config_of(config), calls, restarts, saving=False)  # the seeded test checks saving


def test_saving_after_a_dropping_sweep_leaves_the_sink_shipping_as_before() -> None:
    """The reported defect: a save after a sweep that dropped a whole batch renumbered the sink's batches
    but not the ones waiting to be released, so the next ships raised and the drops went missing."""
    config = StalenessConfig(policy="group", max_staleness=1)

    def rollouts(prefix: str, group: str, dispatch: int) -> list[dict[str, Any]]:
        return [
            {"id": f"{prefix}{i}", "group_id": group, "dispatch_version": dispatch, "samples": [{"mask": [1, 1]}]}
            for i in range(3)
        ]

    def play(sink: Sink, save: bool) -> list[Any]:
        sink.add(rollouts("a", "g", 0))
        first = sink.ship(1)
        sink.add(rollouts("b", "h", 0))  # stale by step 4: the sweep drops this whole batch
        sink.add(rollouts("c", "k", 3))
        sink.sweep(4)
        if save:
            sink.state_dict()
        second = sink.ship(4, ["c0"])
        sink.add(rollouts("d", "k", 4))
        third = sink.ship(5)
        return [(s.ids, s.dropped_rollouts) for s in (first, second, third)] + [sink.totals.rollouts_dropped]

    expected = play(Sink(config, compact_min_rows=0), save=False)
    assert expected[1] == (["c0"], ("b0", "b1", "b2")) and expected[-1] == 3
    assert play(Sink(config, compact_min_rows=0), save=True) == expected
