"""A ship's population in one compiled pass (``population.population_summary``) against the steps it replaced: the
sums pass with the rest in numpy (``compute._population_in_numpy``), on random slices and windows: every metric
(value and type) and every tally field equal."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.metrics import compute
from staleness_metrics.metrics.compute import WindowCounts
from staleness_metrics.metrics.population import population_summary
from tests.engine.test_ship_kernels import BOUNDS, columns, numpy_population, random_slice


def as_slice(t: int, a: dict[str, Any]) -> Any:
    """The fields of a ``Judgement`` the population reads."""
    sample_rollout = np.repeat(np.arange(len(a["frozen"])), np.diff(a["sample_offsets"]))
    span_sample = np.repeat(np.arange(len(a["dropped"])), np.diff(a["span_offsets"]))
    return SimpleNamespace(
        step=t + 1, trained_version=t, n_rollouts=len(a["frozen"]), sample_rollout=sample_rollout,
        span_sample=span_sample, env=np.zeros(len(a["frozen"]), dtype=np.int64), **a,
    )  # fmt: skip


def a_window(seed: int) -> WindowCounts:
    rng = np.random.default_rng(seed)
    window = WindowCounts()
    if rng.random() < 0.5:  # an empty window: the usual case
        return window
    for name in WindowCounts.FIELDS:
        n = int(rng.integers(0, 4))
        window.add(rng.integers(0, 2, n), name, rng.integers(0, 50, n) if name == "tokens_dropped" else None)
    n = int(rng.integers(0, 4))
    window.add_dropped_lengths(rng.integers(0, 2, n), rng.integers(0, 30000, n))
    return window


def plain(tally: Any) -> dict[str, Any]:
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in vars(tally).items()}


def assert_same_population(t: int, rollout_in: Any, a: dict[str, Any], window: WindowCounts, env: int | None) -> None:
    slice_ = as_slice(t, a)
    try:
        want = compute._population_in_numpy(slice_, rollout_in, env, window, 3)
    except ValueError as error:  # a staleness below 0: the numpy steps refuse it, and so does the new path
        with pytest.raises(ValueError, match=str(error)[:20]):
            compute._population(slice_, rollout_in, env, window, 3)
        return
    got = compute._population(slice_, rollout_in, env, window, 3)
    assert repr(list(got[0].items())) == repr(list(want[0].items()))  # values and their types, in order
    assert plain(got[1]) == plain(want[1])
    assert got[1] == want[1]


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rollouts=st.integers(0, 12),
    spread=st.sampled_from([0, 3, 5000]),
    env=st.sampled_from([None, 0, 1]),
)
def test_the_one_pass_population_equals_the_numpy_steps(seed: int, rollouts: int, spread: int, env: int | None) -> None:
    t, rollout_in, a = random_slice(seed, rollouts, spread)
    assert_same_population(t, rollout_in, a, a_window(seed), env)
    assert_same_population(t, np.ones(rollouts, dtype=bool), a, WindowCounts(), None)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rollouts=st.integers(0, 12), spread=st.sampled_from([0, 3, 5000]))
def test_the_summary_sums_equal_the_numpy_sums(seed: int, rollouts: int, spread: int) -> None:
    t, rollout_in, a = random_slice(seed, rollouts, spread)
    a["version"] = np.minimum(a["version"], t)  # a ship's versions: none above the trained one
    a["dispatch"] = np.minimum(a["dispatch"], t)
    quantiles = np.array([[50, 100], [90, 100], [99, 100], [1, 3]], dtype=np.int64)
    got = population_summary(t, rollout_in, columns(a), BOUNDS, (4096, 64), quantiles)
    want = numpy_population(t, rollout_in, a)
    if want["by_staleness"] and max(want["by_staleness"]) - min(want["by_staleness"]) >= 4096:
        assert got is None  # too wide a range to count by value: the numpy steps
        return
    assert got is not None
    assert [got.tokens, got.masked, got.unlabelled, got.frozen, got.samples] == [
        want[name] for name in ("tokens", "masked", "unlabelled", "frozen", "samples")
    ]
    assert got.token_dot == want["token_dot"]
    rollout, in_flight, newest = (np.array(want[k], dtype=np.int64) for k in ("rollout", "in_flight", "newest"))
    in_queue = rollout - in_flight
    assert got.live == len(rollout)
    for total, top, values in (
        (got.rollout_sum, got.rollout_max, rollout),
        (got.in_flight_sum, got.in_flight_max, in_flight),
        (got.in_queue_sum, got.in_queue_max, in_queue),
        (got.newest_sum, got.newest_max, newest),
    ):
        assert total == int(values.sum())
        assert not len(values) or top == int(values.max())
    values = sorted(v for v, c in want["by_staleness"].items() for _ in range(c))
    assert len(got.quantiles) == (len(quantiles) if values else 0)
    for q, (numerator, denominator) in enumerate(quantiles.tolist()):
        if values:
            rank = max(1, -(-numerator * len(values) // denominator))
            assert got.quantiles[q] == values[rank - 1]
    token_histogram = np.zeros(min(max(values), 64) + 1 if values else 0, dtype=np.int64)
    for v in values:
        token_histogram[min(v, 64)] += 1
    assert got.token_histogram.tolist() == token_histogram.tolist()
    rollout_histogram = np.zeros(min(int(rollout.max()), 64) + 1 if len(rollout) else 0, dtype=np.int64)
    np.add.at(rollout_histogram, np.minimum(rollout, 64), 1)
    assert got.rollout_histogram.tolist() == rollout_histogram.tolist()
    assert got.length_sampled.tolist() == want["length_sampled"]
    assert got.length_removed.tolist() == want["length_removed"]


def test_a_staleness_below_zero_is_left_to_the_general_path() -> None:
    t, _, a = random_slice(5, 6, 3)
    a["dispatch"] = a["dispatch"] + 2 * t + 10  # rollouts without sampled spans then report a negative staleness
    a["sampled"] = np.zeros_like(a["sampled"])
    a["frozen"] = np.zeros(6, dtype=bool)
    got = population_summary(t, np.ones(6, dtype=bool), columns(a), BOUNDS, (4096, 64), np.array([[50, 100]]))
    assert got is None
