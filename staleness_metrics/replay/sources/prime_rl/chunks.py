"""A prime-rl run's files in the current layout (``prime-rl-traces.md`` section 1) and its streams'
lines, plain or sealed (zstd frames), each at the decompressed offset prime-rl's index names."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import zstandard

from .damage import Damage

_CHUNK = re.compile(r"^(\d+)\.jsonl(\.zst)?$")
_INDEX_SUFFIX = ".index.jsonl"


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


def _chunks(folder: Path) -> list[ChunkFile]:
    """A chunked stream's files in chunk order, a plain file preferred to its sealed twin (as
    prime-rl's reader does)."""
    found: dict[int, ChunkFile] = {}
    for path in folder.iterdir():
        match = _CHUNK.match(path.name)
        if match is None or not path.is_file():
            continue
        number, sealed = int(match.group(1)), match.group(2) is not None
        if number not in found or (found[number].sealed and not sealed):
            found[number] = ChunkFile(path, number, sealed)
    return [found[number] for number in sorted(found)]


def _stream_files(base: Path) -> list[ChunkFile]:
    """``base.jsonl`` then ``base/`` chunks (a run relaunched by a newer prime-rl holds both)."""
    files = []
    single = base.with_name(base.name + ".jsonl")
    if single.is_file():
        files.append(ChunkFile(single, None, False))
    if base.is_dir():
        files.extend(_chunks(base))
    return files


def find_layout(path: str | Path) -> TracesLayout | None:
    """The files of the run at ``path`` (root, ``monitors/file`` or ``traces``), if it has a stream."""
    root = Path(path)
    if not root.is_dir():
        return None
    for traces in (root / "monitors" / "file" / "traces", root / "traces", root):
        if (traces / "stream").is_dir() or (traces / "stream.jsonl").is_file():
            break
    else:
        return None
    index = traces / f"stream{_INDEX_SUFFIX}"
    annotations: dict[str, list[ChunkFile]] = {}
    folder = traces / "annotations"
    if folder.is_dir():
        # a producer's updates: NAME/ chunks or NAME.jsonl (what names neither finds no files)
        names = {
            p.name if p.is_dir() else p.name.removesuffix(".jsonl")
            for p in folder.iterdir()
            if p.is_dir() or not p.name.endswith(_INDEX_SUFFIX)
        }
        for name in sorted(names):
            if files := _stream_files(folder / name):
                annotations[name] = files
    metrics = traces.parent / "metrics.jsonl"
    return TracesLayout(
        stream=_stream_files(traces / "stream"),
        index=index if index.is_file() else None,
        annotations=annotations,
        metrics=metrics if metrics.is_file() else None,
    )


def is_current_layout(path: str | Path) -> bool:
    """Whether ``path`` holds a prime-rl trace stream in the current layout."""
    return find_layout(path) is not None


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
        self._in_frame = False  # bytes of the current frame were fed and its end not seen yet
        self._out = b""

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        while not self._out:
            data = self._raw.read(_BUFFER)
            if not data:
                if self._in_frame:
                    raise zstandard.ZstdError("the file ends inside a frame (cut short)")
                return False
            parts = []
            while data:
                parts.append(self._frame.decompress(data))
                self._in_frame = True
                if self._frame.eof:
                    data = self._frame.unused_data
                    self._frame = self._context.decompressobj()
                    self._in_frame = False
                else:
                    data = b""
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
        except zstandard.ZstdError as error:
            reason = f"corrupt zstd data after line {number} ({error})"
            damage.report("bad_chunk", file.path, number + 1, reason)
        except OSError as error:
            reason = f"cannot be read after line {number} ({error})"
            damage.report("bad_chunk", file.path, number + 1, reason)
