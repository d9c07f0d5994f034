"""``/v1/runs/{run}/mismatch``: what staleness cost a shipped step, as the trainer
measured it (SPEC 11)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Response

from ..models import MismatchRequest, MismatchResult
from ..registry import RunRegistry
from ..responses import JSONModelResponse, documented
from .access import Access, RunName

__all__ = ["mismatch_router"]


def mismatch_router(registry: RunRegistry, access: Access) -> APIRouter:
    router = APIRouter(prefix="/v1/runs/{run}", tags=["metrics"])

    @router.post(
        "/mismatch",
        openapi_extra=access.writes,
        response_model=MismatchResult,
        responses=documented(400, 401, 404, 413),
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

        Post one `MismatchSums.to_dict()` per rank or micro-batch: posts for one step merge. Invalid
        sums (a missing bucket, a negative count) or a step the run never shipped get 422 naming the
        field, and nothing is recorded.
        """
        return JSONModelResponse(registry.get(run).record_mismatch(request, idempotency_key))

    return router
