"""The replay's simdjson read of rollout lines (issue 12) gives exactly what the general path gives.

:class:`~staleness_metrics.records.simd_records.LineReader` either declines a line (``None``: the general path,
orjson then :func:`~staleness_metrics.records.model.parse_rollout`, reads it) or returns the very record the
general path returns: same echo (values, types, key order), same arrays, dtypes and bits (``-0.0`` is
not ``0.0``). Lines are drawn plain and with every oddity JSON allows where a list of numbers belongs
(booleans, nulls, strings, nested lists, objects, integers beyond 64 bits), repeated keys, escapes,
``[`` inside strings; numbers are written in every form a JSON writer may use.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from staleness_metrics.records import jsonio, simd_records
from staleness_metrics.records.model import ParsedRollout, parse_or_error
from staleness_metrics.records.simd_records import LineReader
from staleness_metrics.replay.stream import read_events

if not simd_records.AVAILABLE:
    # pysimdjson has no wheel for this Python yet: replay reads every line by the general path.
    assert sys.version_info >= (3, 14), "pysimdjson is a dependency below Python 3.14: install it"
    pytest.skip("pysimdjson is not installed for this Python", allow_module_level=True)


def _bits_equal(x: Any, y: Any) -> None:
    assert (x is None) == (y is None)
    if x is None:
        return
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()  # bit for bit: -0.0 and 0.0 differ here


def assert_same_record(fast: ParsedRollout, checked: object) -> None:
    assert isinstance(checked, ParsedRollout), checked
    assert list(fast.echo.items()) == list(checked.echo.items())
    assert [type(v) for v in fast.echo.values()] == [type(v) for v in checked.echo.values()]
    assert (fast.id, fast.dispatch_version, fast.completion_version, fast.frozen, fast.agentic) == (
        checked.id, checked.dispatch_version, checked.completion_version, checked.frozen, checked.agentic,
    )  # fmt: skip
    assert (fast.group_id, fast.env) == (checked.group_id, checked.env)
    assert len(fast.samples) == len(checked.samples)
    for a, b in zip(fast.samples, checked.samples):
        for name in ("mask", "spans", "token_versions", "logprobs", "trainer_logprobs"):
            _bits_equal(getattr(a, name), getattr(b, name))
        assert set(a.weights) == set(b.weights)
        for name in a.weights:
            _bits_equal(a.weights[name], b.weights[name])


def general(line: bytes) -> object:
    """What the general path makes of a rollout line (a record, a refusal, or a decode error)."""
    try:
        event = jsonio.loads(line)
    except jsonio.DecodeError:
        return "bad JSON"
    if not isinstance(event, dict) or event.get("type") != "rollout" or not isinstance(event.get("rollout"), dict):
        return "not a rollout"
    if len(event) != 2:
        return "a key a rollout event does not have"
    return parse_or_error(event["rollout"], booleans=b"true" in line or b"false" in line)


def read_one(reader: LineReader, line: bytes) -> ParsedRollout | None:
    """The line on its own: taken, then finished."""
    if not reader.take(line):
        return None
    (parsed,) = reader.finish()
    return parsed


def check(line: bytes) -> ParsedRollout | None:
    fast = read_one(LineReader(), line)
    if fast is not None:
        assert_same_record(fast, general(line))
    return fast


# -- numbers as text -------------------------------------------------------------------------------

# The strategies here are built once, not inside each draw: the same draws and examples, without
# hypothesis building and validating strategies per drawn number (most of these tests' time).
_DECIMALS = st.from_regex(r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,40})?([eE][+-]?[0-9]{1,3})?", fullmatch=True)
_NUMBER_KINDS = st.integers(0, 4)
_INTEGERS = st.integers(-(2**64), 2**64)
_FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([-0.0, 5e-324, 2.2250738585072014e-308])
_PRECISIONS = st.integers(1, 25)
_FORMATS = st.sampled_from("eEg")


@st.composite
def number_texts(draw: st.DrawFn) -> str:
    """A JSON number as some writer would spell it: shortest repr, fixed digits, long decimals, ints."""
    kind = draw(_NUMBER_KINDS)
    if kind == 4:
        return str(draw(_INTEGERS))
    if kind == 3:
        return draw(_DECIMALS)
    x = draw(_FLOATS)
    if kind == 0:
        return repr(x)
    if kind == 1:
        return orjson.dumps(x).decode()
    return f"{x:.{draw(_PRECISIONS)}{draw(_FORMATS)}}"


_NUMBER_TEXTS = number_texts()


def _line(texts: dict[str, str], head: str = '"id": "r1", "dispatch_version": 3') -> bytes:
    fields = ", ".join(f'"{k}": {v}' for k, v in texts.items())
    return ('{"type": "rollout", "rollout": {' + head + ', "samples": [{' + fields + "}]}}").encode()


@settings(max_examples=400, deadline=None)
@given(st.lists(number_texts(), min_size=1, max_size=12))
@example(["-0.0", "-0", "0", "4.9e-324", "2.2250738585072011e-308", "1.7976931348623157e308"])
@example(["0.1000000000000000055511151231257827021181583404541015625", "1E5", "1e+05", "-1.5E-7"])
@example([str(2**53 + 1), str(2**63 - 1), str(-(2**63)), str(2**63), str(2**64 - 1), str(2**64)])
def test_numbers_are_read_to_the_bits_the_standard_library_gives(texts: list[str]) -> None:
    """Every float list is read as ``float()`` of the standard library's value, or declined."""
    n = len(texts)
    listed = "[" + ", ".join(texts) + "]"
    line = _line({"mask": json.dumps([1] * n), "logprobs": listed, "rl_weights": listed})
    fast = check(line)
    values = json.loads(listed)
    plain = all(
        (isinstance(v, int) and abs(v) < 2**63) or (isinstance(v, float) and math.isfinite(v) and abs(v) < 2**63)
        for v in values
    )
    if plain and not any(len(t) >= 19 and t.lstrip("-").isdigit() for t in texts):
        assert fast is not None  # plain numbers are read by this path, not declined
        expected = np.array([float(v) for v in values], dtype=np.float64)
        _bits_equal(fast.samples[0].logprobs, expected)


