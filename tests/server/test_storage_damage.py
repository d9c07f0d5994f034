"""A data directory that does not hold what was written to it is refused at start, never loaded.

Each test writes a data directory through the service's own registry and store (no clean shutdown, as
after ``kill -9``, so the journal has a tail after the last snapshot), damages it the way disks and
operators do, and starts the real ``serve --data-dir`` command on it: the command must exit 1 with a
message that names the run and the row and says how to start fresh on purpose, never a raw decoder error.
"""

from __future__ import annotations

import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from staleness_metrics.config import StalenessConfig
from staleness_metrics.server import ExportSettings, RunRegistry, ServerSettings
from staleness_metrics.server.models import ShipRequest
from staleness_metrics.server.store import (
    DATABASE_NAME,
    MANIFEST_NAME,
    SNAPSHOT_EVERY,
    Chunked,
    SqliteStore,
    checksum,
)

from .conftest import ROOT, ServeProcess, ThreadServer, child_env, serve_command

pytestmark = pytest.mark.integration

RUN = "exp-7"


def rollout(rid: str, version: int) -> dict[str, object]:
    return {"id": rid, "dispatch_version": version, "samples": [{"mask": [1, 1, 1], "weight_versions": [[version, 0]]}]}


def write_directory(data_dir: Path, rows: int = 12) -> None:
    """Two runs; ``RUN`` gets ``rows`` journal rows (adds, and a ship every fourth), left as after kill -9."""
    registry = RunRegistry(ExportSettings(), SqliteStore(data_dir))
    registry.create("other", StalenessConfig())
    run, _ = registry.create(RUN, StalenessConfig(max_staleness=2))
    for i in range(rows):
        if i % 4 == 3:
            run.ship(ShipRequest(step=i // 4 + 1))
        else:
            run.add([rollout(f"r{i}", i // 4)])
    registry.store.close()  # no final snapshot


def start(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """``serve --data-dir`` on a damaged directory: it must exit by itself (the timeout only guards a hang)."""
    return subprocess.run(
        serve_command(["--port", "0", "--log-level", "warning", "--data-dir", str(data_dir)]),
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_refused(result: subprocess.CompletedProcess[str], data_dir: Path, *named: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "staleness-metrics service on http://" not in result.stdout  # never served
    message = result.stderr
    for part in named:
        assert part in message, message
    assert f"mv {data_dir} {data_dir}.damaged" in message  # how to start fresh on purpose
    assert "Traceback" not in message and "JSONDecodeError" not in message and "orjson" not in message


def edit_row(data_dir: Path, sql: str, *params: object) -> None:
    with sqlite3.connect(data_dir / DATABASE_NAME) as db:
        changed = db.execute(sql, params).rowcount
    assert changed == 1


def request_of(data_dir: Path, seq: int) -> bytes:
    with sqlite3.connect(data_dir / DATABASE_NAME) as db:
        (data,) = db.execute("SELECT request FROM journal WHERE run = ? AND seq = ?", (RUN, seq)).fetchone()
    assert isinstance(data, bytes)
    return data


def test_an_undamaged_directory_starts_and_keeps_its_runs(tmp_path: Path) -> None:
    """The baseline for the tests below: the same directory, undamaged, loads (checked in-process)."""
    write_directory(tmp_path)
    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore() == 2
    assert restored.get(RUN).info().ships == 3 and restored.get(RUN).info().rollouts_received == 9
    restored.close()


def test_an_emptied_database_file_is_refused(tmp_path: Path) -> None:
    write_directory(tmp_path)
    (tmp_path / DATABASE_NAME).write_bytes(b"")  # 0 bytes, as after a truncating copy or a full disk
    assert_refused(start(tmp_path), tmp_path, str(tmp_path / DATABASE_NAME), "is empty", repr(RUN), "'other'")
    assert (tmp_path / DATABASE_NAME).stat().st_size == 0  # left as found: no empty tables written into it


def test_a_missing_database_with_the_manifest_is_refused(tmp_path: Path) -> None:
    write_directory(tmp_path)
    (tmp_path / DATABASE_NAME).unlink()
    assert (tmp_path / MANIFEST_NAME).exists()
    result = start(tmp_path)
    assert_refused(result, tmp_path, "is missing", str(tmp_path / MANIFEST_NAME), "2 run(s)", repr(RUN))
    assert not (tmp_path / DATABASE_NAME).exists()  # nothing was created in its place


def test_a_flipped_digit_in_a_journal_row_is_refused(tmp_path: Path) -> None:
    write_directory(tmp_path)
    data = request_of(tmp_path, 5)
    flipped = data.replace(b'"dispatch_version":1', b'"dispatch_version":0')  # still valid JSON, still a record
    assert flipped != data
    edit_row(tmp_path, "UPDATE journal SET request = ? WHERE run = ? AND seq = 5", flipped, RUN)
    assert_refused(start(tmp_path), tmp_path, f"run {RUN!r}", "journal row 5", "fails its checksum")


def test_a_truncated_journal_row_is_refused(tmp_path: Path) -> None:
    write_directory(tmp_path)
    data = request_of(tmp_path, 6)
    edit_row(tmp_path, "UPDATE journal SET request = ? WHERE run = ? AND seq = 6", data[: len(data) // 2], RUN)
    assert_refused(start(tmp_path), tmp_path, f"run {RUN!r}", "journal row 6", "fails its checksum")


def test_a_gap_in_the_journal_sequence_is_refused(tmp_path: Path) -> None:
    write_directory(tmp_path)
    edit_row(tmp_path, "DELETE FROM journal WHERE run = ? AND seq = 7", RUN)
    assert_refused(start(tmp_path), tmp_path, f"run {RUN!r}", "journal row 7 ", "is missing", "gap")


def test_a_damaged_snapshot_is_refused(tmp_path: Path) -> None:
    write_directory(tmp_path, rows=SNAPSHOT_EVERY + 5)  # one snapshot, then a tail
    with sqlite3.connect(tmp_path / DATABASE_NAME) as db:
        (seq, state) = db.execute("SELECT seq, state FROM snapshots WHERE run = ?", (RUN,)).fetchone()
    edit_row(tmp_path, "UPDATE snapshots SET state = ? WHERE run = ?", state[:-7], RUN)
    assert_refused(start(tmp_path), tmp_path, f"run {RUN!r}", f"snapshot (taken at journal row {seq})", "checksum")


def test_a_database_from_before_checksums_is_migrated_then_protected(tmp_path: Path) -> None:
    """Rows written without checksums are stamped at the first start (once each decodes), then checked."""
    write_directory(tmp_path)
    (tmp_path / MANIFEST_NAME).unlink()
    with sqlite3.connect(tmp_path / DATABASE_NAME) as db:  # as the previous release wrote it
        for table in ("runs", "journal", "history", "snapshots"):
            db.execute(f"ALTER TABLE {table} DROP COLUMN checksum")
        db.execute("PRAGMA user_version = 0")
    migrated = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert migrated.restore() == 2 and migrated.get(RUN).info().ships == 3
    migrated.store.close()
    assert (tmp_path / MANIFEST_NAME).exists()  # written from the database at the migration
    data = request_of(tmp_path, 2)
    edit_row(tmp_path, "UPDATE journal SET request = ? WHERE run = ? AND seq = 2", data.replace(b"r1", b"r7"), RUN)
    assert_refused(start(tmp_path), tmp_path, f"run {RUN!r}", "journal row 2", "fails its checksum")


def test_an_undecodable_row_of_an_old_database_is_named_at_the_migration(tmp_path: Path) -> None:
    write_directory(tmp_path)
    with sqlite3.connect(tmp_path / DATABASE_NAME) as db:
        db.execute("ALTER TABLE journal DROP COLUMN checksum")
        db.execute("PRAGMA user_version = 0")
    data = request_of(tmp_path, 3)
    edit_row(tmp_path, "UPDATE journal SET request = ? WHERE run = ? AND seq = 3", data[:-3], RUN)
    assert_refused(start(tmp_path), tmp_path, f"run {RUN!r}", "journal row 3", "is not valid JSON")


def test_a_row_that_cannot_be_applied_again_makes_its_run_unavailable_and_healthz_names_it(
    tmp_path: Path, serve_process: Callable[..., ServeProcess]
) -> None:
    """A row whose bytes are intact but which the run cannot apply (here: an operation this version does
    not know) cannot be told at the checksum: the service starts, that run answers 503 with the row named,
    /healthz answers 503 naming it, and the other runs are served."""
    write_directory(tmp_path)
    data = orjson.dumps({"step": 9})
    with sqlite3.connect(tmp_path / DATABASE_NAME) as db:
        db.execute(
            "INSERT INTO journal (run, seq, op, request, checksum) VALUES (?, 13, 'rewind', ?, ?)",
            (RUN, data, checksum("journal", RUN, 13, b"rewind\0" + data)),
        )
    served = serve_process(["--data-dir", str(tmp_path)])
    with httpx.Client(base_url=served.url, timeout=60) as http:
        health = http.get("/healthz")
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "unavailable" and body["runs"] == 1 and list(body["unavailable"]) == [RUN]
        assert "journal row 13 (rewind)" in body["unavailable"][RUN]
        answer = http.get(f"/v1/runs/{RUN}")
        assert answer.status_code == 503 and "journal row 13" in answer.json()["detail"]
        assert http.get("/v1/runs/other").status_code == 200  # the other run is served
        assert http.delete(f"/v1/runs/{RUN}").status_code == 204  # the way out the message names
        assert http.get("/healthz").status_code == 200


def test_a_history_row_that_does_not_load_is_named_when_steps_reads_it(
    tmp_path: Path, serve_process: Callable[..., ServeProcess]
) -> None:
    """History rows are validated when ``/steps`` first reads them (a restart no longer validates every
    ship's): one whose bytes pass their checksum but that does not load (only a bug could write one)
    leaves the newer rows served, answers 503 naming the ship once read, and ``/healthz`` names it then."""
    write_directory(tmp_path, rows=SNAPSHOT_EVERY + 5)  # 65 ships, in the snapshot's history
    data = orjson.dumps({"ship": 1, "step": "one"})
    sql = "UPDATE history SET row = ?, checksum = ? WHERE run = ? AND seq = 4"  # ship 1: journal row 4
    edit_row(tmp_path, sql, data, checksum("history", RUN, 4, data), RUN)
    served = serve_process(["--data-dir", str(tmp_path)])
    with httpx.Client(base_url=served.url, timeout=60) as http:
        newest = http.get(f"/v1/runs/{RUN}/steps", params={"since": 60})
        assert newest.status_code == 200 and [row["ship"] for row in newest.json()["steps"]] == [61, 62, 63, 64, 65]
        everything = http.get(f"/v1/runs/{RUN}/steps")
        assert everything.status_code == 503 and "history row of ship 1 cannot be loaded" in everything.json()["detail"]
        health = http.get("/healthz")
        assert health.status_code == 503 and "history row of ship 1" in health.json()["unavailable"][RUN]
        assert http.get("/v1/runs/other").status_code == 200  # the other run is served


def test_healthz_names_a_run_that_could_not_persist_a_write(
    tmp_path: Path, start_server: Callable[..., ThreadServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server(ServerSettings(data_dir=tmp_path))
    store = server.app.state.runs.store
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.put("/v1/runs/fine", json={}).status_code == 201
        assert http.put(f"/v1/runs/{RUN}", json={}).status_code == 201
        assert http.get("/healthz").status_code == 200
        write = store.append

        def disk_full(run: str, *args: Any, **kwargs: Any) -> int:
            if run == RUN:
                raise OSError(28, "No space left on device")
            return write(run, *args, **kwargs)

        monkeypatch.setattr(store, "append", disk_full)
        assert http.post(f"/v1/runs/{RUN}/rollouts", json={"rollouts": [rollout("a", 0)]}).status_code == 503
        health = http.get("/healthz")
        assert health.status_code == 503
        assert list(health.json()["unavailable"]) == [RUN]
        assert "No space left on device" in health.json()["unavailable"][RUN]
        assert http.post("/v1/runs/fine/rollouts", json={"rollouts": [rollout("a", 0)]}).status_code == 200


def test_a_database_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    write_directory(tmp_path)
    (tmp_path / DATABASE_NAME).write_bytes(b"\x00garbage" * 512)  # overwritten by something else
    assert_refused(start(tmp_path), tmp_path, f"the database {tmp_path / DATABASE_NAME} cannot be read")


@pytest.mark.parametrize("layout", ["request last", "checksum last (databases from before)"])
def test_a_journal_row_written_a_piece_at_a_time_is_checked_and_loaded_as_written(tmp_path: Path, layout: str) -> None:
    """Large adds are journalled in pieces (into a blob when the request is the row's last column, bound
    whole otherwise): the row reads back as the same JSON and carries the checksum of its bytes."""
    if layout != "request last":  # the table as the previous release created it
        with sqlite3.connect(tmp_path / DATABASE_NAME) as db:
            db.execute(
                "CREATE TABLE journal (run TEXT NOT NULL, seq INTEGER NOT NULL, op TEXT NOT NULL, "
                "request BLOB NOT NULL, checksum TEXT, PRIMARY KEY (run, seq))"
            )
    request = {"rollouts": [{"id": "r", "dispatch_version": 0, "samples": [{"mask": [1] * 600_000}]}], "duplicates": 0}
    text = orjson.dumps(request)
    pieces = [text[at : at + 100_000] for at in range(0, len(text), 100_000)]
    store = SqliteStore(tmp_path)
    store.create_run(RUN, {})
    assert store.append(RUN, 1, "add", Chunked(lambda: iter(pieces))) == len(text)
    store.close()
    assert request_of(tmp_path, 1) == text
    (stored,) = SqliteStore(tmp_path).load()  # checksum checked before the row is decoded
    assert [(row.seq, row.op, row.request) for row in stored.tail] == [(1, "add", request)]
    edit_row(tmp_path, "UPDATE journal SET request = ? WHERE run = ? AND seq = 1", text.replace(b"1]", b"0]"), RUN)
    assert_refused(start(tmp_path), tmp_path, f"run {RUN!r}", "journal row 1", "fails its checksum")
