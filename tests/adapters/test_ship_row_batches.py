"""``ship_rows``: a trainer batch held as several row batches ships in one ship, each part handed back
with its own source, and errors name the row of the batch it came from."""

from __future__ import annotations

import numpy as np
import pytest

from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.adapters._ship import TrainerNames, ship_rows
from staleness_metrics.errors import TraceError
from staleness_metrics.records.columnar import RolloutBatch

NAMES = TrainerNames("demo", "policy_version", {"dispatch_version": "starts[{row}]"})


def rows(ids: list[str], width: int, start: list[int]):  # type: ignore[no-untyped-def]
    mask = np.ones((len(ids), width), dtype=np.int64)
    return mask, RolloutBatch.from_padded(ids, mask, dispatch_version=np.array(start))


def test_several_batches_one_ship_parts_in_order() -> None:
    exports: list[int] = []

    class Steps:
        name = "steps"

        def export(self, report: object) -> None:
            exports.append(report.step)  # type: ignore[attr-defined]

        def close(self) -> None:
            pass

    monitor = StalenessMonitor(StalenessConfig(max_staleness=1), [Steps()])
    (_, first), (_, second), (_, third) = rows(["a", "b"], 2, [5, 3]), rows(["c"], 3, [1]), rows(["d"], 1, [4])
    result = ship_rows(
        monitor, [(first, "first", None), (second, "second", None), (third, "third", None)], version=5, names=NAMES
    )
    assert exports == [6]  # one ship, one export
    assert [(p.source, p.rows.tolist()) for p in result.parts] == [("first", [0]), ("third", [0])]
    assert [p.lag_matrix().tolist() for p in result.parts] == [[[0, 0]], [[1]]]
    assert sorted(result.shipment.dropped_rollouts) == ["b", "c"]


def test_an_error_names_the_row_of_its_own_batch() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=1))
    (_, first), (_, second) = rows(["a"], 1, [2]), rows(["b", "c"], 1, [2, 7])
    with pytest.raises(TraceError) as caught:
        ship_rows(monitor, [(first, 1, None), (second, 2, None)], version=3, names=NAMES)
    assert caught.value.rollout_id == "c" and caught.value.field == "batch[1].starts[1]"  # as add-time refusals
    assert "pass demo's policy_version" in caught.value.reason
