"""``replay`` packs and cuts the rollouts of consecutive small adds together, across the ships between them
(``stream.cut_ahead``): every ship's metrics, shipped records and lags, every error and the sink's totals are
those of the same events added one add at a time, however the windows fall."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import Sink
from staleness_metrics.errors import EventError
from staleness_metrics.replay import stream
from staleness_metrics.replay.stream import (
    Added,
    Event,
    Step,
    cut_ahead,
    pack_once,
    parse_event,
    prepare,
    run_events,
    run_steps,
)
from tests.engine.test_checkpoint import POLICIES, config_of
from tests.reference.streams import DrawChooser, generate_events, random_config


def outcome(
    raw: list[dict[str, Any]], config: Any, window: int | None, batch_size: int, shared: bool = False
) -> list[Any]:
    """What a replay of ``raw`` gives: per ship its metrics, records and lags; the error that stopped it; totals.
    ``window``: positions of the cut ahead (None: every add cut by the sink itself); ``shared``: the steps packed
    for several runs, as ``what-if`` packs them (:func:`pack_once`)."""
    sink = Sink(config)
    steps: Iterable[Step] = prepare((parse_event(n, event) for n, event in enumerate(raw, 1)), batch_size)
    if shared:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(stream, "CUT_AHEAD_POSITIONS", window or 0)
            steps = pack_once(steps)
    elif window is not None:
        steps = cut_ahead(steps, sink, window)
    seen: list[Any] = []
    try:
        for shipment in run_steps(steps, sink):
            invalid = [str(error) for error in shipment.invalid]
            seen.append((dict(shipment.metrics), shipment.batches_line(), shipment.lags.tolist(), invalid))
    except EventError as error:
        seen.append(str(error))
    seen.append((sink.queued, sink.tokens_queued, sink.tokens_entered, repr(vars(sink.totals))))
    return seen


@settings(max_examples=60)
@given(data=st.data())
def test_a_replay_cut_ahead_gives_what_adds_cut_one_at_a_time_give(data: st.DataObject) -> None:
    chooser = DrawChooser(data.draw)
    lenient = data.draw(st.booleans(), label="lenient")
    policy = data.draw(st.sampled_from(POLICIES), label="policy")
    replay_config = random_config(chooser, policy, lenient=lenient)
    raw = generate_events(chooser, replay_config, defects=data.draw(st.integers(0, 2), label="defects"))
    window = data.draw(st.sampled_from([8, 40, 200, 1 << 16]), label="window positions")
    batch_size = data.draw(st.sampled_from([1, 2, 512]), label="batch size")
    config = config_of(replay_config)
    one_at_a_time = outcome(raw, config, None, batch_size)
    assert outcome(raw, config, window, batch_size) == one_at_a_time
    assert outcome(raw, config, window, batch_size, shared=True) == one_at_a_time


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


def owned_adds(raw: list[dict[str, Any]], config: Any, window: int) -> list[bool]:
    """Per add step of a replay of ``raw``: whether the cut ahead handed it its part of a shared cut."""
    sink = Sink(config)
    steps = cut_ahead(prepare(parse_event(n, event) for n, event in enumerate(raw, 1)), sink, window)
    flags = []
    for step in steps:
        if isinstance(step, Added):
            flags.append(step.owned)
            sink.add_parsed(step.items, step.packed, step.checked)
        elif step.kind == "ship":
            sink.ship(step.step)
    return flags


@pytest.mark.parametrize("lenient", [False, True])
def test_small_adds_share_one_cut_and_a_refused_rollout_leaves_its_window_to_the_sink(lenient: bool) -> None:
    from staleness_metrics import StalenessConfig

    config = StalenessConfig(policy="token", max_staleness=1, strict=not lenient)
    # 30 adds of 3 rollouts (24 positions each): windows of 64 positions hold 2 adds, the last one alone
    assert owned_adds(small_stream(90, 3), config, 64) == [True] * 30
    with pytest.MonkeyPatch.context() as patch:  # at most 2 steps held: an add and the ship after it, alone
        patch.setattr(stream, "_CUT_AHEAD_STEPS", 2)
        assert owned_adds(small_stream(90, 3), config, 64) == [False] * 30
        assert outcome(small_stream(90, 3), config, 64, 512) == outcome(small_stream(90, 3), config, None, 512)
    # rollout 40 refused: its window (adds 13 and 14) is added as it came, and named at its own add
    raw = small_stream(90, 3, bad=40)
    if lenient:
        assert owned_adds(raw, config, 64) == [True] * 12 + [False, False] + [True] * 16
    cut = outcome(raw, config, 64, 512)
    assert cut == outcome(raw, config, None, 512)
    refused = "rollout 'r40': field samples[0].mask[7]: expected 0, 1 or a boolean, got 2"
    if lenient:  # set aside at its add, reported by the next ship
        assert [error for ship in cut[:-1] for error in ship[3]] == [refused]
    else:  # the replay stops at its line (rollout 40 follows 13 ships)
        assert cut[-2] == f"line {40 + 1 + 13}: {refused}"


def test_run_events_hands_a_ship_on_before_reading_on_unless_asked_to_read_ahead() -> None:
    from staleness_metrics import StalenessConfig

    config = StalenessConfig(policy="token", max_staleness=1)
    raw = small_stream(30, 3)  # rollouts on lines 1-3, the first ship on line 4

    def results(read_ahead: bool) -> tuple[int, list[Any]]:
        read: list[int] = []

        def events() -> Iterator[Event]:
            for number, event in enumerate(raw, 1):
                read.append(number)
                yield parse_event(number, event)

        shipments = run_events(events(), Sink(config), read_ahead=read_ahead)
        first = next(shipments)
        lines_read = read[-1]
        every = [first, *shipments]
        return lines_read, [(dict(s.metrics), s.batches_line(), s.lags.tolist()) for s in every]

    live, recorded = results(False), results(True)
    assert live[0] == 4  # a live stream's ship comes as soon as its line is read
    assert recorded[0] == len(raw)  # the whole (short) stream is one window
    assert live[1] == recorded[1] and len(live[1]) == 10
