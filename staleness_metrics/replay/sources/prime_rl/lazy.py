"""JSON lines read lazily (episode records are mostly token data the reader never needs):
simdjson's proxies where pysimdjson is installed, orjson's objects elsewhere. Every proxy of a line
must be gone before a :class:`Parser` parses the next, so each stream gets its own parser."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ....records import jsonio

try:
    import simdjson
except ImportError:  # no wheel for this Python: orjson reads every line
    simdjson = None  # type: ignore[assignment]


class DecodeError(ValueError):
    pass


class Parser:
    """Parses one line at a time (``simdjson.Parser`` reused, or ``orjson.loads``)."""

    def __init__(self) -> None:
        self._parser = simdjson.Parser() if simdjson is not None else None

    def parse(self, line: bytes) -> Any:
        if self._parser is None:
            try:
                return jsonio.loads(line)
            except jsonio.DecodeError as error:
                raise DecodeError(error.msg) from None
        try:
            return self._parser.parse(line)
        except ValueError as error:  # simdjson's errors are ValueErrors (and UnicodeDecodeError)
            raise DecodeError(str(error)) from None


def is_object(value: object) -> bool:
    return (simdjson is not None and type(value) is simdjson.Object) or isinstance(value, Mapping)


def is_array(value: object) -> bool:
    return isinstance(value, list) or (simdjson is not None and type(value) is simdjson.Array)


def get(value: object, key: str) -> Any:
    """``value[key]`` of an object, None when absent or when ``value`` is not an object."""
    if simdjson is not None and type(value) is simdjson.Object:
        return value.get(key)
    return value.get(key) if isinstance(value, Mapping) else None


def length(value: object) -> int:
    """Elements of an array (simdjson's count saturates at 2**24 - 1)."""
    size = len(value)  # type: ignore[arg-type]
    if size >= 0xFFFFFF and simdjson is not None and type(value) is simdjson.Array:
        return len(value.as_list())
    return size


def to_python(value: object) -> Any:
    if simdjson is not None:
        if type(value) is simdjson.Object:
            return value.as_dict()
        if type(value) is simdjson.Array:
            return value.as_list()
    return value


def _list(value: object) -> list[Any]:
    if simdjson is not None and type(value) is simdjson.Array:
        return value.as_list()  # type: ignore[no-any-return]
    if isinstance(value, list):
        return value
    raise TypeError(f"expected a list, got {type(value).__name__}")


def as_floats(value: object, *, nulls: bool = False) -> npt.NDArray[np.float64]:
    """A list of numbers as float64 (``nulls``: null -> NaN); ``TypeError`` for anything else."""
    if simdjson is not None and type(value) is simdjson.Array:
        with contextlib.suppress(TypeError, ValueError):  # a null, boolean or string among them
            return np.frombuffer(value.as_buffer(of_type="d"), dtype=np.float64)
    items = _list(value)
    kinds = set(map(type, items))  # a C loop: bool is its own type, so booleans are refused too
    if not kinds <= ({int, float, type(None)} if nulls else {int, float}):
        raise TypeError("null among the numbers" if type(None) in kinds and not nulls else "expected numbers")
    try:
        return np.array(items, dtype=np.float64) if items else np.zeros(0)
    except OverflowError:
        raise TypeError("a number beyond float range") from None


def as_ints(value: object) -> npt.NDArray[np.int64]:
    """A list of integers as int64; ``TypeError`` for anything else."""
    if simdjson is not None and type(value) is simdjson.Array:
        with contextlib.suppress(TypeError, ValueError):
            return np.frombuffer(value.as_buffer(of_type="i"), dtype=np.int64)
    items = _list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise TypeError("expected integers")
    try:
        return np.array(items, dtype=np.int64)
    except OverflowError:
        raise TypeError("integers beyond 64 bits") from None


def as_bools(value: object) -> npt.NDArray[np.bool_]:
    """A list of booleans (or 0/1) as bool; ``TypeError`` for anything else."""
    items = _list(value)
    size, true = len(items), items.count(True)  # C loops (``count`` compares by value: 1 == True)
    false = items.count(False)
    if true + false != size:
        raise TypeError("expected booleans")
    if true == size or false == size:  # a node samples all its tokens or none (the common layout)
        return np.full(size, true == size, dtype=bool)
    return np.array(items, dtype=bool)
