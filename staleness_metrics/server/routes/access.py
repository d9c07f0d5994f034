"""What every run route shares: the run's name in the path, and which routes the OpenAPI document
shows as needing the token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Path

from ..models import RUN_NAME_PATTERN
from ..settings import ServerSettings

__all__ = ["Access", "RunName"]

RunName = Annotated[
    str,
    Path(pattern=RUN_NAME_PATTERN, description="The run's name (its `run` label).", examples=["demo"]),
]


@dataclass(frozen=True)
class Access:
    """The OpenAPI ``security`` of writes and of reads, and the error codes a read may answer.

    Only the document: :class:`..security.TokenFirst` checks the token before routing, so a
    per-route dependency would merely check it again on every request."""

    writes: dict[str, Any]
    reads: dict[str, Any]
    read_errors: tuple[int, ...]

    @classmethod
    def of(cls, settings: ServerSettings) -> Access:
        writes: dict[str, Any] = {"security": [{"HTTPBearer": []}]}
        if settings.protect_reads:
            return cls(writes, writes, (401,))
        return cls(writes, {}, ())
