"""A prime-rl run in the current layout as the SPEC 9 event stream it implies, its annotation
updates read in two passes (:func:`scan_updates`: ships; :class:`StreamFeed`: trainer streams)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ....errors import ConfigError, EventError
from ....records.model import ParsedRollout, UnparsedRollout
from ...stream import Event
from . import lazy
from .chunks import ChunkFile, Damage, IndexCheck, Line, TracesLayout, find_layout, read_files
from .episodes import EpisodeHead, NotAnEpisode, Stream, TraceHead, episode_head, trace_rollout
from .legacy import stale_at_arrival

STREAM_FIELD = "trainer_logprobs"


@dataclass
class TraceFacts:
    """What the updates say of one trace: its ship and where it was first named."""

    effective: bool | None = None
    ship_step: int | None = None
    where: tuple[Path, int] | None = None


@dataclass
class Updates:
    traces: dict[str, TraceFacts] = field(default_factory=dict)
    # producer -> trace -> ordinal of its last update carrying a stream
    last_stream: dict[str, dict[str, int]] = field(default_factory=dict)
    torn: int = 0


def read_updates(files: list[ChunkFile], damage: Damage) -> Iterator[tuple[int, Line, Any]]:
    """``(ordinal, line, update)`` of a producer's updates in order, ``update`` None for a torn last
    line (it ends the stream); others that are not updates go to ``damage``."""
    parser = lazy.Parser()
    ordinal = 0
    for last, line in read_files(files, damage):
        ordinal += 1
        try:
            doc = parser.parse(line.text)
        except lazy.DecodeError as error:
            if not line.ended and last:
                yield ordinal, line, None
            else:
                fault = "not JSON" if line.ended else "a torn line"
                damage.report("bad_line", line.file.path, line.number, f"{fault} ({error})")
            continue
        if (reason := update_fault(doc)) is not None:
            del doc
            damage.report("not_update", line.file.path, line.number, reason)
            continue
        yield ordinal, line, doc
        del doc


def update_fault(doc: object) -> str | None:
    if not lazy.is_object(doc):
        return "not an update (expected a JSON object)"
    trace_id = lazy.get(doc, "trace_id")
    if not isinstance(trace_id, str) or not trace_id:
        return "not an update (expected a string 'trace_id')"
    if (info := lazy.get(doc, "info")) is not None and not lazy.is_object(info):
        return f"trace {trace_id!r}: 'info' is not an object"
    branches = lazy.get(doc, "branches")
    if branches is None:
        return None
    if not lazy.is_array(branches):
        return f"trace {trace_id!r}: 'branches' is not a list"
    for i, branch in enumerate(branches):
        index = lazy.get(branch, "index")
        if not lazy.is_object(branch) or type(index) is not int or index < 0:  # (a bool is no index)
            return f"trace {trace_id!r}: branches[{i}] has no index >= 0"
    return None


def _merge_info(facts: TraceFacts, info: object) -> None:
    """prime-rl's deep merge of ``info`` (the newest value wins), for a ship's keys."""
    if (effective := lazy.get(info, "effective")) is not None:
        facts.effective = effective is True
    ship = lazy.get(info, "ship")
    if lazy.is_object(ship):
        if (step := lazy.get(ship, "step")) is not None:
            facts.ship_step = step if isinstance(step, int) and not isinstance(step, bool) else None
    elif ship is not None:
        facts.ship_step = None  # replaced by a value that is not a ship


def scan_updates(producers: dict[str, list[ChunkFile]], damage: Damage) -> Updates:
    """Per trace, its ship (``info.effective``, ``info.ship.step``), its last ``trainer_logprobs``
    update and where it was first named."""
    out = Updates()
    for producer, files in producers.items():
        last: dict[str, int] = {}
        for ordinal, line, doc in read_updates(files, damage):
            if doc is None:
                out.torn += 1
                continue
            trace_id = lazy.get(doc, "trace_id")
            facts = out.traces.setdefault(trace_id, TraceFacts(where=(line.file.path, line.number)))
            _merge_info(facts, lazy.get(doc, "info"))
            branches = lazy.get(doc, "branches")
            if branches is not None and any(lazy.get(b, STREAM_FIELD) is not None for b in branches):
                last[trace_id] = ordinal
            del doc, branches
        if last:
            out.last_stream[producer] = last
    return out


class StreamFeed:
    """One producer's ``trainer_logprobs`` streams, read alongside the episode stream and handed
    out trace by trace (what is read ahead waits)."""

    def __init__(self, files: list[ChunkFile], last: dict[str, int], damage: Damage) -> None:
        self._last, self._damage = last, damage
        self._updates = read_updates(files, Damage(quiet=True))
        self._read = 0  # ordinal of the last update read
        self._held: dict[str, dict[int, list[Stream]]] = {}

    @property
    def held(self) -> int:
        return len(self._held)

    def pull(self, trace_id: str) -> dict[int, list[Stream]]:
        """The streams of ``trace_id`` per branch index, in write order."""
        target = self._last.pop(trace_id, 0)
        while self._read < target:
            update = next(self._updates, None)
            if update is None:  # the updates ended before the first pass's last (rewritten since)
                break
            self._read, line, doc = update
            if doc is not None:  # None: the torn tail (counted by the first pass)
                self._hold(line, doc)
            del update, doc  # every proxy of the line is gone before the next is parsed
        return self._held.pop(trace_id, {})

    def _hold(self, line: Line, doc: object) -> None:
        trace_id = lazy.get(doc, "trace_id")
        for branch in lazy.get(doc, "branches") or ():
            value = lazy.get(branch, STREAM_FIELD)
            if value is None:
                continue
            index = lazy.get(branch, "index")
            try:
                values = lazy.as_floats(value, nulls=True)
            except TypeError as error:
                where = f"trace {trace_id!r} branch {index}"
                reason = f"{where}: {STREAM_FIELD} is not a list of numbers or nulls ({error})"
                self._damage.report("bad_update", line.file.path, line.number, reason)
                continue
            if not values.flags.writeable:
                values = values.copy()
            stream = Stream(values, str(line.file.path), line.number)
            self._held.setdefault(trace_id, {}).setdefault(index, []).append(stream)


@dataclass
class K3Stats:
    """prime-rl's ``mismatch_kl`` statistics of one scope (``all`` or an env), per token over the
    trained samples' covered sampled positions, frozen samples included."""

    tokens: int = 0
    total: float = 0.0
    squares: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, k3: npt.NDArray[np.float64]) -> None:
        if k3.size:
            self.tokens += int(k3.size)
            self.total += float(k3.sum())
            self.squares += float(np.square(k3).sum())
            self.low, self.high = min(self.low, float(k3.min())), max(self.high, float(k3.max()))

    def value(self, stat: str) -> float | None:
        """``mean``, ``std`` (unbiased, as torch), ``min`` or ``max``; None without tokens."""
        if not self.tokens or (stat == "std" and self.tokens < 2):
            return None
        n, mean = self.tokens, self.total / self.tokens
        if stat == "std":
            return math.sqrt(max(0.0, (self.squares - n * mean * mean) / (n - 1)))
        return {"mean": mean, "min": self.low, "max": self.high}.get(stat)


