"""Reading a rollout body in memory bounded by its size: long number lists become arrays; a body
costing far more, or cutting more span rows than it may, is refused (docs/service.md, "Limits")."""

from __future__ import annotations

import gc
import json
import re
import sys
import threading
from array import array
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
from starlette.exceptions import HTTPException

from ..records.jsonio import has_long_integer
from .limits import SPAN_ROW_FLOOR
from .models import ErrorItem

COMPACT_MIN_LENGTH = 1024  # shorter lists cost little; they stay lists
FAST_DECODE_MAX_BYTES = 1024 * 1024
# what a large body's other values may cost besides its size (not millions of tiny values)
SKELETON_ALLOWANCE = 48 * 1024 * 1024
_VALUE_COST = 72  # bytes of Python object per JSON value: a dict, list, str or float with its slot
_PIECE_BYTES = 256 * 1024  # read into Python objects at once while a long list becomes an array
_INT_FIELDS = ("mask", "token_versions")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FLOAT_FIELDS = ("rl_weights", "ce_weights", "ref_kl_weights", "logprobs", "trainer_logprobs")
_LIST_FIELDS = ("mask", "token_versions", "weight_versions", *_FLOAT_FIELDS)
# a per-position list's key, ":" and "[" (its items start just after)
_LIST_START = re.compile(rb'"(' + "|".join(_LIST_FIELDS).encode() + rb')"[ \t\r\n]*:[ \t\r\n]*\[')
# a list's end, and any byte it may not hold to be read as numbers (pairs for weight_versions)
_NUMBERS = (re.compile(rb"\]"), re.compile(rb"[^0-9eE+\-. \t\r\n,]"))
_SHAPES = {
    "weight_versions": (re.compile(rb"\][ \t\r\n]*\]"), re.compile(rb"[^0-9\- \t\r\n,\[\]]")),
    "trainer_logprobs": (_NUMBERS[0], re.compile(rb"[^0-9eE+\-. \t\r\n,nul]")),
}
# a JSON text can only spell NUL as an escape, which a body using this path lacks
_PLACEHOLDER = "\x00#"


