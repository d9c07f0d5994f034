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

from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..records.columnar import RolloutBatch
from .decision import Judgement
from .kernels import shipped_rows
from .queue import RolloutQueue
from .segments import distinct, expand_ranges

__all__ = ["NOT_SAMPLED", "ShippedSpans", "shipped_spans"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NOT_SAMPLED = -1  # the lag of a position outside SPEC 11's population (mask 0 as arrived, or frozen)


@dataclass(frozen=True)
class ShippedSpans:
    """The spans of a ship's kept samples, in ship order (rollouts, then samples, then positions).

    ``lag`` is ``T - version`` for sampled positions of live rollouts and :data:`NOT_SAMPLED` otherwise;
    ``masked`` says the policy masked the span; ``chunk`` indexes ``batches``; ``sample_offsets`` groups
    the spans per shipped sample. A span of a ``token_versions`` sample may hold scattered unlabelled
    positions (``mixed``): ``lag`` and ``masked`` are then its labelled positions', ``unlabelled_lag``
    and ``unlabelled_masked`` those of its positions whose token version is -1.
    """

    batches: Sequence[RolloutBatch]
    chunk: IntArray
    lo: IntArray
    hi: IntArray
    lag: IntArray
    masked: BoolArray
    sample_offsets: IntArray
    mixed: BoolArray | None = None
    unlabelled_lag: IntArray | None = None
    unlabelled_masked: BoolArray | None = None
    env: IntArray | None = None  # the env index of each span's rollout (the sink's numbering)

    def _unlabelled(self, rows: IntArray) -> tuple[IntArray, IntArray]:
        """For mixed spans among ``rows``: the indices (into the concatenation of ``rows``' positions)
        of their unlabelled positions, and the row (index into ``rows``) of each."""
        if self.mixed is None or not self.mixed[rows].any():
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(self.hi[rows] - self.lo[rows])))
        found, owners = [], []
        for c in distinct(self.chunk[rows][self.mixed[rows]]):
            tokens = self.batches[c].token_versions
            assert tokens is not None
            local = np.flatnonzero(self.mixed[rows] & (self.chunk[rows] == c))
            positions = expand_ranges(self.lo[rows][local], self.hi[rows][local])
            owner = np.repeat(local, self.hi[rows][local] - self.lo[rows][local])
            where = positions - np.repeat(self.lo[rows][local], self.hi[rows][local] - self.lo[rows][local])
            unlabelled = tokens[positions] < 0
            found.append((starts[owner] + where)[unlabelled])
            owners.append(owner[unlabelled])
        return np.concatenate(found), np.concatenate(owners)

    def _per_position(self, rows: IntArray) -> tuple[IntArray, BoolArray]:
        """Lag and masked flag of every position of ``rows``, in order."""
        lengths = self.hi[rows] - self.lo[rows]
        lag, masked = np.repeat(self.lag[rows], lengths), np.repeat(self.masked[rows], lengths)
        at, owner = self._unlabelled(rows)
        if len(at):
            assert self.unlabelled_lag is not None and self.unlabelled_masked is not None
            lag[at] = self.unlabelled_lag[rows][owner]
            masked[at] = self.unlabelled_masked[rows][owner]
        return lag, masked

    def lags(self) -> IntArray:
        """The lag of every shipped position, aligned with the shipped samples' arrays concatenated."""
        return self._per_position(np.arange(len(self.lo)))[0]

    def lag_offsets(self) -> IntArray:
        """Where each shipped sample starts in :meth:`lags` (one more entry than samples)."""
        lengths = np.concatenate(([0], np.cumsum(self.hi - self.lo)))
        return lengths[self.sample_offsets]

    def carries_trainer_logprobs(self) -> bool:
        return any(self.batches[c].trainer_logprobs is not None for c in distinct(self.chunk))

    def mismatch(self, band: tuple[float, float], env: int | None = None) -> MismatchSums:
        """SPEC 11 sums over the sampled positions of live rollouts, from the records' log-probabilities; of the
        rollouts of one env (the sink's index) when ``env`` is given."""
        total = MismatchSums.zero()
        inside = self.lag >= 0
        if env is not None:
            assert self.env is not None
            inside &= self.env == env
        for c in distinct(self.chunk[inside]):
            rows = np.flatnonzero(inside & (self.chunk == c))
            lag, masked = self._per_position(rows)
            total = total + _chunk_sums(self.batches[c], self.lo[rows], self.hi[rows], lag, masked, band)
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
    """Sums over the positions of spans ``[lo, hi)`` of one batch; ``lag`` and ``masked`` per position."""
    lengths = hi - lo
    positions = expand_ranges(lo, hi)
    return mismatch_sums(
        lag,
        _values(batch, "logprobs", lo, positions, lengths),
        _values(batch, "trainer_logprobs", lo, positions, lengths),
        masked,
        band=band,
    )


def shipped_spans(queue: RolloutQueue, shipped: Judgement) -> ShippedSpans:
    """The spans of the shipped, kept samples in ship order, with each one's lag (SPEC 11): one compiled
    pass over the shipped samples' span rows (:func:`~staleness_metrics.engine.kernels.shipped_rows`)."""
    s, n = queue.samples, queue.spans
    chunks = queue.rollouts["chunk"][shipped.rows]
    used = distinct(chunks)
    batches: list[RolloutBatch] = []
    for c in used:
        batch = queue.chunks[c]
        assert batch is not None  # a queued rollout's batch is kept
        batches.append(batch)
    # each rollout's chunk as an index into ``batches`` (one batch: the usual ship between two adds)
    chunk_index = np.zeros(len(chunks), dtype=np.int64) if len(used) == 1 else np.searchsorted(used, chunks)
    rows = shipped_rows(
        s["span_lo"][shipped.sample_rows], s["span_hi"][shipped.sample_rows], ~shipped.dropped, shipped.sample_rollout,
        shipped.mask_below, shipped.version, shipped.sampled, shipped.frozen, chunk_index,
        shipped.env, n["part"], n["lo"], n["hi"], shipped.trained_version, NOT_SAMPLED,
    )  # fmt: skip
    return ShippedSpans(
        batches=batches,
        chunk=rows.chunk,
        lo=rows.lo,
        hi=rows.hi,
        lag=rows.lag,
        masked=rows.masked,
        sample_offsets=rows.sample_offsets,
        mixed=rows.mixed,
        unlabelled_lag=rows.unlabelled_lag,
        unlabelled_masked=rows.unlabelled_masked,
        env=rows.env,
    )
