"""Replay of a recorded event stream (SPEC 9): the sink run over JSON lines, no service, no network."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from .config import StalenessConfig
from .errors import EventError, TraceError
from .sink import Shipment, Sink

__all__ = ["Event", "parse_event", "read_events", "replay", "run_events"]


@dataclass(frozen=True)
class Event:
    """One line of an event stream: ``kind`` is ``rollout``, ``sweep`` or ``ship``."""

    line: int
    kind: str
    rollout: dict[str, Any] | None = None
    step: int = 0
    ids: tuple[str, ...] | None = None


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


def read_events(source: IO[str] | Iterable[str]) -> Iterator[Event]:
    """Decode JSON lines (blank lines skipped) into events, checking steps never decrease."""
    last_step = 0
    for number, text in enumerate(source, start=1):
        if not text.strip():
            continue
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise EventError(number, f"bad JSON: {error.msg}") from None
        event = parse_event(number, raw)
        if event.kind != "rollout":
            if event.step < last_step:
                raise EventError(number, f"step {event.step} is below an earlier step {last_step}")
            last_step = event.step
        yield event


def run_events(events: Iterable[Event], sink: Sink, batch_size: int = 512) -> Iterator[Shipment]:
    """Feed events to ``sink``, yielding each ship's result as it happens.

    Consecutive rollout events are added together (one columnar batch, same outcome as one by one).
    A rollout the sink rejects (strict mode) raises :class:`EventError` naming its line.
    """
    pending: list[Event] = []

    def flush() -> None:
        try:
            sink.add([e.rollout or {} for e in pending])
        except TraceError:
            # Strict mode added nothing: replay one by one to find the offending line.
            for event in pending:
                try:
                    sink.add(event.rollout or {})
                except TraceError as error:
                    raise EventError(event.line, str(error)) from error
        pending.clear()

    for event in events:
        if event.kind == "rollout":
            pending.append(event)
            if len(pending) >= batch_size:
                flush()
            continue
        if pending:
            flush()
        try:
            if event.kind == "sweep":
                sink.sweep(event.step)
            else:
                yield sink.ship(event.step, event.ids)
        except TraceError as error:
            raise EventError(event.line, str(error)) from error
    if pending:
        flush()


def replay(events: Iterable[Event], config: StalenessConfig) -> list[Shipment]:
    """Run a fresh sink with ``config`` over ``events``; one :class:`Shipment` per ship."""
    return list(run_events(events, Sink(config)))
