"""A checkpoint's text written a piece at a time is the text written whole, and costs no copy of it.

The digests saved in every checkpoint (SPEC 13) and the service's snapshots are computed from pieces of
the JSON text (:func:`json_pieces`): a queue of millions of positions is never one text in memory. The
pieces must be byte for byte what one ``orjson.dumps`` gives, and the digests those of before, or
checkpoints and data directories saved earlier would be refused as damaged.
"""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.state_checks import (
    PIECE_ITEMS,
    PIECED_DEPTH,
    NestedTooDeep,
    arrays_left_as_numpy,
    digests_of,
    json_pieces,
)

SORTED_NUMPY = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY


def plain(value: Any) -> Any:
    """What the digests hand orjson for a value it does not write itself (as state_checks does)."""
    return value.item() if isinstance(value, np.generic) else repr(value)


def former_digest(value: Any) -> str:
    """The digest as it was computed before it was hashed in pieces: the whole text, orjson's or, for
    what orjson refuses, the standard library's."""
    try:
        text = orjson.dumps(value, default=plain, option=SORTED_NUMPY)
    except (TypeError, orjson.JSONEncodeError):
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=plain).encode()
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value, "a": level}
    return value


_BIG = PIECE_ITEMS * 3 + 7  # over a piece, and not a multiple of it
_ARRAYS = st.sampled_from(
    [
        np.ones(_BIG, dtype=np.int8),
        np.arange(_BIG, dtype=np.uint64) * 2**40,
        np.linspace(-3.0, 3.0, _BIG),
        np.linspace(-3.0, 3.0, _BIG).astype(np.float32),  # written shorter than float64
        np.arange(_BIG) % 3 == 0,
        np.arange(2 * _BIG, dtype=np.int32).reshape(-1, 2),  # rows of pairs
        np.arange(2 * _BIG, dtype=np.int64)[::2],  # not contiguous: orjson hands it to ``default``
        np.arange(_BIG, dtype=">i8"),  # not native: the same
        np.array([1.5, -2.0]),
        np.zeros(0, dtype=np.int16),
        np.int64(7),
        np.float32(0.25),
    ]
)
# lone surrogates too: orjson refuses them, the standard library writes them
_TEXT = st.text(max_size=6) | st.text(st.characters(categories=["Cs", "Lu", "Nd"]), max_size=3)
_KEYS = _TEXT
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)  # past 64 bits: orjson refuses, the standard library writes it
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
_VALUES = st.recursive(
    _SCALARS | _ARRAYS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple) | st.dictionaries(_KEYS, inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=80, deadline=None)
@given(_VALUES, st.booleans())
def test_pieces_join_to_the_text_orjson_writes_or_raise_where_it_raises(value: Any, sort_keys: bool) -> None:
    option = orjson.OPT_SERIALIZE_NUMPY | (orjson.OPT_SORT_KEYS if sort_keys else 0)
    try:
        expected: bytes | type[Exception] = orjson.dumps(value, default=plain, option=option)
    except orjson.JSONEncodeError:
        expected = orjson.JSONEncodeError
    try:
        written: bytes | type[Exception] = b"".join(json_pieces(value, option, default=plain))
    except orjson.JSONEncodeError:
        written = orjson.JSONEncodeError
    assert written == expected


@settings(max_examples=80, deadline=None)
@given(_VALUES)
def test_digests_are_those_of_the_whole_text(value: Any) -> None:
    """Checkpoints saved before the digests were hashed in pieces still load: the same value, the same digest."""
    assert digests_of({"value": value}) == {"value": former_digest(value)}


def outcome(write: Any) -> bytes | type[Exception]:
    try:
        return bytes(write())
    except (NestedTooDeep, orjson.JSONEncodeError) as exc:
        return type(exc)


def deep_outcomes(value: Any) -> tuple[bytes | type[Exception], bytes | type[Exception]]:
    """What the pieces give (joined) and what orjson gives whole: a text or the error raised."""
    pieces = outcome(lambda: b"".join(json_pieces(value, SORTED_NUMPY, max_depth=PIECED_DEPTH)))
    return pieces, outcome(lambda: orjson.dumps(value, option=SORTED_NUMPY))


@pytest.mark.parametrize("depth", [*range(PIECED_DEPTH - 2, PIECED_DEPTH + 2), 253, 254, 255, 256, 400])
def test_deep_values_have_the_digest_they_had(depth: int) -> None:
    """orjson refuses past 254 levels (the standard library writes those); pieces stop well before that,
    so a value is refused, or written, exactly where the whole text was (the two texts differ: the
    standard library escapes non-ASCII text and hands arrays to ``default``)."""
    value = nested(depth, {"text": "é", "array": np.ones(_BIG, dtype=np.int8)})
    assert digests_of({"value": value}) == {"value": former_digest(value)}
    pieces, whole = deep_outcomes(value)
    if depth + 1 > PIECED_DEPTH:  # the leaf's values are one level below its dict
        assert pieces in (NestedTooDeep, whole)  # NestedTooDeep: the caller writes it whole
    else:
        assert pieces == whole and isinstance(whole, bytes)


@pytest.mark.parametrize("depth", [250, 251, 252, 253, 254, 255])
def test_a_deep_part_beside_an_array_is_refused_where_orjson_refuses_the_whole(depth: int) -> None:
    """A part without arrays is written by one orjson call, inside containers of the kinds around it, so
    orjson's nesting limit applies to it as within the whole value."""
    value = {"array": np.ones(_BIG, dtype=np.int8), "deep": [nested(depth, "é")]}
    assert digests_of({"value": value}) == {"value": former_digest(value)}
    pieces, whole = deep_outcomes(value)
    assert pieces == whole
    assert (whole is orjson.JSONEncodeError) == (depth + 2 > 254)  # the value, its list, then depth levels


def queued_monitor(positions: int) -> StalenessMonitor:
    """A monitor with one queued rollout of ``positions`` masked positions (int8 mask: a compact batch)."""
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    monitor.add([{"id": "long", "dispatch_version": 0, "samples": [{"mask": np.ones(positions, dtype=np.int8)}]}])
    return monitor


def test_a_checkpoint_of_a_long_queue_is_hashed_without_a_copy_of_its_text() -> None:
    """The digests of a state queuing 16M positions (32 MB of text) cost a small part of that text in
    memory (what orjson reserves for a piece of values), and are the digests of the whole text."""
    monitor = queued_monitor(16_000_000)
    with arrays_left_as_numpy():  # as the service snapshots: the arrays handed to orjson as they are
        state = monitor.state_dict()
    sink = {key: value for key, value in state["sink"].items() if key != "digests"}
    text_bytes = len(orjson.dumps(sink["queue"], option=orjson.OPT_SERIALIZE_NUMPY))
    assert text_bytes > 32_000_000
    tracemalloc.start()
    try:
        digests = digests_of(sink)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < text_bytes / 5, f"{peak} bytes traced hashing {text_bytes} bytes of text"
    assert digests == {key: former_digest(value) for key, value in sink.items()}
    assert digests == state["sink"]["digests"]
