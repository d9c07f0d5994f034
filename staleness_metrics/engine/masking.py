"""Writing a decision into the position arrays: newly stale sampled positions become 0, in place,
in one compiled pass over the masked spans of a batch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from ..compiled import UNSIGNED_OF_SIZE, CompiledLoop
from ..parallel import PARALLEL_MIN_POSITIONS, SHARES, run_all
from .segments import IntArray

_NO_TOKENS = np.zeros(0, dtype=np.int64)


@CompiledLoop
def _zero_spans(
    b0: npt.NDArray[Any],
    b1: npt.NDArray[Any],
    b2: npt.NDArray[Any],
    b3: npt.NDArray[Any],
    tokens: IntArray,
    lo: IntArray,
    hi: IntArray,
    part: npt.NDArray[np.int8],
    count: IntArray,
    zeros: tuple[Any, Any, Any, Any],
) -> None:  # pragma: no cover - compiled
    z0, z1, z2, z3 = zeros
    n = len(b0)
    if len(b1) != n or len(b2) != n or len(b3) != n:
        raise ValueError("zero_spans: the arrays differ in length")
    rows = len(lo)
    if len(hi) != rows or len(part) != rows or len(count) != rows:
        raise ValueError("zero_spans: lo, hi, part and count differ in length")
    for r in range(rows):
        a = lo[r]
        b = hi[r]
        if a >= b:
            continue
        if a < 0 or b > n or (part[r] != 0 and b > len(tokens)):
            raise IndexError("zero_spans: a span lies outside the arrays")
        # Slices, in bounds by the check above: LLVM makes each loop a memset or a vector select
        s0, s1, s2, s3 = b0[a:b], b1[a:b], b2[a:b], b3[a:b]
        if part[r] == 0:
            for i in range(b - a):
                s0[i] = z0
            for i in range(b - a):
                s1[i] = z1
            for i in range(b - a):
                s2[i] = z2
            for i in range(b - a):
                s3[i] = z3
            continue
        want = part[r] == 2
        tok = tokens[a:b]
        if 4 * count[r] < b - a:  # few positions to write: a branch, rarely taken
            for i in range(b - a):
                if (tok[i] < 0) == want:
                    s0[i], s1[i], s2[i], s3[i] = z0, z1, z2, z3
            continue
        for i in range(b - a):  # many: unconditional stores of a select, no branch to mispredict
            keep = (tok[i] < 0) != want
            s0[i] = s0[i] if keep else z0
            s1[i] = s1[i] if keep else z1
            s2[i] = s2[i] if keep else z2
            s3[i] = s3[i] if keep else z3


def zero_spans(
    arrays: Sequence[npt.NDArray[Any]],
    tokens: npt.NDArray[np.signedinteger[Any]] | None,
    lo: IntArray,
    hi: IntArray,
    part: npt.NDArray[np.int8],
    count: IntArray,
) -> None:
    """Zero, in place, in each of ``arrays`` (one to four), the positions of ``[lo[r], hi[r])``: all
    (``part`` 0), the labelled (1) or unlabelled (2, ``tokens < 0``) ones; ``count``: how many."""
    if len(lo) == 0:
        return
    views = [values.view(UNSIGNED_OF_SIZE[values.dtype.itemsize]) for values in arrays]
    views += [views[0]] * (4 - len(views))  # zeroing a position twice is harmless
    # (a literal 0 would make the selects float64)
    zeros = tuple(view.dtype.type(0) for view in views)
    labels = _NO_TOKENS if tokens is None else tokens
    total = int((hi - lo).sum())
    if total < PARALLEL_MIN_POSITIONS:
        _zero_spans(*views, labels, lo, hi, part, count, zeros)
        return
    written = (hi - lo).cumsum()
    # shares of about equal positions, written in parallel (the rows are disjoint)
    edges = np.searchsorted(written, np.linspace(0, total, num=SHARES + 1)[1:-1], "left").tolist()
    bounds = [0, *edges, len(lo)]
    tasks = [
        partial(_zero_spans, *views, labels, lo[a:b], hi[a:b], part[a:b], count[a:b], zeros)
        for a, b in itertools.pairwise(bounds) if b > a
    ]  # fmt: skip
    run_all(tasks, total)
