"""JSON in and out of the replay paths, through orjson; a line orjson refuses or might read
differently (``NaN``, integers beyond 64 bits, lone surrogates) is read by the standard library."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from ..compiled import CompiledLoop

DecodeError = json.JSONDecodeError  # orjson.JSONDecodeError is a subclass of it
_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_TOO_DEEP = "arrays or objects nested too deeply"  # (orjson stops at 1024 levels)

# orjson reads an integer beyond 64 bits as a float: a run of 19 digits goes to the standard library
_DIGITS = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
_LONG_NUMBER = b"0" * 19


def has_long_integer(raw: bytes | bytearray) -> bool:
    """True when ``raw`` holds a run of 19 digits or more: an integer orjson may read as a float."""
    return _LONG_NUMBER in raw.translate(_DIGITS)


def loads(text: str | bytes) -> Any:
    """Decode one JSON document; raises :class:`json.JSONDecodeError`."""
    return loads_checked(text)[0]


def loads_checked(text: str | bytes) -> tuple[Any, bool]:
    """:func:`loads`, and whether every string decoded is known to be valid Unicode."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as error:
        if "depth" in error.msg:  # final: the standard library's limit depends on the Python
            raise DecodeError(_TOO_DEEP, "", 0) from None
        return _standard_loads(text), False
    if has_long_integer(text if isinstance(text, bytes) else text.encode()):
        return _standard_loads(text), False
    return value, True


def _standard_loads(text: str | bytes) -> Any:
    if isinstance(text, bytes):
        # UTF-8 as json.loads reads it (never its guess at UTF-32); bad bytes become surrogates
        text = text.decode("utf-8-sig", "surrogateescape")
    try:
        return json.loads(text)
    except RecursionError:  # (a depth orjson reads, past the interpreter's recursion limit)
        raise DecodeError(_TOO_DEEP, text, 0) from None


def _default(value: object) -> object:
    if isinstance(value, np.ndarray):  # not C-contiguous, or a dtype orjson does not write
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def dumps(value: Any) -> bytes:
    """``value`` (numpy too) as compact JSON; callers pass finite numbers, float32 made float64."""
    return orjson.dumps(value, default=_default, option=_OPTIONS)


def dumps_line(value: Any) -> bytes:
    return orjson.dumps(value, default=_default, option=_OPTIONS | orjson.OPT_APPEND_NEWLINE)


# orjson's 0.0 and 1.0, each with a comma after, as one 4-byte word each
_ZERO_WORD, _ONE_WORD = np.frombuffer(b"0.0,1.0,", dtype=np.uint32).tolist()
_ONE_BITS = int(np.float64(1.0).view(np.int64))  # (-0.0, written "-0.0", has other bits than 0.0)
_EMPTY_LIST = orjson.Fragment(b"[]")


@CompiledLoop
def _zero_one_words(bits: npt.NDArray[np.int64], words: npt.NDArray[np.uint32]) -> bool:  # pragma: no cover - compiled
    plain = True
    for i in range(len(bits)):  # (no branch: a vector select)
        one = bits[i] == _ONE_BITS
        plain &= one | (bits[i] == 0)
        words[i] = _ONE_WORD if one else _ZERO_WORD
    return plain


def zero_one_floats(arrays: Sequence[npt.NDArray[np.float64]]) -> list[orjson.Fragment] | None:
    """Each float64 array's JSON, a word per value, when every value is 0.0 or 1.0; else None."""
    if not arrays:
        return []
    bits = np.concatenate(arrays).view(np.int64)
    words = np.empty(len(bits), dtype=np.uint32)
    if not _zero_one_words(bits, words):
        return None
    text = words.data.cast("B")
    out, start = [], 0
    for array in arrays:
        end = start + 4 * len(array)
        out.append(orjson.Fragment(b"".join((b"[", text[start : end - 1], b"]"))) if end > start else _EMPTY_LIST)
        start = end
    return out
