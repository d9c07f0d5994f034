"""SPEC 13 for the service: every acknowledged write survives ``kill -9``; re-sent requests count once.

The acceptance test runs the real ``serve`` command with a data directory and one run per policy (token,
episode, group, xtuner with retries; strict and lenient), four concurrent clients and a coordinator that
ships every run between phases. A snapshot is taken after every journal row
(``STALENESS_TEST_SNAPSHOT_EVERY``, read by tests/server/launch.py), so one lands after every kind of
write: adds, re-sent duplicates, ships whose sweep dropped rollouts, and a strict ship refused after its
sweep dropped the newest batch whole (saving used to renumber the batches but not that pending release).
It SIGKILLs the service mid-phase and once mid-ship, restarts it on the same directory, lets each client
re-send what got no answer, and compares every run's ``/steps``, counters, ship answers and ``/metrics``
with a service that was never killed. Each run's exported events, replayed by ``staleness-metrics
replay`` (no snapshots there), reproduce its ``/steps``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import httpx
import pytest
from fastapi.testclient import TestClient

from staleness_metrics.cli import main as cli_main
from staleness_metrics.config import StalenessConfig
from staleness_metrics.server import ExportSettings, RunRegistry, ServerSettings, create_app
from staleness_metrics.server import store as store_module
from staleness_metrics.server.models import ShipRequest, StepRow
from staleness_metrics.server.store import SNAPSHOT_EVERY, SqliteStore

from .conftest import TLS, ServeProcess, ThreadServer

pytestmark = pytest.mark.integration

RUN = "durable"
CONFIG = {"policy": "xtuner", "max_staleness": 1, "max_token_staleness": 0, "retry_expired": True, "strict": False}
RUNS: dict[str, dict[str, Any]] = {
    "token": {"policy": "token", "max_staleness": 1, "strict": True},
    "episode": {"policy": "episode", "max_staleness": 1, "strict": False},
    "group": {"policy": "group", "max_staleness": 1, "strict": True},
    "xtuner": CONFIG,
}
CLIENTS = 4
PHASES = 6
KILL_IN_PHASE = 2  # SIGKILL while the clients of this phase are sending
KILL_AT_SHIP = 4  # and once while this phase's ships are in flight
AHEAD_IN_PHASE = 3  # a rollout labelled above the phase's trained version: strict runs refuse that ship
SNAPSHOTS_EVERY = 1  # journal rows between snapshots in the services under test: one after every write


def batch(client: int, phase: int) -> list[dict[str, Any]]:
    """What one client sends in one phase, as one batch (versions up to the phase's trained version)."""
    rng = random.Random(client * 1000 + phase)
    records = []
    for j in range(8):
        dispatch = rng.randint(max(0, phase - 3), phase)
        n = rng.randint(1, 6)
        later = min(dispatch + 1, phase)
        sample: dict[str, Any] = {"mask": [1] * n}
        if n > 1:
            sample["weight_versions"] = [[dispatch, 0], [later, n // 2]]
        records.append({
            "id": f"c{client}-p{phase}-{j}", "group_id": f"g{phase}-{(client + j) % 5}",
            "env": rng.choice(["math", "code"]), "dispatch_version": dispatch, "samples": [sample],
        })  # fmt: skip
    if phase == AHEAD_IN_PHASE and client == 0:
        records.append({"id": f"ahead-{phase}", "dispatch_version": phase + 1, "samples": [{"mask": [1, 1]}]})
    return records


# Sent last before the ship of AHEAD_IN_PHASE, so it is the newest batch: the ship's sweep drops all of it,
# then strict runs refuse the ship, and a snapshot lands while the batch waits to be released.
STALE = [{"id": f"stale-{j}", "group_id": f"stale-{j}", "dispatch_version": 0, "samples": [{"mask": [1]}]}
         for j in range(3)]  # fmt: skip


@dataclass
class Service:
    """The ``serve`` command on a data directory; restartable on the same directory."""

    start: Callable[..., ServeProcess]
    data_dir: Path
    process: ServeProcess | None = None
    generation: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def up(self) -> None:
        env = {"STALENESS_TEST_SNAPSHOT_EVERY": str(SNAPSHOTS_EVERY)}
        self.process = self.start(["--data-dir", str(self.data_dir)], env)
        self.generation += 1

    def kill(self) -> None:
        assert self.process is not None
        self.process.process.send_signal(signal.SIGKILL)
        self.process.process.wait()

    @property
    def url(self) -> str:
        assert self.process is not None
        return self.process.url

    def died(self) -> bool:
        return self.process is not None and self.process.process.poll() is not None


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response | None:
    """The answer, or None when the service died before answering (the client does not know the outcome)."""
    try:
        return httpx.post(url + path, json=body, headers=headers, timeout=60, verify=TLS)
    except httpx.TransportError:
        return None


def ship(url: str, run: str, phase: int, again: bool = False) -> httpx.Response | None:
    key = f"ship-{phase}{'-again' if again else ''}"
    return post(url, f"/v1/runs/{run}/ship", {"step": phase + 1 + again}, {"Idempotency-Key": key})


def ship_all(service: Service, phase: int) -> None:
    for run in RUNS:
        ship(service.url, run, phase)


def drive(service: Service, kill: bool) -> dict[str, Any]:
    """Phases of concurrent adds to every run, each closed by a ship of every run with an idempotency key."""
    for run, config in RUNS.items():
        put = httpx.put(f"{service.url}/v1/runs/{run}", json=config, timeout=60, verify=TLS)
        assert put.status_code == 201, put.text
    ship_answers: dict[str, list[Any]] = {run: [] for run in RUNS}
    for phase in range(1, PHASES + 1):
        answered = threading.Semaphore(0)
        unanswered: list[tuple[str, Any]] = []
        url = service.url

        def client(index: int, url: str = url, phase: int = phase, answered: threading.Semaphore = answered,
                   unanswered: list[tuple[str, Any]] = unanswered) -> None:  # fmt: skip
            body = {"rollouts": batch(index, phase)}
            for run in RUNS:
                answer = post(url, f"/v1/runs/{run}/rollouts", body)
                if answer is None:
                    with service.lock:
                        unanswered.append((run, body))
                else:
                    assert answer.status_code == 200, answer.text
                    answered.release()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        if kill and phase == KILL_IN_PHASE:
            for _ in range(CLIENTS * len(RUNS) // 2):  # some batches of this phase are in, others are not
                answered.acquire()
            service.kill()
        for thread in threads:
            thread.join()
        if service.died():
            service.up()
            for run, body in unanswered:  # each client re-sends what it got no answer for
                answer = post(service.url, f"/v1/runs/{run}/rollouts", body)
                assert answer is not None and answer.status_code == 200
        if phase == AHEAD_IN_PHASE:
            for run in RUNS:
                answer = post(service.url, f"/v1/runs/{run}/rollouts", {"rollouts": STALE})
                assert answer is not None and answer.status_code == 200
        if kill and phase == KILL_AT_SHIP:
            sender = threading.Thread(target=ship_all, args=(service, phase))
            sender.start()
            service.kill()  # some ships may have been applied, others not: the coordinator cannot tell
            sender.join()
            service.up()
        # (again after a kill: an applied ship answers from its idempotency key). After the refused ship, a
        # second one right away, before any add: it releases what the refused one's sweep dropped.
        for again in (False, True) if phase == AHEAD_IN_PHASE else (False,):
            for run in RUNS:
                answer = ship(service.url, run, phase, again)
                assert answer is not None
                body = answer.json()
                ship_answers[run].append((answer.status_code, {k: v for k, v in body.items() if k != "replayed"}))
    base = service.url
    metrics = httpx.get(f"{base}/metrics", timeout=60, verify=TLS).text
    return {
        "steps": {run: httpx.get(f"{base}/v1/runs/{run}/steps", timeout=60, verify=TLS).json() for run in RUNS},
        "info": {run: httpx.get(f"{base}/v1/runs/{run}", timeout=60, verify=TLS).json() for run in RUNS},
        "metrics": sorted(line for line in metrics.splitlines() if line.startswith("rl_staleness")),
        "ships": ship_answers,
        "events": {run: httpx.get(f"{base}/v1/runs/{run}/events", timeout=60, verify=TLS).text for run in RUNS},
    }


def comparable_ship(answer: tuple[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """Ship answers with their id lists as sets (concurrent clients add in any order)."""
    status, out = answer[0], dict(answer[1])
    for name in ("shipped", "dropped_rollouts", "held"):
        if name in out:
            out[name] = sorted(out[name])
    if "dropped_samples" in out:
        out["dropped_samples"] = sorted(map(tuple, out["dropped_samples"]))
    return status, out


def test_sigkill_under_concurrent_load_changes_no_answer_counter_or_metric_under_any_policy(
    serve_process: Callable[..., ServeProcess], tmp_path: Path
) -> None:
    killed = Service(serve_process, tmp_path / "killed")
    killed.up()
    survived = Service(serve_process, tmp_path / "never-killed")
    survived.up()
    got = drive(killed, kill=True)
    expected = drive(survived, kill=False)
    assert killed.generation == 3 and survived.generation == 1

    for run, config in RUNS.items():
        assert got["steps"][run] == expected["steps"][run], run
        assert len(got["steps"][run]["steps"]) == PHASES + 1 - config["strict"], run  # a strict run refused one
        resent = got["info"][run].pop("duplicates_ignored")  # re-sent records applied before the kill
        assert expected["info"][run].pop("duplicates_ignored") == 0
        assert got["info"][run] == expected["info"][run], run
        assert got["info"][run]["rollouts_received"] == CLIENTS * PHASES * 8 + 1 + len(STALE), run  # nothing lost
        assert resent % 8 == 0, run  # whole batches, counted once
        assert [comparable_ship(a) for a in got["ships"][run]] == [comparable_ship(a) for a in expected["ships"][run]]
        refused = [status for status, _ in got["ships"][run] if status != 200]
        assert len(refused) == (1 if config["strict"] else 0), run

        # The persisted history replays to the same metrics (SPEC 9 events).
        events = tmp_path / f"{run}.jsonl"
        events.write_text(got["events"][run])
        metrics_out = tmp_path / f"{run}-metrics.jsonl"
        options = ["--policy", config["policy"], "--max-staleness", str(config["max_staleness"])]
        if run == "xtuner":
            options += ["--max-token-staleness", "0", "--retry-expired"]
        options.append("--strict" if config["strict"] else "--lenient")
        # (in this process: the command's own process is tested by tests/replay; here it reads the events)
        assert cli_main(["replay", str(events), *options, "--metrics-out", str(metrics_out)]) == 0
        replayed = [json.loads(line) for line in metrics_out.read_text().splitlines()]
        assert replayed == [{"step": row["step"], **row["metrics"]} for row in got["steps"][run]["steps"]], run
    assert got["metrics"] == expected["metrics"]  # the Prometheus counters continued, not restarted


def fill(registry: RunRegistry, writes: int) -> None:
    run = registry.get(RUN)
    for i in range(writes):
        if i % 4 == 3:
            run.ship(ShipRequest(step=i // 4 + 2), idempotency_key=f"k{i}")
        else:
            run.add(
                [{"id": f"r{i}", "group_id": f"g{i % 5}", "dispatch_version": i // 4, "samples": [{"mask": [1, 1]}]}]
            )


def snapshot_of(registry: RunRegistry) -> dict[str, Any]:
    run = registry.get(RUN)
    return {
        "info": run.info().model_dump(),
        "steps": [row.model_dump() for row in run.steps()],
        "queued": [i for batch in run.monitor.sink.state_dict()["queue"]["batches"] for i in batch["ids"]["list"]],
    }


def test_restart_replays_only_the_journal_after_the_last_snapshot(tmp_path: Path) -> None:
    config = StalenessConfig.from_mapping(CONFIG)
    registry = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    registry.create(RUN, config)
    fill(registry, 3 * SNAPSHOT_EVERY + 17)
    before = snapshot_of(registry)
    registry.store.close()  # no clean shutdown (no final snapshot): as after kill -9

    stored = {run.name: run for run in SqliteStore(tmp_path).load()}[RUN]
    assert stored.snapshot is not None and len(stored.tail) < SNAPSHOT_EVERY  # bounded restart work
    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore() == 1
    assert snapshot_of(restored) == before
    replay = restored.get(RUN).ship(ShipRequest(step=2), idempotency_key="k3")  # a key from before the snapshot
    assert replay.replayed and replay.ship == 1  # the stored answer, not a new ship
    assert restored.get(RUN).info().ships == before["info"]["ships"]
    restored.close()


def test_a_restart_validates_history_rows_when_read_and_a_poll_for_the_newest_reads_a_few(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restart time grew with the ships made (every history row validated at load, 0.77 of 1.14 s at
    16,000 ships) and a poll for the newest step scanned the whole history under the run's lock: rows
    are validated when ``/steps`` first reads them, and a poll finds its first row by bisection."""
    registry = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    registry.create(RUN, StalenessConfig.from_mapping(CONFIG))
    fill(registry, 2 * SNAPSHOT_EVERY)  # 128 ships, all before the final snapshot
    before = snapshot_of(registry)
    registry.close()
    validated: list[Any] = []
    validate = StepRow.model_validate

    def counted(row: Any, *args: Any, **kwargs: Any) -> StepRow:
        validated.append(row)
        return validate(row, *args, **kwargs)

    monkeypatch.setattr(StepRow, "model_validate", counted)
    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore(background=False) == 1 and validated == []
    latest = before["steps"][-1]["step"]
    assert [row.model_dump() for row in restored.get(RUN).steps(since=latest - 1)] == before["steps"][-1:]
    assert 0 < len(validated) <= 9  # log2(128) + the row returned
    assert snapshot_of(restored) == before
    restored.close()


def test_deleted_runs_stay_deleted_and_names_can_be_reused(tmp_path: Path) -> None:
    registry = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    registry.create(RUN, StalenessConfig())
    fill(registry, 9)
    registry.delete(RUN)
    registry.create(RUN, StalenessConfig(max_staleness=2))
    registry.close()
    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore() == 1
    info = restored.get(RUN).info()
    assert info.config["max_staleness"] == 2 and info.ships == 0 and info.rollouts_received == 0
    restored.close()


def test_a_delete_waits_for_the_write_in_flight_so_no_journal_row_outlives_its_run(tmp_path: Path) -> None:
    """An add already past its run's checks journals its row before DELETE removes the run's rows: a
    row written after them made the re-created run's writes collide (503) or its restart refuse."""
    writing, release = threading.Event(), threading.Event()

    class SlowStore(SqliteStore):
        def append(self, run: str, seq: int, op: str, request: Any, history_row: Any | None = None) -> int:
            if op == "add" and not release.is_set():
                writing.set()
                release.wait(10)
            return super().append(run, seq, op, request, history_row)

    store = SlowStore(tmp_path)
    registry = RunRegistry(ExportSettings(), store)
    registry.create(RUN, StalenessConfig())
    adding = threading.Thread(target=fill, args=(registry, 1))
    adding.start()
    assert writing.wait(10)
    deleting = threading.Thread(target=registry.delete, args=(RUN,))
    deleting.start()
    deleting.join(0.3)
    assert deleting.is_alive()  # it waits for the add
    release.set()
    adding.join(10)
    deleting.join(10)
    assert list(store.journal(RUN)) == []
    registry.create(RUN, StalenessConfig())
    fill(registry, 3)  # the re-created run journals rows 1..3 again
    registry.close()
    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore() == 1 and restored.get(RUN).info().rollouts_received == 3
    restored.close()


def test_one_app_started_again_serves_its_stored_runs_and_writes_as_a_restart_does(tmp_path: Path) -> None:
    """One app object run twice (two TestClient blocks, a server running the lifespan again): the
    second start found no runs (404 for a stored one) and a closed database (503 on every write).
    Each start now opens the directory as a restart does, its lock included."""
    app = create_app(ServerSettings(data_dir=tmp_path))
    with TestClient(app, base_url="http://127.0.0.1") as http:
        assert http.put(f"/v1/runs/{RUN}", json=CONFIG).status_code == 201
        assert http.post(f"/v1/runs/{RUN}/rollouts", json={"rollouts": [ROLLOUT]}).status_code == 200
        first = http.get(f"/v1/runs/{RUN}").json()
    other = create_app(ServerSettings(data_dir=tmp_path))  # takes the directory while the app is stopped
    with pytest.raises(RuntimeError, match="another service is using"), TestClient(app):
        pass
    other.state.runs.close()
    with TestClient(app, base_url="http://127.0.0.1") as http:
        assert http.get("/healthz").json()["runs"] == 1
        assert http.get(f"/v1/runs/{RUN}").json() == first
        assert http.post(f"/v1/runs/{RUN}/rollouts", json={"rollouts": [ROLLOUT]}).json()["duplicates"] == 1
        assert http.put("/v1/runs/other", json={}).status_code == 201
        assert http.post(f"/v1/runs/{RUN}/ship", json={"step": 1}).status_code == 200
        with pytest.raises(RuntimeError, match="another service is using"):
            create_app(ServerSettings(data_dir=tmp_path))
    restarted = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restarted.restore(background=False) == 2 and restarted.get(RUN).info().ships == 1
    restarted.close()


def test_in_memory_service_has_no_events_to_export(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url) as http:
        http.put(f"/v1/runs/{RUN}", json={})
        response = http.get(f"/v1/runs/{RUN}/events")
        assert response.status_code == 409 and "--in-memory" in response.json()["detail"]
        assert http.get("/v1/runs/nope/events").status_code == 404


def test_a_large_batch_journalled_a_piece_at_a_time_restores_and_is_recognised_when_re_sent(
    tmp_path: Path, start_server: Callable[..., ThreadServer]
) -> None:
    """A batch with a 2M-position rollout and 300 small ones is hashed and journalled in pieces: after a
    restart the run holds the same queue, and the same body sent again is all duplicates (its digests,
    recomputed from the journal's lists, match those of the arrays the body was read into)."""
    big = {"id": "big", "dispatch_version": 0, "samples": [{"mask": [1] * 2_000_000, "logprobs": [-0.5] * 2_000_000}]}
    small = [{"id": f"s{n}", "dispatch_version": 0, "samples": [{"mask": [0, 1, 1]}]} for n in range(300)]
    body = json.dumps({"rollouts": [big, *small]}).encode()
    settings = ServerSettings(data_dir=tmp_path, max_body_bytes=2 * len(body))
    headers = {"content-type": "application/json"}
    first = start_server(settings)
    with httpx.Client(base_url=first.url, timeout=120) as http:
        http.put(f"/v1/runs/{RUN}", json={}).raise_for_status()
        assert http.post(f"/v1/runs/{RUN}/rollouts", content=body, headers=headers).json()["accepted"] == 301
        info = http.get(f"/v1/runs/{RUN}").json()
    first.stop()
    again = start_server(settings)
    with httpx.Client(base_url=again.url, timeout=120) as http:
        assert http.get(f"/v1/runs/{RUN}").json() == info
        answer = http.post(f"/v1/runs/{RUN}/rollouts", content=body, headers=headers).json()
        assert (answer["accepted"], answer["duplicates"]) == (0, 301)
        events = [json.loads(line) for line in http.get(f"/v1/runs/{RUN}/events").text.splitlines()]
    assert [event["rollout"]["id"] for event in events] == ["big", *(record["id"] for record in small)]
    assert events[0]["rollout"] == big and events[1:] == [{"type": "rollout", "rollout": r} for r in small]


class FullDisk:
    """ENOSPC at one point of the store's writes while ``full``: the new manifest's text (``manifest``),
    the SQLite commit (``commit``) or, after the commit, the manifest's rename (``rename``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: SqliteStore, where: str) -> None:
        self.full = False
        manifest, replace, write = store.manifest_path, os.replace, store._write

        def new_manifest(path: Any, *args: Any, **kwargs: Any) -> Any:
            if self.full and str(path).endswith(".partial"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return open(path, *args, **kwargs)

        def commit(statements: Any) -> None:
            if self.full:
                raise sqlite3.OperationalError("database or disk is full")
            write(statements)

        def rename(source: Any, target: Any) -> None:
            if self.full and Path(target) == manifest:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
            replace(source, target)

        if where == "manifest":
            monkeypatch.setattr(store_module, "open", new_manifest, raising=False)
        elif where == "commit":
            monkeypatch.setattr(store, "_write", commit)
        else:
            monkeypatch.setattr(os, "replace", rename)


def disk_reason(detail: str) -> bool:
    return "No space left on device" in detail or "database or disk is full" in detail


@pytest.mark.parametrize("where", ["manifest", "commit", "rename"])
def test_a_run_not_created_for_a_full_disk_answers_503_and_a_retry_creates_it(
    tmp_path: Path, start_server: Callable[..., ThreadServer], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """PUT on a full disk answered 500 (a traceback); when the disk filled between the run's commit and its
    manifest, the run was stored but not served, every retried PUT answered 500 (UNIQUE runs.name), and a
    restart brought back the run the client was told had failed. Now: 503 naming the reason, nothing
    served, and the PUT retried once there is room creates it (the manifest's new text is written before
    the commit: a full disk fails it there, with nothing stored)."""
    server = start_server(ServerSettings(data_dir=tmp_path))
    disk = FullDisk(monkeypatch, server.app.state.runs.store, where)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.put("/v1/runs/kept", json={}).status_code == 201
        disk.full = True
        for _ in range(2):
            answer = http.put(f"/v1/runs/{RUN}", json={"max_staleness": 2})
            assert answer.status_code == 503, answer.text
            assert f"run {RUN!r} was not created" in answer.json()["detail"] and disk_reason(answer.json()["detail"])
        assert http.get(f"/v1/runs/{RUN}").status_code == 404
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json()["runs"] == 1
        disk.full = False
    server.stop()
    stored = sorted(run.name for run in SqliteStore(tmp_path).load())
    assert stored == (["durable", "kept"] if where == "rename" else ["kept"])  # committed, then not renamed
    again = start_server(ServerSettings(data_dir=tmp_path))
    with httpx.Client(base_url=again.url, timeout=60) as http:
        created = http.put(f"/v1/runs/{RUN}", json={"max_staleness": 2})
        assert created.status_code in ((200,) if where == "rename" else (201,)), created.text
        assert http.post(f"/v1/runs/{RUN}/rollouts", json={"rollouts": [ROLLOUT]}).status_code == 200


ROLLOUT = {"id": "r0", "dispatch_version": 0, "samples": [{"mask": [1, 1]}]}


@pytest.mark.parametrize("where", ["manifest", "commit"])
def test_a_run_not_deleted_for_a_full_disk_answers_503_and_serves_on(
    tmp_path: Path, start_server: Callable[..., ThreadServer], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """DELETE on a full disk answered 500 and left a zombie: the run refused every request ("was deleted")
    while its rows stayed and /healthz counted it. Now: 503 naming the reason, and the run, not deleted,
    serves on (after a restart too); the DELETE retried once there is room deletes it."""
    server = start_server(ServerSettings(data_dir=tmp_path))
    disk = FullDisk(monkeypatch, server.app.state.runs.store, where)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.put(f"/v1/runs/{RUN}", json={}).status_code == 201
        assert http.post(f"/v1/runs/{RUN}/rollouts", json={"rollouts": [ROLLOUT]}).status_code == 200
        disk.full = True
        answer = http.delete(f"/v1/runs/{RUN}")
        assert answer.status_code == 503, answer.text
        assert f"run {RUN!r} was not deleted" in answer.json()["detail"] and disk_reason(answer.json()["detail"])
        disk.full = False
        assert http.get(f"/v1/runs/{RUN}").json()["queued"] == 1
        assert http.post(f"/v1/runs/{RUN}/ship", json={"step": 1}).json()["shipped"] == ["r0"]
        assert http.get("/healthz").json() == {"status": "ok", "version": ANY, "runs": 1, "unavailable": {}}
    server.stop()
    again = start_server(ServerSettings(data_dir=tmp_path))
    with httpx.Client(base_url=again.url, timeout=60) as http:
        assert http.get(f"/v1/runs/{RUN}").json()["ships"] == 1
        assert http.delete(f"/v1/runs/{RUN}").status_code == 204
        assert http.get(f"/v1/runs/{RUN}").status_code == 404


def test_a_snapshot_the_full_disk_refuses_at_shutdown_is_one_log_line_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM on a full disk logged a traceback for the final snapshot (the journal holds every write):
    now one line naming the run and the reason."""
    store = SqliteStore(tmp_path)
    registry = RunRegistry(ExportSettings(), store)
    registry.create(RUN, StalenessConfig.from_mapping(CONFIG))
    fill(registry, 9)
    before = snapshot_of(registry)

    def disk_full(*args: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "save_snapshot", disk_full)
    with caplog.at_level(logging.ERROR, logger="staleness_metrics.server"):
        registry.close()
    (record,) = [record for record in caplog.records if "snapshot" in record.getMessage()]
    assert record.getMessage().startswith(f"run {RUN}: snapshot failed (OperationalError: database or disk is full)")
    assert not record.exc_info and "Traceback" not in caplog.text
    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore(background=False) == 1 and snapshot_of(restored) == before
    restored.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 400 KiB tmpfs (root only), unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_really_full_disk_refuses_creating_and_deleting_runs_with_503_and_shuts_down_cleanly(
    small_disk: Path, serve_process: Callable[..., ServeProcess]
) -> None:
    data_dir = small_disk / "data"
    served = serve_process(["--data-dir", str(data_dir)])
    with httpx.Client(base_url=served.url, timeout=60) as http:
        assert http.put("/v1/runs/kept", json={}).status_code == 201
        assert http.post("/v1/runs/kept/rollouts", json={"rollouts": [ROLLOUT]}).status_code == 200
        with open(small_disk / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"x" * 1024)
        created = http.put(f"/v1/runs/{RUN}", json={})
        assert created.status_code == 503 and disk_reason(created.json()["detail"]), created.text
        deleted = http.delete("/v1/runs/kept")
        assert deleted.status_code == 503 and disk_reason(deleted.json()["detail"]), deleted.text
        assert http.get("/v1/runs/kept").json()["rollouts_received"] == 1
        assert http.get(f"/v1/runs/{RUN}").status_code == 404
    _, log = served.stop()
    assert "Traceback" not in log, log
    (small_disk / "filler").unlink()
    again = serve_process(["--data-dir", str(data_dir)])
    with httpx.Client(base_url=again.url, timeout=60) as http:
        assert http.get("/v1/runs/kept").json()["rollouts_received"] == 1
        assert http.get(f"/v1/runs/{RUN}").status_code == 404
        assert http.put(f"/v1/runs/{RUN}", json={}).status_code == 201
        assert http.delete("/v1/runs/kept").status_code == 204
