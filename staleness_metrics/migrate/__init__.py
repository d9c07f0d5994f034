"""Migration of configs, dashboards, rules, W&B panels and histories across the rename (SPEC 7;
docs/migrate.md)."""

from __future__ import annotations

from .driver import detect_kind, iter_files, migrate_file, migrate_text, unified_diff, write_atomically
from .model import Action, FileKind, FileResult, Finding, Options

__all__ = [
    "Action",
    "FileKind",
    "FileResult",
    "Finding",
    "Options",
    "detect_kind",
    "iter_files",
    "migrate_file",
    "migrate_text",
    "unified_diff",
    "write_atomically",
]
