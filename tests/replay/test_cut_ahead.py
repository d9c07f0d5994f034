"""Replay and what-if pack, check and cut the rollouts once (``stream.cut_ahead``): several small adds with the ships
between them at once (replay), and once for every bound (what-if). Every ship's metrics, shipped records and lags,
every error and the sink's totals are those of the same events added by the sink itself (which stages the adds
between two ships and cuts them together)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import Sink
from staleness_metrics.errors import EventError
from staleness_metrics.replay.stream import Added, Event, Step, cut_ahead, parse_event, prepare, run_events, run_steps
from tests.engine.test_checkpoint import POLICIES, config_of
from tests.reference.streams import DrawChooser, SeededChooser, generate_events, random_config

Packing = Literal["sink", "shared", "own"]


def outcome(
    raw: list[dict[str, Any]], config: Any, batch_size: int, packing: Packing = "sink", compact_min_rows: int = 4096
) -> list[Any]:
    """What a replay of ``raw`` gives: per ship its metrics, records and lags; the error that stopped it; totals.
    ``packing``: "sink", each add packed by the sink; "shared", the steps cut ahead for several runs, as what-if
    cuts them; "own", cut ahead for this sink's run, as replay cuts them."""
    sink = Sink(config, compact_min_rows=compact_min_rows)
    steps: Iterable[Step] = prepare((parse_event(n, event) for n, event in enumerate(raw, 1)), batch_size)
    if packing == "shared":
        steps = list(cut_ahead(steps))
    elif packing == "own":
        steps = cut_ahead(steps, sink)
    return played(steps, sink)


def played(steps: Iterable[Step], sink: Sink) -> list[Any]:
    seen: list[Any] = []
    try:
        for shipment in run_steps(steps, sink):
            invalid = [str(error) for error in shipment.invalid]
            seen.append((dict(shipment.metrics), shipment.batches_line(), shipment.lags.tolist(), invalid))
    except EventError as error:
        seen.append(str(error))
    # (the tally's repr, in field order: a restored tally is built, a live one summed, their dicts ordered apart)
    seen.append((sink.queued, sink.tokens_queued, sink.tokens_entered, repr(sink.totals)))
    return seen


_OPTIONAL = ("rl_weights", "ce_weights", "ref_kl_weights", "logprobs", "trainer_logprobs")


def uniform(raw: list[dict[str, Any]], carried: tuple[str, ...]) -> list[dict[str, Any]]:
    """``raw`` with every sample carrying exactly the optional arrays ``carried`` (so that windows form)."""
    for event in raw:
        rollout = event.get("rollout") if isinstance(event, dict) else None
        for sample in rollout.get("samples") or [] if isinstance(rollout, dict) else []:
            if not isinstance(sample, dict) or not isinstance(sample.get("mask"), list):
                continue
            n = len(sample["mask"])
            for name in _OPTIONAL:
                if name not in carried:
                    sample.pop(name, None)
                elif sample.get(name) is None:
                    sample[name] = [0.5 if name.endswith("weights") else -1.25] * n
    return raw


def windows_cut(raw: list[dict[str, Any]], batch_size: int) -> int:
    """How many adds of ``raw`` take a part of a window cut with other adds."""
    steps = cut_ahead(prepare((parse_event(n, event) for n, event in enumerate(raw, 1)), batch_size))
    return sum(isinstance(step, Added) and step.part is not None for step in steps)


@settings(max_examples=60)
@given(data=st.data())
def test_steps_cut_ahead_give_what_the_sink_gives_alone(data: st.DataObject) -> None:
    chooser = DrawChooser(data.draw)
    lenient = data.draw(st.booleans(), label="lenient")
    policy = data.draw(st.sampled_from(POLICIES), label="policy")
    replay_config = random_config(chooser, policy, lenient=lenient)
    raw = generate_events(chooser, replay_config, defects=data.draw(st.integers(0, 2), label="defects"))
    if data.draw(st.booleans(), label="uniform"):
        raw = uniform(raw, tuple(data.draw(st.sets(st.sampled_from(_OPTIONAL)), label="carried")))
    batch_size = data.draw(st.sampled_from([1, 2, 512]), label="batch size")
    config = config_of(replay_config)
    alone = outcome(raw, config, batch_size)
    compact = data.draw(st.sampled_from([0, 4096]), label="compact_min_rows")  # (0: compacted at every ship)
    assert outcome(raw, config, batch_size, "shared", compact) == alone
    assert outcome(raw, config, batch_size, "own", compact) == alone


def test_uniform_random_streams_do_cut_windows() -> None:
    """The property above meets windows: random streams whose samples carry the same arrays form them."""
    cut = 0
    for seed in range(20):
        chooser = SeededChooser(seed)
        raw = generate_events(chooser, random_config(chooser, "token", lenient=True), defects=0)
        cut += windows_cut(uniform(raw, ("rl_weights", "logprobs")), 512)
    assert cut > 20


