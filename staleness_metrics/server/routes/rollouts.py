"""``/rollouts``, ``/sweep`` and ``/ship`` of a run: the hot path of a training loop.

A small add or ship does about a millisecond of work of its own, and the hop to a worker thread
and back costs as much again (two thread wake-ups, each waiting for a core on a busy machine).
:func:`on_run`, the one place that decides, calls the run on the event loop when that cannot
stall the other connections: the run is held in memory (a write to a data directory waits for the
disk, and finding a run there may load it), the request is small, and :meth:`.Run.quick` holds
the run's lock without waiting (its queue small). Otherwise the call goes to a worker thread,
where it waits for the run's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import APIRouter, Header, HTTPException, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ..decode import BodyTooComplex, BodyTooDeep, compact_records, paused_gc, read_json
from ..errors import SpanRowsTooMany
from ..models import (
    AddResult,
    ErrorItem,
    ErrorMessage,
    RolloutBatchIn,
    RunInfo,
    ShipRequest,
    ShipResult,
    SweepRequest,
    ValidationErrorBody,
)
from ..registry import RunRegistry
from ..responses import ERRORS, JSONModelResponse, documented
from ..runs import Run
from ..span_rows import check_span_rows
from .access import Access, RunName

__all__ = ["QUICK_BODY_BYTES", "on_run", "rollouts_router"]

T = TypeVar("T")

# a rollouts body up to this size is read and applied in about a millisecond
QUICK_BODY_BYTES = 64 * 1024
ROLLOUT_BATCH_SCHEMA = RolloutBatchIn.model_json_schema()


async def on_run(registry: RunRegistry, run: str, call: Callable[[Run], T], *, small: bool = True) -> T:
    """``call`` of the run ``run``: on the event loop when the request is ``small``, the run in
    memory and free at once (see the module's docstring), else on a worker thread. Errors are
    raised as from either."""
    if small and not registry.store.persistent:
        target = registry.get(run)
        with target.quick() as free:
            if free:
                return call(target)
    # 404 before the call reads anything
    return await run_in_threadpool(lambda: call(registry.get(run)))


def add_body(target: Run, held: list[bytearray], bytes_per_span_row: int) -> AddResult:
    """Parse a rollouts body (dropping its bytes as they are read, see :mod:`..decode`) and
    add it to ``target``."""
    body_bytes = sum(len(part) for part in held)
    with paused_gc():  # millions of new containers: see paused_gc
        try:
            data = read_json(held)
        except BodyTooComplex as error:  # refused before its values were built (the memory bound)
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, str(error)) from None
        except BodyTooDeep as error:  # as any route answers a body too deep for the JSON reader
            raise HTTPException(status.HTTP_400_BAD_REQUEST, str(error)) from None
        except ValueError as error:  # not UTF-8 (UnicodeDecodeError is a ValueError) or not JSON
            raise RequestValidationError(
                [{"loc": ("body",), "msg": f"JSON decode error: {error}", "type": "json_invalid"}]
            ) from None
        try:
            batch = RolloutBatchIn.model_validate(data)
        except ValidationError as error:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None
        del data
        compact_records(batch.rollouts)
        # before the queue builds any span table: a row per run of one mask value and
        # version (see .span_rows)
        exceeded = check_span_rows(batch.rollouts, body_bytes, bytes_per_span_row)
        if exceeded is not None:
            item = ErrorItem(
                field=exceeded.field,
                reason=exceeded.reason,
                rollout_id=exceeded.rollout_id,
                index=exceeded.index,
            )
            raise SpanRowsTooMany([item])
        return target.add(batch.rollouts)


async def read_body(request: Request) -> bytearray:
    """The request's body (the size cap, :class:`..limits.BodySizeLimit`, has
    counted it as it came)."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
    except ClientDisconnect:  # gone, or cut off by the body size cap (which has answered 413)
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "the client disconnected before the body ended") from None
    return body


def rollouts_router(registry: RunRegistry, access: Access, bytes_per_span_row: int) -> APIRouter:
    router = APIRouter(prefix="/v1/runs/{run}", tags=["rollouts"])

    @router.post(
        "/rollouts",
        response_model=AddResult,
        responses={
            **documented(400, 401, 404, 409, 413),
            413: {
                "model": ErrorMessage | ValidationErrorBody,
                "description": ERRORS[413] + " Or more span rows than the body's size allows "
                "(serve --body-bytes-per-span-row): then `detail` names the rollout, field "
                "and reason as a 422 does.",
            },
        },
        openapi_extra={
            **access.writes,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ROLLOUT_BATCH_SCHEMA}},
            },
        },
    )
    async def add_rollouts(run: RunName, request: Request) -> Response:
        """Queue finished rollouts. Records received before (same id and
        content) count as duplicates.

        Strict runs: an invalid record gets 422 naming its id, field and reason, and nothing of the
        batch is applied. Lenient runs set invalid records aside (counted) and queue the rest.
        """
        # parsed once, by add_body, which drops the bytes as it reads them
        held = [await read_body(request)]
        small = len(held[0]) <= QUICK_BODY_BYTES
        added = await on_run(registry, run, lambda target: add_body(target, held, bytes_per_span_row), small=small)
        return JSONModelResponse(added)

    @router.post(
        "/sweep",
        openapi_extra=access.writes,
        response_model=RunInfo,
        responses=documented(400, 401, 404, 409, 413),
    )
    def sweep(run: RunName, request: SweepRequest) -> Response:
        """Apply the policy at ``step`` to the queue; its drops are reported with the next ship."""
        return JSONModelResponse(registry.get(run).sweep(request.step))

    @router.post(
        "/ship",
        openapi_extra=access.writes,
        response_model=ShipResult,
        responses=documented(400, 401, 404, 409, 413),
    )
    async def ship(
        run: RunName,
        request: ShipRequest,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                min_length=1,
                max_length=255,
                description="Send the same key when retrying a ship: the run answers it once.",
            ),
        ] = None,
    ) -> Response:
        """Mask and ship the batch for ``step`` and publish its metrics to every exporter."""
        return JSONModelResponse(await on_run(registry, run, lambda target: target.ship(request, idempotency_key)))

    return router
