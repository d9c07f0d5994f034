"""Checked reading, exact writing of checkpoint states (SPEC 13): plain data read value by value,
the first wrong one refused by key path; arrays keep their dtype; one digest per top-level key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
import orjson

from .errors import ConfigError

FORMAT = 3
READABLE_FORMATS = (1, 2, 3)  # format 1 (before digests) still loads


def fail(path: str, reason: str) -> NoReturn:
    """Refuse a checkpoint, naming the key path and the reason."""
    raise ConfigError(f"checkpoint: {path or 'state'}: {reason}")


def join(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if key == "":  # rollouts without an env are counted under ""
        return f'{path}[""]'
    return f"{path}.{key}" if path else str(key)


def kind_of(value: object) -> str:
    return "null" if value is None else type(value).__name__


def mapping(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        fail(path, f"expected an object, got {kind_of(value)}")
    return value


def keys(value: object, path: str, required: Collection[str], optional: Collection[str] = ()) -> Mapping[str, Any]:
    """``value`` as a mapping of every ``required`` key and no key but ``optional`` ones."""
    found = mapping(value, path)
    for key in required:
        if key not in found:
            fail(join(path, key), "missing")
    for key in found:
        if key not in required and key not in optional:
            fail(join(path, str(key)), "unknown key")
    return found


def integer(value: object, path: str, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        fail(path, f"expected an integer, got {kind_of(value)}")
    number = int(value)
    if low is not None and number < low:
        fail(path, f"{number} is below {low}")
    if high is not None and number > high:
        fail(path, f"{number} is above {high}")
    return number


def boolean(value: object, path: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        fail(path, f"expected true or false, got {kind_of(value)}")
    return bool(value)


def string(value: object, path: str, optional: bool = False) -> Any:
    if not (isinstance(value, str) or (optional and value is None)):
        fail(path, f"expected a string{' or null' if optional else ''}, got {kind_of(value)}")
    return value


def sequence(value: object, path: str, length: int | None = None) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        fail(path, f"expected a list, got {kind_of(value)}")
    if length is not None and len(value) != length:
        fail(path, f"{len(value)} entries where {length} are needed")
    return value


def strings(value: object, path: str, optional: bool = False, unique: bool = False) -> list[Any]:
    out = list(sequence(value, path))
    for index, item in enumerate(out):
        if not (isinstance(item, str) or (optional and item is None)):
            string(item, join(path, index), optional)
    if unique and len(set(out)) != len(out):
        seen: set[Any] = set()
        repeated = next(item for item in out if item in seen or seen.add(item))  # type: ignore[func-returns-value]
        fail(path, f"{repeated!r} appears twice")
    return out


# Arrays of more values are encoded this many values at a time (orjson reserves an output buffer
# for the longest text of each value: 32 MB for 1M int8 values whole).
PIECE_ITEMS = 1 << 16
# Nesting json_pieces follows when given a limit: far below orjson's (254), so text written in
# pieces is text orjson would have written whole. Deeper values are encoded whole by the caller.
PIECED_DEPTH = 100
# dtypes orjson writes natively (an array cut into blocks of rows is the same text)
_PIECED_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.float32, np.float64)
)  # fmt: skip

_CONTAINERS = (dict, list, tuple, np.ndarray)


class NestedTooDeep(ValueError):
    """Raised by :func:`json_pieces` past its ``max_depth``: encode the value whole instead."""


class _HoldsNumpy(Exception):
    """A value met a numpy object while written without numpy support: it is written in pieces."""


def json_pieces(
    value: Any,
    option: int,
    default: Callable[[Any], Any] | None = None,
    max_depth: int | None = None,
) -> Iterator[bytes]:
    """``orjson.dumps(value, default=default, option=option)`` in pieces of the same text, so that a
    value holding huge arrays is hashed or stored without its whole text in memory; raises what
    ``orjson.dumps`` raises, and :class:`NestedTooDeep` past ``max_depth``."""
    sort_keys = bool(option & orjson.OPT_SORT_KEYS)
    plain_option = option & ~orjson.OPT_SERIALIZE_NUMPY

    def whole(item: Any) -> bytes:
        return orjson.dumps(item, default=default, option=option)

    def no_numpy(item: Any) -> Any:
        if isinstance(item, np.ndarray | np.generic):
            raise _HoldsNumpy
        if default is None:
            raise TypeError(f"Type is not JSON serializable: {type(item).__name__}")
        return default(item)

    def without_numpy(item: Any, path: tuple[type, ...]) -> bytes | None:
        """``item``'s text (None if it holds numpy), nested as at ``path`` for orjson's limit."""
        wrapped = item
        for kind in reversed(path):
            wrapped = {"": wrapped} if kind is dict else kind((wrapped,))
        head = sum(4 if kind is dict else 1 for kind in path)  # {"": or [ opens each level
        try:
            text = orjson.dumps(wrapped, default=no_numpy, option=plain_option)
        except orjson.JSONEncodeError as exc:
            if isinstance(exc.__cause__, _HoldsNumpy):
                return None
            raise
        return text[head : len(text) - len(path)]

    def pieces(item: Any, depth: int, path: tuple[type, ...]) -> Iterator[bytes]:
        if max_depth is not None and depth > max_depth:
            raise NestedTooDeep(f"nested more than {max_depth} levels")
        if isinstance(item, dict | list | tuple):
            text = without_numpy(item, path)
            if text is not None:
                yield text
            elif isinstance(item, dict) and all(type(key) is str for key in item):
                # else orjson words the refusal
                inner = (*path, dict)
                yield b"{"
                for number, (key, entry) in enumerate(sorted(item.items()) if sort_keys else item.items()):
                    yield (b"," if number else b"") + whole(key) + b":"
                    yield from pieces(entry, depth + 1, inner)
                yield b"}"
            elif isinstance(item, list | tuple) and any(isinstance(entry, _CONTAINERS) for entry in item):
                inner = (*path, list if isinstance(item, list) else tuple)
                yield b"["
                for number, entry in enumerate(item):
                    if number:
                        yield b","
                    yield from pieces(entry, depth + 1, inner)
                yield b"]"
            else:
                yield whole(item)
        elif (
            isinstance(item, np.ndarray)
            and item.size > PIECE_ITEMS
            and item.ndim >= 1
            and item.dtype in _PIECED_DTYPES
            and item.flags.c_contiguous
        ):
            rows = max(1, PIECE_ITEMS * len(item) // item.size)
            yield b"["
            for start in range(0, len(item), rows):
                yield (b"," if start else b"") + whole(item[start : start + rows])[1:-1]
            yield b"]"
        else:
            yield whole(item)

    return pieces(value, 0, ())


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else repr(value)


_DIGEST_OPTION = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _digest(value: Any, path: str) -> str:
    """A hash of ``value``'s canonical JSON, in pieces (stdlib JSON for integers beyond 64 bits)."""
    digest = hashlib.blake2b(digest_size=16)
    try:
        try:
            for piece in json_pieces(value, _DIGEST_OPTION, default=_plain, max_depth=PIECED_DEPTH):
                digest.update(piece)
            return digest.hexdigest()
        except NestedTooDeep:  # whole, so that orjson refuses exactly where it always did
            text = orjson.dumps(value, default=_plain, option=_DIGEST_OPTION)
    except (TypeError, orjson.JSONEncodeError):
        try:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=_plain).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            fail(path, f"not plain data ({exc})")
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def digests_of(state: Mapping[str, Any], skip: Collection[str] = ()) -> dict[str, str]:
    """A digest of each top-level value (but ``skip``), which loading checks."""
    return {key: _digest(value, key) for key, value in state.items() if key not in skip}


