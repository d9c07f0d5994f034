"""Small adds and ships on the event loop (Run.quick): only when the run is free at once and its queue
small, so that a run busy with a long call never stalls the other connections."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from fastapi.testclient import TestClient

from staleness_metrics.config import StalenessConfig
from staleness_metrics.server import RunRegistry, ServerSettings, create_app
from staleness_metrics.server.models import ShipRequest
from staleness_metrics.server.runs import QUICK_MAX_POSITIONS, QUICK_MAX_ROLLOUTS, Run

from .conftest import ThreadServer

pytestmark = pytest.mark.integration

HANG_GUARD = 60.0  # seconds: only fails a request that never comes back, never asserted as a speed


def rollout(rid: str, positions: int = 16, version: int = 0) -> dict[str, Any]:
    return {"id": rid, "dispatch_version": version, "samples": [{"mask": [0] * 4 + [1] * (positions - 4)}]}


def test_a_busy_run_stalls_its_own_requests_only(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url, timeout=HANG_GUARD) as http:
        for run in ("busy", "other"):
            assert http.put(f"/v1/runs/{run}", json={"max_staleness": 4}).status_code == 201
            assert http.post(f"/v1/runs/{run}/rollouts", json={"rollouts": [rollout("r1")]}).status_code == 200
        busy = server.app.state.runs.get("busy")
        with ThreadPoolExecutor(1) as pool:
            with busy.quick() as free:  # the run's lock, held here as a long call would hold it
                assert free
                waiting = pool.submit(http.post, "/v1/runs/busy/ship", json={"step": 1})
                # The event loop still answers everyone else, adds and ships included.
                assert http.get("/healthz").status_code == 200
                added = http.post("/v1/runs/other/rollouts", json={"rollouts": [rollout("r2")]})
                assert added.status_code == 200 and added.json()["queued"] == 2
                other = http.post("/v1/runs/other/ship", json={"step": 1})
                assert other.status_code == 200 and sorted(other.json()["shipped"]) == ["r1", "r2"]
                assert not waiting.done()  # the busy run's ship waits for its lock, on a worker
            shipped = waiting.result(timeout=HANG_GUARD)
        assert shipped.status_code == 200
        assert shipped.json()["shipped"] == ["r1"] and shipped.json()["ship"] == 1
        assert http.get("/v1/runs/busy").json()["ships"] == 1


def test_quick_only_when_the_lock_is_free_and_the_queue_small() -> None:
    registry = RunRegistry()
    run, _ = registry.create("q", StalenessConfig(max_staleness=4))
    with run.quick() as free:
        assert free  # an empty run
        seen: list[bool] = []

        def other_thread() -> None:
            with run.quick() as other_free:
                seen.append(other_free)

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert seen == [False]  # held by this thread: another never waits for it
    # Positions: a queue past the bound goes to a worker until a ship empties it.
    run.add([rollout("big", positions=QUICK_MAX_POSITIONS + 1)])
    with run.quick() as free:
        assert not free
    run.ship(ShipRequest(step=1))
    with run.quick() as free:
        assert free
    # Rollouts: the same for a queue of many small ones.
    run.add([rollout(f"r{i}") for i in range(QUICK_MAX_ROLLOUTS + 1)])
    with run.quick() as free:
        assert not free
    run.ship(ShipRequest(step=2))
    with run.quick() as free:
        assert free
    # A rollout held over a ship keeps the bound: the positions added since the queue was last empty.
    run.add([rollout("stale", positions=QUICK_MAX_POSITIONS, version=0)])
    run.add([rollout("one-more", version=1)])
    run.ship(ShipRequest(step=2, ids=["one-more"]))
    assert run.info().queued == 1
    with run.quick() as free:
        assert not free
    registry.close()


@contextmanager
def held_lock(run: Run) -> Iterator[threading.Event]:
    """``run``'s lock held by another thread, as a long add or ship holds it, until the event is set."""
    held, release = threading.Event(), threading.Event()

    def long_call() -> None:
        with run.quick():
            held.set()
            release.wait(HANG_GUARD)

    holder = threading.Thread(target=long_call)
    holder.start()
    try:
        assert held.wait(HANG_GUARD)
        yield release
    finally:
        release.set()
        holder.join(HANG_GUARD)


async def settled(limiter: anyio.CapacityLimiter, tasks: list[asyncio.Task[Any]]) -> None:
    """Once every request waits: one on a worker for the run's lock, the others on the event loop."""
    for _ in range(500):  # (each runs to where it waits: requests through ASGITransport do no I/O)
        await asyncio.sleep(0)
    deadline = time.monotonic() + HANG_GUARD
    while limiter.borrowed_tokens != 1 and time.monotonic() < deadline:  # (a list's hop to a worker)
        assert not any(task.done() for task in tasks)
        await asyncio.sleep(0.001)
    for _ in range(500):
        await asyncio.sleep(0)
    assert limiter.borrowed_tokens == 1 and not any(task.done() for task in tasks)


