"""A prime-rl run's files in the current layout (``prime-rl-traces.md`` section 1), their lines
(plain or sealed: zstd frames) at their decompressed offsets, and what a damaged run gets (SPEC 9):
strict mode stops naming file, line and reason, lenient mode sets it aside and counts it."""

from __future__ import annotations

import io
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeGuard

import zstandard

from ....errors import EventError
from ....records import jsonio

_CHUNK = re.compile(r"^(\d+)\.jsonl(\.zst)?$")
_INDEX_SUFFIX = ".index.jsonl"
_log = logging.getLogger("staleness_metrics.replay.sources.prime_rl")


@dataclass(frozen=True)
class ChunkFile:
    """One file of a stream: ``number`` its chunk (None: single file), ``sealed`` when zstd."""

    path: Path
    number: int | None
    sealed: bool


@dataclass(frozen=True)
class TracesLayout:
    """The files of a run in the current layout, each stream's files in reading order."""

    stream: list[ChunkFile]
    index: Path | None
    annotations: dict[str, list[ChunkFile]] = field(default_factory=dict)
    metrics: Path | None = None
    index_size: int = 0  # its size before the chunks were listed: rows added since are not read


def _stream_files(base: Path) -> list[ChunkFile]:
    """``base.jsonl`` then ``base/`` chunks (a run relaunched by a newer prime-rl holds both), in
    order, a plain chunk over its sealed twin (as prime-rl's reader does)."""
    single = base.with_name(base.name + ".jsonl")
    found: dict[int, ChunkFile] = {}
    for path in base.iterdir() if base.is_dir() else ():
        match = _CHUNK.match(path.name)
        if match is None or not path.is_file():
            continue
        number, sealed = int(match.group(1)), match.group(2) is not None
        if number not in found or (found[number].sealed and not sealed):
            found[number] = ChunkFile(path, number, sealed)
    files = [ChunkFile(single, None, False)] if single.is_file() else []
    return files + [found[number] for number in sorted(found)]


def find_layout(path: str | Path) -> TracesLayout | None:
    """The run's files at ``path`` (root, ``monitors/file`` or ``traces``), if it has a stream."""
    root = Path(path)
    if not root.is_dir():
        return None
    for traces in (root / "monitors" / "file" / "traces", root / "traces", root):
        if (traces / "stream").is_dir() or (traces / "stream.jsonl").is_file():
            break
    else:
        return None
    index = traces / f"stream{_INDEX_SUFFIX}"
    size = index.stat().st_size if index.is_file() and os.access(index, os.R_OK) else None
    folder = traces / "annotations"
    # a producer's updates: NAME/ chunks or NAME.jsonl (what names neither finds no files)
    names = {
        p.name if p.is_dir() else p.name.removesuffix(".jsonl")
        for p in (folder.iterdir() if folder.is_dir() else ())
        if p.is_dir() or not p.name.endswith(_INDEX_SUFFIX)
    }
    annotations = {name: files for name in sorted(names) if (files := _stream_files(folder / name))}
    metrics = traces.parent / "metrics.jsonl"
    return TracesLayout(
        stream=_stream_files(traces / "stream"),
        index=index if size is not None else None,  # (a cross-check)
        annotations=annotations,
        metrics=metrics if metrics.is_file() else None,
        index_size=size or 0,  # (a row added since may point at a chunk listed after it: a roll)
    )


def is_current_layout(path: str | Path) -> bool:
    """Whether ``path`` holds a prime-rl trace stream in the current layout."""
    return find_layout(path) is not None


DAMAGE_KINDS = {  # what can be set aside, as counted (the keys of :attr:`Damage.counts`)
    "bad_line": "lines that are not JSON",
    "not_episode": "stream lines that are not an episode record",
    "not_update": "annotation lines that are not an update",
    "bad_chunk": "chunks with corrupt or cut zstd data (the rest of the chunk)",
    "index_nowhere": "index rows pointing at no episode",
    "unknown_trace": "updates for a trace the stream does not hold",
    "bad_update": "updates that do not fit their trace (a branch it lacks, a stream longer than its branch)",
    "late_ship": "traces shipped at a step the replay had passed (their arrival came after the ship)",
    "duplicate_trace": "traces read a second time (an episode line written twice)",
}


@dataclass
class Damage:
    """What was set aside, counted per kind of :data:`DAMAGE_KINDS` (each reason is logged)."""

    strict: bool = True
    counts: Counter[str] = field(default_factory=Counter)
    quiet: bool = False  # a second reading's: the first reported what it sees

    def report(self, kind: str, path: Path | str, line: int, reason: str) -> None:
        """Raise :class:`EventError` (strict) or count it (lenient); nothing when ``quiet``."""
        if self.quiet:
            return
        if self.strict:
            raise EventError(line, f"{path}: {reason}")
        self.counts[kind] += 1
        _log.warning("set aside: %s: line %d: %s", path, line, reason)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        return ", ".join(f"{n} {DAMAGE_KINDS[kind]}" for kind, n in sorted(self.counts.items()))


_BUFFER = 1 << 20  # lines of long episodes are hundreds of KB


