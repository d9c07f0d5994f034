"""The FastAPI application of ``staleness-metrics serve``: the routers of :mod:`.routes` behind
the token check and the body size cap, in that order."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from .. import __version__
from .limits import DEFAULT_BODY_BYTES_PER_SPAN_ROW, DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from .registry import ExportSettings, RunRegistry
from .routes import EXCEPTION_HANDLERS, routers
from .security import BEARER_SCHEME, TokenFirst, check_token
from .store import SqliteStore, Store

DESCRIPTION = """\
A sidecar that keeps one staleness sink per run and publishes its metrics, for orchestrators written in
other languages or split over processes. Create a run (`PUT /v1/runs/{run}`), send finished rollouts,
ship batches, and read the metrics back (`/steps`, `/metrics`). Trainers post what staleness cost a
shipped step (their mismatch sums by token lag, `/mismatch`), one post per rank: they merge.

Writes need `Authorization: Bearer <token>` when the service was started with a token (always, off
loopback). Re-sending a batch or a ship after a timeout is safe: rollouts are counted once by id, and a
ship or mismatch post with an `Idempotency-Key` the run has seen returns the first answer.
"""


@dataclass(frozen=True)
class ServerSettings:
    """The ``serve`` options. ``token``: needed on every write when set, and on reads too with
    ``protect_reads``. ``body_bytes_per_span_row``: a rollouts body may cut one span row per that
    many bytes, at least 65,536 (0: no cap). ``exporters``: OTLP and W&B besides Prometheus.
    ``data_dir``: where every acknowledged write is persisted; None keeps runs in memory only."""

    token: str | None = field(default=None, repr=False)  # never printed
    protect_reads: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_bytes_per_span_row: int = DEFAULT_BODY_BYTES_PER_SPAN_ROW
    exporters: ExportSettings = field(default_factory=ExportSettings)
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        check_token(self.token)


def create_app(settings: ServerSettings | None = None, runs: RunRegistry | None = None) -> FastAPI:
    """The service application. ``runs`` defaults to a new registry with ``settings.exporters``."""
    settings = settings or ServerSettings()
    if runs is not None:
        registry = runs
    else:
        store = SqliteStore(settings.data_dir) if settings.data_dir is not None else Store()
        registry = RunRegistry(settings.exporters, store)
        registry.restore(defer=True)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
    for router in routers(registry, settings.protect_reads, settings.body_bytes_per_span_row):
        app.include_router(router)

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
