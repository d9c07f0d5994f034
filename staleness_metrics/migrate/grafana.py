"""Grafana dashboard JSON: legacy series names in queries, and legacy names in titles and legends.

Queries (``expr`` of a target, ``query``/``definition`` of a template variable or annotation)
are read as PromQL; every other string (titles, descriptions, legend formats, override
matchers) as free text, where both W&B keys and Prometheus names are recognised. A target whose
query reads only removed metrics is deleted under ``--drop-removed``, and a panel whose targets
all go is deleted whole.
"""

from __future__ import annotations

from collections import defaultdict

from .model import Action, FileKind
from .names import Context
from .structured import ScalarScan, Unit, nearest_key, resolve
from .tree import Path

__all__ = ["GrafanaPolicy", "looks_like_grafana"]

_QUERY_KEYS = frozenset({"expr", "query", "definition"})


def looks_like_grafana(document: object) -> bool:
    """A dashboard (or an API export wrapping one in ``{"dashboard": ...}``)
    with a ``panels`` list."""
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
        # target path -> whether every series its queries read was removed
        targets: dict[Path, bool] = {}
        for scan in scans:
            if scan.context is not Context.PROMQL or scan.is_key:
                continue
            target = _target_of(scan.path)
            if target is None:
                continue
            only_removed = all(h.action is Action.REMOVED for h in scan.scanned.hits)
            targets[target] = targets.get(target, True) and only_removed
        doomed_by_panel: dict[Path, list[Path]] = defaultdict(list)
        for target, only_removed in targets.items():
            if only_removed:
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
