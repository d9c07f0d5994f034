"""``/v1/runs/{run}/steps`` and ``/events``: what a run has done, as metrics rows
or as its event stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import orjson
from fastapi import APIRouter, Query, Response
from fastapi.responses import StreamingResponse

from ..models import MAX_STEP, StepsPage
from ..registry import RunRegistry
from ..responses import JSONModelResponse, documented
from .access import Access, RunName

__all__ = ["history_router"]


def history_router(registry: RunRegistry, access: Access) -> APIRouter:
    router = APIRouter(prefix="/v1/runs/{run}", tags=["metrics"])

    @router.get(
        "/steps",
        openapi_extra=access.reads,
        response_model=StepsPage,
        responses=documented(*access.read_errors, 404),
    )
    def steps(
        run: RunName,
        since: Annotated[int, Query(ge=0, le=MAX_STEP, description="Return the ships with step > since.")] = 0,
    ) -> Response:
        """The run's metrics history, one row per ship, oldest first."""
        return JSONModelResponse(StepsPage(run=run, steps=registry.get(run).steps(since)))

    @router.get(
        "/events",
        openapi_extra=access.reads,
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "The run's history as SPEC 9 events, one JSON object a line (`replay` input).",
                "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
            },
            **documented(*access.read_errors, 404, 409),
        },
    )
    def events(run: RunName) -> StreamingResponse:
        """Every rollout, sweep and ship the run acknowledged, in order:
        ``staleness-metrics replay`` of this file reproduces ``/steps``. Needs a data directory (409
        with ``--in-memory``)."""
        lines = registry.get(run).events()
        first = next(lines, None)  # errors (404, 409) surface before the 200 starts

        def body() -> Iterator[bytes]:
            if first is not None:
                yield orjson.dumps(first) + b"\n"
            for event in lines:
                yield orjson.dumps(event) + b"\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")

    return router
