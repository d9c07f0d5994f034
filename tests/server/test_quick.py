"""Small adds and ships on the event loop (Run.quick): only when the run is free at once and its queue
small, so that a run busy with a long call never stalls the other connections."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from staleness_metrics.config import StalenessConfig
from staleness_metrics.server import RunRegistry
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
