"""Token versions kept narrow in a long batch (issue 19: memory bounded by the size of what arrives).

A packed batch of many positions keeps the int8/16/32 versions the service parsed instead of int64, and
the compiled loops read them as they are. None of it may change a cut, a decision, a metric, a checkpoint
or the error a user reads.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import staleness_metrics.records.model as records_module
from staleness_metrics import Sink, StalenessConfig
from staleness_metrics.engine.judging import zero_spans
from staleness_metrics.records.model import pack, parse_rollout
from tests.engine.test_checkpoint import POLICIES, config_of
from tests.engine.test_small_adds import play
from tests.reference.streams import SeededChooser, generate_events, random_config
from tests.support.cuts import token_spans

NARROW = (np.int8, np.int16, np.int32)


@st.composite
def labelled_batches(draw: st.DrawFn) -> tuple[npt.NDArray[Any], npt.NDArray[np.int8], npt.NDArray[np.int64]]:
    """Versions in runs (labels, -1 and now and then a label below -1), a 0/1 mask in runs, sample offsets."""
    runs = draw(st.lists(st.tuples(st.sampled_from([-3, -1, -1, 0, 1, 2, 2]), st.integers(1, 9)), max_size=25))
    tokens = np.array([v for v, n in runs for _ in range(n)], dtype=np.int64)
    n = len(tokens)
    mask_runs = draw(st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(1, 12)), min_size=1, max_size=12))
    mask = np.resize(np.array([v for v, k in mask_runs for _ in range(k)], dtype=np.int8), n)
    cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=5))))
    pos_off = np.array([0, *cuts, n], dtype=np.int64)
    return tokens, mask, pos_off


@settings(max_examples=400, deadline=None)
@given(
    labelled_batches(),
    st.sampled_from(NARROW),
    st.integers(0, 3),
    st.sampled_from([np.float32, np.float64]),
    st.randoms(use_true_random=False),
)
def test_cuts_of_narrow_versions_equal_those_of_int64_versions(
    case: tuple[npt.NDArray[Any], npt.NDArray[np.int8], npt.NDArray[np.int64]],
    dtype: Any,
    n_weights: int,
    weight_dtype: Any,
    rng: random.Random,
) -> None:
    """Starts, ends, labels, labelled counts, weight bits and the count of labels below -1 are those of the
    same versions as int64."""
    tokens, mask, pos_off = case
    samples = np.array([s for s in range(len(pos_off) - 1) if rng.random() < 0.8], dtype=np.int64)
    choices = [0.0, 1.0, 0.5, -2.0, float("inf"), float("nan")]
    weights = [
        np.array([rng.choice(choices) for _ in range(len(tokens))], dtype=weight_dtype) for _ in range(n_weights)
    ]
    want = token_spans(tokens, mask, pos_off, samples, weights)
    got = token_spans(tokens.astype(dtype), mask, pos_off, samples, weights)
    for name, values in zip(want._fields, want):
        assert np.array_equal(np.asarray(getattr(got, name)), np.asarray(values)), name


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-1, 2), min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 39), st.integers(0, 12), st.sampled_from([0, 1, 2])), max_size=6),
    st.sampled_from(NARROW),
)
def test_zero_spans_of_narrow_versions_write_what_int64_versions_write(
    values: list[int], rows: list[tuple[int, int, int]], dtype: Any
) -> None:
    tokens = np.array(values, dtype=np.int64)
    n = len(tokens)
    lo = np.array([min(a, n) for a, _, _ in rows], dtype=np.int64)
    hi = np.minimum(lo + np.array([w for _, w, _ in rows], dtype=np.int64), n)
    part = np.array([p for _, _, p in rows], dtype=np.int8)
    rng = np.random.default_rng(len(rows))
    arrays = [rng.random(n).astype(np.float32) + 1 for _ in range(3)]
    expected = [a.copy() for a in arrays]
    count = hi - lo
    zero_spans(expected, tokens, lo, hi, part, count)
    zero_spans(arrays, tokens.astype(dtype), lo, hi, part, count)
    for got, want in zip(arrays, expected):
        assert got.tobytes() == want.tobytes()


def _versions_as(events: list[dict[str, Any]], dtype: Any) -> list[dict[str, Any]]:
    """The events with every plain token_versions list given as a ``dtype`` array (as the service parses
    a long list of small versions), where the values fit."""
    out = []
    for event in events:
        rollout = event.get("rollout")
        if event["type"] == "rollout" and isinstance(rollout, dict) and isinstance(rollout.get("samples"), list):
            samples = []
            for sample in rollout["samples"]:
                versions = sample.get("token_versions") if isinstance(sample, dict) else None
                if (
                    isinstance(versions, list)
                    and versions
                    and all(type(v) is int for v in versions)
                    and np.iinfo(dtype).min <= min(versions)
                    and max(versions) <= np.iinfo(dtype).max
                ):
                    sample = {**sample, "token_versions": np.array(versions, dtype=dtype)}
                samples.append(sample)
            event = {**event, "rollout": {**rollout, "samples": samples}}
        out.append(event)
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_streams_decide_the_same_with_token_versions_kept_narrow(policy: str) -> None:
    """Every packed batch keeps its int8/16/32 versions (the threshold at 0): the same outcomes, shipped
    arrays, counts and errors as with int64 versions, under every policy, strict and lenient, with defects."""
    for seed in range(4):
        chooser = SeededChooser(seed * 17 + len(policy))
        drawn = random_config(chooser, policy, lenient=seed % 2 == 1)
        config, events = config_of(drawn), generate_events(chooser, drawn, defects=seed % 3)
        narrow_events = _versions_as(events, NARROW[seed % 3])
        as_int64 = play(config, narrow_events, random.Random(seed))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(records_module, "COMPACT_MASK_MIN_POSITIONS", 0)
            narrow = play(config, narrow_events, random.Random(seed))
        assert narrow == as_int64
        assert narrow == play(config, events, random.Random(seed))


def _long_sample(positions: int) -> dict[str, Any]:
    versions = np.zeros(positions, dtype=np.int8)
    versions[positions // 3 :] = 2
    versions[::7] = -1
    return {"id": "long", "dispatch_version": 0, "samples": [{"mask": [1] * positions, "token_versions": versions}]}


def test_a_long_batch_keeps_int8_versions_and_its_checkpoint_holds_int64() -> None:
    """The batch keeps the parse's int8 array's values as int8 (an eighth of int64); a state taken of the
    sink says int64 (what every state holds), and a sink restored from its JSON text ships the same."""
    positions = records_module.COMPACT_MASK_MIN_POSITIONS
    batch = pack([parse_rollout(_long_sample(positions))])
    assert batch.token_versions is not None and batch.token_versions.dtype == np.int8
    assert batch.mask.dtype == np.int8
    small = pack([parse_rollout(_long_sample(1000))])
    assert small.token_versions is not None and small.token_versions.dtype == np.int64
    live = Sink(StalenessConfig(max_staleness=1, policy="token"))
    live.add([_long_sample(positions)])
    state = live.state_dict()
    restored = Sink(StalenessConfig(max_staleness=1, policy="token"))
    restored.load_state_dict(json.loads(json.dumps(state, default=lambda a: a.tolist())))
    shipped = [sink.ship(3) for sink in (live, restored)]
    assert shipped[0].metrics == shipped[1].metrics
    assert shipped[0].batches_line() == shipped[1].batches_line()
    assert shipped[0].metrics["staleness/token/masked"] > 0  # version 0 is 3 behind: the first third masked