def check_digests(state: Mapping[str, Any], path: str, skip: Collection[str] = ()) -> None:
    """Refuse a state whose values differ from its digests (format 1 has none)."""
    if state["format"] == 1:
        return
    checked = [key for key in state if key not in skip and key != "digests"]
    saved = keys(state["digests"], join(path, "digests"), checked)
    for key in checked:
        if saved[key] != _digest(state[key], join(path, key)):
            changed = "the checkpoint was changed or damaged"
            fail(join(path, key), f"differs from the digest saved with it: {changed}")


def check_format(state: Any, what: str, path: str = "") -> None:
    """Refuse a checkpoint of another format version, or something that is not one."""
    where = join(path, "format")
    if not isinstance(state, Mapping) or "format" not in state:
        fail(where, f"missing: not a {what} checkpoint (no 'format' field)")
    if isinstance(state["format"], bool) or state["format"] not in READABLE_FORMATS:
        readable = ", ".join(map(str, READABLE_FORMATS))
        unknown = f"unknown {what} checkpoint format {state['format']!r}"
        fail(where, f"{unknown} (this version reads formats {readable}: a later one needs an upgrade)")


_NUMPY_DATA: ContextVar[bool] = ContextVar("numpy_data", default=False)
# dtypes whose numpy text in orjson is byte for byte that of their list (float32 is written shorter)
_SAME_TEXT_AS_LIST = _PIECED_DTYPES - {np.dtype(np.float32)}
_NON_FINITE = (("nan", np.nan), ("posinf", np.inf), ("neginf", -np.inf))


