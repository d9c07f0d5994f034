"""Small adds and ships on the event loop (Run.quick): only when the run is free at once and its queue
small, so that a run busy with a long call never stalls the other connections."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest

from staleness_metrics.config import StalenessConfig
from staleness_metrics.server import RunRegistry, ServerSettings, create_app
from staleness_metrics.server.models import ShipRequest
from staleness_metrics.server.runs import QUICK_MAX_POSITIONS, QUICK_MAX_ROLLOUTS

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


@pytest.mark.parametrize("persistent", [False, True])
def test_requests_waiting_for_a_busy_run_hold_one_worker(persistent: bool, tmp_path: Path) -> None:
    """More requests to a busy run than the worker pool has threads (40): they wait for the run on
    the event loop, one at a time on a worker, so every other run's requests still find one."""
    settings = ServerSettings(data_dir=tmp_path if persistent else None)
    app = create_app(settings)
    registry: RunRegistry = app.state.runs
    for name in ("busy", "other"):
        registry.create(name, StalenessConfig(max_staleness=4))[0].add([rollout(f"{name}-r1")])
    busy, held, release = registry.get("busy"), threading.Event(), threading.Event()

    def long_call() -> None:
        with busy.quick():  # the run's lock, held as a long add or ship holds it
            held.set()
            release.wait(HANG_GUARD)

    async def scenario() -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=HANG_GUARD) as http:
            waiting = [asyncio.create_task(http.get("/v1/runs/busy")) for _ in range(48)]
            waiting += [asyncio.create_task(http.post("/v1/runs/busy/sweep", json={"step": 1})) for _ in range(4)]
            waiting.append(asyncio.create_task(http.get("/v1/runs/busy/steps")))
            while limiter.borrowed_tokens < 1:  # the first has reached the run's lock, on a worker
                assert not any(task.done() for task in waiting)
                await asyncio.sleep(0.001)
            for _ in range(500):  # (every request runs to where it waits: this loop has no I/O)
                await asyncio.sleep(0)
            assert limiter.borrowed_tokens == 1
            other = [http.get("/v1/runs/other"), http.post("/v1/runs/other/sweep", json={"step": 1})]
            other.append(http.post("/v1/runs/other/rollouts", json={"rollouts": [rollout("big", 20_000)]}))
            answers = await asyncio.wait_for(asyncio.gather(*other), HANG_GUARD)
            assert [a.status_code for a in answers] == [200, 200, 200] and answers[2].json()["queued"] == 2
            assert not any(task.done() for task in waiting)
            release.set()
            done = await asyncio.wait_for(asyncio.gather(*waiting), HANG_GUARD)
        assert {a.status_code for a in done} == {200} and done[0].json()["queued"] == 1

    holder = threading.Thread(target=long_call)
    holder.start()
    try:
        assert held.wait(HANG_GUARD)
        asyncio.run(scenario())
    finally:
        release.set()
        holder.join(HANG_GUARD)
        registry.close()
