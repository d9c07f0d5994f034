"""What the Prometheus exporter adds to a small ship (issue 20), measured turn about in one process.

    python bench/export.py [--ships 1000] [--repeat 3] [--json]

A monitor adds one rollout of 16 positions and ships it (the service's small ship), with a
``PrometheusExporter`` attached (no port: the service's setup) and without; the two ship turn about,
the best p50 of ``--repeat`` rounds kept. Run without and with the env breakdown (three envs). Reported:

- **ship ratio**: ship p50 with the exporter over ship p50 without. Goal: <= 1.15.
- **export share**: the exporter's own ``export`` p50 (timed alone on the same reports) over the ship
  p50 without it: what a ship pays for exporting.
- **scrape**: one text exposition after the run (the series are built at scrape time, once per ship read).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from staleness_metrics import StalenessConfig
from staleness_metrics.exporters.base import ExportContext
from staleness_metrics.exporters.prometheus import PrometheusExporter
from staleness_metrics.metrics.report import StepReport
from staleness_metrics.monitor import StalenessMonitor

GOAL_SHIP_RATIO = 1.15
ENVS = ("math", "code", "chat")


def rollout(i: int, by_env: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"id": f"r{i}", "dispatch_version": 0, "samples": [{"mask": [0] * 4 + [1] * 12}]}
    if by_env:
        record["env"] = ENVS[i % len(ENVS)]
    return record


def ships(count: int, by_env: bool) -> tuple[float, float, list[StepReport]]:
    """p50 of a small ship without and with the exporter (the two monitors ship turn about, after a tenth of
    warm-up), and the reports of the ships without it."""
    config = StalenessConfig(max_staleness=4, env_breakdown=by_env)
    monitors = [StalenessMonitor(config), StalenessMonitor(config, exporters=[PrometheusExporter(port=None)])]
    times: list[list[float]] = [[], []]
    reports: list[StepReport] = []
    for i in range(count):
        for which in (0, 1) if i % 2 else (1, 0):
            monitors[which].add([rollout(i, by_env)])
            start = time.perf_counter()
            shipment = monitors[which].ship(1 + i // 10)
            times[which].append(time.perf_counter() - start)
            if which == 0:
                reports.append(shipment.report)
    for monitor in monitors:
        monitor.close()
    without, with_exporter = (statistics.median(t[count // 10 :]) for t in times)
    return without, with_exporter, reports


def export_p50(reports: list[StepReport], by_env: bool) -> tuple[float, float]:
    """p50 of the exporter's ``export`` alone on ``reports``, and one scrape after them."""
    exporter = PrometheusExporter(port=None)
    exporter.attach(ExportContext(env_breakdown=by_env))
    times = []
    for report in reports:
        start = time.perf_counter()
        exporter.export(report)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    exporter.exposition()
    scrape = time.perf_counter() - start
    exporter.close()
    return statistics.median(times[len(times) // 10 :]), scrape


def measure(count: int, repeat: int, by_env: bool) -> dict[str, float]:
    without, with_exporter, export, scrape = [], [], [], []
    for _ in range(repeat):
        plain, exported, reports = ships(count, by_env)
        without.append(plain)
        with_exporter.append(exported)
        alone, after = export_p50(reports, by_env)
        export.append(alone)
        scrape.append(after)
    ship = min(without)
    return {
        "ship_p50_ms": ship * 1e3,
        "ship_with_prometheus_p50_ms": min(with_exporter) * 1e3,
        "ship_ratio": min(with_exporter) / ship,
        "export_p50_ms": min(export) * 1e3,
        "export_share": min(export) / ship,
        "scrape_ms": min(scrape) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ships", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {
        name: measure(args.ships, args.repeat, by_env) for name, by_env in (("plain", False), ("env_breakdown", True))
    }
    if args.json:
        print(json.dumps({"goal_ship_ratio": GOAL_SHIP_RATIO, **results}, indent=2))
        return
    for name, r in results.items():
        verdict = "ok" if r["ship_ratio"] <= GOAL_SHIP_RATIO else "ABOVE GOAL"
        print(
            f"{name}: ship p50 {r['ship_p50_ms']:.3f} ms, with Prometheus {r['ship_with_prometheus_p50_ms']:.3f} ms "
            f"(ratio {r['ship_ratio']:.2f}, goal <= {GOAL_SHIP_RATIO}: {verdict}); export alone "
            f"{r['export_p50_ms']:.3f} ms = {r['export_share']:.2f} of a ship; scrape {r['scrape_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
