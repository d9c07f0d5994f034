"""Small adds are queued with a few checks and cut into spans later, together (``Sink.add``): a run that
adds rollouts one at a time decides, masks and reports exactly what the same run does with every batch
cut as it arrives, and the quick check that lets a batch be queued so never passes a batch the exact
checks refuse."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import staleness_metrics.engine.sink as sink_module
from staleness_metrics import RolloutBatch, Sink, StalenessConfig
from staleness_metrics.engine.spans import checked_spans
from staleness_metrics.errors import StalenessError
from staleness_metrics.records.model import ParsedRollout, pack, parse_or_error
from staleness_metrics.records.validation import plainly_valid
from tests.engine.test_checkpoint import POLICIES, config_of
from tests.reference.streams import DrawChooser, SeededChooser, generate_events, random_config


def play(config: StalenessConfig, events: list[dict[str, Any]], batching: random.Random) -> list[Any]:
    """Every call's outcome (an error's message included), the shipped arrays as masked, the sink's counts."""
    sink = Sink(config, compact_min_rows=batching.choice((0, 4096)))
    seen: list[Any] = []
    added: list[RolloutBatch] = []
    pending: list[dict[str, Any]] = []

    def add_pending() -> None:
        while pending:
            size = batching.choice((1, 1, 1, 2, 5))
            records = pending[:size]
            del pending[:size]
            parsed = [parse_or_error(r) for r in records]
            batch = pack([p for p in parsed if isinstance(p, ParsedRollout)]) if batching.random() < 0.5 else None
            try:
                if batch is not None and len(batch.ids) == len(records):
                    added.append(batch)  # a RolloutBatch the caller keeps: its arrays are masked in place
                    seen.append(sink.add(batch))
                else:
                    seen.append(sink.add(records))
            except (StalenessError, ValueError) as error:
                seen.append(f"{type(error).__name__}: {error}")
            if batching.random() < 0.2:
                seen.append((sink.queued, sink.tracked_rollouts, sink.tokens_queued, sink.tokens_entered))

    for event in events:
        if event["type"] == "rollout":
            pending.append(event["rollout"])
            continue
        add_pending()
        try:
            if event["type"] == "sweep":
                sink.sweep(event["step"])
                continue
            shipment = sink.ship(event["step"], event.get("ids"))
            seen.append((dict(shipment.metrics), shipment.batches_line(), shipment.lags.tolist()))
        except (StalenessError, ValueError) as error:
            seen.append(f"{type(error).__name__}: {error}")
    add_pending()
    seen.append((sink.queued, sink.tokens_queued, sink.tokens_entered, repr(sink.totals)))
    seen.append([b.mask.tolist() for b in added])
    return seen


def check_same(config: StalenessConfig, events: list[dict[str, Any]], seed: int) -> None:
    staged = play(config, events, random.Random(seed))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sink_module, "STAGE_MAX_POSITIONS", -1)  # every batch cut as it arrives
        direct = play(config, events, random.Random(seed))
    assert staged == direct


@pytest.mark.parametrize("policy", POLICIES)
def test_single_adds_decide_as_batches_cut_on_arrival(policy: str) -> None:
    for seed in range(6):
        chooser = SeededChooser(seed * 11 + len(policy))
        config = random_config(chooser, policy, lenient=seed % 2 == 1)
        check_same(config_of(config), generate_events(chooser, config, defects=seed % 3), seed)


@settings(max_examples=40)  # each example plays a stream twice; the seeded test above adds six per policy
@given(data=st.data())
def test_drawn_streams_decide_the_same_staged_or_not(data: st.DataObject) -> None:
    chooser = DrawChooser(data.draw)
    policy = data.draw(st.sampled_from(POLICIES), label="policy")
    config = random_config(chooser, policy, data.draw(st.booleans(), label="lenient"))
    events = generate_events(chooser, config, defects=data.draw(st.integers(0, 2), label="defects"))
    check_same(config_of(config), events, data.draw(st.integers(0, 2**16), label="batching"))


