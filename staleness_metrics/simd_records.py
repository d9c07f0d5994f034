"""Rollout event lines read straight into arrays by simdjson (the replay's fast path, issue 12).

orjson turns every number of a line into a Python object, which :mod:`.records` then copies into an
array: for a stream of long samples most of a replay went into building and reading those objects.
simdjson parses the line into its own tape, and ``Array.as_buffer`` copies a list of numbers out of it
at C speed, so the per-position lists become arrays without a Python object per position.

This path only ever *accepts* a plain, valid rollout line, and produces exactly the
:class:`~.records.ParsedRollout` the general path (:func:`.jsonio.loads` then
:func:`.records.parse_rollout`) gives for it; anything else (a ship or sweep event, an invalid or odd
record, a boolean or null among numbers, a string escape, a JSON error) returns ``None`` and the line is
read by the general path, which decides and names errors as it always did. ``as_buffer`` refuses
booleans, nulls, strings and objects, and integers beyond 64 bits; it flattens nested lists, which a
count of ``[`` in the line rules out (every ``[`` must open a list this reader looked at).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import simdjson

from .columnar import WEIGHT_FIELDS
from .errors import TraceError
from .records import _INT64_BOUND, MAX_VERSION, ParsedRollout, ParsedSample, check_head

__all__ = ["LineReader"]

_FLOAT_FIELDS = (*WEIGHT_FIELDS, "logprobs", "trainer_logprobs")


class _NotPlain(Exception):
    """The line is not one this path reads exactly: the general path reads it."""


def _array(value: object) -> simdjson.Array:
    if type(value) is not simdjson.Array:
        raise _NotPlain
    return value


def _object(value: object) -> simdjson.Object:
    """A JSON object without repeated keys (simdjson's lookup finds the first, JSON readers keep the last)."""
    if type(value) is not simdjson.Object or len(set(value)) != len(value):
        raise _NotPlain
    return value


def _joined(buffers: list[Any], dtype: type) -> tuple[npt.NDArray[Any], list[npt.NDArray[Any]]]:
    """Copied-out lists of one kind as one array (checked by one reduction) and views of it, one per list."""
    whole: npt.NDArray[Any] = np.frombuffer(buffers[0] if len(buffers) == 1 else b"".join(buffers), dtype=dtype)
    if len(buffers) == 1:
        return whole, [whole]
    parts, start = [], 0
    for buffer in buffers:
        end = start + memoryview(buffer).nbytes // whole.itemsize
        parts.append(whole[start:end])
        start = end
    return whole, parts


def _rollout(document: object, line: bytes) -> ParsedRollout:
    event = _object(document)
    if event.get("type") != "rollout":
        raise _NotPlain
    raw = _object(event.get("rollout"))
    head: dict[str, Any] = {}
    for key in raw:  # document order, as the general path's echo keeps it
        if key != "samples":
            value = raw[key]
            if type(value) is simdjson.Object or type(value) is simdjson.Array:
                raise _NotPlain
            head[key] = value
    items = _array(raw.get("samples"))
    if not len(items):
        raise _NotPlain
    rid, dispatch, completion, source, agentic = check_head(head)

    # Copy every per-position list out of the tape, as :func:`.records._parse_sample` would read it.
    samples: list[ParsedSample] = []
    masks: list[Any] = []
    versions: list[Any] = []  # token versions and span pairs (flattened): one bound
    version_owners: list[tuple[ParsedSample, str]] = []
    floats: list[Any] = []
    float_owners: list[tuple[ParsedSample, str]] = []
    lists = 1  # "samples" itself
    for item in items:
        sample = _object(item)
        parsed = ParsedSample(mask=_NO_MASK)
        labels = 0
        for key in sample:  # one lookup per field present (a lookup is a scan of the object's keys)
            value = sample[key]
            if value is None:
                if key == "mask":
                    raise _NotPlain
                continue  # a null field is an absent one
            array = _array(value)
            lists += 1
            if key in _FLOAT_FIELDS:
                floats.append(array.as_buffer(of_type="d"))
                float_owners.append((parsed, key))
            elif key == "mask":
                masks.append(array.as_buffer(of_type="i"))
            elif key == "token_versions":
                versions.append(array.as_buffer(of_type="i"))
                version_owners.append((parsed, key))
                labels += 1
            elif key == "weight_versions":
                # [version, start] pairs, flattened by as_buffer: each must be a list of two
                for pair in array:
                    if type(pair) is not simdjson.Array or len(pair) != 2:
                        raise _NotPlain
                versions.append(array.as_buffer(of_type="i"))
                version_owners.append((parsed, key))
                lists += len(array)
                labels += 1
            else:
                raise _NotPlain  # an unknown field
        if labels > 1:  # both weight_versions and token_versions
            raise _NotPlain
        samples.append(parsed)
    if len(masks) != len(samples) or line.count(b"[") != lists:
        # a sample without a mask; a nested list (as_buffer flattens it), or a "[" in a string
        raise _NotPlain

    # One reduction per kind of list: as unsigned, a negative mask value is huge; float magnitudes of
    # 2**63 or more (integers that records._plain_floats sends down the checked path) go there too.
    whole, mask_parts = _joined(masks, np.int64)
    if whole.size and whole.view(np.uint64).max() > 1:
        raise _NotPlain
    for parsed, mask in zip(samples, mask_parts):
        parsed.mask = mask.astype(np.int8)
    if versions:
        whole, version_parts = _joined(versions, np.int64)
        if whole.size and not (whole.max() <= MAX_VERSION and whole.min() >= -MAX_VERSION):
            raise _NotPlain
        for (parsed, name), part in zip(version_owners, version_parts):
            if name == "token_versions":
                parsed.token_versions = part
            else:
                parsed.spans = part.reshape(-1, 2)
    if floats:
        whole, float_parts = _joined(floats, np.float64)
        if whole.size and not (whole.max() < _INT64_BOUND and whole.min() > -_INT64_BOUND):
            raise _NotPlain
        for (parsed, name), part in zip(float_owners, float_parts):
            if name == "logprobs":
                parsed.logprobs = part
            elif name == "trainer_logprobs":
                parsed.trainer_logprobs = part
            else:
                parsed.weights[name] = part
    for parsed in samples:
        n = parsed.mask.size
        per_position = (parsed.token_versions, parsed.logprobs, parsed.trainer_logprobs, *parsed.weights.values())
        if any(values is not None and values.size != n for values in per_position):
            raise _NotPlain
    return ParsedRollout(
        id=rid,
        dispatch_version=dispatch,
        completion_version=completion,
        frozen=source == "frozen",
        agentic=agentic,
        group_id=head.get("group_id"),
        env=head.get("env"),
        samples=samples,
        echo=head,
    )


_NO_MASK = np.zeros(0, dtype=np.int8)


class LineReader:
    """Reads rollout event lines with one reused simdjson parser (not thread-safe: one per reader)."""

    def __init__(self) -> None:
        self._parser = simdjson.Parser()

    def rollout(self, line: bytes) -> ParsedRollout | None:
        """The rollout of a plain, valid rollout event line; ``None``: let the general path read the line."""
        # a line not starting with "{" (a byte order mark simdjson would skip, blanks) or holding a
        # string escape (lone surrogates, which orjson refuses) is left to the general path
        if line[:1] != b"{" or b"\\" in line:
            return None
        try:
            document = self._parser.parse(line)
        except (ValueError, RuntimeError):
            # bad JSON, a number beyond 64 bits, invalid UTF-8: the general path says what it is. A fresh
            # parser, in case this one is still held by a proxy of an earlier line (never expected).
            self._parser = simdjson.Parser()
            return None
        try:
            return _rollout(document, line)
        except (_NotPlain, TraceError, TypeError, ValueError, RuntimeError):
            return None
        finally:
            del document