@settings(max_examples=200, deadline=None)
@given(st.lists(number_texts(), min_size=1, max_size=8))
def test_integer_lists_take_integers_only(texts: list[str]) -> None:
    n = len(texts)
    listed = "[" + ", ".join(texts) + "]"
    fast = check(_line({"mask": json.dumps([1] * n), "token_versions": listed}))
    if fast is not None:
        assert all(isinstance(v, int) for v in json.loads(listed))


# -- whole records ---------------------------------------------------------------------------------

_ODD = st.sampled_from(
    [
        "true",
        "false",
        "null",
        '"1"',
        "[1]",
        "[]",
        "{}",
        '{"a": 1}',
        "NaN",
        "Infinity",
        "1.0",
        "-1",
        "2",
        str(2**64),
        str(-(2**63) - 1),
        "1e400",
        "[[1, 2]]",
    ]
)


_SAMPLE_COUNTS = st.integers(1, 3)
_LENGTHS = st.integers(0, 5)
_MASK_TEXTS = st.sampled_from(["0", "1"])
_LABEL_KINDS = st.integers(0, 3)
_VERSION_TEXTS = st.sampled_from(["-1", "0", "2", "7"])
_SPAN_VERSIONS = st.lists(st.integers(0, 5), max_size=3)
_ONE_IN_TEN = st.integers(0, 9)
_ONE_IN_FOUR = st.integers(0, 3)
_ONE_IN_TWENTY = st.integers(0, 19)
_ODD_FIELDS = st.sampled_from(["null", '"x"', "3", "[[0], [1]]", "{}"])
_IDS = st.sampled_from(['"r1"', '"r[1]"', '"r\\u00e91"', '"r\u00e91"', '"r\\"1"', '""', "7"])  # escapes, raw UTF-8, "["
_HEAD_FIELDS = [
    (name, st.sampled_from(options))
    for name, options in (
        ("dispatch_version", ["0", "3", "-1", "1.0", "null", "true", str(2**63), str(2**64)]),
        ("completion_version", ["4", "null", "2.5"]),
        ("group_id", ['"g"', "null", "7"]),
        ("env", ['"math"', '""', "null"]),
        ("source", ['"live"', '"frozen"', '"other"']),
        ("agentic", ["true", "false", "0"]),
        ("weird", ["1"]),
    )
]
_ONE_IN_THREE = st.integers(0, 2)
_FOUR_IN_FIVE = st.integers(0, 4)
_EVENT_EXTRAS = st.sampled_from(['"note": [1]', '"note": "x"', '"type": "ship"'])
_SPACINGS = st.sampled_from(["", " ", "\t"])
_LINE_ENDS = st.sampled_from(["", "\n", "\r\n", " "])


