"""Where the service keeps its runs: in memory, or in SQLite under a data directory (a journal
row per acknowledged write, history rows, snapshots, each row checksummed; see docs/service.md)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from ..config import StalenessConfig
from ..state_checks import PIECED_DEPTH, NestedTooDeep, json_pieces
from .models import reason_of

DATABASE_NAME = "staleness.sqlite3"
MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 2  # PRAGMA user_version; 1: rows carry checksums; 2: a snapshot's state last
SNAPSHOT_EVERY = 256  # journal rows between snapshots
SNAPSHOT_BYTES = 64 * 1024 * 1024  # or this much journal, whichever comes first
PIECE_BYTES = 1024 * 1024  # journal or snapshot text written into SQLite at once
Pieces = Callable[[], Iterable[bytes]]  # a row's JSON text, made again at each call


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)  # records may hold arrays


@dataclass(frozen=True)
class Chunked:
    """A journal request as the pieces of its JSON text (made twice: to size it, to write it)."""

    pieces: Pieces


class StoreDamaged(RuntimeError):
    """The data directory does not hold what was written to it: the service refuses to start."""

    def __init__(self, data_dir: Path, what: str) -> None:
        super().__init__(
            f"{what}. Refusing to start on damaged data: nothing was changed. To keep the "
            f"data, restore {data_dir} from a backup; to start fresh on purpose, move it "
            f"aside (mv {data_dir} {data_dir}.damaged) and start again: the service "
            "creates a new, empty directory."
        )


def checksum(table: str, run: str, seq: int, data: bytes, op: str | None = None) -> str:
    """What a stored row must match: its bytes (after its ``op``), and where it belongs."""
    return _sized(table, run, seq, [data], op)[1]


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
    history: dict[int, Any]  # history rows up to the snapshot, by their ship's journal row
    tail: list[JournalRow]


class Store:
    """No persistence (``--in-memory``): every method is a no-op."""

    persistent = False

    def create_run(self, name: str, config: dict[str, Any]) -> None: ...
    def delete_run(self, name: str) -> None: ...
    def save_snapshot(self, run: str, seq: int, state: Any) -> None: ...
    def close(self) -> None: ...

    def reopen(self) -> Store:
        return self  # in memory: nothing to reopen

    def append(self, run: str, seq: int, op: str, request: Any, history: list[tuple[int, Any]] | None = None) -> int:
        """Journal one write (and history rows by their ship's seq); returns the bytes written."""
        return 0

    def load(self) -> list[StoredRun]:
        return []

    def journal(self, run: str) -> Iterator[JournalRow]:
        return iter(())


_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (name TEXT PRIMARY KEY, config BLOB NOT NULL, checksum TEXT);
CREATE TABLE IF NOT EXISTS journal (
    run TEXT NOT NULL, seq INTEGER NOT NULL, op TEXT NOT NULL, checksum TEXT, request BLOB NOT NULL,
    PRIMARY KEY (run, seq)
);
CREATE TABLE IF NOT EXISTS history (
    run TEXT NOT NULL, seq INTEGER NOT NULL, row BLOB NOT NULL, checksum TEXT, PRIMARY KEY (run, seq)
);
CREATE TABLE IF NOT EXISTS snapshots (run TEXT PRIMARY KEY, seq INTEGER NOT NULL, checksum TEXT, state BLOB NOT NULL);
"""
# A blob is written in place only as its row's last column: schema 2 put the state last.
_SNAPSHOTS_REORDERED = (
    "CREATE TABLE snapshots_reordered (run TEXT PRIMARY KEY, seq INTEGER NOT NULL, checksum TEXT, state BLOB NOT NULL)",
    "INSERT INTO snapshots_reordered (run, seq, checksum, state) SELECT run, seq, checksum, state FROM snapshots",
    "DROP TABLE snapshots",
    "ALTER TABLE snapshots_reordered RENAME TO snapshots",
)

_DATA_COLUMN = {"runs": "config", "journal": "request", "history": "row", "snapshots": "state"}
_ROW_NAME = {
    "runs": "configuration",
    "journal": "journal row {seq}",
    "history": "history row {seq} (the ship journalled as row {seq})",
    "snapshots": "snapshot (taken at journal row {seq})",
}


class SqliteStore(Store):
    """One SQLite database (WAL, ``synchronous=FULL``) under ``data_dir``; a transaction a write."""

    persistent = True

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        # one service per directory; the lock dies with the process (kill -9 included)
        self._lock_file = open(data_dir / "lock", "a+b")  # noqa: SIM115 - held while it lives
        try:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"another service is using {data_dir}") from None
            self._open(data_dir)
        except BaseException:
            self._lock_file.close()
            raise

    def _open(self, data_dir: Path) -> None:
        self.path = data_dir / DATABASE_NAME
        self.manifest_path = data_dir / MANIFEST_NAME
        manifest = self._read_manifest()
        says = f"{self.manifest_path} says the directory holds {len(manifest)} run(s)"
        says += f" ({quoted(manifest)})"
        if manifest and not self.path.exists():  # connecting would create an empty one
            raise StoreDamaged(data_dir, f"the database {self.path} is missing, but {says}")
        self._lock = threading.Lock()  # one connection, shared by the request threads
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._in_place = getattr(self._db, "blobopen", None) is not None
        try:
            # read before anything is written: a damaged database is left as it was found
            has_runs = self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'")
            stored = set() if has_runs.fetchone() is None else {n for (n,) in self._db.execute("SELECT name FROM runs")}
            if missing := [name for name in manifest if name not in stored]:
                what = "is empty" if not stored else f"holds {len(stored)} run(s) but not {quoted(missing)}"
                raise StoreDamaged(data_dir, f"the database {self.path} {what}, but {says}")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before the answer
            if self._db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                self._migrate()
            # a journal from before the request came last, or Python 3.10: texts are bound whole
            columns = [row[1] for row in self._db.execute("PRAGMA table_info(journal)")]
            self._journal_in_place = self._in_place and columns[-1:] == ["request"]
        except BaseException as exc:
            self._db.close()
            if isinstance(exc, sqlite3.DatabaseError):  # not a database, or its pages are damaged
                raise StoreDamaged(data_dir, f"the database {self.path} cannot be read ({exc})") from None
            raise
        if sorted(stored) != sorted(manifest):
            self._write_manifest(sorted(stored))  # a crash between a new run's commit and manifest

    def _read_manifest(self) -> list[str]:
        try:
            raw = self.manifest_path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            runs = orjson.loads(raw)["runs"]
            if not isinstance(runs, list) or not all(isinstance(name, str) for name in runs):
                raise TypeError("runs: not a list of names")
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreDamaged(self.data_dir, f"the manifest {self.manifest_path} cannot be read ({exc})") from None
        return runs

    def _write_manifest(self, runs: list[str], commit: Callable[[], None] = lambda: None) -> None:
        """Replace the manifest atomically: written beside the old one (a full disk fails it there),
        then ``commit()`` (a failure leaves the old one), renamed, the directory fsynced."""
        partial = self.manifest_path.with_suffix(".json.partial")
        try:
            with open(partial, "wb") as out:
                out.write(dumps({"format": 1, "database": DATABASE_NAME, "runs": runs}))
                out.flush()
                os.fsync(out.fileno())
            commit()
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, self.manifest_path)
        directory = os.open(self.data_dir, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def _manifest_runs(self) -> list[str]:
        with self._lock:
            return [name for (name,) in self._db.execute("SELECT name FROM runs ORDER BY name")]

    def _migrate(self) -> None:
        """Create the tables, or bring an older database up to :data:`SCHEMA_VERSION`."""
        with self._transaction() as db:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            for table, column in _DATA_COLUMN.items():
                if "checksum" not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN checksum TEXT")
                # the rows written before checksums existed, stamped once each decodes
                key = "name, 0" if table == "runs" else "run, seq"
                op_column = "op" if table == "journal" else "NULL"
                select = f"SELECT rowid, {key}, {op_column}, {column} FROM {table}"
                unstamped = db.execute(f"{select} WHERE checksum IS NULL").fetchall()
                for rowid, run, seq, op, data in unstamped:
                    self._decode(table, run, int(seq), data)
                    stamp = checksum(table, run, int(seq), data, op)
                    db.execute(f"UPDATE {table} SET checksum = ? WHERE rowid = ?", (stamp, rowid))
            if [row[1] for row in db.execute("PRAGMA table_info(snapshots)")][-1] != "state":
                for statement in _SNAPSHOTS_REORDERED:
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _damaged(self, table: str, run: str, seq: int, reason: str) -> StoreDamaged:
        row = _ROW_NAME[table].format(seq=seq)
        return StoreDamaged(self.data_dir, f"run {run!r}: its {row} in {self.path} {reason}")

    def _decode(self, table: str, run: str, seq: int, data: Any) -> Any:
        if not isinstance(data, bytes):
            raise self._damaged(table, run, seq, f"holds {type(data).__name__}, not stored JSON")
        try:
            return orjson.loads(data)
        except ValueError as exc:
            raise self._damaged(table, run, seq, f"is not valid JSON ({exc})") from None

    def _checked(self, table: str, run: str, seq: int, data: Any, stored: Any, op: str | None = None) -> Any:
        """The decoded row, once its checksum matches."""
        if isinstance(data, bytes) and stored != checksum(table, run, seq, data, op):
            changed = "its bytes changed after they were written: a flipped or truncated value"
            reason = "has no checksum" if stored is None else f"fails its checksum ({changed})"
            raise self._damaged(table, run, seq, reason)
        return self._decode(table, run, seq, data)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _write(self, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        with self._transaction() as db:
            for sql, params in statements:
                db.execute(sql, params)

    def create_run(self, name: str, config: dict[str, Any]) -> None:
        data = dumps(config)
        # (or replace: the row of a creation that failed after its commit, retried)
        insert = "INSERT OR REPLACE INTO runs (name, config, checksum) VALUES (?, ?, ?)"
        created = (insert, (name, data, checksum("runs", name, 0, data)))
        # renamed in place after the commit: a crash between leaves a run the manifest lacks
        self._write_manifest(sorted({*self._manifest_runs(), name}), lambda: self._write([created]))

    def delete_run(self, name: str) -> None:
        # before the delete: a crash between leaves a run the manifest lacks
        self._write_manifest([run for run in self._manifest_runs() if run != name])
        tables = ((table, "name" if table == "runs" else "run") for table in _DATA_COLUMN)
        self._write([(f"DELETE FROM {table} WHERE {key} = ?", (name,)) for table, key in tables])

    def append(self, run: str, seq: int, op: str, request: Any, history: list[tuple[int, Any]] | None = None) -> int:
        insert = "INSERT INTO journal (run, seq, op, checksum, request) VALUES (?, ?, ?, ?, {})"
        if isinstance(request, Chunked) and self._journal_in_place:
            return self._write_in_place("journal", insert, run, seq, request.pieces, op)
        data = b"".join(request.pieces()) if isinstance(request, Chunked) else dumps(request)
        values = (run, seq, op, checksum("journal", run, seq, data, op), data)
        statements: list[tuple[str, tuple[Any, ...]]] = [(insert.format("?"), values)]
        for at, row in history or ():  # a ship's row, or one its step's posted sums went into later
            text = dumps(row)
            insert = "INSERT OR REPLACE INTO history (run, seq, row, checksum) VALUES (?, ?, ?, ?)"
            statements.append((insert, (run, at, text, checksum("history", run, at, text))))
        self._write(statements)
        return len(data)

    def _write_in_place(
        self, table: str, insert: str, run: str, seq: int, pieces: Pieces, op: str | None = None
    ) -> int:
        """Insert a row ending in ``zeroblob(size)``, then write ``pieces()`` in it: the size."""
        size, check = _sized(table, run, seq, pieces(), op)
        key = (run, seq) if op is None else (run, seq, op)
        with self._transaction() as db:
            cursor = db.execute(insert.format("zeroblob(?)"), (*key, check, size))
            assert cursor.lastrowid is not None
            with db.blobopen(table, _DATA_COLUMN[table], cursor.lastrowid) as blob:  # type: ignore[attr-defined]
                buffer = bytearray()
                for piece in pieces():
                    buffer += piece
                    if len(buffer) >= PIECE_BYTES:
                        blob.write(buffer)
                        buffer.clear()
                blob.write(buffer)
                if blob.tell() != size:  # the pieces changed between the passes: never store that
                    raise RuntimeError(f"a {table} row's text changed while it was written")
        return size

    def save_snapshot(self, run: str, seq: int, state: Any) -> None:
        """``dumps(state)``, byte for byte, written in place a piece at a time where it can be."""
        insert = "INSERT OR REPLACE INTO snapshots (run, seq, checksum, state) VALUES (?, ?, ?, {})"
        pieces = partial(json_pieces, state, orjson.OPT_SERIALIZE_NUMPY, max_depth=PIECED_DEPTH)
        if self._in_place:
            with contextlib.suppress(NestedTooDeep):  # then encoded whole (by orjson, or refused)
                self._write_in_place("snapshots", insert, run, seq, pieces)
                return
        data = dumps(state)
        self._write([(insert.format("?"), (run, seq, checksum("snapshots", run, seq, data), data))])

    def load(self) -> list[StoredRun]:
        """Every run, each row checked, then each configuration (else :class:`StoreDamaged`)."""
        with self._lock:
            rows = self._db.execute("SELECT name, config, checksum FROM runs ORDER BY rowid").fetchall()
        runs = [self._load_run(name, config, check) for name, config, check in rows]
        for run in runs:
            try:
                StalenessConfig(**run.config)
            except Exception as exc:
                what = f"run {run.name!r}: its configuration cannot be loaded: {reason_of(exc)}"
                raise StoreDamaged(self.data_dir, what) from None
        return runs

    def _load_run(self, name: str, config_data: Any, config_check: Any) -> StoredRun:
        config = self._checked("runs", name, 0, config_data, config_check)
        with self._lock:
            snap = self._db.execute("SELECT seq, state, checksum FROM snapshots WHERE run = ?", (name,)).fetchone()
            seq = 0 if snap is None else int(snap[0])
            history_rows = self._db.execute(
                "SELECT seq, row, checksum FROM history WHERE run = ? AND seq <= ? ORDER BY seq",
                (name, seq),
            ).fetchall()
            # the whole journal is the run's history (its events): checked from row 1
            query = "SELECT COUNT(*), COALESCE(MAX(seq), 0) FROM journal WHERE run = ?"
            count, last = self._db.execute(query, (name,)).fetchone()
            gap = None
            if count != last or last < seq:
                gap = self._db.execute(
                    "SELECT MIN(seq) FROM (SELECT 1 AS seq UNION ALL SELECT seq + 1 FROM journal "
                    "WHERE run = ?) WHERE seq NOT IN (SELECT seq FROM journal WHERE run = ?)",
                    (name, name),
                ).fetchone()[0]
        if gap is not None and gap <= max(seq, last):
            after = f"the journal jumps from row {gap - 1} to a later row"
            if gap > last:
                after = f"it ends there, though the run's snapshot was taken at row {seq}"
            raise self._damaged("journal", name, gap, f"is missing ({after}: a gap in its sequence)")
        snapshot = None if snap is None else self._checked("snapshots", name, seq, snap[1], snap[2])
        history = {int(s): self._checked("history", name, int(s), row, check) for s, row, check in history_rows}
        return StoredRun(name, config, seq, snapshot, history, list(self.journal(name, after=seq)))

    def journal(self, run: str, after: int = 0) -> Iterator[JournalRow]:
        """The journal rows of ``run`` after row ``after``, checked, on a connection of its own."""
        with contextlib.closing(sqlite3.connect(self.path, check_same_thread=False)) as reader:
            while True:
                page = reader.execute(
                    "SELECT seq, op, request, checksum FROM journal WHERE run = ? AND seq > ? ORDER BY seq LIMIT 256",
                    (run, after),
                ).fetchall()
                if not page:
                    return
                for seq, op, request, check in page:
                    yield JournalRow(int(seq), op, self._checked("journal", run, int(seq), request, check, op))
                after = int(page[-1][0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._lock_file.close()

    def reopen(self) -> Store:
        return type(self)(self.data_dir)  # checked and locked again, as a restart opens it


def _sized(table: str, run: str, seq: int, pieces: Iterable[bytes], op: str | None = None) -> tuple[int, str]:
    """The size of the text ``pieces`` make, and its :func:`checksum`."""
    digest = hashlib.blake2b(b"" if op is None else op.encode() + b"\0", digest_size=16)
    size = 0
    for piece in pieces:
        digest.update(piece)
        size += len(piece)
    digest.update(f"\0{table}\0{run}\0{seq}".encode())
    return size, digest.hexdigest()


def quoted(names: list[str], most: int = 5) -> str:
    """The first ``most`` names, quoted, and how many more."""
    shown = ", ".join(repr(name) for name in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
