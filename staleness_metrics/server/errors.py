"""The service's errors, one :class:`RunError` subclass per status code, and the library's
errors as the items of an answer (their ``field`` and ``reason``, never parsed from a message)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import StalenessError, TraceError
from .models import ErrorItem

INT64_RANGE = (-(2**63), 2**63 - 1)


class RunError(Exception):
    """A request the run cannot honour, answered with ``status``."""

    status = 409


class RunNotFound(RunError):
    status = 404


class RunConflict(RunError):
    """Conflicts with the run's state (another configuration, a step below the latest, ...)."""


class RunBroken(RunError):
    """A write could not be persisted: the run's memory is ahead of its store."""

    status = 503


class RestoreFailed(Exception):
    """A stored run could not be loaded again (the message names the run and the row)."""


def reason_of(exc: BaseException) -> str:
    """How a restore failure names its cause: a deliberate error's message, else the type too."""
    if isinstance(exc, RunError | TraceError | ValueError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class RecordsInvalid(RunError):
    """Invalid records or ship-time versions; nothing of the request was applied."""

    status = 422

    def __init__(self, errors: list[ErrorItem]) -> None:
        super().__init__("; ".join(f"{e.rollout_id!r}: {e.field}: {e.reason}" for e in errors))
        self.errors = errors


class SpanRowsTooMany(RecordsInvalid):
    """More span rows than the body's size allows: 413, in the shape of an invalid request."""

    status = 413


def trace_item(error: TraceError, index: int | None = None) -> ErrorItem:
    return ErrorItem(field=error.field, reason=error.reason, rollout_id=error.rollout_id, index=index)


def out_of_range(value: Any, path: str) -> str | None:
    """Path of the first integer in ``value`` outside int64 (the sink's width), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return path if not INT64_RANGE[0] <= value <= INT64_RANGE[1] else None
    if isinstance(value, Mapping):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    found = (out_of_range(item, where) for where, item in items)
    return next((path for path in found if path is not None), None)


def field_item(error: ValueError, default_field: str) -> ErrorItem:
    """The library's error as an item (``default_field`` and the message when it names no field)."""
    if isinstance(error, StalenessError) and error.field:
        return ErrorItem(field=error.field, reason=error.reason)
    return ErrorItem(field=default_field, reason=str(error))
