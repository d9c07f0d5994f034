"""prime-rl TrainingSamples (flat branches with mask, logprobs, rl/ce/ref-KL weights, env_name) plus
the episode's policy span equal the same rollouts given as SPEC 3 records, and the masked arrays are
written back into the samples the trainer receives."""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import FieldError, StalenessConfig, StalenessMonitor, TraceError
from staleness_metrics.adapters import prime_rl_live
from staleness_metrics.adapters.prime_rl_live import from_training_samples, shipped_samples
from tests.adapters.equivalence import compare_ships, shipped_records


@dataclass
class TrainingSample:
    """The fields of prime-rl's msgspec struct this adapter reads (others omitted)."""

    token_ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    temperatures: list[float]
    env_name: str
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    advantages: list[float] | None = field(default=None)


def sample(mask: list[int], env: str = "math", **weights: list[float]) -> TrainingSample:
    n = len(mask)
    return TrainingSample(list(range(n)), [bool(m) for m in mask], [-0.1] * n, [1.0] * n, env, **weights)


def as_records(
    samples: list[TrainingSample], rollout_ids: list[str], policy: dict[str, tuple[int | None, int | None]]
) -> list[dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    for s, rid in zip(samples, rollout_ids, strict=True):
        start, end = policy[rid]
        record = records.setdefault(rid, {"id": rid, "env": s.env_name, "samples": []})
        if start is None:
            record["source"] = "frozen"
        else:
            record["dispatch_version"] = start
            if end is not None:
                record["completion_version"] = end
        out: dict[str, Any] = {"mask": [int(m) for m in s.mask], "logprobs": s.logprobs}
        for name in ("rl_weights", "ce_weights", "ref_kl_weights"):
            if getattr(s, name) is not None:
                out[name] = getattr(s, name)
        record["samples"].append(out)
    return list(records.values())


def test_a_two_branch_trace_and_a_frozen_episode() -> None:
    samples = [
        sample([0, 0, 1, 1, 1], rl_weights=[0.0, 0.0, 1.0, 1.0, 1.0]),
        sample([0, 1, 1], ce_weights=[1.0, 0.0, 0.0]),  # a ce weight on a context token is never masked
        sample([0, 1, 1], env="code"),
        sample([0, 1], env="code"),
    ]
    rollout_ids = ["t1", "t1", "t2", "frozen-1"]
    policy: dict[str, tuple[int | None, int | None]] = {"t1": (3, 5), "t2": (6, 6), "frozen-1": (None, None)}
    batch = from_training_samples(samples, rollout_ids, policy)
    records = as_records(samples, rollout_ids, policy)
    both = compare_ships(batch, records, StalenessConfig(max_staleness=2), [8])  # T = 7, bound 5
    m = both.adapter[0].metrics
    assert m["staleness/rollout/max"] == 4  # t1 starts at 3
    # t1's positions are unlabelled (version 3 < 5): its rl-only branch is dropped, the other masked
    assert m["staleness/token/masked"] == 2 / 4 and m["staleness/sample/dropped"] == 1
    shipped = shipped_samples(both.adapter[0], batch, samples)
    # t1's first branch had only rl positions: all masked, so it is dropped; its second keeps a ce weight
    assert [s.env_name for s in shipped] == ["math", "code", "code"]
    assert shipped[0].mask == [False, False, False] and shipped[0].ce_weights == [1.0, 0.0, 0.0]
    assert shipped[1].mask == [False, True, True]
    assert both.adapter[0].dropped_samples == (("t1", 0),)
    reference = shipped_records(both.records[0])
    assert [int(x) for x in shipped[0].mask] == reference["t1"]["samples"][0]["mask"]


def test_samples_of_one_rollout_must_be_adjacent_and_have_a_policy_span() -> None:
    samples = [sample([1]), sample([1]), sample([1])]
    with pytest.raises(ValueError, match="adjacent"):
        from_training_samples(samples, ["a", "b", "a"], {"a": (0, 0), "b": (0, 0)})
    with pytest.raises(KeyError, match="'b'"):
        from_training_samples(samples, ["a", "a", "b"], {"a": (0, 0)})


def test_a_null_sampler_logprob_is_uncovered_as_records_read_it_and_stays_null() -> None:
    """SPEC 11: a position lacking a sampler log-prob is uncovered, never an error; the records read a
    null so, and the shipped sample keeps its null."""
    samples = [sample([0, 1, 1]), sample([1, 1], env="code")]
    samples[0].logprobs = [-0.1, None, -0.3]  # type: ignore[list-item]
    samples[1].logprobs = [None, None]  # type: ignore[list-item]
    rollout_ids = ["a", "b"]
    policy: dict[str, tuple[int | None, int | None]] = {"a": (4, 4), "b": (5, 5)}
    batch = from_training_samples(samples, rollout_ids, policy)
    assert batch.logprobs is not None and [math.isnan(x) for x in batch.logprobs] == [0, 1, 0, 1, 1]
    compare_ships(batch, as_records(samples, rollout_ids, policy), StalenessConfig(max_staleness=1), [6])
    lenient = StalenessMonitor(StalenessConfig(max_staleness=1, strict=False))
    shipped = prime_rl_live.ship(lenient, samples, version=5, rollout_ids=rollout_ids, policy=policy)
    assert shipped == samples and shipped.shipment.invalid == ()
    assert [s.logprobs for s in shipped] == [[-0.1, None, -0.3], [None, None]]


# The strategies are built once (per length), not inside each draw: the same draws and examples, without
# hypothesis building and validating strategies per drawn sample (most of this test's time).
TRACE_COUNTS = st.integers(1, 5)
STARTS = st.integers(0, 6) | st.none()
SPREADS = st.integers(0, 2)
SAMPLE_COUNTS = st.integers(1, 3)
LENGTHS = st.integers(0, 6)
ENVS = st.sampled_from(["math", "code"])


@cache
def masks(n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, 1), min_size=n, max_size=n)


