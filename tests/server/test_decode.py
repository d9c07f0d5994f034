"""Rollout batch bodies mean the same whichever decoder reads them: orjson (small bodies) or the standard
library (large ones, and whatever orjson refuses or could read differently)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.server import decode
from staleness_metrics.server.decode import FAST_DECODE_MAX_BYTES, read_json


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


def test_large_bodies_go_to_the_standard_library(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = decode.orjson.loads

    def counted(data: Any) -> Any:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(decode.orjson, "loads", counted)
    small = json.dumps({"rollouts": [{"id": "r", "samples": [{"mask": [1] * 100}]}]}).encode()
    large = json.dumps({"rollouts": [{"id": "r", "samples": [{"mask": [1] * FAST_DECODE_MAX_BYTES}]}]}).encode()
    assert service(small) == standard(small) and calls == [len(small)]
    assert service(large) == standard(large) and calls == [len(small)]  # orjson not called for it


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
