"""The cut into spans: the compiled pass that finds where a sample's positions change label or mask
(and the weight facts of each cut), and the span rows :mod:`.spans` keeps of those cuts."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import UNSIGNED_OF_SIZE, CompiledLoop
from ..parallel import PARALLEL_MIN_POSITIONS, SHARES, run_all
from .segments import BoolArray, IntArray

_BLOCK = 32  # positions the cut loop checks at once for a cut (one vector pass)

# Per cut facts of a weight array, as bits of one byte each (see sample_cuts)
WEIGHT_NONZERO, WEIGHT_NONFINITE, WEIGHT_NAN, WEIGHT_NOT_POSITIVE = 1, 2, 4, 8
# Sign bit and +inf bit pattern of the float dtypes the loop reads as unsigned integers
_FLOAT_BITS = {
    np.dtype(np.float16): (np.uint64(1 << 15), np.uint64(0x7C00)),
    np.dtype(np.float32): (np.uint64(1 << 31), np.uint64(0x7F800000)),
    np.dtype(np.float64): (np.uint64(1 << 63), np.uint64(0x7FF << 52)),
}


def _span_bits(seg: npt.NDArray[Any], sign: np.uint64, infinity: np.uint64) -> int:  # pragma: no cover
    one = np.uint64(1)
    magnitude = sign - one
    # y + at_least_inf has the sign bit exactly when y >= +inf's bits
    at_least_inf = sign - infinity
    above_inf = at_least_inf - one  # ... when y > +inf's bits: a NaN
    any_bits = any_inf = any_nan = any_not_positive = np.uint64(0)
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
    cuts: tuple[IntArray, IntArray, int, int],
    flags: npt.NDArray[np.uint8],
    sign: np.uint64,
    infinity: np.uint64,
) -> None:  # pragma: no cover - compiled
    """Into ``flags``, the ``WEIGHT_*`` bits of the cuts ``first`` to ``k - 1`` of one sample."""
    starts, ends, first, k = cuts
    w0, w1, w2 = weights  # (three arrays: fewer repeat the first, whose bits are read once more)
    for c in range(first, k):
        cut_start, cut_end = starts[c], ends[c]
        s0, s1, s2 = w0[cut_start:cut_end], w1[cut_start:cut_end], w2[cut_start:cut_end]
        # Usual cut (all finite, > 0): min and max in the values' own width; any other is read again
        low0, low1, low2 = s0[0], s1[0], s2[0]
        top0, top1, top2 = low0, low1, low2
        for q in range(1, cut_end - cut_start):
            low0, top0 = min(low0, s0[q]), max(top0, s0[q])
            low1, top1 = min(low1, s1[q]), max(top1, s1[q])
            low2, top2 = min(low2, s2[q]), max(top2, s2[q])
        if (min(low0, low1, low2) > 0) & (top0 < infinity) & (top1 < infinity) & (top2 < infinity):
            for w in range(n_weights):
                flags[w, c] = 1
            continue
        for w in range(n_weights):
            flags[w, c] = _span_bits(weights[w][cut_start:cut_end], sign, infinity)


def _checked_positions(
    labels: tuple[npt.NDArray[np.int8], npt.NDArray[Any], IntArray, IntArray, IntArray],
    mask: npt.NDArray[Any],
    pos_off: IntArray,
    samples: IntArray,
    weights: tuple[npt.NDArray[Any], ...],
    n_weights: int,
) -> int:  # pragma: no cover - compiled
    """The positions of ``samples``, once the offsets and lengths are checked (not span starts)."""
    kinds, tokens, span_offsets, span_starts, span_versions = labels
    n = len(mask)
    if n_weights > 0 and (len(weights[0]) != n or len(weights[1]) != n or len(weights[2]) != n):
        raise ValueError("sample_cuts: a weight array and the mask differ in length")
    if len(span_starts) != len(span_versions):
        raise ValueError("sample_cuts: span starts and versions differ in length")
    total = end = 0
    for s in samples:
        if s < 0 or s + 1 >= len(pos_off) or s >= len(kinds):
            raise IndexError("sample_cuts: a sample index beyond the position offsets")
        a, b = pos_off[s], pos_off[s + 1]
        if a < end or b < a or b > n:
            raise ValueError("sample_cuts: position offsets out of order or beyond the arrays")
        if kinds[s] == 2 and len(tokens) != n:
            raise ValueError("sample_cuts: token_versions and mask differ in length")
        spans_out = s + 1 >= len(span_offsets) or not 0 <= span_offsets[s] <= span_offsets[s + 1]
        if kinds[s] == 1 and (spans_out or span_offsets[s + 1] > len(span_starts)):
            raise ValueError("sample_cuts: span offsets out of order or beyond the spans")
        end = b
        total += b - a
    return total


def _grown(values: IntArray, used: int, capacity: int) -> IntArray:  # pragma: no cover - compiled
    wider = np.empty(capacity, dtype=values.dtype)
    wider[:used] = values[:used]
    return wider


def _token_sample(
    tok: npt.NDArray[Any], m: npt.NDArray[Any], a: int, k: int, out: tuple[IntArray, IntArray, IntArray]
) -> tuple[int, int]:  # pragma: no cover - compiled
    """Cut one sample labelled per position into ``out`` from cut ``k``; next cut, labels < -1."""
    starts, labels, labelled = out
    length = len(tok)
    starts[k] = a
    cut_label = np.int64(tok[0])  # -1: none yet (leading -1 positions join the first label)
    count = 1 if cut_label >= 0 else 0
    below = 1 if cut_label < -1 else 0
    i = 1
    while i < length:
        end = min(i + _BLOCK, length)
        # Does anything cut in this block (one vector pass over slices)? Mostly not: then count.
        block_tok = tok[i:end]
        block_mask = m[i:end]
        before_mask = m[i - 1 : end - 1]
        cuts = block_labelled = block_below = 0
        for q in range(end - i):
            t = np.int64(block_tok[q])
            is_labelled = t >= 0
            cuts += (block_mask[q] != before_mask[q]) | (is_labelled & (t != cut_label))
            block_labelled += is_labelled
            block_below += t < -1
        if cuts == 0:
            count += block_labelled
            below += block_below
            i = end
            continue
        # Walk to the block's first cut (no branch on whether a position is labelled), cut there.
        q = i
        while (m[q] == m[q - 1]) & (((tok[q] ^ cut_label) & ~(np.int64(tok[q]) >> 63)) == 0):
            count += tok[q] >= 0
            below += tok[q] < -1
            q += 1
        t = np.int64(tok[q])
        below += t < -1
        if m[q] != m[q - 1]:  # the mask changes (NaN differs from everything, as numpy's !=)
            labels[k] = cut_label
            labelled[k] = count
            k += 1
            starts[k] = a + q
            cut_label = np.int64(-1)
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
    return k + 1, below


def _span_sample(
    span_starts: IntArray,
    span_versions: IntArray,
    m: npt.NDArray[Any],
    a: int,
    k: int,
    out: tuple[IntArray, IntArray, IntArray],
) -> int:  # pragma: no cover - compiled
    """Cut one sample labelled by version spans into ``out`` from cut ``k``; the next cut."""
    starts, labels, labelled = out
    length = len(m)
    n_spans = len(span_starts)
    j = 0
    label = np.int64(-1)
    if n_spans and span_starts[0] == 0:
        label = span_versions[0]
        j = 1
    starts[k] = a
    cut_start = 0
    q = 1
    while q < length:
        seg_end = length
        if j < n_spans:
            seg_end = span_starts[j]
            if seg_end < q or seg_end >= length:
                raise ValueError("sample_cuts: span starts out of order or beyond their sample")
        while q < seg_end:  # the mask changes before the next span: a block at a time, mostly none
            end = min(q + _BLOCK, seg_end)
            block_mask = m[q:end]
            before_mask = m[q - 1 : end - 1]
            changes = 0
            for i in range(end - q):
                changes += block_mask[i] != before_mask[i]
            if changes == 0:
                q = end
                continue
            while m[q] == m[q - 1]:  # (NaN differs from everything, as numpy's !=)
                q += 1
            labels[k] = label
            labelled[k] = q - cut_start if label >= 0 else 0
            k += 1
            starts[k] = a + q
            cut_start = q
            q += 1
        if q == seg_end and j < n_spans:  # the next span begins: a cut with its label
            labels[k] = label
            labelled[k] = q - cut_start if label >= 0 else 0
            label = span_versions[j]
            j += 1
            k += 1
            starts[k] = a + q
            cut_start = q
            q += 1
    if j < n_spans:
        raise ValueError("sample_cuts: span starts out of order or beyond their sample")
    labels[k] = label
    labelled[k] = length - cut_start if label >= 0 else 0
    return k + 1


_CUTTERS = (_checked_positions, _grown, _span_bits, _cut_flags, _token_sample, _span_sample)
_CUT_CALLEES: dict[str, tuple[Any, Mapping[str, Any]]] = {f.__name__: (f, {}) for f in _CUTTERS}


@CompiledLoop(callees=_CUT_CALLEES)
def _sample_cuts(
    labels: tuple[npt.NDArray[np.int8], npt.NDArray[Any], IntArray, IntArray, IntArray],
    mask: npt.NDArray[Any],
    pos_off: IntArray,
    samples: IntArray,
    weights: tuple[npt.NDArray[Any], ...],
    n_weights: int,
    bits: tuple[np.uint64, np.uint64],
) -> tuple[IntArray, IntArray, IntArray, IntArray, npt.NDArray[np.uint8], int]:  # pragma: no cover
    total = _checked_positions(labels, mask, pos_off, samples, weights, n_weights)
    kinds, tokens, span_offsets, span_starts, span_versions = labels
    sign, infinity = bits
    # Outputs sized by the cuts, not the positions (page faults), doubled when short
    capacity = min(total + 1, max(64, 8 * len(samples)))
    starts = np.empty(capacity, dtype=np.int64)
    ends = np.empty_like(starts)
    cut_labels = np.empty_like(starts)
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
            ends = _grown(ends, k, capacity)
            cut_labels = _grown(cut_labels, k, capacity)
            labelled = _grown(labelled, k, capacity)
            wider = np.empty((n_weights, capacity), dtype=np.uint8)
            wider[:, :k] = flags[:, :k]
            flags = wider
        first_cut = k
        m = mask[a : a + length]  # slices: in bounds (checked above), no negative-index fix-up
        out = (starts, cut_labels, labelled)
        if kinds[s] == 2:
            k, seen = _token_sample(tokens[a : a + length], m, a, k, out)
            below += seen
        else:
            first, last = (span_offsets[s], span_offsets[s + 1]) if kinds[s] == 1 else (0, 0)
            k = _span_sample(span_starts[first:last], span_versions[first:last], m, a, k, out)
        for c in range(first_cut, k - 1):
            ends[c] = starts[c + 1]
        ends[k - 1] = a + length
        if n_weights > 0:
            _cut_flags(weights, n_weights, (starts, ends, first_cut, k), flags, sign, infinity)
    found = (starts[:k].copy(), ends[:k].copy(), cut_labels[:k].copy(), labelled[:k].copy())
    return found[0], found[1], found[2], found[3], flags[:, :k].copy(), below


def _comparable_mask(mask: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The mask in a dtype the loop compares as numpy does (float16, long double, a byte order not
    the machine's: run numbers)."""
    if mask.dtype.isnative and (mask.dtype.kind in "biu" or mask.dtype in (np.float32, np.float64)):
        return mask
    runs = np.zeros(len(mask), dtype=np.int64)
    np.cumsum(mask[1:] != mask[:-1], out=runs[1:])
    return runs


