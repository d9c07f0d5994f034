"""Prometheus rule files (and the ``spec.groups`` of a PrometheusRule resource): ``expr`` read as
PromQL, labels, annotations and comments as free text, alert names left alone; ``--drop-removed``
deletes a rule whose ``expr`` reads only removed series."""

from __future__ import annotations

from .model import FileKind
from .names import Context
from .structured import ScalarScan, Unit, nearest_key, only_removed, resolve
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
        units = []
        for rule in only_removed(scans, _rule_of):
            entity = resolve(data, rule)
            assert isinstance(entity, dict)
            if "alert" in entity:
                label = f'alert "{entity["alert"]}"'
            else:
                label = f'recording rule "{entity.get("record")}" (rules using it break too)'
            units.append(Unit(rule, label))
        return units


def _rule_of(path: Path) -> Path | None:
    """The path of the rule (an entry of a ``rules`` list) whose ``expr`` is at ``path``."""
    rule = path[:-1]
    return rule if len(rule) >= 2 and rule[-2] == "rules" and isinstance(rule[-1], int) else None
