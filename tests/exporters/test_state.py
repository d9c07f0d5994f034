"""Cumulative state: exact bucket mapping, env partition, snapshots."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from staleness_metrics.exporters.state import CumulativeState, Snapshot, bucket_counts, partition_by_env
from staleness_metrics.metrics.buckets import BUCKETS
from staleness_metrics.metrics.report import StepReport, Tally
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import FAR_CONFIG, FAR_SHIPS, far_records, far_staleness, hand_report


def test_integer_histogram_maps_exactly_onto_the_buckets() -> None:
    counts = np.zeros(70, dtype=np.int64)
    counts[[0, 3, 16, 17, 32, 33, 64, 65, 69]] = [5, 1, 2, 3, 4, 6, 7, 8, 9]
    point = bucket_counts(counts)
    by_bound = dict(zip([*BUCKETS, float("inf")], point.bucket_counts, strict=True))
    assert by_bound[0.0] == 5 and by_bound[3.0] == 1 and by_bound[16.0] == 2
    assert by_bound[32.0] == 3 + 4  # 17..32 fall in (16, 32]
    assert by_bound[64.0] == 6 + 7  # 33..64
    assert by_bound[float("inf")] == 8 + 9
    assert point.count == int(counts.sum())
    assert point.sum == int(np.dot(np.arange(70), counts))
    assert (point.min, point.max) == (0, 69)
    assert point.cumulative()[-1] == point.count


def test_empty_histogram() -> None:
    point = bucket_counts(np.zeros(0, dtype=np.int64))
    assert point.count == 0 and point.min is None and sum(point.bucket_counts) == 0


def test_partition_covers_the_whole_window() -> None:
    report = hand_report(1, {"": [[1]], "math": [[2, 3]]}, dropped={"code": 1})
    # a window whose per-env tallies miss something (e.g. invalid rollouts without an env)
    extra = Tally(rollouts_invalid=2)
    report = type(report)(**{**report.__dict__, "tally": report.tally + extra})
    parts = partition_by_env(report)
    assert sum(parts.values(), Tally()) == report.tally
    assert parts[""].rollouts_invalid == 2
    assert partition_by_env(report, by_env=False) == {"": report.tally}


def test_snapshots_accumulate_counters_and_keep_last_gauges() -> None:
    state = CumulativeState("r", by_env=True)
    first = state.apply(hand_report(1, {"math": [[1, 2]]}))
    second = state.apply(hand_report(2, {"": [[4]]}))
    assert second.cumulative.counters["tokens_sampled"] == {"": 1, "math": 2}
    assert second.delta.counters["tokens_sampled"] == {"": 1}
    assert second.gauges["token_mean"] == {"": 4.0}
    assert first.gauges["token_mean"] == {"": 1.5, "math": 1.5}  # earlier snapshots never change
    assert second.cumulative.histograms["token_staleness"]["math"].count == 2
    assert second.start_time_ns == first.start_time_ns and second.time_ns > first.time_ns
    assert second.previous_time_ns == first.time_ns


def test_live_mismatch_sums_move_only_the_mismatch_counters_and_deltas_add_up() -> None:
    """A trainer's sums (the live path) add to the mismatch counters; the tally counters, histograms and
    the last ship's gauges stay, and their deltas are 0 (OTLP delta temporality must not re-send a ship)."""
    from staleness_metrics.metrics.mismatch import mismatch_sums

    state = CumulativeState("r")
    before = state.apply(hand_report(1, {"": [[1, 2]]}))
    assert before.cumulative.counters["mismatch_tokens"] == {}  # no sums yet
    assert before.cumulative.counters["mismatch_uncovered"] == {}
    sums = mismatch_sums([0, 1, 1, 70], [-1.0] * 4, [-1.0, -1.5, float("nan"), -0.5])
    live = state.apply_mismatch(1, sums)
    tokens = live.cumulative.counters["mismatch_tokens"]
    assert list(tokens) == [("", v) for v in ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12",
                                              "13", "14", "15", "16", "32", "64", "+Inf")]  # fmt: skip
    assert (tokens[("", "0")], tokens[("", "1")], tokens[("", "+Inf")]) == (1, 1, 1)
    assert live.delta.counters["mismatch_tokens"] == tokens
    assert live.cumulative.counters["mismatch_uncovered"] == live.delta.counters["mismatch_uncovered"] == {"": 1}
    assert live.cumulative.counters["tokens_sampled"] == before.cumulative.counters["tokens_sampled"] == {"": 2}
    assert live.delta.counters["tokens_sampled"] == {"": 0}
    assert live.delta.histograms["token_staleness"][""].count == 0
    assert live.gauges == before.gauges and live.step == 1
    length = live.delta.counters["length_sampled_tokens"]
    assert set(length.values()) == {0}
    after = state.apply(hand_report(2, {"": [[0]]}))  # a ship without sums: the mismatch totals stay
    assert after.cumulative.counters["mismatch_tokens"] == tokens
    assert set(after.delta.counters["mismatch_tokens"].values()) == {0}
    assert after.delta.counters["mismatch_uncovered"] == {"": 0}


