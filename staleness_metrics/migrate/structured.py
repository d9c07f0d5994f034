"""In-place migration of a structured document (Grafana dashboard, W&B workspace spec, rule file):
each kind's :class:`Policy` says how a string is read and what ``--drop-removed`` may delete."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from .model import Action, FileKind, FileResult, Finding, MissingParser, Options
from .names import Context, Hit, Scanned, Scanner
from .tree import Edit, Node, Path, Scalar, Sequence, Syntax, apply_edits, line_of, walk, written_at


@dataclass(frozen=True)
class ScalarScan:
    path: Path  # the value's path; for a key, the path of the value it names
    scalar: Scalar
    is_key: bool
    context: Context
    scanned: Scanned


@dataclass(frozen=True)
class Unit:
    path: Path
    label: str  # 'panel "Token max"', 'alert "X"'


@dataclass(frozen=True)
class Policy:
    """A structured file kind: its test of a document, how to read the string at a path (None: leave
    it), the entries ``--drop-removed`` deletes, and whether its free text holds series names."""

    kind: FileKind
    looks_like: Callable[[object], bool]
    context: Callable[[Path], Context | None]
    units: Callable[[list[object], list[ScalarScan]], list[Unit]]
    prometheus: bool


def _nearest_key(path: Path) -> str:
    return next((part for part in reversed(path) if isinstance(part, str)), "")


def _only_removed(scans: list[ScalarScan], owner: Callable[[Path], Path | None]) -> list[Path]:
    """The owners (targets, rules) all of whose PromQL values read only removed series."""
    verdict: dict[Path, bool] = {}
    for scan in scans:
        found = None if scan.is_key or scan.context is not Context.PROMQL else owner(scan.path)
        if found is not None:
            removed = all(h.action is Action.REMOVED for h in scan.scanned.hits)
            verdict[found] = verdict.get(found, True) and removed and not scan.scanned.live
    return [path for path, removed in verdict.items() if removed]


def _under(path: Path, prefix: Path) -> bool:
    return path[: len(prefix)] == prefix


def _resolve(data: list[object], path: Path) -> object:
    node: object = data
    for part in path:
        node = node[part]  # type: ignore[index]
    return node


def _line(text: str, scalar: Scalar, hit: Hit) -> int:
    """The line of a hit, found in its scalar's source (folded scalars lose their line breaks)."""
    value = str(scalar.value)
    occurrence = value[: hit.start].count(hit.old)
    raw = text[scalar.start : scalar.end]
    position = -1
    for _ in range(occurrence + 1):
        position = raw.find(hit.old, position + 1)
        if position < 0:
            block = 1 if scalar.style in ("|", ">") else 0  # the indicator line comes first
            return line_of(text, scalar.start) + value[: hit.start].count("\n") + block
    return line_of(text, scalar.start + position)


def migrate_structured(
    path: str, text: str, syntax: Syntax, policy: Policy, scanner: Scanner, options: Options
) -> FileResult:
    result = FileResult(path, policy.kind, original=text)
    try:
        roots, data = syntax.read(text)
    except ValueError as exc:  # a MissingParser names the package to install
        missing = isinstance(exc, MissingParser)
        result.error = str(exc) if missing else f"cannot parse as {syntax.name}: {exc}"
        return result
    migration = _Migration(path, text, syntax, scanner, roots)
    migration.scan(policy)
    migration.drop(policy.units(data, migration.scans), options.drop_removed)
    migration.rename()
    migration.comments()
    result.findings = sorted(migration.findings, key=lambda f: (f.line, f.old))
    if not migration.edits:
        return result
    try:  # a set: a YAML alias repeats its anchor's edits
        new_text = apply_edits(text, set(migration.edits))
        migration.verify(new_text, data)
    except ValueError as exc:
        result.error = f"refusing to edit: {exc}"
        return result
    result.new_text = new_text
    return result