@cache
def weight_lists(n: int) -> st.SearchStrategy[list[float]]:
    return st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n)


@st.composite
def traces(draw: st.DrawFn) -> tuple[list[TrainingSample], list[str], dict[str, tuple[int | None, int | None]]]:
    samples: list[TrainingSample] = []
    rollout_ids: list[str] = []
    policy: dict[str, tuple[int | None, int | None]] = {}
    for t in range(draw(TRACE_COUNTS)):
        rid = f"trace-{t}"
        start = draw(STARTS)
        policy[rid] = (start, None if start is None else start + draw(SPREADS))
        for _ in range(draw(SAMPLE_COUNTS)):
            n = draw(LENGTHS)
            mask = draw(masks(n))
            weights = {
                name: draw(weight_lists(n))
                for name in ("rl_weights", "ce_weights", "ref_kl_weights")
                if draw(st.booleans())
            }
            samples.append(sample(mask, env=draw(ENVS), **weights))
            rollout_ids.append(rid)
    return samples, rollout_ids, policy


@settings(max_examples=100, deadline=None)
@given(data=traces(), bound=st.integers(0, 3), policy_name=st.sampled_from(["token", "episode"]))
def test_random_traces_equal_their_records(
    data: tuple[list[TrainingSample], list[str], dict[str, tuple[int | None, int | None]]], bound: int, policy_name: str
) -> None:
    samples, rollout_ids, policy = data
    records = as_records(copy.deepcopy(samples), rollout_ids, policy)
    batch = from_training_samples(samples, rollout_ids, policy)
    both = compare_ships(batch, records, StalenessConfig(policy=policy_name, max_staleness=bound), [9])
    shipped = shipped_samples(both.adapter[0], batch, samples)
    expected = [s for r in both.records[0].rollouts for s in r.record()["samples"]]
    assert len(shipped) == len(expected)
    for got, want in zip(shipped, expected, strict=True):
        assert [int(m) for m in got.mask] == want["mask"]
        for name in ("rl_weights", "ce_weights", "ref_kl_weights"):
            assert getattr(got, name) == want.get(name)


