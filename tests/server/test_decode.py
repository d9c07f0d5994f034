"""Rollout batch bodies mean the same whichever decoder reads them: orjson (small bodies) or the standard
library (large ones, and whatever orjson refuses or could read differently)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.server import decode
from staleness_metrics.server.decode import FAST_DECODE_MAX_BYTES, read_json
from staleness_metrics.state_checks import json_pieces


def standard(body: bytes) -> Any:
    """What the service read before orjson: UTF-8, then the standard library."""
    return json.loads(body.decode("utf-8"))


def outcome(read: Any, body: bytes) -> tuple[str, str]:
    """The decoded value (JSON text with types kept: 1 and 1.0 differ) or the error, as comparable text."""
    try:
        value = read(body)
    except ValueError as error:
        return ("error", f"{type(error).__name__}: {error}")
    return ("value", json.dumps(value, sort_keys=True) + repr(value))


def service(body: bytes) -> Any:
    return read_json([bytearray(body)])


@pytest.mark.parametrize(
    "body",
    [
        b'{"rollouts": [{"id": "r", "dispatch_version": 0, "samples": [{"mask": [0, 1, 1]}]}]}',
        b'{"rollouts": [{"id": "r", "samples": [{"mask": [1], "rl_weights": [NaN]}]}]}',  # orjson refuses NaN
        b'{"rollouts": [{"id": "\\ud800"}]}',  # a lone surrogate: orjson refuses it
        b'{"rollouts": [{"dispatch_version": 18446744073709551616}]}',  # 2**64: orjson would read a float
        b'{"rollouts": [{"dispatch_version": -9223372036854775809}]}',
        b'{"rollouts": [{"dispatch_version": 9223372036854775807}]}',
        b'{"x": 0.12345678901234567890123}',
        b'{"x": 1e400}',
        b'{"x": -0.0, "y": 1.0, "z": 1}',
        b'{"rollouts": []} trailing',
        b'{"rollouts": [}',
        b"",
        b"\xff\xfe{}",  # not UTF-8
        b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark: refused as before
        '{"x": "é"}'.encode("utf-16"),
        b'{"x": "\xc3\xa9 \xf0\x9f\x98\x80"}',
        b'{"a": 1, "a": 2}',  # the last wins in both
    ],
)
def test_bodies_read_as_the_standard_library_reads_them(body: bytes) -> None:
    assert outcome(service, body) == outcome(standard, body)


def test_large_bodies_read_long_lists_straight_into_arrays() -> None:
    """Above FAST_DECODE_MAX_BYTES, long per-position lists arrive as arrays holding exactly the list's
    values (ints stay ints, nulls in trainer_logprobs are NaN); everything else reads as JSON says."""
    n = FAST_DECODE_MAX_BYTES
    sample = {"mask": [1, 0] * n, "logprobs": [-0.5, 1] * 1000, "trainer_logprobs": [None, -1.25] * 1000}
    record = {"id": "r\u00e9", "group_id": None, "samples": [sample, {"mask": [1] * 10}]}
    body = json.dumps({"rollouts": [record], "mask": [3] * 3000}).encode()
    value = service(body)
    read = value["rollouts"][0]["samples"][0]
    assert read["mask"].dtype == np.int8 and read["mask"].tolist() == sample["mask"]
    assert read["logprobs"].dtype == np.float64 and read["logprobs"].tolist() == sample["logprobs"]
    assert np.isnan(read["trainer_logprobs"][0]) and read["trainer_logprobs"][1] == -1.25
    assert value["rollouts"][0]["samples"][1] == {"mask": [1] * 10} and value["rollouts"][0]["id"] == "r\u00e9"
    assert value["mask"].tolist() == [3] * 3000  # any key of that name: the same numbers


def test_long_integer_lists_are_read_in_the_smallest_exact_dtype() -> None:
    """Versions, span pairs and integer weights are read compactly (int8, int32) while every value fits,
    and into a wider dtype, exactly, when a later piece holds a value that does not: the values are the
    list's either way (a digest of the record, and the library, read the same numbers)."""
    n = 400_000  # text of several pieces
    tokens = [i % 7 for i in range(n)]
    late_big = [*tokens[:-1], 2**40]
    weights = [1, 0] * (n // 2)
    late_float = [*weights[:-1], 0.25]
    pairs = [[v, i] for i, v in enumerate(tokens[: n // 4])]
    sample = {"mask": [1] * n, "token_versions": tokens, "rl_weights": weights, "ce_weights": late_float}
    other = {"mask": [1] * n, "token_versions": late_big, "weight_versions": pairs}
    value = service(json.dumps({"rollouts": [{"id": "r", "samples": [sample, other]}]}).encode())
    first, second = value["rollouts"][0]["samples"]
    expected_dtypes = {"token_versions": np.int8, "rl_weights": np.int8, "ce_weights": np.float64}
    for name, dtype in expected_dtypes.items():
        assert first[name].dtype == dtype and first[name].tolist() == sample[name]
    assert second["token_versions"].dtype == np.int64 and second["token_versions"].tolist() == late_big
    assert second["weight_versions"].dtype == np.int32 and second["weight_versions"].tolist() == pairs


def test_a_large_body_of_tiny_values_is_refused_before_it_is_built() -> None:
    body = b'{"rollouts":[' + b"{}," * FAST_DECODE_MAX_BYTES + b"{}]}"
    with pytest.raises(decode.BodyTooComplex, match="smaller batches"):
        service(body)


def test_a_large_body_too_deep_to_read_is_refused() -> None:
    body = (
        b'{"rollouts":[' + b"[" * 100_000 + b"]" * 100_000 + b"], " + b'"x": "' + b"a" * FAST_DECODE_MAX_BYTES + b'"}'
    )
    with pytest.raises(decode.BodyTooDeep):
        service(body)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_drawn_documents_read_the_same(value: Any) -> None:
    body = json.dumps(value).encode()  # NaN and Infinity literals included, as the standard library writes
    assert outcome(service, body) == outcome(standard, body)


# ---------------------------------------------------------------- the journal's text, a piece at a time

_ARRAYS = st.sampled_from(
    [
        np.ones(300_000, dtype=np.int8),  # over a piece: written in blocks of rows
        np.arange(200_000, dtype=np.int64).reshape(-1, 2),  # weight_versions pairs
        np.linspace(-3.0, 3.0, 140_001),  # floats, and a length that does not divide into pieces
        np.zeros(0, dtype=np.float64),
        np.array([1, 0, 1], dtype=np.int8),
    ]
)
_RECORD_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text() | _ARRAYS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(_RECORD_VALUES, st.booleans())
def test_a_record_written_in_pieces_is_the_same_text(value: Any, sort_keys: bool) -> None:
    """Hashing and journalling a record a piece at a time changes no byte: the digests that recognise a
    re-sent rollout, and the journal rows, are those of the whole text."""
    option = orjson.OPT_SERIALIZE_NUMPY | (orjson.OPT_SORT_KEYS if sort_keys else 0)
    assert b"".join(json_pieces(value, option)) == orjson.dumps(value, option=option)