class _Migration:
    """The edits, findings and intended data changes of one document, built step by step."""

    def __init__(self, path: str, text: str, syntax: Syntax, scanner: Scanner, roots: list[Node]) -> None:
        self.path, self.text, self.syntax = path, text, syntax
        self.scanner, self.roots = scanner, roots
        self.nodes: dict[Path, Node] = {}
        self.scans: list[ScalarScan] = []
        self.edits: list[Edit] = []
        self.removals: list[Edit] = []
        self.findings: list[Finding] = []
        self.sets: list[tuple[Path, str]] = []  # value path -> new value
        self.renames: list[tuple[Path, str, str]] = []  # mapping path, old key, new key
        self.dropped: list[Unit] = []
        self.drop_notes: dict[Path, str] = {}

    def scan(self, policy: Policy) -> None:
        for index, root in enumerate(self.roots):
            for node_path, node, key in walk(root, (index,)):
                self.nodes[node_path] = node
                if key is not None and isinstance(key.value, str):
                    self._scan(node_path, key, True, Context.TEXT)
                if isinstance(node, Scalar) and isinstance(node.value, str):
                    context = policy.context(node_path)
                    if context is not None:
                        self._scan(node_path, node, False, context)

    def _scan(self, path: Path, scalar: Scalar, is_key: bool, context: Context) -> None:
        scanned = self.scanner.scan(str(scalar.value), context)
        if scanned.hits:
            self.scans.append(ScalarScan(path, scalar, is_key, context, scanned))

    def drop(self, units: list[Unit], drop_removed: bool) -> None:
        """Delete the units (``--drop-removed``), or note on their findings that the flag would."""
        note = "{} cannot be deleted automatically" if drop_removed else "--drop-removed deletes {}"
        by_parent: dict[Path, list[Unit]] = defaultdict(list)
        paths = {u.path for u in units}
        for unit in units:
            if any(p != unit.path and _under(unit.path, p) for p in paths):
                continue  # inside another unit
            by_parent[unit.path[:-1]].append(unit)
        for parent_path, members in by_parent.items():
            parent = self.nodes[parent_path]
            assert isinstance(parent, Sequence)
            removal = self.syntax.remove(self.text, parent, [_index(u.path) for u in members]) if drop_removed else None
            if removal is None:
                self.drop_notes.update((unit.path, note.format(unit.label)) for unit in members)
                continue
            self.edits.extend(removal)
            self.removals.extend(removal)
            self.dropped.extend(members)
        for unit in self.dropped:
            hits = [h for s in self.scans if _under(s.path, unit.path) for h in s.scanned.hits]
            names = ", ".join(sorted({h.old for h in hits}))
            reasons = "; ".join(sorted({h.reason for h in hits if h.action is Action.REMOVED}))
            line = line_of(self.text, written_at(self.nodes[unit.path])[0])
            self.findings.append(Finding(self.path, line, names, None, Action.DROP, f"{unit.label} deleted: {reasons}"))

    def rename(self) -> None:
        for scan in self.scans:
            if any(_under(scan.path, u.path) for u in self.dropped):
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
            note = next((n for p, n in self.drop_notes.items() if _under(scan.path, p)), "")
            for hit in scan.scanned.hits:
                action, reason = hit.action, hit.reason
                if action is Action.RENAME and raw is None:
                    action = Action.MANUAL
                    reason = "cannot rewrite this value in place: edit by hand"
                if action is Action.REMOVED and note:
                    reason = f"{reason}; {note}"
                line = _line(self.text, scan.scalar, hit)
                self.findings.append(Finding(self.path, line, hit.old, hit.new, action, reason))

    def comments(self) -> None:
        for start, end in self.syntax.comments(self.text, self.roots):
            if any(r.start <= start < r.end for r in self.removals):
                continue  # deleted with its panel or rule
            scanned = self.scanner.scan(self.text[start:end], Context.TEXT)
            if scanned.changed:
                self.edits.append(Edit(start, end, scanned.text))
            for hit in scanned.hits:
                line = line_of(self.text, start + hit.start)
                reason = f"{hit.reason}, in a comment"
                self.findings.append(Finding(self.path, line, hit.old, hit.new, hit.action, reason))

    def verify(self, new_text: str, data: list[object]) -> None:
        """Read the edited text back: it must be the old data with exactly the intended changes."""
        expected = copy.deepcopy(data)
        for value_path, value in self.sets:
            parent = _resolve(expected, value_path[:-1])
            parent[value_path[-1]] = value  # type: ignore[index]
        for doomed in sorted((u.path for u in self.dropped), key=lambda p: (-len(p), -_index(p))):
            parent = _resolve(expected, doomed[:-1])
            del parent[doomed[-1]]  # type: ignore[attr-defined]
        for map_path, old, new in sorted(self.renames, key=lambda r: -len(r[0])):
            mapping = _resolve(expected, map_path)
            assert isinstance(mapping, dict)
            if new in mapping:
                raise ValueError(f"renaming {old!r} would collide with the existing {new!r}")
            mapping[new] = mapping.pop(old)
        try:
            actual = self.syntax.read(new_text)[1]
        except ValueError as exc:
            raise ValueError(f"the edited text does not parse ({exc})") from exc
        if actual != expected:
            raise ValueError("the edited text does not read back as intended")


