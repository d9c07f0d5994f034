"""What users open: Grafana dashboards, Prometheus rules and a W&B workspace, generated from the
metric table (``staleness-metrics dashboards`` writes them; ``--check`` finds drift)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..exporters.wandb import DEFAULT_STEP_KEY
from ..files import write_whole
from .grafana import DASHBOARDS
from .rules import render_collector_config, render_rules
from .wandb_panels import workspace_spec

__all__ = ["WANDB_X_AXIS", "generated_files", "stale_files", "write_files"]

# The x-axis of the W&B panels: the key the W&B exporter logs every staleness key against.
WANDB_X_AXIS = DEFAULT_STEP_KEY


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def generated_files() -> dict[str, str]:
    """Path relative to the project root -> content, rendered from the metric table as it is now."""
    files = {f"dashboards/{name}": _json(build()) for name, build in DASHBOARDS.items()}
    files["dashboards/wandb-workspace.json"] = _json(workspace_spec(WANDB_X_AXIS))
    files["exporters/prometheus/staleness.rules.yml"] = render_rules()
    files["exporters/otel/collector.yaml"] = render_collector_config()
    return files


def _same(path: Path, generated: str) -> bool:
    if not path.is_file():
        return False
    existing = path.read_text(encoding="utf-8")
    if path.suffix in (".yml", ".yaml"):
        # Compared as data: another ruamel.yaml release may lay the same rules out differently.
        from ruamel.yaml import YAML

        yaml = YAML(typ="safe", pure=True)
        return bool(yaml.load(existing) == yaml.load(generated))
    return existing == generated


def stale_files(root: Path, files: dict[str, str] | None = None) -> list[str]:
    """The files under ``root`` that are missing or differ from ``files`` (default: as now)."""
    generated = files or generated_files()
    return [path for path, content in generated.items() if not _same(root / path, content)]


def write_files(root: Path) -> list[str]:
    """Writes the generated files under ``root``; returns the ones that changed."""
    files = generated_files()
    changed = stale_files(root, files)
    for path in changed:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        write_whole(target, files[path])
    return changed
