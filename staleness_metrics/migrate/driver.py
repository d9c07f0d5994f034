"""Find the files, tell their kind, migrate them (configs and metrics histories here, structured
documents in :mod:`.structured`), show diffs and write atomically."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from ..files import atomic_output
from ..metrics.metric_table import LegacyKey
from .legacy import in_legacy_namespace, migrate_key
from .model import Action, FileKind, FileResult, Finding, MissingParser, Options
from .names import UNMAPPED, Context, Scanner, peer_lookup, scanner_for
from .structured import POLICIES, migrate_structured
from .tree import JSON, YAML_SYNTAX, Edit, Mapping, apply_edits, json_loads, line_of

ConfigFormat = Literal["toml", "yaml", "json"]

_CONFIG_FORMATS: dict[FileKind, ConfigFormat] = {
    FileKind.TOML_CONFIG: "toml",
    FileKind.YAML_CONFIG: "yaml",
    FileKind.JSON_CONFIG: "json",
}
_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules"})
IGNORE_PRAGMA = "staleness-migrate: ignore"
MARKER_KEY = "migrate/legacy_through_step"
_LINES = re.compile(r"[^\n]*\n|[^\n]+\Z")  # as patch splits (str.splitlines splits on U+2028 too)
_Seen = list[tuple[str, str | None, Action, str]]  # a history line: key, new key, action, reason


def iter_files(paths: Iterable[str]) -> Iterator[tuple[Path, bool]]:
    """Each file to look at, and whether it was named on the command line."""
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
    if suffix in (".jsonl", ".ndjson"):
        return FileKind.HISTORY if looks_like_history(text) else FileKind.TEXT
    if suffix not in (".json", ".yaml", ".yml"):
        return FileKind.TOML_CONFIG if suffix == ".toml" else FileKind.TEXT
    config = FileKind.JSON_CONFIG if suffix == ".json" else FileKind.YAML_CONFIG
    try:
        data = load_config(text, _CONFIG_FORMATS[config])
    except ValueError:
        return config  # reported as unparseable
    documents = [data] if config is FileKind.JSON_CONFIG else data
    return next((p.kind for p in POLICIES if any(p.looks_like(d) for d in documents)), config)


def migrate_text(path: Path, text: str, kind: FileKind, options: Options) -> FileResult:
    """Migrate the contents of one file (nothing is written)."""
    shown = str(path)
    policy = next((p for p in POLICIES if p.kind is kind), None)
    # old series names are legacy names in configs (Helm values holding rules) and plain text too
    scanner = scanner_for(options, prometheus=policy is None or policy.prometheus)
    if kind in _CONFIG_FORMATS:
        return _migrate_config(shown, text, kind, scanner)
    if policy is not None:
        syntax = JSON if path.suffix.lower() == ".json" else YAML_SYNTAX
        return migrate_structured(shown, text, syntax, policy, scanner, options)
    if kind is FileKind.HISTORY:
        return migrate_history(shown, text, options)
    return scan_text(shown, text, scanner, "this kind of file is only reported: edit by hand")


def load_config(text: str, fmt: ConfigFormat) -> Any:
    try:
        if fmt == "toml":
            import tomlkit  # optional dependency (the cli extra)

            return tomlkit.parse(text).unwrap()
        return YAML_SYNTAX.load(text) if fmt == "yaml" else json_loads(text)
    except ImportError as exc:
        raise MissingParser("TOML", "tomlkit") from exc
    except ValueError:
        raise
    except Exception as exc:  # tomlkit and ruamel raise their own error classes
        raise ValueError(str(exc)) from exc


class _Refused(Exception):
    """A config or history line the migration will not edit, and why."""


def _renamed(data: Any, scanner: Scanner) -> Any:
    if isinstance(data, dict):
        out: dict[Any, Any] = {}
        for key, value in data.items():
            new_key = scanner.scan(key, Context.TEXT).text if isinstance(key, str) else key
            if new_key in out or (new_key != key and new_key in data):
                raise _Refused(f"both {key!r} and {new_key!r} are set; keep one of them, then run again")
            out[new_key] = _renamed(value, scanner)
        return out
    if isinstance(data, list):
        return [_renamed(item, scanner) for item in data]
    return scanner.scan(data, Context.TEXT).text if isinstance(data, str) else data


def _migrate_config(path: str, text: str, kind: FileKind, scanner: Scanner) -> FileResult:
    """A config renamed as text, kept only if it parses to the old data with the names replaced."""
    fmt = _CONFIG_FORMATS[kind]
    result = FileResult(path, kind, original=text)
    try:
        old_data = load_config(text, fmt)
    except ValueError as exc:  # a MissingParser names the package to install
        missing = isinstance(exc, MissingParser)
        result.error = str(exc) if missing else f"cannot parse as {fmt.upper()}: {exc}"
        return result
    scanned = scanner.scan(text, Context.TEXT)
    for hit in scanned.hits:
        note = "; delete it from the config by hand" if hit.action is Action.REMOVED else ""
        line, reason = line_of(text, hit.start), hit.reason + note
        result.findings.append(Finding(path, line, hit.old, hit.new, hit.action, reason))
    if not scanned.changed:
        return result
    try:
        expected = _renamed(old_data, scanner)
        try:
            new_data = load_config(scanned.text, fmt)
        except ValueError as exc:
            raise _Refused(f"the renamed text does not parse ({exc})") from None
        if new_data != expected:
            raise _Refused("renaming in place would change more than the names (escaped text?)")
    except _Refused as exc:  # not safely edited: an error (exit 2)
        result.error = f"refusing to edit: {exc}"
        return result
    result.new_text = scanned.text
    return result


def looks_like_history(text: str) -> bool:
    """The first non-blank line is a JSON object with a ``step`` (event streams have a ``type``)."""
    line = next((line for line in text.split("\n") if line.strip()), "null")
    try:
        first = json.loads(line)
    except ValueError:
        return False
    return isinstance(first, dict) and "step" in first and "type" not in first


def migrate_history(path: str, text: str, options: Options) -> FileResult:
    """A metrics history, keys renamed in place and a boundary line after the last legacy one."""
    result = FileResult(path, FileKind.HISTORY, original=text)
    found: dict[tuple[str, Action], Finding] = {}  # one per key and action, over its lines
    out: list[str] = []
    boundary: tuple[int, int, object] | None = None  # (where in ``out`` it goes, line number, step)
    legacy = False
    newline = "\r\n" if "\r\n" in text else "\n"
    for number, line in enumerate(_LINES.findall(text), start=1):
        body = line.rstrip("\r\n")
        if not body.strip():
            out.append(line)
            continue
        seen: _Seen = []
        try:
            new_body, had_legacy, is_marker, step = _migrate_line(body, options, seen)
        except _Refused as exc:
            result.error = f"line {number}: {exc}"
            return result
        for old, new, action, reason in seen:
            known = found.get((old, action)) or Finding(path, number, old, new, action, reason, count=0)
            found[old, action] = replace(known, last_line=number, count=known.count + 1)
        if is_marker:  # an earlier run's boundary: the new one goes there, or after later legacy
            boundary = (len(out), number - 1, step)
            continue
        legacy |= had_legacy
        out.append(new_body + line[len(body) :])
        boundary = (len(out), number, step) if had_legacy else boundary
    result.findings = sorted(found.values(), key=lambda f: (f.line, f.old))
    if not legacy or boundary is None:
        return result  # nothing legacy: the file (and any earlier boundary line) stays as it is
    at, number, step = boundary
    if not out[at - 1].endswith(("\n", "\r")):
        out[at - 1] += newline
    marker = json.dumps({"step": step, MARKER_KEY: step})
    out.insert(at, marker + (newline if at < len(out) or text.endswith("\n") else ""))
    result.notes.append(f"boundary line after line {number} (step {step}): old definitions up to there")
    result.new_text = "".join(out)
    return result


def _migrate_line(body: str, options: Options, found: _Seen) -> tuple[str, bool, bool, object]:
    try:
        [node], [data] = JSON.read(body)
    except ValueError as exc:
        raise _Refused(f"not a JSON object: {exc}") from exc
    if not isinstance(node, Mapping) or not isinstance(data, dict):
        raise _Refused("not a JSON object")
    keys = {key.value for key, _ in node.items}
    edits: list[Edit] = []
    doomed: list[int] = []
    taken: set[str] = set()
    had_legacy = False
    expected: dict[object, object] = {}
    for index, (key, _value) in enumerate(node.items):
        name = str(key.value)
        expected[name] = data[name]  # kept, unless renamed or dropped below
        if options.peer:
            row = peer_lookup(options.peer, name)
            if row is not None and row.new is None:
                # a peer key whose meaning differs: reported, kept (it is data), never renamed or
                # dropped; it sets no boundary line, since nothing on the line changes meaning
                reason = f"{row.peer}: {row.reason} [{row.source}]"
                found.append((name, None, Action.MANUAL, reason))
                continue
            legacy = None if row is None else LegacyKey(name, row.new, f"{row.peer}: {row.reason}")
        else:
            legacy = migrate_key(name)
        if legacy is None:
            if not options.peer and in_legacy_namespace(name):
                had_legacy = True
                found.append((name, None, Action.MANUAL, UNMAPPED))
            continue
        had_legacy |= not options.peer  # a peer's line counts only once a key on it is edited
        new, reason = legacy.new, legacy.reason
        if new is None or new in keys or new in taken:
            if new is None and options.drop_removed:  # (a renamed one's value is data: kept)
                doomed.append(index)
                found.append((name, None, Action.DROP, reason))
                del expected[name]
            elif new is None:
                found.append((name, None, Action.REMOVED, f"{reason}; --drop-removed deletes it"))
            else:
                found.append((name, new, Action.MANUAL, f"{new} is already on the line"))
            continue
        taken.add(new)
        edits.append(Edit(key.start, key.end, JSON.render(body, key, new, {name: new})))
        expected[new] = expected.pop(name)
        found.append((name, new, Action.RENAME, reason or "renamed"))
    if doomed:
        edits.extend(JSON.remove(body, node, doomed))
    new_body = apply_edits(body, edits) if edits else body
    if edits and json_loads(new_body) != expected:
        raise _Refused("the edited line does not read back as intended")
    return new_body, had_legacy or bool(edits), MARKER_KEY in data, data.get("step")


def migrate_file(path: Path, options: Options, *, kind: FileKind | None = None, explicit: bool = True) -> FileResult:
    shown = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return FileResult(shown, kind, error=f"cannot read: {exc.strerror or exc}")
    binary = b"\0" in raw[:8192] and raw[:2] not in (b"\xff\xfe", b"\xfe\xff")  # not UTF-16 text
    if binary and not explicit:  # a walk skips binary files silently, never text it cannot read
        return FileResult(shown, kind, skipped="binary file")
    if binary:
        return FileResult(shown, kind, error="binary file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return FileResult(shown, kind, error="not UTF-8 text; not read")
    bom = "\ufeff" if text.startswith("\ufeff") else ""  # editors on Windows write one
    text = text.removeprefix(bom)
    try:
        kind = kind or detect_kind(path, text)
        result = migrate_text(path, text, kind, options)
    except RecursionError:  # nested deeper than the parsers and tree walks go
        result = FileResult(shown, kind, error="nested too deeply to read")
    if result.error is not None:  # never edited: still say where the legacy names are
        reason = "the file could not be migrated: edit by hand"
        scanner = scanner_for(options, prometheus=True)
        result.findings = scan_text(shown, text, scanner, reason).findings
        result.new_text = None
    if bom and result.original is not None:  # read past, written back
        result.original = bom + result.original
        result.new_text = result.new_text and bom + result.new_text
    return result


def scan_text(path: str, text: str, scanner: Scanner, reason: str) -> FileResult:
    """Any other text file: legacy names reported, never edited."""
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
    old, new = _LINES.findall(result.original), _LINES.findall(result.new_text)
    lines = difflib.unified_diff(old, new, fromfile=f"a/{result.path}", tofile=f"b/{result.path}")
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def write_atomically(path: Path, original: str, new_text: str) -> None:
    """Replace the file's contents in one step if it still holds ``original`` (mode kept)."""
    target = Path(os.path.realpath(path))
    if target.read_bytes() != original.encode("utf-8"):
        raise OSError(f"{path} changed while it was being migrated; run again")
    with atomic_output(target) as handle:
        handle.write(new_text.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())  # (a config: on disk before the rename)
