"""Write xtuner-owed-2.json: format 2 checkpoints of an xtuner policy owing re-rollouts, its groups numbered
with gaps (rollouts without a group), which test_old_checkpoints.py loads and continues.

Run once with the tree before checkpoints of meaning (format 3: the parent of 865499a):
``PYTHONPATH=<that tree> python tests/engine/old_checkpoints/make_owed.py <its commit>``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import staleness_metrics
from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.exporters.prometheus import PrometheusExporter

CONFIG = {
    "adapt_every": None, "adapt_high": 16, "adapt_low": 1, "cost_window": 20, "env_breakdown": False,
    "floor_max_age": 100, "floor_min_tokens": 1000, "lenient": False, "max_staleness": 3,
    "max_token_staleness": None, "mismatch_budget": None, "policy": "xtuner", "retry_expired": True,
    "sync_interval": 1,
}  # fmt: skip


def rollout(rid: str, dispatch: int, group: str | None = None) -> dict[str, Any]:
    found = {"id": rid, "dispatch_version": dispatch, "samples": [{"mask": [1, 1]}]}
    return found if group is None else {**found, "group_id": group}


CALLS: list[dict[str, Any]] = [
    {"call": "add", "rollouts": [rollout("lone", 0), rollout("x", 0, "h"), rollout("b", 3, "g"),
                                 rollout("y", 3, "h"), rollout("lone2", 3)]},
    {"call": "ship", "step": 5, "ids": ["y"]},  # x and lone expire: h owes a re-rollout (y held)
    {"call": "ship", "step": 6, "ids": ["b", "y"]},  # b ships (g owes none), y still held
    {"call": "add", "rollouts": [rollout("z", 5, "h"), rollout("c", 5)]},  # h's re-rollout
    {"call": "ship", "step": 7, "ids": None},
]  # fmt: skip


def main() -> None:
    config = StalenessConfig(policy="xtuner", max_staleness=3, retry_expired=True)
    monitor = StalenessMonitor(config, [PrometheusExporter(port=None)], run="ckpt")
    checkpoints = []
    for index, call in enumerate(CALLS):
        if index:
            checkpoints.append({"before_call": index, "state": json.loads(json.dumps(monitor.state_dict()))})
        if call["call"] == "add":
            monitor.add(call["rollouts"])
        else:
            monitor.ship(call["step"], call["ids"])
    made_by = f"staleness_metrics {staleness_metrics.__version__} at {sys.argv[1]}"
    record = {"calls": CALLS, "checkpoints": checkpoints, "config": CONFIG, "made_by": made_by}
    (Path(__file__).resolve().parent / "xtuner-owed-2.json").write_text(json.dumps(record, sort_keys=True))


if __name__ == "__main__":
    main()
