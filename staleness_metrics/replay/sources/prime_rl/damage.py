"""What a damaged run gets (SPEC 9): strict mode stops naming file, line and reason, lenient mode
sets the damaged part aside and counts it; and the stream index checked against the stream."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ....errors import EventError
from ....records import jsonio

_log = logging.getLogger("staleness_metrics.replay.sources.prime_rl")

# What can be set aside, as counted (the keys of :attr:`Damage.counts`).
DAMAGE_KINDS = {
    "bad_line": "lines that are not JSON",
    "not_episode": "stream lines that are not an episode record",
    "not_update": "annotation lines that are not an update",
    "bad_chunk": "chunks with corrupt or cut zstd data (the rest of the chunk)",
    "index_nowhere": "index rows pointing at no episode",
    "unknown_trace": "updates for a trace the stream does not hold",
    "bad_update": "updates that do not fit their trace (a branch it lacks, a stream longer than its branch)",
    "late_ship": "traces shipped at a step the replay had passed (their arrival came after the ship)",
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
        return ", ".join(f"{count} {DAMAGE_KINDS[kind]}" for kind, count in sorted(self.counts.items()))


Position = tuple[int, int]  # (chunk number, -1 in the single-file layout; byte offset)


class IndexCheck:
    """Walks the index in step with the stream (:meth:`see` each line, then :meth:`finish`)."""

    def __init__(self, path: Path | None, damage: Damage) -> None:
        self._path = path
        self._damage = damage
        self._rows = self._read(path) if path is not None else iter(())
        self._next: tuple[int, Position, str | None] | None = next(self._rows, None)

    def _read(self, path: Path) -> Iterator[tuple[int, Position, str | None]]:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
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
                if not isinstance(offset, int) or not _is_int(offset) or not (chunk is None or _is_int(chunk)):
                    self._damage.report(
                        "index_nowhere",
                        path,
                        number,
                        "an index row without a chunk and offset",
                    )
                    continue
                name = row.get("id")
                position: Position = (-1 if chunk is None else chunk, offset)
                yield number, position, name if isinstance(name, str) else None

    def _nowhere(self, reason: str) -> None:
        assert self._next is not None and self._path is not None
        number, (chunk, offset), name = self._next
        where = f"offset {offset}" if chunk < 0 else f"chunk {chunk:05d}, offset {offset}"
        self._damage.report(
            "index_nowhere",
            self._path,
            number,
            f"the row of episode {name!r} points at {where}: {reason}",
        )
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
        if self._next is None:
            return None
        chunk, offset = self._next[1]
        if chunk == position[0] and position[1] < offset < position[1] + size:
            return offset
        return None

    def finish(self) -> None:
        while self._next is not None:
            self._nowhere("past the end of the stream")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
