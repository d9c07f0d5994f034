"""SPEC 15's shared call on plain numpy batches: masks land in the caller's arrays, dropped rows are left
out, held rows come back with the call that ships them, errors name the trainer's field and counter."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.adapters._ship import TrainerArray, TrainerNames, ship_rows
from staleness_metrics.errors import FieldError, TraceError
from staleness_metrics.records.columnar import RolloutBatch

NAMES = TrainerNames(
    "demo", "policy_version", {"dispatch_version": "starts[{row}]", "token_versions": "versions[{row}]"}
)


def padded(ids: list[str], mask: list[list[int]], start: list[int], groups: list[str] | None = None):  # type: ignore[no-untyped-def]
    array = np.array(mask, dtype=np.int64)
    return array, RolloutBatch.from_padded(ids, array, dispatch_version=np.array(start), group_ids=groups)


def test_masks_in_place_drops_left_out_and_lags_per_position() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    mask, batch = padded(["old", "mid", "new"], [[0, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]], [0, 3, 5])
    result = ship_rows(monitor, [(batch, "source", None)], version=5, names=NAMES)  # T = 5: lags 5, 2, 0
    (part,) = result.parts
    assert part.source == "source" and part.rows.tolist() == [1, 2] and not part.every_row
    assert result.shipment.dropped_rollouts == ("old",)
    assert part.lag_matrix().tolist() == [[2, 2, -1, -1], [-1, 0, 0, 0]]
    assert mask[1:].tolist() == [[1, 1, 0, 0], [0, 1, 1, 1]]  # the caller's own array, kept rows unmasked


def test_held_rows_come_back_with_the_call_that_ships_them() -> None:
    config = StalenessConfig(policy="xtuner", max_staleness=1, retry_expired=True)
    monitor = StalenessMonitor(config)
    _, first = padded(["g-stale", "g-fresh"], [[1, 1], [1, 1]], [0, 4], groups=["g", "g"])
    held = ship_rows(monitor, [(first, "first", None)], version=4, names=NAMES)
    assert held.parts == () and held.shipment.held == ("g-fresh",)
    assert held.shipment.dropped_rollouts == ("g-stale",)
    _, second = padded(["g-retry"], [[1, 1]], [4], groups=["g"])
    shipped = ship_rows(monitor, [(second, "second", None)], version=4, names=NAMES)
    assert [(p.source, p.rows.tolist()) for p in shipped.parts] == [("first", [1]), ("second", [0])]
    later = ship_rows(monitor, [(padded(["later"], [[1]], [4])[1], "third", None)], version=4, names=NAMES)
    assert later.parts[0].every_row


def test_a_version_above_the_trained_one_names_the_field_row_and_counter() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    _, batch = padded(["a", "b"], [[1], [1]], [1, 3])
    with pytest.raises(TraceError) as caught:
        ship_rows(monitor, [(batch, None, None)], version=2, names=NAMES)
    assert caught.value.rollout_id == "b" and caught.value.field == "starts[1]"
    assert "pass demo's policy_version" in str(caught.value)
    with pytest.raises(TypeError, match="policy_version"):
        ship_rows(monitor, [(batch, None, None)], version=None, names=NAMES)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("columns", "field"),
    [({"dispatch_version": np.array([5, 9])}, "starts[1]"),
     ({"token_versions": np.array([[5, 5], [5, 9]])}, "samples[0].weight_versions")],
)  # fmt: skip
def test_a_call_refused_for_a_version_above_the_trained_one_leaves_nothing_queued(
    columns: dict[str, np.ndarray], field: str
) -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    batch = RolloutBatch.from_padded(["a", "b"], np.ones((2, 2), dtype=np.int64), **columns)  # type: ignore[arg-type]
    with pytest.raises(TraceError, match="version 9 is above the trained version 5") as caught:
        ship_rows(monitor, [(batch, None, None)], version=5, names=NAMES)
    assert (caught.value.rollout_id, caught.value.field) == ("b", field)
    assert monitor.sink.queued == 0 and monitor.sink.step == 0  # as an add-time refusal: no add, no ship
    _, later = padded(["c"], [[1, 1]], [5])
    assert ship_rows(monitor, [(later, "later", None)], version=5, names=NAMES).parts[0].every_row


def test_a_call_refused_for_a_version_below_the_last_ship_leaves_nothing_queued() -> None:
    """A version that went back (the wrong counter passed) is refused before the add, as one above."""
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    _, first = padded(["a"], [[1, 1]], [4])
    ship_rows(monitor, [(first, "first", None)], version=5, names=NAMES)
    _, back = padded(["b"], [[1, 1]], [2])
    with pytest.raises(FieldError, match=r"^version: 3: step: 4 is below the previous step 6") as caught:
        ship_rows(monitor, [(back, "back", None)], version=3, names=NAMES)
    assert "pass demo's policy_version" in caught.value.reason
    assert monitor.sink.queued == 0 and monitor.sink.step == 6  # no add, no ship
    _, later = padded(["c"], [[1, 1]], [5])
    result = ship_rows(monitor, [(later, "later", None)], version=6, names=NAMES)
    assert [(p.source, p.rows.tolist()) for p in result.parts] == [("later", [0])]


def test_a_set_aside_id_repeating_a_held_row_leaves_the_held_row_to_come_back() -> None:
    config = StalenessConfig(policy="xtuner", max_staleness=1, retry_expired=True, strict=False)
    monitor = StalenessMonitor(config)
    _, first = padded(["q0", "q1", "q2"], [[1], [1], [1]], [0, 3, 3], groups=["q"] * 3)
    assert ship_rows(monitor, [(first, "first", None)], version=3, names=NAMES).parts == ()  # q1, q2 held
    _, repeat = padded(["x", "q1"], [[1], [1]], [3, 3], groups=["x", "q"])
    result = ship_rows(monitor, [(repeat, "repeat", None)], version=3, names=NAMES)
    assert [(p.source, p.rows.tolist()) for p in result.parts] == [("repeat", [0])]
    assert [e.rollout_id for e in result.shipment.invalid] == ["q1"]  # the repeat, set aside
    _, retry = padded(["q7"], [[1]], [3], groups=["q"])
    result = ship_rows(monitor, [(retry, "retry", None)], version=3, names=NAMES)
    assert [(p.source, p.rows.tolist()) for p in result.parts] == [("first", [1, 2]), ("retry", [0])]
    assert monitor.sink.queued == 0


def test_a_copy_is_written_back_into_the_caller_array() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=0))
    owned = np.asfortranarray(np.array([[1, 1, 0], [0, 1, 1]], dtype=np.int32))  # not viewable flat
    view = TrainerArray(owned)
    batch = RolloutBatch.from_padded(
        ["x", "y"], view.array, token_versions=np.array([[2, 3, 3], [3, 3, 3]]), attention_mask=np.ones((2, 3))
    )
    ship_rows(monitor, [(batch, owned, lambda: view.write_back(batch.mask))], version=3, names=NAMES)
    assert owned.tolist() == [[0, 1, 0], [0, 1, 1]] and owned.dtype == np.int32


@given(
    calls=st.lists(
        st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4)), min_size=1, max_size=5), min_size=1, max_size=4
    ),
    bound=st.integers(0, 3),
)
def test_every_row_entered_is_returned_once_or_dropped(calls: list[list[tuple[int, int]]], bound: int) -> None:
    """Over several calls (versions never decreasing), each row comes back exactly once or is named dropped,
    and its lags are ``T - start`` on its sampled positions, -1 elsewhere."""
    monitor = StalenessMonitor(StalenessConfig(max_staleness=bound))
    version, returned, dropped = 6, [], []
    for number, rows in enumerate(calls):
        ids = [f"c{number}r{k}" for k in range(len(rows))]
        mask = np.array([[1] * n + [0] * (4 - n) for _, n in rows], dtype=np.int64)
        starts = np.array([start for start, _ in rows])
        batch = RolloutBatch.from_padded(ids, mask, dispatch_version=starts)
        result = ship_rows(monitor, [(batch, ids, None)], version=version, names=NAMES)
        dropped += result.shipment.dropped_rollouts
        for part in result.parts:
            for row, lag in zip(part.rows.tolist(), part.lag_matrix()):
                start, n = calls[int(part.source[row][1:].split("r")[0])][row]
                assert lag.tolist() == [version - start] * n + [-1] * (4 - n)
                returned.append(part.source[row])
    entered = [f"c{number}r{k}" for number, rows in enumerate(calls) for k in range(len(rows))]
    assert sorted(returned + dropped) == sorted(entered) and len(set(returned)) == len(returned)
