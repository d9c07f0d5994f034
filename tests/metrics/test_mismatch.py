"""SPEC 11 by hand: lag buckets, clamping, coverage, masked counts, the lag-0 floor, and exact merging."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import (
    LAG_BUCKETS,
    FieldError,
    MismatchSums,
    Sink,
    StalenessConfig,
    StalenessError,
    TraceError,
    mismatch_sums,
)
from staleness_metrics.metrics.buckets import N_BUCKETS
from staleness_metrics.metrics.mismatch import COUNT_FIELDS, LAG_UPPER_BOUNDS, LOG_RATIO_CLAMP, SUM_FIELDS

BOUNDS = np.asarray(LAG_UPPER_BOUNDS, dtype=np.int64)


def k3(d: float) -> float:
    return math.exp(d) - 1 - d


def test_lag_buckets_are_named_by_their_upper_bound() -> None:
    lags = [0, 1, 16, 17, 32, 33, 64, 65, 10_000]
    sums = mismatch_sums(lags, [0.0] * len(lags), [0.0] * len(lags))
    assert LAG_BUCKETS[16:] == ("16", "32", "64", "inf")
    tokens = dict(zip(LAG_BUCKETS, sums.tokens.tolist()))
    assert {b: n for b, n in tokens.items() if n} == {"0": 1, "1": 1, "16": 1, "32": 2, "64": 2, "inf": 2}


def test_hand_computed_keys_of_one_batch() -> None:
    # lag 0: d = 0.1, -0.1 (the numeric floor); lag 3: d = 0.5, 1.0 (r = 2.718 is out of band); lag 40: d = -1.0
    lags = [0, 0, 3, 3, 40]
    sampler = [-1.0, -1.0, -2.0, -2.0, -1.0]
    trainer = [-0.9, -1.1, -1.5, -1.0, -2.0]
    d = [t - s for t, s in zip(trainer, sampler)]
    floor = (k3(d[0]) + k3(d[1])) / 2
    metrics = mismatch_sums(lags, sampler, trainer, masked=[False, False, True, False, True]).metrics(floor=floor)

    assert metrics["staleness/mismatch/lag_0/tokens"] == 2
    assert metrics["staleness/mismatch/lag_0/k3"] == pytest.approx(floor, rel=1e-12)
    assert "staleness/mismatch/lag_0/excess_k3" not in metrics  # SPEC 14: every bucket but 0
    assert metrics["staleness/mismatch/lag_3/k3"] == pytest.approx((k3(d[2]) + k3(d[3])) / 2, rel=1e-12)
    assert metrics["staleness/mismatch/lag_3/excess_k3"] == pytest.approx((k3(d[2]) + k3(d[3])) / 2 - floor)
    assert metrics["staleness/mismatch/lag_3/abs_log_ratio"] == pytest.approx(0.75)
    assert metrics["staleness/mismatch/lag_3/out_of_band"] == 0.5  # exp(1.0) > 2
    r = [math.exp(x) for x in d[2:4]]
    assert metrics["staleness/mismatch/lag_3/ess"] == pytest.approx(sum(r) ** 2 / (2 * sum(x * x for x in r)))
    assert metrics["staleness/mismatch/lag_64/tokens"] == 1
    assert metrics["staleness/mismatch/lag_64/out_of_band"] == 1.0  # exp(-1) < 0.5
    assert metrics["staleness/mismatch/lag_64/ess"] == 1.0
    assert metrics["staleness/mismatch/k3"] == pytest.approx(sum(map(k3, d)) / 5)
    stale = (k3(d[2]) + k3(d[3]) + k3(d[4])) / 3
    assert metrics["staleness/mismatch/excess_k3"] == pytest.approx(stale - floor)
    assert metrics["staleness/mismatch/coverage"] == 1.0
    assert not any("lag_1/" in key or "lag_inf/" in key for key in metrics)  # buckets without tokens


def test_masked_positions_count_in_the_sums_and_apart() -> None:
    sums = mismatch_sums([2, 2, 2], [-1.0, -1.0, -1.0], [-1.5, -1.0, -0.5], masked=np.array([True, True, False]))
    assert sums.tokens[2] == 3 and sums.masked[2] == 2
    assert sums.sum_log_ratio[2] == pytest.approx(0.0)


def test_log_ratio_is_clamped_at_twenty_nats() -> None:
    sums = mismatch_sums([1, 1], [-100.0, -1.0], [-1.0, -100.0])
    assert sums.sum_log_ratio[1] == 0.0
    assert sums.sum_abs_log_ratio[1] == 40.0
    assert sums.sum_ratio[1] == pytest.approx(math.exp(20) + math.exp(-20))
    assert sums.sum_k3[1] == pytest.approx(k3(20.0) + k3(-20.0))
    assert sums.out_of_band[1] == 2


@pytest.mark.parametrize("dtype", [np.float64, np.longdouble])
def test_finite_log_probabilities_whose_difference_overflows_are_covered_and_clamped(dtype: Any) -> None:
    """SPEC 11 leaves uncovered only a value that is absent, null, NaN or infinite: two finite ones whose
    difference is past float64 are clamped, as any other difference past 20 (a run with a ratio on a band
    edge counts its out-of-band positions again: the same rule there)."""
    lags = [0, 0, 1, 1, 2]
    sampler = np.array([-1e308, 1e308, -1e308, 0.0, -1e308], dtype=dtype)
    trainer = np.array([1e308, -1e308, 1e308, math.log(2.0), np.inf], dtype=dtype)
    sums = mismatch_sums(lags, sampler, trainer)
    assert sums.covered == 4 and sums.uncovered == 1
    clamped = mismatch_sums(lags, [-1.0, 1.0, -1.0, 0.0, -1.0], [50.0, -50.0, 50.0, math.log(2.0), np.inf])
    assert sums == clamped
    assert sums.sum_abs_log_ratio[0] == 40.0 and sums.out_of_band[0] == 2


def test_uncovered_positions_are_counted_never_an_error() -> None:
    nan, inf = float("nan"), float("inf")
    sums = mismatch_sums([0, 0, 1, 1, 1, -1], [-1.0, nan, -1.0, -inf, -1.0, -1.0], [-1.0, -1.0, inf, -1.0, nan, -1.0])
    assert sums.covered == 1 and sums.uncovered == 4  # the lag -1 position is outside the population
    assert sums.metrics()["staleness/mismatch/coverage"] == 0.2
    # a list holding None (a missing value, null in a record) is uncovered too, as NaN
    assert mismatch_sums([0, 0, 1], [-1.0, None, -1.0], [-1.0, -1.0, None]) == mismatch_sums(
        [0, 0, 1], [-1.0, nan, -1.0], [-1.0, -1.0, nan]
    )
    with pytest.raises(FieldError, match="sampler_logprobs"):
        mismatch_sums([0, 0], [-1.0, "-1.0"], [-1.0, -1.0])  # (a string is not read as a number)


def test_nothing_covered_leaves_the_family_out() -> None:
    assert mismatch_sums([0, 3], [float("nan")] * 2, [-1.0, -1.0]).metrics() == {}
    assert mismatch_sums([], [], []).metrics() == {}


def test_without_a_floor_there_are_no_excess_keys() -> None:
    metrics = mismatch_sums([0, 2, 5], [-1.0, -1.0, -1.0], [-1.0, -1.2, -0.7]).metrics()
    assert "staleness/mismatch/excess_k3" not in metrics
    assert not any(key.endswith("/excess_k3") for key in metrics)
    assert metrics["staleness/mismatch/lag_2/tokens"] == 1


def test_only_lag_zero_has_no_overall_excess() -> None:
    metrics = mismatch_sums([0, 0], [-1.0, -1.0], [-1.2, -0.7]).metrics(floor=0.01)
    assert not any(key.endswith("excess_k3") for key in metrics)
    assert "staleness/mismatch/excess_k3" not in metrics


def test_band_is_configurable() -> None:
    sums = mismatch_sums([0, 0], [0.0, 0.0], [math.log(1.5), math.log(0.9)], band=(0.95, 1.2))
    assert sums.out_of_band[0] == 2
    with pytest.raises(ValueError, match="band"):
        mismatch_sums([0], [0.0], [0.0], band=(2.0, 1.0))


@pytest.mark.parametrize("band", ["x", (1.0, "2"), (0.5,), None])
def test_a_band_of_the_wrong_type_is_named(band: Any) -> None:
    from staleness_metrics.errors import FieldError

    with pytest.raises(FieldError) as found:
        mismatch_sums([0], [0.0], [0.0], band=band)
    assert found.value.field == "band"


def test_array_likes_and_two_dimensional_batches() -> None:
    lags = np.array([[0, 1], [1, -1]])
    sampler = np.array([[-1.0, -1.0], [-2.0, -2.0]], dtype=np.float32)
    trainer = [[-1.0, -0.5], [-2.5, 0.0]]
    sums = mismatch_sums(lags, sampler, trainer, masked=np.array([[0, 1], [0, 0]]))
    assert sums.tokens[:2].tolist() == [1, 2] and sums.masked[1] == 1


def test_wrong_lengths_name_the_field() -> None:
    """Each refusal is a FieldError (a StalenessError, and a ValueError as before) naming the argument."""
    calls: list[tuple[str, Any]] = [
        ("trainer_logprobs", lambda: mismatch_sums([0, 1], [0.0, 0.0], [0.0])),
        ("masked", lambda: mismatch_sums([0, 1], [0.0, 0.0], [0.0, 0.0], masked=[True, False, True])),
        ("lags", lambda: mismatch_sums([0.5], [0.0], [0.0])),
        ("sampler_logprobs", lambda: mismatch_sums([0], ["x"], [0.0])),
        ("band", lambda: mismatch_sums([0], [0.0], [0.0], band=(0.0, 1.0))),
    ]
    for field, call in calls:
        with pytest.raises(FieldError) as caught:
            call()
        assert caught.value.field == field and isinstance(caught.value, (ValueError, StalenessError))
        assert str(caught.value).startswith(f"{field}: ") and caught.value.reason in str(caught.value)
    with pytest.raises(ValueError, match="trainer_logprobs: length 1 differs"):
        mismatch_sums([0, 1], [0.0, 0.0], [0.0])
    with pytest.raises(ValueError, match="lags: expected integers"):
        mismatch_sums([0.5], [0.0], [0.0])
    with pytest.raises(ValueError, match="masked: expected booleans or integers, got dtype float64"):
        mismatch_sums([0, 1], [0.0, 0.0], [0.0, 0.0], masked=np.array([1.0, 0.0]))
    for lags in ([3], [3, 4]):  # a missing argument, not one missing position
        with pytest.raises(ValueError, match=r"^trainer_logprobs: required, got None$"):
            mismatch_sums(lags, [-1.0] * len(lags), None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- the dict


def test_dict_round_trip_through_json_is_exact() -> None:
    rng = np.random.default_rng(3)
    n = 500
    sums = mismatch_sums(rng.integers(-1, 90, n), rng.normal(-1, 1, n), rng.normal(-1, 1, n), rng.random(n) < 0.2)
    again = MismatchSums.from_dict(json.loads(json.dumps(sums.to_dict())))
    assert again == sums
    assert again.metrics() == sums.metrics()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["lags"].pop("7"), "lags.7: missing lag bucket"),
        (lambda d: d["lags"]["3"].__setitem__("tokens", -1), "lags.3.tokens: must be >= 0"),
        (lambda d: d.__setitem__("uncovered", -2), "uncovered: must be >= 0"),
        (lambda d: d["lags"]["3"].__setitem__("tokens", 10**30), "lags.3.tokens: must fit int64"),
        (lambda d: d["lags"]["2"].__setitem__("sum_k3", 10**400), "lags.2.sum_k3: expected a finite"),
        (lambda d: d["lags"]["0"].__setitem__("masked", 5), "lags.0.masked: 5 exceeds tokens"),
        (lambda d: d["lags"]["inf"].__setitem__("sum_k3", float("nan")), "lags.inf.sum_k3: expected a finite"),
        (lambda d: d["lags"]["1"].__setitem__("tokens", True), "lags.1.tokens: expected a non-negative integer"),
        (lambda d: d["lags"].__setitem__("65", {}), "lags.65: unknown lag bucket"),
        (lambda d: d.__setitem__("format", 9), "format: unknown"),
        (lambda d: d.pop("lags"), "lags: required"),
    ],
)
def test_bad_dicts_name_the_field(edit: Any, field: str) -> None:
    data = mismatch_sums([0, 3], [-1.0, -1.0], [-1.0, -1.5]).to_dict()
    edit(data)
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        MismatchSums.from_dict(data)


def _at_the_clamp(n: int) -> MismatchSums:
    """The largest sums a pass makes: ``n`` positions in lag 0 at d = 20, ``n`` in lag 1 at d = -20."""
    lags = [0] * n + [1] * n
    return mismatch_sums(lags, [-30.0] * n + [-10.0] * n, [-10.0] * n + [-30.0] * n)


@pytest.mark.parametrize(
    ("bucket", "field", "value"),
    [
        ("0", "sum_k3", 1.7e308),  # finite, but the all-bucket k3 would be inf (and written as null)
        ("0", "sum_k3", 3 * (math.exp(20) - 21) * (1 + 1e-9)),  # just past three tokens at the clamp
        ("1", "sum_log_ratio", -3 * 20 * (1 + 1e-9)),
        ("1", "sum_abs_log_ratio", 61.0),
        ("0", "sum_ratio", 3 * math.exp(20) * (1 + 1e-9)),
        ("0", "sum_ratio_sq", 1e18),
        ("5", "sum_ratio", 1e-300),  # a bucket without tokens sums to nothing
    ],
)
def test_sums_no_pass_could_make_are_refused_naming_the_bucket_and_field(bucket: str, field: str, value: float) -> None:
    """d is clamped to ±20, so a token adds at most 20 to Σ|d|, e^20 - 21 to Σk3, e^20 to Σr, e^40 to Σr²: past
    tokens times that the sums are not a pass's (from a dict, or merged from sums built by hand)."""
    data = _at_the_clamp(3).to_dict()
    data["lags"][bucket][field] = value
    outside = rf"^lags\.{bucket}\.{field}: \S+ is outside \S+, what \d+ tokens add \(d in ±20\)$"
    with pytest.raises(FieldError, match=outside) as caught:
        MismatchSums.from_dict(data)
    assert caught.value.field == f"lags.{bucket}.{field}"
    by_hand = _at_the_clamp(3)
    getattr(by_hand, field)[LAG_BUCKETS.index(bucket)] = value
    with pytest.raises(FieldError, match=rf"^lags\.{bucket}\.{field}: "):
        MismatchSums.zero().merged(by_hand)


