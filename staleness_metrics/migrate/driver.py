"""Find the files, tell their kind, run the right migration, show diffs and write atomically."""

from __future__ import annotations

import difflib
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from .configs import CONFIG_KINDS, ConfigFormat, load_config, migrate_config
from .history import looks_like_history, migrate_history
from .model import Action, FileKind, FileResult, Finding, Options
from .names import Context, Scanner, scanner_for
from .structured import POLICIES, migrate_structured
from .tree import JSON, YAML_SYNTAX

_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules"})
_CONFIG_FORMATS = {kind: fmt for fmt, kind in CONFIG_KINDS.items()}


def iter_files(paths: Iterable[str]) -> Iterator[tuple[Path, bool]]:
    """Each file to look at, and whether it was named on the command line (directories are walked,
    hidden directories and caches skipped, symlinked directories not followed)."""
    for name in paths:
        path = Path(name)
        if not path.is_dir():
            yield path, True
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS)
            for file_name in sorted(files):
                yield Path(root) / file_name, False


def detect_kind(path: Path, text: str) -> FileKind:
    suffix = path.suffix.lower()
    if suffix == ".toml":
        return FileKind.TOML_CONFIG
    if suffix in (".jsonl", ".ndjson"):
        return FileKind.HISTORY if looks_like_history(text) else FileKind.TEXT
    if suffix not in (".json", ".yaml", ".yml"):
        return FileKind.TEXT
    fmt: ConfigFormat = "json" if suffix == ".json" else "yaml"
    try:
        data = load_config(text, fmt)
    except ValueError:
        return CONFIG_KINDS[fmt]  # reported as unparseable
    documents = data if fmt == "yaml" else [data]
    policy = next((p for p in POLICIES if any(p.looks_like(d) for d in documents)), None)
    return CONFIG_KINDS[fmt] if policy is None else policy.kind


def migrate_text(path: Path, text: str, kind: FileKind, options: Options) -> FileResult:
    """Migrate the contents of one file (nothing is written)."""
    shown = str(path)
    config_scanner = scanner_for(options, prometheus=False)
    prometheus_scanner = scanner_for(options, prometheus=True)
    if kind in _CONFIG_FORMATS:
        return migrate_config(shown, text, _CONFIG_FORMATS[kind], config_scanner)
    for policy in POLICIES:
        if policy.kind is kind:
            syntax = JSON if path.suffix.lower() == ".json" else YAML_SYNTAX
            scanner = prometheus_scanner if policy.prometheus else config_scanner
            return migrate_structured(shown, text, syntax, policy, scanner, options)
    if kind is FileKind.HISTORY:
        return migrate_history(shown, text, options)
    return scan_text(shown, text, prometheus_scanner)


def migrate_file(path: Path, options: Options, *, kind: FileKind | None = None, explicit: bool = True) -> FileResult:
    """Read one file and migrate it in memory; ``kind`` None detects it."""
    shown = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return FileResult(shown, kind, error=f"cannot read: {exc.strerror or exc}")
    try:
        unreadable = "binary file" if b"\0" in raw[:8192] else None
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        unreadable = unreadable or "not UTF-8 text; not read"
    if unreadable is not None:
        if explicit:
            return FileResult(shown, kind, error=unreadable)
        return FileResult(shown, kind, skipped=unreadable)
    if text.startswith("\ufeff") and kind is not FileKind.TEXT:
        return FileResult(shown, kind, error="starts with a byte-order mark; remove it, then run again")
    result = migrate_text(path, text, kind or detect_kind(path, text), options)
    if result.error is not None:
        # never edited: still say where the legacy names are
        reason = "the file could not be migrated: edit by hand"
        scanner = scanner_for(options, prometheus=True)
        result.findings = scan_text(shown, text, scanner, reason=reason).findings
        result.new_text = None
    return result


IGNORE_PRAGMA = "staleness-migrate: ignore"


def scan_text(
    path: str,
    text: str,
    scanner: Scanner,
    *,
    reason: str = "this kind of file is only reported: edit by hand",
) -> FileResult:
    """Any other text file: legacy names reported with line numbers, never edited (a line holding
    ``staleness-migrate: ignore`` is skipped)."""
    result = FileResult(path, FileKind.TEXT, original=text)
    for number, line in enumerate(text.split("\n"), start=1):  # editors count "\n" only
        if IGNORE_PRAGMA in line:
            continue
        for hit in scanner.scan(line, Context.TEXT).hits:
            detail = reason if hit.action is Action.RENAME else f"{hit.reason}; {reason}"
            result.findings.append(Finding(path, number, hit.old, hit.new, Action.MANUAL, detail))
    return result


def unified_diff(result: FileResult) -> str:
    if not result.changed or result.original is None or result.new_text is None:
        return ""
    lines = difflib.unified_diff(
        result.original.splitlines(keepends=True),
        result.new_text.splitlines(keepends=True),
        fromfile=f"a/{result.path}",
        tofile=f"b/{result.path}",
    )
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def write_atomically(path: Path, original: str, new_text: str) -> None:
    """Replace the file's contents in one step (temp file beside it, then ``os.replace``).

    The file must still hold ``original``: a file changed since it was read is not overwritten.
    Symlinks are followed (the target is replaced, the link stays) and the permission bits are kept.
    """
    target = Path(os.path.realpath(path))
    if target.read_bytes() != original.encode("utf-8"):
        raise OSError(f"{path} changed while it was being migrated; run again")
    mode = stat.S_IMODE(target.stat().st_mode)
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(new_text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp_name, mode)
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
