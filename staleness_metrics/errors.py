"""Errors that name what was wrong: the rollout, the field and the reason."""

from __future__ import annotations

__all__ = ["ConfigError", "EventError", "StalenessError", "TraceError"]


class StalenessError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(StalenessError, ValueError):
    """An invalid setting."""


class TraceError(StalenessError, ValueError):
    """An invalid rollout record (SPEC 3)."""

    def __init__(self, rollout_id: str | None, field: str, reason: str) -> None:
        self.rollout_id = rollout_id
        self.field = field
        self.reason = reason
        super().__init__(f"rollout {rollout_id!r}: field {field}: {reason}")


class EventError(StalenessError, ValueError):
    """A malformed event line in a replay stream (bad JSON, unknown type, a step going back)."""

    def __init__(self, line: int, reason: str) -> None:
        self.line = line
        self.reason = reason
        super().__init__(f"line {line}: {reason}")