@pytest.mark.parametrize("persistent", [False, True])
def test_requests_waiting_for_a_busy_run_hold_one_worker(persistent: bool, tmp_path: Path) -> None:
    """More requests to a busy run than the worker pool has threads (40): they wait for the run on
    the event loop, one at a time on a worker, so every other run's requests still find one."""
    settings = ServerSettings(data_dir=tmp_path if persistent else None)
    app = create_app(settings)
    registry: RunRegistry = app.state.runs
    for name in ("busy", "other"):
        registry.create(name, StalenessConfig(max_staleness=4))[0].add([rollout(f"{name}-r1")])
    busy = registry.get("busy")

    async def scenario(release: threading.Event) -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=HANG_GUARD) as http:
            waiting = [asyncio.create_task(http.get("/v1/runs/busy")) for _ in range(48)]
            waiting += [asyncio.create_task(http.post("/v1/runs/busy/sweep", json={"step": 1})) for _ in range(4)]
            waiting.append(asyncio.create_task(http.get("/v1/runs/busy/steps")))
            waiting += [asyncio.create_task(http.get("/v1/runs")) for _ in range(4)]  # every run's info
            await settled(limiter, waiting)
            deleting = asyncio.create_task(http.delete("/v1/runs/busy"))  # after the requests before it
            await settled(limiter, [*waiting, deleting])
            other = [http.get("/v1/runs/other"), http.post("/v1/runs/other/sweep", json={"step": 1})]
            other.append(http.post("/v1/runs/other/rollouts", json={"rollouts": [rollout("big", 20_000)]}))
            other.append(http.put("/v1/runs/new", json={}))  # (the delete waits holding no registry lock)
            answers = await asyncio.wait_for(asyncio.gather(*other), HANG_GUARD)
            assert [a.status_code for a in answers] == [200, 200, 200, 201] and answers[2].json()["queued"] == 2
            assert not any(task.done() for task in [*waiting, deleting])
            release.set()
            done = await asyncio.wait_for(asyncio.gather(*waiting), HANG_GUARD)
            assert (await deleting).status_code == 204
            assert (await http.get("/v1/runs/busy")).status_code == 404
        assert {a.status_code for a in done} == {200} and done[0].json()["queued"] == 1
        assert [run["run"] for run in done[-1].json()["runs"]] == ["busy", "other"]

    with held_lock(busy) as release:
        asyncio.run(scenario(release))
    registry.close()


def test_one_app_driven_by_several_event_loops_serves_a_busy_run() -> None:
    """A TestClient used without ``with`` from two threads runs each request on its own event loop:
    the requests waiting for one busy run wait on their own loop's gate, and all are answered."""
    app = create_app(ServerSettings())
    registry: RunRegistry = app.state.runs
    busy = registry.create("busy", StalenessConfig(max_staleness=4))[0]
    busy.add([rollout("r1")])
    client = TestClient(app, base_url="http://127.0.0.1")
    with ThreadPoolExecutor(3) as pool:
        with busy.quick():  # the run's lock, held as a long call holds it
            waiting = [pool.submit(client.get, path) for path in ("/v1/runs/busy", "/v1/runs/busy/steps")]
            waiting.append(pool.submit(client.post, "/v1/runs/busy/sweep", json={"step": 1}))
            time.sleep(0.2)  # (only a chance for the three to meet at the gate: none may answer yet)
            assert not any(future.done() for future in waiting)
        answers = [future.result(timeout=HANG_GUARD) for future in waiting]
        assert [answer.status_code for answer in answers] == [200, 200, 200]
        assert pool.submit(client.get, "/v1/runs/busy").result(timeout=HANG_GUARD).status_code == 200
    registry.close()


def test_a_request_cancelled_while_waiting_for_its_run_answers_503_not_500() -> None:
    """Past its shutdown grace, uvicorn cancels the requests left: the waiting ones, and one whose call
    ends on its worker, answer a JSON 503 (a client sends them again), never a bare 500."""
    app = create_app(ServerSettings())
    registry: RunRegistry = app.state.runs
    busy = registry.create("busy", StalenessConfig(max_staleness=4))[0]

    async def scenario(release: threading.Event) -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=HANG_GUARD) as http:
            body = {"rollouts": [rollout(f"r{i}") for i in range(400)]}  # (over 64 KiB: added on a worker)
            adding = asyncio.create_task(http.post("/v1/runs/busy/rollouts", json=body))
            await settled(limiter, [adding])  # on the worker, for the run's lock
            waiting = asyncio.create_task(http.get("/v1/runs/busy"))
            await settled(limiter, [adding, waiting])  # at the gate
            adding.cancel()
            waiting.cancel()
            release.set()  # the add on its worker ends, then its cancellation lands
            answers = await asyncio.wait_for(asyncio.gather(adding, waiting), HANG_GUARD)
        for answer in answers:
            assert answer.status_code == 503 and "send the request again" in answer.json()["detail"]
        deadline = time.monotonic() + HANG_GUARD  # (its worker, left to finish, may still be adding)
        while busy.info().queued != 400 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert busy.info().queued == 400  # the add was applied: sent again, its rollouts count once

    with held_lock(busy) as release:
        asyncio.run(scenario(release))
    registry.close()
