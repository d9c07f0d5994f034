"""Where the service keeps its runs: in memory (tests, throw-away runs) or in SQLite under a data directory.

Every acknowledged write of a run is one journal row, written (and fsynced) before the service answers:
the operation's name and its validated request as JSON, under the run and a per-run sequence number.
A ship's history row goes in the same transaction. Restart loads each run's latest snapshot (the run's
``state_dict``, taken every :data:`SNAPSHOT_EVERY` writes or :data:`SNAPSHOT_BYTES` of journal) and
re-applies the journal rows after it, so restart time is bounded by one snapshot and a short journal
tail, however long the run. The journal is kept whole: it is the run's history, exported as SPEC 9
events (``GET /v1/runs/{run}/events``). See docs/decisions.md for why SQLite.
"""

from __future__ import annotations

import fcntl
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

__all__ = [
    "DATABASE_NAME",
    "SNAPSHOT_BYTES",
    "SNAPSHOT_EVERY",
    "JournalRow",
    "MemoryStore",
    "SqliteStore",
    "Store",
    "StoredRun",
    "dumps",
    "loads",
]

DATABASE_NAME = "staleness.sqlite3"
SNAPSHOT_EVERY = 256  # journal rows between snapshots
SNAPSHOT_BYTES = 64 * 1024 * 1024  # or this much journal, whichever comes first


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)  # records may hold arrays (see .decode)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


@dataclass(frozen=True)
class JournalRow:
    seq: int
    op: str
    request: Any


@dataclass(frozen=True)
class StoredRun:
    """A run as stored: its config, the latest snapshot (or None) and the journal rows after it."""

    name: str
    config: dict[str, Any]
    snapshot_seq: int
    snapshot: Any | None
    history: list[Any]  # history rows up to the snapshot
    tail: list[JournalRow]


class Store:
    """No persistence (``--in-memory``): every method is a no-op, and there is no history to export."""

    persistent = False

    def create_run(self, name: str, config: dict[str, Any]) -> None:
        pass

    def delete_run(self, name: str) -> None:
        pass

    def append(self, run: str, seq: int, op: str, request: Any, history_row: Any | None = None) -> int:
        """Journal one write; returns the bytes written (0 when nothing is stored)."""
        return 0

    def save_snapshot(self, run: str, seq: int, state: Any) -> None:
        pass

    def load(self) -> list[StoredRun]:
        return []

    def journal(self, run: str) -> Iterator[JournalRow]:
        return iter(())

    def close(self) -> None:
        pass


MemoryStore = Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (name TEXT PRIMARY KEY, config BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS journal (
    run TEXT NOT NULL, seq INTEGER NOT NULL, op TEXT NOT NULL, request BLOB NOT NULL, PRIMARY KEY (run, seq)
);
CREATE TABLE IF NOT EXISTS history (run TEXT NOT NULL, seq INTEGER NOT NULL, row BLOB NOT NULL, PRIMARY KEY (run, seq));
CREATE TABLE IF NOT EXISTS snapshots (run TEXT PRIMARY KEY, seq INTEGER NOT NULL, state BLOB NOT NULL);
"""


class SqliteStore(Store):
    """One SQLite database (WAL, ``synchronous=FULL``) under ``data_dir``; every write is its own transaction."""

    persistent = True

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        # One service per directory: two would interleave their journals. The lock dies with the process
        # (kill -9 included), so a restart never finds a stale one.
        self._lock_file = open(data_dir / "lock", "a+b")  # noqa: SIM115 - held for the store's lifetime
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"another service is using {data_dir}") from None
        self.path = data_dir / DATABASE_NAME
        self._lock = threading.Lock()  # one connection, shared by the request threads
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before the answer
        self._db.executescript(_SCHEMA)

    def _write(self, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    self._db.execute(sql, params)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def create_run(self, name: str, config: dict[str, Any]) -> None:
        self._write([("INSERT INTO runs (name, config) VALUES (?, ?)", (name, dumps(config)))])

    def delete_run(self, name: str) -> None:
        self._write([(f"DELETE FROM {table} WHERE {key} = ?", (name,)) for table, key in _RUN_TABLES])

    def append(self, run: str, seq: int, op: str, request: Any, history_row: Any | None = None) -> int:
        data = dumps(request)
        statements: list[tuple[str, tuple[Any, ...]]] = [
            ("INSERT INTO journal (run, seq, op, request) VALUES (?, ?, ?, ?)", (run, seq, op, data))
        ]
        if history_row is not None:
            statements.append(("INSERT INTO history (run, seq, row) VALUES (?, ?, ?)", (run, seq, dumps(history_row))))
        self._write(statements)
        return len(data)

    def save_snapshot(self, run: str, seq: int, state: Any) -> None:
        self._write([("INSERT OR REPLACE INTO snapshots (run, seq, state) VALUES (?, ?, ?)", (run, seq, dumps(state)))])

    def load(self) -> list[StoredRun]:
        with self._lock:
            runs = self._db.execute("SELECT name, config FROM runs ORDER BY rowid").fetchall()
            stored = []
            for name, config in runs:
                snap = self._db.execute("SELECT seq, state FROM snapshots WHERE run = ?", (name,)).fetchone()
                seq = 0 if snap is None else int(snap[0])
                history = [
                    loads(row)
                    for (row,) in self._db.execute(
                        "SELECT row FROM history WHERE run = ? AND seq <= ? ORDER BY seq", (name, seq)
                    )
                ]
                tail = [
                    JournalRow(int(s), op, loads(request))
                    for s, op, request in self._db.execute(
                        "SELECT seq, op, request FROM journal WHERE run = ? AND seq > ? ORDER BY seq", (name, seq)
                    )
                ]
                stored.append(
                    StoredRun(name, loads(config), seq, None if snap is None else loads(snap[1]), history, tail)
                )
            return stored

    def journal(self, run: str) -> Iterator[JournalRow]:
        """Every journal row of ``run``, oldest first, read page by page on a connection of its own."""
        reader = sqlite3.connect(self.path, check_same_thread=False)
        try:
            after = 0
            while True:
                page = reader.execute(
                    "SELECT seq, op, request FROM journal WHERE run = ? AND seq > ? ORDER BY seq LIMIT 256",
                    (run, after),
                ).fetchall()
                if not page:
                    return
                for seq, op, request in page:
                    yield JournalRow(int(seq), op, loads(request))
                after = int(page[-1][0])
        finally:
            reader.close()

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._lock_file.close()


_RUN_TABLES = (("runs", "name"), ("journal", "run"), ("history", "run"), ("snapshots", "run"))
