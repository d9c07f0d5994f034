"""Grafana dashboard JSON: queries (``expr``, ``query``, ``definition``) read as PromQL, every
other string as free text; ``--drop-removed`` deletes targets of removed series only, and a panel
whose targets all go."""

from __future__ import annotations

from collections import defaultdict

from .model import FileKind
from .names import Context
from .structured import ScalarScan, Unit, nearest_key, only_removed, resolve
from .tree import Path

__all__ = ["GrafanaPolicy", "looks_like_grafana"]

_QUERY_KEYS = frozenset({"expr", "query", "definition"})


def looks_like_grafana(document: object) -> bool:
    """A dashboard (or an API export wrapping one in ``{"dashboard": ...}``) with ``panels``."""
    if isinstance(document, dict) and isinstance(document.get("dashboard"), dict):
        document = document["dashboard"]
    if not isinstance(document, dict) or not isinstance(document.get("panels"), list):
        return False
    if "schemaVersion" in document or "templating" in document:
        return True
    return any(isinstance(p, dict) and ("gridPos" in p or "targets" in p) for p in document["panels"])


def _title(data: list[object], path: Path) -> str:
    panel = resolve(data, path)
    title = panel.get("title") if isinstance(panel, dict) else None
    return str(title) if title else f"#{path[-1]}"


class GrafanaPolicy:
    kind = FileKind.GRAFANA

    def context(self, path: Path) -> Context | None:
        return Context.PROMQL if nearest_key(path) in _QUERY_KEYS else Context.TEXT

    def units(self, data: list[object], scans: list[ScalarScan]) -> list[Unit]:
        doomed_by_panel: dict[Path, list[Path]] = defaultdict(list)
        for target in only_removed(scans, _target_of):
            doomed_by_panel[target[:-2]].append(target)
        units = []
        for panel, doomed in doomed_by_panel.items():
            panel_targets = resolve(data, (*panel, "targets"))
            title = _title(data, panel)
            is_panel = len(panel) >= 2 and panel[-2] == "panels"
            if is_panel and isinstance(panel_targets, list) and len(doomed) == len(panel_targets):
                units.append(Unit(panel, f'panel "{title}"'))
            else:
                for target in doomed:
                    ref = resolve(data, target)
                    ref_id = ref.get("refId", target[-1]) if isinstance(ref, dict) else target[-1]
                    units.append(Unit(target, f'target {ref_id} of panel "{title}"'))
        return units


def _target_of(path: Path) -> Path | None:
    """The path of the target (an entry of a ``targets`` list) that holds ``path``."""
    for index in range(len(path) - 2, -1, -1):
        if path[index] == "targets" and isinstance(path[index + 1], int):
            return path[: index + 2]
    return None
