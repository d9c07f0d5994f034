"""The replay's fast read of per-position lists (issue 12) decides exactly as the checked path does.

On a line whose text holds no ``true`` / ``false``, the parser reads lists of numbers through
``array('d')`` / ``array('q')`` (C loops that refuse strings, nulls, nested lists and, for ints, floats)
instead of numpy's per-element type discovery; masks take the int read whatever the text. Lines are
drawn with every element such a list may hold in JSON (integers up to 64 bits and beyond, floats,
nulls, booleans, strings, nested lists, objects) among plain numbers: the parse of the line must equal
the parse of the same decoded record with nothing known about its text (same arrays and dtypes, or
the same error).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from staleness_metrics.records import jsonio
from staleness_metrics.records import model as records
from staleness_metrics.records.model import ParsedRollout, UnparsedRollout, parse_or_error
from staleness_metrics.replay.stream import read_events

_ELEMENTS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64 - 1, 0.5, 1.0, -0.0]),
    st.sampled_from([None, True, False, "1.5", "x", [1.0], [], {}, {"a": 1}]),
)


# The strategies are built once (per argument), not inside each draw: the same draws and examples,
# without hypothesis building and validating strategies per drawn list (most of this test's time).
_BITS = st.integers(0, 1)
_NUMBERS = st.floats(-10, 10, allow_nan=False) | st.integers(-5, 5)
_ODD_COUNTS = st.integers(1, 3)


@cache
def _plain_lists(n: int, ints: bool) -> st.SearchStrategy[list[Any]]:
    return st.lists(_BITS if ints else _NUMBERS, min_size=n, max_size=n)


@st.composite
def float_lists(draw: st.DrawFn, n: int, ints: bool = False) -> list[Any]:
    plain = draw(_plain_lists(n, ints))
    if n and draw(st.booleans()):  # a few odd elements among plain numbers
        for _ in range(draw(_ODD_COUNTS)):
            plain[draw(st.integers(0, n - 1))] = draw(_ELEMENTS)
    return plain


_float_lists = cache(float_lists)
_SAMPLE_COUNTS = st.integers(1, 3)
_LENGTHS = st.integers(0, 6)
_ONE_IN_TEN = st.integers(0, 9)
_IDS = st.sampled_from(["r1", 'r"1', "r\\1", "r\u00e91"])
_ENVS = st.sampled_from(["math", "a,b"])


@st.composite
def lines(draw: st.DrawFn) -> str:
    samples = []
    for _ in range(draw(_SAMPLE_COUNTS)):
        n = draw(_LENGTHS)
        sample: dict[str, Any] = {"mask": draw(_float_lists(n, ints=True))}
        if draw(st.booleans()):
            sample["token_versions"] = draw(_float_lists(n, ints=True))
        for name in ("rl_weights", "ce_weights", "logprobs", "trainer_logprobs"):
            if draw(st.booleans()):
                sample[name] = draw(_float_lists(n if draw(_ONE_IN_TEN) else n + 1))
        if draw(_ONE_IN_TEN) == 0:
            sample["extra"] = "x"  # an unknown field holding a string
        samples.append(sample)
    record: dict[str, Any] = {"id": draw(_IDS), "samples": samples}
    record["dispatch_version"] = 2
    if draw(st.booleans()):
        record["env"] = draw(_ENVS)
    if draw(st.booleans()):
        record["agentic"] = draw(st.booleans())
    event: dict[str, Any] = {"type": "rollout", "rollout": record}  # (another key is refused: no note)
    return json.dumps(event, ensure_ascii=draw(st.booleans()))


def _same(fast: ParsedRollout | UnparsedRollout, checked: ParsedRollout | UnparsedRollout) -> None:
    assert type(fast) is type(checked)
    if isinstance(fast, UnparsedRollout):
        assert isinstance(checked, UnparsedRollout)
        assert str(fast.error) == str(checked.error)
        return
    assert isinstance(checked, ParsedRollout)
    assert fast.echo == checked.echo
    for a, b in zip(fast.samples, checked.samples, strict=True):
        pairs = [(a.mask, b.mask), (a.token_versions, b.token_versions), (a.logprobs, b.logprobs)]
        pairs += [(a.trainer_logprobs, b.trainer_logprobs)]
        pairs += [(a.weights.get(k), b.weights.get(k)) for k in {*a.weights, *b.weights}]
        for x, y in pairs:
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(x, y)


def _line(logprobs: str, rl_weights: str = "[1, 1]") -> str:
    """A rollout line with the given JSON text as lists (numbers json.dumps would not write)."""
    head = '{"type": "rollout", "rollout": {"id": "r1", "dispatch_version": 0, "samples": [{"mask": [1, 1], '
    return head + '"logprobs": ' + logprobs + ', "rl_weights": ' + rl_weights + "}]}}"


@settings(max_examples=300, deadline=None)
@given(line=lines(), as_bytes=st.booleans())
@example(line=_line(f"[{2**64}, 1]", "[NaN, 1]"), as_bytes=True)  # NaN: the standard library reads 2**64 as an int
@example(line=_line(f"[{2**63}, -1]"), as_bytes=True)
@example(line=_line("[NaN, 1.5]"), as_bytes=False)
@example(line=_line("[1e400, 1]"), as_bytes=True)
def test_float_lists_read_from_the_text_parse_as_the_checked_path(line: str, as_bytes: bool) -> None:
    (event,) = read_events([line.encode() if as_bytes else line])
    fast = parse_or_error(event.rollout, booleans=event.booleans)
    _same(fast, parse_or_error(jsonio.loads(line)["rollout"]))  # the same decoder, nothing known of the text


def test_a_plain_line_takes_the_fast_read() -> None:
    """The fast read applies to the lines the replay usually sees (else the test above proves nothing)."""
    line = json.dumps(
        {"type": "rollout", "rollout": {"id": "r1", "dispatch_version": 0, "env": "math",
         "samples": [{"mask": [0, 1], "token_versions": [0, 0], "rl_weights": [0.0, 1.0], "logprobs": [-1, -0.5]}]}}
    )  # fmt: skip
    (event,) = read_events([line.encode()])
    assert not event.booleans
    assert event.rollout is not None
    sample = event.rollout["samples"][0]
    assert records._fast(sample["mask"], "q") is not None and records._fast(sample["token_versions"], "q") is not None
    floats = [records._fast(sample[name], "d") for name in ("rl_weights", "logprobs")]
    assert all(values is not None and not records.floats_beyond(values) for values in floats)
    (other,) = read_events([line.replace("0.0", "false")])
    assert other.booleans
