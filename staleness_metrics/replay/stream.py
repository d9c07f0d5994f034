"""Replay of a recorded event stream (SPEC 9): the sink run over JSON lines, no service."""

from __future__ import annotations

import bz2
import copy
import dataclasses
import gzip
import lzma
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from ..config import StalenessConfig
from ..engine.cuts import SpanTable
from ..engine.shipment import Shipment
from ..engine.sink import MAX_STEP, Sink
from ..engine.spans import checked_spans
from ..errors import ConfigError, EventError, TraceError
from ..records import jsonio, simd_records
from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from ..records.model import ParsedRollout, UnparsedRollout, pack, parse_or_error
from ..records.validation import Verdicts, lone_surrogate


@dataclass(frozen=True)
class Event:
    """One line of an event stream: a rollout (record, ``parsed``, ``unparsed``), sweep or ship."""

    line: int
    kind: str
    rollout: dict[str, Any] | None = None
    step: int = 0
    ids: tuple[str, ...] | None = None
    booleans: bool = True  # the line may hold JSON booleans (False: a faster check)
    parsed: ParsedRollout | None = None
    unparsed: UnparsedRollout | None = None
    # a rollout a run never shipped, read as stale at arrival: its lag then (None: any other event)
    arrival_lag: int | None = None

    def enters(self, bound: int) -> bool:
        """Whether a replay at ``bound`` reads this event (a read at a smaller bound holds it)."""
        return self.arrival_lag is None or self.arrival_lag > bound


def _step(line: int, raw: dict[str, Any]) -> int:
    step = raw.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= MAX_STEP:
        raise EventError(line, f"'step' must be an integer in 1..{MAX_STEP}, got {step!r}")
    return step


# each event type's keys: another is refused, as a record's unknown field is (a misspelt "ids"
# would ship every queued rollout)
_KEYS_OF = dict(rollout=("type", "rollout"), sweep=("type", "step"), ship=("type", "step", "ids"))


