"""Annotation updates folded back onto the episodes (``prime-rl-traces.md`` sections 6-9) in two
passes: :func:`scan_updates` (the ships, no token data), then a :class:`StreamFeed` per producer.
What a producer writes is read from its updates, never assumed from its name."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import lazy
from .chunks import ChunkDamage, ChunkFile, Line, read_files
from .damage import Damage
from .episodes import Stream

STREAM_FIELD = "trainer_logprobs"


@dataclass
class TraceFacts:
    """What the updates say of one trace: its ship and where it was first named."""

    effective: bool | None = None
    ship_step: int | None = None
    where: tuple[Path, int] | None = None

    @property
    def shipped_at(self) -> int | None:
        return self.ship_step if self.effective else None


@dataclass
class Updates:
    traces: dict[str, TraceFacts] = field(default_factory=dict)
    # producer -> trace -> ordinal of its last update carrying a stream
    last_stream: dict[str, dict[str, int]] = field(default_factory=dict)
    torn: int = 0


def read_updates(
    files: list[ChunkFile], parser: lazy.Parser, damage: Damage, *, quiet: bool = False
) -> Iterator[tuple[int, Line, Any]]:
    """``(ordinal, line, update)`` of a producer's updates in order, ``update`` None for a torn last
    line (it ends the stream); others that are not updates go to ``damage`` (``quiet``: skipped)."""

    def bad_chunk(error: ChunkDamage) -> None:
        if not quiet:
            damage.report("bad_chunk", error.path, error.line, error.reason)

    ordinal = 0
    for last, line in read_files(files, bad_chunk):
        ordinal += 1
        try:
            doc = parser.parse(line.text)
        except lazy.DecodeError as error:
            if not line.ended:
                if last:
                    yield ordinal, line, None
                elif not quiet:
                    damage.report("bad_line", line.file.path, line.number, f"a torn line ({error})")
                continue
            if not quiet:
                damage.report("bad_line", line.file.path, line.number, f"not JSON ({error})")
            continue
        reason = _update_fault(doc)
        if reason is not None:
            del doc
            if not quiet:
                damage.report("not_update", line.file.path, line.number, reason)
            continue
        yield ordinal, line, doc
        del doc


def _update_fault(doc: object) -> str | None:
    if not lazy.is_object(doc):
        return "not an update (expected a JSON object)"
    trace_id = lazy.get(doc, "trace_id")
    if not isinstance(trace_id, str) or not trace_id:
        return "not an update (expected a string 'trace_id')"
    info = lazy.get(doc, "info")
    if info is not None and not lazy.is_object(info):
        return f"trace {trace_id!r}: 'info' is not an object"
    branches = lazy.get(doc, "branches")
    if branches is None:
        return None
    if not lazy.is_array(branches):
        return f"trace {trace_id!r}: 'branches' is not a list"
    for i, branch in enumerate(branches):
        index = lazy.get(branch, "index")
        if not lazy.is_object(branch) or not isinstance(index, int) or isinstance(index, bool) or index < 0:
            return f"trace {trace_id!r}: branches[{i}] has no index >= 0"
    return None


def _merge_info(facts: TraceFacts, info: object) -> None:
    """prime-rl's deep merge of ``info`` (the newest value wins), for a ship's keys."""
    effective = lazy.get(info, "effective")
    if effective is not None:
        facts.effective = effective is True
    ship = lazy.get(info, "ship")
    if lazy.is_object(ship):
        step = lazy.get(ship, "step")
        if step is not None:
            facts.ship_step = step if isinstance(step, int) and not isinstance(step, bool) else None
    elif ship is not None:
        facts.ship_step = None  # replaced by a value that is not a ship


def scan_updates(producers: dict[str, list[ChunkFile]], damage: Damage) -> Updates:
    """Per trace, its ship (``info.effective``, ``info.ship.step``), its last ``trainer_logprobs``
    update and where it was first named."""
    out = Updates()
    parser = lazy.Parser()
    for producer, files in producers.items():
        last: dict[str, int] = {}
        for ordinal, line, doc in read_updates(files, parser, damage):
            if doc is None:
                out.torn += 1
                continue
            trace_id = lazy.get(doc, "trace_id")
            facts = out.traces.get(trace_id)
            if facts is None:
                facts = out.traces[trace_id] = TraceFacts(where=(line.file.path, line.number))
            info = lazy.get(doc, "info")
            if info is not None:
                _merge_info(facts, info)
            branches = lazy.get(doc, "branches")
            if branches is not None and any(lazy.get(b, STREAM_FIELD) is not None for b in branches):
                last[trace_id] = ordinal
            del doc, info, branches
        if last:
            out.last_stream[producer] = last
    return out


class StreamFeed:
    """One producer's ``trainer_logprobs`` streams, read alongside the episode stream and handed
    out trace by trace (what is read ahead waits)."""

    def __init__(self, files: list[ChunkFile], last: dict[str, int], damage: Damage) -> None:
        self._last = last
        self._damage = damage
        self._updates = read_updates(files, lazy.Parser(), damage, quiet=True)
        self._read = 0  # ordinal of the last update read
        self._held: dict[str, dict[int, list[Stream]]] = {}
        self._done = False

    @property
    def held(self) -> int:
        return len(self._held)

    def pull(self, trace_id: str) -> dict[int, list[Stream]]:
        """The streams of ``trace_id`` per branch index, in write order."""
        target = self._last.pop(trace_id, 0)
        while self._read < target and not self._done:
            self._read_one()
        return self._held.pop(trace_id, {})

    def _read_one(self) -> None:
        try:
            ordinal, line, doc = next(self._updates)
        except StopIteration:
            self._done = True
            return
        self._read = ordinal
        if doc is None:  # the torn tail (counted by the first pass)
            return
        trace_id = lazy.get(doc, "trace_id")
        branches = lazy.get(doc, "branches") or ()
        for branch in branches:
            value = lazy.get(branch, STREAM_FIELD)
            if value is None:
                continue
            index = lazy.get(branch, "index")
            try:
                values = lazy.as_floats(value, nulls=True)
            except TypeError as error:
                self._damage.report(
                    "bad_update",
                    line.file.path,
                    line.number,
                    f"trace {trace_id!r} branch {index}: {STREAM_FIELD} is not a list of numbers or nulls ({error})",
                )
                continue
            if not values.flags.writeable:
                values = values.copy()
            stream = Stream(values, str(line.file.path), line.number)
            self._held.setdefault(trace_id, {}).setdefault(index, []).append(stream)
        del doc, branches
