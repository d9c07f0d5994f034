"""Compiled single passes over positions, for the shapes numpy cannot do in a constant number of passes.

Per-position ``token_versions`` with scattered ``-1`` positions or labels that change often make
"find the runs, then reduce per run" cost a dozen numpy passes over arrays as long as the runs are
many. These loops (compiled once by numba, cached on disk) read each position once instead. Each has
the numpy formulation it replaced in ``tests/engine/test_kernels.py`` (the mismatch pass: in
``tests/metrics/test_mismatch.py``), checked equal on random inputs.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .parallel import PARALLEL_MIN_POSITIONS, run_all

__all__ = [
    "MAX_IN_FLIGHT", "MAX_IN_QUEUE", "MAX_NEWEST", "MAX_ROLLOUT", "ROLLOUT_BINS", "SUM_DOT", "SUM_FROZEN",
    "SUM_IN_FLIGHT", "SUM_IN_QUEUE", "SUM_LIVE", "SUM_MASKED", "SUM_NEWEST", "SUM_QUANTILES", "SUM_ROLLOUT",
    "SUM_SAMPLES", "SUM_TOKENS", "SUM_UNLABELLED", "TOKEN_BINS", "WEIGHT_NAN", "WEIGHT_NONFINITE", "WEIGHT_NONZERO",
    "WEIGHT_NOT_POSITIVE", "PopulationSummary", "PopulationSums", "PositionCopies", "ShippedRows",
    "SliceRows", "SpanRows", "StaleRows", "TokenDecision", "TokenSpans", "fusable_weights", "mismatch_runs",
    "plain_values", "population_summary", "population_sums", "shipped_rows", "slice_rows", "span_rows", "stale_rows",
    "token_cuts", "token_decision", "token_spans", "warm_up", "weight_flags", "zero_spans",
]  # fmt: skip

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_UNSIGNED_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NO_FLAGS = np.zeros(0, dtype=np.uint8)
_NO_WEIGHTS = np.zeros(0, dtype=np.uint32)
_NO_WIDE_WEIGHTS = np.zeros(0, dtype=np.uint64)
_BLOCK = 32  # positions the cut loop checks at once for a cut (one vector pass)
_SHARES = 4  # parallel shares of a large input: even work for 2-4 threads


class _CompiledOnFirstCall:
    """``loop`` compiled by numba on its first call (numba is imported then, not with the package), for
    the argument types it gets; the machine code is cached on disk across processes.

    ``options`` are numba's (``error_model="numpy"``: a float division by zero gives inf or NaN as in
    numpy, with no check that stops LLVM from vectorising the loop). ``callees`` are loops the loop
    calls by a module-level name, compiled first with their own options (``fastmath={"reassoc"}`` lets
    LLVM add a sum in vector lanes, which only such a callee may do: the loop's own arithmetic stays
    exact).
    """

    def __init__(
        self,
        loop: Callable[..., Any] | None = None,
        *,
        callees: Mapping[str, tuple[Callable[..., Any], Mapping[str, Any]]] | None = None,
        **options: Any,
    ) -> None:
        self._loop = loop
        self._callees = dict(callees or {})
        self._options = options
        self._compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        if self._loop is None:  # used as @_CompiledOnFirstCall(options): this call passes the loop
            (loop,) = args
            return _CompiledOnFirstCall(loop, callees=self._callees, **self._options)
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    import numba

                    for name, (callee, options) in self._callees.items():
                        self._loop.__globals__[name] = numba.njit(cache=True, nogil=True, **options)(callee)
                    self._compiled = numba.njit(cache=True, nogil=True, **self._options)(self._loop)
        assert self._compiled is not None
        return self._compiled(*args)


def _grown(values: IntArray, used: int, capacity: int) -> IntArray:  # pragma: no cover - compiled
    """``values``' first ``used`` entries in a new array of ``capacity`` (a callee of ``_token_spans``)."""
    wider = np.empty(capacity, dtype=values.dtype)
    wider[:used] = values[:used]
    return wider


@_CompiledOnFirstCall(callees={"_grown": (_grown, {})})
def _token_spans(
    tokens: IntArray,
    mask: npt.NDArray[Any],
    pos_off: IntArray,
    samples: IntArray,
    weights: tuple[npt.NDArray[Any], ...],
    n_weights: int,
    sign: np.uint64,
    infinity: np.uint64,
) -> tuple[IntArray, IntArray, IntArray, npt.NDArray[np.uint8], int]:  # pragma: no cover - compiled
    n = len(tokens)
    if len(mask) != n:
        raise ValueError("token_cuts: token_versions and mask differ in length")
    if n_weights > 0 and (len(weights[0]) != n or len(weights[1]) != n or len(weights[2]) != n):
        raise ValueError("token_cuts: a weight array and token_versions differ in length")
    total = 0
    end = 0
    for s in samples:  # checked before any read: a damaged offset must not read or write out of bounds
        if s < 0 or s + 1 >= len(pos_off):
            raise IndexError("token_cuts: a sample index beyond the position offsets")
        a = pos_off[s]
        b = pos_off[s + 1]
        if a < end or b < a or b > n:
            raise ValueError("token_cuts: position offsets out of order or beyond the arrays")
        end = b
        total += b - a
    # Outputs sized by the cuts, not the positions: room for the next sample's worst case (a cut per
    # position), doubled when short. (Arrays of one entry per position cost page faults and numba's
    # zeroing of the flags, in every parallel share: more than the cut loop's own reads.)
    capacity = min(total + 1, max(64, 8 * len(samples)))
    starts = np.empty(capacity, dtype=np.int64)
    labels = np.empty_like(starts)
    labelled = np.empty_like(starts)
    flags = np.empty((n_weights, capacity), dtype=np.uint8)  # (every cut's bits are written)
    # The weight bits (see _weight_flags) of each cut, read while its sample is in cache.
    one = np.uint64(1)
    magnitude = sign - one
    at_least_inf = sign - infinity
    above_inf = at_least_inf - one
    below = 0  # labels below -1 seen (a value rule of SPEC 3, checked by the caller when any)
    k = 0
    for s in samples:
        a = pos_off[s]
        length = pos_off[s + 1] - a
        if length == 0:
            continue
        if k + length + 1 > len(starts):  # this sample may cut at each position
            capacity = max(2 * len(starts), k + length + 1)
            starts = _grown(starts, k, capacity)
            labels = _grown(labels, k, capacity)
            labelled = _grown(labelled, k, capacity)
            wider = np.empty((n_weights, capacity), dtype=np.uint8)
            wider[:, :k] = flags[:, :k]
            flags = wider
        first_cut = k
        tok = tokens[a : a + length]  # slices: in bounds by the checks above, and no negative-index fix-up
        m = mask[a : a + length]
        starts[k] = a
        cut_label = tok[0]  # -1: none yet (leading -1 positions join the first label)
        count = 1 if cut_label >= 0 else 0
        below += cut_label < -1
        i = 1
        while i < length:
            end = min(i + _BLOCK, length)
            # Slices of the block (and of the positions before it): indices from 0, so no negative-index
            # fix-up per position and the check below is one vector pass. Does anything cut here? Mostly
            # not: then only count.
            block_tok = tok[i:end]
            block_mask = m[i:end]
            before_mask = m[i - 1 : end - 1]
            cuts = 0
            block_labelled = 0
            block_below = 0
            for q in range(end - i):
                t = block_tok[q]
                is_labelled = t >= 0
                cuts += (block_mask[q] != before_mask[q]) | (is_labelled & (t != cut_label))
                block_labelled += is_labelled
                block_below += t < -1
            if cuts == 0:
                count += block_labelled
                below += block_below
                i = end
                continue
            # The block holds a cut: walk to the first one (the same test, with no branch on whether a
            # position is labelled: -1 positions come at random), cut there, and check again after it.
            q = i
            while (m[q] == m[q - 1]) & (((tok[q] ^ cut_label) & ~(tok[q] >> 63)) == 0):
                count += tok[q] >= 0
                below += tok[q] < -1
                q += 1
            t = tok[q]
            below += t < -1
            if m[q] != m[q - 1]:  # the mask changes (NaN differs from everything, as numpy's !=)
                labels[k] = cut_label
                labelled[k] = count
                k += 1
                starts[k] = a + q
                cut_label = -1
                count = 0
            is_labelled = t >= 0
            if is_labelled & (t != cut_label):  # -1 positions carry the cut's label on: they never cut
                if cut_label >= 0:  # a different label: -1 positions before it stay behind
                    labels[k] = cut_label
                    labelled[k] = count
                    k += 1
                    starts[k] = a + q
                    count = 0
                cut_label = t
            count += is_labelled
            i = q + 1
        labels[k] = cut_label
        labelled[k] = count
        k += 1
        if n_weights == 0:
            continue
        w0, w1, w2 = weights  # (three arrays: fewer repeat the first, whose bits are read once more)
        for c in range(first_cut, k):
            cut_start = starts[c]
            cut_end = starts[c + 1] if c + 1 < k else a + length
            s0, s1, s2 = w0[cut_start:cut_end], w1[cut_start:cut_end], w2[cut_start:cut_end]
            # The usual cut: every value finite and > 0 (bits 1 .. +inf's - 1). One pass over the three
            # arrays at once, a min and a max per value in the values' own width (as many lanes per vector
            # as the bits allow: no widening); any other cut is read again. (A cut holds a position.)
            low0, low1, low2 = s0[0], s1[0], s2[0]
            top0, top1, top2 = low0, low1, low2
            for q in range(1, cut_end - cut_start):
                low0, top0 = min(low0, s0[q]), max(top0, s0[q])
                low1, top1 = min(low1, s1[q]), max(top1, s1[q])
                low2, top2 = min(low2, s2[q]), max(top2, s2[q])
            lowest = min(low0, low1, low2)
            if (lowest > 0) & (top0 < infinity) & (top1 < infinity) & (top2 < infinity):
                for w in range(n_weights):
                    flags[w, c] = 1
                continue
            for w in range(n_weights):
                seg = weights[w][cut_start:cut_end]
                any_bits = np.uint64(0)
                any_inf = np.uint64(0)
                any_nan = np.uint64(0)
                any_not_positive = np.uint64(0)
                for q in range(len(seg)):  # integer ORs only: one vector pass over the cut
                    u = np.uint64(seg[q])
                    y = u & magnitude
                    any_bits |= y
                    any_inf |= y + at_least_inf
                    any_nan |= y + above_inf
                    any_not_positive |= u | (y - one)
                bits_of_cut = 0
                if any_bits != 0:
                    bits_of_cut |= 1
                if any_inf & sign:
                    bits_of_cut |= 2
                if any_nan & sign:
                    bits_of_cut |= 4 | 8
                if any_not_positive & sign:
                    bits_of_cut |= 8
                flags[w, c] = bits_of_cut
    return starts[:k].copy(), labels[:k].copy(), labelled[:k].copy(), flags[:, :k].copy(), below


