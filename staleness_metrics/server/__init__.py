"""The sidecar service (``staleness-metrics serve``): one sink per run behind an HTTP API.

Needs the ``server`` extra (FastAPI, uvicorn, prometheus-client). See ``docs/service.md``.
"""

from __future__ import annotations

from .app import ServerSettings, create_app
from .registry import ExportSettings, RunRegistry

__all__ = ["ExportSettings", "RunRegistry", "ServerSettings", "create_app"]
