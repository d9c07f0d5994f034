"""What the migration found in a file and what it would do about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .legacy import DEFAULT_PROMETHEUS_PREFIXES


class MissingParser(ValueError):
    """The parser of a file format is an optional dependency that is not installed."""

    def __init__(self, format_name: str, package: str) -> None:
        super().__init__(f"reading {format_name} needs {package}: pip install 'staleness-metrics[cli]'")


class FileKind(str, enum.Enum):
    """How a file is read; ``auto`` detection picks one per file."""

    TOML_CONFIG = "toml-config"
    YAML_CONFIG = "yaml-config"
    JSON_CONFIG = "json-config"
    GRAFANA = "grafana"
    WANDB = "wandb"
    PROMETHEUS_RULES = "prometheus-rules"
    HISTORY = "history"
    TEXT = "text"


@dataclass(frozen=True)
class Options:
    """How to migrate (``peer``: whose keys to map instead of this project's legacy ones)."""

    drop_removed: bool = False
    prometheus_prefixes: tuple[str, ...] = DEFAULT_PROMETHEUS_PREFIXES
    peer: str | None = None


class Action(str, enum.Enum):
    """What happens to a legacy name: renamed, deleted, left as a removed metric, or reported."""

    RENAME = "rename"
    DROP = "drop"
    REMOVED = "removed"
    MANUAL = "manual"


_OUTCOMES = {Action.DROP: ": deleted", Action.REMOVED: ": removed", Action.MANUAL: ": not edited"}


@dataclass(frozen=True)
class Finding:
    """One legacy name at one place (or, in a metrics history, one key over a range of lines)."""

    path: str
    line: int
    old: str
    new: str | None
    action: Action
    reason: str = ""
    last_line: int | None = None  # history: the last line carrying the key
    count: int = 1  # history: how many lines carry the key

    @property
    def fixed_by_write(self) -> bool:
        return self.action in (Action.RENAME, Action.DROP)

    def describe(self) -> str:
        where = f"{self.path}:{self.line}"
        if self.last_line is not None and self.last_line != self.line:
            where += f"-{self.last_line}"
        arrow = self.new is not None and self.action in (Action.RENAME, Action.MANUAL)
        name = f"{self.old} -> {self.new}" if arrow else self.old
        text = f"{where}: {name}{_OUTCOMES.get(self.action, '')}"
        details = [d for d in (self.reason, f"{self.count} lines" if self.count > 1 else "") if d]
        return text + (f" ({'; '.join(details)})" if details else "")


@dataclass
class FileResult:
    """The outcome for one file: its findings, and the new text when the migration changes it."""

    path: str
    kind: FileKind | None
    original: str | None = None
    new_text: str | None = None  # None: nothing to change, or the file is not edited
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None  # not read, parsed or safely edited: the file is never touched then
    skipped: str | None = None  # left out for a harmless reason (a binary file in a directory)
    notes: list[str] = field(default_factory=list)  # what else it did (a history boundary line)

    @property
    def changed(self) -> bool:
        return self.new_text is not None and self.new_text != self.original