def test_a_policy_version_no_integer_is_refused_as_given_and_no_samples_ship_nothing() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=0))
    with pytest.raises(
        TraceError, match=r"^rollout 'r': field policy.start: expected an integer >= 0 \(or None\), got 2\.9$"
    ):
        prime_rl_live.ship(monitor, [{"mask": [1, 1]}], version=3, rollout_ids=["r"], policy={"r": (2.9, 3)})
    assert monitor.sink.queued == 0
    assert prime_rl_live.ship(monitor, [], version=3, rollout_ids=[], policy={}) == []


def _live(mask: list[int], **arrays: Any) -> dict[str, Any]:
    return {"mask": mask, "env_name": "math", **arrays}


@pytest.mark.parametrize(
    ("samples", "policy", "field", "reason"),
    [  # lengths that cancel over the call: no value may slide into the next sample
        (
            [_live([1, 1, 1], rl_weights=[0.0, 1, 1, 1]), _live([1, 1, 1], rl_weights=[0.5, 0.5])],
            {},
            "samples[0].rl_weights",
            "4 entries for 3 positions",
        ),
        (
            [_live([1, 1], logprobs=[-0.1]), _live([1], logprobs=[-0.1, -0.2])],
            {},
            "samples[0].logprobs",
            "1 entries for 2 positions",
        ),
        ([_live([1, 1], ce_weights=[1, 1, 1]), _live([1])], {}, "samples[0].ce_weights", "3 entries for 2 positions"),
        ([_live([1]), _live([1, 1], ref_kl_weights=[1])], {}, "samples[1].ref_kl_weights", "1 entries for 2 positions"),
        # a start the others' integers would coerce (numpy reads True as 1 and 4.0 as 4)
        ([_live([1, 1]), _live([1])], {"a": (True, 5)}, "policy.start", "expected an integer >= 0 (or None), got True"),
        ([_live([1, 1]), _live([1])], {"a": (4.0, 5)}, "policy.start", "expected an integer >= 0 (or None), got 4.0"),
        ([_live([1, 1]), _live([1])], {"a": (4, 5.0)}, "policy.end", "expected an integer >= 0 (or None), got 5.0"),
        # a negative version: -1 stood for None, so the rollout was read as frozen, never masked
        ([_live([1, 1]), _live([1])], {"a": (-1, 5)}, "policy.start", "expected an integer >= 0 (or None), got -1"),
        ([_live([1, 1]), _live([1])], {"a": (4, -3)}, "policy.end", "expected an integer >= 0 (or None), got -3"),
        # the engine's own check keeps the sample's index (strict named "TrainingSample.mask of rollout #0")
        ([_live([1, 1]), _live([1, 2])], {}, "samples[1].mask", "position 1: expected 0 or 1"),
        # wrong types: named, not a bare TypeError or ValueError
        ([_live(None), _live([1])], {}, "samples[0].mask", "expected a list of numbers, got None"),  # type: ignore[arg-type]
        ([_live("11"), _live([1])], {}, "samples[0].mask", "expected a list of numbers, got '11'"),  # type: ignore[arg-type]
        ([_live([1, 1], rl_weights=["x", 1.0]), _live([1])], {}, "samples[0].rl_weights", "expected a list of numbers"),
        ([_live([1, 1], logprobs=[[-0.1], -0.2]), _live([1])], {}, "samples[0].logprobs", "expected a list of numbers"),
    ],
)
def test_a_bad_sample_or_policy_refuses_its_rollout_by_name_and_lenient_sets_it_aside(
    samples: list[dict[str, Any]], policy: dict[str, Any], field: str, reason: str
) -> None:
    samples = [*samples, _live([1, 0])]  # rollout 'a', then 'b', valid
    ids = ["a"] * (len(samples) - 1) + ["b"]
    spans = {"a": (5, 5), "b": (5, 5), **policy}
    with pytest.raises(TraceError) as refused:
        prime_rl_live.ship(StalenessMonitor(StalenessConfig()), samples, version=5, rollout_ids=ids, policy=spans)
    assert (refused.value.rollout_id, refused.value.field) == ("a", field)
    assert refused.value.reason.startswith(reason)
    lenient = StalenessMonitor(StalenessConfig(strict=False))
    shipped = prime_rl_live.ship(lenient, samples, version=5, rollout_ids=ids, policy=spans)
    assert shipped == [samples[-1]] and [r.id for r in shipped.shipment.rollouts] == ["b"]
    assert [(e.rollout_id, e.field) for e in shipped.shipment.invalid] == [("a", field)]
    assert lenient.sink.totals.rollouts_invalid == 1