@dataclass
class StepRule:
    """prime-rl's own figures of one ship step, from the shipped episodes (:mod:`.compare`)."""

    live: int = 0
    frozen: int = 0
    total: list[int] = field(default_factory=list)  # per episode, frozen ones as 0
    in_flight: list[int] = field(default_factory=list)
    in_queue: list[int] = field(default_factory=list)
    k3: dict[str, K3Stats] = field(default_factory=lambda: defaultdict(K3Stats))  # per env, "all"
    live_traces: int = 0


@dataclass
class ReadNotes:
    """What the reader left out or set aside, and prime-rl's own rule per ship step."""

    damage: Damage
    eval_episodes: int = 0
    errored_traces: int = 0
    # never shipped, fresh at arrival: prime-rl discarded them for other reasons
    unshipped_left_out: int = 0
    unshipped_stale: int = 0  # never shipped, stale at arrival: entered to be dropped by the sink
    frozen_unshipped: int = 0
    untrainable: int = 0  # traces that train nothing (no sampled token, agent not trainable)
    torn: int = 0
    split_lines: int = 0  # torn lines a relaunch appended to (split where the index says)
    held_peak: int = 0  # most traces whose trainer streams waited for their episode at once
    steps: dict[int, StepRule] = field(default_factory=dict)

    def left_out(self) -> str:
        """What was left out on purpose (not damage), in one line."""
        parts = [(self.eval_episodes, "eval episodes"), (self.errored_traces, "errored traces"),
                 (self.unshipped_left_out, "fresh traces prime-rl never shipped"),
                 (self.frozen_unshipped, "frozen traces never shipped"),
                 (self.untrainable, "traces with nothing to train"),
                 (self.torn, "torn last lines")]  # fmt: skip
        return ", ".join(f"{count} {text}" for count, text in parts if count)


