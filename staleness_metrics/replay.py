"""Replay of a recorded event stream (SPEC 9): the sink run over JSON lines, no service, no network."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import IO, Any

from . import jsonio
from .config import StalenessConfig
from .errors import EventError, TraceError
from .records import ParsedRollout, UnparsedRollout, parse_or_error
from .sink import Shipment, Sink

__all__ = ["Added", "Event", "parse_event", "prepare", "read_events", "replay", "run_events", "run_steps"]


@dataclass(frozen=True)
class Event:
    """One line of an event stream: ``kind`` is ``rollout``, ``sweep`` or ``ship``."""

    line: int
    kind: str
    rollout: dict[str, Any] | None = None
    step: int = 0
    ids: tuple[str, ...] | None = None
    booleans: bool = True  # a rollout line may hold JSON booleans (False: a faster check of its numbers)


def _step(line: int, raw: dict[str, Any]) -> int:
    step = raw.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise EventError(line, f"'step' must be an integer >= 1, got {step!r}")
    return step


def parse_event(line: int, raw: object) -> Event:
    """Check one decoded event object; raises :class:`EventError` naming the line."""
    if not isinstance(raw, dict):
        raise EventError(line, f"expected a JSON object, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "rollout":
        if not isinstance(raw.get("rollout"), dict):
            raise EventError(line, "a rollout event needs a 'rollout' object")
        return Event(line, "rollout", rollout=raw["rollout"])
    if kind == "sweep":
        return Event(line, "sweep", step=_step(line, raw))
    if kind == "ship":
        ids = raw.get("ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise EventError(line, "'ids' must be a list of strings")
        return Event(line, "ship", step=_step(line, raw), ids=None if ids is None else tuple(ids))
    raise EventError(line, f"unknown event type {kind!r} (expected rollout, sweep or ship)")


def read_events(source: IO[str] | IO[bytes] | Iterable[str | bytes]) -> Iterator[Event]:
    """Decode JSON lines (blank lines skipped) into events, checking steps never decrease."""
    last_step = 0
    for number, text in enumerate(source, start=1):
        if not text.strip():
            continue
        try:
            raw = jsonio.loads(text)
        except jsonio.DecodeError as error:
            raise EventError(number, f"bad JSON: {error.msg}") from None
        event = parse_event(number, raw)
        if event.kind != "rollout":
            if event.step < last_step:
                raise EventError(number, f"step {event.step} is below an earlier step {last_step}")
            last_step = event.step
        else:  # a line without true / false cannot hide a boolean among numbers
            marks = (b"true", b"false") if isinstance(text, bytes) else ("true", "false")
            event = replace(event, booleans=marks[0] in text or marks[1] in text)  # type: ignore[operator]
        yield event


@dataclass(frozen=True)
class Added:
    """Consecutive rollout events, type-checked into columnar-ready records (no JSON objects kept)."""

    lines: tuple[int, ...]
    items: tuple[ParsedRollout | UnparsedRollout, ...]


Step = Added | Event  # what a sink does next: add some rollouts, or a sweep / ship event


def prepare(events: Iterable[Event], batch_size: int = 512) -> Iterator[Step]:
    """Events as the sink's steps: each rollout parsed as it is read, consecutive ones added together.

    The steps do not depend on the sink's settings, so one prepared stream can be run by several sinks
    (:func:`run_steps`); every run packs its own copy of the arrays.
    """
    lines: list[int] = []
    items: list[ParsedRollout | UnparsedRollout] = []
    for event in events:
        if event.kind == "rollout":
            lines.append(event.line)
            items.append(parse_or_error(event.rollout or {}, booleans=event.booleans))
            if len(items) >= batch_size:
                yield Added(tuple(lines), tuple(items))
                lines, items = [], []
            continue
        if items:
            yield Added(tuple(lines), tuple(items))
            lines, items = [], []
        yield event
    if items:
        yield Added(tuple(lines), tuple(items))


def run_steps(steps: Iterable[Step], sink: Sink) -> Iterator[Shipment]:
    """Run prepared steps through ``sink``, yielding each ship's result as it happens.

    A rollout the sink rejects (strict mode) raises :class:`EventError` naming its line.
    """
    for step in steps:
        if isinstance(step, Added):
            try:
                sink.add_parsed(step.items)
            except TraceError:
                # Strict mode added nothing: add one by one to find the offending line.
                for line, item in zip(step.lines, step.items):
                    try:
                        sink.add_parsed((item,))
                    except TraceError as error:
                        raise EventError(line, str(error)) from error
            continue
        try:
            if step.kind == "sweep":
                sink.sweep(step.step)
            else:
                yield sink.ship(step.step, step.ids)
        except TraceError as error:
            raise EventError(step.line, str(error)) from error


def run_events(events: Iterable[Event], sink: Sink, batch_size: int = 512) -> Iterator[Shipment]:
    """Feed events to ``sink``, yielding each ship's result as it happens.

    Consecutive rollout events are added together (one columnar batch, same outcome as one by one).
    A rollout the sink rejects (strict mode) raises :class:`EventError` naming its line.
    """
    return run_steps(prepare(events, batch_size), sink)


def replay(events: Iterable[Event], config: StalenessConfig) -> list[Shipment]:
    """Run a fresh sink with ``config`` over ``events``; one :class:`Shipment` per ship."""
    return list(run_events(events, Sink(config)))
