"""The FastAPI application of ``staleness-metrics serve``: one :class:`fastapi.APIRouter` per
resource, how they answer (models written to JSON in one call, the error bodies), and
:func:`create_app` putting them behind the token check and the body size cap."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import pathlib
import re
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Body, Header, HTTPException, Path, Query, Request, Response, status
from fastapi.applications import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from .. import __version__
from ..config import StalenessConfig, check_int
from ..errors import ConfigError
from .decode import check_span_rows, compact_records, paused_gc, read_json
from .limits import DEFAULT_BODY_BYTES_PER_SPAN_ROW, DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from .models import (
    MAX_ERROR_ITEMS,
    MAX_STEP,
    RUN_NAME_PATTERN,
    AddResult,
    ErrorItem,
    ErrorMessage,
    Health,
    MismatchRequest,
    MismatchResult,
    RecordsInvalid,
    RolloutBatchIn,
    RunError,
    RunInfo,
    RunList,
    ServiceStopping,
    ShipRequest,
    ShipResult,
    SpanRowsTooMany,
    StepsPage,
    SweepRequest,
    ValidationErrorBody,
    field_item,
    run_config_schema,
)
from .registry import ExportSettings, RunRegistry
from .runs import Run
from .security import BEARER_SCHEME, TokenFirst, check_token
from .store import SqliteStore, Store

T = TypeVar("T")
HEALTH_LOADING_WAIT = 5.0  # seconds /healthz waits for the stored runs to load after a restart
QUICK_BODY_BYTES = 64 * 1024  # a rollouts body up to this size is read and applied in ~1 ms
NDJSON = "application/x-ndjson"
STOPPING = "the service stopped before answering: send the request again once it is back, as after a timeout"
WRITE_ERRORS = (400, 401, 404, 409, 413)  # what a write to a run may answer, besides 422
_JSON = re.compile(r"\s*application/([^;]*\+)?json\s*(;|$)", re.IGNORECASE)

ERRORS: dict[int, str] = {
    400: "The body could not be read (not UTF-8 JSON).",
    401: "Missing or wrong bearer token.",
    404: "No such run (create it with PUT /v1/runs/{run}).",
    409: "Conflicts with the run's state.",
    413: "Request body larger than the service accepts.",
}


def documented(*codes: int, invalid: bool = True) -> dict[int | str, dict[str, Any]]:
    answers: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorMessage, "description": ERRORS[code]} for code in codes
    }
    if invalid:
        answers[422] = {
            "model": ValidationErrorBody,
            "description": "Invalid request: the field and reason of each error; nothing was applied.",
        }
    return answers


class JSONModelResponse(Response):
    """A model written to JSON by pydantic in one call (a returned one is validated again)."""

    media_type = "application/json"

    def __init__(self, model: BaseModel, status_code: int = status.HTTP_200_OK) -> None:
        super().__init__(model.__pydantic_serializer__.to_json(model), status_code=status_code)


def _printable(text: str) -> str:
    """``text`` with lone surrogates escaped: an answer naming a bad string can be encoded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _invalid(items: list[ErrorItem], status_code: int = RecordsInvalid.status) -> JSONResponse:
    if (more := len(items) - MAX_ERROR_ITEMS) > 0:  # one item counts the rest: each costs memory
        items = [*items[:MAX_ERROR_ITEMS], ErrorItem(field="body", reason=f"{more} more errors")]
    dumped = (item.model_dump().items() for item in items)
    detail = [{k: _printable(v) if isinstance(v, str) else v for k, v in pairs} for pairs in dumped]
    return JSONResponse({"detail": detail}, status_code=status_code)


async def _run_error(request: Request, exc: RunError) -> JSONResponse:
    if isinstance(exc, RecordsInvalid):  # the 422 shape, a span-row cap's 413 too
        return _invalid(exc.errors, exc.status)
    return JSONResponse({"detail": _printable(str(exc))}, status_code=exc.status)


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    items = []
    for error in exc.errors():  # a record's error names its index in the batch, as the checks' do
        loc = tuple(error.get("loc", ()))
        index = loc[2] if loc[:2] == ("body", "rollouts") and len(loc) > 2 else None
        items.append(ErrorItem(field=".".join(map(str, loc)), reason=str(error.get("msg", "")), index=index))
    return _invalid(items)


