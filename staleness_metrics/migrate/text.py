"""Any other text file: legacy names reported with line numbers, never edited (a line holding
``staleness-migrate: ignore`` is skipped)."""

from __future__ import annotations

from .model import Action, FileKind, FileResult, Finding
from .names import Context, Scanner

__all__ = ["IGNORE_PRAGMA", "scan_text"]

IGNORE_PRAGMA = "staleness-migrate: ignore"


def scan_text(
    path: str,
    text: str,
    scanner: Scanner,
    *,
    reason: str = "this kind of file is only reported: edit by hand",
) -> FileResult:
    result = FileResult(path, FileKind.TEXT, original=text)
    for number, line in enumerate(text.split("\n"), start=1):  # editors count "\n" only
        if IGNORE_PRAGMA in line:
            continue
        for hit in scanner.scan(line, Context.TEXT).hits:
            detail = reason if hit.action is Action.RENAME else f"{hit.reason}; {reason}"
            result.findings.append(Finding(path, number, hit.old, hit.new, Action.MANUAL, detail))
    return result