@dataclass(frozen=True)
class Line:
    """One line of a stream file: ``number`` 1-based, ``offset`` its first (decompressed) byte,
    ``text`` without the newline, ``ended`` whether the newline was there."""

    file: ChunkFile
    number: int
    offset: int
    text: bytes
    ended: bool


class _Frames(io.RawIOBase):
    """The decompressed bytes of a file of zstd frames; ``ZstdError`` for a corrupt or cut frame
    (zstandard's own stream reader ends quietly on a cut file)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._context = zstandard.ZstdDecompressor()
        self._frame = self._context.decompressobj()
        self._in_frame = True  # a frame's end not seen yet (a sealed file holds one at least)
        self._out = b""

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        while not self._out:
            data = self._raw.read(_BUFFER)
            if not data:
                if self._in_frame:
                    raise zstandard.ZstdError("cut short inside a frame, or no frame at all")
                return False
            parts = []
            while data:
                parts.append(self._frame.decompress(data))
                self._in_frame = not self._frame.eof
                data = self._frame.unused_data if self._frame.eof else b""
                if self._frame.eof:
                    self._frame = self._context.decompressobj()
            self._out = b"".join(parts)
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if not self._fill():
            return 0
        size = min(len(buffer), len(self._out))
        buffer[:size] = self._out[:size]
        self._out = self._out[size:]
        return size


def read_files(files: list[ChunkFile], damage: Damage) -> Iterator[tuple[bool, Line]]:
    """``(last, line)``: every non-blank line of ``files`` in order (``last``: in the last file); a
    chunk that cannot be read on goes to ``damage`` and the next file is read."""
    for position, file in enumerate(files):
        number = offset = 0
        if not file.sealed and not file.path.exists():  # sealed since it was listed (a full chunk)
            file = ChunkFile(file.path.with_name(file.path.name + ".zst"), file.number, True)
        try:
            with open(file.path, "rb", buffering=_BUFFER) as plain:
                handle = io.BufferedReader(_Frames(plain), _BUFFER) if file.sealed else plain
                for raw in handle:
                    number += 1
                    ended = raw.endswith(b"\n")
                    text = raw[:-1] if ended else raw
                    if text.strip():
                        yield position == len(files) - 1, Line(file, number, offset, text, ended)
                    offset += len(raw)
        except (zstandard.ZstdError, OSError) as error:
            fault = "cannot be read" if isinstance(error, OSError) else "corrupt zstd data"
            reason = f"{fault} after line {number} ({error})"
            damage.report("bad_chunk", file.path, number + 1, reason)


Position = tuple[int, int]  # (chunk number, -1 in the single-file layout; byte offset)


class IndexCheck:
    """Walks the index in step with the stream (:meth:`see` each line, then :meth:`finish`)."""

    def __init__(self, path: Path | None, damage: Damage, size: int) -> None:
        self._path, self._damage = path, damage
        self._rows = self._read(path, size) if path is not None else iter(())
        self._next: tuple[int, Position, str | None] | None = next(self._rows, None)

    def _read(self, path: Path, size: int) -> Iterator[tuple[int, Position, str | None]]:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                raw, size = raw[: max(size, 0)], size - len(raw)  # (a row cut there: torn)
                if not raw.strip():
                    continue
                try:
                    row = jsonio.loads(raw)
                except jsonio.DecodeError as error:
                    if not raw.endswith(b"\n"):
                        return  # a torn last row: the writer died mid-append
                    self._damage.report("bad_line", path, number, f"not JSON ({error.msg})")
                    continue
                chunk, offset = (row.get("chunk"), row.get("offset")) if isinstance(row, dict) else (None, None)
                if not _is_int(offset) or not (chunk is None or _is_int(chunk)):
                    self._damage.report("index_nowhere", path, number, "an index row without a chunk and offset")
                    continue
                name = row.get("id")
                position: Position = (-1 if chunk is None else chunk, offset)
                yield number, position, name if isinstance(name, str) else None

    def _nowhere(self, reason: str) -> None:
        assert self._next is not None and self._path is not None
        number, (chunk, offset), name = self._next
        where = f"offset {offset}" if chunk < 0 else f"chunk {chunk:05d}, offset {offset}"
        why = f"the row of episode {name!r} points at {where}: {reason}"
        self._damage.report("index_nowhere", self._path, number, why)
        self._next = next(self._rows, None)

    def see(self, position: Position, episode_id: str | None) -> None:
        """The stream has a line at ``position`` holding ``episode_id`` (None: not an episode)."""
        while self._next is not None and self._next[1] < position:
            self._nowhere("no line of the stream starts there")
        if self._next is not None and self._next[1] == position:
            name = self._next[2]
            if name is not None and episode_id is not None and name != episode_id:
                self._nowhere(f"the line there holds episode {episode_id!r}")
            else:
                self._next = next(self._rows, None)

    def resume_inside(self, position: Position, size: int) -> int | None:
        """The offset of a row pointing inside the line at ``position`` (``size`` bytes)."""
        chunk, offset = self._next[1] if self._next is not None else (None, 0)
        inside = chunk == position[0] and position[1] < offset < position[1] + size
        return offset if inside else None

    def finish(self) -> None:
        while self._next is not None:
            self._nowhere("past the end of the stream")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