def _weight_bits(
    weights: Sequence[npt.NDArray[Any]], mask: npt.NDArray[Any]
) -> tuple[tuple[npt.NDArray[Any], ...], tuple[np.uint64, np.uint64]]:
    """The weight arrays as three contiguous arrays of one float dtype's bits, and its sign and +inf
    bits (other dtypes copied to the widest float given)."""
    floats = [w.dtype for w in weights if w.dtype in _FLOAT_BITS]
    dtype: np.dtype[Any] = np.dtype(np.float64 if floats else np.float32)
    if not weights:  # (empty arrays of the mask's width: the loop compiled for that dtype serves)
        dtype = np.dtype(np.float64 if mask.dtype == np.float64 else np.float32)
        return (np.zeros(0, dtype=UNSIGNED_OF_SIZE[dtype.itemsize]),) * 3, _FLOAT_BITS[dtype]
    if len(floats) == len(weights):
        dtype = max(floats, key=lambda d: d.itemsize)
    unsigned = UNSIGNED_OF_SIZE[dtype.itemsize]
    views = tuple(np.ascontiguousarray(w, dtype=dtype).view(unsigned) for w in weights)
    return views + (views[0],) * (3 - len(views)), _FLOAT_BITS[dtype]


class Cuts(NamedTuple):
    """Per cut its range, label, labelled positions and ``WEIGHT_*`` bits; labels below -1 seen."""

    starts: IntArray
    ends: IntArray
    labels: IntArray
    labelled: IntArray
    flags: npt.NDArray[np.uint8]
    below: int