@st.composite
def rollout_lines(draw: st.DrawFn) -> bytes:
    samples = []
    for _ in range(draw(_SAMPLE_COUNTS)):
        n = draw(_LENGTHS)
        fields: dict[str, list[str] | str] = {"mask": [draw(_MASK_TEXTS) for _ in range(n)]}
        label = draw(_LABEL_KINDS)
        if label in (1, 3):
            fields["token_versions"] = [draw(_VERSION_TEXTS) for _ in range(n)]
        if label in (2, 3):
            pairs = [f"[{v}, {s}]" for v, s in zip(sorted(draw(_SPAN_VERSIONS)), range(0, 9, 3))]
            fields["weight_versions"] = "[" + ", ".join(pairs) + "]"
        for name in ("rl_weights", "ce_weights", "ref_kl_weights", "logprobs", "trainer_logprobs"):
            if draw(st.booleans()):
                size = n if draw(_ONE_IN_TEN) else n + 1
                fields[name] = [draw(_NUMBER_TEXTS) for _ in range(size)]
        if draw(_ONE_IN_FOUR) == 0:  # one odd element, or a null field, or an odd field
            name = draw(st.sampled_from(sorted(fields)))
            if isinstance(fields[name], list) and fields[name] and draw(st.booleans()):
                elements = list(fields[name])
                elements[draw(st.integers(0, len(elements) - 1))] = draw(_ODD)
                fields[name] = elements
            else:
                fields[name] = draw(_ODD_FIELDS)
        if draw(_ONE_IN_TWENTY) == 0:
            fields["extra"] = "1"
        text = {k: v if isinstance(v, str) else "[" + ", ".join(v) + "]" for k, v in fields.items()}
        samples.append("{" + ", ".join(f'"{k}": {v}' for k, v in text.items()) + "}")
    head = ['"id": ' + draw(_IDS)]
    for name, options in _HEAD_FIELDS:
        if draw(_ONE_IN_THREE) == 0 if name != "dispatch_version" else draw(_FOUR_IN_FIVE):
            head.append(f'"{name}": {draw(options)}')
    if draw(_ONE_IN_TEN) == 0:
        head.append(head[0].replace("r1", "r2"))  # a repeated key
    order = draw(st.permutations(range(len(head) + 1)))
    parts = [*head, '"samples": [' + ", ".join(samples) + "]"]
    rollout = "{" + ", ".join(parts[i] for i in order) + "}"
    event = ['"type": "rollout"', f'"rollout": {rollout}']
    if draw(_ONE_IN_TEN) == 0:
        event.append(draw(_EVENT_EXTRAS))
    spacing = draw(_SPACINGS)
    return ("{" + ("," + spacing).join(event) + "}" + draw(_LINE_ENDS)).encode()


@settings(max_examples=600, deadline=None)
@given(rollout_lines())
def test_a_line_is_read_as_the_general_path_reads_it_or_left_to_it(line: bytes) -> None:
    check(line)


def test_plain_lines_of_every_shape_take_this_path() -> None:
    """The lines a replay usually sees are read here (else the comparisons above would prove little)."""
    lines = [
        _line(
            {
                "mask": "[0, 1, 1]",
                "token_versions": "[-1, 2, 3]",
                "rl_weights": "[0.0, 1.0, 1]",
                "logprobs": "[-0.5, -1e-3, -0.0]",
            }
        ),
        _line(
            {
                "mask": "[0, 1]",
                "weight_versions": "[[1, 0], [2, 1]]",
                "trainer_logprobs": "[-1, -2]",
                "ce_weights": "[1, 0]",
                "ref_kl_weights": "[0.5, 0.5]",
            }
        ),
        _line({"mask": "[]", "weight_versions": "[]"}),
        _line({"mask": "[1]", "logprobs": "null", "token_versions": "null"}),
        _line(
            {"mask": "[1]"},
            head='"id": "r\u00e9", "source": "frozen", "agentic": true, "env": "code", '
            '"group_id": "g", "completion_version": 4',
        ),
    ]
    for line in lines:
        assert check(line) is not None, line


