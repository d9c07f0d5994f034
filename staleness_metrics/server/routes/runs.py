"""``/v1/runs`` and ``/v1/runs/{run}``: the runs themselves (create with a
configuration, read, delete)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Body, Response, status

from ...config import StalenessConfig
from ...errors import ConfigError
from ..errors import RecordsInvalid
from ..models import MAX_STEP, ErrorItem, RunInfo, RunList, run_config_schema
from ..registry import RunRegistry
from ..responses import JSONModelResponse, documented
from .access import Access, RunName

__all__ = ["runs_router"]


def _parse_config(config: dict[str, Any]) -> StalenessConfig:
    """The run's configuration; :class:`RecordsInvalid` (422) naming the setting when it is not one.

    No setting may exceed MAX_STEP: steps stop there, and larger bounds overflow the sink's int64
    arithmetic at the first ship (a 500 long after the run was accepted)."""
    try:
        parsed = StalenessConfig.from_mapping(config)
    except ConfigError as error:
        raise RecordsInvalid([ErrorItem(field=error.field or "config", reason=error.reason)]) from None
    for setting in dataclasses.fields(parsed):
        value = getattr(parsed, setting.name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_STEP:
            raise RecordsInvalid([ErrorItem(field=setting.name, reason=f"must be <= {MAX_STEP}, got {value}")])
    return parsed


def runs_router(registry: RunRegistry, access: Access) -> APIRouter:
    router = APIRouter(prefix="/v1/runs", tags=["runs"])

    @router.get(
        "",
        openapi_extra=access.reads,
        response_model=RunList,
        responses=documented(*access.read_errors, invalid=False),
    )
    def list_runs() -> Response:
        return JSONModelResponse(RunList(runs=[run.info() for run in registry.runs()]))

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
        created_run, created = registry.create(run, _parse_config(config))
        return JSONModelResponse(created_run.info(), status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @router.get(
        "/{run}",
        openapi_extra=access.reads,
        response_model=RunInfo,
        responses=documented(*access.read_errors, 404),
    )
    def get_run(run: RunName) -> Response:
        return JSONModelResponse(registry.get(run).info())

    @router.delete(
        "/{run}",
        openapi_extra=access.writes,
        status_code=status.HTTP_204_NO_CONTENT,
        response_class=Response,
        responses=documented(401, 404),
    )
    def delete_run(run: RunName) -> Response:
        """Delete a run: its exporters flush and close, and its series leave ``/metrics``."""
        registry.delete(run)
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    return router
