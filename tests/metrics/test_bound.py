"""SPEC 14 by hand: each floor source, the window, pool-adjacent-violators, the budget, the advice and the
adaptive bound, on sums whose per-bucket token counts and k3 are chosen so every number is checked by eye."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import ConfigError, StalenessConfig
from staleness_metrics.metrics.bound import (
    BoundAdvice,
    BoundTracker,
    Curve,
    adapt_bound,
    advise,
    bound_metrics,
    budget_of,
    excess_curve,
    isotonic_increasing,
    select_floor,
)
from staleness_metrics.metrics.mismatch import LAG_BUCKETS, MismatchSums


def sums_of(buckets: dict[int, tuple[int, float]]) -> MismatchSums:
    """Sums with ``tokens`` covered positions of mean k3 ``k3`` per bucket index (other sums zero)."""
    lags: dict[str, Any] = {}
    for i, name in enumerate(LAG_BUCKETS):
        tokens, k3 = buckets.get(i, (0, 0.0))
        lags[name] = {
            "tokens": tokens, "masked": 0, "out_of_band": 0, "sum_log_ratio": 0.0,
            "sum_abs_log_ratio": 0.0, "sum_k3": tokens * k3, "sum_ratio": 0.0, "sum_ratio_sq": 0.0,
        }  # fmt: skip
    return MismatchSums.from_dict({"format": 1, "uncovered": 0, "lags": lags})


# ---------------------------------------------------------------------- the floor
def test_floor_lag0_when_bucket_0_has_enough_tokens() -> None:
    floor = select_floor(sums_of({0: (1000, 0.002), 1: (5000, 0.01)}), 7, (0.5, 6), min_tokens=1000, max_age=100)
    assert floor is not None
    assert (floor.value, floor.source, floor.step, floor.age) == (0.002, "lag0", 7, 0)


def test_floor_carried_from_the_last_lag0_ship_within_max_age() -> None:
    # 999 tokens at lag 0 are not enough: the floor measured at step 3 is carried to step 103 (age 100) ...
    sums = sums_of({0: (999, 0.9), 2: (4000, 0.02)})
    floor = select_floor(sums, 103, (0.003, 3), min_tokens=1000, max_age=100)
    assert floor is not None
    assert (floor.value, floor.source, floor.step, floor.age) == (0.003, "carried", 3, 100)
    # ... but not to step 104: the smallest bucket with enough tokens (lag 2) gives an upper bound.
    floor = select_floor(sums, 104, (0.003, 3), min_tokens=1000, max_age=100)
    assert floor is not None
    assert (floor.value, floor.source, floor.step, floor.age) == (0.02, "min_lag", 104, 0)


def test_floor_min_lag_takes_the_smallest_bucket_with_enough_tokens() -> None:
    sums = sums_of({1: (10, 0.0), 3: (50, 0.01), 5: (50, 0.03), 17: (60, 0.2)})
    floor = select_floor(sums, 9, None, min_tokens=50, max_age=100)
    assert floor is not None and (floor.value, floor.source) == (0.01, "min_lag")
    # Beyond 16 counts too (the bucket named 32).
    floor = select_floor(sums, 9, None, min_tokens=60, max_age=100)
    assert floor is not None and (floor.value, floor.source) == (0.2, "min_lag")


def test_no_floor_when_no_bucket_has_enough_tokens() -> None:
    assert select_floor(sums_of({0: (10, 0.0), 4: (999, 0.1)}), 5, None, min_tokens=1000, max_age=100) is None
    # A lag0 floor measured later than this ship (a late call) is never carried backwards.
    assert select_floor(sums_of({4: (10, 0.1)}), 5, (0.001, 6), min_tokens=1000, max_age=100) is None


# ---------------------------------------------------------------------- pool-adjacent-violators
def test_isotonic_keeps_a_non_decreasing_sequence_and_its_ties() -> None:
    assert isotonic_increasing([0.1, 0.2, 0.2, 0.5], [1, 2, 3, 4]) == [0.1, 0.2, 0.2, 0.5]


def test_isotonic_pools_violators_by_weight() -> None:
    # 0.3 (weight 1) then 0.1 (weight 3) violate: pooled to (0.3 + 0.3) / 4 = 0.15; then 0.4 stays.
    assert isotonic_increasing([0.3, 0.1, 0.4], [1, 3, 2]) == pytest.approx([0.15, 0.15, 0.4])
    # [1, 3, 0] (weights 1, 1, 2): 3 and 0 pool to (3*1 + 0*2) / 3 = 1.0, a tie with the 1 before: no pooling.
    assert isotonic_increasing([1.0, 3.0, 0.0], [1, 1, 2]) == pytest.approx([1.0, 1.0, 1.0])
    # [2, 3, 0] (weights 1, 1, 1): 3 and 0 pool to 1.5 < 2, so all three pool to 5/3.
    assert isotonic_increasing([2.0, 3.0, 0.0], [1, 1, 1]) == pytest.approx([5 / 3] * 3)


def test_isotonic_refuses_bad_weights() -> None:
    with pytest.raises(ValueError, match="weights: must be > 0"):
        isotonic_increasing([0.1], [0])
    with pytest.raises(ValueError, match="weights: length"):
        isotonic_increasing([0.1, 0.2], [1])


# ---------------------------------------------------------------------- the curve, the budget, the advice
def test_curve_over_buckets_1_to_16_with_enough_tokens() -> None:
    window = sums_of({
        0: (5000, 0.001),  # never on the curve
        1: (1000, 0.003), 2: (999, 0.5),  # lag 2 lacks tokens
        3: (3000, 0.002),  # violates lag 1: pooled to (1000*0.002 + 3000*0.001) / 4000 = 0.00125 (excess)
        16: (2000, 0.011), 17: (9000, 0.9),  # the bucket named 32 is never on the curve
    })  # fmt: skip
    curve = excess_curve(window, 0.001, min_tokens=1000)
    assert curve.lags == (1, 3, 16)
    assert curve.tokens == (1000, 3000, 2000)
    assert curve.raw == pytest.approx((0.002, 0.001, 0.010))
    assert curve.fitted == pytest.approx((0.00125, 0.00125, 0.010))


def test_budget_is_the_floor_unless_set() -> None:
    assert budget_of(None, 0.004) == 0.004
    assert budget_of(0.02, 0.004) == 0.02


def curve(lags: tuple[int, ...], fitted: tuple[float, ...]) -> Curve:
    return Curve(lags, tuple(1000 for _ in lags), fitted, fitted)


def test_advice_when_the_budget_is_crossed() -> None:
    advice = advise(curve((1, 2, 4, 6), (0.001, 0.002, 0.003, 0.009)), 0.003, 5)
    # The largest lag with ê <= 0.003 is 4; lag 6 is above it; at bound 5 the largest lag <= 5 is 4.
    assert advice == BoundAdvice(suggested=4, crossed=True, excess_at_bound=0.003)


def test_advice_when_the_budget_is_never_crossed() -> None:
    advice = advise(curve((2, 3), (0.001, 0.002)), 0.01, 8)
    assert advice == BoundAdvice(suggested=3, crossed=False, excess_at_bound=0.002)


def test_advice_suggests_0_when_the_first_lag_is_above_budget_and_leaves_out_excess_below_the_curve() -> None:
    advice = advise(curve((3, 4), (0.02, 0.03)), 0.01, 2)
    assert advice == BoundAdvice(suggested=0, crossed=True, excess_at_bound=None)
    assert advise(curve((), ()), 0.01, 2) is None


def test_adaptation_steps() -> None:
    crossed_below = BoundAdvice(suggested=3, crossed=True, excess_at_bound=0.1)
    crossed_above = BoundAdvice(suggested=9, crossed=True, excess_at_bound=0.0)
    crossed_at = BoundAdvice(suggested=6, crossed=True, excess_at_bound=0.0)
    clear_above = BoundAdvice(suggested=8, crossed=False, excess_at_bound=0.0)
    clear_below = BoundAdvice(suggested=4, crossed=False, excess_at_bound=0.0)
    assert adapt_bound(6, crossed_below, 1, 16) == 5  # toward the suggestion, one step
    assert adapt_bound(6, crossed_above, 1, 16) == 7
    assert adapt_bound(6, crossed_at, 1, 16) == 6
    assert adapt_bound(6, clear_above, 1, 16) == 7  # a looser bound may be as good
    assert adapt_bound(8, clear_above, 1, 16) == 9  # suggested >= bound: up
    assert adapt_bound(6, clear_below, 1, 16) == 6  # the data does not reach the bound: stay
    assert adapt_bound(6, crossed_below, 6, 16) == 6  # the clamps
    assert adapt_bound(8, clear_above, 1, 8) == 8


def test_bound_metrics_keys_and_types() -> None:
    tracker = BoundTracker(StalenessConfig(max_staleness=2, floor_min_tokens=100))
    ship = tracker.observe(1, sums_of({0: (100, 0.001), 1: (100, 0.0015), 3: (200, 0.004)}))
    assert ship is not None
    assert bound_metrics(ship) == pytest.approx({
        "staleness/mismatch/floor": 0.001,
        "staleness/mismatch/floor_age": 0,
        "staleness/mismatch/floor_source": "lag0",
        "staleness/mismatch/budget": 0.001,
        "staleness/mismatch/curve/lag_1": 0.0005,
        "staleness/mismatch/curve/lag_3": 0.003,
        "staleness/bound/suggested": 1,
        "staleness/bound/crossed": 1,
        "staleness/bound/excess_at_bound": 0.0005,
    })  # fmt: skip
    assert isinstance(bound_metrics(ship)["staleness/mismatch/floor_source"], str)


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"floor_min_tokens": 0}, "floor_min_tokens: must be in 1.."),
        ({"floor_max_age": -1}, "floor_max_age: must be in 0.."),
        ({"cost_window": 0}, "cost_window: must be in 1.."),
        ({"mismatch_budget": -0.1}, "mismatch_budget: must be >= 0"),
        ({"mismatch_budget": float("nan")}, "mismatch_budget: expected a finite number"),
        ({"mismatch_budget": "0.1"}, "mismatch_budget: expected a finite number"),
        ({"adapt_every": 0}, "adapt_every: must be in 1.."),
        ({"adapt_low": 5, "adapt_high": 4}, "adapt_low: 5 is above adapt_high 4"),
        ({"policy": "episode", "adapt_every": 2}, "adapt_every: only the 'token' policy"),
        ({"policy": "group", "adapt_high": 8}, "adapt_high: only the 'token' policy"),
        ({"adapt_every": 2, "max_staleness": 20}, "max_staleness: 20 is outside adapt_low..adapt_high 1..16"),
    ],
)
def test_config_refuses(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        StalenessConfig(**settings)


def test_config_defaults() -> None:
    config = StalenessConfig()
    assert (config.floor_min_tokens, config.floor_max_age, config.cost_window) == (1000, 100, 20)
    assert (config.mismatch_budget, config.adapt_every, config.adapt_low, config.adapt_high) == (None, None, 1, 16)
    assert StalenessConfig(mismatch_budget=1).mismatch_budget == 1.0


# ---------------------------------------------------------------------- the tracker
def test_window_holds_the_last_cost_window_ships() -> None:
    tracker = BoundTracker(StalenessConfig(cost_window=2, floor_min_tokens=100))
    # Step 1 measures the floor 0.001; lag 1 has 60 tokens per ship: on the curve once two ships add up.
    first = tracker.observe(1, sums_of({0: (100, 0.001), 1: (60, 0.003)}))
    assert first is not None and first.curve.lags == ()
    second = tracker.observe(2, sums_of({1: (60, 0.005)}))
    assert second is not None and second.floor is not None and second.floor.source == "carried"
    assert second.curve.lags == (1,) and second.curve.fitted == pytest.approx((0.004 - 0.001,))
    # Step 3: the window is steps 2 and 3 (cost_window 2); step 1's tokens left it.
    third = tracker.observe(3, sums_of({1: (40, 0.011)}))
    assert third is not None and third.curve.fitted == pytest.approx(((60 * 0.005 + 40 * 0.011) / 100 - 0.001,))
    assert [step for step, _ in tracker.window] == [2, 3]
    # A ship without a covered position reports nothing and does not enter the window.
    assert tracker.observe(4, MismatchSums.zero()) is None
    assert [step for step, _ in tracker.window] == [2, 3]


def test_two_ships_of_one_step_are_two_ships_unless_merged() -> None:
    tracker = BoundTracker(StalenessConfig(floor_min_tokens=100))
    tracker.observe(1, sums_of({0: (100, 0.001)}))
    tracker.observe(2, sums_of({1: (50, 0.002)}))
    tracker.observe(2, sums_of({1: (50, 0.002)}))  # a second ship at step 2 (the sink)
    assert tracker.window_sums().tokens[1] == 100
    ship = tracker.observe(2, sums_of({1: (80, 0.002)}), merge=True)  # the trainer's total of step 2 so far
    assert tracker.window_sums().tokens[1] == 130
    assert ship is not None and ship.curve.lags == (1,)


@settings(max_examples=60, deadline=None)
@given(
    ships=st.lists(
        st.tuples(
            st.integers(1, 4), st.dictionaries(st.integers(0, 19), st.tuples(st.integers(1, 500), st.floats(0, 1)))
        ),
        min_size=1,
        max_size=30,
    ),
    window=st.integers(1, 8),
)
def test_window_sums_are_the_sums_of_its_ships(
    ships: list[tuple[int, dict[int, tuple[int, float]]]], window: int
) -> None:
    tracker = BoundTracker(StalenessConfig(cost_window=window, floor_min_tokens=50))
    step, observed = 0, []
    for gap, buckets in ships:
        step += gap
        sums = sums_of(buckets)
        tracker.observe(step, sums)
        if sums.covered:
            observed.append(sums)
    expected = MismatchSums.zero()
    for sums in observed[-window:]:
        expected = expected + sums
    got = tracker.window_sums()
    assert got.tokens.tolist() == expected.tokens.tolist()
    assert got == expected  # added in the same order: equal to the last bit
