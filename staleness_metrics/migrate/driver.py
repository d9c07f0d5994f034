"""Find the files, tell their kind, migrate them (configs here, the other kinds in their own
modules), show diffs and write atomically."""

from __future__ import annotations

import difflib
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from .history import looks_like_history, migrate_history
from .model import Action, FileKind, FileResult, Finding, MissingParser, Options
from .names import Context, Scanner, scanner_for
from .structured import POLICIES, migrate_structured
from .tree import JSON, YAML_SYNTAX, line_of

ConfigFormat = Literal["toml", "yaml", "json"]

_CONFIG_FORMATS: dict[FileKind, ConfigFormat] = {
    FileKind.TOML_CONFIG: "toml",
    FileKind.YAML_CONFIG: "yaml",
    FileKind.JSON_CONFIG: "json",
}
_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules"})
IGNORE_PRAGMA = "staleness-migrate: ignore"


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
    config = FileKind.JSON_CONFIG if suffix == ".json" else FileKind.YAML_CONFIG
    try:
        data = load_config(text, _CONFIG_FORMATS[config])
    except ValueError:
        return config  # reported as unparseable
    documents = [data] if config is FileKind.JSON_CONFIG else data
    policy = next((p for p in POLICIES if any(p.looks_like(d) for d in documents)), None)
    return config if policy is None else policy.kind


def migrate_text(path: Path, text: str, kind: FileKind, options: Options) -> FileResult:
    """Migrate the contents of one file (nothing is written)."""
    shown = str(path)
    config_scanner = scanner_for(options, prometheus=False)
    prometheus_scanner = scanner_for(options, prometheus=True)
    if kind in _CONFIG_FORMATS:
        return _migrate_config(shown, text, kind, config_scanner)
    for policy in POLICIES:
        if policy.kind is kind:
            syntax = JSON if path.suffix.lower() == ".json" else YAML_SYNTAX
            scanner = prometheus_scanner if policy.prometheus else config_scanner
            return migrate_structured(shown, text, syntax, policy, scanner, options)
    if kind is FileKind.HISTORY:
        return migrate_history(shown, text, options)
    return scan_text(shown, text, prometheus_scanner)


def load_config(text: str, fmt: ConfigFormat) -> Any:
    """Plain data of a config file (raises ``ValueError`` with the parser's message)."""
    try:
        if fmt == "toml":
            import tomlkit  # optional dependency (the cli extra)

            return tomlkit.parse(text).unwrap()
        return YAML_SYNTAX.load(text) if fmt == "yaml" else json.loads(text)
    except ImportError as exc:
        raise MissingParser("TOML", "tomlkit") from exc
    except ValueError:
        raise
    except Exception as exc:  # tomlkit and ruamel raise their own error classes
        raise ValueError(str(exc)) from exc


class _Collision(Exception):
    pass


def _renamed(data: Any, scanner: Scanner) -> Any:
    """``data`` with the names in every key and string replaced, as the edit should leave it."""
    if isinstance(data, dict):
        out: dict[Any, Any] = {}
        for key, value in data.items():
            new_key = scanner.scan(key, Context.TEXT).text if isinstance(key, str) else key
            if new_key in out or (new_key != key and new_key in data):
                raise _Collision(f"both {key!r} and {new_key!r} are set; keep one of them, then run again")
            out[new_key] = _renamed(value, scanner)
        return out
    if isinstance(data, list):
        return [_renamed(item, scanner) for item in data]
    if isinstance(data, str):
        return scanner.scan(data, Context.TEXT).text
    return data


def _migrate_config(path: str, text: str, kind: FileKind, scanner: Scanner) -> FileResult:
    """A config edited as text, each legacy name replaced where it stands as a whole name so that
    every other byte stays; kept only if it parses to the old data with those names replaced."""
    fmt = _CONFIG_FORMATS[kind]
    result = FileResult(path, kind, original=text)
    try:
        old_data = load_config(text, fmt)
    except MissingParser as exc:
        result.error = str(exc)
        return result
    except ValueError as exc:
        result.error = f"cannot parse as {fmt.upper()}: {exc}"
        return result
    scanned = scanner.scan(text, Context.TEXT)
    for hit in scanned.hits:
        removed = hit.action is Action.REMOVED
        reason = hit.reason + ("; delete it from the config by hand" if removed else "")
        line = line_of(text, hit.start)
        result.findings.append(Finding(path, line, hit.old, hit.new, hit.action, reason))
    if not scanned.changed:
        return result
    try:
        expected = _renamed(old_data, scanner)
    except _Collision as exc:
        result.findings = [
            replace(f, action=Action.MANUAL, reason=str(exc)) if f.action is Action.RENAME else f
            for f in result.findings
        ]
        return result
    try:
        new_data = load_config(scanned.text, fmt)
    except ValueError as exc:
        result.error = f"refusing to edit: the renamed text does not parse ({exc})"
        return result
    if new_data != expected:
        result.error = "refusing to edit: renaming in place would change more than the names (escaped text?)"
        return result
    result.new_text = scanned.text
    return result


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