def _comparable_mask(mask: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The mask in a dtype the loop compares as numpy does: float32/64, integers and booleans as they
    are; any other dtype (float16, long double) as run numbers, equal exactly where numpy's ``!=`` says
    no change from the previous position."""
    if mask.dtype.kind in "biu" or mask.dtype in (np.float32, np.float64):
        return mask
    runs = np.zeros(len(mask), dtype=np.int64)
    np.cumsum(mask[1:] != mask[:-1], out=runs[1:])
    return runs


def fusable_weights(weights: Sequence[npt.NDArray[Any]]) -> bool:
    """Whether :func:`token_spans` reads the bits of ``weights`` in its pass: 1-d contiguous arrays of one
    float dtype (float16/32/64). Others get their bits from :func:`weight_flags` or numpy."""
    if not weights:
        return True
    dtype = weights[0].dtype
    return (
        len(weights) <= 3
        and dtype in _FLOAT_BITS
        and all(w.dtype == dtype and w.ndim == 1 and w.flags.c_contiguous for w in weights)
    )


class TokenSpans(NamedTuple):
    """What :func:`token_spans` finds: per cut its start, label (-1: none), labelled positions and the
    ``WEIGHT_*`` bits of each weight array (one row per array); and how many labels are below -1."""

    starts: IntArray
    labels: IntArray
    labelled: IntArray
    flags: npt.NDArray[np.uint8]
    below: int


def token_spans(
    tokens: IntArray,
    mask: npt.NDArray[Any],
    pos_off: IntArray,
    samples: IntArray,
    weights: Sequence[npt.NDArray[Any]] = (),
) -> TokenSpans:
    """Cuts of the (increasing) ``samples`` labelled per position: start, label and count of labelled
    positions of each, the ``WEIGHT_*`` bits of each of ``weights`` per cut (as :func:`weight_flags`;
    the arrays must pass :func:`fusable_weights`), and the count of labels below -1 (the caller checks
    them: the cuts then treat such a label as unlabelled).

    A cut starts with its sample, wherever the mask differs from the previous position's, and where a
    label differs from the cut's label. ``-1`` positions never start a cut: they belong to the cut they
    fall in, so a cut holds one label (or none: -1) and the unlabelled positions around it. One pass
    reads the labels and the mask, then each cut's weights while the sample is in cache. Large inputs
    are cut in parallel, a share of the samples per thread (the loop releases the GIL).

    Raises ``IndexError`` / ``ValueError`` on offsets that are out of order or point beyond the arrays
    (the loop checks them before it reads or writes anything).
    """
    samples = np.ascontiguousarray(samples, dtype=np.int64)
    mask = _comparable_mask(mask)
    views: tuple[npt.NDArray[Any], ...]
    if weights:
        if not fusable_weights(weights):
            raise ValueError("token_spans: weights of one float dtype, 1-d and contiguous")
        sign, infinity = _FLOAT_BITS[weights[0].dtype]
        views = tuple(w.view(_UNSIGNED_OF_SIZE[w.dtype.itemsize]) for w in weights)
        views += (views[0],) * (3 - len(views))  # always three: one compiled loop per dtype
    else:
        # (empty arrays of the mask's width: the loop compiled for that float dtype's weights serves)
        wide = getattr(mask, "dtype", None) == np.float64
        sign, infinity = _FLOAT_BITS[np.dtype(np.float64 if wide else np.float32)]
        views = (_NO_WIDE_WEIGHTS if wide else _NO_WEIGHTS,) * 3
    n_weights = len(weights)
    constants = (np.uint64(sign), np.uint64(infinity))
    n = len(tokens)
    if len(samples) < 2 or n < PARALLEL_MIN_POSITIONS:
        return TokenSpans(*_token_spans(tokens, mask, pos_off, samples, views, n_weights, *constants))
    # Shares of about equal positions (the offsets are checked again inside each share).
    ends = np.clip(pos_off[np.clip(samples + 1, 0, len(pos_off) - 1)], 0, None)
    edges = np.unique(np.searchsorted(ends, np.linspace(0, ends[-1], num=_SHARES + 1)[1:-1], "left"))
    bounds = [0, *(int(e) + 1 for e in edges if 0 <= e < len(samples) - 1), len(samples)]
    tasks = [
        partial(_token_spans, tokens, mask, pos_off, samples[a:b], views, n_weights, *constants)
        for a, b in itertools.pairwise(bounds) if b > a
    ]  # fmt: skip
    parts: list[tuple[IntArray, IntArray, IntArray, npt.NDArray[np.uint8], int]] = run_all(tasks, n)
    if len(parts) == 1:
        return TokenSpans(*parts[0])
    return TokenSpans(
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]),
        np.concatenate([p[3] for p in parts], axis=1),
        sum(p[4] for p in parts),
    )


def token_cuts(
    tokens: IntArray, mask: npt.NDArray[Any], pos_off: IntArray, samples: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """The cuts of :func:`token_spans` alone: start, label and count of labelled positions of each.

    Raises ``IndexError`` / ``ValueError`` on offsets that are out of order or point beyond the arrays.
    """
    found = token_spans(tokens, mask, pos_off, samples)
    return found.starts, found.labels, found.labelled


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
    n = len(b0)
    if len(b1) != n or len(b2) != n or len(b3) != n:
        raise ValueError("zero_spans: the arrays differ in length")
    rows = len(lo)
    if len(hi) != rows or len(part) != rows or len(count) != rows:
        raise ValueError("zero_spans: lo, hi, part and count differ in length")
    # part: 0 whole, 1 labelled, 2 unlabelled (spans.PART_*; spans imports this module, not the reverse)
    for r in range(rows):
        a = lo[r]
        b = hi[r]
        if a >= b:
            continue
        if a < 0 or b > n or (part[r] != 0 and b > len(tokens)):
            raise IndexError("zero_spans: a span lies outside the arrays")
        # Loops over slices: in bounds by the check above, with no negative-index fix-up per position,
        # so LLVM makes each a memset or a vector select.
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
    labels = _NO_TOKENS if tokens is None else tokens
    total = int((hi - lo).sum())
    if total < PARALLEL_MIN_POSITIONS:
        _zero_spans(*views, labels, lo, hi, part, count, zeros)
        return
    written = (hi - lo).cumsum()
    # Shares of about equal positions, written in parallel: the rows are disjoint ranges, so the shares
    # never write the same position.
    edges = np.searchsorted(written, np.linspace(0, total, num=_SHARES + 1)[1:-1], "left").tolist()
    bounds = [0, *edges, len(lo)]
    tasks = [
        partial(_zero_spans, *views, labels, lo[a:b], hi[a:b], part[a:b], count[a:b], zeros)
        for a, b in itertools.pairwise(bounds) if b > a
    ]  # fmt: skip
    run_all(tasks, total)


class SpanRows(NamedTuple):
    """The span table :func:`span_rows` writes: per row, then per sample (see ``spans.SpanTable``)."""

    sample: IntArray
    lo: IntArray
    hi: IntArray
    label: IntArray
    version: IntArray
    part: npt.NDArray[np.int8]
    sampled: IntArray
    live: BoolArray
    span_offsets: IntArray
    n_sampled: IntArray
    n_unlabelled: IntArray
    unmaskable: BoolArray
    had_train: BoolArray
    max_label: IntArray
    max_sampled_version: IntArray
    seq_min_version: IntArray


@_CompiledOnFirstCall
def _span_rows(
    lo: IntArray,
    hi: IntArray,
    label: IntArray,
    labelled: IntArray,
    kept: BoolArray,
    sampled: BoolArray,
    live_labelled: BoolArray,
    live_unlabelled: BoolArray,
    side: BoolArray,
    pos_off: IntArray,
    dispatch: IntArray,
    no_low: int,
    no_high: int,
) -> tuple[Any, ...]:  # pragma: no cover - compiled
    cuts = len(lo)
    n_samples = len(pos_off) - 1
    if (len(hi) != cuts or len(label) != cuts or len(labelled) != cuts or len(kept) != cuts or len(sampled) != cuts
            or len(live_labelled) != cuts or len(live_unlabelled) != cuts or len(side) != cuts):  # fmt: skip
        raise ValueError("span_rows: the cut arrays differ in length")
    if len(dispatch) != n_samples:
        raise ValueError("span_rows: one dispatch version per sample expected")
    n_rows = 0
    for c in range(cuts):
        if kept[c]:
            if not (0 <= lo[c] < hi[c] <= pos_off[n_samples]):
                raise IndexError("span_rows: a cut outside the positions")
            n_rows += 2 if (labelled[c] > 0) & (labelled[c] < hi[c] - lo[c]) else 1
    row_sample = np.empty(n_rows, dtype=np.int64)
    row_lo = np.empty(n_rows, dtype=np.int64)
    row_hi = np.empty(n_rows, dtype=np.int64)
    row_label = np.empty(n_rows, dtype=np.int64)
    row_version = np.empty(n_rows, dtype=np.int64)
    row_part = np.empty(n_rows, dtype=np.int8)
    row_sampled = np.empty(n_rows, dtype=np.int64)
    row_live = np.empty(n_rows, dtype=np.bool_)
    span_offsets = np.zeros(n_samples + 1, dtype=np.int64)
    n_sampled = np.zeros(n_samples, dtype=np.int64)
    n_unlabelled = np.zeros(n_samples, dtype=np.int64)
    unmaskable = np.zeros(n_samples, dtype=np.bool_)
    had_train = np.zeros(n_samples, dtype=np.bool_)
    max_label = np.full(n_samples, -1, dtype=np.int64)
    max_sampled = np.full(n_samples, no_low, dtype=np.int64)
    seq_min = np.full(n_samples, no_high, dtype=np.int64)
    s = 0
    r = 0
    for c in range(cuts):
        if not kept[c]:
            continue
        a = lo[c]
        while s + 1 < n_samples and pos_off[s + 1] <= a:  # the sample holding the cut (cuts come in order)
            s += 1
        width = hi[c] - a
        n_labelled = labelled[c]
        mixed = (n_labelled > 0) & (n_labelled < width)
        # One row per cut; a mixed cut's labelled part, then its unlabelled part (spans.PART_*: 0 whole,
        # 1 labelled, 2 unlabelled; spans imports this module, not the reverse).
        for half in range(2 if mixed else 1):
            if mixed and half == 0:
                part, lab, count, alive = 1, label[c], n_labelled, live_labelled[c]
            elif mixed:
                part, lab, count, alive = 2, np.int64(-1), width - n_labelled, live_unlabelled[c]
            else:
                part, lab, count, alive = 0, label[c], width, live_labelled[c]
            version = lab if lab >= 0 else dispatch[s]
            positions = count if sampled[c] else 0
            row_sample[r] = s
            row_lo[r] = a
            row_hi[r] = hi[c]
            row_label[r] = lab
            row_version[r] = version
            row_part[r] = part
            row_sampled[r] = positions
            row_live[r] = alive
            r += 1
            span_offsets[s + 1] += 1
            n_sampled[s] += positions
            if lab < 0:
                n_unlabelled[s] += positions
            unmaskable[s] |= side[c]
            had_train[s] |= alive
            max_label[s] = max(max_label[s], lab)
            if positions > 0:
                max_sampled[s] = max(max_sampled[s], version)
            if (lab >= 0) | (positions > 0):
                seq_min[s] = min(seq_min[s], version)
    for i in range(n_samples):
        span_offsets[i + 1] += span_offsets[i]
        had_train[i] |= unmaskable[i]
    return (row_sample, row_lo, row_hi, row_label, row_version, row_part, row_sampled, row_live, span_offsets,
            n_sampled, n_unlabelled, unmaskable, had_train, max_label, max_sampled, seq_min)  # fmt: skip


def span_rows(
    lo: IntArray,
    hi: IntArray,
    label: IntArray,
    labelled: IntArray,
    kept: BoolArray,
    sampled: BoolArray,
    live_labelled: BoolArray,
    live_unlabelled: BoolArray,
    side: BoolArray,
    pos_off: IntArray,
    dispatch: IntArray,
    no_version: tuple[int, int],
) -> SpanRows:
    """The rows of a span table from the cuts that tile the positions (``lo``/``hi``, in order), in one
    pass: one row per ``kept`` cut, two per mixed cut (``0 < labelled < hi - lo``: its labelled part,
    then its unlabelled part, label -1), each row's sample (by ``pos_off``), version (the label, or the
    sample's ``dispatch`` version), sampled positions (where the cut is ``sampled``), liveness
    (``live_labelled`` for a whole cut or a labelled part, ``live_unlabelled`` for an unlabelled part);
    and per sample the row offsets and the reductions ``spans.SpanTable`` keeps (``side``: a weight on
    an unsampled cut; ``no_version``: the low and high "no version" values).

    Raises ``ValueError`` on arrays of different lengths, ``IndexError`` on a kept cut outside the positions.
    """
    as_int = partial(np.ascontiguousarray, dtype=np.int64)
    as_bool = partial(np.ascontiguousarray, dtype=np.bool_)
    found = _span_rows(
        as_int(lo), as_int(hi), as_int(label), as_int(labelled), as_bool(kept), as_bool(sampled),
        as_bool(live_labelled), as_bool(live_unlabelled), as_bool(side), as_int(pos_off), as_int(dispatch),
        int(no_version[0]), int(no_version[1]),
    )  # fmt: skip
    return SpanRows(*found)


class SliceRows(NamedTuple):
    """The sample and span rows of some rollouts of the sink, in order, with local offsets (see
    :func:`slice_rows`)."""

    sample_rows: IntArray
    sample_offsets: IntArray  # per rollout, into sample_rows
    sample_rollout: IntArray  # per sample, its local rollout
    span_rows: IntArray
    span_offsets: IntArray  # per sample, into span_rows
    span_sample: IntArray  # per span, its local sample


@_CompiledOnFirstCall
def _slice_rows(
    rows: IntArray, sample_lo: IntArray, sample_hi: IntArray, span_lo: IntArray, span_hi: IntArray
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray, IntArray]:  # pragma: no cover - compiled
    n_rollouts = len(sample_lo)
    n_samples = len(span_lo)
    if len(sample_hi) != n_rollouts or len(span_hi) != n_samples:
        raise ValueError("slice_rows: lo and hi differ in length")
    samples = 0
    for row in rows:
        if row < 0 or row >= n_rollouts:
            raise IndexError("slice_rows: a rollout row outside the table")
        a = sample_lo[row]
        b = sample_hi[row]
        if a < 0 or b < a or b > n_samples:
            raise IndexError("slice_rows: a sample range outside the table")
        samples += b - a
    sample_rows = np.empty(samples, dtype=np.int64)
    sample_offsets = np.empty(len(rows) + 1, dtype=np.int64)
    sample_rollout = np.empty(samples, dtype=np.int64)
    sample_offsets[0] = 0
    at = 0
    spans = 0
    for i in range(len(rows)):
        for k in range(sample_lo[rows[i]], sample_hi[rows[i]]):
            a = span_lo[k]
            b = span_hi[k]
            if a < 0 or b < a:
                raise IndexError("slice_rows: a span range out of order")
            sample_rows[at] = k
            sample_rollout[at] = i
            spans += b - a
            at += 1
        sample_offsets[i + 1] = at
    span_rows = np.empty(spans, dtype=np.int64)
    span_offsets = np.empty(samples + 1, dtype=np.int64)
    span_sample = np.empty(spans, dtype=np.int64)
    span_offsets[0] = 0
    at = 0
    for j in range(samples):
        k = sample_rows[j]
        for row in range(span_lo[k], span_hi[k]):
            span_rows[at] = row
            span_sample[at] = j
            at += 1
        span_offsets[j + 1] = at
    return sample_rows, sample_offsets, sample_rollout, span_rows, span_offsets, span_sample


def slice_rows(
    rows: IntArray, sample_lo: IntArray, sample_hi: IntArray, span_lo: IntArray, span_hi: IntArray
) -> SliceRows:
    """For the rollouts at ``rows`` (rows of a table whose samples are ``sample_lo[row]:sample_hi[row]``, each
    with spans ``span_lo[k]:span_hi[k]``): their sample rows in order, offsets per rollout and each sample's
    rollout; then the same for the samples' span rows. One pass instead of a range expansion, two offset
    sums and two repeats per level.

    Raises ``ValueError`` on lo and hi of different lengths, ``IndexError`` on a row or range outside the table.
    """
    return SliceRows(*_slice_rows(rows, sample_lo, sample_hi, span_lo, span_hi))


class ShippedRows(NamedTuple):
    """The kept span rows of a ship as :func:`shipped_rows` writes them (see ``shipped_positions.ShippedSpans``)."""

    chunk: IntArray
    lo: IntArray
    hi: IntArray
    lag: IntArray
    masked: BoolArray
    sample_offsets: IntArray
    mixed: BoolArray
    unlabelled_lag: IntArray
    unlabelled_masked: BoolArray
    env: IntArray


@_CompiledOnFirstCall
def _shipped_rows(
    span_lo: IntArray,
    span_hi: IntArray,
    kept_sample: BoolArray,
    sample_rollout: IntArray,
    mask_below: IntArray,
    version: IntArray,
    sampled: IntArray,
    frozen: BoolArray,
    rollout_chunk: IntArray,
    rollout_env: IntArray,
    part: npt.NDArray[np.int8],
    table_lo: IntArray,
    table_hi: IntArray,
    trained: int,
    not_sampled: int,
) -> tuple[Any, ...]:  # pragma: no cover - compiled
    n_samples = len(span_lo)
    if len(span_hi) != n_samples or len(kept_sample) != n_samples or len(sample_rollout) != n_samples:
        raise ValueError("shipped_rows: the sample arrays differ in length")
    if len(mask_below) != n_samples:
        raise ValueError("shipped_rows: the sample arrays differ in length")
    n_rollouts = len(frozen)
    if len(rollout_chunk) != n_rollouts or len(rollout_env) != n_rollouts:
        raise ValueError("shipped_rows: the rollout arrays differ in length")
    table_rows = len(part)
    if len(table_lo) != table_rows or len(table_hi) != table_rows:
        raise ValueError("shipped_rows: the span table's columns differ in length")
    n = 0
    for k in range(n_samples):  # checked before any read: the rows, samples and rollouts named exist
        if not (0 <= span_lo[k] <= span_hi[k] <= table_rows):
            raise IndexError("shipped_rows: a sample's span rows outside the span table")
        if not (0 <= sample_rollout[k] < n_rollouts):
            raise IndexError("shipped_rows: a sample of no rollout")
        n += span_hi[k] - span_lo[k]
    if len(version) != n or len(sampled) != n:
        raise ValueError("shipped_rows: one version and one sampled count per span row expected")
    # Per row (in judgement order): lag and masked flag, read by a row and by the labelled part before it.
    lag = np.empty(n, dtype=np.int64)
    masked = np.empty(n, dtype=np.bool_)
    n_kept = 0
    kept_samples = 0
    i = 0
    for k in range(n_samples):
        rollout = sample_rollout[k]
        live = not frozen[rollout]
        for r in range(span_lo[k], span_hi[k]):
            lag[i] = trained - version[i] if live and sampled[i] > 0 else not_sampled
            masked[i] = version[i] < mask_below[k]
            n_kept += kept_sample[k] and part[r] != 2  # a mixed span once, by its first row (spans.PART_*)
            i += 1
        kept_samples += kept_sample[k]
    chunk = np.empty(n_kept, dtype=np.int64)
    lo = np.empty(n_kept, dtype=np.int64)
    hi = np.empty(n_kept, dtype=np.int64)
    out_lag = np.empty(n_kept, dtype=np.int64)
    out_masked = np.empty(n_kept, dtype=np.bool_)
    mixed = np.empty(n_kept, dtype=np.bool_)
    unlabelled_lag = np.empty(n_kept, dtype=np.int64)
    unlabelled_masked = np.empty(n_kept, dtype=np.bool_)
    env = np.empty(n_kept, dtype=np.int64)
    sample_offsets = np.zeros(kept_samples + 1, dtype=np.int64)
    last = max(n - 1, 0)
    i = 0
    j = 0
    kept_k = 0
    for k in range(n_samples):
        rollout = sample_rollout[k]
        for r in range(span_lo[k], span_hi[k]):
            if kept_sample[k] and part[r] != 2:
                partner = min(i + 1, last)  # the unlabelled part follows its labelled part
                chunk[j] = rollout_chunk[rollout]
                lo[j] = table_lo[r]
                hi[j] = table_hi[r]
                out_lag[j] = lag[i]
                out_masked[j] = masked[i]
                mixed[j] = part[r] == 1
                unlabelled_lag[j] = lag[partner]
                unlabelled_masked[j] = masked[partner]
                env[j] = rollout_env[rollout]
                j += 1
            i += 1
        if kept_sample[k]:
            kept_k += 1
            sample_offsets[kept_k] = j
    return chunk, lo, hi, out_lag, out_masked, sample_offsets, mixed, unlabelled_lag, unlabelled_masked, env


def shipped_rows(
    span_lo: IntArray,
    span_hi: IntArray,
    kept_sample: BoolArray,
    sample_rollout: IntArray,
    mask_below: IntArray,
    version: IntArray,
    sampled: IntArray,
    frozen: BoolArray,
    rollout_chunk: IntArray,
    rollout_env: IntArray,
    part: npt.NDArray[np.int8],
    table_lo: IntArray,
    table_hi: IntArray,
    trained: int,
    not_sampled: int,
) -> ShippedRows:
    """The span rows of shipped samples, in one pass: the samples' rows ``[span_lo[k], span_hi[k])`` of a span
    table (``part``, ``table_lo``, ``table_hi``), ``version`` and ``sampled`` per row in that order; each row's
    lag (``trained - version`` where its rollout is not ``frozen`` and it has sampled positions, else
    ``not_sampled``) and masked flag (``version < mask_below`` of its sample). Kept are the rows of
    ``kept_sample`` samples that are not an unlabelled part; for each, its chunk and env (by its sample's
    rollout), range, lag, masked flag, whether it is a labelled part, the next row's lag and masked flag (a
    labelled part's unlabelled part), and per kept sample the offsets of its kept rows.

    Raises ``ValueError`` on arrays of different lengths, ``IndexError`` on rows or rollouts outside them.
    """
    as_int = partial(np.ascontiguousarray, dtype=np.int64)
    as_bool = partial(np.ascontiguousarray, dtype=np.bool_)
    found = _shipped_rows(
        as_int(span_lo), as_int(span_hi), as_bool(kept_sample), as_int(sample_rollout), as_int(mask_below),
        as_int(version), as_int(sampled), as_bool(frozen), as_int(rollout_chunk), as_int(rollout_env),
        np.ascontiguousarray(part, dtype=np.int8), as_int(table_lo), as_int(table_hi), int(trained), int(not_sampled),
    )  # fmt: skip
    return ShippedRows(*found)


class StaleRows(NamedTuple):
    """The span rows a decision newly masks, as :func:`stale_rows` finds them (what ``zero_spans`` writes)."""

    chunk: IntArray
    lo: IntArray
    hi: IntArray
    part: npt.NDArray[np.int8]
    positions: IntArray  # the sampled positions of each (the whole range's or its part's)


@_CompiledOnFirstCall
def _stale_rows(
    span_lo: IntArray,
    span_hi: IntArray,
    sample_rollout: IntArray,
    old_below: IntArray,
    new_below: IntArray,
    raised: BoolArray,
    version: IntArray,
    sampled: IntArray,
    rollout_chunk: IntArray,
    part: npt.NDArray[np.int8],
    table_lo: IntArray,
    table_hi: IntArray,
) -> tuple[IntArray, IntArray, IntArray, npt.NDArray[np.int8], IntArray]:  # pragma: no cover - compiled
    n_samples = len(span_lo)
    if (len(span_hi) != n_samples or len(sample_rollout) != n_samples or len(old_below) != n_samples
            or len(new_below) != n_samples or len(raised) != n_samples):  # fmt: skip
        raise ValueError("stale_rows: the sample arrays differ in length")
    table_rows = len(part)
    if len(table_lo) != table_rows or len(table_hi) != table_rows:
        raise ValueError("stale_rows: the span table's columns differ in length")
    n = 0
    for k in range(n_samples):  # checked before any read: the rows and rollouts named exist
        if not (0 <= span_lo[k] <= span_hi[k] <= table_rows):
            raise IndexError("stale_rows: a sample's span rows outside the span table")
        if not (0 <= sample_rollout[k] < len(rollout_chunk)):
            raise IndexError("stale_rows: a sample of no rollout")
        n += span_hi[k] - span_lo[k]
    if len(version) != n or len(sampled) != n:
        raise ValueError("stale_rows: one version and one sampled count per span row expected")
    # Per row (in judgement order): stale at the new threshold, and newly masked (hit).
    stale = np.empty(n, dtype=np.bool_)
    hit = np.empty(n, dtype=np.bool_)
    row_of = np.empty(n, dtype=np.int64)  # the row in the span table
    i = 0
    for k in range(n_samples):
        for r in range(span_lo[k], span_hi[k]):
            stale[i] = version[i] < new_below[k]
            hit[i] = raised[k] & stale[i] & (version[i] >= old_below[k]) & (sampled[i] > 0)
            row_of[i] = r
            i += 1
    # The two parts of a mixed span are adjacent rows (spans.PART_*: 1 labelled, then 2 unlabelled): when
    # both are stale now the whole range goes, written once by the labelled part's row.
    count = 0
    for i in range(n):
        p = part[row_of[i]]
        partner = i + (p == 1) - (p == 2)
        if partner < 0 or partner >= n:
            raise IndexError("stale_rows: a part of a mixed span without its other part")
        if hit[i] and not (p == 2 and hit[partner]):
            count += 1
    out_chunk = np.empty(count, dtype=np.int64)
    out_lo = np.empty(count, dtype=np.int64)
    out_hi = np.empty(count, dtype=np.int64)
    out_part = np.empty(count, dtype=np.int8)
    out_count = np.empty(count, dtype=np.int64)
    j = 0
    i = 0
    for k in range(n_samples):
        for r in range(span_lo[k], span_hi[k]):
            p = part[r]
            partner = i + (p == 1) - (p == 2)
            if hit[i] and not (p == 2 and hit[partner]):
                out_chunk[j] = rollout_chunk[sample_rollout[k]]
                out_lo[j] = table_lo[r]
                out_hi[j] = table_hi[r]
                out_part[j] = 0 if stale[partner] else p
                out_count[j] = sampled[i]
                j += 1
            i += 1
    return out_chunk, out_lo, out_hi, out_part, out_count


def stale_rows(
    span_lo: IntArray,
    span_hi: IntArray,
    sample_rollout: IntArray,
    old_below: IntArray,
    new_below: IntArray,
    raised: BoolArray,
    version: IntArray,
    sampled: IntArray,
    rollout_chunk: IntArray,
    part: npt.NDArray[np.int8],
    table_lo: IntArray,
    table_hi: IntArray,
) -> StaleRows:
    """The span rows a decision newly masks, in one pass over the judged samples' rows ``[span_lo[k],
    span_hi[k])`` of a span table (``part``, ``table_lo``, ``table_hi``; ``version`` and ``sampled`` per row
    in that order): rows with sampled positions of a ``raised`` sample whose version is at or above the
    sample's ``old_below`` threshold and below its ``new_below``. Each with its chunk (by its sample's
    rollout), range, part (0, the whole range, when both parts of a mixed span are stale: then only the
    labelled part's row is given) and its sampled positions.

    Raises ``ValueError`` on arrays of different lengths, ``IndexError`` on rows or rollouts outside them.
    """
    as_int = partial(np.ascontiguousarray, dtype=np.int64)
    found = _stale_rows(
        as_int(span_lo), as_int(span_hi), as_int(sample_rollout), as_int(old_below), as_int(new_below),
        np.ascontiguousarray(raised, dtype=np.bool_), as_int(version), as_int(sampled), as_int(rollout_chunk),
        np.ascontiguousarray(part, dtype=np.int8), as_int(table_lo), as_int(table_hi),
    )  # fmt: skip
    return StaleRows(*found)


class PopulationSums(NamedTuple):
    """What :func:`population_sums` finds over the selected rollouts of a shipped slice."""

    tokens: int  # sampled positions of their live, kept samples
    masked: int  # of those, below their sample's threshold
    unlabelled: int  # of those, on unlabelled spans
    frozen: int  # selected frozen rollouts
    samples: int  # their live, kept samples
    token_dot: int | None  # sum of staleness x sampled positions (None: int64 could overflow)
    low: int  # the smallest staleness of a span with sampled positions
    counts: IntArray | None  # sampled positions per staleness low, low + 1, ... (None: none, or too wide a range)
    rollout: IntArray  # per selected live rollout: T - its oldest shipped sampled version (dispatch when none)
    in_flight: IntArray  # its completion - that version, within 0..rollout
    newest: IntArray  # T - its newest shipped sampled version (dispatch when none)
    length_sampled: IntArray  # per length bucket (by a sample's sampled positions): sampled positions
    length_removed: IntArray  # of those, masked


# Where :func:`population_summary` writes each number in the array it returns (its four arrays follow them).
(SUM_TOKENS, SUM_MASKED, SUM_UNLABELLED, SUM_FROZEN, SUM_SAMPLES, SUM_DOT, SUM_LIVE, SUM_ROLLOUT, MAX_ROLLOUT,
 SUM_IN_FLIGHT, MAX_IN_FLIGHT, SUM_IN_QUEUE, MAX_IN_QUEUE, SUM_NEWEST, MAX_NEWEST, TOKEN_BINS, ROLLOUT_BINS,
 SUM_QUANTILES) = range(18)  # fmt: skip


def _check_population(
    rollout_in: BoolArray,
    frozen: BoolArray,
    dispatch: IntArray,
    completion: IntArray,
    sample_offsets: IntArray,
    dropped: BoolArray,
    mask_below: IntArray,
    n_sampled: IntArray,
    span_offsets: IntArray,
    version: IntArray,
    sampled: IntArray,
    labelled: BoolArray,
) -> None:  # pragma: no cover - compiled
    """The checks of a population pass's arrays (a callee of ``_population_sums`` and ``_population_summary``)."""
    n_rollouts = len(frozen)
    n_samples = len(dropped)
    n_spans = len(version)
    if len(rollout_in) != n_rollouts or len(dispatch) != n_rollouts or len(completion) != n_rollouts:
        raise ValueError("population: rollout arrays differ in length")
    if len(sample_offsets) != n_rollouts + 1 or len(mask_below) != n_samples or len(n_sampled) != n_samples:
        raise ValueError("population: sample arrays differ in length")
    if len(span_offsets) != n_samples + 1 or len(sampled) != n_spans or len(labelled) != n_spans:
        raise ValueError("population: span arrays differ in length")
    if sample_offsets[0] != 0 or sample_offsets[n_rollouts] != n_samples or span_offsets[0] != 0:
        raise ValueError("population: offsets do not cover the arrays")
    if span_offsets[n_samples] != n_spans:
        raise ValueError("population: offsets do not cover the arrays")
    for r in range(n_rollouts):
        if sample_offsets[r + 1] < sample_offsets[r]:
            raise ValueError("population: offsets out of order")
    for k in range(n_samples):
        if span_offsets[k + 1] < span_offsets[k]:
            raise ValueError("population: offsets out of order")


def _walk_live_rollout(
    r: int,
    t: int,
    dispatch: IntArray,
    sample_offsets: IntArray,
    dropped: BoolArray,
    mask_below: IntArray,
    n_sampled: IntArray,
    span_offsets: IntArray,
    version: IntArray,
    sampled: IntArray,
    labelled: BoolArray,
    length_bounds: IntArray,
    totals: IntArray,
    length_sampled: IntArray,
    length_removed: IntArray,
    extent: IntArray,
) -> tuple[int, int]:  # pragma: no cover - compiled
    """Add live rollout ``r``'s kept samples and their spans with sampled positions to ``totals`` (at the
    ``SUM_*`` places of tokens, masked, unlabelled and samples, which ``_population_sums`` shares), the
    length buckets and ``extent`` (the lowest, highest and largest absolute staleness, and 1 once any is
    seen); returns the rollout's oldest and newest sampled version (its dispatch version for both when it
    has none). A callee of ``_population_sums`` and ``_population_summary``."""
    n_buckets = len(length_bounds) + 1
    oldest = dispatch[r]
    freshest = dispatch[r]
    found = False
    for s in range(sample_offsets[r], sample_offsets[r + 1]):
        if dropped[s]:
            continue
        totals[SUM_SAMPLES] += 1
        masked_here = 0
        for k in range(span_offsets[s], span_offsets[s + 1]):
            count = sampled[k]
            if count <= 0:
                continue
            v = version[k]
            if not found:
                oldest = v
                freshest = v
                found = True
            else:
                oldest = min(oldest, v)
                freshest = max(freshest, v)
            staleness = t - v
            if extent[3] == 0:
                extent[0] = staleness
                extent[1] = staleness
                extent[3] = 1
            else:
                extent[0] = min(extent[0], staleness)
                extent[1] = max(extent[1], staleness)
            extent[2] = max(extent[2], abs(staleness))
            totals[SUM_TOKENS] += count
            if not labelled[k]:
                totals[SUM_UNLABELLED] += count
            if v < mask_below[s]:
                masked_here += count
        totals[SUM_MASKED] += masked_here
        length = n_sampled[s]
        if length > 0:
            bucket = 0
            while bucket < n_buckets - 1 and length_bounds[bucket] < length:
                bucket += 1
            length_sampled[bucket] += length
            length_removed[bucket] += masked_here
    return oldest, freshest


_POPULATION_CALLEES: dict[str, tuple[Callable[..., Any], Mapping[str, Any]]] = {
    "_check_population": (_check_population, {}),
    "_walk_live_rollout": (_walk_live_rollout, {}),
}


@_CompiledOnFirstCall(callees=_POPULATION_CALLEES)
def _population_sums(
    t: int,
    rollout_in: BoolArray,
    frozen: BoolArray,
    dispatch: IntArray,
    completion: IntArray,
    sample_offsets: IntArray,
    dropped: BoolArray,
    mask_below: IntArray,
    n_sampled: IntArray,
    span_offsets: IntArray,
    version: IntArray,
    sampled: IntArray,
    labelled: BoolArray,
    length_bounds: IntArray,
    direct_range: int,
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray, IntArray, IntArray]:  # pragma: no cover - compiled
    _check_population(
        rollout_in, frozen, dispatch, completion, sample_offsets, dropped, mask_below, n_sampled, span_offsets,
        version, sampled, labelled,
    )  # fmt: skip
    n_rollouts = len(frozen)
    # [tokens, masked, unlabelled, frozen, samples, dot, dot fits, low, any present]
    totals = np.zeros(9, dtype=np.int64)
    n_buckets = len(length_bounds) + 1
    length_sampled = np.zeros(n_buckets, dtype=np.int64)
    length_removed = np.zeros(n_buckets, dtype=np.int64)
    selected = 0
    for r in range(n_rollouts):
        if rollout_in[r] and not frozen[r]:
            selected += 1
    rollout = np.empty(selected, dtype=np.int64)
    in_flight = np.empty(selected, dtype=np.int64)
    newest = np.empty(selected, dtype=np.int64)
    extent = np.zeros(4, dtype=np.int64)  # _walk_live_rollout's lowest, highest and largest |staleness|, any
    at = 0
    for r in range(n_rollouts):
        if not rollout_in[r]:
            continue
        if frozen[r]:
            totals[3] += 1
            continue
        oldest, freshest = _walk_live_rollout(
            r, t, dispatch, sample_offsets, dropped, mask_below, n_sampled, span_offsets, version, sampled, labelled,
            length_bounds, totals, length_sampled, length_removed, extent,
        )  # fmt: skip
        rollout[at] = t - oldest
        flight = completion[r] - oldest
        flight = max(flight, 0)
        in_flight[at] = min(flight, t - oldest)
        newest[at] = t - freshest
        at += 1
    low, high, largest, present = extent[0], extent[1], extent[2], extent[3] != 0
    # sum(staleness x count) fits in int64 when |staleness| x tokens does (every partial sum is below it)
    fits = largest == 0 or totals[0] <= (2**62 - 1) // largest
    counts = np.zeros(0, dtype=np.int64)
    if present:
        totals[7] = low
        totals[8] = 1
        direct = high - low < direct_range
        if direct:
            counts = np.zeros(high - low + 1, dtype=np.int64)
        if fits or direct:
            dot = 0
            for r in range(n_rollouts):
                if not rollout_in[r] or frozen[r]:
                    continue
                for s in range(sample_offsets[r], sample_offsets[r + 1]):
                    if dropped[s]:
                        continue
                    for k in range(span_offsets[s], span_offsets[s + 1]):
                        count = sampled[k]
                        if count <= 0:
                            continue
                        if fits:
                            dot += (t - version[k]) * count
                        if direct:
                            counts[t - version[k] - low] += count
            totals[5] = dot
    totals[6] = 1 if fits else 0
    return totals, counts, rollout, in_flight, newest, length_sampled, length_removed


def population_sums(
    trained_version: int,
    rollout_in: BoolArray,
    frozen: BoolArray,
    dispatch: IntArray,
    completion: IntArray,
    sample_offsets: IntArray,
    dropped: BoolArray,
    mask_below: IntArray,
    n_sampled: IntArray,
    span_offsets: IntArray,
    version: IntArray,
    sampled: IntArray,
    labelled: BoolArray,
    length_bounds: IntArray,
    direct_range: int,
) -> PopulationSums:
    """The sums of a ship's metrics over the rollouts selected by ``rollout_in``, in one pass over their spans
    (a slice as ``decision.Judgement`` holds it: rollouts, samples by ``sample_offsets``, spans by
    ``span_offsets``). Frozen rollouts are only counted; dropped samples are left out. A sample's length
    bucket is the first of ``length_bounds`` at or above its sampled positions (the last bucket past them
    all); samples with none are in no bucket. ``counts`` is given when the staleness values of spans with
    sampled positions lie within ``direct_range``.

    Raises ``ValueError`` on arrays of different lengths or offsets that do not tile them.
    """
    found = _population_sums(
        int(trained_version), rollout_in, frozen, dispatch, completion, sample_offsets, dropped, mask_below,
        n_sampled, span_offsets, version, sampled, labelled, length_bounds, int(direct_range),
    )  # fmt: skip
    totals, counts, rollout, in_flight, newest, length_sampled, length_removed = found
    tokens, masked, unlabelled, n_frozen, samples, dot, fits, low, present = totals.tolist()
    return PopulationSums(
        tokens, masked, unlabelled, n_frozen, samples, dot if fits and present else (0 if not present else None),
        low, counts if present and len(counts) else None, rollout, in_flight, newest, length_sampled, length_removed,
    )  # fmt: skip


class TokenDecision(NamedTuple):
    """What :func:`token_decision` decides (``decision.Decision``'s first three arrays)."""

    mask_below: IntArray
    drop_sample: BoolArray
    drop_rollout: BoolArray


@_CompiledOnFirstCall
def _token_decision(
    bound: int,
    no_mask: int,
    frozen: BoolArray,
    sample_offsets: IntArray,
    mask_below: IntArray,
    dropped: BoolArray,
    had_train: BoolArray,
    unmaskable: BoolArray,
    span_offsets: IntArray,
    version: IntArray,
    live: BoolArray,
) -> tuple[IntArray, BoolArray, BoolArray]:  # pragma: no cover - compiled
    n_rollouts = len(frozen)
    n_samples = len(mask_below)
    n_spans = len(version)
    if len(sample_offsets) != n_rollouts + 1 or len(span_offsets) != n_samples + 1:
        raise ValueError("token_decision: offsets of the wrong length")
    if len(dropped) != n_samples or len(had_train) != n_samples or len(unmaskable) != n_samples:
        raise ValueError("token_decision: sample arrays differ in length")
    if len(live) != n_spans:
        raise ValueError("token_decision: span arrays differ in length")
    if sample_offsets[0] != 0 or sample_offsets[n_rollouts] != n_samples or span_offsets[0] != 0:
        raise ValueError("token_decision: offsets do not cover the arrays")
    if span_offsets[n_samples] != n_spans:
        raise ValueError("token_decision: offsets do not cover the arrays")
    for r in range(n_rollouts):
        if sample_offsets[r + 1] < sample_offsets[r]:
            raise ValueError("token_decision: offsets out of order")
    for k in range(n_samples):
        if span_offsets[k + 1] < span_offsets[k]:
            raise ValueError("token_decision: offsets out of order")
    new_below = np.empty(n_samples, dtype=np.int64)
    drop_sample = np.zeros(n_samples, dtype=np.bool_)
    drop_rollout = np.zeros(n_rollouts, dtype=np.bool_)
    for r in range(n_rollouts):
        is_live = not frozen[r]
        gone = 0
        for k in range(sample_offsets[r], sample_offsets[r + 1]):
            below = max(mask_below[k], bound if is_live else no_mask)
            new_below[k] = below
            left = unmaskable[k]
            if not left:
                for i in range(span_offsets[k], span_offsets[k + 1]):
                    if live[i] and version[i] >= below:
                        left = True
                        break
            drop = is_live and not dropped[k] and had_train[k] and not left
            drop_sample[k] = drop
            gone += dropped[k] or drop
        drop_rollout[r] = is_live and gone == sample_offsets[r + 1] - sample_offsets[r]
    return new_below, drop_sample, drop_rollout


def token_decision(
    bound: int,
    no_mask: int,
    frozen: BoolArray,
    sample_offsets: IntArray,
    mask_below: IntArray,
    dropped: BoolArray,
    had_train: BoolArray,
    unmaskable: BoolArray,
    span_offsets: IntArray,
    version: IntArray,
    live: BoolArray,
) -> TokenDecision:
    """The ``token`` policy over a judged slice (rollouts, samples by ``sample_offsets``, spans by
    ``span_offsets``), in one pass: each sample of a live (not ``frozen``) rollout masks below
    ``max(mask_below, bound)`` (a frozen one's keeps ``max(mask_below, no_mask)``); a live rollout's sample
    not yet ``dropped`` that ``had_train`` is dropped when it is not ``unmaskable`` and none of its ``live``
    spans has a version at or above its new threshold; a live rollout whose samples are all dropped (or that
    has none) is dropped.

    Raises ``ValueError`` on arrays of different lengths or offsets that do not tile them.
    """
    found = _token_decision(
        int(bound), int(no_mask), frozen, sample_offsets, mask_below, dropped, had_train, unmaskable, span_offsets,
        version, live,
    )  # fmt: skip
    return TokenDecision(*found)


class PopulationSummary(NamedTuple):
    """What :func:`population_summary` finds: the numbers (indexed by the ``SUM_*`` / ``MAX_*`` constants,
    then one nearest-rank staleness per quantile asked) and four arrays."""

    numbers: list[int]
    length_sampled: IntArray  # per length bucket (by a sample's sampled positions): sampled positions
    length_removed: IntArray  # of those, masked
    token_histogram: IntArray  # sampled positions per staleness 0, 1, ..., the last counting all from ``top`` up
    rollout_histogram: IntArray  # live rollouts per staleness (their oldest shipped version's), folded alike


@_CompiledOnFirstCall(callees=_POPULATION_CALLEES)
def _population_summary(
    t: int,
    rollout_in: BoolArray,
    frozen: BoolArray,
    dispatch: IntArray,
    completion: IntArray,
    sample_offsets: IntArray,
    dropped: BoolArray,
    mask_below: IntArray,
    n_sampled: IntArray,
    span_offsets: IntArray,
    version: IntArray,
    sampled: IntArray,
    labelled: BoolArray,
    length_bounds: IntArray,
    direct_range: int,
    top: int,
    quantiles: IntArray,
) -> IntArray:  # pragma: no cover - compiled
    _check_population(
        rollout_in, frozen, dispatch, completion, sample_offsets, dropped, mask_below, n_sampled, span_offsets,
        version, sampled, labelled,
    )  # fmt: skip
    n_rollouts = len(frozen)
    n_quantiles = len(quantiles)
    head = SUM_QUANTILES + n_quantiles
    n_buckets = len(length_bounds) + 1
    totals = np.zeros(head, dtype=np.int64)
    length_sampled = np.zeros(n_buckets, dtype=np.int64)
    length_removed = np.zeros(n_buckets, dtype=np.int64)
    rollout_hist = np.zeros(top + 1, dtype=np.int64)
    extent = np.zeros(4, dtype=np.int64)  # _walk_live_rollout's lowest, highest and largest |staleness|, any
    rollout_top = -1
    counts = np.zeros(0, dtype=np.int64)
    for r in range(n_rollouts):
        if not rollout_in[r]:
            continue
        if frozen[r]:
            totals[SUM_FROZEN] += 1
            continue
        oldest, freshest = _walk_live_rollout(
            r, t, dispatch, sample_offsets, dropped, mask_below, n_sampled, span_offsets, version, sampled, labelled,
            length_bounds, totals, length_sampled, length_removed, extent,
        )  # fmt: skip
        rollout = t - oldest
        in_flight = min(max(completion[r] - oldest, 0), rollout)
        in_queue = rollout - in_flight
        newest = t - freshest
        if rollout < 0:
            return np.zeros(0, dtype=np.int64)  # a staleness below 0: the caller's general path
        first = totals[SUM_LIVE] == 0
        totals[SUM_LIVE] += 1
        totals[SUM_ROLLOUT] += rollout
        totals[SUM_IN_FLIGHT] += in_flight
        totals[SUM_IN_QUEUE] += in_queue
        totals[SUM_NEWEST] += newest
        totals[MAX_ROLLOUT] = rollout if first else max(totals[MAX_ROLLOUT], rollout)
        totals[MAX_IN_FLIGHT] = in_flight if first else max(totals[MAX_IN_FLIGHT], in_flight)
        totals[MAX_IN_QUEUE] = in_queue if first else max(totals[MAX_IN_QUEUE], in_queue)
        totals[MAX_NEWEST] = newest if first else max(totals[MAX_NEWEST], newest)
        folded = min(rollout, top)
        rollout_hist[folded] += 1
        rollout_top = max(rollout_top, folded)
    low, high, largest, present = extent[0], extent[1], extent[2], extent[3] != 0
    token_top = -1
    if present:
        # the general path: a staleness below 0, too wide a range to count by value, or a dot beyond int64
        if low < 0 or high - low >= direct_range or (largest > 0 and totals[SUM_TOKENS] > (2**62 - 1) // largest):
            return np.zeros(0, dtype=np.int64)
        counts = np.zeros(high - low + 1, dtype=np.int64)
        dot = 0
        for r in range(n_rollouts):
            if not rollout_in[r] or frozen[r]:
                continue
            for s in range(sample_offsets[r], sample_offsets[r + 1]):
                if dropped[s]:
                    continue
                for k in range(span_offsets[s], span_offsets[s + 1]):
                    count = sampled[k]
                    if count > 0:
                        dot += (t - version[k]) * count
                        counts[t - version[k] - low] += count
        totals[SUM_DOT] = dot
        token_top = min(high, top)
        total = totals[SUM_TOKENS]
        for q in range(n_quantiles):
            numerator = quantiles[q, 0]
            denominator = quantiles[q, 1]
            # ceil(numerator * total / denominator) without the product, which may not fit in int64
            whole = total // denominator
            rest = total % denominator
            rank = max(1, numerator * whole + (numerator * rest + denominator - 1) // denominator)
            running = 0
            for i in range(len(counts)):
                running += counts[i]
                if running >= rank:
                    totals[SUM_QUANTILES + q] = low + i
                    break
    totals[TOKEN_BINS] = token_top + 1
    totals[ROLLOUT_BINS] = rollout_top + 1
    out = np.empty(head + 2 * n_buckets + token_top + 1 + rollout_top + 1, dtype=np.int64)
    out[:head] = totals
    at = head
    out[at : at + n_buckets] = length_sampled
    at += n_buckets
    out[at : at + n_buckets] = length_removed
    at += n_buckets
    if present:
        out[at : at + token_top + 1] = 0
        for i in range(len(counts)):
            out[at + min(low + i, top)] += counts[i]
    at += token_top + 1
    out[at : at + rollout_top + 1] = rollout_hist[: rollout_top + 1]
    return out


def population_summary(
    trained_version: int,
    rollout_in: BoolArray,
    frozen: BoolArray,
    dispatch: IntArray,
    completion: IntArray,
    sample_offsets: IntArray,
    dropped: BoolArray,
    mask_below: IntArray,
    n_sampled: IntArray,
    span_offsets: IntArray,
    version: IntArray,
    sampled: IntArray,
    labelled: BoolArray,
    length_bounds: IntArray,
    direct_range: int,
    top: int,
    quantiles: IntArray,
) -> PopulationSummary | None:
    """What a ship reports of the rollouts selected by ``rollout_in`` (the inputs of :func:`population_sums`),
    in one pass and one array back: the sums of :func:`population_sums`, the count, sum and maximum of the
    live rollouts' staleness, in-flight and in-queue times and newest staleness, the nearest-rank staleness of
    each ``quantiles`` row (numerator, denominator: the ceil(p * N)-th smallest sampled position's), and the
    token and rollout histograms (index = staleness, the last index ``top`` counting all above it).

    None where the general path is needed: a staleness below 0, staleness values of sampled positions that
    span ``direct_range`` or more, or a staleness x positions sum that could overflow int64.

    Raises ``ValueError`` on arrays of different lengths or offsets that do not tile them.
    """
    out = _population_summary(
        int(trained_version), rollout_in, frozen, dispatch, completion, sample_offsets, dropped, mask_below,
        n_sampled, span_offsets, version, sampled, labelled, length_bounds, int(direct_range), int(top), quantiles,
    )  # fmt: skip
    if not len(out):
        return None
    head = SUM_QUANTILES + len(quantiles)
    n_buckets = len(length_bounds) + 1
    numbers: list[int] = out[:head].tolist()
    tokens_at = head + 2 * n_buckets
    rollouts_at = tokens_at + numbers[TOKEN_BINS]
    return PopulationSummary(
        numbers, out[head : head + n_buckets], out[head + n_buckets : tokens_at], out[tokens_at:rollouts_at],
        out[rollouts_at : rollouts_at + numbers[ROLLOUT_BINS]],
    )  # fmt: skip


# Per span facts of a weight array, as bits of one byte each (see weight_flags).
WEIGHT_NONZERO, WEIGHT_NONFINITE, WEIGHT_NAN, WEIGHT_NOT_POSITIVE = 1, 2, 4, 8
# Sign bit and +inf bit pattern of the float dtypes the loop reads as unsigned integers of their width.
_FLOAT_BITS = {np.dtype(np.float16): (1 << 15, 0x7C00), np.dtype(np.float32): (1 << 31, 0x7F800000),
               np.dtype(np.float64): (1 << 63, 0x7FF << 52)}  # fmt: skip


@_CompiledOnFirstCall
def _weight_flags(
    bits: npt.NDArray[Any], lo: IntArray, hi: IntArray, sign: np.uint64, infinity: np.uint64
) -> npt.NDArray[np.uint8]:  # pragma: no cover - compiled
    n = len(bits)
    rows = len(lo)
    if len(hi) != rows:
        raise ValueError("weight_flags: lo and hi differ in length")
    out = np.zeros(rows, dtype=np.uint8)
    one = np.uint64(1)
    magnitude = sign - one
    at_least_inf = sign - infinity  # y + at_least_inf has the sign bit exactly when y >= +inf's bits
    above_inf = at_least_inf - one  # ... when y > +inf's bits: a NaN
    for r in range(rows):
        a = lo[r]
        b = hi[r]
        if a >= b:
            continue
        if a < 0 or b > n:
            raise IndexError("weight_flags: a span lies outside the array")
        seg = bits[a:b]  # a slice: in bounds, no negative-index fix-up, so the loop is vectorised
        any_bits = np.uint64(0)
        any_inf = np.uint64(0)
        any_nan = np.uint64(0)
        any_not_positive = np.uint64(0)
        # Integer ORs only (no compare, no branch): one vector pass over the span.
        for i in range(b - a):
            u = np.uint64(seg[i])
            y = u & magnitude
            any_bits |= y
            any_inf |= y + at_least_inf
            any_nan |= y + above_inf
            any_not_positive |= u | (y - one)  # the sign bit set, or y == 0 (wraps to all ones)
        flags = 0
        if any_bits != 0:
            flags |= 1
        if any_inf & sign:
            flags |= 2
        if any_nan & sign:
            flags |= 4 | 8  # NaN is not > 0 either
        if any_not_positive & sign:
            flags |= 8
        out[r] = flags
    return out


def weight_flags(values: npt.NDArray[Any], lo: IntArray, hi: IntArray) -> npt.NDArray[np.uint8] | None:
    """Per span ``[lo[r], hi[r])`` of a float16/32/64 array, the bits: ``WEIGHT_NONZERO`` (a value
    other than +-0.0, NaN included), ``WEIGHT_NONFINITE`` (a NaN or an infinity), ``WEIGHT_NAN`` and
    ``WEIGHT_NOT_POSITIVE`` (a value that is not > 0: a zero, a negative sign bit or a NaN).

    One pass of integer ORs over each value's bits. ``None`` for other dtypes and non-contiguous arrays,
    which the caller reduces with numpy. Raises ``IndexError`` on a span outside the array.
    """
    constants = _FLOAT_BITS.get(values.dtype)
    if constants is None or not values.flags.c_contiguous or values.ndim != 1:
        return None
    sign, infinity = constants
    bits = values.view(_UNSIGNED_OF_SIZE[values.dtype.itemsize])
    flags: npt.NDArray[np.uint8] = _weight_flags(bits, lo, hi, np.uint64(sign), np.uint64(infinity))
    return flags


# exp(x) for |x| <= 20 as fdlibm's e_exp.c computes it (within 1 ulp of the C library's): x = k ln2 + r,
# |r| <= ln2 / 2 (ln2 in two parts, so k ln2 is exact), a rational approximation of exp(r), then 2^k.
# Written in the loop, it is vectorised; the C library's exp is a call per position.
_LN2_HI, _LN2_LO, _INV_LN2 = 6.93147180369123816490e-01, 1.90821492927058770002e-10, 1.44269504088896338700e00
_EXP_P1, _EXP_P2, _EXP_P3 = 1.66666666666666019037e-01, -2.77777777770155933842e-03, 6.61375632143793436117e-05
_EXP_P4, _EXP_P5 = -1.65339022054652515390e-06, 4.13813679705723846039e-08
_SHIFTER = 1.5 * 2.0**52  # added to an integer-valued float below 2^51, leaves it in the low mantissa bits
# A log-ratio this close to the log of a band edge is compared again with the C library's exp; farther,
# its side of the edge is the side of exp(d) (log's and exp's rounding are far below it)
_NEAR = 2.0**-39


def _ratio(d: float) -> tuple[float, float]:  # pragma: no cover - compiled
    """``r = exp(d)`` for ``|d| <= 700`` (fdlibm's e_exp.c, within one ulp of the C library's) and the k3
    term ``r - 1 - d``. Compiled without reassociation, so the reduction keeps its order even where it is
    inlined into a loop that sums in vector lanes; ``k`` is rounded to nearest (a tie either way is exact
    enough) and the polynomial is evaluated in Estrin's order: a shorter chain of dependent operations."""
    k = np.rint(d * _INV_LN2)
    high = d - k * _LN2_HI
    low = k * _LN2_LO
    x = high - low
    xx = x * x
    x4 = xx * xx
    c = x - xx * ((_EXP_P1 + xx * _EXP_P2) + x4 * ((_EXP_P3 + xx * _EXP_P4) + x4 * _EXP_P5))
    y = 1.0 - ((low - (x * c) / (2.0 - c)) - high)
    # 2^k from k's bits in the mantissa of k + 1.5 * 2^52 (no float-to-integer conversion: any d gives
    # a value, which a loop may compute for positions it then discards)
    scale = np.int64((np.float64(k + _SHIFTER).view(np.int64) + 1023) << 52).view(np.float64)
    r = y * scale  # exact
    return r, r - 1.0 - d


_ratio_compiled: Any = None  # _ratio, compiled when _mismatch_runs is


@_CompiledOnFirstCall(
    error_model="numpy", fastmath={"reassoc"}, callees={"_ratio_compiled": (_ratio, {"error_model": "numpy"})}
)
def _mismatch_runs(
    lag: IntArray,
    sampler: npt.NDArray[Any],
    trainer: npt.NDArray[Any],
    flags: npt.NDArray[np.uint8],
    has_flags: bool,
    bounds: IntArray,
    band_lo: float,
    band_hi: float,
    clamp: float,
) -> tuple[IntArray, npt.NDArray[np.float64], int]:  # pragma: no cover - compiled
    # Compiled with reassociation: the sums go in vector lanes (float64 rounding apart from a sequential
    # pass); exp and the k3 term are _ratio's, compiled without it.
    n = len(lag)
    if len(sampler) != n or len(trainer) != n or (has_flags and len(flags) != n):
        raise ValueError("mismatch_runs: the arrays differ in length")
    n_buckets = len(bounds) + 1
    counts = np.zeros((3, n_buckets), dtype=np.int64)  # tokens, masked, out_of_band
    sums = np.zeros((5, n_buckets), dtype=np.float64)  # d, |d|, r - 1 - d, r, r^2
    uncovered = 0
    # The band in log space: d outside [log_lo, log_hi] is out of band, except d within _NEAR of an edge,
    # where which side exp(d) falls is the C library exp's answer. The comparisons read d, not r: they
    # do not wait for the exp.
    log_lo = math.log(band_lo) if band_lo > 0 else -np.inf
    log_hi = math.log(band_hi) if band_hi > 0 else -np.inf
    near_lo, near_lo_top = log_lo - _NEAR, log_lo + _NEAR
    near_hi, near_hi_top = log_hi - _NEAR, log_hi + _NEAR
    last_lag = -1
    bucket = 0
    p = 0
    while p < n:  # one run of equal lag at a time: its bucket is found once
        run_lag = lag[p]
        q = p + 1
        while q < n:  # the run's end: 64 positions compared at once, then one by one
            top = min(q + 64, n)
            ahead = lag[q:top]
            differ = 0
            for i in range(top - q):
                differ += ahead[i] != run_lag
            if differ == 0:
                q = top
                continue
            i = 0
            while ahead[i] == run_lag:
                i += 1
            q += i
            break
        if run_lag < 0:  # not a sampled position of a live rollout: outside the population
            p = q
            continue
        if run_lag != last_lag:  # numpy's searchsorted(bounds, lag, "left")
            bucket = 0
            while bucket < n_buckets - 1 and bounds[bucket] < run_lag:
                bucket += 1
            last_lag = run_lag
        s = sampler[p:q]  # slices: in bounds, no negative-index fix-up per position
        t = trainer[p:q]
        # The usual run: every difference finite and within the clamp, no ratio near a band edge. One
        # vector pass with no per-position branch or select; anything else is computed again below.
        sum_d = sum_abs = sum_k3 = sum_r = sum_r2 = 0.0
        unusual = 0
        n_out = 0
        near = 0
        for i in range(q - p):
            d = np.float64(t[i]) - np.float64(s[i])
            unusual += not (abs(d) <= clamp)  # NaN, infinite or to be clamped: the run is computed again
            r, k3 = _ratio_compiled(d)
            sum_d += d
            sum_abs += abs(d)
            sum_k3 += k3
            sum_r += r
            sum_r2 += r * r
            n_out += (d < log_lo) | (d > log_hi)
            near += ((d > near_lo) & (d < near_lo_top)) | ((d > near_hi) & (d < near_hi_top))
        tokens = q - p
        n_masked = 0
        if unusual == 0:
            if has_flags:
                f = flags[p:q]
                for i in range(q - p):
                    n_masked += f[i] != 0
        else:  # position by position: non-finite differences are uncovered, the others clamped
            sum_d = sum_abs = sum_k3 = sum_r = sum_r2 = 0.0
            tokens = 0
            n_out = 0
            near = 0
            for i in range(q - p):
                d = np.float64(t[i]) - np.float64(s[i])
                finite = abs(d) < np.inf  # either value NaN or infinite: uncovered, never an error
                d = min(max(d, -clamp), clamp) if finite else 0.0
                r, k3 = _ratio_compiled(d)
                r = r if finite else 0.0
                sum_d += d
                sum_abs += abs(d)
                sum_k3 += k3 if finite else 0.0
                sum_r += r
                sum_r2 += r * r
                tokens += finite
                if has_flags:
                    n_masked += finite & (flags[p + i] != 0)
                n_out += finite & ((d < log_lo) | (d > log_hi))
                near += finite & (((d > near_lo) & (d < near_lo_top)) | ((d > near_hi) & (d < near_hi_top)))
        if near:  # a ratio on a band edge: which side it falls is the C library exp's answer
            n_out = 0
            for i in range(q - p):
                d = np.float64(t[i]) - np.float64(s[i])
                if abs(d) < np.inf:
                    d = min(max(d, -clamp), clamp)
                    if ((d > near_lo) & (d < near_lo_top)) | ((d > near_hi) & (d < near_hi_top)):
                        r = math.exp(d)
                        n_out += (r < band_lo) | (r > band_hi)
                    else:
                        n_out += (d < log_lo) | (d > log_hi)
        counts[0, bucket] += tokens
        counts[1, bucket] += n_masked
        counts[2, bucket] += n_out
        sums[0, bucket] += sum_d
        sums[1, bucket] += sum_abs
        sums[2, bucket] += sum_k3
        sums[3, bucket] += sum_r
        sums[4, bucket] += sum_r2
        uncovered += (q - p) - tokens
        p = q
    return counts, sums, uncovered


def mismatch_runs(
    lag: IntArray,
    sampler: npt.NDArray[Any],
    trainer: npt.NDArray[Any],
    flags: npt.NDArray[np.bool_] | npt.NDArray[np.uint8] | None,
    band_lo: float,
    band_hi: float,
    bounds: IntArray,
    clamp: float,
) -> tuple[IntArray, npt.NDArray[np.float64], int]:
    """SPEC 11's per-bucket sums of one call in one pass: ``counts`` (tokens, masked, out of band) and
    ``sums`` (d, \|d\|, r - 1 - d, r, r\ :sup:`2`) per bucket (``searchsorted(bounds, lag, "left")``),
    and the uncovered positions. ``lag`` is int64; the log-probabilities float32 or float64 (each read as
    float64); ``flags`` one byte (or bool) per position or ``None``. Positions with a negative lag are
    skipped, those where the difference is not finite are uncovered; ``d`` is clamped to ``±clamp``
    (at most 700: ``exp`` is computed in the loop for the arguments of a float64 result). The float sums
    are those of a sequential pass to float64 rounding: ``r`` within one ulp of the C library's ``exp``,
    added in vector lanes; the counts are exact (a ratio on a band edge is compared again with the C
    library's ``exp``). Large inputs are summed in parallel shares (the loop releases the GIL), then added.

    Raises ``ValueError`` when the arrays differ in length or ``clamp`` is out of range.
    """
    if not 0 <= clamp <= 700:
        raise ValueError(f"mismatch_runs: clamp {clamp} outside 0..700")
    flag_bytes = _NO_FLAGS if flags is None else flags.view(np.uint8)
    has_flags = flags is not None
    n = len(lag)
    if n < PARALLEL_MIN_POSITIONS:
        one: tuple[IntArray, npt.NDArray[np.float64], int] = _mismatch_runs(
            lag, sampler, trainer, flag_bytes, has_flags, bounds, band_lo, band_hi, clamp
        )
        return one
    if len(sampler) != n or len(trainer) != n or (has_flags and len(flag_bytes) != n):
        raise ValueError("mismatch_runs: the arrays differ in length")
    edges = np.linspace(0, n, num=_SHARES + 1, dtype=np.int64).tolist()
    tasks = [
        partial(_mismatch_runs, lag[a:b], sampler[a:b], trainer[a:b], flag_bytes[a:b] if has_flags else flag_bytes,
                has_flags, bounds, band_lo, band_hi, clamp)
        for a, b in itertools.pairwise(edges)
    ]  # fmt: skip
    parts: list[tuple[IntArray, npt.NDArray[np.float64], int]] = run_all(tasks, n)
    counts = np.sum([p[0] for p in parts], axis=0)
    sums = np.sum([p[1] for p in parts], axis=0)
    return counts, sums, sum(p[2] for p in parts)


def _finite(values: npt.NDArray[Any]) -> bool:  # pragma: no cover - compiled
    """Whether every value is finite (a callee of ``_plain_values``: one vector pass)."""
    bad = False
    for x in values:
        bad |= not math.isfinite(x)
    return not bad


def _copy_to(copy: npt.NDArray[Any], values: npt.NDArray[Any], start: int, n: int) -> None:  # pragma: no cover
    """``values`` into ``copy`` from ``start`` on, when both are there (an empty array is not; a callee)."""
    if len(copy) and len(values) == n:
        copy[start : start + n] = values


@_CompiledOnFirstCall(callees={"_finite": (_finite, {}), "_copy_to": (_copy_to, {})})
def _plain_values(
    n_rollouts: int,
    sample_offsets: IntArray,
    position_offsets: IntArray,
    dispatch: IntArray,
    completion: IntArray,
    label_kind: npt.NDArray[np.int8],
    labels: int,
    mask: npt.NDArray[Any],
    rl: npt.NDArray[Any],
    ce: npt.NDArray[Any],
    ref_kl: npt.NDArray[Any],
    logprobs: npt.NDArray[Any],
    tokens: IntArray,
    mask_copy: npt.NDArray[Any],
    rl_copy: npt.NDArray[Any],
    ce_copy: npt.NDArray[Any],
    ref_kl_copy: npt.NDArray[Any],
    token_copy: IntArray,
    start: int,
) -> bool:  # pragma: no cover - compiled
    # (flat arguments, no tuples: the call itself is most of the cost of a small batch's check)
    n_samples, n = len(position_offsets) - 1, len(mask)
    if (
        n_samples < 0
        or len(sample_offsets) != n_rollouts + 1
        or len(dispatch) != n_rollouts
        or len(completion) != n_rollouts
        or len(label_kind) != n_samples
    ):
        return False  # (the lengths every read below relies on)
    if sample_offsets[0] != 0 or sample_offsets[n_rollouts] != n_samples:
        return False
    if position_offsets[0] != 0 or position_offsets[n_samples] != n:
        return False
    for i in range(n_rollouts):  # offsets never decreasing; versions as check_batch wants them
        d, c = dispatch[i], completion[i]
        if sample_offsets[i + 1] < sample_offsets[i] or d < 0 or c < -1 or 0 <= c < d:
            return False  # (frozen ones too: -1 falls to the exact path)
    for j in range(n_samples):
        kind = label_kind[j]
        if position_offsets[j + 1] < position_offsets[j] or kind < 0 or kind > 2 or not (labels >> kind) & 1:
            return False
    bad = False
    for x in mask:
        bad |= (x != 0) & (x != 1)  # NaN too
    for t in tokens:
        bad |= t < -1
    if bad or not (_finite(rl) and _finite(ce) and _finite(ref_kl) and _finite(logprobs)):
        return False
    _copy_to(mask_copy, mask, start, n)
    _copy_to(rl_copy, rl, start, n)
    _copy_to(ce_copy, ce, start, n)
    _copy_to(ref_kl_copy, ref_kl, start, n)
    _copy_to(token_copy, tokens, start, n)
    return True


_PLAIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # (numba reads no float16)
_INT8 = np.dtype(np.int8)
_PLAIN_PADDING = {dtype: np.zeros(0, dtype=dtype) for dtype in _PLAIN_DTYPES}  # (read-only: never written)


class PositionCopies(NamedTuple):
    """Where :func:`plain_values` copies plain positions to: an array for the mask and for each of the three
    weights, of the mask's type, and one for the token versions (an empty array, or an array the batch lacks:
    not copied)."""

    mask_and_weights: tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]
    token_versions: IntArray


_NO_COPIES = {
    dtype: PositionCopies((empty, empty, empty, empty), _NO_TOKENS) for dtype, empty in _PLAIN_PADDING.items()
}  # (nothing copied)

Weights = tuple[npt.NDArray[Any] | None, npt.NDArray[Any] | None, npt.NDArray[Any] | None]


def plain_values(
    n_rollouts: int,
    sample_offsets: IntArray,
    position_offsets: IntArray,
    dispatch: IntArray,
    completion: IntArray,
    label_kind: npt.NDArray[np.int8],
    labels: int,
    mask: npt.NDArray[Any],
    weights: Weights,
    logprobs: npt.NDArray[Any] | None,
    tokens: IntArray | None,
    into: PositionCopies | None = None,
    start: int = 0,
) -> bool | None:
    """Whether a batch's values are plain, in one compiled pass (a small batch's checks in one call instead of a
    few dozen Python steps): its offsets run from 0 to the sample and position counts, never decreasing,
    dispatch versions are >= 0, completion versions >= -1 and not below a non-negative dispatch, label kinds are
    allowed (``labels`` has bit ``k`` set when kind ``k`` may appear); every mask value is 0 or 1, every value of
    the ``weights`` (rl, ce, ref-KL: None where absent) and ``logprobs`` finite and every token version >= -1.
    When they are and ``into`` is given, the mask, the weights and the token versions are copied there, from
    element ``start`` on, in the same call (a sink gathering small adds). The per-position arrays must be as long
    as the mask (the caller checks).

    ``None`` when the arrays are not 1-d contiguous float32/float64 (mask and floats of one type), the label
    kinds not int8, or while no compiled loop is loaded yet: the caller checks with Python and numpy
    (microseconds), so that a check never makes a cold process import numba (a second or more, e.g. inside a
    service's restore of its runs)."""
    if "numba" not in sys.modules:
        return None
    dtype = mask.dtype
    empty = _PLAIN_PADDING.get(dtype)
    if empty is None or mask.ndim != 1 or not mask.flags.c_contiguous or label_kind.dtype != _INT8:
        return None
    if not sample_offsets.ndim == position_offsets.ndim == dispatch.ndim == completion.ndim == label_kind.ndim == 1:
        return None  # (other shapes: Python says)
    rl, ce, ref_kl = weights  # (written out: this runs once per small add)
    rl, ce, ref_kl = empty if rl is None else rl, empty if ce is None else ce, empty if ref_kl is None else ref_kl
    logprobs = empty if logprobs is None else logprobs
    for values in (rl, ce, ref_kl, logprobs):
        if values is not empty and (values.dtype != dtype or values.ndim != 1 or not values.flags.c_contiguous):
            return None
    (mask_copy, rl_copy, ce_copy, ref_kl_copy), token_copy = _NO_COPIES[dtype] if into is None else into
    loop = _plain_values._compiled or _plain_values  # (the compiled loop itself once it is loaded)
    result: bool = loop(
        n_rollouts, sample_offsets, position_offsets, dispatch, completion, label_kind, labels, mask, rl, ce, ref_kl,
        logprobs, _NO_TOKENS if tokens is None else tokens, mask_copy, rl_copy, ce_copy, ref_kl_copy, token_copy, start,
    )  # fmt: skip
    return result


def warm_up() -> None:
    """Compile (or load from the disk cache) every loop for float32 and float64 arrays, so that the
    first batch a process handles does not pay for it: a service calls this when it starts."""
    tokens = np.array([0, -1, 1], dtype=np.int64)
    offsets = np.array([0, 3], dtype=np.int64)
    lo, hi, count = np.array([0], dtype=np.int64), np.array([3], dtype=np.int64), np.array([1], dtype=np.int64)
    yes = np.ones(1, dtype=bool)
    span_rows(lo, hi, count, count, yes, yes, yes, yes, ~yes, np.array([0, 3]), count, (-(1 << 60), 1 << 60))
    slice_rows(np.array([0]), np.array([0]), np.array([1]), np.array([0]), np.array([1]))
    shipped_rows(lo, count, yes, lo, count, count, count, ~yes, lo, lo, np.zeros(1, np.int8), lo, hi, 2, -1)
    stale_rows(lo, count, lo, lo, hi, yes, count, count, lo, np.zeros(1, np.int8), lo, hi)
    population_sums(1, yes, ~yes, count, count, np.array([0, 1]), ~yes, count, count, np.array([0, 1]), count, count,
                    yes, np.array([256]), 4096)  # fmt: skip
    token_decision(1, -9, ~yes, np.array([0, 1]), count, ~yes, yes, ~yes, np.array([0, 1]), count, yes)
    population_summary(1, yes, ~yes, count, count, np.array([0, 1]), ~yes, count, count, np.array([0, 1]), count,
                       count, yes, np.array([256]), 4096, 4096, np.array([[50, 100]]))  # fmt: skip
    for dtype in (np.float32, np.float64):
        arrays = [np.ones(3, dtype=dtype) for _ in range(4)]
        token_cuts(tokens, arrays[0], offsets, np.array([0], dtype=np.int64))
        token_spans(tokens, arrays[0], offsets, np.array([0], dtype=np.int64), arrays[1:])  # (1-3 weights alike)
        weight_flags(arrays[1], lo, hi)
        zero_spans(arrays, tokens, lo, hi, np.array([2], dtype=np.int8), count)
        mismatch_runs(tokens, arrays[0], arrays[1], np.zeros(3, dtype=bool), 0.5, 2.0, offsets, 20.0)
        mismatch_runs(tokens, arrays[0], arrays[1], None, 0.5, 2.0, offsets, 20.0)
        weights = (arrays[1], arrays[2], arrays[3])
        rows = (1, np.array([0, 1]), offsets, count, count, np.array([2], dtype=np.int8), 0b111)
        plain_values(*rows, arrays[0], weights, None, tokens)
        copies = PositionCopies((np.empty(3, dtype), np.empty(3, dtype), np.empty(3, dtype), np.empty(3, dtype)),
                                np.empty(3, np.int64))  # fmt: skip
        plain_values(*rows, arrays[0], weights, arrays[0], tokens, copies)