_gc_lock = threading.Lock()
_gc_pausers = 0


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic collector paused while a body is read and applied (no cycles to find)."""
    global _gc_pausers
    with _gc_lock:
        ours = _gc_pausers > 0 or gc.isenabled()  # else paused by someone else: leave it to them
        if ours:
            _gc_pausers += 1
            gc.disable()
    try:
        yield
    finally:
        if ours:
            with _gc_lock:
                _gc_pausers -= 1
                if _gc_pausers == 0:
                    gc.enable()


class BodyTooComplex(HTTPException):
    """A body whose JSON values would cost far more memory than its size (413)."""


class BodyTooDeep(HTTPException):
    """A body nested too deeply to read (400)."""


_TOO_DEEP = "the body is nested too deeply to read"  # (orjson stops at 1024 levels)


def read_json(held: list[bytearray]) -> Any:
    """The JSON value of the one body in ``held``, whose bytes are released once read."""
    try:
        if len(held[-1]) > FAST_DECODE_MAX_BYTES:
            return _read_large(held)  # no reference here keeps the body: it drops it once read
        body = held.pop()
        try:  # (json reads NaN, and words errors)
            value = orjson.loads(body)
            if not has_long_integer(body):  # else orjson would read a float
                return value
        except orjson.JSONDecodeError as error:
            if "depth" in error.msg:  # final: the standard library's limit depends on the Python
                raise BodyTooDeep(400, _TOO_DEEP) from None
        text = body.decode("utf-8")
        del body
        return _loads(text)
    except RecursionError:
        raise BodyTooDeep(400, _TOO_DEEP) from None


def _read_large(held: list[bytearray]) -> Any:
    body = held.pop()
    arrays: list[npt.NDArray[Any]] = []
    parts: list[bytes] = []
    done = 0
    if b"\\u0000" not in body:  # else a string could spell a placeholder: no list is read ahead
        for found in _LIST_START.finditer(body):
            if found.start() < done:
                continue
            field, start = found[1].decode(), found.end()
            if (converted := _convert(body, field, start)) is None:
                continue
            array, end = converted
            parts.append(bytes(body[done : start - 1]))
            parts.append(b'"\\u0000#%d"' % len(arrays))  # the JSON spelling of the placeholder
            arrays.append(array)
            done = end
    if not arrays:  # nothing read ahead: the body is its own skeleton
        _check_budget(body, len(body))
        text = body.decode("utf-8")
        del body
        return _loads(text)
    parts.append(bytes(body[done:]))
    skeleton = b"".join(parts)
    del parts
    _check_budget(skeleton, len(body))
    del body

    def swap(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)  # a repeated key: the last wins, as in any JSON reader
        for key, value in out.items():
            if type(value) is str and value.startswith(_PLACEHOLDER):
                out[key] = arrays[int(value[len(_PLACEHOLDER) :])]
        return out

    try:
        return _loads(skeleton.decode("utf-8"), object_pairs_hook=swap)
    except json.JSONDecodeError as error:
        # its position is the skeleton's, not the body's: not shown
        raise ValueError(f"{error.msg} (the body is not valid JSON)") from None


def _loads(text: str, **hooks: Any) -> Any:
    try:
        return json.loads(text, **hooks)
    except ValueError as error:  # bad JSON, or an integer of more digits than Python converts
        if isinstance(error, json.JSONDecodeError):  # (quadratic time): read as its first ones,
            raise  # out of int64 all the same, so that the range checks name its field
        limit = sys.get_int_max_str_digits()
        return json.loads(text, parse_int=lambda digits: int(digits[:limit]), **hooks)


def _check_budget(skeleton: bytes | bytearray, body_size: int) -> None:
    values = sum(map(skeleton.count, (b",", b"{", b"[", b":")))
    if (cost := values * _VALUE_COST) > SKELETON_ALLOWANCE + body_size:
        raise BodyTooComplex(
            413,
            f"the body holds about {values} JSON values outside long per-position number "
            f"lists, which would take about {cost // 2**20} MiB to read; send smaller bodies "
            "(the rollouts in smaller batches)",
        )


def _convert(body: bytearray, field: str, start: int) -> tuple[npt.NDArray[Any], int] | None:
    ends, not_allowed = _SHAPES.get(field, _NUMBERS)
    found = ends.search(body, start)
    if found is None or not_allowed.search(body, start, found.start()) is not None:
        return None
    if (end := found.end()) - start < 2 * COMPACT_MIN_LENGTH:
        return None
    inner_end = end - 1  # the closing "]"
    pairs = field == "weight_versions"
    # the item count, from the separators: the array is allocated at its final size
    count = body.count(b"[", start, inner_end) if pairs else body.count(b",", start, inner_end) + 1
    out: npt.NDArray[Any] | None = None
    filled = 0
    at = start
    while at < inner_end:
        if pairs:  # a piece ends with a pair's "]", the next starts after a comma
            close = body.find(b"]", min(at + _PIECE_BYTES, inner_end - 1), inner_end)
            cut = inner_end if close < 0 else close + 1
            comma = body.find(b",", cut, inner_end)
            after = inner_end if comma < 0 else comma + 1
        else:
            comma = body.find(b",", min(at + _PIECE_BYTES, inner_end), inner_end)
            cut = inner_end if comma < 0 else comma
            after = cut + 1
        text = bytes(body[at:cut]).strip()
        at = after
        if not text or has_long_integer(text):
            return None  # "[1,,2]", a trailing comma, or an integer orjson would read as a float
        try:
            items = orjson.loads(b"[" + text + b"]")
        except orjson.JSONDecodeError:
            return None  # the standard library reads the list, and words the error
        del text
        piece = _piece(field, items)
        del items
        if piece is None or filled + len(piece) > count:
            return None
        if out is None:
            out = np.empty((count, *piece.shape[1:]), dtype=piece.dtype)
        elif piece.dtype != out.dtype:
            # as numpy joins mixed pieces: int8, int64 to int64; ints, floats to float64
            wider = np.empty(out.shape, dtype=np.result_type(out, piece))
            wider[:filled] = out[:filled]
            out = wider
        out[filled : filled + len(piece)] = piece
        filled += len(piece)
    return None if out is None or filled != count else (out, end)


def _piece(field: str, items: list[Any]) -> npt.NDArray[Any] | None:
    """A long list (or a piece of one) as an array holding each value exactly, or None."""
    kinds = set(map(type, items))
    try:
        if field == "weight_versions":
            if not items or kinds != {list} or set(map(len, items)) != {2}:
                return None
            flat = list(chain.from_iterable(items))
            if set(map(type, flat)) != {int}:
                return None
            pairs = np.frombuffer(array("q", flat), dtype=np.int64).reshape(-1, 2)
            if pairs.min() >= _INT32_MIN and pairs.max() <= _INT32_MAX:
                return pairs.astype(np.int32)  # 8 bytes a pair where "[0,0]," is 6 of text
            return pairs
        if kinds == {int}:
            values = np.frombuffer(array("q", items), dtype=np.int64)
            if values.min() >= -128 and values.max() <= 127:  # (not empty: kinds holds int)
                return values.astype(np.int8)
            if field == "token_versions" and values.min() >= _INT32_MIN and values.max() <= _INT32_MAX:
                return values.astype(np.int32)
            return values
        if field in _INT_FIELDS:
            return None  # a float or null where integers belong: the library names it
        if kinds <= {int, float}:
            return np.frombuffer(array("d", items), dtype=np.float64)
        if field == "trainer_logprobs" and kinds <= {int, float, type(None)}:
            return np.array([np.nan if item is None else item for item in items], dtype=np.float64)
    except (OverflowError, ValueError, TypeError):
        return None
    return None


def compact_records(records: list[dict[str, Any]]) -> None:
    """Replace, in place, long per-position lists (and float lists holding an int) by arrays."""
    for record in records:
        samples = record.get("samples")
        for sample in samples if isinstance(samples, list) else ():
            if not isinstance(sample, dict):
                continue
            for name, values in sample.items():
                if not isinstance(values, list) or name == "weight_versions":
                    continue
                # a float list holding an integer: an array, as in a large body (one digest)
                if len(values) >= COMPACT_MIN_LENGTH or (name not in _INT_FIELDS and int in set(map(type, values))):
                    compact = _piece(name, values)
                    if compact is not None:
                        sample[name] = compact


PIECE_POSITIONS = 1 << 20  # positions compared at once: a 1 MiB bool and at most 8 MiB of indices


def allowed_span_rows(body_bytes: int, body_bytes_per_row: int) -> int:
    """The span rows a body of ``body_bytes`` may cut (``body_bytes_per_row`` 0: no cap)."""
    return -1 if body_bytes_per_row <= 0 else max(SPAN_ROW_FLOOR, body_bytes // body_bytes_per_row)


def _length(values: Any) -> int:
    return len(values) if isinstance(values, Sequence | np.ndarray) and not isinstance(values, str) else 0


def _changes(values: Any, unlabelled: int | None = None) -> int:
    """Positions whose value differs from the previous one, ``unlabelled`` positions skipped; 0 for
    values that are not a 1-d list or array of numbers (the library refuses them, naming why)."""
    try:
        values = np.asarray(values) if isinstance(values, list) else values
    except (ValueError, TypeError, OverflowError):
        return 0
    if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype.kind not in "biuf":
        return 0
    changes = 0
    last: Any = None
    for start in range(0, len(values), PIECE_POSITIONS):
        piece = values[start : start + PIECE_POSITIONS]
        if unlabelled is not None:
            piece = piece[piece != unlabelled]
        if len(piece) == 0:
            continue
        changes += int(np.count_nonzero(piece[1:] != piece[:-1]))
        if last is not None and piece[0] != last:
            changes += 1
        last = piece[-1]
    return changes


def _sample_rows(sample: Mapping[str, Any]) -> tuple[int, str]:
    """An upper bound of the rows ``sample`` cuts, and the field that cuts the most of them."""
    positions = max(_length(sample.get("mask")), _length(sample.get("token_versions")))
    by_field = {
        "mask": _changes(sample.get("mask")),
        "token_versions": _changes(sample.get("token_versions"), -1),
        "weight_versions": _length(sample.get("weight_versions")),
    }
    rows = min(1 + sum(by_field.values()), max(1, positions))
    return rows, max(by_field, key=lambda name: by_field[name])


def check_span_rows(records: Any, body_bytes: int, body_bytes_per_row: int) -> ErrorItem | None:
    """Where the rollouts of a body pass the span rows it may cut, else None."""
    allowed = allowed_span_rows(body_bytes, body_bytes_per_row)
    if allowed < 0 or not isinstance(records, list):
        return None
    samples_of = [
        (position, record, list(enumerate(record["samples"])))
        for position, record in enumerate(records)
        if isinstance(record, Mapping) and isinstance(record.get("samples"), list)
    ]
    by_length = sum(
        max(1, _length(s.get("mask")), _length(s.get("token_versions")))
        for _, _, samples in samples_of
        for _, s in samples
        if isinstance(s, Mapping)
    )
    if by_length <= allowed:
        return None
    total = 0
    for position, record, samples in samples_of:
        for index, sample in samples:
            if not isinstance(sample, Mapping):
                continue
            rows, field = _sample_rows(sample)
            total += rows
            if total > allowed:
                rid = record.get("id")
                return ErrorItem(
                    rollout_id=None if rid is None else str(rid),
                    index=position,
                    field=f"samples[{index}].{field}",
                    reason=f"the body cuts more than {allowed:,} span rows (runs of one mask value "
                    f"and one version; this rollout brings them to {total:,}): a body of "
                    f"{body_bytes:,} bytes may cut one per {body_bytes_per_row} bytes, at "
                    f"least {SPAN_ROW_FLOOR:,} (serve --body-bytes-per-span-row)",
                )
    return None