@contextmanager
def arrays_left_as_numpy() -> Iterator[None]:
    """Within it, :func:`encode_array` leaves ``data`` a numpy array, for a writer using
    ``OPT_SERIALIZE_NUMPY`` (the same text and digests, no Python object per value)."""
    token = _NUMPY_DATA.set(True)
    try:
        yield
    finally:
        _NUMPY_DATA.reset(token)


def encode_array(values: npt.NDArray[Any]) -> dict[str, Any]:
    """An array as ``{"dtype", "data"}``, exactly; non-finite floats are written as 0 with their
    positions listed beside (JSON has no NaN)."""
    out: dict[str, Any] = {"dtype": values.dtype.str}
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        for name, fill in _NON_FINITE:
            where = np.isnan(values) if name == "nan" else values == fill
            if where.any():
                out[name] = np.flatnonzero(where).tolist()
        values = np.where(np.isfinite(values), values, 0)
    as_numpy = _NUMPY_DATA.get() and values.ndim == 1 and values.dtype in _SAME_TEXT_AS_LIST
    out["data"] = np.ascontiguousarray(values) if as_numpy else values.tolist()
    return out


# what list items may parse as, per target kind
_RAW_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "fiu"}
_KIND_NAMES = {"b": "true/false", "i": "integer", "u": "integer", "f": "numeric"}


def decode_array(encoded: Any, path: str = "array", dtype: npt.DTypeLike | None = None) -> npt.NDArray[Any]:
    """The array of :func:`encode_array`, of ``dtype`` when given (else any numeric one)."""
    found = keys(encoded, path, ("dtype", "data"), ("nan", "posinf", "neginf"))
    name = string(found["dtype"], join(path, "dtype"))
    try:
        target = np.dtype(name).newbyteorder("=")  # (the byte order compiled loops take)
    except (TypeError, ValueError, SyntaxError):  # (numpy reads some strings as Python literals)
        fail(join(path, "dtype"), f"{name!r} is not a numpy dtype")
    if dtype is not None and target != np.dtype(dtype):
        fail(join(path, "dtype"), f"{name!r} where {np.dtype(dtype).str!r} is kept")
    if target.kind not in _RAW_KINDS or target.itemsize not in (1, 2, 4, 8) or target.shape:
        fail(join(path, "dtype"), f"{name!r} is not a numeric dtype")
    data = sequence(found["data"], join(path, "data"))
    try:
        raw = np.asarray(data) if len(data) else np.zeros(0, dtype=target)
    except (TypeError, ValueError, OverflowError):
        fail(join(path, "data"), f"expected a flat list of {_KIND_NAMES[target.kind]} values")
    if raw.ndim != 1 or (raw.dtype.kind not in _RAW_KINDS[target.kind] and len(raw)):
        fail(join(path, "data"), f"expected a flat list of {_KIND_NAMES[target.kind]} values")
    if target.kind in "iu" and len(raw):
        info = np.iinfo(target)
        low, high = int(raw.min()), int(raw.max())
        if low < info.min or high > info.max:
            fail(join(path, "data"), f"{low if low < info.min else high} does not fit {name!r}")
    values = raw.astype(target)
    for key, fill in _NON_FINITE:
        if key in found:
            if target.kind != "f":
                fail(join(path, key), "only float arrays have non-finite values")
            where = sequence(found[key], join(path, key))
            positions = [integer(p, join(join(path, key), i), 0, len(values) - 1) for i, p in enumerate(where)]
            values[np.asarray(positions, dtype=np.int64)] = fill
    return values
