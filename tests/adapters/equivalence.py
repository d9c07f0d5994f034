"""The same rollouts through two doors: an adapter's columnar batch and SPEC 3 records.

``compare_ships`` adds each to its own sink, runs the same steps, and returns the two ship results so
tests can assert identical decisions, metrics and masked arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from staleness_metrics import RolloutBatch, Sink, StalenessConfig
from staleness_metrics.engine.shipment import Shipment


@dataclass
class Both:
    adapter: list[Shipment]
    records: list[Shipment]


def compare_ships(
    batch: RolloutBatch, records: Sequence[dict[str, Any]], config: StalenessConfig, steps: Sequence[int]
) -> Both:
    """Ship both inputs at each step; assert equal decisions and metrics on the way."""
    via_adapter, via_records = Sink(config), Sink(config)
    via_adapter.add(batch)
    via_records.add(list(records))
    both = Both([], [])
    for step in steps:
        a, r = via_adapter.ship(step), via_records.ship(step)
        assert dict(a.metrics) == dict(r.metrics), f"step {step}"
        assert sorted(a.dropped_rollouts) == sorted(r.dropped_rollouts)
        assert sorted(a.dropped_samples) == sorted(r.dropped_samples)
        assert sorted(a.held) == sorted(r.held)
        assert [x.id for x in a.rollouts] == [x.id for x in r.rollouts]
        assert a.report.tally == r.report.tally
        both.adapter.append(a)
        both.records.append(r)
    return both


def shipped_records(shipment: Shipment) -> dict[str, dict[str, Any]]:
    return {r.id: r.record() for r in shipment.rollouts}
