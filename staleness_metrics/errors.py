"""Errors that name what was wrong: the rollout, the field and the reason."""

from __future__ import annotations

__all__ = ["MAX_REASON_CHARS", "ConfigError", "EventError", "StalenessError", "TraceError", "shortened"]


class StalenessError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(StalenessError, ValueError):
    """An invalid setting."""


MAX_REASON_CHARS = 300  # a reason quoting a huge or deeply nested value shows its start


def shortened(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class TraceError(StalenessError, ValueError):
    """An invalid rollout record (SPEC 3). A ``reason`` longer than :data:`MAX_REASON_CHARS` (one quoting
    the whole of a huge value) is cut there: the field names where the value is."""

    def __init__(self, rollout_id: str | None, field: str, reason: str) -> None:
        reason = shortened(reason)
        self.rollout_id = rollout_id
        self.field = field
        self.reason = reason
        super().__init__(f"rollout {shortened(repr(rollout_id), 120)}: field {field}: {reason}")


class EventError(StalenessError, ValueError):
    """A malformed event line in a replay stream (bad JSON, unknown type, a step going back)."""

    def __init__(self, line: int, reason: str) -> None:
        self.line = line
        self.reason = reason
        super().__init__(f"line {line}: {reason}")
