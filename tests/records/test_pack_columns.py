"""``pack``: parsed rollouts end to end in one columnar batch, each sample's values where its offsets say.

Drawn batches mix every way a sample may carry its arrays (present or not, the dtypes the parse and the
service give, a length that differs from the mask's, which validation reports later); the batch is
checked sample by sample against the parsed arrays it came from, in both mask layouts (float64 below
``COMPACT_MASK_MIN_POSITIONS`` positions, int8 from there on, where versions stay as narrow as parsed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.records import model
from staleness_metrics.records.columnar import LABELS_NONE, LABELS_SPANS, LABELS_TOKENS, WEIGHT_FIELDS
from staleness_metrics.records.model import ParsedRollout, ParsedSample, pack

FILLS = {"rl_weights": 1.0, "ce_weights": 0.0, "ref_kl_weights": 0.0, "logprobs": 0.0, "trainer_logprobs": np.nan}
VERSION_DTYPES = st.sampled_from([np.int8, np.int16, np.int32, np.int64])
FLOATS = st.floats(-4, 4, allow_nan=False) | st.sampled_from([-0.0, 0.0, 1.0])


@st.composite
def samples(draw: st.DrawFn) -> ParsedSample:
    n = draw(st.integers(0, 6))

    def length() -> int:  # now and then a length other than the mask's (validation names it later)
        return n if draw(st.integers(0, 9)) else draw(st.integers(0, 7))

    sample = ParsedSample(mask=np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.int8))
    label = draw(st.integers(0, 2))
    if label == 1:
        pairs = draw(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=3))
        dtype = draw(st.sampled_from([np.int32, np.int64]))
        sample.spans = np.array(pairs, dtype=dtype).reshape(-1, 2)
    elif label == 2:
        size = length()
        values = draw(st.lists(st.integers(-1, 100), min_size=size, max_size=size))
        sample.token_versions = np.array(values, dtype=draw(VERSION_DTYPES))
        sample.fresh.add("token_versions")
    for name in FILLS:
        if draw(st.booleans()):
            size = length()
            values = np.array(draw(st.lists(FLOATS, min_size=size, max_size=size)), dtype=np.float64)
            if name in WEIGHT_FIELDS:
                sample.weights[name] = values
            else:
                setattr(sample, name, values)
            if draw(st.booleans()):
                sample.fresh.add(name)
    return sample


@st.composite
def rollouts(draw: st.DrawFn) -> list[ParsedRollout]:
    out = []
    for index in range(draw(st.integers(1, 4))):
        out.append(
            ParsedRollout(
                id=f"r{index}",
                dispatch_version=draw(st.integers(-1, 9)),
                completion_version=draw(st.integers(-1, 9)),
                frozen=draw(st.booleans()),
                agentic=draw(st.booleans()),
                group_id=draw(st.none() | st.just("g")),
                env=draw(st.none() | st.just("math")),
                samples=draw(st.lists(samples(), min_size=1, max_size=3)),
                echo={"id": f"r{index}"},
            )
        )
    return out


def array_of(sample: ParsedSample, name: str) -> Any:
    if name in WEIGHT_FIELDS:
        return sample.weights.get(name)
    return getattr(sample, name)


def same(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> None:
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (x, y)


@settings(max_examples=300, deadline=None)
@given(rollouts(), st.sampled_from([0, 5, 10**9]), st.booleans())
def test_each_sample_s_values_are_where_the_offsets_say(
    parsed: list[ParsedRollout], compact_from: int, adopt: bool
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "COMPACT_MASK_MIN_POSITIONS", compact_from)
        batch = pack(parsed, adopt=adopt)
    flat = [s for r in parsed for s in r.samples]
    lengths = [len(s.mask) for s in flat]
    total = sum(lengths)
    compact = total >= compact_from
    same(batch.position_offsets, np.array([0, *np.cumsum(lengths)], dtype=np.int64))
    same(batch.sample_offsets, np.array([0, *np.cumsum([len(r.samples) for r in parsed])], dtype=np.int64))
    assert batch.ids == [r.id for r in parsed] and batch.echo == [r.echo for r in parsed]
    assert batch.frozen is not None and batch.agentic is not None and batch.completion_version is not None
    for name in ("dispatch_version", "completion_version", "frozen", "agentic"):
        assert getattr(batch, name).tolist() == [getattr(r, name) for r in parsed]
    assert batch.mask.dtype == (np.int8 if compact else np.float64)
    assert batch.label_kind is not None
    kinds = [
        LABELS_SPANS if s.spans is not None else LABELS_TOKENS if s.token_versions is not None else LABELS_NONE
        for s in flat
    ]
    same(batch.label_kind, np.array(kinds, dtype=np.int8))

    aligned = {
        name: all(len(array_of(s, name)) == n for s, n in zip(flat, lengths) if array_of(s, name) is not None)
        for name in (*FILLS, "token_versions")
    }
    given_versions = [s.token_versions for s in flat if s.token_versions is not None]
    narrow = compact and bool(given_versions) and all(v.dtype != np.int64 for v in given_versions)
    for name in (*FILLS, "token_versions"):
        column = getattr(batch, name)
        has = [array_of(s, name) is not None for s in flat]
        if not any(has):
            assert column is None and name not in batch.present
            continue
        if name != "token_versions":
            assert batch.present[name].tolist() == has
        if not aligned[name]:  # kept end to end as given (validation refuses the batch)
            expected = np.concatenate(
                [array_of(s, name) if h else np.full(n, FILLS.get(name, -1)) for s, h, n in zip(flat, has, lengths)]
            )
            assert np.array_equal(column, expected.astype(column.dtype), equal_nan=True)
            continue
        if name == "token_versions":
            assert column.dtype == (np.result_type(*given_versions, np.int8) if narrow else np.int64)
        else:
            assert column.dtype == np.float64
        for s, h, lo, hi in zip(flat, has, batch.position_offsets[:-1], batch.position_offsets[1:]):
            part = column[lo:hi]
            if h:
                same(part, array_of(s, name).astype(column.dtype))
            else:
                same(part, np.full(hi - lo, FILLS.get(name, -1), dtype=column.dtype))
        if adopt and len(flat) == 1 and name in flat[0].fresh and array_of(flat[0], name).dtype == column.dtype:
            assert column is array_of(flat[0], name)  # taken as the parse made it, not copied
        else:
            assert all(not np.may_share_memory(column, array_of(s, name)) for s, h in zip(flat, has) if h)

    assert batch.span_offsets is not None and batch.span_versions is not None and batch.span_starts is not None
    counts = [0 if s.spans is None else len(s.spans) for s in flat]
    same(batch.span_offsets, np.array([0, *np.cumsum(counts)], dtype=np.int64))
    pairs = [pair for s in flat if s.spans is not None for pair in s.spans.tolist()]
    same(batch.span_versions, np.array([v for v, _ in pairs], dtype=np.int64))
    same(batch.span_starts, np.array([start for _, start in pairs], dtype=np.int64))


def test_a_mask_is_written_into_the_batch_not_into_the_parsed_sample() -> None:
    """The sink masks the batch in place: a batch never shares the parsed arrays it was packed from, but
    for the one array of a one-sample batch it was told it may adopt."""
    sample = ParsedSample(mask=np.array([0, 1, 1], dtype=np.int8), logprobs=np.array([-1.0, -2.0, -3.0]))
    sample.weights["rl_weights"] = np.array([0.0, 1.0, 1.0])
    sample.fresh.add("rl_weights")
    rollout = ParsedRollout("r", 0, -1, False, False, None, None, [sample], {"id": "r"})
    batch = pack([rollout, rollout])
    assert batch.rl_weights is not None and batch.logprobs is not None
    batch.rl_weights[:] = 0
    batch.mask[:] = 0
    assert sample.weights["rl_weights"].tolist() == [0.0, 1.0, 1.0] and sample.mask.tolist() == [0, 1, 1]
    adopted = pack([rollout], adopt=True)
    assert adopted.rl_weights is sample.weights["rl_weights"] and adopted.logprobs is not sample.logprobs
