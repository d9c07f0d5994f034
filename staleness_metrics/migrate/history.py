"""Metrics history (``metrics.jsonl``, one JSON object with a ``step`` a line): keys renamed in
place, values untouched, and a boundary line ``{"step": S, "migrate/legacy_through_step": S}``
after the last line with legacy keys (steps up to S used the old definitions)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

from ..metrics.metric_table import LegacyKey
from .legacy import in_legacy_namespace, migrate_key
from .model import Action, FileKind, FileResult, Finding, Options
from .names import peer_lookup
from .tree import JSON, Edit, Mapping, apply_edits

MARKER_KEY = "migrate/legacy_through_step"
_LINES = re.compile(r"[^\n]*\n|[^\n]+\Z")


def looks_like_history(text: str) -> bool:
    """The first non-blank line is a JSON object with a ``step`` (event streams have a ``type``)."""
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            first = json.loads(line)
        except ValueError:
            return False
        return isinstance(first, dict) and "step" in first and "type" not in first
    return False


class _LineError(ValueError):
    pass


class _Findings(dict[tuple[str, Action], Finding]):
    """Findings per (key, action), over the range of lines that carry the key."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def add(self, old: str, new: str | None, action: Action, reason: str, line: int) -> None:
        known = self.get((old, action))
        if known is None:
            self[old, action] = Finding(self.path, line, old, new, action, reason, last_line=line)
        else:
            self[old, action] = replace(known, last_line=line, count=known.count + 1)


def migrate_history(path: str, text: str, options: Options) -> FileResult:
    result = FileResult(path, FileKind.HISTORY, original=text)
    found = _Findings(path)
    out: list[str] = []
    last_legacy: tuple[int, int, object] | None = None  # (index in ``out``, line number, step)
    newline = "\r\n" if "\r\n" in text else "\n"
    # split on "\n" only: a JSON string may hold U+2028 and friends, which str.splitlines splits on
    for number, line in enumerate(_LINES.findall(text), start=1):
        body = line.rstrip("\r\n")
        if not body.strip():
            out.append(line)
            continue
        try:
            new_body, had_legacy, is_marker, step = _migrate_line(body, number, options, found)
        except _LineError as exc:
            result.error = f"line {number}: {exc}"
            return result
        if is_marker:
            continue  # an earlier run's boundary: dropped only if a new one is written below
        if had_legacy:
            last_legacy = (len(out), number, step)
        out.append(new_body + line[len(body) :])
    result.findings = sorted(found.values(), key=lambda f: (f.line, f.old))
    if last_legacy is None:
        return result  # nothing legacy: the file (and any earlier boundary line) stays as it is
    index, number, step = last_legacy
    if not out[index].endswith(("\n", "\r")):
        out[index] += newline
    marker = json.dumps({"step": step, MARKER_KEY: step})
    out.insert(index + 1, marker + (newline if index + 1 < len(out) else ""))
    result.notes.append(f"boundary line after line {number} (step {step}): old definitions up to there")
    result.new_text = "".join(out)
    return result


def _migrate_line(body: str, number: int, options: Options, found: _Findings) -> tuple[str, bool, bool, object]:
    """The line with legacy keys renamed; whether it had any; whether it is a boundary; its step."""
    try:
        [node], [data] = JSON.read(body)
    except ValueError as exc:
        raise _LineError(f"not a JSON object: {exc}") from exc
    if not isinstance(node, Mapping) or not isinstance(data, dict):
        raise _LineError("not a JSON object")
    keys = {key.value for key, _ in node.items}
    edits: list[Edit] = []
    doomed: list[int] = []
    taken: set[str] = set()
    had_legacy = False
    expected: dict[object, object] = {}
    for index, (key, _value) in enumerate(node.items):
        name = str(key.value)
        if options.peer:
            peer_row = peer_lookup(options.peer, name)
            if peer_row is not None and peer_row.new is None:
                # a peer key whose meaning differs: reported, kept (it is data), never renamed or
                # dropped; it sets no boundary line, since nothing on the line changes meaning
                reason = f"{peer_row.peer}: {peer_row.reason} [{peer_row.source}]"
                found.add(name, None, Action.MANUAL, reason, number)
                expected[name] = data[name]
                continue
            legacy = None if peer_row is None else LegacyKey(name, peer_row.new, f"{peer_row.peer}: {peer_row.reason}")
        else:
            legacy = migrate_key(name)
        if legacy is None:
            if not options.peer and in_legacy_namespace(name):
                had_legacy = True
                found.add(name, None, Action.MANUAL, "old off_policy/ namespace, no known mapping", number)
            expected[name] = data[name]
            continue
        had_legacy = True
        if legacy.new is None or legacy.new in keys or legacy.new in taken:
            reason = legacy.reason if legacy.new is None else f"{legacy.new} is already on the line"
            if options.drop_removed:
                doomed.append(index)
                found.add(name, None, Action.DROP, reason, number)
            else:
                action = Action.REMOVED if legacy.new is None else Action.MANUAL
                found.add(name, legacy.new, action, f"{reason}; --drop-removed deletes it", number)
                expected[name] = data[name]
            continue
        taken.add(legacy.new)
        raw = JSON.render(body, key, legacy.new, {name: legacy.new})
        assert raw is not None
        edits.append(Edit(key.start, key.end, raw))
        expected[legacy.new] = data[name]
        found.add(name, legacy.new, Action.RENAME, legacy.reason or "renamed", number)
    if doomed:
        edits.extend(JSON.remove(body, node, doomed))
    new_body = apply_edits(body, edits) if edits else body
    if edits and json.loads(new_body) != expected:
        raise _LineError("the edited line does not read back as intended")
    return new_body, had_legacy, MARKER_KEY in data, data.get("step")
