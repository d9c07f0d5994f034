"""In-place migration of a structured document (Grafana dashboard, W&B workspace spec, rule file).

A file-kind :class:`Policy` says how each string is read (PromQL, regex, free text) and which list
entries may be deleted under ``--drop-removed``; the edited text is read back before it is kept.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from .model import Action, FileKind, FileResult, Finding, MissingParser, Options
from .names import Context, Hit, Scanned, Scanner
from .tree import Edit, LineIndex, Mapping, Node, Path, Scalar, Sequence, Syntax, apply_edits, walk

__all__ = [
    "Policy",
    "ScalarScan",
    "Unit",
    "migrate_structured",
    "nearest_key",
    "only_removed",
    "resolve",
    "under",
]


@dataclass(frozen=True)
class ScalarScan:
    """The legacy names found in one string value (or mapping key) of the document."""

    path: Path  # the value's path; for a key, the path of the value it names
    scalar: Scalar
    is_key: bool
    context: Context
    scanned: Scanned

    @property
    def removed_whole(self) -> bool:
        """The whole value is one removed name (a series entry or regex of removed metrics only)."""
        hits = self.scanned.hits
        return (
            len(hits) == 1
            and hits[0].action is Action.REMOVED
            and hits[0].end - hits[0].start == len(str(self.scalar.value))
        )


@dataclass(frozen=True)
class Unit:
    """A list entry ``--drop-removed`` may delete: it shows only removed metrics."""

    path: Path
    label: str  # 'panel "Token max"', 'alert "X"'


class Policy(Protocol):
    kind: FileKind

    def context(self, path: Path) -> Context | None:
        """How to read the string at ``path`` (None: leave it alone)."""
        ...

    def units(self, data: list[object], scans: list[ScalarScan]) -> list[Unit]:
        """The entries to delete under ``--drop-removed``."""
        ...


def nearest_key(path: Path) -> str:
    """The mapping key a value sits under (list indices skipped)."""
    for part in reversed(path):
        if isinstance(part, str):
            return part
    return ""


def only_removed(scans: list[ScalarScan], owner: Callable[[Path], Path | None]) -> list[Path]:
    """The owners (targets, rules) of PromQL values all of whose queries read only removed series."""
    verdict: dict[Path, bool] = {}
    for scan in scans:
        found = None if scan.is_key or scan.context is not Context.PROMQL else owner(scan.path)
        if found is not None:
            removed = all(h.action is Action.REMOVED for h in scan.scanned.hits)
            verdict[found] = verdict.get(found, True) and removed
    return [path for path, removed in verdict.items() if removed]


def under(path: Path, prefix: Path) -> bool:
    return path[: len(prefix)] == prefix


def resolve(data: list[object], path: Path) -> object:
    node: object = data
    for part in path:
        node = node[part]  # type: ignore[index]
    return node


def _line(text: str, lines: LineIndex, scalar: Scalar, hit: Hit) -> int:
    """The line of a hit, found in its scalar's source text (folded scalars lose their line breaks)."""
    value = str(scalar.value)
    occurrence = value[: hit.start].count(hit.old)
    raw = text[scalar.start : scalar.end]
    position = -1
    for _ in range(occurrence + 1):
        position = raw.find(hit.old, position + 1)
        if position < 0:
            # the content starts after the indicator line
            block = 1 if scalar.style in ("|", ">") else 0
            return lines.line(scalar.start) + value[: hit.start].count("\n") + block
    return lines.line(scalar.start + position)


def migrate_structured(
    path: str, text: str, syntax: Syntax, policy: Policy, scanner: Scanner, options: Options
) -> FileResult:
    result = FileResult(path, policy.kind, original=text)
    try:
        roots = syntax.parse(text)
        data = syntax.load(text)
    except MissingParser as exc:
        result.error = str(exc)
        return result
    except ValueError as exc:
        result.error = f"cannot parse as {syntax.name}: {exc}"
        return result
    migration = _Migration(path, text, syntax, scanner, roots)
    migration.scan(policy)
    migration.drop(policy.units(data, migration.scans), options.drop_removed)
    migration.rename()
    migration.comments()
    result.findings = sorted(migration.findings, key=lambda f: (f.line, f.old))
    if not migration.edits:
        return result
    try:
        new_text = apply_edits(text, _unique(migration.edits))
        _verify(syntax, new_text, data, migration.sets, migration.deletes, migration.renames)
    except ValueError as exc:
        result.error = f"refusing to edit: {exc}"
        return result
    result.new_text = new_text
    return result