@settings(max_examples=60)
@given(data=st.data())
def test_the_quick_check_never_passes_what_the_exact_checks_refuse(data: st.DataObject) -> None:
    chooser = DrawChooser(data.draw)
    config = random_config(chooser, data.draw(st.sampled_from(POLICIES), label="policy"), lenient=True)
    events = generate_events(chooser, config, defects=data.draw(st.integers(0, 2), label="defects"))
    parsed = [parse_or_error(e["rollout"]) for e in events if e["type"] == "rollout"]
    records = [p for p in parsed if isinstance(p, ParsedRollout)]
    if not records:
        return
    batch = pack(records)
    known = set(data.draw(st.lists(st.sampled_from(list(batch.ids)), max_size=2), label="known ids"))
    if data.draw(st.booleans(), label="damage a value"):
        fields = ["mask", "rl_weights", "logprobs", "token_versions", "dispatch_version", "completion_version",
                  "label_kind", "sample_offsets", "position_offsets"]  # fmt: skip
        field = data.draw(st.sampled_from(fields), label="field")
        values = getattr(batch, field)
        if values is not None and len(values):
            at = data.draw(st.integers(0, len(values) - 1), label="position")
            if field in ("mask", "rl_weights", "logprobs"):
                values[at] = data.draw(st.sampled_from([np.nan, np.inf, 0.5, 2.0]), label="value")
            else:  # an integer out of its range, or offsets that go back
                values[at] = data.draw(st.sampled_from([-2, 3, values[at] - 1, values[at] + 1]), label="value")
    if plainly_valid(batch, known):
        assert not checked_spans(batch, known)[0].errors


def _record(rid: str, dispatch: int = 0) -> dict[str, Any]:
    return {"id": rid, "dispatch_version": dispatch, "samples": [{"mask": [0, 1, 1], "rl_weights": [0, 1, 1]}]}


@pytest.mark.parametrize("through", ["sink", "monitor"])
def test_loading_a_checkpoint_forgets_small_adds_not_yet_cut(through: str) -> None:
    """Rollouts added (and queued without being cut yet) before a load belong to the state the load replaces."""
    from staleness_metrics import StalenessMonitor

    config = StalenessConfig(max_staleness=2)

    def owner() -> Any:
        return Sink(config) if through == "sink" else StalenessMonitor(config, [])

    saved = owner()
    saved.add([_record("a"), _record("b")])
    state = saved.state_dict()
    live, fresh = owner(), owner()
    live.add(_record("x"))  # queued, not cut yet
    for target in (live, fresh):
        target.load_state_dict(state)
    sinks = [t if isinstance(t, Sink) else t.sink for t in (live, fresh)]
    assert [s.queued for s in sinks] == [2, 2]
    assert sinks[0].tokens_entered == sinks[1].tokens_entered == 4
    shipped = [s.ship(1) for s in sinks]
    assert shipped[0].ids == shipped[1].ids == ["a", "b"]
    assert shipped[0].batches_line() == shipped[1].batches_line()
    assert sinks[0].add(_record("x")) == 1  # its id was never accepted by the loaded state


def _small_batch(rid: str, rng: random.Random, step: int) -> RolloutBatch:
    """One rollout of a few positions: mostly float32 arrays with rl weights and token versions, now and
    then float64 ones or one of them missing (a batch of another kind among the staged ones)."""
    n = rng.randint(2, 9)
    odd = rng.random() < 0.1
    dtype = rng.choice((np.float32, np.float64)) if odd else np.float32
    mask = np.ones(n, dtype=dtype)
    mask[: rng.randint(0, n - 1)] = 0
    tokens = np.sort(np.array([rng.randint(max(step - 4, 0), step - 1) for _ in range(n)], dtype=np.int64))
    return RolloutBatch(
        ids=[rid], sample_offsets=np.arange(2), position_offsets=np.array([0, n]), mask=mask,
        dispatch_version=np.array([max(step - 4, 0)]), rl_weights=None if odd and rng.random() < 0.5 else mask * 2,
        token_versions=None if odd and rng.random() < 0.5 else tokens,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(3))
def test_sinks_adding_in_turn_on_one_thread_decide_as_each_alone(seed: int) -> None:
    """Small adds to several sinks in turn (their staged positions kept in the thread's buffers, lent to one
    sink at a time) ship, mask and count what each sink does when it is the only one."""
    config = StalenessConfig(policy="token", max_staleness=1)
    names = ("a", "b", "c")
    outcomes: dict[str, list[Any]] = {}
    for together in (False, True):
        rng = random.Random(seed)
        plan = [(step, name) for step in range(2, 7) for _ in range(rng.randint(1, 12)) for name in names]
        sinks = {name: Sink(config) for name in names}
        seen: dict[str, list[Any]] = {name: [] for name in names}
        for only in [None] if together else names:
            batches: dict[str, list[RolloutBatch]] = {name: [] for name in names}
            draw = random.Random(seed + 1)
            for i, (step, name) in enumerate(plan):
                batch = _small_batch(f"{name}{i}", draw, step)
                if only is None or name == only:
                    batches[name].append(batch)
                    seen[name].append(sinks[name].add(batch))
                if i + 1 == len(plan) or plan[i + 1][0] != step:  # the last add of a step: ship every sink
                    for ship_name in names[::-1] if step % 2 else names:
                        if only is None or ship_name == only:
                            shipment = sinks[ship_name].ship(step)
                            seen[ship_name].append((dict(shipment.metrics), shipment.batches_line()))
            for name in names:
                if only is None or name == only:
                    seen[name].append([b.mask.tolist() for b in batches[name]])
        outcomes[str(together)] = [seen[name] for name in names]
    assert outcomes["True"] == outcomes["False"]
    assert any(1 in mask for mask in outcomes["True"][0][-1])  # (some positions were trained, as sent)