def test_sums_at_the_clamp_are_accepted_and_merge_to_their_rounding() -> None:
    """The cap leaves float rounding its slack: the largest sums a pass makes load, and merge, untouched."""
    parts = [_at_the_clamp(n) for n in (1, 3, 1000, 12345)]
    total = MismatchSums.zero()
    for part in parts:
        assert MismatchSums.from_dict(json.loads(json.dumps(part.to_dict()))) == part
        total = total.merged(part)
    assert total.tokens[:2].tolist() == [13349, 13349]
    assert MismatchSums.from_dict(total.to_dict()) == total
    assert math.isfinite(total.metrics()["staleness/mismatch/k3"])


# ---------------------------------------------------------------------------------------------- merging


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 300),
    cuts=st.lists(st.integers(0, 300), max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_sums_over_any_split_add_up_to_the_whole(n: int, cuts: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    lags = rng.integers(-1, 100, n)
    sampler = rng.normal(-1, 2, n)
    trainer = np.where(rng.random(n) < 0.1, np.nan, rng.normal(-1, 2, n))
    masked = rng.random(n) < 0.3
    whole = mismatch_sums(lags, sampler, trainer, masked)
    bounds = sorted({0, n, *(c for c in cuts if c <= n)})
    parts = [mismatch_sums(lags[a:b], sampler[a:b], trainer[a:b], masked[a:b]) for a, b in itertools.pairwise(bounds)]
    merged = sum(parts, MismatchSums.zero())
    for name in ("tokens", "masked", "out_of_band"):  # counts: exact
        assert np.array_equal(getattr(merged, name), getattr(whole, name))
    assert merged.uncovered == whole.uncovered
    for name in ("sum_log_ratio", "sum_abs_log_ratio", "sum_k3", "sum_ratio", "sum_ratio_sq"):  # to rounding
        np.testing.assert_allclose(getattr(merged, name), getattr(whole, name), rtol=1e-12, atol=1e-9)
    last = parts[-1] if parts else MismatchSums.zero()
    change = whole - (merged - last)  # a revised total's change, added to what was merged before it
    for name in ("tokens", "masked", "out_of_band"):
        assert np.array_equal(getattr(change, name), getattr(last, name))
    assert change.uncovered == last.uncovered
    for name in (
        "sum_log_ratio",
        "sum_abs_log_ratio",
        "sum_k3",
        "sum_ratio",
        "sum_ratio_sq",
    ):  # to the totals' rounding
        scale = np.abs(getattr(whole, name)) + np.abs(getattr(merged, name))
        assert np.all(np.abs(getattr(change, name) - getattr(last, name)) <= 1e-12 * scale + 1e-12)


def test_blocks_do_not_change_the_answer() -> None:
    """The computation runs in blocks; positions on either side of a block boundary land in their buckets."""
    rng = np.random.default_rng(11)
    n = (1 << 16) + 123
    lags, sampler, trainer = rng.integers(0, 17, n), rng.normal(-1, 1, n), rng.normal(-1, 1, n)  # one lag a bucket
    masked = rng.random(n) < 0.5
    sums = mismatch_sums(lags, sampler, trainer, masked)
    assert np.array_equal(sums.tokens, np.bincount(lags, minlength=len(LAG_BUCKETS)))
    assert np.array_equal(sums.masked, np.bincount(lags[masked], minlength=len(LAG_BUCKETS)))
    d = trainer - sampler
    np.testing.assert_allclose(sums.sum_k3, np.bincount(lags, weights=np.expm1(d) - d, minlength=len(LAG_BUCKETS)))


# ---------------------------------------------------------------------------------------------- in the sink


def test_a_ship_reports_the_family_from_its_records_and_its_lags_line_up() -> None:
    sink = Sink(StalenessConfig(max_staleness=2))
    sink.add(
        [
            {
                "id": "a",
                "dispatch_version": 0,
                "samples": [
                    {
                        "mask": [0, 1, 1, 1],
                        "token_versions": [-1, 0, 1, -1],  # the last one unlabelled: dispatch 0
                        "logprobs": [0.0, -1.0, -1.0, -1.0],
                        "trainer_logprobs": [None, -1.5, None, -0.5],
                    }
                ],
            },
            {"id": "b", "dispatch_version": 3, "samples": [{"mask": [1, 1], "logprobs": [-1.0, -2.0]}]},
            {"id": "f", "source": "frozen", "samples": [{"mask": [1], "trainer_logprobs": [0.0], "logprobs": [0.0]}]},
        ]
    )
    shipment = sink.ship(4)  # T = 3, bound 1: version 0 is masked, version 1 trains
    assert shipment.lags.tolist() == [-1, 3, 2, 3, 0, 0, -1]  # mask-0 and frozen positions are -1
    assert shipment.lag_offsets.tolist() == [0, 4, 6, 7]
    metrics = shipment.metrics
    assert metrics["staleness/mismatch/lag_3/tokens"] == 2
    assert metrics["staleness/mismatch/lag_3/k3"] == pytest.approx((k3(-0.5) + k3(0.5)) / 2)
    assert metrics["staleness/mismatch/coverage"] == 2 / 5  # a's unlabelled position and b have no trainer value
    assert shipment.report.mismatch is not None
    assert shipment.report.mismatch.masked[3] == 2  # both covered positions were masked (v=0 < bound 1)
    assert "staleness/mismatch/excess_k3" not in metrics  # 2 covered tokens: no floor (floor_min_tokens 1000)
    records = [r.record() for r in shipment.rollouts]
    assert records[0]["samples"][0]["trainer_logprobs"] == [None, -1.5, None, -0.5]


def test_a_missing_sampler_logprob_counts_as_a_missing_trainer_one_and_is_written_back_as_null() -> None:
    """SPEC 11, either value: a record lacking the sampler's value (null, NaN, ±inf) at a position gives the
    sums of the record lacking the trainer's value there; a shipped record writes each as null."""
    nan, inf = float("nan"), float("inf")

    def shipped(sampler: list[Any], trainer: list[Any]) -> tuple[MismatchSums, list[dict[str, Any]]]:
        sink = Sink(StalenessConfig(max_staleness=2))
        sample = {"mask": [0, 1, 1, 1, 1, 1], "token_versions": [-1, 0, 0, 1, 1, 2],
                  "logprobs": sampler, "trainer_logprobs": trainer}  # fmt: skip
        sink.add({"id": "a", "dispatch_version": 0, "samples": [sample]})
        shipment = sink.ship(4)
        assert shipment.report.mismatch is not None
        return shipment.report.mismatch, [s for r in shipment.rollouts for s in r.record()["samples"]]

    sampler_side, samples = shipped([0.0, -1.0, None, nan, -inf, inf], [None, -1.5, -1.0, -0.5, -1.0, -1.0])
    trainer_side, _ = shipped([0.0, -1.0, -1.0, -1.0, -1.0, -1.0], [None, -1.5, None, nan, -inf, inf])
    assert sampler_side == trainer_side and sampler_side.covered == 1 and sampler_side.uncovered == 4
    assert samples[0]["logprobs"] == [0.0, -1.0, None, None, None, None]
    assert samples[0]["mask"] == [0, 0, 0, 1, 1, 1]  # T = 3, bound 2: version 0 masked, as with finite values


def test_the_live_call_on_shipped_arrays_equals_the_sink_computation() -> None:
    rng = np.random.default_rng(5)
    records = []
    for i in range(30):
        n = int(rng.integers(1, 40))
        dispatch = int(rng.integers(0, 6))
        versions = np.minimum(dispatch + rng.integers(0, 3, n), 6).tolist()
        records.append(
            {
                "id": f"r{i}",
                "dispatch_version": dispatch,
                "samples": [
                    {
                        "mask": rng.integers(0, 2, n).tolist(),
                        "token_versions": [v if rng.random() > 0.1 else -1 for v in versions],
                        "logprobs": rng.normal(-1, 1, n).tolist(),
                        "trainer_logprobs": rng.normal(-1, 1, n).tolist(),
                    }
                ],
            }
        )
    sink = Sink(StalenessConfig(max_staleness=2))
    sink.add(records)
    shipment = sink.ship(8)
    shipped = [s for r in shipment.rollouts for s in r.record()["samples"]]
    mask = np.concatenate([s["mask"] for s in shipped])
    sampler = np.concatenate([s["logprobs"] for s in shipped])
    trainer = np.concatenate([s["trainer_logprobs"] for s in shipped])
    live = mismatch_sums(shipment.lags, sampler, trainer, masked=mask == 0)
    assert shipment.report.mismatch is not None
    assert np.array_equal(live.tokens, shipment.report.mismatch.tokens)
    assert np.array_equal(live.masked, shipment.report.mismatch.masked)
    np.testing.assert_allclose(live.sum_k3, shipment.report.mismatch.sum_k3, rtol=1e-12)


def test_trainer_logprobs_of_the_wrong_length_name_rollout_and_field() -> None:
    sink = Sink(StalenessConfig())
    bad = {"id": "x", "dispatch_version": 0, "samples": [{"mask": [1, 1], "trainer_logprobs": [0.0]}]}
    with pytest.raises(TraceError) as caught:
        sink.add(bad)
    assert (caught.value.rollout_id, caught.value.field) == ("x", "samples[0].trainer_logprobs")
    assert "length 1 differs" in str(caught.value)
    with pytest.raises(TraceError, match=r"samples\[0\]\.trainer_logprobs"):
        sink.add({"id": "y", "dispatch_version": 0, "samples": [{"mask": [1], "trainer_logprobs": ["-1"]}]})
    assert sink.queued == 0


def test_a_ship_without_trainer_logprobs_has_no_family() -> None:
    sink = Sink(StalenessConfig())
    sink.add({"id": "a", "dispatch_version": 0, "samples": [{"mask": [1, 1], "logprobs": [-1.0, -1.0]}]})
    shipment = sink.ship(1)
    assert shipment.report.mismatch is None
    assert not any(key.startswith("staleness/mismatch/") for key in shipment.metrics)


# ---------------------------------------------------------------------------------------------- the compiled pass


def numpy_mismatch_sums(
    lags: np.ndarray, sampler: np.ndarray, trainer: np.ndarray, masked: np.ndarray | None, band: tuple[float, float]
) -> MismatchSums:
    """The former numpy formulation (blocks of runs, ``reduceat`` per quantity), kept as the reference."""
    totals = NumpyBlocks(*band)
    for start in range(0, len(lags), CHUNK):
        block = slice(start, start + CHUNK)
        totals.add(lags[block], sampler[block], trainer[block], None if masked is None else masked[block])
    return MismatchSums(**totals.counts, **totals.sums, uncovered=totals.uncovered)


CHUNK = 1 << 16  # positions per block


class NumpyBlocks:
    """Block-wise sums. Lags come in runs (a sample's span of one version), so each quantity is reduced per
    run of equal lag with one ``reduceat`` and only the runs are binned: no per-position bucketing. Positions
    outside the population (lag < 0) form runs of their own, which are left out whole."""

    def __init__(self, lo: float, hi: float) -> None:
        self.counts = {f: np.zeros(N_BUCKETS, dtype=np.int64) for f in COUNT_FIELDS}
        self.sums = {f: np.zeros(N_BUCKETS) for f in SUM_FIELDS}
        self.uncovered = 0
        self.lo, self.hi = lo, hi

    def add(
        self,
        lag: npt.NDArray[Any],
        sampler: npt.NDArray[Any],
        trainer: npt.NDArray[Any],
        flags: npt.NDArray[Any] | None,
    ) -> None:
        if len(lag) == 0:
            return
        starts = np.concatenate(([0], np.flatnonzero(lag[1:] != lag[:-1]) + 1))
        run_lag = lag[starts]
        inside = run_lag >= 0
        if not inside.any():
            return
        bucket = np.searchsorted(BOUNDS, run_lag[inside], "left")

        def per_bucket(values: npt.NDArray[Any], dtype: type) -> npt.NDArray[Any]:
            runs = np.add.reduceat(values, starts, dtype=dtype)[inside]
            return np.bincount(bucket, weights=runs, minlength=N_BUCKETS).astype(dtype)

        d = trainer.astype(np.float64)
        d -= sampler  # NaN / inf propagate: those positions are uncovered
        high, low = float(d.max()), float(d.min())  # NaN if any is NaN: one pass answers both questions
        everywhere = math.isfinite(high) and math.isfinite(low)
        finite = None if everywhere else np.isfinite(d)
        if finite is None:
            run_lengths = np.diff(np.append(starts, len(lag)))[inside]
            tokens = np.bincount(bucket, weights=run_lengths, minlength=N_BUCKETS).astype(np.int64)
        else:
            d[~finite] = 0.0  # adds nothing to Σd and Σ|d|; the ratio is zeroed below
            tokens = per_bucket(finite, np.int64)
            run_lengths = np.diff(np.append(starts, len(lag)))[inside]
            self.uncovered += int(run_lengths.sum()) - int(tokens.sum())
        if not everywhere or high > LOG_RATIO_CLAMP or low < -LOG_RATIO_CLAMP:
            np.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP, out=d)
        r = np.exp(d)
        out_of_band = r < self.lo
        out_of_band |= r > self.hi
        if finite is not None:
            r[~finite] = 0.0
            out_of_band &= finite
        counts, sums = self.counts, self.sums
        counts["tokens"] += tokens
        if flags is not None:
            counts["masked"] += per_bucket(flags if finite is None else flags & finite, np.int64)
        counts["out_of_band"] += per_bucket(out_of_band, np.int64)
        sum_d = per_bucket(d, np.float64)
        sum_r = per_bucket(r, np.float64)
        sums["sum_log_ratio"] += sum_d
        sums["sum_ratio"] += sum_r
        # Σ(r - 1 - d) = Σr - n - Σd: exact in exact arithmetic, and per run the float error is far below k3.
        sums["sum_k3"] += np.maximum(sum_r - tokens - sum_d, 0.0)
        np.abs(d, out=d)
        sums["sum_abs_log_ratio"] += per_bucket(d, np.float64)
        np.multiply(r, r, out=r)
        sums["sum_ratio_sq"] += per_bucket(r, np.float64)


SPECIAL_LOGPROBS = [0.0, -1.0, -1e-9, -25.0, -100.0, float("nan"), float("inf"), float("-inf"), math.log(0.5), -50.0]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 400),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.float32, np.float64, np.float16, np.int64]),
    with_flags=st.booleans(),
    band=st.sampled_from([(0.5, 2.0), (0.9, 1.1), (1.0, 1.0)]),
    run_length=st.integers(1, 40),
    specials=st.lists(st.sampled_from(SPECIAL_LOGPROBS), max_size=12),
)
def test_the_compiled_pass_equals_the_numpy_blocks(
    n: int,
    seed: int,
    dtype: Any,
    with_flags: bool,
    band: tuple[float, float],
    run_length: int,
    specials: list[float],
) -> None:
    """Counts identical, float sums to float64 rounding, on lags in runs (negative ones outside), every
    bucket, clamped and uncovered positions and each log-probability dtype."""
    rng = np.random.default_rng(seed)
    lags = np.repeat(rng.integers(-2, 120, size=n // run_length + 1), run_length)[:n]
    sampler = rng.normal(-1, 2, n)
    trainer = sampler + rng.normal(0, 0.7, n)
    for value in specials:  # NaN, infinities, differences beyond the clamp, ratios on the band's edges
        if n:
            (sampler if rng.random() < 0.5 else trainer)[rng.integers(0, n)] = value
    if dtype is np.int64:
        sampler, trainer = np.round(sampler * 3), np.round(trainer * 3)
        sampler, trainer = np.nan_to_num(sampler, posinf=9, neginf=-9), np.nan_to_num(trainer, posinf=9, neginf=-9)
    with np.errstate(over="ignore", invalid="ignore"):
        sampler, trainer = sampler.astype(dtype), trainer.astype(dtype)
    masked = rng.random(n) < 0.3 if with_flags else None
    got = mismatch_sums(lags, sampler, trainer, masked, band=band)
    with np.errstate(over="ignore", invalid="ignore"):
        want = numpy_mismatch_sums(lags, sampler, trainer, masked, band)
    for name in ("tokens", "masked", "out_of_band"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert got.uncovered == want.uncovered
    # Float64 rounding of a bucket's sum: relative for sums of terms of one sign; for Σd (either sign) and
    # Σk3 (the reference took Σr - n - Σd, the pass adds r - 1 - d) up to that of the largest terms, e^20.
    cancelling = got.tokens * math.exp(20) * 1e-14
    for name in ("sum_log_ratio", "sum_abs_log_ratio", "sum_k3", "sum_ratio", "sum_ratio_sq"):
        g, w = getattr(got, name), getattr(want, name)
        slack = cancelling if name in ("sum_log_ratio", "sum_k3") else 0.0
        assert np.all(np.abs(g - w) <= 1e-11 * np.abs(w) + slack), (name, g, w)


def test_the_compiled_pass_in_parallel_shares_equals_one_pass() -> None:
    """Past a million positions the pass runs in shares on threads; runs cut by a share boundary add up."""
    rng = np.random.default_rng(2)
    n = (1 << 20) + 777
    lags = np.repeat(rng.integers(-1, 70, size=n // 1000 + 1), 1000)[:n]
    sampler = rng.normal(-1, 1, n).astype(np.float32)
    trainer = (sampler + rng.normal(0, 0.1, n)).astype(np.float32)
    trainer[rng.integers(0, n, 50)] = np.nan
    masked = rng.random(n) < 0.5
    got = mismatch_sums(lags, sampler, trainer, masked)
    want = numpy_mismatch_sums(lags, sampler, trainer, masked, (0.5, 2.0))
    for name in ("tokens", "masked", "out_of_band"):
        assert np.array_equal(getattr(got, name), getattr(want, name))
    assert got.uncovered == want.uncovered == int(np.sum(np.isnan(trainer) & (lags >= 0)))
    for name in ("sum_log_ratio", "sum_abs_log_ratio", "sum_ratio", "sum_ratio_sq"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-12)
    np.testing.assert_allclose(got.sum_k3, want.sum_k3, rtol=1e-9)  # Σ(r - 1 - d) per position, not Σr - n - Σd


@pytest.mark.skipif(np.finfo(np.longdouble).nmant <= 52, reason="long double is float64 here")
def test_long_double_log_probabilities_differ_in_their_own_precision() -> None:
    """The difference of two long doubles is taken before the pass reads it as float64: a difference finer
    than float64 resolves at 1 is kept."""
    sampler = np.array([1.0, 1.0], dtype=np.longdouble)
    trainer = sampler + np.longdouble(2.0**-60)
    sums = mismatch_sums([0, 0], sampler, trainer)
    assert sums.sum_log_ratio[0] == 2 * 2.0**-60 and sums.tokens[0] == 2


def test_unsigned_lags_beyond_int64_land_in_the_last_bucket() -> None:
    lags = np.array([3, 2**63 + 5, 2**64 - 1], dtype=np.uint64)
    sums = mismatch_sums(lags, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    assert sums.tokens[3] == 1 and sums.tokens[-1] == 2


@settings(max_examples=60, deadline=None)
@given(
    edge=st.sampled_from([0.5, 2.0, 0.9, 1.1]),
    steps=st.lists(st.integers(-40, 40), min_size=1, max_size=300),
    run_length=st.integers(1, 40),
)
def test_ratios_on_a_band_edge_fall_where_the_c_library_s_exp_puts_them(
    edge: float, steps: list[int], run_length: int
) -> None:
    """The pass computes exp in its own loop (within one ulp of the C library's); a ratio within a few ulps
    of a band edge is counted in or out of band exactly as ``math.exp`` says, so counts never change."""
    d = np.array([math.log(edge) + k * 2.0**-52 for k in steps])
    n = len(d)
    lags = np.repeat(np.arange(n // run_length + 1), run_length)[:n]
    band = (0.5, 2.0) if edge in (0.5, 2.0) else (0.9, 1.1)
    sums = mismatch_sums(lags, np.zeros(n), d, band=band)
    ratios = [math.exp(x) for x in d.tolist()]
    outside = np.array([r < band[0] or r > band[1] for r in ratios])
    want = np.bincount(np.searchsorted(np.asarray(LAG_UPPER_BOUNDS), lags, "left"), weights=outside,
                       minlength=len(LAG_BUCKETS)).astype(np.int64)  # fmt: skip
    assert sums.out_of_band.tolist() == want.tolist()
    assert sums.tokens.sum() == n
    np.testing.assert_allclose(sums.sum_ratio.sum(), math.fsum(ratios), rtol=1e-13)


def test_a_ratio_the_pass_rounds_apart_from_the_c_library_is_counted_as_the_c_library_rounds_it() -> None:
    """Where the pass's own exp and ``math.exp`` differ in the last bit, a band edge set between the two
    still counts the position as ``math.exp`` puts it."""
    rng = np.random.default_rng(5)
    found = 0
    for x in rng.uniform(-3, 3, 400).tolist():
        own = float(mismatch_sums([0], [0.0], [x]).sum_ratio[0])
        exact = math.exp(x)
        if own == exact:
            continue
        found += 1
        band = (exact, 4 * exact) if own < exact else (exact / 4, exact)  # the pass's r lies just outside
        sums = mismatch_sums([0, 0, 0], [0.0, 0.0, 0.0], [x, x, x], band=band)
        assert sums.out_of_band[0] == 0
        assert abs(own - exact) <= math.ulp(exact)
    assert found > 0


def test_arrays_never_load_the_torch_module() -> None:
    """The seam: numpy arrays and lists take the compiled pass; the torch code (and torch) is loaded only for
    a caller holding tensors (tests/trainers/test_mismatch_torch.py covers that side where torch exists)."""
    code = (
        "import sys; from staleness_metrics import mismatch_sums; "
        "mismatch_sums([0, 1], [0.0, 0.0], [0.0, 1.0]); mismatch_sums(np.array([2]), np.zeros(1), np.ones(1)); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.endswith('mismatch_torch')))"
    )
    done = subprocess.run([sys.executable, "-c", "import numpy as np; " + code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
