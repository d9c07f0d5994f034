"""The service's routes, one :class:`fastapi.APIRouter` per resource, each made
for one registry of runs.

- :func:`service_router`: ``/healthz`` and ``/metrics``;
- :func:`runs_router`: ``/v1/runs`` and ``/v1/runs/{run}`` (create, read, delete);
- :func:`rollouts_router`: ``/rollouts``, ``/sweep`` and ``/ship`` of a run (the hot path);
- :func:`mismatch_router`: ``/mismatch`` of a run (trainer-side SPEC 11 sums);
- :func:`history_router`: ``/steps`` and ``/events`` of a run.

Handlers are plain functions where they may wait (FastAPI runs them on its thread pool; each run
serializes its own calls, see :mod:`..runs`); adds and ships go through :func:`.rollouts.on_run`.
"""

from __future__ import annotations

from .access import Access
from .history import history_router
from .mismatch import mismatch_router
from .rollouts import rollouts_router
from .runs import runs_router
from .service import service_router

__all__ = [
    "Access",
    "history_router",
    "mismatch_router",
    "rollouts_router",
    "runs_router",
    "service_router",
]
