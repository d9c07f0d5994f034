"""Reading a rollout batch body without keeping a Python object per position.

A large body is mostly one or two long per-position lists. The standard JSON reader builds them as lists of
(shared, small) ints or of floats; here each long list is turned into one numpy array as soon as the body
is parsed and the list is dropped, so the peak memory of a request is the body, one list at a time and the
arrays, not every list at once. Bodies up to :data:`FAST_DECODE_MAX_BYTES` (every small request) are
decoded by orjson, as replay decodes its lines (:mod:`staleness_metrics.jsonio`), several times faster;
larger ones by the standard library, because orjson building a 28M-item list peaks at three times the
list's size. Where orjson refuses a body or might read it differently (``NaN``, lone surrogates, integers
beyond 64 bits), the standard library decodes it, so a body means the same, and is refused with the same
message, whichever decoder read it. Only lists whose items are all of the expected JSON types are converted, and
only into a dtype that holds every value exactly; anything else stays a list, and the library's validation
names the field, the position and the value as it always does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from ..jsonio import has_long_integer

__all__ = ["COMPACT_MIN_LENGTH", "FAST_DECODE_MAX_BYTES", "compact_records", "read_json"]

COMPACT_MIN_LENGTH = 1024  # shorter lists cost little; they stay lists
FAST_DECODE_MAX_BYTES = 1024 * 1024
_INT_FIELDS = {"mask": np.int8, "token_versions": np.int64}
_NOT_PER_POSITION = frozenset({"weight_versions"})


def read_json(held: list[bytearray]) -> Any:
    """The JSON value of the one body in ``held`` (``ValueError`` when it is not UTF-8 JSON). The bytes are
    released once decoded, before the parse builds its lists."""
    body = held.pop()
    if len(body) <= FAST_DECODE_MAX_BYTES:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # the standard library decides, and words the error
        else:
            if not has_long_integer(body):
                return value
    text = body.decode("utf-8")
    del body
    return json.loads(text)


def _compact(name: str, values: list[Any]) -> Any:
    kinds = set(map(type, values))  # one C-level pass, no per-item Python code
    if name in _INT_FIELDS:
        if kinds != {int}:
            return values
        try:
            array = np.fromiter(values, dtype=_INT_FIELDS[name], count=len(values))
        except (OverflowError, ValueError):
            return values  # out of the dtype's range: the validation reports it from the list
        if name == "mask" and not bool(((array == 0) | (array == 1)).all()):
            return values
        return array
    try:
        if kinds == {int}:  # integer weights stay integers (exactly what the list said)
            return np.fromiter(values, dtype=np.int64, count=len(values))
        if kinds == {float, int} or kinds == {float}:  # as the library reads a mixed list: float64
            return np.fromiter(values, dtype=np.float64, count=len(values))
    except (OverflowError, ValueError):
        pass
    return values


def compact_records(records: Any) -> None:
    """Replace, in place, every long per-position list of every sample by a numpy array."""
    if not isinstance(records, list):
        return
    for record in records:
        samples = record.get("samples") if isinstance(record, Mapping) else None
        if not isinstance(samples, list):
            continue
        for sample in samples:
            if not isinstance(sample, dict):
                continue
            for name, values in sample.items():
                if name not in _NOT_PER_POSITION and isinstance(values, list) and len(values) >= COMPACT_MIN_LENGTH:
                    sample[name] = _compact(name, values)