def small_stream(rollouts: int, per_ship: int, bad: int | None = None) -> list[dict[str, Any]]:
    """Rollouts of one 8-position sample (token versions, weights, log-probabilities), a ship every
    ``per_ship``; rollout ``bad`` has a mask value of 2."""
    rng, raw, step = random.Random(0), [], 2
    for number in range(rollouts):
        versions = [rng.choice([-1, step - 2, step - 1]) for _ in range(8)]
        mask = [0, 0, 1, 1, 1, 1, 1, 2 if number == bad else 1]
        sample = {"mask": mask, "token_versions": versions, "rl_weights": [float(m > 0) for m in mask],
                  "logprobs": [-0.5] * 8}  # fmt: skip
        raw.append({"type": "rollout", "rollout": {"id": f"r{number}", "dispatch_version": max(0, step - 2),
                                                   "samples": [sample]}})  # fmt: skip
        if number % per_ship == per_ship - 1:
            raw.append({"type": "ship", "step": step})
            step += 1
    return raw


@pytest.mark.parametrize("lenient", [False, True])
def test_a_refused_rollout_is_named_at_its_own_add(lenient: bool) -> None:
    from staleness_metrics import StalenessConfig

    config = StalenessConfig(policy="token", max_staleness=1, strict=not lenient)
    raw = small_stream(90, 3, bad=40)
    alone = outcome(raw, config, 512)
    assert outcome(raw, config, 512, "shared") == alone
    assert outcome(raw, config, 512, "own") == alone
    refused = "rollout 'r40': field samples[0].mask[7]: expected 0, 1 or a boolean, got 2"
    if lenient:  # set aside at its add, reported by the next ship
        assert [error for ship in alone[:-1] for error in ship[3]] == [refused]
    else:  # the replay stops at its line (rollout 40 follows 13 ships)
        assert alone[-2] == f"line {40 + 1 + 13}: {refused}"


def test_run_events_hands_a_ship_on_as_soon_as_its_line_is_read() -> None:
    from staleness_metrics import StalenessConfig

    config = StalenessConfig(policy="token", max_staleness=1)
    raw = small_stream(30, 3)  # rollouts on lines 1-3, the first ship on line 4
    read: list[int] = []

    def events() -> Iterator[Event]:
        for number, event in enumerate(raw, 1):
            read.append(number)
            yield parse_event(number, event)

    shipments = run_events(events(), Sink(config))
    first = next(shipments)
    assert read[-1] == 4  # a live stream's ship comes as soon as its line is read
    every = [(dict(s.metrics), s.batches_line(), s.lags.tolist()) for s in [first, *shipments]]
    assert every == [ship[:3] for ship in outcome(raw, config, 512)[:-1]] and len(every) == 10


@pytest.mark.parametrize("per_ship", [1, 3, 7])
def test_small_ships_are_cut_in_windows_with_the_sink_s_decisions(per_ship: int) -> None:
    from staleness_metrics import StalenessConfig

    raw = small_stream(120, per_ship)
    assert windows_cut(raw, 512) == len([event for event in raw if event["type"] == "ship"]) + (120 % per_ship > 0)
    for policy in POLICIES:
        config = StalenessConfig(policy=policy, max_staleness=1)
        alone = outcome(raw, config, 512)
        assert outcome(raw, config, 512, "own") == alone and outcome(raw, config, 512, "shared") == alone


def test_a_window_is_read_ahead_only_when_asked() -> None:
    from staleness_metrics import StalenessConfig

    config = StalenessConfig(policy="token", max_staleness=1)
    raw = small_stream(60, 3)
    read: list[int] = []

    def events() -> Iterator[Event]:
        for number, event in enumerate(raw, 1):
            read.append(number)
            yield parse_event(number, event)

    shipments = run_events(events(), Sink(config), read_ahead=True)
    first = next(shipments)
    assert read[-1] == len(raw)  # the whole stream is one window: read before its first ship
    every = [(dict(s.metrics), s.batches_line(), s.lags.tolist()) for s in [first, *shipments]]
    assert every == [ship[:3] for ship in outcome(raw, config, 512)[:-1]] and len(every) == 20


def test_a_checkpoint_after_any_ship_of_a_read_ahead_replay_continues_the_same() -> None:
    """A user may checkpoint the sink between the ships ``run_events(read_ahead=True)`` hands on: restored into a
    fresh sink and fed the rest of the events, it ships what the uninterrupted replay ships."""
    import json

    def ships(sink: Sink, part: list[Event], read_ahead: bool) -> list[Any]:
        seen: list[Any] = []
        try:
            for shipment in run_events(part, sink, read_ahead=read_ahead):
                seen.append((dict(shipment.metrics), shipment.batches_line(), shipment.lags.tolist()))
        except EventError as error:
            seen.append(str(error))
        return seen

    streams = 0
    for seed in range(40):
        chooser = SeededChooser(seed)
        replay_config = random_config(chooser, POLICIES[seed % len(POLICIES)], lenient=bool(seed % 2))
        raw = uniform(generate_events(chooser, replay_config, defects=seed % 3), ("rl_weights", "logprobs"))
        if windows_cut(raw, 512) == 0:
            continue  # (a stream without two adds of one window: nothing read ahead)
        streams += 1
        config = config_of(replay_config)
        events = [parse_event(n, event) for n, event in enumerate(raw, 1)]
        straight = ships(Sink(config), events, read_ahead=False)
        for at in [i for i, event in enumerate(events) if event.kind == "ship"]:
            sink = Sink(config)
            before = ships(sink, events[: at + 1], read_ahead=True)
            if before and isinstance(before[-1], str):  # (the replay stopped at an error there)
                assert before == straight[: len(before)]
                break
            restored = Sink(config)
            restored.load_state_dict(json.loads(json.dumps(sink.state_dict())))
            assert before + ships(restored, events[at + 1 :], read_ahead=False) == straight
    assert streams >= 10


