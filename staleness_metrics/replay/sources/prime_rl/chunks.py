"""The lines of a prime-rl stream, chunk after chunk, plain or sealed (zstd), with where each one
starts (offsets in decompressed bytes, as prime-rl's index gives them).

A sealed chunk is read front to back as independent zstd frames (the seek table is a skippable
frame). A corrupt or cut chunk is :class:`ChunkDamage`, for the caller's strictness to decide; a
last line without its newline (a process that died mid-append) has ``ended`` False.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import zstandard

from .layout import ChunkFile

_BUFFER = 1 << 20  # lines of long episodes are hundreds of KB


class ChunkDamage(Exception):
    """A chunk that cannot be read to its end: ``path``, the line reached and why."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


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
    """The decompressed bytes of a file of zstd frames; ``zstandard.ZstdError`` for a corrupt or
    cut frame (the package's stream reader ends quietly on a cut file)."""

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

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_chunk(file: ChunkFile) -> IO[bytes]:
    """The decompressed bytes of a stream file, buffered."""
    raw = open(file.path, "rb", buffering=_BUFFER)  # noqa: SIM115 (closed with the reader)
    if not file.sealed:
        return raw
    return io.BufferedReader(_Frames(raw), _BUFFER)


def read_files(files: list[ChunkFile], on_damage: Callable[[ChunkDamage], None]) -> Iterator[tuple[bool, Line]]:
    """``(last, line)``: every line of ``files`` in order (``last``: in the last file); a chunk
    that cannot be read on goes to ``on_damage`` and the next file is read."""
    for position, file in enumerate(files):
        lines = read_lines(file)
        while True:
            try:
                line = next(lines)
            except StopIteration:
                break
            except ChunkDamage as error:
                on_damage(error)
                break
            yield position == len(files) - 1, line


def read_lines(file: ChunkFile) -> Iterator[Line]:
    """Every non-blank line of one stream file; :class:`ChunkDamage` where it cannot be read on."""
    number = offset = 0
    try:
        with open_chunk(file) as handle:
            for raw in handle:
                number += 1
                ended = raw.endswith(b"\n")
                text = raw[:-1] if ended else raw
                if text.strip():
                    yield Line(file, number, offset, text, ended)
                offset += len(raw)
    except zstandard.ZstdError as error:
        raise ChunkDamage(file.path, number + 1, f"corrupt zstd data after line {number} ({error})") from None
    except OSError as error:
        raise ChunkDamage(file.path, number + 1, f"cannot be read after line {number} ({error})") from None
