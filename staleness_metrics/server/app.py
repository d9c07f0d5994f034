"""The FastAPI application of ``staleness-metrics serve``.

Routes (see the OpenAPI document at ``/openapi.json``, browsable at ``/docs``):

- ``PUT /v1/runs/{run}`` creates a run with its configuration (201; 200 when it exists with the same
  one, 409 with another). Rollouts to a run that was not created get 404: a typo in a run name must
  not silently start a second run with default settings.
- ``POST /v1/runs/{run}/rollouts``, ``/sweep``, ``/ship``, ``/mismatch`` (trainer-side SPEC 11 sums of a
  shipped step; posts for one step merge); ``GET /v1/runs/{run}``, ``/steps?since=N``;
  ``DELETE /v1/runs/{run}``; ``GET /v1/runs``.
- ``GET /metrics``: the Prometheus exposition of every run; ``GET /healthz``.

Handlers are plain functions: FastAPI runs them on its thread pool, and each run serializes its own
calls (see :mod:`.runs`). Small adds and ships to a run held in memory are the exception: they run on
the event loop when the run is free at once (see :mod:`.quick`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import Body, FastAPI, Header, HTTPException, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .. import __version__
from ..config import StalenessConfig
from ..errors import ConfigError
from .decode import BodyTooComplex, BodyTooDeep, compact_records, paused_gc, read_json
from .errors import (
    IdempotencyMismatch,
    NotPersisted,
    RecordConflict,
    RecordsInvalid,
    RunBroken,
    RunConflict,
    RunError,
    RunNotFound,
    SpanRowsTooMany,
    StepConflict,
)
from .exporting import ServiceCollector
from .limits import BodySizeLimit
from .methods import AllowHeader
from .models import (
    MAX_STEP,
    RUN_NAME_PATTERN,
    AddResult,
    ErrorItem,
    ErrorMessage,
    Health,
    MismatchRequest,
    MismatchResult,
    RolloutBatchIn,
    RunInfo,
    RunList,
    ShipRequest,
    ShipResult,
    StepsPage,
    SweepRequest,
    ValidationErrorBody,
    run_config_schema,
)
from .quick import QUICK_BODY_BYTES, QuickLane, quickly
from .registry import RunRegistry
from .runs import Run
from .security import BEARER_SCHEME, TokenFirst
from .settings import ServerSettings
from .span_rows import check_span_rows
from .store import SqliteStore, Store

__all__ = ["create_app"]

DESCRIPTION = """\
A sidecar that keeps one staleness sink per run and publishes its metrics, for orchestrators written in
other languages or split over processes. Create a run (`PUT /v1/runs/{run}`), send finished rollouts,
ship batches, and read the metrics back (`/steps`, `/metrics`). Trainers post what staleness cost a
shipped step (their mismatch sums by token lag, `/mismatch`), one post per rank: they merge.

Writes need `Authorization: Bearer <token>` when the service was started with a token (always, off
loopback). Re-sending a batch or a ship after a timeout is safe: rollouts are counted once by id, and a
ship or mismatch post with an `Idempotency-Key` the run has seen returns the first answer.
"""

RunName = Annotated[
    str,
    Path(pattern=RUN_NAME_PATTERN, description="The run's name (its `run` label).", examples=["demo"]),
]

_ERRORS: dict[int, str] = {
    400: "The body could not be read (not UTF-8 JSON).",
    401: "Missing or wrong bearer token.",
    404: "No such run (create it with PUT /v1/runs/{run}).",
    409: "Conflicts with the run's state.",
    413: "Request body larger than the service accepts.",
}


def _responses(*codes: int, invalid: bool = True) -> dict[int | str, dict[str, Any]]:
    documented: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorMessage, "description": _ERRORS[code]} for code in codes
    }
    if invalid:
        documented[422] = {
            "model": ValidationErrorBody,
            "description": "Invalid request: the field and reason of each error; nothing was applied.",
        }
    return documented


class JSONModelResponse(Response):
    """A response model written to JSON by pydantic in one call.

    Returning the model itself would make FastAPI validate it again against the route's response model,
    turn it into Python dicts and lists, and encode those with the standard library: three passes over
    an answer the handler has just built from validated values. Routes declare ``response_model`` for
    the OpenAPI document, and FastAPI passes a returned ``Response`` through untouched.
    """

    media_type = "application/json"

    def __init__(self, model: BaseModel, status_code: int = status.HTTP_200_OK) -> None:
        super().__init__(model.__pydantic_serializer__.to_json(model), status_code=status_code)


def _config_item(error: ConfigError) -> ErrorItem:
    return ErrorItem(field=error.field or "config", reason=error.reason)


def _check_config_range(config: StalenessConfig) -> None:
    """No setting above MAX_STEP: steps stop there, and larger bounds overflow the sink's int64 arithmetic
    at the first ship (a 500 long after the run was accepted)."""
    for setting in dataclasses.fields(config):
        value = getattr(config, setting.name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_STEP:
            raise RecordsInvalid([ErrorItem(field=setting.name, reason=f"must be <= {MAX_STEP}, got {value}")])


_STATUS_OF: dict[type[Exception], int] = {
    RunNotFound: status.HTTP_404_NOT_FOUND,
    RunConflict: status.HTTP_409_CONFLICT,
    RecordConflict: status.HTTP_409_CONFLICT,
    StepConflict: status.HTTP_409_CONFLICT,
    NotPersisted: status.HTTP_409_CONFLICT,
    RunBroken: status.HTTP_503_SERVICE_UNAVAILABLE,
}


def _printable(text: str) -> str:
    """``text`` with lone surrogates written as escapes: an answer naming a bad string can be encoded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _invalid_response(items: list[ErrorItem], status_code: int = status.HTTP_422_UNPROCESSABLE_CONTENT) -> JSONResponse:
    printable = [
        item.model_copy(
            update={
                "field": _printable(item.field),
                "reason": _printable(item.reason),
                "rollout_id": None if item.rollout_id is None else _printable(item.rollout_id),
            }
        )
        for item in items
    ]
    body = ValidationErrorBody(detail=printable)
    return JSONResponse(body.model_dump(), status_code=status_code)


