"""``/healthz`` and ``/metrics``: the service's own resources."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from ..exporting import ServiceCollector
from ..models import Health
from ..registry import RunRegistry
from ..responses import JSONModelResponse, documented
from .access import Access

__all__ = ["HEALTH_LOADING_WAIT", "service_router"]

HEALTH_LOADING_WAIT = 5.0  # seconds /healthz waits for the stored runs to load after a restart


def service_router(registry: RunRegistry, access: Access) -> APIRouter:
    router = APIRouter(tags=["service"])
    exposition = CollectorRegistry(auto_describe=False)
    exposition.register(ServiceCollector(registry.registries))

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
        health = Health(
            status="unavailable" if unavailable else "ok",
            runs=registry.count(),
            unavailable=unavailable,
        )
        return JSONModelResponse(health, status.HTTP_503_SERVICE_UNAVAILABLE if unavailable else status.HTTP_200_OK)

    @router.get(
        "/metrics",
        openapi_extra=access.reads,
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text exposition (OpenMetrics when the Accept header asks for it).",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **documented(*access.read_errors, invalid=False),
        },
    )
    def metrics(request: Request) -> Response:
        """Every run's metrics, each series labelled with its ``run``."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(exposition), media_type=content_type)

    return router
