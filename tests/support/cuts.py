"""Test helpers over the engine's cut and segment passes (the package itself never calls them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from staleness_metrics.engine.cuts import Cuts, SampleLabels, sample_cuts
from staleness_metrics.engine.segments import IntArray

_NO_SPANS = np.zeros(0, dtype=np.int64)


def token_spans(
    tokens: npt.NDArray[np.signedinteger[Any]],
    mask: npt.NDArray[Any],
    pos_off: IntArray,
    samples: IntArray,
    weights: Sequence[npt.NDArray[Any]] = (),
) -> Cuts:
    """:func:`sample_cuts` of ``samples`` labelled per position by ``tokens``."""
    kinds = np.full(max(len(pos_off) - 1, 0), 2, dtype=np.int8)
    labels = SampleLabels(kinds, tokens, _NO_SPANS, _NO_SPANS, _NO_SPANS)
    return sample_cuts(labels, mask, pos_off, samples, weights)


def segment_min(values: IntArray, offsets: IntArray, empty: int) -> IntArray:
    """The minimum of each segment (``empty`` for an empty one), a segment at a time."""
    out = np.full(len(offsets) - 1, empty, dtype=np.int64)
    for i, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if hi > lo:
            out[i] = values[lo:hi].min()
    return out