class _Migration:
    """The edits, findings and intended data changes of one document, built step by step."""

    def __init__(self, path: str, text: str, syntax: Syntax, scanner: Scanner, roots: list[Node]) -> None:
        self.path, self.text, self.syntax, self.scanner, self.roots = path, text, syntax, scanner, roots
        self.lines = LineIndex(text)
        self.nodes: dict[Path, Node] = {}
        self.scans: list[ScalarScan] = []
        self.edits: list[Edit] = []
        self.removals: list[Edit] = []
        self.findings: list[Finding] = []
        self.sets: list[tuple[Path, str]] = []  # value path -> new value
        self.renames: list[tuple[Path, str, str]] = []  # mapping path, old key, new key
        self.deletes: list[Path] = []  # list entries
        self.dropped: list[Unit] = []
        self.drop_notes: dict[Path, str] = {}

    def scan(self, policy: Policy) -> None:
        for index, root in enumerate(self.roots):
            for node_path, node, _ in walk(root, (index,)):
                self.nodes[node_path] = node
                if isinstance(node, Mapping):
                    for key, _value in node.items:
                        if isinstance(key.value, str):
                            self._scan((*node_path, key.value), key, True, Context.TEXT)
                elif isinstance(node, Scalar) and isinstance(node.value, str):
                    context = policy.context(node_path)
                    if context is not None:
                        self._scan(node_path, node, False, context)

    def _scan(self, path: Path, scalar: Scalar, is_key: bool, context: Context) -> None:
        scanned = self.scanner.scan(str(scalar.value), context)
        if scanned.hits:
            self.scans.append(ScalarScan(path, scalar, is_key, context, scanned))

    def drop(self, units: list[Unit], drop_removed: bool) -> None:
        """Delete the units (``--drop-removed``), or note on their findings that the flag would."""
        by_parent: dict[Path, list[Unit]] = defaultdict(list)
        for unit in _outermost(units):
            by_parent[unit.path[:-1]].append(unit)
        for parent_path, members in by_parent.items():
            parent = self.nodes[parent_path]
            assert isinstance(parent, Sequence)
            removal = self.syntax.remove(self.text, parent, [_index(u.path) for u in members]) if drop_removed else None
            if removal is None:
                for unit in members:
                    note = "{} cannot be deleted automatically" if drop_removed else "--drop-removed deletes {}"
                    self.drop_notes[unit.path] = note.format(unit.label)
                continue
            self.edits.extend(removal)
            self.removals.extend(removal)
            self.dropped.extend(members)
            self.deletes.extend(u.path for u in members)
        for unit in self.dropped:
            hits = [h for s in self.scans if under(s.path, unit.path) for h in s.scanned.hits]
            names = ", ".join(sorted({h.old for h in hits}))
            reasons = "; ".join(sorted({h.reason for h in hits if h.action is Action.REMOVED}))
            line = self.lines.line(self.nodes[unit.path].start)
            self.findings.append(Finding(self.path, line, names, None, Action.DROP, f"{unit.label} deleted: {reasons}"))

    def rename(self) -> None:
        for scan in self.scans:
            if any(under(scan.path, u.path) for u in self.dropped):
                continue
            raw = None
            if scan.scanned.changed:
                new_value = scan.scanned.text
                renamed = {h.old: h.new for h in scan.scanned.hits if h.action is Action.RENAME and h.new}
                raw = self.syntax.render(self.text, scan.scalar, new_value, renamed)
                if raw is not None:
                    self.edits.append(Edit(scan.scalar.start, scan.scalar.end, raw))
                    if scan.is_key:
                        self.renames.append((scan.path[:-1], str(scan.scalar.value), new_value))
                    else:
                        self.sets.append((scan.path, new_value))
            note = next((n for p, n in self.drop_notes.items() if under(scan.path, p)), "")
            for hit in scan.scanned.hits:
                action, reason = hit.action, hit.reason
                if action is Action.RENAME and raw is None:
                    action, reason = Action.MANUAL, "cannot rewrite this value in place: edit by hand"
                if action is Action.REMOVED and note:
                    reason = f"{reason}; {note}"
                line = _line(self.text, self.lines, scan.scalar, hit)
                self.findings.append(Finding(self.path, line, hit.old, hit.new, action, reason))

    def comments(self) -> None:
        for start, end in self.syntax.comments(self.text, self.roots):
            if any(r.start <= start < r.end for r in self.removals):
                continue  # deleted with its panel or rule
            scanned = self.scanner.scan(self.text[start:end], Context.TEXT)
            if scanned.changed:
                self.edits.append(Edit(start, end, scanned.text))
            for hit in scanned.hits:
                line = self.lines.line(start + hit.start)
                reason = f"{hit.reason}, in a comment"
                self.findings.append(Finding(self.path, line, hit.old, hit.new, hit.action, reason))


def _index(path: Path) -> int:
    last = path[-1]
    assert isinstance(last, int), f"{path} does not end in a list index"
    return last


def _unique(edits: Iterable[Edit]) -> list[Edit]:
    # a YAML alias repeats its anchor's edits
    return sorted(set(edits), key=lambda e: (e.start, e.end))


def _outermost(units: list[Unit]) -> list[Unit]:
    paths = {u.path for u in units}
    return [u for u in units if not any(p != u.path and under(u.path, p) for p in paths)]


def _verify(
    syntax: Syntax,
    new_text: str,
    data: list[object],
    sets: list[tuple[Path, str]],
    deletes: list[Path],
    renames: list[tuple[Path, str, str]],
) -> None:
    """Read the edited text back and check it is the old data with exactly the intended changes."""
    expected = copy.deepcopy(data)
    for value_path, value in sets:
        parent = resolve(expected, value_path[:-1])
        parent[value_path[-1]] = value  # type: ignore[index]
    for doomed in sorted(deletes, key=lambda p: (-len(p), -_index(p))):
        parent = resolve(expected, doomed[:-1])
        del parent[doomed[-1]]  # type: ignore[attr-defined]
    for map_path, old, new in sorted(renames, key=lambda r: -len(r[0])):
        mapping = resolve(expected, map_path)
        assert isinstance(mapping, dict)
        if new in mapping:
            raise ValueError(f"renaming {old!r} would collide with the existing {new!r}")
        mapping[new] = mapping.pop(old)
    try:
        syntax.parse(new_text)
        actual = syntax.load(new_text)
    except ValueError as exc:
        raise ValueError(f"the edited text does not parse ({exc})") from exc
    if actual != expected:
        raise ValueError("the edited text does not read back as intended")
