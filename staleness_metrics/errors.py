"""Errors that name what was wrong: the rollout, the field and the reason, as attributes
(``.field``, ``.reason``, ``.rollout``) a caller reads rather than parsing the message."""

from __future__ import annotations

MAX_REASON_CHARS = 300  # a reason quoting a huge or deeply nested value shows its start


def shortened(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class StalenessError(Exception):
    """Base class of every error this package raises on purpose: ``field`` (a setting, a record
    field such as ``samples[0].mask[3]``; None for the whole input), ``reason``, ``rollout``."""

    field: str | None = None
    reason: str = ""
    rollout: str | None = None


class ConfigError(StalenessError, ValueError):
    """An invalid setting: ``ConfigError("<setting>: <reason>")`` sets ``field`` and ``reason``
    from the message, unless they are given (``ConfigError("...", field=..., reason=...)``)."""

    def __init__(self, message: str, *, field: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        if field is None:
            name, sep, rest = message.partition(": ")
            if sep and name and " " not in name:
                field, reason = name, rest
        self.field = field
        self.reason = reason if reason is not None else message


class _NamedField(StalenessError):
    """An error built from the field, the reason and the rollout: ``"<field>: <reason>"``."""

    def __init__(self, field: str | None, reason: str, *, rollout: str | None = None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason
        self.rollout = rollout


class FieldError(_NamedField, ValueError):
    """A refused value, neither a setting nor a record (an array of the wrong shape or dtype, a
    step, SPEC 11 sums): ``"<field>: <reason>"``; ``rollout`` names the rollout at fault, if any."""


class FieldTypeError(_NamedField, TypeError):
    """An argument of the wrong type (a ``TypeError``): ``field`` names the argument."""


class MissingFieldError(_NamedField, KeyError):
    """A key a trainer's batch or a call's mapping lacks (a ``KeyError``): ``field`` names the key,
    and the message reads as the other errors' (a plain ``KeyError`` quotes it)."""

    def __str__(self) -> str:
        return Exception.__str__(self)


class TraceError(StalenessError, ValueError):
    """An invalid rollout record (SPEC 3); a ``reason`` longer than :data:`MAX_REASON_CHARS` is cut
    there (the field names where the value is)."""

    field: str

    def __init__(self, rollout_id: str | None, field: str, reason: str) -> None:
        reason = shortened(reason)
        self.rollout_id = self.rollout = rollout_id
        self.field = field
        self.reason = reason
        super().__init__(f"rollout {shortened(repr(rollout_id), 120)}: field {field}: {reason}")


class EventError(StalenessError, ValueError):
    """A bad replay event line (bad JSON or type, a step going back); ``field`` is ``line <n>``."""

    def __init__(self, line: int, reason: str) -> None:
        self.line = line
        self.field = f"line {line}"
        self.reason = reason
        super().__init__(f"line {line}: {reason}")