def _index(path: Path) -> int:
    last = path[-1]
    assert isinstance(last, int), f"{path} does not end in a list index"
    return last


# -- Grafana dashboards: queries read as PromQL, --drop-removed deletes targets and whole panels --


def _looks_like_grafana(document: object) -> bool:
    if isinstance(document, dict) and isinstance(document.get("dashboard"), dict):
        document = document["dashboard"]
    if not isinstance(document, dict) or not isinstance(document.get("panels"), list):
        return False
    if "schemaVersion" in document or "templating" in document:
        return True
    return any(isinstance(p, dict) and ("gridPos" in p or "targets" in p) for p in document["panels"])


def _grafana_context(path: Path) -> Context | None:
    return Context.PROMQL if _nearest_key(path) in ("expr", "query", "definition") else Context.TEXT


def _grafana_units(data: list[object], scans: list[ScalarScan]) -> list[Unit]:
    doomed_by_panel: dict[Path, list[Path]] = defaultdict(list)
    for target in _only_removed(scans, _target_of):
        doomed_by_panel[target[:-2]].append(target)
    units = []
    for panel, doomed in doomed_by_panel.items():
        panel_targets = _resolve(data, (*panel, "targets"))
        entity = _resolve(data, panel)
        title = entity.get("title") if isinstance(entity, dict) else None
        title = str(title) if title else f"#{panel[-1]}"
        is_panel = len(panel) >= 2 and panel[-2] == "panels"
        if is_panel and isinstance(panel_targets, list) and len(doomed) == len(panel_targets):
            units.append(Unit(panel, f'panel "{title}"'))
            continue
        for target in doomed:
            ref = _resolve(data, target)
            ref_id = ref.get("refId", target[-1]) if isinstance(ref, dict) else target[-1]
            units.append(Unit(target, f'target {ref_id} of panel "{title}"'))
    return units


def _target_of(path: Path) -> Path | None:
    for index in range(len(path) - 2, -1, -1):
        if path[index] == "targets" and isinstance(path[index + 1], int):
            return path[: index + 2]
    return None


# -- W&B workspace specs and panel lists: ``*regex*`` values read as key regexes ------------------

_SERIES_KEYS = frozenset({"y", "metrics", "metric", "keys", "key"})


def _is_regex_key(key: str) -> bool:
    return "regex" in key.lower()


def _looks_like_wandb(document: object) -> bool:
    if isinstance(document, dict):
        if {"sections", "panels", "workspace", "panel_regexes"} & set(document):
            return True
        return any(_is_regex_key(str(k)) or _looks_like_wandb(v) for k, v in document.items())
    return isinstance(document, list) and any(_looks_like_wandb(item) for item in document)


def _is_series_key(key: object) -> bool:
    return isinstance(key, str) and (key in _SERIES_KEYS or _is_regex_key(key))


