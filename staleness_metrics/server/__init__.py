"""The sidecar service (``staleness-metrics serve``): one sink per run behind an HTTP API.

Needs the ``server`` extra (FastAPI, uvicorn, prometheus-client). See ``docs/service.md``.
"""

from __future__ import annotations

from ..exporters.base import MissingExtra

try:
    from .app import ServerSettings, create_app
    from .registry import ExportSettings, RunRegistry
except ModuleNotFoundError as exc:  # (fastapi, uvicorn, pydantic...)
    raise MissingExtra("The service", exc.name, "server") from exc

__all__ = ["ExportSettings", "RunRegistry", "ServerSettings", "create_app"]
