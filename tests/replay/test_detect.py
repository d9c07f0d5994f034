"""Choosing the reader by what a run input is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from staleness_metrics.errors import ConfigError, EventError
from staleness_metrics.replay.sources import detect_and_read, detect_source
from tests.support.examples import EXAMPLES


def test_each_kind_of_input_is_recognised(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('\n{"type": "ship", "step": 1}\n')
    assert detect_source(EXAMPLES / "prime-rl-run") == "prime-rl"
    assert detect_source(EXAMPLES / "xtuner-states.jsonl") == "xtuner"
    assert detect_source(EXAMPLES / "prime-rl-run" / "metrics.jsonl") == "metrics"
    assert detect_source(events) == "events"
    assert list(detect_and_read(events)) == [{"type": "ship", "step": 1}]


def test_inputs_that_are_none_of_them_say_what_was_expected(tmp_path: Path) -> None:
    empty, other, directory = tmp_path / "empty.jsonl", tmp_path / "other.jsonl", tmp_path / "dir"
    empty.write_text("\n")
    other.write_text(json.dumps({"hello": 1}) + "\n")
    directory.mkdir()
    for path, message in (
        (empty, "empty"),
        (other, "not an event stream"),
        (directory, "rollouts/step_N"),
        (tmp_path / "missing", "no such file"),
    ):
        with pytest.raises(ConfigError, match=message):
            detect_source(path)


def test_logged_metrics_cannot_be_replayed() -> None:
    with pytest.raises(ConfigError, match="logged metrics, not events"):
        detect_and_read(EXAMPLES / "prime-rl-run" / "metrics.jsonl")


def test_a_bad_line_in_an_event_file_names_its_line(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('{"type": "ship", "step": 1}\n{"type": \n')
    with pytest.raises(EventError, match="line 2"):
        list(detect_and_read(events))
