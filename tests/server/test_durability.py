"""SPEC 13 for the service: every acknowledged write survives ``kill -9``; re-sent requests count once.

The acceptance test runs the real ``serve`` command with a data directory, four concurrent clients and a
coordinator that ships between phases; it SIGKILLs the service mid-phase (and once mid-ship), restarts it
on the same directory, lets each client re-send what got no answer, and compares ``/steps``, the run's
counters and ``/metrics`` with a service that was never killed. The run's exported events, replayed by
``staleness-metrics replay``, reproduce ``/steps``.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from staleness_metrics.config import StalenessConfig
from staleness_metrics.server import ExportSettings, RunRegistry
from staleness_metrics.server.models import ShipRequest
from staleness_metrics.server.store import SNAPSHOT_EVERY, SqliteStore

from .conftest import ROOT, ServeProcess, ThreadServer

pytestmark = pytest.mark.integration

RUN = "durable"
CONFIG = {"policy": "xtuner", "max_staleness": 1, "max_token_staleness": 0, "retry_expired": True, "strict": False}
CLIENTS = 4
PHASES = 8
KILL_IN_PHASE = 3  # SIGKILL while the clients of this phase are sending
KILL_AT_SHIP = 6  # and once while this phase's ship is in flight


def batches(client: int, phase: int) -> list[list[dict[str, Any]]]:
    """The batches one client sends in one phase (versions never above the phase's trained version)."""
    rng = random.Random(client * 1000 + phase)
    out = []
    for b in range(3):
        records = []
        for j in range(4):
            dispatch = rng.randint(max(0, phase - 3), phase)
            n = rng.randint(1, 6)
            later = min(dispatch + 1, phase)
            record: dict[str, Any] = {
                "id": f"c{client}-p{phase}-b{b}-{j}",
                "group_id": f"g{phase}-{(client + j) % 3}",
                "env": rng.choice(["math", "code"]),
                "dispatch_version": dispatch,
                "samples": [{"mask": [1] * n, "weight_versions": [[dispatch, 0], [later, n // 2]] if n > 1 else None}],
            }
            if record["samples"][0]["weight_versions"] is None:
                del record["samples"][0]["weight_versions"]
            records.append(record)
        out.append(records)
    return out


@dataclass
class Service:
    """The ``serve`` command on a data directory; restartable on the same directory."""

    start: Callable[..., ServeProcess]
    data_dir: Path
    process: ServeProcess | None = None
    generation: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def up(self) -> None:
        self.process = self.start(["--data-dir", str(self.data_dir)])
        self.generation += 1

    def kill(self) -> None:
        assert self.process is not None
        self.process.process.send_signal(signal.SIGKILL)
        self.process.process.wait()

    @property
    def url(self) -> str:
        assert self.process is not None
        return self.process.url


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response | None:
    """The answer, or None when the service died before answering (the client does not know the outcome)."""
    try:
        response = httpx.post(url + path, json=body, headers=headers, timeout=60)
    except httpx.TransportError:
        return None
    assert response.status_code == 200, response.text
    return response


def drive(service: Service, kill: bool) -> dict[str, Any]:
    """Phases of concurrent adds, each closed by a ship with an idempotency key."""
    put = httpx.put(f"{service.url}/v1/runs/{RUN}", json=CONFIG, timeout=60)
    assert put.status_code == 201, put.text
    ship_answers = []
    for phase in range(1, PHASES + 1):
        answered = threading.Semaphore(0)
        unanswered: list[tuple[str, Any]] = []
        url = service.url

        def client(
            index: int,
            url: str = url,
            phase: int = phase,
            answered: threading.Semaphore = answered,
            unanswered: list[tuple[str, Any]] = unanswered,
        ) -> None:
            for records in batches(index, phase):
                body = {"rollouts": records}
                if post(url, f"/v1/runs/{RUN}/rollouts", body) is None:
                    with service.lock:
                        unanswered.append(("/rollouts", body))
                else:
                    answered.release()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        if kill and phase == KILL_IN_PHASE:
            for _ in range(5):  # some batches of this phase are in, others are not
                answered.acquire()
            service.kill()
        for thread in threads:
            thread.join()
        if service.process is not None and service.process.process.poll() is not None:
            service.up()
            for path, body in unanswered:  # each client re-sends what it got no answer for
                assert post(service.url, f"/v1/runs/{RUN}{path}", body) is not None
        ship = {"step": phase + 1}
        key = {"Idempotency-Key": f"ship-{phase}"}
        if kill and phase == KILL_AT_SHIP:
            sender = threading.Thread(target=post, args=(service.url, f"/v1/runs/{RUN}/ship", ship, key))
            sender.start()
            service.kill()  # the ship may or may not have been applied: the client cannot tell
            sender.join()
            service.up()
        answer = post(service.url, f"/v1/runs/{RUN}/ship", ship, key)
        assert answer is not None
        ship_answers.append({k: v for k, v in answer.json().items() if k != "replayed"})
    base = service.url
    metrics = httpx.get(f"{base}/metrics", timeout=60).text
    return {
        "steps": httpx.get(f"{base}/v1/runs/{RUN}/steps", timeout=60).json(),
        "info": httpx.get(f"{base}/v1/runs/{RUN}", timeout=60).json(),
        "metrics": sorted(line for line in metrics.splitlines() if line.startswith("rl_staleness")),
        "ships": ship_answers,
        "events": httpx.get(f"{base}/v1/runs/{RUN}/events", timeout=60).text,
    }


def comparable_ship(answer: dict[str, Any]) -> dict[str, Any]:
    """Ship answers with their id lists as sets (concurrent clients add in any order)."""
    out = dict(answer)
    for name in ("shipped", "dropped_rollouts", "held"):
        out[name] = sorted(out[name])
    out["dropped_samples"] = sorted(map(tuple, out["dropped_samples"]))
    return out


def test_sigkill_mid_stream_loses_nothing_and_counts_nothing_twice(
    serve_process: Callable[..., ServeProcess], tmp_path: Path
) -> None:
    killed = Service(serve_process, tmp_path / "killed")
    killed.up()
    survived = Service(serve_process, tmp_path / "never-killed")
    survived.up()
    got = drive(killed, kill=True)
    expected = drive(survived, kill=False)
    assert killed.generation == 3 and survived.generation == 1

    assert got["steps"] == expected["steps"]
    assert len(got["steps"]["steps"]) == PHASES
    resent = got["info"].pop("duplicates_ignored")  # re-sent records that had been applied before the kill
    assert expected["info"].pop("duplicates_ignored") == 0 and resent % 4 == 0  # whole batches, counted once
    assert got["info"] == expected["info"]
    assert got["info"]["rollouts_received"] == CLIENTS * PHASES * 3 * 4  # nothing lost
    assert got["metrics"] == expected["metrics"]  # the Prometheus counters continued, not restarted
    assert [comparable_ship(a) for a in got["ships"]] == [comparable_ship(a) for a in expected["ships"]]

    # The persisted history replays to the same metrics (SPEC 9 events).
    events = tmp_path / "events.jsonl"
    events.write_text(got["events"])
    metrics_out = tmp_path / "metrics.jsonl"
    options = ["--policy", "xtuner", "--max-staleness", "1", "--max-token-staleness", "0", "--retry-expired"]
    subprocess.run(
        [sys.executable, "-m", "staleness_metrics.cli", "replay", str(events), *options, "--lenient",
         "--metrics-out", str(metrics_out)],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    replayed = [json.loads(line) for line in metrics_out.read_text().splitlines()]
    assert replayed == [{"step": row["step"], **row["metrics"]} for row in got["steps"]["steps"]]


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
        "queued": run.monitor.sink.state_dict()["ids"],
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


def test_in_memory_service_has_no_events_to_export(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url) as http:
        http.put(f"/v1/runs/{RUN}", json={})
        response = http.get(f"/v1/runs/{RUN}/events")
        assert response.status_code == 409 and "--in-memory" in response.json()["detail"]
        assert http.get("/v1/runs/nope/events").status_code == 404
