"""How the service answers: models written to JSON in one call, and the error bodies
(``{"detail": "..."}``, or :class:`.ValidationErrorBody` where a field is at fault)."""

from __future__ import annotations

from typing import Any

from fastapi import Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from .errors import RecordsInvalid, RunError
from .models import ErrorItem, ErrorMessage, ValidationErrorBody

__all__ = ["ERRORS", "EXCEPTION_HANDLERS", "JSONModelResponse", "documented"]

ERRORS: dict[int, str] = {
    400: "The body could not be read (not UTF-8 JSON).",
    401: "Missing or wrong bearer token.",
    404: "No such run (create it with PUT /v1/runs/{run}).",
    409: "Conflicts with the run's state.",
    413: "Request body larger than the service accepts.",
}


def documented(*codes: int, invalid: bool = True) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route answering ``codes`` (and 422 when ``invalid``)."""
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
    """A response model written to JSON by pydantic in one call (a returned model would be
    validated again, turned into dicts and encoded by the standard library). Routes declare
    ``response_model`` for the OpenAPI document."""

    media_type = "application/json"

    def __init__(self, model: BaseModel, status_code: int = status.HTTP_200_OK) -> None:
        super().__init__(model.__pydantic_serializer__.to_json(model), status_code=status_code)


def _printable(text: str) -> str:
    """``text`` with lone surrogates escaped, so an answer naming a bad string can be encoded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _invalid(items: list[ErrorItem], status_code: int = RecordsInvalid.status) -> JSONResponse:
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
    return JSONResponse(ValidationErrorBody(detail=printable).model_dump(), status_code=status_code)


async def _run_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RunError)
    if isinstance(exc, RecordsInvalid):  # the 422 shape (a span-row cap's 413 too): field and reason
        return _invalid(exc.errors, exc.status)
    return JSONResponse({"detail": _printable(str(exc))}, status_code=exc.status)


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _invalid(
        [
            ErrorItem(
                field=".".join(str(part) for part in error.get("loc", ())),
                reason=str(error.get("msg", "")),
            )
            for error in exc.errors()
        ]
    )


async def _too_deep(request: Request, exc: Exception) -> JSONResponse:
    # a body nested past the JSON reader's recursion limit is unreadable, on every route
    return JSONResponse({"detail": "the body is nested too deeply to read"}, status_code=status.HTTP_400_BAD_REQUEST)


# The application's exception handlers (``FastAPI(exception_handlers=...)``).
EXCEPTION_HANDLERS: dict[Any, Any] = {
    RunError: _run_error,
    RequestValidationError: _invalid_request,
    RecursionError: _too_deep,
}
