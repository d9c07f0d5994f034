"""Small adds and ships on the event loop (Run.quick): only when the run is free at once and its queue
small, so that a run busy with a long call never stalls the other connections."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
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


def _routed_ship(http: httpx.Client, run: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    """The ship as the quick lane takes it, or (a content type it leaves to the route) as the route does."""
    headers = (
        {"content-type": "application/json"}
        if run.startswith("lane")
        else {"content-type": "application/json; charset=utf-8"}
    )
    if key is not None:
        headers["Idempotency-Key"] = key
    return http.post(f"/v1/runs/{run}/ship", content=json.dumps(body).encode(), headers=headers)


def _routed_add(http: httpx.Client, run: str, records: list[dict[str, Any]]) -> httpx.Response:
    """The add with a length (the lane takes it) or streamed without one (the lane leaves it to the route)."""
    body = json.dumps({"rollouts": records}).encode()
    content: bytes | Iterator[bytes] = body if run.startswith("lane") else iter([body])
    return http.post(f"/v1/runs/{run}/rollouts", content=content, headers={"content-type": "application/json"})


def _same(lane: httpx.Response, route: httpx.Response) -> None:
    assert lane.status_code == route.status_code
    assert lane.headers.get("content-type") == route.headers.get("content-type")
    assert lane.content.replace(b"lane", b"RUN") == route.content.replace(b"route", b"RUN")


def test_the_quick_lane_answers_as_the_routes_do(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url, timeout=HANG_GUARD) as http:
        for run in ("lane", "route"):
            assert http.put(f"/v1/runs/{run}", json={"max_staleness": 1, "policy": "token"}).status_code == 201
        steps: list[tuple[str, int, Callable[[str], httpx.Response]]] = [
            ("add", 200, lambda run: _routed_add(http, run, [rollout("r1"), rollout("r2", version=1)])),
            ("a duplicate", 200, lambda run: _routed_add(http, run, [rollout("r1"), rollout("r3")])),
            ("an id again, other content", 409, lambda run: _routed_add(http, run, [rollout("r1", positions=20)])),
            ("an invalid record", 422, lambda run: _routed_add(http, run, [{"id": "bad", "samples": [{"mask": [2]}]}])),
            ("ship", 200, lambda run: _routed_ship(http, run, {"step": 2, "include_rollouts": True}, key="k1")),
            ("its retry", 200, lambda run: _routed_ship(http, run, {"step": 2, "include_rollouts": True}, key="k1")),
            ("another ship, same key", 422, lambda run: _routed_ship(http, run, {"step": 3}, key="k1")),
            ("a step below", 409, lambda run: _routed_ship(http, run, {"step": 1})),
            ("a ship by ids", 200, lambda run: _routed_ship(http, run, {"step": 3, "ids": ["r3", "nothing"]})),
        ]
        answers: dict[str, Any] = {}
        for what, status, call in steps:
            lane, route = call("lane"), call("route")
            assert lane.status_code == status, what
            _same(lane, route)
            answers[what] = lane.json()
        assert answers["a duplicate"]["duplicates"] == 1 and answers["a duplicate"]["accepted"] == 1
        assert sorted(answers["ship"]["shipped"]) == ["r1", "r2", "r3"] and answers["ship"]["rollouts"]
        assert answers["its retry"]["replayed"] and not answers["ship"]["replayed"]
        missing_lane = _routed_ship(http, "lane-missing", {"step": 1})
        missing_route = _routed_ship(http, "route-missing", {"step": 1})
        assert missing_lane.status_code == 404
        _same(missing_lane, missing_route)
        lane_steps, route_steps = http.get("/v1/runs/lane/steps"), http.get("/v1/runs/route/steps")
        _same(lane_steps, route_steps)
        assert [row["ship"] for row in lane_steps.json()["steps"]] == [1, 2]
