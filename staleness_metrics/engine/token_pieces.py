"""The compiled token loops over narrow token versions, a bounded piece at a time.

A long batch keeps its token versions in the dtype the parse gave them (int8 for small versions:
``records.model.pack``), a quarter or an eighth of int64. The compiled loops read int64 versions: a
narrow array is handed to them a piece of at most about :data:`PIECE_POSITIONS` positions at a time,
widened to int64, so the widened copy costs a few MiB whatever the batch's length (and the loops keep
the one specialisation they are compiled for).

A piece of a long sample ends only where the cut loop cuts anyway, or where it would merely continue a
cut with the same label (the two halves are then joined again): at a position ``p`` whose version and
the previous one are both labels (>= 0), or where the mask changes and the version at ``p`` is a label
or -1. There the loop started on ``p`` finds exactly what one pass would, so the cuts, labels, labelled
counts and weight bits (ORs over a cut's positions) are those of one pass. A sample with no such
position (labels below -1 or -1 throughout) is read as one piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .kernels import TokenSpans, token_spans, zero_spans

__all__ = ["PIECE_POSITIONS", "narrow", "token_spans_in_pieces", "zero_spans_in_pieces"]

IntArray = npt.NDArray[np.int64]
PIECE_POSITIONS = 1 << 20  # 8 MiB of int64 versions at once


def narrow(tokens: npt.NDArray[Any] | None) -> bool:
    """Whether ``tokens`` are versions the compiled loops do not read as they are (not int64)."""
    return tokens is not None and tokens.dtype != np.int64


def _piece_ends(tokens: npt.NDArray[Any], mask: npt.NDArray[Any], a: int, b: int, size: int) -> list[int]:
    """Where the pieces of the sample ``[a, b)`` end: after at least half of ``size`` positions, at the
    first position that may start a piece (see the module's docstring); ``b`` last."""
    ends: list[int] = []
    at = a
    half = max(size // 2, 1)
    while b - at > size:
        found = -1
        lo = at + half
        while found < 0 and lo < b:
            hi = min(lo + half, b)
            here = tokens[lo:hi]
            before = tokens[lo - 1 : hi - 1]
            changes = mask[lo:hi] != mask[lo - 1 : hi - 1]
            may_start = ((here >= 0) & (before >= 0)) | (changes & (here >= -1))
            hits = np.flatnonzero(may_start)
            if len(hits):
                found = lo + int(hits[0])
            lo = hi
        if found < 0:
            break
        ends.append(found)
        at = found
    ends.append(b)
    return ends


def token_spans_in_pieces(
    tokens: npt.NDArray[Any],
    mask: npt.NDArray[Any],
    pos_off: IntArray,
    samples: IntArray,
    weights: Sequence[npt.NDArray[Any]] = (),
    size: int | None = None,
) -> TokenSpans:
    """:func:`~staleness_metrics.engine.kernels.token_spans` of narrow ``tokens``, the same result
    (``size``: positions widened at once, :data:`PIECE_POSITIONS` by default)."""
    size = size or PIECE_POSITIONS
    samples = np.asarray(samples, dtype=np.int64)
    if len(samples) and (int(samples.min()) < 0 or int(samples.max()) + 1 >= len(pos_off)):
        raise IndexError("token_cuts: a sample index beyond the position offsets")
    # Pieces (start, end, joins the cut before it), in sample order.
    pieces: list[tuple[int, int, bool]] = []
    for s in samples.tolist():
        a, b = int(pos_off[s]), int(pos_off[s + 1])
        start = a
        for end in _piece_ends(tokens, mask, a, b, size):
            joins = (
                start > a
                and mask[start] == mask[start - 1]
                and int(tokens[start]) == int(tokens[start - 1])
                and int(tokens[start]) >= 0
            )
            pieces.append((start, end, joins))
            start = end
    found: list[TokenSpans] = []
    first_of_piece: list[IntArray] = []  # per cut found, whether it starts a piece that joins the cut before
    at = 0
    while at < len(pieces):  # consecutive pieces read together, up to about ``size`` positions from the first
        lo = pieces[at][0]
        until = at + 1
        while until < len(pieces) and pieces[until][1] - lo <= size:
            until += 1
        group = pieces[at:until]
        hi = group[-1][1]
        offsets = np.array([p for start, end, _ in group for p in (start - lo, end - lo)], dtype=np.int64)
        part = token_spans(
            tokens[lo:hi].astype(np.int64),
            mask[lo:hi],
            offsets,
            np.arange(0, 2 * len(group), 2, dtype=np.int64),
            [w[lo:hi] for w in weights],
        )
        found.append(part._replace(starts=part.starts + lo))
        piece_of_cut = np.searchsorted(offsets[0::2], part.starts, "right") - 1
        joins = np.array([j for _, _, j in group], dtype=bool)
        first = np.zeros(len(part.starts), dtype=bool)
        first[1:] = piece_of_cut[1:] != piece_of_cut[:-1]
        if len(first):
            first[0] = True
        first_of_piece.append(first & joins[piece_of_cut])
        at = until
    if not found:  # no sample: what the loop gives for none
        none = np.zeros(0, dtype=np.int64)
        return token_spans(none, mask[:0], np.zeros(1, dtype=np.int64), samples, [w[:0] for w in weights])
    starts = np.concatenate([p.starts for p in found])
    labels = np.concatenate([p.labels for p in found])
    labelled = np.concatenate([p.labelled for p in found])
    flags = np.concatenate([p.flags for p in found], axis=1)
    below = sum(p.below for p in found)
    merged = np.concatenate(first_of_piece)
    if not merged.any():
        return TokenSpans(starts, labels, labelled, flags, below)
    keep = np.flatnonzero(~merged)  # each cut joined to the one before it: counts add up, bits OR
    return TokenSpans(
        starts[keep],
        labels[keep],
        np.add.reduceat(labelled, keep),
        np.bitwise_or.reduceat(flags, keep, axis=1) if len(flags) else flags[:, keep],
        below,
    )


def zero_spans_in_pieces(
    arrays: Sequence[npt.NDArray[Any]],
    tokens: npt.NDArray[Any],
    lo: IntArray,
    hi: IntArray,
    part: npt.NDArray[np.int8],
    count: IntArray,
    size: int | None = None,
) -> None:
    """:func:`~staleness_metrics.engine.kernels.zero_spans` with narrow ``tokens``: whole spans as they are
    (they read no version), the others a range of ``size`` positions at a time with its versions as int64
    (:data:`PIECE_POSITIONS` by default)."""
    size = size or PIECE_POSITIONS
    whole = part == 0
    if whole.any():
        rows = np.flatnonzero(whole)
        zero_spans(arrays, None, lo[rows], hi[rows], part[rows], count[rows])
    rows = np.flatnonzero(~whole & (hi > lo))
    if len(rows) == 0:
        return
    if int(lo[rows].min()) < 0 or int(hi[rows].max()) > len(tokens):
        raise IndexError("zero_spans: a span lies outside the arrays")
    first = lo[rows] // size
    last = (hi[rows] - 1) // size
    repeats = last - first + 1
    row = np.repeat(rows, repeats)
    index = np.arange(len(row)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
    window = np.repeat(first, repeats) + index
    order = np.argsort(window, kind="stable")
    windows, bounds = np.unique(window[order], return_index=True)
    for w, a, b in zip(windows.tolist(), bounds.tolist(), [*bounds[1:].tolist(), len(order)], strict=True):
        these = order[a:b]
        base = w * size
        end = min(base + size, len(tokens))
        r = row[these]
        zero_spans(
            [values[base:end] for values in arrays],
            tokens[base:end].astype(np.int64),
            np.maximum(lo[r], base) - base,
            np.minimum(hi[r], end) - base,
            part[r],
            count[r],
        )