class PrimeRlRead:
    """The events of a run (iterate once); :attr:`notes` fills in as they are read."""

    def __init__(self, layout: TracesLayout, *, max_staleness: int = 8, strict: bool = True) -> None:
        self.layout, self.max_staleness = layout, max_staleness
        self.notes = ReadNotes(Damage(strict=strict))

    def _lines(self, index: IndexCheck) -> Iterator[tuple[Line, object]]:
        """``(line, episode proxy)`` of the stream in order, damage reported, torn lines handled."""
        damage, parser = self.notes.damage, lazy.Parser()
        for last, line in read_files(self.layout.stream, damage):
            where = (-1 if line.file.number is None else line.file.number, line.offset)
            try:
                yield line, parser.parse(line.text)
                continue
            except lazy.DecodeError as error:
                reason = str(error)
            resume = index.resume_inside(where, len(line.text))
            if resume is not None:  # a relaunch appended after a torn line: the index says where
                self.notes.split_lines += 1
                line = replace(line, offset=resume, text=line.text[resume - line.offset :])
                where = (where[0], resume)
                try:
                    yield line, parser.parse(line.text)
                    continue
                except lazy.DecodeError as again:
                    reason = str(again)
            index.see(where, None)
            if not line.ended and last:
                self.notes.torn += 1  # a torn last line ends the stream
                return
            damage.report("bad_line", line.file.path, line.number, f"not JSON ({reason})")

    def __iter__(self) -> Iterator[Event]:
        notes, damage = self.notes, self.notes.damage
        self._updates = scan_updates(self.layout.annotations, damage)
        notes.torn += self._updates.torn
        self._feeds = {
            producer: StreamFeed(self.layout.annotations[producer], last, damage)
            for producer, last in self._updates.last_stream.items()
        }
        self._ships: dict[int, list[str]] = {}
        self._read_ids: set[str] = set()  # the trace ids of the lines read
        self._passed = 0  # the last ship step emitted
        index = IndexCheck(self.layout.index, damage, self.layout.index_size)
        number = 0
        for line, doc in self._lines(index):
            number += 1
            events = self._episode(number, line, doc, index)
            del doc  # every proxy of the line is gone before the next is parsed
            yield from events
            notes.held_peak = max(notes.held_peak, sum(feed.held for feed in self._feeds.values()))
        index.finish()
        for step in sorted(self._ships):
            yield Event(number, "ship", step=step, ids=tuple(self._ships[step]))
        for trace_id, facts in self._updates.traces.items():  # left: traces the stream never held
            path, at = facts.where if facts.where is not None else ("annotations", 0)
            reason = f"an update for trace {trace_id!r}, which the stream does not hold"
            damage.report("unknown_trace", path, at, reason)

    def _episode(self, number: int, line: Line, doc: object, index: IndexCheck) -> list[Event]:
        """The events of one stream line: the ships its traces' arrivals pass, and the rollouts."""
        where = (-1 if line.file.number is None else line.file.number, line.offset)
        try:
            episode = episode_head(doc)
        except NotAnEpisode as error:
            index.see(where, None)
            self.notes.damage.report("not_episode", line.file.path, line.number, str(error))
            return []
        index.see(where, episode.id)
        events = []
        for trace in episode.traces:
            if trace.id in self._read_ids:  # prime-rl writes an episode once (and ships the first)
                reason = f"trace {trace.id!r} was read before (an episode line written twice?)"
                self.notes.damage.report("duplicate_trace", line.file.path, line.number, reason)
                continue
            self._read_ids.add(trace.id)
            streams = self._streams(trace.id)
            facts = self._updates.traces.pop(trace.id, None)
            shipped = facts.ship_step if facts is not None and facts.effective else None
            arrival = self._arrival(episode, trace, shipped, doc)
            if arrival is None:
                continue
            for step in sorted(s for s in self._ships if s < arrival):
                self._passed = step
                events.append(Event(number, "ship", step=step, ids=tuple(self._ships.pop(step))))
            event = self._trace_event(number, line, episode, trace, shipped, streams, arrival)
            if event is None:
                continue
            events.append(event)
            if shipped is not None:
                self._ships.setdefault(shipped, []).extend([trace.id] if event.parsed is not None else [])
        return events

    def _streams(self, trace_id: str) -> dict[int, list[Stream]]:
        merged: dict[int, list[Stream]] = {}
        for producer in sorted(self._feeds):  # producers in name order, each in write order
            for branch, streams in self._feeds[producer].pull(trace_id).items():
                merged.setdefault(branch, []).extend(streams)
        return merged

    def _arrival(self, episode: EpisodeHead, trace: TraceHead, shipped: int | None, doc: object) -> int | None:
        """The trace's arrival step, or None when it is left out (eval, errored)."""
        if episode.kind != "train":
            if trace is episode.traces[0]:
                self.notes.eval_episodes += 1
            return None
        if not (episode.ok and trace.ok):
            self.notes.errored_traces += 1
            return None
        if trace.arrival_step is not None:
            return trace.arrival_step
        if shipped is not None:
            return shipped
        step = lazy.get(lazy.get(lazy.get(doc, "run"), "work"), "step")
        return step if isinstance(step, int) and not isinstance(step, bool) else 1

    def _trace_event(self, number: int, line: Line, episode: EpisodeHead, trace: TraceHead,
                     shipped: int | None, streams: dict[int, list[Stream]],
                     arrival: int) -> Event | None:  # fmt: skip
        notes = self.notes
        lag = None
        if shipped is None:
            if episode.policy is None:  # frozen-model work
                notes.frozen_unshipped += 1
                return None
            start = episode.policy[0]
            if not stale_at_arrival(start, arrival, self.max_staleness):
                notes.unshipped_left_out += 1
                return None
            notes.unshipped_stale += 1
            lag = (arrival - 1) - start if type(start) is int else None  # (a bool is no version)
        elif shipped <= self._passed or shipped < arrival:
            late = f"trace {trace.id!r} arrived at step {arrival} and shipped at step {shipped}"
            why = f"{late}, a step already passed (a relaunch from an earlier checkpoint?)"
            notes.damage.report("late_ship", line.file.path, line.number, why)
            return None
        rollout, problems = trace_rollout(episode, trace, streams)
        for path, line_number, reason in problems:
            notes.damage.report("bad_update", path, line_number, reason)
        if rollout is None:
            notes.untrainable += 1
            return None
        # (only a run that logged has values to compare)
        if shipped is not None and self.layout.metrics is not None:
            self._rule(shipped, episode, trace, rollout)
        if isinstance(rollout, UnparsedRollout):
            if notes.damage.strict:  # named by its file and line, as damage is (no sink knows them)
                raise EventError(line.number, f"{line.file.path}: {rollout.error}")
            return Event(number, "rollout", unparsed=rollout, arrival_lag=lag)
        return Event(number, "rollout", parsed=rollout, arrival_lag=lag)

    def _rule(
        self, step: int, episode: EpisodeHead, trace: TraceHead, rollout: ParsedRollout | UnparsedRollout
    ) -> None:
        """prime-rl's figures of a shipped trace (its episode counted at its first trace)."""
        rule = self.notes.steps.setdefault(step, StepRule())
        if isinstance(rollout, ParsedRollout):
            for sample in rollout.samples:
                k3 = np.zeros(0)
                if sample.logprobs is not None and sample.trainer_logprobs is not None:
                    # prime-rl's per-token exp(d) - d - 1 over covered sampled positions, unclamped
                    keep = (sample.mask == 1) & np.isfinite(sample.trainer_logprobs)
                    d = sample.trainer_logprobs[keep] - sample.logprobs[keep]
                    k3 = np.asarray(np.expm1(d) - d, dtype=np.float64)
                rule.k3["all"].add(k3)
                if episode.env is not None:
                    rule.k3[episode.env].add(k3)
            rule.live_traces += not rollout.frozen
        if trace is not next((t for t in episode.traces if t.ok), None):
            return
        if episode.policy is None:
            rule.frozen += 1
            total = flight = 0
        else:
            start, end = episode.policy
            if not (isinstance(start, int) and isinstance(end, int)):
                return
            rule.live += 1
            total = max(0, (step - 1) - start)
            flight = min(total, max(0, end - start))
        rule.total.append(total)
        rule.in_flight.append(flight)
        rule.in_queue.append(total - flight)


def read_run_events(path: str | Path, *, max_staleness: int = 8, strict: bool = True) -> PrimeRlRead:
    """The events of the prime-rl run at ``path`` (root, ``monitors/file`` or ``traces``)."""
    layout = find_layout(path)
    if layout is None:
        raise ConfigError(f"{path}: no prime-rl trace stream (monitors/file/traces/stream/ or traces/stream.jsonl)")
    return PrimeRlRead(layout, max_staleness=max_staleness, strict=strict)
