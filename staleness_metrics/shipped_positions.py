"""The positions of a ship, for what needs more than spans: the lag of every shipped position (handed to a
trainer in another process) and the SPEC 11 sums from log-probabilities the records carry.

The sink describes a ship by its spans (runs of one version inside one sample, wholly sampled or not);
this module expands them to positions only when asked, in one vectorised pass per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .columnar import RolloutBatch
from .mismatch import MismatchSums, mismatch_sums
from .segments import expand_ranges

__all__ = ["NOT_SAMPLED", "ShippedSpans"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NOT_SAMPLED = -1  # the lag of a position outside SPEC 11's population (mask 0 as arrived, or frozen)


@dataclass(frozen=True)
class ShippedSpans:
    """The spans of a ship's kept samples, in ship order (rollouts, then samples, then positions).

    ``lag`` is ``T - version`` for sampled positions of live rollouts and :data:`NOT_SAMPLED` otherwise;
    ``masked`` says the policy masked the span; ``chunk`` indexes ``batches``; ``sample_offsets`` groups
    the spans per shipped sample.
    """

    batches: Sequence[RolloutBatch]
    chunk: IntArray
    lo: IntArray
    hi: IntArray
    lag: IntArray
    masked: BoolArray
    sample_offsets: IntArray

    def lags(self) -> IntArray:
        """The lag of every shipped position, aligned with the shipped samples' arrays concatenated."""
        return np.repeat(self.lag, self.hi - self.lo)

    def lag_offsets(self) -> IntArray:
        """Where each shipped sample starts in :meth:`lags` (one more entry than samples)."""
        lengths = np.concatenate(([0], np.cumsum(self.hi - self.lo)))
        return lengths[self.sample_offsets]

    def carries_trainer_logprobs(self) -> bool:
        return any(self.batches[c].trainer_logprobs is not None for c in np.unique(self.chunk).tolist())

    def mismatch(self, band: tuple[float, float]) -> MismatchSums:
        """SPEC 11 sums over the sampled positions of live rollouts, from the records' log-probabilities."""
        total = MismatchSums.zero()
        inside = self.lag >= 0
        for c in np.unique(self.chunk[inside]).tolist():
            here = inside & (self.chunk == c)
            total = total + _chunk_sums(self.batches[c], self.lo[here], self.hi[here], self.lag[here],
                                        self.masked[here], band)  # fmt: skip
        return total


def _values(
    batch: RolloutBatch, name: str, lo: IntArray, positions: IntArray, lengths: IntArray
) -> npt.NDArray[np.float64]:
    """``name`` at ``positions``; NaN (missing) where the array or the sample's copy of it is absent."""
    values: npt.NDArray[np.float64] | None = getattr(batch, name)
    if values is None:
        return np.full(len(positions), np.nan)
    out = values[positions].astype(np.float64)
    present = batch.present.get(name)
    if present is not None and not present.all():
        sample = np.searchsorted(batch.position_offsets, lo, "right") - 1
        out[~np.repeat(present[sample], lengths)] = np.nan
    return out


def _chunk_sums(
    batch: RolloutBatch, lo: IntArray, hi: IntArray, lag: IntArray, masked: BoolArray, band: tuple[float, float]
) -> MismatchSums:
    lengths = hi - lo
    positions = expand_ranges(lo, hi)
    return mismatch_sums(
        np.repeat(lag, lengths),
        _values(batch, "logprobs", lo, positions, lengths),
        _values(batch, "trainer_logprobs", lo, positions, lengths),
        np.repeat(masked, lengths),
        band=band,
    )
