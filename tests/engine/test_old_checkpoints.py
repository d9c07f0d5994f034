"""SPEC 13 across versions: checkpoints written by the code before checkpoints of meaning (format 2: the queue's
tables and batches, tests/engine/old_checkpoints/, made by its make.py with that tree) load into today's monitor
and continue exactly as a run never stopped: the same ships, records, lags, counters, histograms and queue."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from staleness_metrics import ConfigError
from tests.engine.test_checkpoint import config_of, final_state, new_monitor
from tests.engine.test_checkpoint_cuts import apply
from tests.reference.streams import ReplayConfig

FIXTURES = sorted((Path(__file__).parent / "old_checkpoints").glob("*.json"))


def load(path: Path) -> tuple[Any, dict[str, Any]]:
    record = json.loads(path.read_text())
    return config_of(ReplayConfig(**record["config"])), record


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_an_old_checkpoint_continues_as_a_run_never_stopped(path: Path) -> None:
    config, record = load(path)
    calls = record["calls"]
    monitor = new_monitor(config)
    outputs = [apply(monitor, call) for call in calls]
    uninterrupted = outputs, final_state(monitor)
    assert record["checkpoints"]
    for checkpoint in record["checkpoints"]:
        start, state = checkpoint["before_call"], checkpoint["state"]
        assert state["format"] == 2 and "tables" in state["sink"]
        resumed = new_monitor(config)
        resumed.load_state_dict(state)
        continued = [apply(resumed, call) for call in calls[start:]]
        assert continued == uninterrupted[0][start:], f"{path.name}: calls from {start}"
        assert final_state(resumed) == uninterrupted[1]
        # and saved again, now in today's format, it loads and continues the same
        again = new_monitor(config)
        again.load_state_dict(json.loads(json.dumps(new_monitor_state(config, state))))


def new_monitor_state(config: Any, state: dict[str, Any]) -> dict[str, Any]:
    monitor = new_monitor(config)
    monitor.load_state_dict(state)
    saved = monitor.state_dict()
    assert saved["format"] == 3 and "queue" in saved["sink"] and "tables" not in saved["sink"]
    return saved


def test_a_damaged_old_checkpoint_is_refused_by_its_key_path() -> None:
    config, record = load(FIXTURES[0])
    state = next(c["state"] for c in record["checkpoints"] if c["state"]["sink"]["ids"])
    state["sink"]["tables"]["rollouts"]["chunk"]["data"][0] = 10**6
    monitor = new_monitor(config)
    with pytest.raises(ConfigError, match=r"checkpoint: sink\.tables\.rollouts\.chunk: values are chunk numbers"):
        monitor.load_state_dict(state)
