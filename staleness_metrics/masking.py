"""Writing a decision into the position arrays: newly stale sampled positions become 0, in place.

The policy decides per sample a threshold (positions with a version below it are masked); this module
turns the spans that crossed it into writes. Whole spans are plain range fills, merged where they
touch. A mixed span of a token-labelled sample (its scattered ``-1`` positions take the dispatch
version) whose labelled and unlabelled parts fall on different sides of the threshold is written
position by position: the unlabelled positions of a batch are found once and kept while the batch
is in the sink.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .columnar import WEIGHT_FIELDS, RolloutBatch
from .segments import expand_ranges
from .spans import PART_LABELLED, PART_UNLABELLED, PART_WHOLE

__all__ = ["PositionMasker"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

FILL_LOOP_MAX_RUNS = 64  # beyond this many ranges in a batch, one masked write per array beats slicing


def position_arrays(batch: RolloutBatch) -> list[npt.NDArray[Any]]:
    """The mask followed by the weight arrays of a batch (those it has)."""
    return [batch.mask, *(getattr(batch, f) for f in WEIGHT_FIELDS if getattr(batch, f) is not None)]


def touching_runs(chunk: IntArray, lo: IntArray, hi: IntArray) -> list[tuple[int, IntArray, IntArray]]:
    """Per chunk, the ranges ``[lo, hi)`` sorted and merged where one ends where the next begins."""
    if len(lo) == 0:
        return []
    order = np.lexsort((lo, chunk))
    chunk, lo, hi = chunk[order], lo[order], hi[order]
    starts = np.flatnonzero(np.concatenate(([True], (lo[1:] != hi[:-1]) | (chunk[1:] != chunk[:-1]))))
    ends = np.append(starts[1:], len(lo)) - 1
    chunk, lo, hi = chunk[starts], lo[starts], hi[ends]
    bounds = np.flatnonzero(np.concatenate(([True], chunk[1:] != chunk[:-1], [True])))
    return [(int(chunk[a]), lo[a:b], hi[a:b]) for a, b in itertools.pairwise(bounds.tolist())]


class PositionMasker:
    """Zeroes positions of the batches held by a sink (its chunks), by span.

    ``chunks`` is the sink's list of batches (indexed by chunk); the unlabelled positions of a batch
    are a cache, recomputable from its ``token_versions``, dropped with :meth:`forget`.
    """

    def __init__(self) -> None:
        self._unlabelled: dict[int, IntArray] = {}

    def forget(self) -> None:
        """Drop the cache (the sink renumbered or released its chunks)."""
        self._unlabelled.clear()

    def mask(
        self,
        chunks: Sequence[RolloutBatch | None],
        chunk: IntArray,
        lo: IntArray,
        hi: IntArray,
        part: npt.NDArray[np.int8],
        whole: BoolArray,
    ) -> None:
        """Zero the positions of the given span rows: every position of ``[lo, hi)`` where ``whole``,
        else only the positions of the row's part (labelled or unlabelled)."""
        runs = touching_runs(chunk[whole], lo[whole], hi[whole])
        arrays: dict[int, list[npt.NDArray[Any]]] = {}

        def arrays_of(c: int) -> list[npt.NDArray[Any]]:
            if c not in arrays:
                batch = chunks[c]
                assert batch is not None
                arrays[c] = position_arrays(batch)
            return arrays[c]

        # Spans are wholly sampled (mask-0 positions are spans of their own, never hit): one fill per
        # run of touching spans and array, or, for many runs in one batch, one masked write per array.
        for c, starts, ends in runs:
            if len(starts) <= FILL_LOOP_MAX_RUNS:
                for values in arrays_of(c):
                    for a, b in zip(starts.tolist(), ends.tolist()):
                        values[a:b] = 0
                continue
            first, last = int(starts[0]), int(ends[-1])
            gaps = np.append(starts[1:], last) - ends
            covered = np.repeat(
                np.tile(np.array([True, False]), len(starts)), np.stack((ends - starts, gaps), 1).ravel()
            )
            for values in arrays_of(c):
                np.copyto(values[first:last], 0, where=covered)
        partial = np.flatnonzero(~whole)
        if len(partial) == 0:
            return
        for c in np.unique(chunk[partial]).tolist():
            rows = partial[chunk[partial] == c]
            positions = self._part_positions(chunks, c, lo[rows], hi[rows], part[rows])
            for values in arrays_of(c):
                values[positions] = 0

    def _part_positions(
        self, chunks: Sequence[RolloutBatch | None], c: int, lo: IntArray, hi: IntArray, part: npt.NDArray[np.int8]
    ) -> IntArray:
        batch = chunks[c]
        assert batch is not None and batch.token_versions is not None and not (part == PART_WHOLE).any()
        tokens = batch.token_versions
        out = []
        unlabelled = part == PART_UNLABELLED
        if unlabelled.any():
            if c not in self._unlabelled:
                self._unlabelled[c] = np.flatnonzero(tokens < 0)
            where = self._unlabelled[c]
            out.append(
                where[expand_ranges(np.searchsorted(where, lo[unlabelled]), np.searchsorted(where, hi[unlabelled]))]
            )
        labelled = part == PART_LABELLED
        if labelled.any():  # labels older than the dispatch version: rare
            positions = expand_ranges(lo[labelled], hi[labelled])
            out.append(positions[tokens[positions] >= 0])
        return np.concatenate(out)
