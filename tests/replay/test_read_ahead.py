"""``read_events(read_ahead=True)``, as ``replay`` and ``what-if`` read a file: the same events in the same
order as the plain read, and every error (a malformed line, a decreasing step, a file that fails while
being read) raised after the same events, however rollout, ship and sweep lines alternate.

The read ahead checks the values of up to 64 rollout lines together across ship lines; without it a ship
line's event is handed on as soon as the line is read (a live stream's ships are never held back).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.errors import EventError
from staleness_metrics.records import simd_records
from staleness_metrics.replay.stream import Event, read_events


def rollout(number: int, mask: str = "[0, 1, 1]", extra: str = "") -> bytes:
    sample = f'{{"mask": {mask}, "token_versions": [-1, 0, 0], "logprobs": [-0.5, -1.25, -2]}}'
    record = f'{{"id": "r{number}", "dispatch_version": 0{extra}, "samples": [{sample}]}}'
    return f'{{"type": "rollout", "rollout": {record}}}'.encode()


KINDS = st.sampled_from(
    [
        *["plain"] * 12,  # read by the simdjson path
        "mask of 2",  # taken, then refused when the values are checked: the general path reads it
        "boolean",  # left to the general path as it is read
        "ship",
        "ship",
        "sweep",
        "step down",
        "bad json",
        "blank",
    ]
)


def lines_of(kinds: list[str]) -> list[bytes]:
    lines, step = [], 1
    for number, kind in enumerate(kinds):
        if kind == "plain":
            lines.append(rollout(number))
        elif kind == "mask of 2":
            lines.append(rollout(number, mask="[0, 2, 1]"))
        elif kind == "boolean":
            lines.append(rollout(number, extra=', "agentic": true'))
        elif kind in ("ship", "sweep"):
            step += 1
            lines.append(json.dumps({"type": kind, "step": step}).encode())
        elif kind == "step down":
            lines.append(json.dumps({"type": "ship", "step": max(1, step - 1)}).encode())
        elif kind == "bad json":
            lines.append(b'{"type": "ship", ')
        else:
            lines.append(b"   \n")
    return lines


class Damaged(OSError):
    """What a decompressing reader raises on damaged data."""


def source(lines: list[bytes], fail_at: int | None) -> Iterator[bytes]:
    for index, line in enumerate(lines):
        if index == fail_at:
            raise Damaged("damaged data")
        yield line


def view(event: Event) -> tuple[Any, ...]:
    parsed = event.parsed
    arrays = None
    if parsed is not None:
        sample = parsed.samples[0]
        assert sample.token_versions is not None and sample.logprobs is not None
        arrays = (parsed.id, sample.mask.tolist(), sample.token_versions.tolist(), sample.logprobs.tolist())
    return event.line, event.kind, event.step, event.ids, event.rollout, event.booleans, arrays, event.unparsed


def outcome(
    lines: list[bytes], fail_at: int | None, read_ahead: bool, parse: bool = True
) -> tuple[list[tuple[Any, ...]], str | None]:
    seen = []
    try:
        for event in read_events(source(lines, fail_at), parse=parse, read_ahead=read_ahead):
            seen.append(view(event))
    except (EventError, Damaged) as error:
        return seen, f"{type(error).__name__}: {error}"
    return seen, None


@settings(max_examples=300, deadline=None)
@given(st.lists(KINDS, max_size=300), st.none() | st.integers(0, 300))
def test_reading_ahead_yields_the_same_events_and_errors_after_the_same_events(
    kinds: list[str], fail_at: int | None
) -> None:
    lines = lines_of(kinds)
    ahead = outcome(lines, fail_at, read_ahead=True)
    assert ahead == outcome(lines, fail_at, read_ahead=False)
    # the lines the general path reads one by one, each before an error (a damaged file's too)
    general = outcome(lines, fail_at, read_ahead=False, parse=False)
    assert ([seen[:2] for seen in ahead[0]], ahead[1]) == ([seen[:2] for seen in general[0]], general[1])
    # and the plain lines were read by the simdjson path (else this would compare the general path with itself)
    if simd_records.AVAILABLE and "plain" in kinds[: min(len(kinds), fail_at or len(kinds))]:
        assert ahead[0] == [] or any(seen[6] is not None for seen in ahead[0]) or ahead[1] is not None


@pytest.mark.parametrize("ships_every", [1, 3, 64, 65])
def test_a_long_stream_is_read_the_same_ahead_or_not(ships_every: int) -> None:
    kinds = [kind for k in range(400) for kind in (["plain", "ship"] if (k + 1) % ships_every == 0 else ["plain"])]
    lines = lines_of(kinds)
    for fail_at in (None, 70, 129, 250):
        ahead = outcome(lines, fail_at, read_ahead=True)
        assert ahead == outcome(lines, fail_at, read_ahead=False)
        if fail_at is None:
            assert sum(seen[6] is not None for seen in ahead[0]) == (400 if simd_records.AVAILABLE else 0)


def test_without_read_ahead_a_ship_is_handed_on_as_soon_as_its_line_is_read() -> None:
    """A live stream: the ship event comes before the next line is asked for."""
    asked = []

    def live() -> Iterator[bytes]:
        for number, line in enumerate(lines_of(["plain", "plain", "ship", "plain", "ship"]), start=1):
            asked.append(number)
            yield line

    for event in read_events(live(), parse=True):
        if event.kind == "ship":
            assert asked[-1] == event.line
