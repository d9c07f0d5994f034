"""A training loop written as the docs show it, checked by ``mypy --strict`` (``tests/test_typing.py``) and
run: a documented usage the annotations refuse makes a typed user cast or ignore what works."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from staleness_metrics import (
    MismatchSums,
    Rollout,
    Sample,
    Sink,
    StalenessConfig,
    StalenessMonitor,
    StepReport,
    mismatch_sums,
)
from staleness_metrics.exporters import BackgroundExporter


@dataclass(frozen=True)
class Printer:
    """An exporter whose ``name`` is read only (docs/exporters.md: a string, ``export`` and ``close``)."""

    name: str = "printer"

    def export(self, report: StepReport) -> None:
        assert report.step > 0

    def close(self) -> None:
        pass


class Named:
    @property
    def name(self) -> str:
        return "named"

    def export(self, report: StepReport) -> None:
        assert report.step > 0

    def close(self) -> None:
        pass


def training_loop() -> list[int]:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=8), [Printer(), Named(), BackgroundExporter(Printer())])
    steps = []
    for step in np.arange(1, 4, dtype=np.int64):  # steps may be numpy integers (docs/getting-started.md)
        rollout = Rollout(id=f"r{step}", samples=[Sample(mask=[0, 1, 1])], dispatch_version=int(step) - 1)
        monitor.add(rollout)  # a typed rollout, as Sink.add takes it
        monitor.sweep(step)
        shipment = monitor.ship(step)
        trainer: list[float | None] = [None, -0.2, None]  # null outside the loss mask (docs/multi-gpu.md)
        monitor.record_mismatch(step, mismatch_sums(shipment.lags, [None, -0.25, -0.5], trainer))
        assert isinstance(monitor.mismatch(step), MismatchSums) and monitor.mismatch_metrics(step) is not None
        steps.append(shipment.step)
    monitor.close()
    steps.append(Sink(StalenessConfig()).ship(np.uint64(9)).step)
    return steps


async def prime_rl_orchestrator() -> int:
    """docs/trainers/prime-rl.md's monitor is awaited as prime-rl awaits its monitors."""
    from staleness_metrics.adapters.prime_rl_monitor import PrimeRlMonitor

    staleness = PrimeRlMonitor(StalenessMonitor(StalenessConfig(max_staleness=8)))
    await staleness.log([], 1, "train", "all")
    await staleness.finalize()
    return len(staleness.shipments)
