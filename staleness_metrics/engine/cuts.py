"""The cut into spans: the compiled passes that find where a sample's positions change label or mask, and the
span rows :mod:`.spans` keeps of those cuts.

Per-position ``token_versions`` with scattered ``-1`` positions or labels that change often make "find the runs,
then reduce per run" cost a dozen numpy passes over arrays as long as the runs are many. These loops read each
position once instead. Each has the numpy formulation it replaced in ``tests/engine/test_kernels.py``, checked
equal on random inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import UNSIGNED_OF_SIZE, CompiledLoop
from ..parallel import PARALLEL_MIN_POSITIONS, SHARES, run_all

__all__ = [
    "WEIGHT_NAN", "WEIGHT_NONFINITE", "WEIGHT_NONZERO", "WEIGHT_NOT_POSITIVE", "CutFlags", "SpanRows", "TokenSpans",
    "fusable_weights", "span_rows", "token_cuts", "token_spans", "weight_flags",
]  # fmt: skip

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_NO_WEIGHTS = np.zeros(0, dtype=np.uint32)
_NO_WIDE_WEIGHTS = np.zeros(0, dtype=np.uint64)
_BLOCK = 32  # positions the cut loop checks at once for a cut (one vector pass)

# Per span facts of a weight array, as bits of one byte each (see weight_flags).
WEIGHT_NONZERO, WEIGHT_NONFINITE, WEIGHT_NAN, WEIGHT_NOT_POSITIVE = 1, 2, 4, 8
# Sign bit and +inf bit pattern of the float dtypes the loop reads as unsigned integers of their width.
_FLOAT_BITS = {np.dtype(np.float16): (1 << 15, 0x7C00), np.dtype(np.float32): (1 << 31, 0x7F800000),
               np.dtype(np.float64): (1 << 63, 0x7FF << 52)}  # fmt: skip


def _span_bits(seg: npt.NDArray[Any], sign: np.uint64, infinity: np.uint64) -> int:  # pragma: no cover - compiled
    """The ``WEIGHT_*`` bits of one span's values read as unsigned integers of their width (``sign``, ``infinity``:
    the sign bit and +inf's bits). Integer ORs only (no compare, no branch): one vector pass over the span. A
    callee of ``_weight_flags`` and ``_cut_flags``."""
    one = np.uint64(1)
    magnitude = sign - one
    at_least_inf = sign - infinity  # y + at_least_inf has the sign bit exactly when y >= +inf's bits
    above_inf = at_least_inf - one  # ... when y > +inf's bits: a NaN
    any_bits = np.uint64(0)
    any_inf = np.uint64(0)
    any_nan = np.uint64(0)
    any_not_positive = np.uint64(0)
    for i in range(len(seg)):
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
    return flags


def _cut_flags(
    weights: tuple[npt.NDArray[Any], ...],
    n_weights: int,
    starts: IntArray,
    cuts: tuple[int, int, int],
    flags: npt.NDArray[np.uint8],
    sign: np.uint64,
    infinity: np.uint64,
) -> None:  # pragma: no cover - compiled
    """Into ``flags``, the ``WEIGHT_*`` bits of each weight array on the cuts ``first`` to ``k - 1`` of one sample
    (``cuts``: first, k, the sample's end), read while the sample is in cache. A callee of ``_token_spans``."""
    first, k, end = cuts
    w0, w1, w2 = weights  # (three arrays: fewer repeat the first, whose bits are read once more)
    for c in range(first, k):
        cut_start = starts[c]
        cut_end = starts[c + 1] if c + 1 < k else end
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
            flags[w, c] = _span_bits(weights[w][cut_start:cut_end], sign, infinity)


def _checked_positions(
    tokens: IntArray,
    mask: npt.NDArray[Any],
    pos_off: IntArray,
    samples: IntArray,
    weights: tuple[npt.NDArray[Any], ...],
    n_weights: int,
) -> int:  # pragma: no cover - compiled
    """The positions of ``samples``, once their offsets and the arrays' lengths are checked: checked before any
    read, so a damaged offset never reads or writes out of bounds (a callee of ``_token_spans``)."""
    n = len(tokens)
    if len(mask) != n:
        raise ValueError("token_cuts: token_versions and mask differ in length")
    if n_weights > 0 and (len(weights[0]) != n or len(weights[1]) != n or len(weights[2]) != n):
        raise ValueError("token_cuts: a weight array and token_versions differ in length")
    total = 0
    end = 0
    for s in samples:
        if s < 0 or s + 1 >= len(pos_off):
            raise IndexError("token_cuts: a sample index beyond the position offsets")
        a = pos_off[s]
        b = pos_off[s + 1]
        if a < end or b < a or b > n:
            raise ValueError("token_cuts: position offsets out of order or beyond the arrays")
        end = b
        total += b - a
    return total


def _grown(values: IntArray, used: int, capacity: int) -> IntArray:  # pragma: no cover - compiled
    """``values``' first ``used`` entries in a new array of ``capacity`` (a callee of ``_token_spans``)."""
    wider = np.empty(capacity, dtype=values.dtype)
    wider[:used] = values[:used]
    return wider


_CUT_CALLEES: dict[str, tuple[Callable[..., Any], Mapping[str, Any]]] = {
    "_checked_positions": (_checked_positions, {}),
    "_grown": (_grown, {}),
    "_span_bits": (_span_bits, {}),
    "_cut_flags": (_cut_flags, {}),
}


@CompiledLoop(callees=_CUT_CALLEES)
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
    total = _checked_positions(tokens, mask, pos_off, samples, weights, n_weights)
    # Outputs sized by the cuts, not the positions: room for the next sample's worst case (a cut per
    # position), doubled when short. (Arrays of one entry per position cost page faults and numba's
    # zeroing of the flags, in every parallel share: more than the cut loop's own reads.)
    capacity = min(total + 1, max(64, 8 * len(samples)))
    starts = np.empty(capacity, dtype=np.int64)
    labels = np.empty_like(starts)
    labelled = np.empty_like(starts)
    flags = np.empty((n_weights, capacity), dtype=np.uint8)  # (every cut's bits are written)
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
        if n_weights > 0:
            _cut_flags(weights, n_weights, starts, (first_cut, k, a + length), flags, sign, infinity)
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
        views = tuple(w.view(UNSIGNED_OF_SIZE[w.dtype.itemsize]) for w in weights)
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
    edges = np.unique(np.searchsorted(ends, np.linspace(0, ends[-1], num=SHARES + 1)[1:-1], "left"))
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


@CompiledLoop(callees={"_span_bits": (_span_bits, {})})
def _weight_flags(
    bits: npt.NDArray[Any], lo: IntArray, hi: IntArray, sign: np.uint64, infinity: np.uint64
) -> npt.NDArray[np.uint8]:  # pragma: no cover - compiled
    n = len(bits)
    rows = len(lo)
    if len(hi) != rows:
        raise ValueError("weight_flags: lo and hi differ in length")
    out = np.zeros(rows, dtype=np.uint8)
    for r in range(rows):
        a = lo[r]
        b = hi[r]
        if a >= b:
            continue
        if a < 0 or b > n:
            raise IndexError("weight_flags: a span lies outside the array")
        out[r] = _span_bits(bits[a:b], sign, infinity)  # (a slice: in bounds, no negative-index fix-up)
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
    bits = values.view(UNSIGNED_OF_SIZE[values.dtype.itemsize])
    flags: npt.NDArray[np.uint8] = _weight_flags(bits, lo, hi, np.uint64(sign), np.uint64(infinity))
    return flags


# exp(x) for |x| <= 20 as fdlibm's e_exp.c computes it (within 1 ulp of the C library's): x = k ln2 + r,
# |r| <= ln2 / 2 (ln2 in two parts, so k ln2 is exact), a rational approximation of exp(r), then 2^k.
# Written in the loop, it is vectorised; the C library's exp is a call per position.
_LN2_HI, _LN2_LO, _INV_LN2 = 6.93147180369123816490e-01, 1.90821492927058770002e-10, 1.44269504088896338700e00
_EXP_P1, _EXP_P2, _EXP_P3 = 1.66666666666666019037e-01, -2.77777777770155933842e-03, 6.61375632143793436117e-05


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


@CompiledLoop
def _span_rows(
    cuts_of: tuple[IntArray, IntArray, IntArray, IntArray],
    flags: tuple[BoolArray, BoolArray, BoolArray, BoolArray, BoolArray],
    pos_off: IntArray,
    dispatch: IntArray,
    no_low: int,
    no_high: int,
) -> tuple[Any, ...]:  # pragma: no cover - compiled
    lo, hi, label, labelled = cuts_of
    kept, sampled, live_labelled, live_unlabelled, side = flags
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


class CutFlags(NamedTuple):
    """Per cut, what :func:`span_rows` reads besides its range and label: whether it is ``kept`` (its sample
    is valid) and ``sampled`` (mask 1), whether its labelled and unlabelled positions carry a loss weight
    (``live_labelled``, ``live_unlabelled``), and whether it is a ``side`` cut (a weight on an unsampled cut)."""

    kept: BoolArray
    sampled: BoolArray
    live_labelled: BoolArray
    live_unlabelled: BoolArray
    side: BoolArray


def span_rows(
    lo: IntArray,
    hi: IntArray,
    label: IntArray,
    labelled: IntArray,
    flags: CutFlags,
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
        (as_int(lo), as_int(hi), as_int(label), as_int(labelled)), tuple(as_bool(f) for f in flags), as_int(pos_off),
        as_int(dispatch), int(no_version[0]), int(no_version[1]),
    )  # fmt: skip
    return SpanRows(*found)