def _series_paths(node: object, path: Path) -> list[Path]:
    """The strings choosing what a panel plots (y keys, key regexes, at any depth)."""
    found: list[Path] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if _is_series_key(key) and isinstance(value, str):
                found.append((*path, key))
            elif _is_series_key(key) and isinstance(value, list):
                found.extend((*path, key, i) for i, item in enumerate(value) if isinstance(item, str))
            elif key != "panels":
                found.extend(_series_paths(value, (*path, key)))
    elif isinstance(node, list):
        for index, item in enumerate(node):
            found.extend(_series_paths(item, (*path, index)))
    return found


def _wandb_context(path: Path) -> Context | None:
    return Context.REGEX if _is_regex_key(_nearest_key(path)) else Context.TEXT


def _wandb_units(data: list[object], scans: list[ScalarScan]) -> list[Unit]:
    # values that are one removed name as a whole (a series entry, a regex of removed metrics only)
    lone = [(s, s.scanned.hits[0]) for s in scans if not s.is_key and len(s.scanned.hits) == 1]
    removed = {s.path for s, h in lone if h.action is Action.REMOVED and h.old == s.scalar.value}
    units: list[Unit] = []
    for panel in [p for p in _panel_paths(data) if any(_under(r, p) for r in removed)]:
        entity = _resolve(data, panel)
        sources = _series_paths(entity, panel)
        if sources and all(source in removed for source in sources):
            title = entity.get("title") if isinstance(entity, dict) else None
            units.append(Unit(panel, f'panel "{title}"' if title else f"panel #{panel[-1]}"))
    for path in sorted(removed, key=str):
        if any(_under(path, u.path) for u in units):
            continue
        if isinstance(path[-1], int) and len(path) >= 2 and _is_series_key(path[-2]):
            units.append(Unit(path, f"entry {_resolve(data, path)!r} of {path[-2]}"))
    return units


def _panel_paths(node: object, path: Path = ()) -> list[Path]:
    children = dict(enumerate(node)) if isinstance(node, list) else node
    if not isinstance(children, dict):
        return []
    found: list[Path] = []
    for key, value in children.items():
        if key == "panels" and isinstance(value, list):
            found.extend((*path, key, i) for i in range(len(value)))
        found.extend(_panel_paths(value, (*path, key)))
    return found


# -- Prometheus rule files (and PrometheusRule resources): ``expr`` read as PromQL ----------------


def _looks_like_rules(document: object) -> bool:
    groups = document.get("groups") if isinstance(document, dict) else None
    if isinstance(document, dict) and isinstance(document.get("spec"), dict) and "groups" in document["spec"]:
        groups = document["spec"]["groups"]
    return (
        isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("rules", []), list) for g in groups)
        and any(isinstance(g, dict) and "rules" in g for g in groups)
    )


def _rules_context(path: Path) -> Context | None:
    key = _nearest_key(path)
    if key == "alert":
        return None  # the team's own name; dashboards and silences refer to it
    return Context.PROMQL if key == "expr" else Context.TEXT


def _rules_units(data: list[object], scans: list[ScalarScan]) -> list[Unit]:
    units = []
    for rule in _only_removed(scans, _rule_of):
        entity = _resolve(data, rule)
        assert isinstance(entity, dict)
        record = f'recording rule "{entity.get("record")}" (rules using it break too)'
        units.append(Unit(rule, f'alert "{entity["alert"]}"' if "alert" in entity else record))
    return units


def _rule_of(path: Path) -> Path | None:
    rule = path[:-1]
    return rule if len(rule) >= 2 and rule[-2] == "rules" and isinstance(rule[-1], int) else None


POLICIES = (  # detection tries them in this order
    Policy(FileKind.GRAFANA, _looks_like_grafana, _grafana_context, _grafana_units, True),
    Policy(FileKind.PROMETHEUS_RULES, _looks_like_rules, _rules_context, _rules_units, True),
    Policy(FileKind.WANDB, _looks_like_wandb, _wandb_context, _wandb_units, False),
)
