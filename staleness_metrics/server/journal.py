"""A run's journal: every write that changed the run is one row, persisted before it is
answered, and a snapshot now and then, so that a restart replays a short tail."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from ..state_checks import arrays_left_as_numpy
from .errors import RunBroken
from .idempotency import holds_large_array
from .store import SNAPSHOT_BYTES, SNAPSHOT_EVERY, Chunked, Store, encoded_pieces

__all__ = ["CHUNKED_ADD_RECORDS", "Journal", "add_row"]

logger = logging.getLogger("staleness_metrics.server")


CHUNKED_ADD_RECORDS = 256  # an add of more records than this is journalled a record at a time


def add_row(records: list[dict[str, Any]], duplicates: int) -> Any:
    """The journal request of an add, ``{"rollouts": records, "duplicates": n}``: a value, or
    for many records or large arrays the pieces of its text (:class:`~.store.Chunked`)."""
    large = [holds_large_array(record) for record in records]
    if len(records) <= CHUNKED_ADD_RECORDS and not any(large):
        return {"rollouts": records, "duplicates": duplicates}

    def pieces() -> Iterator[bytes]:  # byte for byte orjson.dumps of the request
        yield b'{"rollouts":['
        for number, (record, is_large) in enumerate(zip(records, large, strict=True)):
            if number:
                yield b","
            if is_large:
                yield from encoded_pieces(record)
            else:
                yield orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)
        yield b'],"duplicates":%d}' % duplicates

    return Chunked(pieces)


class Journal:
    """The journal of the run ``run`` in ``store``: its rows in order (``seq``), and when to
    snapshot ``state()``. While ``restoring``, writes are not written again; ``broken`` is the
    error of a write that could not be persisted (the run's memory is then ahead of its store)."""

    def __init__(self, run: str, store: Store, state: Callable[[], dict[str, Any]]) -> None:
        self.run = run
        self.store = store
        self._state = state
        self.seq = 0
        self.rows_since_snapshot = 0
        self.bytes_since_snapshot = 0
        self.restoring = False
        self.broken: BaseException | None = None

    def write(self, op: str, request: Any, history_row: Any | None = None) -> None:
        """Persist one write before it is answered (under the run's lock: in the order applied)."""
        if self.restoring:
            return
        self.seq += 1
        try:
            written = self.store.append(self.run, self.seq, op, request, history_row)
        except Exception as exc:
            self.broken = exc
            raise RunBroken(f"run {self.run!r}: the write was applied but could not be persisted: {exc}") from exc
        if not self.store.persistent:
            return
        self.rows_since_snapshot += 1
        self.bytes_since_snapshot += written
        if self.rows_since_snapshot >= SNAPSHOT_EVERY or self.bytes_since_snapshot >= SNAPSHOT_BYTES:
            self.snapshot()

    def snapshot(self) -> None:
        try:
            # the queue's arrays written by orjson, never as Python lists
            with arrays_left_as_numpy():
                state = self._state()
            self.store.save_snapshot(self.run, self.seq, state)
        except Exception:  # the journal still holds everything: a restart replays a longer tail
            logger.exception("run %s: snapshot failed", self.run)
            return
        self.rows_since_snapshot = self.bytes_since_snapshot = 0