def _install_error_handlers(app: FastAPI) -> None:
    async def run_error(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, (RecordsInvalid, IdempotencyMismatch)):  # the 422 shape: field and reason
            items = (
                exc.errors if isinstance(exc, RecordsInvalid) else [ErrorItem(field="Idempotency-Key", reason=str(exc))]
            )
            too_large = isinstance(exc, SpanRowsTooMany)  # a size limit, named as an invalid record is
            return _invalid_response(items, status.HTTP_413_CONTENT_TOO_LARGE if too_large else 422)
        detail = _printable(str(exc))
        return JSONResponse({"detail": detail}, status_code=_STATUS_OF.get(type(exc), status.HTTP_409_CONFLICT))

    async def invalid_request(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _invalid_response(
            [
                ErrorItem(field=".".join(str(part) for part in error.get("loc", ())), reason=str(error.get("msg", "")))
                for error in exc.errors()
            ]
        )

    async def too_deep(request: Request, exc: Exception) -> JSONResponse:
        # The standard JSON reader recurses once per level: a body nested past the interpreter's limit
        # is unreadable JSON for this service, on every route (400, as for any body it cannot read).
        return JSONResponse(
            {"detail": "the body is nested too deeply to read"}, status_code=status.HTTP_400_BAD_REQUEST
        )

    app.add_exception_handler(RunError, run_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(RecursionError, too_deep)


ROLLOUT_BATCH_SCHEMA = RolloutBatchIn.model_json_schema()
HEALTH_LOADING_WAIT = 5.0  # seconds /healthz waits for the stored runs to load after a restart


def _add_rollouts(registry: RunRegistry, run: str, held: list[bytearray], bytes_per_span_row: int) -> AddResult:
    target = registry.get(run)  # 404 before parsing a body for a run that does not exist
    with paused_gc():  # millions of new containers: see paused_gc
        return _read_and_add(target, held, bytes_per_span_row)


def _read_and_add(target: Run, held: list[bytearray], bytes_per_span_row: int) -> AddResult:
    body_bytes = sum(len(part) for part in held)
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
    # before the queue builds any span table: a row per run of one mask value and version (see .span_rows)
    exceeded = check_span_rows(batch.rollouts, body_bytes, bytes_per_span_row)
    if exceeded is not None:
        rollout_id, field, reason = exceeded.rollout_id, exceeded.field, exceeded.reason
        raise SpanRowsTooMany([ErrorItem(field=field, reason=reason, rollout_id=rollout_id, index=exceeded.index)])
    return target.add(batch.rollouts)


def create_app(settings: ServerSettings | None = None, runs: RunRegistry | None = None) -> FastAPI:
    """The service application. ``runs`` defaults to a new registry with ``settings.exporters``."""
    settings = settings or ServerSettings()
    if runs is not None:
        registry = runs
    else:
        store = SqliteStore(settings.data_dir) if settings.data_dir is not None else Store()
        registry = RunRegistry(settings.exporters, store)
        registry.restore(defer=True)  # every stored run checked before serving; loaded once it listens
    exposition = CollectorRegistry(auto_describe=False)
    exposition.register(ServiceCollector(registry.registries))

    # Which routes the OpenAPI document shows as needing the token. TokenFirst checks it before routing:
    # a per-route dependency would only check it again, on every request.
    writes: dict[str, Any] = {"security": [{"HTTPBearer": []}]}
    reads = writes if settings.protect_reads else {}
    read_errors = (401,) if settings.protect_reads else ()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.load_in_background()  # a request for a run not loaded yet loads it first
        yield
        await run_in_threadpool(registry.close)  # flushes every run's exporters

    app = FastAPI(title="staleness-metrics service", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.runs = registry

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # built at the first request for it, then kept
            document = FastAPI.openapi(app)
            document.setdefault("components", {}).setdefault("securitySchemes", {})["HTTPBearer"] = BEARER_SCHEME
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]

    # The last added runs first: the token is checked before the body size, which is checked before any
    # handler (or the quick lane) reads the body.
    def read_and_add(target: Run, held: list[bytearray]) -> AddResult:
        return _read_and_add(target, held, settings.body_bytes_per_span_row)

    app.add_middleware(
        QuickLane,
        registry=registry,
        add=read_and_add,
        respond=JSONModelResponse,
        handlers=lambda: app.exception_handlers,
    )
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(AllowHeader, routes=lambda: app.routes)
    app.add_middleware(TokenFirst, token=settings.token, protect_reads=settings.protect_reads)
    _install_error_handlers(app)

    @app.get(
        "/healthz",
        tags=["service"],
        response_model=Health,
        responses={503: {"model": Health, "description": "Some runs answer 503: `unavailable` names them."}},
    )
    async def healthz() -> Response:
        """The service answers, and every run does: 503 names the runs that answer 503. Never needs a token.

        Just after a restart it answers once every stored run is loaded (or found unavailable), waiting up
        to a few seconds: a run that cannot be loaded is only known then. Runs still loading after that
        are named as such (503)."""
        if registry.loading():
            unavailable = await run_in_threadpool(registry.unavailable_once_loaded, HEALTH_LOADING_WAIT)
        else:
            unavailable = registry.unavailable()
        health = Health(status="unavailable" if unavailable else "ok", runs=registry.count(), unavailable=unavailable)
        return JSONModelResponse(health, status.HTTP_503_SERVICE_UNAVAILABLE if unavailable else status.HTTP_200_OK)

    @app.get(
        "/metrics",
        tags=["service"],
        openapi_extra=reads,
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text exposition (OpenMetrics when the Accept header asks for it).",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **_responses(*read_errors, invalid=False),
        },
    )
    def metrics(request: Request) -> Response:
        """Every run's metrics, each series labelled with its ``run``."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(exposition), media_type=content_type)

    @app.get(
        "/v1/runs",
        tags=["runs"],
        openapi_extra=reads,
        response_model=RunList,
        responses=_responses(*read_errors, invalid=False),
    )
    def list_runs() -> Response:
        return JSONModelResponse(RunList(runs=[run.info() for run in registry.runs()]))

    @app.put(
        "/v1/runs/{run}",
        tags=["runs"],
        status_code=status.HTTP_201_CREATED,
        response_model=RunInfo,
        responses={
            200: {"model": RunInfo, "description": "The run exists with this configuration."},
            **_responses(400, 401, 409, 413),
        },
        openapi_extra={**writes, "requestBody": {"content": {"application/json": {"schema": run_config_schema()}}}},
    )
    def create_run(run: RunName, config: Annotated[dict[str, Any], Body(default_factory=dict)]) -> Response:
        """Create a run with its configuration (policy and bound); idempotent for the same configuration."""
        try:
            parsed = StalenessConfig.from_mapping(config)
        except ConfigError as error:
            raise RecordsInvalid([_config_item(error)]) from None
        _check_config_range(parsed)
        created_run, created = registry.create(run, parsed)
        return JSONModelResponse(created_run.info(), status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @app.get(
        "/v1/runs/{run}",
        tags=["runs"],
        openapi_extra=reads,
        response_model=RunInfo,
        responses=_responses(*read_errors, 404),
    )
    def get_run(run: RunName) -> Response:
        return JSONModelResponse(registry.get(run).info())

    @app.delete(
        "/v1/runs/{run}",
        tags=["runs"],
        openapi_extra=writes,
        status_code=status.HTTP_204_NO_CONTENT,
        response_class=Response,
        responses=_responses(401, 404),
    )
    def delete_run(run: RunName) -> Response:
        """Delete a run: its exporters flush and close, and its series leave ``/metrics``."""
        registry.delete(run)
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    @app.post(
        "/v1/runs/{run}/rollouts",
        tags=["rollouts"],
        response_model=AddResult,
        responses={
            **_responses(400, 401, 404, 409, 413),
            413: {
                "model": ErrorMessage | ValidationErrorBody,
                "description": _ERRORS[413] + " Or more span rows than the body's size allows (serve "
                "--body-bytes-per-span-row): then `detail` names the rollout, field and reason as a 422 does.",
            },
        },
        openapi_extra={
            **writes,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ROLLOUT_BATCH_SCHEMA}}},
        },
    )
    async def add_rollouts(run: RunName, request: Request) -> Response:
        """Queue finished rollouts. Records received before (same id and content) count as duplicates.

        Strict runs: an invalid record gets 422 naming its id, field and reason, and nothing of the batch
        is applied. Lenient runs set invalid records aside (counted) and queue the rest.
        """
        # The body is read here and parsed once, in the thread pool; the bytes are dropped as soon as they
        # are parsed and long per-position lists become arrays (see .decode).
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
        except ClientDisconnect:  # gone, or cut off by the body size cap (which has answered 413)
            raise HTTPException(status.HTTP_400_BAD_REQUEST, "the client disconnected before the body ended") from None
        held = [body]
        if len(body) <= QUICK_BODY_BYTES:
            with paused_gc():
                done, result = quickly(registry, run, lambda target: read_and_add(target, held))
            if done:
                assert result is not None
                return JSONModelResponse(result)
        del body
        added = await run_in_threadpool(_add_rollouts, registry, run, held, settings.body_bytes_per_span_row)
        return JSONModelResponse(added)

    @app.post(
        "/v1/runs/{run}/sweep",
        tags=["rollouts"],
        openapi_extra=writes,
        response_model=RunInfo,
        responses=_responses(400, 401, 404, 409, 413),
    )
    def sweep(run: RunName, request: SweepRequest) -> Response:
        """Apply the policy at ``step`` to the queue; its drops are reported with the next ship."""
        return JSONModelResponse(registry.get(run).sweep(request.step))

    @app.post(
        "/v1/runs/{run}/ship",
        tags=["rollouts"],
        openapi_extra=writes,
        response_model=ShipResult,
        responses=_responses(400, 401, 404, 409, 413),
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
        done, result = quickly(registry, run, lambda target: target.ship(request, idempotency_key))
        if not done:
            result = await run_in_threadpool(lambda: registry.get(run).ship(request, idempotency_key))
        assert result is not None
        return JSONModelResponse(result)

    @app.post(
        "/v1/runs/{run}/mismatch",
        tags=["metrics"],
        openapi_extra=writes,
        response_model=MismatchResult,
        responses=_responses(400, 401, 404, 413),
    )
    def record_mismatch(
        run: RunName,
        request: MismatchRequest,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                min_length=1,
                max_length=255,
                description="Send the same key when retrying a post: the run merges it once.",
            ),
        ] = None,
    ) -> Response:
        """Merge trainer-side mismatch sums (SPEC 11) into a shipped step's total and publish it.

        Post one `MismatchSums.to_dict()` per rank or micro-batch: posts for one step merge. Invalid sums
        (a missing bucket, a negative count) or a step the run never shipped get 422 naming the field,
        and nothing is recorded.
        """
        return JSONModelResponse(registry.get(run).record_mismatch(request, idempotency_key))

    @app.get(
        "/v1/runs/{run}/steps",
        tags=["metrics"],
        openapi_extra=reads,
        response_model=StepsPage,
        responses=_responses(*read_errors, 404),
    )
    def steps(
        run: RunName,
        since: Annotated[int, Query(ge=0, le=MAX_STEP, description="Return the ships with step > since.")] = 0,
    ) -> Response:
        """The run's metrics history, one row per ship, oldest first."""
        return JSONModelResponse(StepsPage(run=run, steps=registry.get(run).steps(since)))

    @app.get(
        "/v1/runs/{run}/events",
        tags=["metrics"],
        openapi_extra=reads,
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "The run's history as SPEC 9 events, one JSON object a line (`replay` input).",
                "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
            },
            **_responses(*read_errors, 404, 409),
        },
    )
    def events(run: RunName) -> StreamingResponse:
        """Every rollout, sweep and ship the run acknowledged, in order: ``staleness-metrics replay`` of this
        file reproduces ``/steps``. Needs a data directory (409 with ``--in-memory``)."""
        lines = registry.get(run).events()
        first = next(lines, None)  # errors (404, 409) surface before the 200 starts

        def body() -> Iterator[bytes]:
            if first is not None:
                yield orjson.dumps(first) + b"\n"
            for event in lines:
                yield orjson.dumps(event) + b"\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")

    return app
