"""Replay of a recorded event stream (SPEC 9): the sink run over JSON lines, no service, no network."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from . import jsonio, simd_records
from .columnar import WEIGHT_FIELDS, RolloutBatch
from .config import StalenessConfig
from .errors import EventError, TraceError
from .records import ParsedRollout, UnparsedRollout, pack, parse_or_error
from .sink import Shipment, Sink
from .spans import SpanTable, build_spans
from .validation import Verdicts, check_batch

__all__ = [
    "Added",
    "Event",
    "pack_once",
    "parse_event",
    "prepare",
    "read_events",
    "replay",
    "run_events",
    "run_steps",
]


@dataclass(frozen=True)
class Event:
    """One line of an event stream: ``kind`` is ``rollout``, ``sweep`` or ``ship``.

    A rollout event holds its decoded record (``rollout``), or, read by ``read_events(parse=True)``,
    the record already type-checked into arrays (``parsed``).
    """

    line: int
    kind: str
    rollout: dict[str, Any] | None = None
    step: int = 0
    ids: tuple[str, ...] | None = None
    booleans: bool = True  # a rollout line may hold JSON booleans (False: a faster check of its numbers)
    parsed: ParsedRollout | None = None


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


def _decoded(number: int, text: str | bytes) -> Event:
    """One line decoded by :func:`.jsonio.loads` and checked as an event."""
    try:
        raw = jsonio.loads(text)
    except jsonio.DecodeError as error:
        raise EventError(number, f"bad JSON: {error.msg}") from None
    event = parse_event(number, raw)
    if event.kind == "rollout":  # a line without true / false cannot hide a boolean among numbers
        marks = (b"true", b"false") if isinstance(text, bytes) else ("true", "false")
        booleans = marks[0] in text or marks[1] in text  # type: ignore[operator]
        event = Event(number, "rollout", rollout=event.rollout, booleans=booleans)
    return event


_PARSE_LINES = 64  # rollout lines whose values are checked together (:meth:`LineReader.finish`)


def read_events(source: IO[str] | IO[bytes] | Iterable[str | bytes], *, parse: bool = False) -> Iterator[Event]:
    """Decode JSON lines (blank lines skipped) into events, checking steps never decrease.

    ``parse=True``: a valid rollout line given as bytes is read straight into arrays
    (:mod:`.simd_records`, where pysimdjson is installed) and its event holds ``parsed`` instead of
    ``rollout``; :func:`prepare` takes either. Other lines are decoded as always.
    """
    last_step = 0
    reader = simd_records.LineReader() if parse and simd_records.AVAILABLE else None
    taken: list[tuple[int, bytes]] = []

    def finish() -> Iterator[Event]:
        assert reader is not None
        for (number, text), parsed in zip(taken, reader.finish()):
            yield _decoded(number, text) if parsed is None else Event(number, "rollout", parsed=parsed)
        taken.clear()

    for number, text in enumerate(source, start=1):
        if not text or text.isspace():  # as ``not text.strip()``, without copying the line
            continue
        if reader is not None and isinstance(text, bytes) and reader.take(text):
            taken.append((number, text))
            if len(taken) >= _PARSE_LINES:
                yield from finish()
            continue
        if taken:
            yield from finish()
        event = _decoded(number, text)
        if event.kind != "rollout":
            if event.step < last_step:
                raise EventError(number, f"step {event.step} is below an earlier step {last_step}")
            last_step = event.step
        yield event
    if taken:
        yield from finish()


@dataclass(frozen=True)
class Added:
    """Consecutive rollout events, type-checked into columnar-ready records (no JSON objects kept)."""

    lines: tuple[int, ...]
    items: tuple[ParsedRollout | UnparsedRollout, ...]
    packed: RolloutBatch | None = None  # the parsed items packed once (:func:`pack_once`); runs add copies
    checked: tuple[Verdicts, SpanTable] | None = None  # and checked once, as every run's sink checks them


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
            parsed = event.parsed
            items.append(parsed if parsed is not None else parse_or_error(event.rollout or {}, booleans=event.booleans))
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


def pack_once(steps: Iterable[Step]) -> list[Step]:
    """The steps with each :class:`Added`'s parsed rollouts packed into a batch, for several runs.

    Each run then adds a copy of the batch (a sink masks the arrays it holds in place) instead of
    packing the records again: one copy per array rather than a concatenation of every sample's.
    The batch is also checked once (:func:`check_batch`, :func:`build_spans`): what a sink finds
    depends only on the batch as it arrives and on the ids accepted before it, which are the same in
    every run of the steps (a sink accepts every valid rollout it is given, whatever its bound).
    """
    out: list[Step] = []
    accepted: set[str] = set()
    for step in steps:
        if isinstance(step, Added):
            parsed = [item for item in step.items if isinstance(item, ParsedRollout)]
            packed = _share(pack(parsed)) if parsed else None
            checked = None
            if packed is not None:
                verdicts = check_batch(packed, accepted)
                spans = build_spans(packed, verdicts)
                for f in dataclasses.fields(spans):  # shared by every run, like the packed arrays
                    if isinstance(value := getattr(spans, f.name), np.ndarray):
                        value.setflags(write=False)
                checked = verdicts, spans
                accepted.update(packed.ids[i] for i in np.flatnonzero(~verdicts.invalid).tolist())
            step = dataclasses.replace(step, packed=packed, checked=checked)
        out.append(step)
    return out


_MASKED_FIELDS = ("mask", *WEIGHT_FIELDS)  # the arrays a sink writes (masks in place)


def _copy(batch: RolloutBatch) -> RolloutBatch:
    """A batch for one more run: copies of the arrays a sink masks in place, the others shared.

    The shared arrays are made read-only (:func:`_share`), so that a sink that wrote into one would fail
    loudly rather than change what the other runs read."""
    arrays = {name: value.copy() for name in _MASKED_FIELDS if (value := getattr(batch, name)) is not None}
    return dataclasses.replace(batch, **arrays, present={k: v.copy() for k, v in batch.present.items()})


def _share(batch: RolloutBatch) -> RolloutBatch:
    """``batch`` with every array but the masked ones read-only (they are shared by :func:`_copy`)."""
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, np.ndarray) and f.name not in _MASKED_FIELDS:
            value.setflags(write=False)
    return batch


def run_steps(steps: Iterable[Step], sink: Sink) -> Iterator[Shipment]:
    """Run prepared steps through ``sink``, yielding each ship's result as it happens.

    A rollout the sink rejects (strict mode) raises :class:`EventError` naming its line.
    """
    for step in steps:
        if isinstance(step, Added):
            try:
                sink.add_parsed(step.items, None if step.packed is None else _copy(step.packed), step.checked)
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