def test_a_ship_read_later_shows_that_ship_and_equals_one_read_at_once() -> None:
    """A queued OTLP send or a late scrape reads a ship's snapshot after later ships were folded in: it still
    shows that ship, value for value what a snapshot read at once shows."""
    reports = [hand_report(1, {"math": [[1, 2]]}), hand_report(2, {"": [[4]], "code": [[0, 5]]}),
               hand_report(3, {"math": [[3]]}, dropped={"code": 1})]  # fmt: skip
    later, at_once = CumulativeState("r", by_env=True), CumulativeState("r", by_env=True)
    pending = [later.apply(report) for report in reports]  # nothing read until every ship is in

    def shown(snapshot: Snapshot) -> tuple[object, ...]:
        return snapshot.step, snapshot.cumulative, snapshot.delta, snapshot.gauges

    read = [shown(at_once.apply(report)) for report in reports]
    for snapshot, eager in zip(pending, read, strict=True):
        assert shown(snapshot) == eager
        assert snapshot.cumulative is snapshot.cumulative  # built once
    first = pending[0]
    assert first.cumulative.counters["tokens_sampled"] == {"math": 2} and first.step == 1
    assert [p.time_ns for p in pending] == sorted({p.time_ns for p in pending})  # ship order kept


_COUNTS = st.lists(st.integers(0, 50), max_size=6).map(lambda values: np.array(values, dtype=np.int64))


@st.composite
def _tallies(draw: st.DrawFn) -> Tally:
    return Tally(
        **{f.name: draw(_COUNTS if f.type == "Counts" else st.integers(0, 50)) for f in fields(Tally)}  # type: ignore[arg-type]
    )


def _floored_difference(a: Tally, b: Tally) -> Tally:
    """The definition: field by field, the arrays index by index (the shorter one read as zeros); a
    highest staleness above ``b``'s, or a lowest below it (or ``b`` without one: 0), is ``a``'s."""
    values: dict[str, object] = {}
    for f in fields(Tally):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            n = max(len(x), len(y))
            values[f.name] = np.maximum(np.pad(x, (0, n - len(x))) - np.pad(y, (0, n - len(y))), 0)
        elif f.name.endswith("_top_max"):
            values[f.name] = x if x > y else 0
        elif f.name.endswith("_top_min"):
            values[f.name] = x if x and (not y or x < y) else 0
        else:
            values[f.name] = max(x - y, 0)
    return Tally(**values)  # type: ignore[arg-type]


@given(_tallies(), _tallies())
def test_a_window_s_excess_over_its_envs_is_the_floored_difference_and_within_says_when_it_is_empty(
    window: Tally, covered: Tally
) -> None:
    excess = window.excess_over(covered)
    expected = _floored_difference(window, covered)
    for f in fields(Tally):  # exact arrays, lengths included (== trims trailing zeros)
        mine, theirs = getattr(excess, f.name), getattr(expected, f.name)
        assert np.array_equal(mine, theirs) if isinstance(mine, np.ndarray) else mine == theirs, f.name
    assert window.within(covered) == (excess == Tally())
    assert window.within(window) and window.excess_over(window) == Tally()


def far_reports() -> list[StepReport]:
    reports = []
    with StalenessMonitor(FAR_CONFIG, [], run="r") as monitor:
        for ship, (step, _) in enumerate(FAR_SHIPS):
            monitor.add(far_records(ship))
            reports.append(monitor.ship(step).report)
    return reports


def saved_before_the_exact_top(state: Any) -> Any:
    """``state`` as saved before the tallies kept the exact staleness of the histograms' last index."""
    if isinstance(state, dict):
        top = ("_beyond", "_top_min", "_top_max")  # (a tally's fields the older states lack)
        kept = {k: v for k, v in state.items() if not ("token_histogram" in state and k.endswith(top))}
        return {k: saved_before_the_exact_top(v) for k, v in kept.items()}
    return [saved_before_the_exact_top(v) for v in state] if isinstance(state, list) else state


def test_a_state_keeps_the_exact_staleness_from_4096_up_and_one_saved_before_continues() -> None:
    """Saved and loaded, the histograms' sum, min and max stay exact; a state saved before they were
    kept (docs/checkpoints.md) loads, what it folded counts at 4096 as it did, and what follows is exact."""
    first, second, *_ = far_reports()
    state = CumulativeState("r", by_env=True)
    state.apply(first)
    saved = json.loads(json.dumps(state.state_dict()))
    tokens, _ = far_staleness(2, "far")
    before = [min(t, 4096) for t in far_staleness(1, "far")[0]]
    after = tokens[len(before) :]
    for loaded, values in ((saved, tokens), (saved_before_the_exact_top(saved), [*before, *after])):
        point = CumulativeState("r", by_env=True).loaded(loaded, "state").apply(second)
        got = point.cumulative.histograms["token_staleness"]["far"]
        assert (got.count, got.sum, got.min, got.max) == (len(values), sum(values), min(values), max(values))
