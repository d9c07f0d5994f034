"""The queue saves and restores its own state: what a sink's checkpoint holds of it comes from it alone, and
a queue loaded from that state carries on exactly as the one that saved it."""

from __future__ import annotations

import json

import pytest

from staleness_metrics import ConfigError, Sink, StalenessConfig
from staleness_metrics.engine.queue_state import QUEUE_KEYS, read_queue, save_queue


def _sink_with_a_queue() -> Sink:
    sink = Sink(StalenessConfig(policy="group", max_staleness=2))
    sink.add(
        [
            {"id": "a", "group_id": "g", "env": "math", "dispatch_version": 0, "samples": [{"mask": [0, 1, 1]}]},
            {"id": "b", "group_id": "g", "dispatch_version": 1, "samples": [{"mask": [1, 1]}, {"mask": [1]}]},
            {"id": "c", "dispatch_version": 0, "samples": [{"mask": [1, 1, 1, 1]}]},
        ]
    )
    sink.ship(2, ids=["c"])
    sink.add({"id": "d", "group_id": "h", "dispatch_version": 2, "samples": [{"mask": [1, 0, 1]}]})
    return sink


def test_the_sink_state_holds_the_queue_state_as_the_queue_wrote_it() -> None:
    sink = _sink_with_a_queue()
    queue_state = json.loads(json.dumps(save_queue(sink.queue)))
    assert set(queue_state) == set(QUEUE_KEYS)
    assert [batch["ids"]["list"] for batch in queue_state["batches"]] == [["a", "b"], ["d"]]
    assert len(queue_state["judged"]) == 3 and len(queue_state["mask_below"]) == 4  # (b has two samples)
    sink_state = json.loads(json.dumps(sink.state_dict()))
    assert sink_state["queue"] == queue_state


def test_a_loaded_queue_carries_on_like_the_one_that_saved_it() -> None:
    saved = _sink_with_a_queue()
    state = json.loads(json.dumps(save_queue(saved.queue)))
    loaded = Sink(StalenessConfig(policy="group", max_staleness=2))
    loaded.queue = read_queue(state, loaded.policy.observe_added, step=saved.step)
    assert save_queue(loaded.queue) == save_queue(saved.queue)
    assert (loaded.queued, loaded.tokens_queued) == (saved.queued, saved.tokens_queued)
    # the policy and the step are the sink's: give the loaded sink the saved one's, then both ship alike
    loaded.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    assert loaded.ship(4).batches_line() == saved.ship(4).batches_line()


def test_a_bad_queue_state_is_refused_by_its_key_and_changes_nothing() -> None:
    sink = _sink_with_a_queue()
    state = json.loads(json.dumps(save_queue(sink.queue)))
    before = save_queue(sink.queue)
    state["judged"].append(0)
    with pytest.raises(ConfigError, match=r"checkpoint: judged: 4 entries where 3 are needed"):
        read_queue(state, sink.policy.observe_added, step=sink.step)
    assert save_queue(sink.queue) == before