async def _too_deep(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": "the body is nested too deeply to read"}, status_code=status.HTTP_400_BAD_REQUEST)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # (sorted: the Allow order)


async def _not_allowed(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """A 405 whose ``Allow`` lists every method of the path (RFC 9110), not one route's: each method
    a route (one a router includes too) fully matches."""
    routes = request.app.routes
    allowed = [m for m in _METHODS if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)]
    return JSONResponse({"detail": exc.detail}, exc.status_code, headers={"allow": ", ".join(allowed)})


EXCEPTION_HANDLERS: dict[Any, Any] = {
    status.HTTP_405_METHOD_NOT_ALLOWED: _not_allowed,
    RunError: _run_error,
    RequestValidationError: _invalid_request,
    RecursionError: _too_deep,
}


RunName = Annotated[
    str,
    Path(pattern=RUN_NAME_PATTERN, description="The run's name (its `run` label).", examples=["demo"]),
]


def idempotency_header(retried: str) -> Any:
    description = f"Send the same key when retrying {retried} once."
    return Header(alias="Idempotency-Key", min_length=1, max_length=255, description=description)


@dataclasses.dataclass(frozen=True)
class Access:
    """The OpenAPI ``security`` of writes and reads, and the errors a read may answer."""

    writes: dict[str, Any]
    reads: dict[str, Any]
    read_errors: tuple[int, ...]

    def write(self, model: Any, *codes: int) -> dict[str, Any]:
        return {"openapi_extra": self.writes, "response_model": model, "responses": documented(*codes)}

    def read(self, model: Any, *codes: int, invalid: bool = True) -> dict[str, Any]:
        responses = documented(*self.read_errors, *codes, invalid=invalid)
        return {"openapi_extra": self.reads, "response_model": model, "responses": responses}

    def text(self, media: str, about: str, *codes: int, invalid: bool = True) -> dict[str, Any]:
        """A read answering ``media`` text (no model), described by ``about``."""
        answer = {"description": about, "content": {media: {"schema": {"type": "string"}}}}
        responses = {200: answer, **documented(*self.read_errors, *codes, invalid=invalid)}
        return {"openapi_extra": self.reads, "responses": responses}


def service_router(registry: RunRegistry, access: Access) -> APIRouter:
    router = APIRouter(tags=["service"])

    @router.get(
        "/healthz",
        response_model=Health,
        responses={503: {"model": Health, "description": "Some runs answer 503: `unavailable` names them."}},
    )
    async def healthz() -> Response:
        """The service answers, and every run does: 503 names the runs that answer
        503. Never needs a token.

        Just after a restart it answers once every stored run is loaded (or found unavailable),
        waiting up to a few seconds: a run that cannot be loaded is only known then. Runs still
        loading after that are named as such (503)."""
        if registry.loading():
            unavailable = await run_in_threadpool(registry.unavailable_once_loaded, HEALTH_LOADING_WAIT)
        else:
            unavailable = registry.unavailable()
        health = Health(status="unavailable" if unavailable else "ok", runs=registry.count(), unavailable=unavailable)
        return JSONModelResponse(health, status.HTTP_503_SERVICE_UNAVAILABLE if unavailable else status.HTTP_200_OK)

    about = "Prometheus text exposition (OpenMetrics when the Accept header asks for it)."

    @router.get("/metrics", response_class=Response, **access.text("text/plain", about, invalid=False))
    def metrics(request: Request) -> Response:
        """Every run's metrics, each series labelled with its ``run``."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), media_type=content_type)  # RunRegistry.collect

    return router


def runs_router(calls: RunCalls, access: Access) -> APIRouter:
    registry = calls.registry
    router = APIRouter(prefix="/v1/runs", tags=["runs"], route_class=JSONBodyRoute)

    @router.get("", **access.read(RunList, invalid=False))
    async def list_runs() -> Response:
        runs = await run_in_threadpool(registry.runs)  # (loads the stored runs not loaded yet)
        return JSONModelResponse(RunList(runs=[await calls.on_worker(run.name, run.info) for run in runs]))

    @router.put(
        "/{run}",
        status_code=status.HTTP_201_CREATED,
        response_model=RunInfo,
        responses={
            200: {"model": RunInfo, "description": "The run exists with this configuration."},
            **documented(400, 401, 409, 413),
        },
        openapi_extra={
            **access.writes,
            "requestBody": {"content": {"application/json": {"schema": run_config_schema()}}},
        },
    )
    def create_run(run: RunName, config: Annotated[dict[str, Any], Body(default_factory=dict)]) -> Response:
        """Create a run with its configuration (policy and bound); idempotent for
        the same configuration."""
        try:  # 422 naming the setting (none over 2**53: the library checks)
            parsed = StalenessConfig.from_mapping(config)
        except ConfigError as error:
            raise RecordsInvalid([field_item(error, "config")]) from None
        created_run, created = registry.create(run, parsed)
        return JSONModelResponse(created_run.info(), status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @router.get("/{run}", **access.read(RunInfo, 404))
    async def get_run(run: RunName) -> Response:
        return await calls(run, Run.info, small=False)

    @router.delete(
        "/{run}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response, **access.write(None, 401, 404)
    )
    async def delete_run(run: RunName) -> Response:
        """Delete a run: its exporters flush and close, and its series leave ``/metrics``."""
        await calls.on_worker(run, lambda: registry.delete(run))  # (its calls before it done)
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    return router


class RunCalls:
    """Calls of one run at a time: a request waits for its run on the event loop, not on a worker
    thread, so a busy run holds one worker and the other runs' requests find theirs free."""

    def __init__(self, registry: RunRegistry) -> None:
        self.registry = registry
        # a run's lock lives while requests hold or wait for it: unknown names leave nothing behind
        # (per event loop: an asyncio lock serves one, and an app may be driven by several in tests)
        self._gates: weakref.WeakValueDictionary[tuple[object, str], asyncio.Lock] = weakref.WeakValueDictionary()

    async def on_worker(self, run: str, call: Callable[[], T]) -> T:
        """``call()`` on a worker thread once this run's earlier calls are done (waiting on the loop)."""
        try:
            async with self._gates.setdefault((asyncio.get_running_loop(), run), asyncio.Lock()):
                return await run_in_threadpool(call)
        except asyncio.CancelledError:  # (uvicorn ending the requests left past its grace: not a 500)
            raise ServiceStopping(STOPPING) from None

    async def __call__(self, run: str, call: Callable[[Run], BaseModel], *, small: bool = True) -> Response:
        """``call`` of the run answered: on the event loop when that cannot stall other connections (a
        small request, a run in memory, its lock free at once), else on a worker (a large answer too)."""
        if small and not self.registry.store.persistent:
            target = self.registry.get(run)
            with target.quick() as free:
                if free:
                    return JSONModelResponse(call(target))
        return await self.on_worker(run, lambda: JSONModelResponse(call(self.registry.get(run))))


class JSONBodyRequest(Request):
    async def json(self) -> Any:  # as a rollouts body: memory bounded by its size, any integer
        return read_json([bytearray(await self.body())])


class JSONBodyRoute(APIRoute):
    """A route reading its body with :func:`read_json`; a POST not JSON is refused unread (CORS)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_json(request: Request) -> Response:
            media = request.headers.get("content-type", "")
            if request.method == "POST" and not _JSON.match(media):
                raise RequestValidationError([{"loc": ("body",), "msg": "not JSON (a media type)"}])
            return await handle(JSONBodyRequest(request.scope, request.receive))

        return handle_json


def add_body(target: Run, held: list[bytearray], bytes_per_span_row: int) -> AddResult:
    """Parse a rollouts body (dropping its bytes as they are read) and add it to ``target``."""
    body_bytes = sum(len(part) for part in held)
    with paused_gc():  # millions of new containers: see paused_gc
        try:
            data = read_json(held)
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
        if exceeded := check_span_rows(batch.rollouts, body_bytes, bytes_per_span_row):
            raise SpanRowsTooMany([exceeded])
        return target.add(batch.rollouts)


def rollouts_router(calls: RunCalls, access: Access, bytes_per_span_row: int) -> APIRouter:
    router = APIRouter(prefix="/v1/runs/{run}", tags=["rollouts"], route_class=JSONBodyRoute)

    @router.post(
        "/rollouts",
        response_model=AddResult,
        responses={
            **documented(*WRITE_ERRORS),
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
                "content": {"application/json": {"schema": RolloutBatchIn.model_json_schema()}},
            },
        },
    )
    async def add_rollouts(run: RunName, request: Request) -> Response:
        """Queue finished rollouts. Records received before (same id and
        content) count as duplicates.

        Strict runs: an invalid record gets 422 naming its id, field and reason, and nothing of the
        batch is applied. Lenient runs set invalid records aside (counted) and queue the rest."""
        held = [bytearray()]  # parsed once, by add_body, which drops the bytes
        try:
            async for chunk in request.stream():
                held[0] += chunk
        except ClientDisconnect:  # gone, or cut off by the body size cap (which has answered 413)
            detail = "the client disconnected before the body ended"
            raise HTTPException(status.HTTP_400_BAD_REQUEST, detail) from None
        small = len(held[0]) <= QUICK_BODY_BYTES
        return await calls(run, lambda target: add_body(target, held, bytes_per_span_row), small=small)

    @router.post("/sweep", **access.write(RunInfo, *WRITE_ERRORS))
    async def sweep(run: RunName, request: SweepRequest) -> Response:
        """Apply the policy at ``step`` to the queue; its drops are reported with the next ship."""
        return await calls(run, lambda target: target.sweep(request.step), small=False)

    @router.post("/ship", **access.write(ShipResult, *WRITE_ERRORS))
    async def ship(
        run: RunName,
        request: ShipRequest,
        idempotency_key: Annotated[str | None, idempotency_header("a ship: the run answers it")] = None,
    ) -> Response:
        """Mask and ship the batch for ``step`` and publish its metrics to every exporter."""
        return await calls(run, lambda target: target.ship(request, idempotency_key))

    return router


def history_router(calls: RunCalls, access: Access) -> APIRouter:
    router = APIRouter(prefix="/v1/runs/{run}", tags=["metrics"], route_class=JSONBodyRoute)

    @router.post("/mismatch", **access.write(MismatchResult, 400, 401, 404, 413))
    async def record_mismatch(
        run: RunName,
        request: MismatchRequest,
        idempotency_key: Annotated[str | None, idempotency_header("a post: the run merges it")] = None,
    ) -> Response:
        """Merge trainer-side mismatch sums (SPEC 11) into a shipped step's total and publish it.

        Post one `MismatchSums.to_dict()` per rank or micro-batch: posts for one step merge. Invalid
        sums (a missing bucket, a negative count) or a step the run never shipped get 422 naming the
        field, and nothing is recorded."""
        return await calls(run, lambda target: target.record_mismatch(request, idempotency_key), small=False)

    @router.get("/steps", **access.read(StepsPage, 404))
    async def steps(
        run: RunName,
        since: Annotated[int, Query(ge=0, le=MAX_STEP, description="Return the ships with step > since.")] = 0,
    ) -> Response:
        """The run's metrics history, one row per ship, oldest first."""
        return await calls(run, lambda target: StepsPage(run=run, steps=target.steps(since)), small=False)

    about = "The run's history as SPEC 9 events, one JSON object a line (`replay` input)."

    @router.get("/events", response_class=StreamingResponse, **access.text(NDJSON, about, 404, 409))
    def events(run: RunName) -> StreamingResponse:
        """Every rollout, sweep and ship the run acknowledged, in order:
        ``staleness-metrics replay`` of this file reproduces ``/steps``. Needs a data directory (409
        with ``--in-memory``)."""
        lines = calls.registry.get(run).events()
        first = next(lines, None)  # errors (404, 409) surface before the 200 starts
        every = lines if first is None else itertools.chain([first], lines)
        body = (orjson.dumps(event) + b"\n" for event in every)
        return StreamingResponse(body, media_type=NDJSON)

    return router


DESCRIPTION = """\
A sidecar that keeps one staleness sink per run and publishes its metrics, for orchestrators written in
other languages or split over processes. Create a run (`PUT /v1/runs/{run}`), send finished rollouts,
ship batches, and read the metrics back (`/steps`, `/metrics`). Trainers post what staleness cost a
shipped step (their mismatch sums by token lag, `/mismatch`), one post per rank: they merge.

Writes need `Authorization: Bearer <token>` when the service was started with a token (always, off
loopback). Re-sending a batch or a ship after a timeout is safe: rollouts are counted once by id, and a
ship or mismatch post with an `Idempotency-Key` the run has seen returns the first answer.
"""


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """The ``serve`` options. ``token``: needed on every write when set, and on reads too with
    ``protect_reads``. ``body_bytes_per_span_row``: a rollouts body may cut one span row per that
    many bytes, at least 65,536 (0: no cap). ``exporters``: OTLP and W&B besides Prometheus.
    ``data_dir``: where every acknowledged write is persisted; None keeps runs in memory only."""

    token: str | None = dataclasses.field(default=None, repr=False)  # never printed
    protect_reads: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_bytes_per_span_row: int = DEFAULT_BODY_BYTES_PER_SPAN_ROW
    exporters: ExportSettings = dataclasses.field(default_factory=ExportSettings)
    data_dir: pathlib.Path | None = None

    def __post_init__(self) -> None:  # (the serve command's flags too: each checked here once)
        check_token(self.token)
        if self.protect_reads and not self.token:
            raise ConfigError("protect_reads: needs a token, or it would protect nothing")
        check_int("max_body_bytes", self.max_body_bytes, 1)
        check_int("body_bytes_per_span_row", self.body_bytes_per_span_row, 0)


def create_app(settings: ServerSettings | None = None, runs: RunRegistry | None = None) -> FastAPI:
    """The service application. ``runs`` defaults to a new registry with ``settings.exporters``."""
    settings = settings or ServerSettings()
    registry = runs
    if registry is None:
        store = SqliteStore(settings.data_dir) if settings.data_dir is not None else Store()
        registry = RunRegistry(settings.exporters, store)
        registry.restore(defer=True)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if registry.closed:  # this app started again (a second TestClient): a restart
            await run_in_threadpool(registry.reopen)
        registry.load_in_background()  # a request for a run not loaded yet loads it first
        yield
        await run_in_threadpool(registry.close)  # flushes every run's exporters

    app = FastAPI(
        title="staleness-metrics service",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.state.runs = registry
    writes: dict[str, Any] = {"security": [{"HTTPBearer": []}]}
    access = Access(writes, writes, (401,)) if settings.protect_reads else Access(writes, {}, ())
    app.include_router(service_router(registry, access))
    calls = RunCalls(registry)
    app.include_router(runs_router(calls, access))
    app.include_router(rollouts_router(calls, access, settings.body_bytes_per_span_row))
    app.include_router(history_router(calls, access))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # built at the first request for it, then kept
            document = FastAPI.openapi(app)
            document.setdefault("components", {}).setdefault("securitySchemes", {})["HTTPBearer"] = BEARER_SCHEME
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    # the last added runs first
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(TokenFirst, token=settings.token, protect_reads=settings.protect_reads)
    return app