class SampleLabels(NamedTuple):
    """How the samples label their positions (``kinds``: ``LABELS_*``); absent arrays empty."""

    kinds: npt.NDArray[np.int8]
    tokens: npt.NDArray[np.signedinteger[Any]]
    span_offsets: IntArray
    span_starts: IntArray
    span_versions: IntArray


def sample_cuts(
    labels: SampleLabels,
    mask: npt.NDArray[Any],
    pos_off: IntArray,
    samples: IntArray,
    weights: Sequence[npt.NDArray[Any]] = (),
) -> Cuts:
    """The cuts of the (increasing) ``samples``: ranges of one mask value and one version label (a
    ``-1`` position never starts one) that tile each sample, with the ``WEIGHT_*`` bits of each of
    ``weights`` per cut (``NONZERO``: not +-0.0, NaN included; ``NOT_POSITIVE``: not > 0)."""
    samples = np.ascontiguousarray(samples, dtype=np.int64)
    if len(weights) > 3:
        raise ValueError("sample_cuts: at most three weight arrays")
    views, bits = _weight_bits(weights, mask)
    # (a plain tuple of the labels: numba types it faster than a named one)
    cut = partial(_sample_cuts, tuple(labels), _comparable_mask(mask), pos_off)
    if len(samples) < 2 or len(mask) < PARALLEL_MIN_POSITIONS:
        return Cuts(*cut(samples, views, len(weights), bits))
    # shares of about equal positions, in parallel (the offsets are checked in each share)
    ends = np.clip(pos_off[np.clip(samples + 1, 0, len(pos_off) - 1)], 0, None)
    edges = np.unique(np.searchsorted(ends, np.linspace(0, ends[-1], num=SHARES + 1)[1:-1], "left"))
    bounds = [0, *(int(e) + 1 for e in edges if 0 <= e < len(samples) - 1), len(samples)]
    shares = [samples[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    parts = run_all([partial(cut, share, views, len(weights), bits) for share in shares], len(mask))
    starts, ends, cut_labels, labelled = (np.concatenate([p[i] for p in parts]) for i in range(4))
    flags = np.concatenate([p[4] for p in parts], axis=1)
    return Cuts(starts, ends, cut_labels, labelled, flags, sum(p[5] for p in parts))


_NO_SPANS = np.zeros(0, dtype=np.int64)


@dataclass
class SpanTable:
    """Spans of one batch plus the per-sample and per-rollout facts derived from them."""

    sample: IntArray  # per span (a cut, or one part of a mixed cut)
    lo: IntArray  # absolute positions in the batch's flat arrays, [lo, hi)
    hi: IntArray
    label: IntArray  # -1 = unlabelled
    version: IntArray  # effective version: the label, or the rollout's dispatch version
    part: npt.NDArray[np.int8]  # spans.PART_WHOLE, or which part of a mixed cut it holds
    sampled: IntArray  # positions with mask 1 as the sample arrived
    live: BoolArray  # some sampled position carries a loss weight
    span_offsets: IntArray  # per sample
    n_sampled: IntArray
    n_unlabelled: IntArray
    unmaskable: BoolArray  # a weight on a mask-0 position: never masked, so always trainable
    had_train: BoolArray
    max_label: IntArray  # newest label on any position (-1: none), for the ship-time bound check
    max_sampled_version: IntArray  # NO_VERSION_LOW when the sample has no sampled position
    seq_min_version: IntArray  # xtuner's sequence version; NO_VERSION_HIGH when none
    completion: IntArray = field(default_factory=lambda: _NO_SPANS)  # per rollout (build_spans)


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
    s = r = 0
    for c in range(cuts):
        if not kept[c]:
            continue
        a = lo[c]
        # the sample holding the cut (cuts come in order)
        while s + 1 < n_samples and pos_off[s + 1] <= a:
            s += 1
        width = hi[c] - a
        n_labelled = labelled[c]
        mixed = (n_labelled > 0) & (n_labelled < width)
        # One row per cut; a mixed cut's labelled part, then its unlabelled part (spans.PART_*).
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
    """Per cut flags (``side``: a weight on an unsampled cut)."""

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
) -> SpanTable:
    """The rows of a span table from the cuts, in one pass (a mixed cut: its labelled part, then its
    unlabelled part), and the per-sample reductions (``no_version``: their low and high values)."""
    as_int = partial(np.ascontiguousarray, dtype=np.int64)
    as_bool = partial(np.ascontiguousarray, dtype=np.bool_)
    return SpanTable(*_span_rows(
        (as_int(lo), as_int(hi), as_int(label), as_int(labelled)), tuple(as_bool(f) for f in flags), as_int(pos_off),
        as_int(dispatch), int(no_version[0]), int(no_version[1]),
    ))  # fmt: skip