def test_a_checkpoint_between_two_adds_of_a_window_continues_the_same() -> None:
    """A replay's queue holds the rows of a window's later rollouts before their adds (pending): a checkpoint
    taken at a ship inside the window leaves them out, and restored, the rest of the steps ship what the sink
    alone ships, compacted at every ship or not."""
    import json

    inside = 0
    for seed in range(30):
        chooser = SeededChooser(seed)
        replay_config = random_config(chooser, POLICIES[seed % len(POLICIES)], lenient=bool(seed % 2))
        raw = uniform(generate_events(chooser, replay_config, defects=seed % 3), ("rl_weights", "logprobs"))
        config = config_of(replay_config)
        straight = outcome(raw, config, 512)
        steps = list(cut_ahead(prepare(parse_event(n, event) for n, event in enumerate(raw, 1))))
        adds = [(i, step.part) for i, step in enumerate(steps) if isinstance(step, Added)]
        for at, step in enumerate(steps):
            part = next((part for i, part in adds if i > at), None)  # the next add's part of its window
            if isinstance(step, Added) or step.kind != "ship" or part is None or part[0] == 0:
                continue  # (not a ship, or the next add starts a window: nothing is pending here)
            inside += 1
            for compact in (0, 4096):
                sink = Sink(config, compact_min_rows=compact)
                before = played(steps[: at + 1], sink)[:-1]
                if before and isinstance(before[-1], str):  # (the replay stopped at an error there)
                    assert before == straight[: len(before)]
                    continue
                restored = Sink(config, compact_min_rows=compact)
                restored.load_state_dict(json.loads(json.dumps(sink.state_dict())))
                assert before + played(steps[at + 1 :], restored) == straight
    assert inside >= 20


def test_a_replay_s_ships_read_late_equal_the_ships_read_at_once() -> None:
    """A ship's records are built when first asked for: read after the whole replay (windows appended ahead,
    compacted at every ship), they are those read at each ship."""
    from staleness_metrics import StalenessConfig

    raw = small_stream(120, 3)
    for policy in POLICIES:
        config = StalenessConfig(policy=policy, max_staleness=1)  # type: ignore[arg-type]
        at_once = [ship[1] for ship in outcome(raw, config, 512, "own", compact_min_rows=0)[:-1]]
        sink = Sink(config, compact_min_rows=0)
        steps = cut_ahead(prepare(parse_event(n, event) for n, event in enumerate(raw, 1)), sink)
        shipments = list(run_steps(steps, sink))
        assert [shipment.batches_line() for shipment in shipments] == at_once and len(at_once) == 40


def test_a_rollout_left_queued_keeps_a_copy_of_its_own_arrays_not_its_window_s() -> None:
    """A read-ahead window holds many rollouts; one that no ship names and no bound drops stays queued for long,
    and once compacted it keeps a copy of its own arrays, not the window's. Every ship, the last one shipping
    those left, is what the sink gives alone, with a checkpoint between any two ships too."""
    import json

    from staleness_metrics import StalenessConfig

    raw = small_stream(120, 3)  # one window of 960 positions; each ship below leaves its first rollout
    for event in raw:
        if event["type"] == "ship":
            event["ids"] = [f"r{3 * (event['step'] - 2) + k}" for k in (1, 2)]
    raw.append({"type": "ship", "step": raw[-1]["step"] + 1})  # then every rollout left
    for policy in POLICIES:
        config = StalenessConfig(policy=policy, max_staleness=10**6)  # type: ignore[arg-type]
        alone = outcome(raw, config, 512, compact_min_rows=0)
        assert outcome(raw, config, 512, "own", compact_min_rows=0) == alone
        sink, compacted = Sink(config, compact_min_rows=0), 0
        steps = list(cut_ahead(prepare(parse_event(n, event) for n, event in enumerate(raw, 1)), sink))
        for _ in run_steps(steps[:-1], sink):
            if sink.queue.tracked_rollouts == sink.queued:  # compacted at this ship
                kept = {id(batch): batch.n_positions for batch in sink.queue.chunks if batch is not None}
                assert sum(kept.values()) == 8 * sink.queued  # their own positions (the window: 960)
                compacted += 1
        assert sink.queued == 40 and compacted >= 5  # one rollout of each ship left
        restored = Sink(config, compact_min_rows=0)
        restored.load_state_dict(json.loads(json.dumps(sink.state_dict())))
        assert played(steps[-1:], restored)[0] == alone[-2]