def test_a_lenient_set_aside_waits_for_the_monitors_lock_as_an_add_does() -> None:
    # a scrape or a checkpoint in another thread holds the lock: it must not see a set-aside half made
    samples, ids = [_live(None), _live([1, 0])], ["a", "b"]  # type: ignore[arg-type]
    monitor = StalenessMonitor(StalenessConfig(strict=False))
    release, done = threading.Event(), []
    holder = threading.Thread(target=lambda: (monitor._lock.__enter__(), release.wait(), monitor._lock.__exit__()))
    holder.start()
    spans = {"a": (5, 5), "b": (5, 5)}
    call = lambda: done.append(prime_rl_live.ship(monitor, samples, version=5, rollout_ids=ids, policy=spans))  # noqa: E731
    caller = threading.Thread(target=call)
    caller.start()
    caller.join(0.5)
    try:
        assert monitor.sink.invalid == () and not done  # (the set-aside, and the add after it, wait)
    finally:
        release.set()
        holder.join()
        caller.join(10)
    assert [len(out) for out in done] == [1] and monitor.sink.totals.rollouts_invalid == 1


def test_a_lenient_call_refused_by_its_step_counts_nothing_and_its_retry_counts_once() -> None:
    monitor = StalenessMonitor(StalenessConfig(strict=False))
    prime_rl_live.ship(monitor, [_live([1, 1])], version=7, rollout_ids=["x"], policy={"x": (5, 5)})  # step 8
    samples, ids, spans = [_live(None), _live([1, 0])], ["a", "b"], {"a": (5, 5), "b": (5, 5)}  # type: ignore[arg-type]
    with pytest.raises(FieldError, match="steps never decrease"):  # (version 3 goes back: refused)
        prime_rl_live.ship(monitor, samples, version=3, rollout_ids=ids, policy=spans)
    assert monitor.sink.invalid == () and monitor.sink.totals.rollouts_invalid == 0  # 'a' not counted
    shipped = prime_rl_live.ship(monitor, samples, version=8, rollout_ids=ids, policy=spans)
    assert shipped == [samples[1]] and [e.rollout_id for e in shipped.shipment.invalid] == ["a"]
    assert monitor.sink.totals.rollouts_invalid == 1


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("where", ["in the ship", "after the ship"])
def test_a_call_interrupted_and_repeated_with_the_same_samples_ships_them_once(strict: bool, where: str) -> None:
    """docs/checkpoints.md: a call interrupted inside its ship, or after it before it returned, and repeated
    with the same batch object ships its rows once (before, the repeat added them again: a duplicate id)."""
    samples, ids, spans = [_live([1, 1]), _live([1, 0, 1])], ["a", "b"], {"a": (5, 5), "b": (4, 5)}
    reference = StalenessMonitor(StalenessConfig(strict=strict))
    expected = prime_rl_live.ship(reference, samples, version=5, rollout_ids=ids, policy=spans)
    monitor = StalenessMonitor(StalenessConfig(strict=strict))
    target = (monitor.sink, "ship") if where == "in the ship" else (prime_rl_live, "_written_back")
    original = getattr(*target)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        setattr(*target, original)
        raise KeyboardInterrupt

    setattr(*target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        prime_rl_live.ship(monitor, samples, version=5, rollout_ids=ids, policy=spans)
    shipped = prime_rl_live.ship(monitor, samples, version=5, rollout_ids=ids, policy=spans)
    assert list(shipped) == list(expected) and len(expected) == 2
    assert [lag.tolist() for lag in shipped.staleness_lag] == [lag.tolist() for lag in expected.staleness_lag]
    assert monitor.sink.state_dict()["totals"] == reference.sink.state_dict()["totals"]
    again = prime_rl_live.ship(monitor, [_live([1])], version=6, rollout_ids=["c"], policy={"c": (6, 6)})
    assert [len(again)] == [1]  # (handed back: the next call is a new one)
