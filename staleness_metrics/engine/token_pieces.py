"""The compiled token loops over narrow token versions, a bounded piece at a time.

A long batch keeps its token versions in the dtype the parse gave them (int8 for small versions:
``records.model.pack``), a quarter or an eighth of int64. The compiled loops read int64 versions: a
narrow array is handed to them a piece of at most about :data:`PIECE_POSITIONS` positions at a time,
widened to int64, so the widened copy costs a few MiB whatever the batch's length (and the loops keep
the one specialisation they are compiled for).

A piece of a long sample starts on a version that is a label or -1 (never on a label below -1). Where
the mask changes there, one pass cuts there too. Elsewhere one pass was in a cut (label ``L``) when the
piece began one (label ``F``, the first label it met): the two are one cut (labelled counts add up,
weight bits OR: each bit says "some position of the cut") unless ``L`` and ``F`` are different labels;
then one pass cuts where ``F`` first appears, and the unlabelled positions before it (with their weight
bits) join the cut before. So the cuts, labels, labelled counts, weight bits and labels below -1 are
one pass's. A sample with no version >= -1 to start a piece on is read as one piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .cuts import TokenSpans, token_spans, weight_flags

__all__ = ["PIECE_POSITIONS", "narrow", "token_spans_in_pieces"]

IntArray = npt.NDArray[np.int64]
PIECE_POSITIONS = 1 << 20  # 8 MiB of int64 versions at once


def narrow(tokens: npt.NDArray[Any] | None) -> bool:
    """Whether ``tokens`` are versions the compiled loops do not read as they are (not int64)."""
    return tokens is not None and tokens.dtype != np.int64


def _piece_ends(tokens: npt.NDArray[Any], a: int, b: int, size: int) -> list[int]:
    """Where the pieces of the sample ``[a, b)`` end: after at least half of ``size`` positions, at the
    first version that is a label or -1 (a piece never starts on a label below -1); ``b`` last."""
    ends: list[int] = []
    at = a
    half = max(size // 2, 1)
    while b - at > size:
        found = -1
        lo = at + half
        while found < 0 and lo < b:
            hi = min(lo + half, b)
            hits = np.flatnonzero(tokens[lo:hi] >= -1)
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
    """:func:`~staleness_metrics.engine.cuts.token_spans` of narrow ``tokens``, the same result
    (``size``: positions widened at once, :data:`PIECE_POSITIONS` by default)."""
    size = size or PIECE_POSITIONS
    samples = np.asarray(samples, dtype=np.int64)
    if len(samples) and (int(samples.min()) < 0 or int(samples.max()) + 1 >= len(pos_off)):
        raise IndexError("token_cuts: a sample index beyond the position offsets")
    # Pieces (start, end, whether it continues its sample where the mask does not change), in sample order.
    pieces: list[tuple[int, int, bool]] = []
    for s in samples.tolist():
        a, b = int(pos_off[s]), int(pos_off[s + 1])
        start = a
        for end in _piece_ends(tokens, a, b, size):
            pieces.append((start, end, start > a and not bool(mask[start] != mask[start - 1])))
            start = end
    found: list[TokenSpans] = []
    cut_ends: list[IntArray] = []  # where each cut found ends (the next one's start, or its piece's end)
    continues: list[IntArray] = []  # per cut found, whether it starts a piece that continues its sample
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
        first = np.ones(len(part.starts), dtype=bool)
        first[1:] = piece_of_cut[1:] != piece_of_cut[:-1]
        continues.append(first & np.array([c for _, _, c in group], dtype=bool)[piece_of_cut])
        next_start = np.append(part.starts[1:], hi - lo)
        cut_ends.append(np.minimum(next_start, offsets[1::2][piece_of_cut]) + lo)
        at = until
    if not found:  # no sample: what the loop gives for none
        none = np.zeros(0, dtype=np.int64)
        return token_spans(none, mask[:0], np.zeros(1, dtype=np.int64), samples, [w[:0] for w in weights])
    starts = np.concatenate([p.starts for p in found])
    labels = np.concatenate([p.labels for p in found])
    labelled = np.concatenate([p.labelled for p in found])
    flags = np.concatenate([p.flags for p in found], axis=1)
    below = sum(p.below for p in found)
    ends = np.concatenate(cut_ends)
    keep = np.ones(len(starts), dtype=bool)
    head = -1  # the cut that the positions before the current one belong to, in one pass
    for i in np.flatnonzero(np.concatenate(continues)).tolist():
        # The piece starting at cut i began on a version >= -1 with the mask unchanged. One pass would
        # have been in the cut before it (label ``before``); the piece began a cut with label ``after``.
        head = i - 1 if keep[i - 1] else head
        before, after = int(labels[head]), int(labels[i])
        if before >= 0 and after >= 0 and before != after:
            # One pass cuts where ``after`` first appears: the unlabelled positions before it (none when
            # the piece began on it) stay in the cut before, with their weight bits.
            p = int(starts[i])
            q = p + int(np.flatnonzero(tokens[p : int(ends[i])] >= 0)[0])
            if q > p:
                for w, values in enumerate(weights):
                    flags[w, head] |= _bits(values, p, q)
                    flags[w, i] = _bits(values, q, int(ends[i]))
                starts[i] = q
            continue
        # Otherwise one pass runs on: the two are one cut, with the first label found (counts add up,
        # bits OR).
        labels[head] = after if before < 0 and after >= 0 else before
        labelled[head] += labelled[i]
        flags[:, head] |= flags[:, i]
        keep[i] = False
    if keep.all():
        return TokenSpans(starts, labels, labelled, flags, below)
    return TokenSpans(starts[keep], labels[keep], labelled[keep], flags[:, keep], below)


def _bits(values: npt.NDArray[Any], lo: int, hi: int) -> int:
    bits = weight_flags(values, np.array([lo], dtype=np.int64), np.array([hi], dtype=np.int64))
    assert bits is not None  # fusable weights (float16/32/64, contiguous): the compiled pass reads them
    return int(bits[0])
