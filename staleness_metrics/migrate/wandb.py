"""W&B workspace specs and panel lists (JSON or YAML): a value under a key containing ``regex`` is a
key regex, every other string free text; ``--drop-removed`` deletes series entries naming a removed
key, and a panel all of whose series were removed."""

from __future__ import annotations

from .model import FileKind
from .names import Context
from .structured import ScalarScan, Unit, nearest_key, resolve, under
from .tree import Path

__all__ = ["WandbPolicy", "looks_like_wandb"]

SERIES_KEYS = frozenset({"y", "metrics", "metric", "keys", "key"})
_MARKERS = frozenset({"sections", "panels", "workspace", "panel_regexes"})


def _is_regex_key(key: str) -> bool:
    return "regex" in key.lower()


def looks_like_wandb(document: object) -> bool:
    """A workspace spec (``sections``/``panels``) or a document holding key regexes."""
    if isinstance(document, dict):
        if _MARKERS & set(document):
            return True
        return any(_is_regex_key(str(k)) or looks_like_wandb(v) for k, v in document.items())
    if isinstance(document, list):
        return any(looks_like_wandb(item) for item in document)
    return False


def _is_series_key(key: object) -> bool:
    return isinstance(key, str) and (key in SERIES_KEYS or _is_regex_key(key))


def _series_paths(node: object, path: Path) -> list[Path]:
    """The paths of the strings choosing what a panel plots (y keys, key regexes, at any depth)."""
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


class WandbPolicy:
    kind = FileKind.WANDB

    def context(self, path: Path) -> Context | None:
        return Context.REGEX if _is_regex_key(nearest_key(path)) else Context.TEXT

    def units(self, data: list[object], scans: list[ScalarScan]) -> list[Unit]:
        removed = {s.path for s in scans if not s.is_key and s.removed_whole}
        if not removed:
            return []
        units: list[Unit] = []
        panels = [p for p in _panel_paths(data) if any(under(r, p) for r in removed)]
        for panel in panels:
            sources = _series_paths(resolve(data, panel), panel)
            if sources and all(source in removed for source in sources):
                entity = resolve(data, panel)
                title = entity.get("title") if isinstance(entity, dict) else None
                units.append(Unit(panel, f'panel "{title}"' if title else f"panel #{panel[-1]}"))
        for path in sorted(removed, key=str):
            if any(under(path, u.path) for u in units):
                continue
            if isinstance(path[-1], int) and len(path) >= 2 and _is_series_key(path[-2]):
                units.append(Unit(path, f"entry {resolve(data, path)!r} of {path[-2]}"))
        return units


def _panel_paths(data: list[object]) -> list[Path]:
    """Paths of the entries of every ``panels`` list."""
    found: list[Path] = []

    def visit(node: object, path: Path) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "panels" and isinstance(value, list):
                    found.extend((*path, key, i) for i in range(len(value)))
                visit(value, (*path, key))
        elif isinstance(node, list):
            for index, item in enumerate(node):
                visit(item, (*path, index))

    for index, document in enumerate(data):
        visit(document, (index,))
    return found
