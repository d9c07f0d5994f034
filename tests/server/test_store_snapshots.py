"""A run's snapshot is written into SQLite a piece at a time, as the text it always had.

The state's JSON text is checksummed in one pass and written into the row's blob in another (SQLite's
incremental blob I/O), so a run queuing millions of positions is never one text in memory, nor a bound
copy of it in SQLite. The bytes stored are ``dumps(state)`` exactly, and data directories written before
(the snapshot's state ahead of its checksum, schema 1) are migrated at the first start and load as they did.
"""

from __future__ import annotations

import shutil
import sqlite3
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from staleness_metrics.server import ExportSettings, RunRegistry
from staleness_metrics.server.models import ShipRequest
from staleness_metrics.server.store import (
    DATABASE_NAME,
    SNAPSHOT_EVERY,
    SqliteStore,
    StoreDamaged,
    checksum,
    dumps,
)
from staleness_metrics.state_checks import PIECE_ITEMS

from .test_storage_damage import RUN, write_directory


def stored_snapshot(data_dir: Path, run: str = RUN) -> tuple[int, bytes, str]:
    with sqlite3.connect(data_dir / DATABASE_NAME) as db:
        seq, state, check = db.execute("SELECT seq, state, checksum FROM snapshots WHERE run = ?", (run,)).fetchone()
    return int(seq), state, check


def columns(data_dir: Path, table: str) -> list[str]:
    with sqlite3.connect(data_dir / DATABASE_NAME) as db:
        return [row[1] for row in db.execute(f"PRAGMA table_info({table})")]


def user_version(data_dir: Path) -> int:
    with sqlite3.connect(data_dir / DATABASE_NAME) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def state_with_arrays() -> dict[str, Any]:
    """A state shaped as a run's: nested dicts and lists, arrays over a piece (as a queue's are handed to
    orjson), strings, numbers and small lists."""
    return {
        "format": 1,
        "seq": 300,
        "monitor": {
            "sink": {
                "chunks": [
                    {"mask": {"dtype": "|i1", "data": np.ones(5 * PIECE_ITEMS + 3, dtype=np.int8)}},
                    {"weights": {"dtype": "<f8", "data": np.linspace(0.0, 1.0, 2 * PIECE_ITEMS + 1)}},
                ],
                "ids": [f"r{i}" for i in range(1000)],
            },
            "digests": {"run": "ab" * 16},
        },
        "received": {f"r{i}": "cd" * 16 for i in range(1000)},
        "answers": [[[1, None, False], {"step": 1, "counts": {"rollouts_shipped": 3}}]],
        "text": 'é \u2028 "quoted"',
    }


def test_a_snapshot_is_stored_as_its_whole_text_would_be(tmp_path: Path) -> None:
    """The stored bytes are ``dumps(state)`` and the checksum theirs; a later snapshot replaces it."""
    store = SqliteStore(tmp_path)
    store.create_run(RUN, {})
    state = state_with_arrays()
    store.save_snapshot(RUN, 300, state)
    text = dumps(state)
    assert stored_snapshot(tmp_path) == (300, text, checksum("snapshots", RUN, 300, text))
    state["seq"] = 301
    store.save_snapshot(RUN, 301, state)
    store.close()
    text = dumps(state)
    assert stored_snapshot(tmp_path) == (301, text, checksum("snapshots", RUN, 301, text))


def test_a_state_nested_deeper_than_pieces_follow_is_stored_whole(tmp_path: Path) -> None:
    state: Any = {"leaf": np.ones(2 * PIECE_ITEMS, dtype=np.int8)}
    for _ in range(60):  # 121 levels: deeper than pieces follow, within what orjson writes
        state = {"inner": [state]}
    store = SqliteStore(tmp_path)
    store.create_run(RUN, {})
    store.save_snapshot(RUN, 1, state)
    store.close()
    text = dumps(state)
    assert stored_snapshot(tmp_path) == (1, text, checksum("snapshots", RUN, 1, text))


def test_a_large_snapshot_is_never_one_text_in_memory(tmp_path: Path) -> None:
    """Saving a state of 32 MB of text allocates a small part of it (pieces, and the buffer written into
    SQLite at once), where encoding it whole held all of it."""
    state = {"queue": {"dtype": "|i1", "data": np.ones(16 * 2**20, dtype=np.int8)}}
    store = SqliteStore(tmp_path)
    store.create_run(RUN, {})
    tracemalloc.start()
    try:
        store.save_snapshot(RUN, 1, state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    store.close()
    text = stored_snapshot(tmp_path)[1]
    assert text == dumps(state) and len(text) > 32 * 2**20
    assert peak < len(text) / 5, f"{peak} bytes traced saving {len(text)} bytes of text"


def as_schema_1(data_dir: Path) -> None:
    """The snapshots table as releases before schema 2 created it: the state ahead of the checksum."""
    with sqlite3.connect(data_dir / DATABASE_NAME) as db:
        db.execute(
            "CREATE TABLE snapshots_v1 (run TEXT PRIMARY KEY, seq INTEGER NOT NULL, state BLOB NOT NULL, checksum TEXT)"
        )
        db.execute("INSERT INTO snapshots_v1 SELECT run, seq, state, checksum FROM snapshots")
        db.execute("DROP TABLE snapshots")
        db.execute("ALTER TABLE snapshots_v1 RENAME TO snapshots")
        db.execute("PRAGMA user_version = 1")


def restored_answers(data_dir: Path) -> tuple[Any, ...]:
    """What a restart of ``data_dir`` serves: the run's info, and the answer to its next ship."""
    registry = RunRegistry(ExportSettings(), SqliteStore(data_dir))
    assert registry.restore(background=False) == 2  # RUN and an empty one
    run = registry.get(RUN)
    info = run.info().model_dump()
    shipped = run.ship(ShipRequest(step=SNAPSHOT_EVERY)).model_dump()
    registry.close()
    return info, shipped


def test_a_directory_from_before_schema_2_is_migrated_and_loads_as_it_did(tmp_path: Path) -> None:
    written = tmp_path / "written"
    write_directory(written, rows=SNAPSHOT_EVERY + 5)  # one snapshot, then a tail
    old = tmp_path / "old"
    shutil.copytree(written, old)
    as_schema_1(old)
    seq, text, check = stored_snapshot(old)
    assert columns(old, "snapshots")[-1] == "checksum" and seq == SNAPSHOT_EVERY

    SqliteStore(old).close()  # the first start migrates
    assert user_version(old) == 2 and columns(old, "snapshots") == ["run", "seq", "checksum", "state"]
    assert stored_snapshot(old) == (seq, text, check)  # moved as it was, checksum included
    assert restored_answers(old) == restored_answers(written)

    # The migrated table takes snapshots in pieces (the clean shutdown above took one), and still refuses a
    # damaged one.
    seq, text, check = stored_snapshot(old)
    assert seq == SNAPSHOT_EVERY + 6  # the ship after the restart, journalled, then snapshotted at close
    store = SqliteStore(old)
    store.save_snapshot(RUN, seq, orjson.loads(text))
    store.close()
    assert stored_snapshot(old) == (seq, text, check)
    with sqlite3.connect(old / DATABASE_NAME) as db:
        db.execute("UPDATE snapshots SET state = ? WHERE run = ?", (text[:-7], RUN))
    store = SqliteStore(old)
    with pytest.raises(StoreDamaged, match=f"snapshot \\(taken at journal row {seq}\\).*checksum"):
        store.load()
    store.close()
