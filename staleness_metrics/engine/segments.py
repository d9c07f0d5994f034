"""Vectorised helpers over segments: contiguous runs given by offsets."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def segment_sum(values: npt.NDArray[np.generic], offsets: IntArray) -> IntArray:
    """Sum of ``values[offsets[i]:offsets[i+1]]`` for every segment (0 for empty ones)."""
    totals = np.empty(len(values) + 1, dtype=np.int64)
    totals[0] = 0
    values.cumsum(dtype=np.int64, out=totals[1:])
    return totals[offsets[1:]] - totals[offsets[:-1]]


def segment_max(values: IntArray, offsets: IntArray, empty: int) -> IntArray:
    """The maximum of each segment (``empty`` for an empty one)."""
    n = len(offsets) - 1
    out = np.full(n, empty, dtype=np.int64)
    if n == 0 or len(values) == 0:
        return out
    starts = offsets[:-1]
    nonempty = offsets[1:] > starts
    if nonempty.all():  # the usual case: no selection to build
        out[:] = np.maximum.reduceat(values, starts)
    elif nonempty.any():  # (reduceat runs to the next given start: empty segments left out)
        out[nonempty] = np.maximum.reduceat(values, starts[nonempty])
    return out


def segment_any(flags: BoolArray, offsets: IntArray) -> BoolArray:
    return segment_sum(flags, offsets) > 0


def expand_ranges(lo: IntArray, hi: IntArray) -> IntArray:
    """Concatenation of ``arange(lo[i], hi[i])`` without a Python loop."""
    lengths = hi - lo
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(lo - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)


def distinct(values: IntArray) -> list[int]:
    """The distinct values, ascending, as Python integers."""
    return np.unique(values).tolist()  # type: ignore[no-any-return]