def parse_event(line: int, raw: object) -> Event:
    """Check one decoded event object; raises :class:`EventError` naming the line."""
    if not isinstance(raw, dict):
        raise EventError(line, f"expected a JSON object, got {type(raw).__name__}")
    kind = raw.get("type")
    keys = _KEYS_OF.get(kind) if isinstance(kind, str) else None
    if keys is None:
        raise EventError(line, f"unknown event type {kind!r} (expected rollout, sweep or ship)")
    plain = kind == "rollout" and len(raw) == 2 and "rollout" in raw  # (millions: no set made)
    if not plain and (unknown := raw.keys() - keys):
        key, expected = min(unknown), ", ".join(keys)
        raise EventError(line, f"unknown key {key!r} in a {kind} event (expected {expected})")
    if kind == "rollout":
        if not isinstance(raw.get("rollout"), dict):
            raise EventError(line, "a rollout event needs a 'rollout' object")
        return Event(line, "rollout", rollout=raw["rollout"])
    if kind == "sweep":
        return Event(line, "sweep", step=_step(line, raw))
    ids = raw.get("ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise EventError(line, "'ids' must be a list of strings")
    return Event(line, "ship", step=_step(line, raw), ids=None if ids is None else tuple(ids))


def _decoded(number: int, text: str | bytes) -> Event:
    try:
        raw, valid_unicode = jsonio.loads_checked(text)
    except jsonio.DecodeError as error:
        raise EventError(number, _bad_json(text, error)) from None
    event = parse_event(number, raw)
    if not valid_unicode:
        event = _unicode_checked(event, text)
    if event.kind == "rollout" and event.unparsed is None:
        # a line without true / false cannot hide a boolean among numbers
        marks = (b"true", b"false") if isinstance(text, bytes) else ("true", "false")
        booleans = marks[0] in text or marks[1] in text  # type: ignore[operator]
        event = Event(number, "rollout", rollout=event.rollout, booleans=booleans)
    return event


def _bad_json(text: str | bytes, error: jsonio.DecodeError) -> str:
    """Why a line is not JSON: a NUL byte or invalid UTF-8 named before the parser's complaint."""
    nul = text.find(b"\x00" if isinstance(text, bytes) else "\x00")  # type: ignore[arg-type]
    if nul >= 0:
        return f"a NUL byte at column {nul + 1}: not a line of UTF-8 JSON (binary data, or UTF-16/32 text?)"
    if isinstance(text, bytes):
        try:
            text.decode("utf-8")
        except UnicodeDecodeError as bad:
            return f"not valid UTF-8: byte 0x{text[bad.start]:02x} at column {bad.start + 1}"
    return f"bad JSON: {error.msg}"


def _invalid_string(value: object) -> tuple[str, str] | None:
    """``(where, string)`` of the first string (key or value) that is not valid Unicode."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if lone_surrogate(item) is not None:
                return where, item
        elif isinstance(item, dict):
            entries = []
            for key, sub in item.items():
                name = f"{where}.{key}" if where else key
                if lone_surrogate(key) is not None:
                    return name, key
                if isinstance(sub, (str, dict, list)):
                    entries.append((sub, name))
            stack.extend(reversed(entries))
        elif isinstance(item, list):
            stack.extend(
                (sub, f"{where}[{i}]")
                for i, sub in reversed(list(enumerate(item)))
                if isinstance(sub, (str, dict, list))
            )
    return None


def _unicode_reason(text: str | bytes, string: str) -> str:
    """Why ``string`` is not valid Unicode: invalid UTF-8 (surrogateescape'd), or an escape."""
    char = next(c for c in string if "\ud800" <= c <= "\udfff")
    if isinstance(text, bytes) and "\udc80" <= char <= "\udcff":
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            return f"not valid UTF-8 (byte 0x{ord(char) - 0xDC00:02x})"
    return f"not valid Unicode (a lone surrogate \\u{ord(char):04x})"


def _unicode_checked(event: Event, text: str | bytes) -> Event:
    """``event`` with its strings checked: a rollout refused, a ship naming a bad id an error."""
    for rid in event.ids or ():  # a ship's ids
        if lone_surrogate(rid) is not None:
            raise EventError(event.line, f"'ids': {rid!r} is {_unicode_reason(text, rid)}")
    if event.rollout is None or (found := _invalid_string(event.rollout)) is None:
        return event  # a sweep, a ship, or a rollout whose strings are all valid
    where, string = found
    record_id, env = event.rollout.get("id"), event.rollout.get("env")
    error = TraceError(
        record_id if isinstance(record_id, str) else None,
        where.encode("utf-8", "backslashreplace").decode("utf-8"),
        _unicode_reason(text, string),
    )
    known_env = isinstance(env, str) and lone_surrogate(env) is None
    return Event(event.line, "rollout", unparsed=UnparsedRollout(error, env if known_env else None))


_PARSE_LINES = 64  # rollout lines whose values are checked together (:meth:`LineReader.finish`)
_PENDING_EVENTS = 4 * _PARSE_LINES  # events held by read_ahead at most (but for one run's lines)


def read_events(
    source: IO[str] | IO[bytes] | Iterable[str | bytes], *, parse: bool = False, read_ahead: bool = False
) -> Iterator[Event]:
    """Decode JSON lines (blank lines skipped) into events, checking steps never decrease.

    ``parse``: valid rollout lines given as bytes are read straight into arrays (``parsed``);
    ``read_ahead``: checked 64 at a time across ship and sweep lines too (for a whole file)."""
    last_step = 0
    reader = simd_records.LineReader() if parse and simd_records.AVAILABLE else None
    # lines not yet yielded: events, and the reader's as (number, text[, record or None])
    pending: list[Event | tuple[int, bytes] | tuple[int, bytes, ParsedRollout | None]] = []
    taken = 0  # lines of ``pending`` taken and not checked yet
    run = 0  # rollout lines taken since a line decoded here (as a read without read_ahead)
    settled = 0  # pending[:settled] is what a read without read_ahead would have yielded by now

    def flush(upto: int | None) -> Iterator[Event]:
        """Check the values of the lines taken; yield ``pending[:upto]`` (``None``: all of it)."""
        nonlocal taken, settled
        if taken:
            assert reader is not None
            results = iter(reader.finish())
            for i, item in enumerate(pending):
                if type(item) is tuple and len(item) == 2:
                    parsed = next(results)  # the text is kept only for the general path
                    pending[i] = item[0], item[1] if parsed is None else b"", parsed
            taken = 0
        waiting = pending[:upto]
        del pending[:upto]
        settled = 0  # (pending keeps at most lines taken after the last settled one)
        for item in waiting:
            if isinstance(item, Event):
                yield item
            else:
                number, text, parsed = cast(tuple[int, bytes, ParsedRollout | None], item)
                yield (_decoded(number, text) if parsed is None else Event(number, "rollout", parsed=parsed))

    lines = enumerate(source, start=1)
    while True:
        try:
            number, text = next(lines)
        except StopIteration:
            break
        except Exception:
            # a damaged file: every line read before it first (the general path yields each line)
            yield from flush(None)
            raise
        if not text or text.isspace():  # as ``not text.strip()``, without copying the line
            continue
        if reader is not None and isinstance(text, bytes) and reader.take(text):
            pending.append((number, text))
            taken += 1
            run += 1
            if run >= _PARSE_LINES:  # a read without read_ahead checks and yields them now
                run, settled = 0, len(pending)
            if taken >= _PARSE_LINES or len(pending) >= _PENDING_EVENTS:
                yield from flush(settled)
            continue
        run = 0
        if pending and not read_ahead:
            yield from flush(None)
        try:
            event = _decoded(number, text)
            if event.kind != "rollout":
                if event.step < last_step:
                    raise EventError(number, f"step {event.step} is below an earlier step {last_step}")
                last_step = event.step
        except EventError:
            yield from flush(None)  # the events of the lines before it first
            raise
        if not pending:
            yield event
            continue
        pending.append(event)
        settled = len(pending)
        if len(pending) >= _PENDING_EVENTS:
            yield from flush(settled)
    yield from flush(None)


@dataclass(frozen=True)
class Added:
    """Consecutive rollout events, type-checked into columnar-ready records."""

    lines: tuple[int, ...]
    items: tuple[ParsedRollout | UnparsedRollout, ...]
    packed: RolloutBatch | None = None  # its window packed (:func:`cut_ahead`); runs add copies
    checked: tuple[Verdicts, SpanTable] | None = None  # and checked and cut, as a sink would
    part: tuple[int, int] | None = None  # its own rollouts of ``packed`` (None: all of them)


Step = Added | Event  # what a sink does next: add some rollouts, or a sweep / ship event


def prepare(events: Iterable[Event], batch_size: int = 512) -> Iterator[Step]:
    """Events as steps, consecutive rollouts added together; several sinks may run them."""
    lines: list[int] = []
    items: list[ParsedRollout | UnparsedRollout] = []
    try:
        for event in events:
            if event.kind == "rollout":
                lines.append(event.line)
                item = event.parsed if event.parsed is not None else event.unparsed
                items.append(item or parse_or_error(event.rollout or {}, booleans=event.booleans))
                if len(items) < batch_size:
                    continue
            if items:  # a full batch, or the rollouts before a sweep or ship
                yield Added(tuple(lines), tuple(items))
                lines, items = [], []
            if event.kind != "rollout":
                yield event
    except Exception:  # a later line's error: the adds before it first (the first error first)
        if items:
            yield Added(tuple(lines), tuple(items))
        raise
    if items:
        yield Added(tuple(lines), tuple(items))


# a window of consecutive small adds (and the sweeps and ships between them) is packed and cut at once
CUT_AHEAD_POSITIONS = 1 << 16
_CUT_AHEAD_STEPS = 4096  # (and holds at most this many steps)


def cut_ahead(
    steps: Iterable[Step], sink: Sink | None = None, max_positions: int = CUT_AHEAD_POSITIONS
) -> Iterator[Step]:
    """The steps with each add packed, checked and cut once (``sink``: for its run; None: for
    several runs of fresh sinks, as what-if runs them). Consecutive small adds whose samples carry the
    same arrays are cut together with the steps between them, each add taking its part: what a sink
    finds depends only on the rollouts and the ids accepted before them. A window with a refused
    rollout is cut add by add, each as its run reaches it."""
    accepted: set[str] = set()
    for window in _windows(steps, max_positions):
        for step in _cut(window, accepted if sink is None else sink.queue.seen_ids) or window:
            if isinstance(step, Added) and step.checked is None:
                step = (_cut([step], accepted if sink is None else sink.queue.seen_ids) or [step])[0]
            if sink is None and isinstance(step, Added) and step.packed is not None and step.checked is not None:
                lo, hi = step.part or (0, step.packed.n_rollouts)
                accepted.update(step.packed.ids[i] for i in range(lo, hi) if i not in step.checked[0].errors)
            yield step


def _windows(steps: Iterable[Step], max_positions: int) -> Iterator[list[Step]]:
    """The steps in windows: consecutive adds whose samples all carry the same optional arrays, up
    to ``max_positions`` positions, with the steps between them; any other step alone."""
    window: list[Step] = []
    positions, signature = 0, None
    try:
        for step in steps:
            if isinstance(step, Added):
                parsed = [item for item in step.items if isinstance(item, ParsedRollout)]
                samples = [sample for item in parsed for sample in item.samples]
                given = [[name in s.weights for s in samples] for name in WEIGHT_FIELDS]
                given += [[s.logprobs is not None for s in samples], [s.trainer_logprobs is not None for s in samples]]
                found = None  # (a refused rollout, or arrays only some samples carry: alone)
                if samples and len(parsed) == len(step.items) and all(min(f) == max(f) for f in given):
                    found = tuple(flags[0] for flags in given)
                size = sum(len(s.mask) for s in samples)
                if window and (found != signature or positions + size > max_positions):
                    yield window
                    window, positions, signature = [], 0, None
                if found is None or size >= max_positions:
                    yield [step]
                    continue
                positions, signature = positions + size, found
            elif not window:
                yield [step]
                continue
            window.append(step)
            if len(window) >= _CUT_AHEAD_STEPS:
                yield window
                window, positions, signature = [], 0, None
    except Exception:  # a later step's error: the window before it first
        if window:
            yield window
        raise
    if window:
        yield window


def _cut(window: list[Step], known: set[str]) -> list[Step] | None:
    """The window's steps, its adds given their parts of its rollouts packed, checked and cut at
    once; None when it holds no rollout, or the check refuses one of several adds."""
    adds = [step for step in window if isinstance(step, Added)]
    parsed = [item for step in adds for item in step.items if isinstance(item, ParsedRollout)]
    if not parsed:
        return None
    packed = pack(parsed)
    verdicts, spans = checked_spans(packed, known)
    if verdicts.errors and len(adds) > 1:
        return None
    _read_only(packed, but=_MASKED_FIELDS)
    _read_only(spans)
    out: list[Step] = []
    start = 0
    for step in window:
        if isinstance(step, Added):
            part = None if len(adds) == 1 else (start, start + len(step.items))
            step = dataclasses.replace(step, packed=packed, checked=(verdicts, spans), part=part)
            start += len(step.items)
        out.append(step)
    return out


def _read_only(shared: RolloutBatch | SpanTable, but: tuple[str, ...] = ()) -> None:
    """The arrays every run shares, ``but`` those a sink masks in place (in its copy), read-only."""
    for f in dataclasses.fields(shared):
        if isinstance(value := getattr(shared, f.name), np.ndarray) and f.name not in but:
            value.setflags(write=False)


_MASKED_FIELDS = ("mask", *WEIGHT_FIELDS)  # the arrays a sink writes (masks in place)


def _copy(batch: RolloutBatch) -> RolloutBatch:
    """A batch for one more run: copies of the arrays a sink masks in place, the others shared."""
    copied = copy.copy(batch)  # (checked and converted once already: no __post_init__ again)
    for name in _MASKED_FIELDS:
        if (value := getattr(batch, name)) is not None:
            setattr(copied, name, value.copy())
    copied.present = {k: v.copy() for k, v in batch.present.items()}
    return copied


def run_steps(steps: Iterable[Step], sink: Sink) -> Iterator[Shipment]:
    """Run prepared steps through ``sink``, yielding each ship; a rejection names its line."""
    window: RolloutBatch | None = None
    copied: RolloutBatch | None = None  # this run's copy of the window's batch
    for step in steps:
        if isinstance(step, Added):
            if step.packed is not window:
                window = step.packed
                copied = None if window is None else _copy(window)
            try:
                sink.add_parsed(step.items, copied, step.checked, step.part)
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


def run_events(
    events: Iterable[Event], sink: Sink, batch_size: int = 512, *, read_ahead: bool = False
) -> Iterator[Shipment]:
    """Run the events through ``sink``, one :class:`Shipment` per ship (as adding one by one).
    ``read_ahead``: small adds are cut together across the ships between them (:func:`cut_ahead`),
    so a ship's result comes once its window is read: for a recorded stream."""
    steps = cut_ahead(prepare(events, batch_size), sink, CUT_AHEAD_POSITIONS if read_ahead else 0)
    return run_steps(steps, sink)


def replay(events: Iterable[Event], config: StalenessConfig) -> list[Shipment]:
    """Run a fresh sink with ``config`` over ``events``; one :class:`Shipment` per ship."""
    return list(run_events(events, Sink(config), read_ahead=True))


# files that are not UTF-8 text, by their first bytes: gzip, bzip2 and xz read, others named
_OPENERS: dict[str, Callable[[IO[bytes]], IO[bytes]]] = {
    "gzip": lambda raw: cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb")),
    "bzip2": bz2.BZ2File,
    "xz": lzma.LZMAFile,
}
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"PK\x03\x04", "zip"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\xfe\xff", "UTF-16"),
    (b"\xff\xfe", "UTF-16"),
)
_HOW = {
    "zstd": "compressed with zstd, which replay does not read: decompress it first (zstd -d {path})",
    "zip": "a zip archive: extract the event stream first (unzip {path})",
    "UTF-16": "UTF-16 text; replay reads UTF-8: convert it first (iconv -f UTF-16 -t UTF-8 {path})",
    "UTF-32": "UTF-32 text; replay reads UTF-8: convert it first (iconv -f UTF-32 -t UTF-8 {path})",
}


def stream_compression(path: str | Path) -> str | None:
    """``gzip``, ``bzip2``, ``xz`` or None; :class:`ConfigError` for a file replay cannot read."""
    with open(path, "rb") as handle:
        head = handle.read(6)
    for magic, kind in _MAGIC:
        if head.startswith(magic) and (kind != "bzip2" or head[3:4].isdigit()):
            if kind in _OPENERS:
                return kind
            raise ConfigError(f"{path}: {_HOW[kind].format(path=path)}")
    return None


def read_event_path(
    path: str | Path,
    *,
    parse: bool = False,
    read_ahead: bool = False,
    opener: Callable[[Path], AbstractContextManager[IO[bytes]]] | None = None,
) -> Generator[Event, None, None]:
    """The events of an event stream file, decompressed if it is; options as :func:`read_events`."""
    path = Path(path)
    compression = stream_compression(path)
    opener = opener or (lambda p: p.open("rb", buffering=1 << 20))  # lines are tens of KB
    with opener(path) as raw, raw if compression is None else _OPENERS[compression](raw) as handle:
        try:
            yield from read_events(handle, parse=parse, read_ahead=read_ahead)
        except (EOFError, OSError, zlib.error, lzma.LZMAError) as error:
            if compression is None:
                raise
            raise ConfigError(f"{path}: {compression} data damaged or cut short ({error})") from None
