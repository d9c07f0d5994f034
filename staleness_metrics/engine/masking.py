"""Writing a decision into the position arrays: newly stale sampled positions become 0, in place.

The policy decides per sample a threshold (positions with a version below it are masked); this module
turns the spans that crossed it into writes. Whole spans are range fills. A mixed span of a
token-labelled sample (its scattered ``-1`` positions take the dispatch version) whose labelled and
unlabelled parts fall on different sides of the threshold has the positions of one part written.
One compiled pass over the masked spans of a batch does both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from .kernels import zero_spans
from .segments import distinct
from .spans import PART_WHOLE
from .token_pieces import narrow, zero_spans_in_pieces

__all__ = ["mask_spans"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def position_arrays(batch: RolloutBatch) -> list[npt.NDArray[Any]]:
    """The mask followed by the weight arrays of a batch (those it has)."""
    return [batch.mask, *(getattr(batch, f) for f in WEIGHT_FIELDS if getattr(batch, f) is not None)]


def mask_spans(
    chunks: Sequence[RolloutBatch | None],
    chunk: IntArray,
    lo: IntArray,
    hi: IntArray,
    part: npt.NDArray[np.int8],
    whole: BoolArray,
    count: IntArray,
) -> None:
    """Zero the positions of the given span rows of the sink's batches (``chunks``, indexed by
    ``chunk``): every position of ``[lo, hi)`` where ``whole``, else only the positions of the row's
    part (labelled or unlabelled), ``count`` positions."""
    part = np.where(whole, PART_WHOLE, part).astype(np.int8)
    used = distinct(chunk)
    for c in used:
        batch = chunks[c]
        assert batch is not None
        tokens = batch.token_versions
        rows = slice(None) if len(used) == 1 else (chunk == c).nonzero()[0]  # (one batch: every row)
        if tokens is not None and narrow(tokens):
            zero_spans_in_pieces(position_arrays(batch), tokens, lo[rows], hi[rows], part[rows], count[rows])
        else:
            zero_spans(position_arrays(batch), tokens, lo[rows], hi[rows], part[rows], count[rows])
