"""Migration of configs, dashboards, rules, W&B panels and histories across the rename (SPEC 7).

One module per file kind (``configs``, ``grafana``, ``wandb``, ``prometheus_rules``, ``history``,
``text``) on top of shared pieces: ``names`` finds legacy names in a string, ``tree`` with
``json_syntax``/``yaml_syntax`` edit values in place, ``structured`` runs a file-kind policy over a
parsed document, and ``driver`` picks the kind, diffs and writes atomically.
"""

from __future__ import annotations

from .driver import (
    detect_kind,
    iter_files,
    migrate_file,
    migrate_text,
    unified_diff,
    write_atomically,
)
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
