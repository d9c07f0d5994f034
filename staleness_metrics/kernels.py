"""Compiled single passes over positions, for the shapes numpy cannot do in a constant number of passes.

Per-position ``token_versions`` with scattered ``-1`` positions or labels that change often make
"find the runs, then reduce per run" cost a dozen numpy passes over arrays as long as the runs are
many. These loops (compiled once by numba, cached on disk) read each position once instead. Each has
the numpy formulation it replaced in ``tests/core/test_kernels.py``, checked equal on random inputs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["token_cuts", "warm_up", "zero_spans"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_UNSIGNED_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NO_TOKENS = np.zeros(0, dtype=np.int64)


class _CompiledOnFirstCall:
    """``loop`` compiled by numba on its first call (numba is imported then, not with the package), for
    the argument types it gets; the machine code is cached on disk across processes."""

    def __init__(self, loop: Callable[..., Any]) -> None:
        self._loop = loop
        self._compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    import numba

                    self._compiled = numba.njit(cache=True, nogil=True)(self._loop)
        assert self._compiled is not None
        return self._compiled(*args)


@_CompiledOnFirstCall
def _token_cuts(
    tokens: IntArray, pos_off: IntArray, samples: IntArray, changes: IntArray
) -> tuple[IntArray, IntArray, IntArray]:  # pragma: no cover - compiled
    total = 0
    for s in samples:
        total += pos_off[s + 1] - pos_off[s]
    starts = np.empty(total + 1, dtype=np.int64)
    labels = np.empty_like(starts)
    labelled = np.empty_like(starts)
    k = 0
    c = 0
    n_changes = len(changes)
    for s in samples:
        a = pos_off[s]
        b = pos_off[s + 1]
        while c < n_changes and changes[c] <= a:
            c += 1
        lo = a
        while lo < b:  # one stretch of one mask value
            hi = b
            if c < n_changes and changes[c] < b:
                hi = changes[c]
                c += 1
            starts[k] = lo
            cut_label = -1
            count = 0
            for p in range(lo, hi):
                t = tokens[p]
                is_labelled = t >= 0
                label = t if is_labelled else cut_label  # -1 positions carry the cut's label on
                if label != cut_label:
                    if cut_label >= 0:  # a different label: -1 positions before it stay behind
                        labels[k] = cut_label
                        labelled[k] = count
                        k += 1
                        starts[k] = p
                        count = 0
                    cut_label = label
                count += is_labelled
            labels[k] = cut_label
            labelled[k] = count
            k += 1
            lo = hi
    return starts[:k].copy(), labels[:k].copy(), labelled[:k].copy()


def token_cuts(
    tokens: IntArray, pos_off: IntArray, samples: IntArray, changes: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """Cuts of the (non-empty, increasing) ``samples`` labelled per position: start, label and count
    of labelled positions of each.

    A cut starts with its sample, wherever the mask changes (``changes``: sorted positions whose mask
    differs from the previous position's), and where a label differs from the cut's label. ``-1``
    positions never start a cut: they belong to the cut they fall in, so a cut holds one label (or
    none: -1) and the unlabelled positions around it.
    """
    result: tuple[IntArray, IntArray, IntArray] = _token_cuts(tokens, pos_off, samples, changes)
    return result


@_CompiledOnFirstCall
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
    # part: 0 whole, 1 labelled, 2 unlabelled (spans.PART_*; spans imports this module, not the reverse)
    for r in range(len(lo)):
        a = lo[r]
        b = hi[r]
        if a >= b:
            continue
        if part[r] == 0:  # plain loops, not slice assignments: a slice costs more than a short span
            for p in range(a, b):
                b0[p] = z0
            for p in range(a, b):
                b1[p] = z1
            for p in range(a, b):
                b2[p] = z2
            for p in range(a, b):
                b3[p] = z3
            continue
        want = part[r] == 2
        if 4 * count[r] < b - a:  # few positions to write: a branch, rarely taken
            for p in range(a, b):
                if (tokens[p] < 0) == want:
                    b0[p], b1[p], b2[p], b3[p] = z0, z1, z2, z3
            continue
        for p in range(a, b):  # many: unconditional stores of a select, no branch to mispredict
            keep = (tokens[p] < 0) != want
            b0[p] = b0[p] if keep else z0
            b1[p] = b1[p] if keep else z1
            b2[p] = b2[p] if keep else z2
            b3[p] = b3[p] if keep else z3


def zero_spans(
    arrays: Sequence[npt.NDArray[Any]],
    tokens: IntArray | None,
    lo: IntArray,
    hi: IntArray,
    part: npt.NDArray[np.int8],
    count: IntArray,
) -> None:
    """Set to 0, in place, in each of ``arrays`` (one to four of the same length): every position of
    ``[lo[r], hi[r])`` where ``part[r]`` is 0 (the whole span), else its unlabelled positions
    (``tokens < 0``) where ``part[r]`` is 2 and its labelled ones where it is 1; ``count[r]`` is how
    many positions that is (it only chooses how to write them).

    Written through unsigned views of the same width: zero bits are 0 (+0.0) in every numeric dtype.
    """
    if len(lo) == 0:
        return
    views = [values.view(_UNSIGNED_OF_SIZE[values.dtype.itemsize]) for values in arrays]
    views += [views[0]] * (4 - len(views))  # zeroing a position twice is harmless
    # Zeros of each view's own type: a literal 0 would make the selects float64.
    zeros = tuple(view.dtype.type(0) for view in views)
    _zero_spans(*views, _NO_TOKENS if tokens is None else tokens, lo, hi, part, count, zeros)


def warm_up() -> None:
    """Compile (or load from the disk cache) every loop for float32 and float64 arrays, so that the
    first batch a process handles does not pay for it: a service calls this when it starts."""
    tokens = np.array([0, -1, 1], dtype=np.int64)
    offsets = np.array([0, 3], dtype=np.int64)
    token_cuts(tokens, offsets, np.array([0], dtype=np.int64), np.zeros(0, dtype=np.int64))
    for dtype in (np.float32, np.float64):
        arrays = [np.ones(3, dtype=dtype) for _ in range(4)]
        lo, hi, count = np.array([0], dtype=np.int64), np.array([3], dtype=np.int64), np.array([1], dtype=np.int64)
        zero_spans(arrays, tokens, lo, hi, np.array([2], dtype=np.int8), count)
