"""Dense per-position labels (issue 12): scattered ``-1`` and labels that change every few positions.

The engine cuts ``token_versions`` samples into spans whose scattered unlabelled positions form an
unlabelled part of the span (they take the dispatch version), so such samples no longer explode
into one span per change. These inputs are the ones that path exists for; every decision, metric and
masked array is compared with the independent per-position SPEC reference (tests/reference), under
every policy, including weights that are zero on some positions (which part of a span carries a
weight then decides whether a sample still has something to train).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from staleness_metrics import RolloutBatch, Sink, StalenessConfig
from tests.reference.compare import check_stream
from tests.reference.streams import ReplayConfig

# The strategies are built once (per argument), not inside each draw: the same draws and examples,
# without hypothesis building and validating a strategy per drawn position (most of this test's time).
LENGTHS = st.integers(1, 24)
UNLABELLED_SHARES = st.sampled_from([0.0, 0.1, 0.5, 0.9])
UNIT = st.floats(0, 1)
MASK_KINDS = st.sampled_from(["ones", "prompt", "random"])
BITS = st.integers(0, 1)
WEIGHT_PATTERNS = st.sampled_from(["none", "random", "labelled only", "unlabelled only"])
WEIGHTS = st.sampled_from([0.0, 0.0, 0.5, 1.0])


@cache
def label_lists(low: int, high: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(low, high), min_size=1, max_size=3)


@cache
def one_of(labels: tuple[int, ...]) -> st.SearchStrategy[int]:
    return st.sampled_from(labels)


@st.composite
def dense_sample(draw: st.DrawFn, dispatch: int, newest: int) -> dict[str, Any]:
    n = draw(LENGTHS)
    unlabelled = draw(UNLABELLED_SHARES)
    labels = draw(label_lists(max(dispatch - 2, 0), max(newest, dispatch)))
    versions = []
    for _ in range(n):
        if draw(UNIT) < unlabelled:
            versions.append(-1)
        else:
            versions.append(draw(one_of(tuple(labels))))
    mask_kind = draw(MASK_KINDS)
    if mask_kind == "ones":
        mask = [1] * n
    elif mask_kind == "prompt":
        cut = draw(st.integers(0, n))
        mask = [0] * cut + [1] * (n - cut)
    else:
        mask = draw(st.lists(BITS, min_size=n, max_size=n))
    sample: dict[str, Any] = {"mask": mask, "token_versions": versions}
    for name in ("rl_weights", "ce_weights", "ref_kl_weights"):
        pattern = draw(WEIGHT_PATTERNS)
        if pattern == "random":
            sample[name] = draw(st.lists(WEIGHTS, min_size=n, max_size=n))
        elif pattern != "none":  # only one part of a span carries a weight
            on = -1 if pattern == "unlabelled only" else None
            sample[name] = [float((v == -1) == (on == -1)) for v in versions]
    return sample


@cache
def sample_lists(dispatch: int, newest: int) -> st.SearchStrategy[list[dict[str, Any]]]:
    return st.lists(dense_sample(dispatch, newest), min_size=1, max_size=3)


FIRST_STEPS = st.integers(2, 6)
EVENT_COUNTS = st.integers(1, 12)
ONE_IN_FOUR = st.integers(0, 3)
GROUPS = st.sampled_from(["g1", "g2"])
ONE_IN_SIX = st.integers(0, 5)
STEP_GAPS = st.integers(0, 3)
CALLS = st.sampled_from(["sweep", "ship"])
LAST_GAPS = st.integers(0, 4)


@st.composite
def dense_streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    step = draw(FIRST_STEPS)
    for i in range(draw(EVENT_COUNTS)):
        if draw(ONE_IN_FOUR):
            dispatch = draw(st.integers(0, max(step - 2, 0)))
            record: dict[str, Any] = {"id": f"r{i}", "dispatch_version": dispatch}
            samples = sample_lists(dispatch, step - 1)
            record["samples"] = draw(samples)
            if draw(st.booleans()):
                record["group_id"] = draw(GROUPS)
            if draw(ONE_IN_SIX) == 0:
                record["agentic"] = True
            events.append({"type": "rollout", "rollout": record})
        else:
            step += draw(STEP_GAPS)
            events.append({"type": draw(CALLS), "step": step})
    events.append({"type": "ship", "step": step + draw(LAST_GAPS)})
    return events


@st.composite
def configs(draw: st.DrawFn) -> ReplayConfig:
    policy = draw(st.sampled_from(["token", "episode", "group", "xtuner"]))
    if policy != "xtuner":
        return ReplayConfig(policy=policy, max_staleness=draw(st.integers(0, 3)))
    return ReplayConfig(
        policy="xtuner",
        max_staleness=draw(st.integers(0, 4)),
        max_token_staleness=draw(st.none() | st.integers(0, 3)),
        sync_interval=draw(st.integers(1, 2)),
        retry_expired=draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=dense_streams(), config=configs())
def test_dense_labels_match_the_reference(events: list[dict[str, Any]], config: ReplayConfig, tmp_path: Path) -> None:
    note(f"{config.cli_args()}")
    found = check_stream(events, config, work=tmp_path)
    assert not found, "\n".join(found[:10])


def test_a_part_without_weights_does_not_keep_its_sample() -> None:
    """Label 5 with every other position unlabelled (dispatch 2), rl weights only on the unlabelled
    positions: at step 6 with bound 2 the unlabelled part is masked and the labelled part, fresh but
    weightless, leaves nothing to train, so the sample (and its rollout) is dropped."""
    versions = [5, -1] * 6
    weights = [float(v == -1) for v in versions]
    record = {"id": "r0", "dispatch_version": 2, "samples": [{"mask": [1] * 12, "token_versions": versions,
              "rl_weights": weights}]}  # fmt: skip
    sink = Sink(StalenessConfig(max_staleness=2))
    sink.add([record])
    shipment = sink.ship(6)
    assert shipment.dropped_rollouts == ("r0",)
    assert shipment.metrics["staleness/sample/dropped"] == 1


def test_scattered_unlabelled_positions_stay_inside_one_span() -> None:
    """A long sample of one label with every third position unlabelled: a handful of spans, not hundreds,
    and the unlabelled positions (dispatch version 2, stale at step 8 with bound 3) masked one by one."""
    import numpy as np

    n = 3000
    versions = np.full(n, 6, dtype=np.int64)
    versions[::3] = -1
    mask = np.ones(n, dtype=np.float32)
    rl = np.ones(n, dtype=np.float32)
    batch = RolloutBatch(
        ids=["r0"], sample_offsets=np.array([0, 1]), position_offsets=np.array([0, n]), mask=mask,
        rl_weights=rl, dispatch_version=np.array([2]), token_versions=versions,
    )  # fmt: skip
    sink = Sink(StalenessConfig(max_staleness=3))
    sink.add(batch)
    assert len(sink.queue.spans) <= 2  # one span: its labelled part and its unlabelled part
    shipment = sink.ship(8)
    assert shipment.metrics["staleness/token/masked"] == 1000 / 3000
    assert shipment.metrics["staleness/token/unlabelled"] == 1000 / 3000
    np.testing.assert_array_equal(mask, np.where(versions < 0, 0, 1))
    np.testing.assert_array_equal(rl, mask)


def test_lags_of_a_span_with_scattered_unlabelled_positions_are_per_position() -> None:
    """SPEC 11 lags of a shipped sample whose span holds scattered -1 positions: the labelled ones lag by
    their label, the unlabelled ones by the dispatch version, mask-0 ones are -1."""
    import numpy as np

    versions = np.array([4, 4, -1, 4, -1, -1, 5, 5, -1, 5], dtype=np.int64)
    mask = np.array([0, 1, 1, 1, 1, 1, 1, 1, 1, 1], dtype=np.float32)
    batch = RolloutBatch(
        ids=["r0"], sample_offsets=np.array([0, 1]), position_offsets=np.array([0, 10]), mask=mask,
        dispatch_version=np.array([2]), token_versions=versions,
    )  # fmt: skip
    sink = Sink(StalenessConfig(max_staleness=8))
    sink.add(batch)
    shipment = sink.ship(7)  # T = 6
    expected = np.where(mask == 0, -1, 6 - np.where(versions < 0, 2, versions))
    np.testing.assert_array_equal(shipment.lags, expected)
    np.testing.assert_array_equal(shipment.lag_offsets, [0, 10])
