"""What users open: Grafana dashboards, Prometheus rules and a W&B workspace, generated from the
metric table (``staleness-metrics dashboards`` writes them; ``--check`` finds drift)."""

from __future__ import annotations

# the modules are the API: artifacts, grafana, rules, wandb_panels, collector, promql
__all__: list[str] = []