@pytest.mark.parametrize(
    "line",
    [
        _line({"mask": "[0, 1]", "logprobs": "[[1], [2]]"}),  # nested lists: as_buffer would flatten them
        _line({"mask": "[[0], [1]]"}),
        _line({"mask": "[0, 1]", "weight_versions": "[[1], [2, 0, 0]]"}),
        _line({"mask": "[0, 1]", "weight_versions": "[[1, [0]], [2, 0]]"}),
        _line({"mask": '[1], "mask": [0]'}),  # a repeated key (simdjson finds the first, orjson keeps the last)
        _line({"mask": "[1]", "logprobs": "[true]"}),
        _line({"mask": "[1]", "logprobs": "[null]"}),
        _line({"mask": "[1]", "unknown": "null"}),  # an unknown field, null or not: the general path names it
        _line({"mask": "[2]"}),
        _line({"mask": "[1]"}, head='"id": "r\\ud800", "dispatch_version": 3'),  # a lone surrogate
        b"\xef\xbb\xbf" + _line({"mask": "[1]"}),  # a byte order mark (simdjson skips it, orjson refuses)
        b'{"type": "ship", "step": 1}',
        _line({"mask": "[1]"})[:-1] + b', "note": 1}',  # a key a rollout event lacks: the general path names it
        _line({"mask": "[1]"})[:-1] + b', "rollout": {}}',  # a repeated key
        _line({"mask": "[1,]"}),  # not JSON, in any reader
        _line({"mask": "[+1]"}),
        _line({"mask": "[.5]"}),
        _line({"mask": "[1]"}, head='"id": "r\t1", "dispatch_version": 3'),  # a raw control character
        _line({"mask": "[1]"}) + b"\x0c",  # a form feed is not JSON whitespace
        _line({"mask": "[1]", "logprobs": f"[{2**63}]"}),  # what records' fast float read sends to the checked path
        _line({"mask": "[]", "weight_versions": "[[0, 0]]"}),  # more spans than positions: refused as it is parsed
        _line({"mask": "[1]", "weight_versions": "[[0, 0], [1, 0]]"}),
    ],
)
def test_lines_this_path_must_leave_to_the_general_one(line: bytes) -> None:
    assert read_one(LineReader(), line) is None


def test_one_reader_reads_many_lines_and_declined_ones_in_between() -> None:
    """The parser is reused line after line; a declined or broken line does not disturb the next."""
    reader = LineReader()
    good = _line({"mask": "[0, 1]", "logprobs": "[-1.5, -2]"})
    for line in [good, b"{", good, _line({"mask": "[true]"}), good, b'{"a": 1e400}', good]:
        fast = read_one(reader, line)
        assert (fast is not None) == (line == good)
        if fast is not None:
            assert_same_record(fast, general(line))


def test_read_events_parse_gives_the_events_of_the_general_read() -> None:
    """``read_events(parse=True)``: a parsed record where it can, the decoded one elsewhere, same lines."""
    lines = [
        _line({"mask": "[0, 1]", "logprobs": "[-1.5, -2]"}),
        b"",
        _line({"mask": "[0, 1]", "logprobs": "[true, -2]"}),
        b'{"type": "ship", "step": 2}',
    ]
    fast = list(read_events(lines, parse=True))
    plain = list(read_events(lines))
    assert [(e.line, e.kind, e.step) for e in fast] == [(e.line, e.kind, e.step) for e in plain] == [
        (1, "rollout", 0), (3, "rollout", 0), (4, "ship", 2),
    ]  # fmt: skip
    assert fast[0].parsed is not None and fast[0].rollout is None
    assert_same_record(fast[0].parsed, general(lines[0]))
    assert fast[1].parsed is None and fast[1].rollout == plain[1].rollout and fast[1].booleans


def test_values_checked_together_refuse_only_the_lines_that_hold_them() -> None:
    """Lines taken together are checked by one reduction per kind of list; a mask of 2, a version
    beyond 2**53 or a float of 2**63 declines its own line only, and the others keep their values."""
    reader = LineReader()
    good = [
        _line({"mask": f"[0, {k % 2}]", "token_versions": f"[{k}, -1]", "logprobs": f"[-{k}.5, {k}]"}) for k in range(4)
    ]
    bad = [
        _line({"mask": "[0, 2]", "logprobs": "[1, 1]"}),
        _line({"mask": "[0, 1]", "token_versions": f"[0, {2**53 + 1}]"}),
        _line({"mask": "[0, 1]", "weight_versions": f"[[{-(2**53) - 1}, 0]]"}),
        _line({"mask": "[0, 1]", "ref_kl_weights": f"[0, {2**63}]"}),
    ]
    lines = [good[0], bad[0], good[1], bad[1], bad[2], good[2], bad[3], good[3]]
    assert all(reader.take(line) for line in lines[:3])
    # declined as it is read (a nested list found after its other lists were copied out): nothing kept
    assert not reader.take(_line({"mask": "[0, 1]", "logprobs": "[1, 1]", "rl_weights": "[[1], [1]]"}))
    assert all(reader.take(line) for line in lines[3:])
    results = reader.finish()
    assert [r is not None for r in results] == [line in good for line in lines]
    for line, result in zip(lines, results):
        if result is not None:
            assert_same_record(result, general(line))
    assert reader.finish() == []  # finished lines are forgotten
