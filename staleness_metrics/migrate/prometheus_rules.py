"""Prometheus rule files (and the ``spec.groups`` of a PrometheusRule resource).

``expr`` is read as PromQL; labels, annotations and comments as free text. Alert names are left
alone (they are the team's own names; silences and routes refer to them). A recording rule named
``level:metric:operations`` over a legacy series is renamed with its series, the same way in every
file (queries that use it included). A rule whose ``expr`` reads only removed series is deleted
under ``--drop-removed``.
"""

from __future__ import annotations

from .model import Action, FileKind
from .names import Context
from .structured import ScalarScan, Unit, nearest_key, resolve
from .tree import Path

__all__ = ["PrometheusRulesPolicy", "looks_like_rules"]


def _groups(document: object) -> object:
    if isinstance(document, dict) and isinstance(document.get("spec"), dict) and "groups" in document["spec"]:
        return document["spec"]["groups"]
    return document.get("groups") if isinstance(document, dict) else None


def looks_like_rules(document: object) -> bool:
    groups = _groups(document)
    return (
        isinstance(groups, list)
        and bool(groups)
        and all(isinstance(g, dict) and isinstance(g.get("rules", []), list) for g in groups)
        and any(isinstance(g, dict) and "rules" in g for g in groups)
    )


class PrometheusRulesPolicy:
    kind = FileKind.PROMETHEUS_RULES

    def context(self, path: Path) -> Context | None:
        key = nearest_key(path)
        if key == "alert":
            return None  # the team's own name; dashboards and silences refer to it
        return Context.PROMQL if key == "expr" else Context.TEXT

    def units(self, data: list[object], scans: list[ScalarScan]) -> list[Unit]:
        verdict: dict[Path, bool] = {}
        for scan in scans:
            if scan.is_key or scan.context is not Context.PROMQL:
                continue
            rule = scan.path[:-1]
            if len(rule) < 2 or rule[-2] != "rules" or not isinstance(rule[-1], int):
                continue
            only_removed = all(h.action is Action.REMOVED for h in scan.scanned.hits)
            verdict[rule] = verdict.get(rule, True) and only_removed
        units = []
        for rule, only_removed in verdict.items():
            if not only_removed:
                continue
            entity = resolve(data, rule)
            assert isinstance(entity, dict)
            if "alert" in entity:
                label = f'alert "{entity["alert"]}"'
            else:
                label = f'recording rule "{entity.get("record")}" (rules using it break too)'
            units.append(Unit(rule, label))
        return units