# --- the staged rows built by a call a Ctrl-C interrupts ----------------------------------------


def _kind_batch(rid: str, dtype: Any, step: int) -> RolloutBatch:
    """One rollout of four positions, its mask and rl weights of ``dtype`` (another: another run)."""
    mask = np.array([0, 1, 1, 1], dtype=dtype)
    return RolloutBatch(
        ids=[rid], sample_offsets=np.arange(2), position_offsets=np.array([0, 4]), mask=mask,
        dispatch_version=np.array([step - 2]), rl_weights=mask * 2,
        token_versions=np.array([step - 2, step - 2, step - 1, step - 1]),
    )  # fmt: skip


@pytest.mark.parametrize("call", ["sweep", "ship", "state_dict"])
@pytest.mark.parametrize("at", ["build_spans", "append_rows", "set_aside"])
def test_adds_that_returned_survive_a_ctrl_c_while_their_staged_rows_are_built(
    call: str, at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC 6 / 13: the call after small adds builds their rows, a run of one kind at a time; a
    Ctrl-C landing in the middle run (its spans cut, its rows appended, or one rollout its caller
    changed since set aside) loses nothing: the runs not built stay staged, conservation holds, a
    checkpoint loads and the next ship is an uninterrupted run's."""
    import itertools

    import staleness_metrics.engine.queue as queue_module
    from tests.engine.test_sink import interrupt_once

    config = StalenessConfig(policy="xtuner", max_staleness=1, strict=False)
    interrupted, reference = Sink(config), Sink(config)
    for s in (interrupted, reference):
        s.add(_kind_batch("first", np.float32, 3))
        s.ship(3)  # (rows built and shipped: the staged rows come after others)
        runs = [np.float32] * 3 + [np.float64] * 3 + [np.float32] * 2
        batches = [_kind_batch(f"r{i}", dtype, 4) for i, dtype in enumerate(runs)]
        assert [s.add(batch) for batch in batches] == [1] * len(batches)  # (staged)
        batches[4].mask[1] = 7  # its caller changed it since: set aside when its rows are built
    assert interrupted.queued == len(batches) and interrupted.queue._staged
    calls = itertools.count()
    owner = queue_module if at == "build_spans" else queue_module.RolloutQueue
    middle = 0 if at == "set_aside" else 1  # (the call for the middle run)
    interrupt_once(monkeypatch, owner, at, lambda *args: next(calls) == middle)
    with pytest.raises(KeyboardInterrupt):
        interrupted.state_dict() if call == "state_dict" else getattr(interrupted, call)(4)
    assert next(calls) > middle  # (it fired)
    monkeypatch.undo()
    assert interrupted.queue._staged  # (the runs not built)
    assert interrupted.state_dict() == reference.state_dict()
    Sink(config).load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
    shipped = [s.ship(4) for s in (interrupted, reference)]
    assert shipped[0].ids == shipped[1].ids == [f"r{i}" for i in range(len(batches)) if i != 4]
    assert shipped[0].metrics == shipped[1].metrics
    assert (
        [str(e) for e in shipped[0].invalid]
        == [str(e) for e in shipped[1].invalid]
        == ["rollout 'r4': field samples[0].mask: position 1: expected 0 or 1"]
    )
    assert shipped[0].batches_line() == shipped[1].batches_line()
    released = [[batch is None for batch in s.queue.chunks] for s in (interrupted, reference)]
    assert released[0] == released[1] and released[0][-4]  # (the set-aside rollout's batch let go of)
    for s in (interrupted, reference):
        totals = s.totals
        assert s.tokens_entered == totals.tokens_sampled + totals.tokens_dropped + s.tokens_queued
