"""Rollout event lines read straight into arrays by simdjson (replay's fast path): plain, valid
lines only, as the general path reads them (docs/decisions.md, "Rollout lines read by simdjson")."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

try:
    import simdjson
except ImportError:  # no wheel for this Python: every line takes the general path
    simdjson = None  # type: ignore[assignment]

from ..errors import TraceError
from .columnar import WEIGHT_FIELDS
from .model import ParsedRollout, ParsedSample, check_head, floats_beyond, mask_beyond, versions_beyond

AVAILABLE = simdjson is not None

_MASKS, _VERSIONS, _FLOATS = 0, 1, 2  # the kinds of per-position lists, each checked by one rule
_FIELDS: dict[str, tuple[int, Literal["d", "i"]]] = {  # sample field -> (kind, as_buffer type)
    "mask": (_MASKS, "i"),
    "token_versions": (_VERSIONS, "i"),
    "weight_versions": (_VERSIONS, "i"),
    **{name: (_FLOATS, "d") for name in (*WEIGHT_FIELDS, "logprobs", "trainer_logprobs")},
}
_SATURATED = 0xFFFFFF  # simdjson's tape keeps a list's length in 24 bits, saturated
_NO_MASK = np.zeros(0, dtype=np.int8)


class _NotPlain(Exception):
    """A line this path does not read exactly: the general path reads it."""


def _object(value: object) -> tuple[simdjson.Object, list[str]]:
    """An object and its keys, none repeated (simdjson finds the first, JSON keeps the last)."""
    if type(value) is not simdjson.Object:
        raise _NotPlain
    keys = list(value)
    if len(set(keys)) != len(keys):
        raise _NotPlain
    return value, keys


class _Lists:
    """Per-position lists of one kind copied out of the tape, checked by one rule as one array."""

    def __init__(self, dtype: type, bad: Callable[[npt.NDArray[Any]], bool]) -> None:
        self.dtype, self.bad = dtype, bad
        self.buffers: list[Any] = []
        self.sizes: list[int] = []
        self.owners: list[tuple[ParsedSample, str]] = []
        self.firsts: list[int] = []  # per line taken, the index of its first list

    def place(self, refused: set[int]) -> None:
        """Set every list in its sample (one array for all); lines with ``bad`` ones: refused."""
        whole: npt.NDArray[Any] = np.frombuffer(b"".join(self.buffers), dtype=self.dtype)
        ends = list(accumulate(self.sizes))
        starts = [0, *ends]
        if self.bad(whole):
            for at, (start, end) in enumerate(zip(starts, ends)):
                if self.bad(whole[start:end]):
                    refused.add(bisect_right(self.firsts, at) - 1)
        if self.bad is mask_beyond:
            whole = whole.astype(np.int8)  # one conversion for every mask
        for (parsed, name), start, end in zip(self.owners, starts, ends):
            if name == "weight_versions":
                parsed.spans = whole[start:end].reshape(-1, 2)
            elif name in WEIGHT_FIELDS:
                parsed.weights[name] = whole[start:end]
            else:  # mask, token_versions, logprobs, trainer_logprobs
                setattr(parsed, name, whole[start:end])
        self.buffers, self.sizes, self.owners, self.firsts = [], [], [], []


def _rollout(document: object, line: bytes, kinds: tuple[_Lists, ...]) -> ParsedRollout:
    """The line's record, its lists copied into ``kinds`` (for :meth:`LineReader.finish`)."""
    event, keys = _object(document)
    if len(keys) != 2 or event.get("type") != "rollout":
        raise _NotPlain  # (another key: the general path names it)
    raw, keys = _object(event.get("rollout"))
    head: dict[str, Any] = {}
    for key in keys:  # document order, as the general path's echo keeps it
        if key != "samples":
            value = raw[key]
            if type(value) is simdjson.Object or type(value) is simdjson.Array:
                raise _NotPlain
            head[key] = value
    items = raw.get("samples")
    if type(items) is not simdjson.Array or not len(items):
        raise _NotPlain
    rollout = check_head(head)
    lists = 1  # "samples" itself
    for item in items:
        sample, keys = _object(item)
        parsed = ParsedSample(mask=_NO_MASK)
        labels = pairs = 0
        sizes: list[int] = []  # lengths of the per-position lists
        for key in keys:  # one lookup per field present (a lookup is a scan of the object's keys)
            value = sample[key]
            if value is None:
                if key == "mask" or key not in _FIELDS:
                    raise _NotPlain  # (an unknown field, null or not, is named by the general path)
                continue  # a null field is an absent one
            field = _FIELDS.get(key)
            if field is None or type(value) is not simdjson.Array:
                raise _NotPlain  # an unknown field, or not a list
            slot, of_type = field
            kind = kinds[slot]
            buffer = value.as_buffer(of_type=of_type)
            kind.buffers.append(buffer)
            size = len(value)
            if size >= _SATURATED:  # the copied buffer has every element
                size = memoryview(buffer).nbytes // 8 // (2 if key == "weight_versions" else 1)
            labels += slot == _VERSIONS
            if key == "weight_versions":
                # [version, start] pairs, flattened by as_buffer: each must be a list of two
                for pair in value:
                    if type(pair) is not simdjson.Array or len(pair) != 2:
                        raise _NotPlain
                lists += 1 + size  # the list of pairs and each pair
                pairs = size
                size *= 2
            else:
                sizes.append(size)
            kind.sizes.append(size)
            kind.owners.append((parsed, key))
        lists += len(sizes)
        if keys.count("mask") != 1 or labels > 1 or sizes.count(sizes[0]) != len(sizes):
            raise _NotPlain  # no mask; both kinds of labels; a list whose length is not the mask's
        if pairs > sizes[0]:
            raise _NotPlain  # more spans than positions: the general path names the span at fault
        rollout.samples.append(parsed)
    if line.count(b"[") != lists:  # a nested list (as_buffer flattens it), or a "[" in a string
        raise _NotPlain
    return rollout


class LineReader:
    """One reused simdjson parser: :meth:`take` copies lists out, :meth:`finish` checks them."""

    def __init__(self) -> None:
        self._parser = simdjson.Parser()
        self._rollouts: list[ParsedRollout] = []
        self._kinds = (
            _Lists(np.int64, mask_beyond),
            _Lists(np.int64, versions_beyond),
            _Lists(np.float64, floats_beyond),
        )

    def take(self, line: bytes) -> bool:
        """Read a rollout event line if it is plain; ``False``: let the general path read it."""
        if line[:1] != b"{" or b"\\" in line or b'"rollout"' not in line:
            return False
        try:
            document = self._parser.parse(line)
        except (ValueError, RuntimeError):
            # the general path names what is wrong; a fresh parser, in case a proxy holds this one
            self._parser = simdjson.Parser()
            return False
        kinds = self._kinds
        for kind in kinds:
            kind.firsts.append(len(kind.buffers))
        try:
            rollout = _rollout(document, line, kinds)
        except (_NotPlain, TraceError, TypeError, ValueError, RuntimeError):
            for kind in kinds:  # drop the line's lists
                mark = kind.firsts.pop()
                del kind.buffers[mark:], kind.sizes[mark:], kind.owners[mark:]
            return False
        finally:
            del document
        self._rollouts.append(rollout)
        return True

    def finish(self) -> list[ParsedRollout | None]:
        """The records of the lines taken, in order; ``None``: the general path reads its values."""
        refused: set[int] = set()
        for kind in self._kinds:
            kind.place(refused)
        out = [None if i in refused else rollout for i, rollout in enumerate(self._rollouts)]
        self._rollouts = []
        return out
