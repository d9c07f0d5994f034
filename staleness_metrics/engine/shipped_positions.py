"""The positions of a ship, for what needs more than spans: the lag of every shipped position (handed to a
trainer in another process) and the SPEC 11 sums from log-probabilities the records carry.

The sink describes a ship by its spans (runs of one version inside one sample, wholly sampled or not);
this module finds a ship's spans and expands them to positions only when asked, in one vectorised pass per chunk.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from functools import cached_property
from itertools import repeat
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..records.columnar import RolloutBatch
from .decision import Judgement
from .kernels import ShippedRows, shipped_rows
from .queue import RolloutQueue
from .segments import distinct, expand_ranges

__all__ = ["NOT_SAMPLED", "ShippedSpans", "shipped_spans"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NOT_SAMPLED = -1  # the lag of a position outside SPEC 11's population (mask 0 as arrived, or frozen)


class ShippedSpans:
    """The spans of a ship's kept samples, in ship order (rollouts, then samples, then positions).

    ``lag`` is ``T - version`` for sampled positions of live rollouts and :data:`NOT_SAMPLED` otherwise;
    ``masked`` says the policy masked the span; ``chunk`` indexes ``batches``; ``sample_offsets`` groups
    the spans per shipped sample. A span of a ``token_versions`` sample may hold scattered unlabelled
    positions (``mixed``): ``lag`` and ``masked`` are then its labelled positions', ``unlabelled_lag``
    and ``unlabelled_masked`` those of its positions whose token version is -1; ``env`` is the env index of
    each span's rollout (the sink's numbering).

    The spans are found on first use (``find``: one compiled pass over what the ship read), so a ship whose
    lags and log-probability sums nobody asks for never pays for them.
    """

    def __init__(self, batches: Sequence[RolloutBatch], find: Callable[[], ShippedRows]) -> None:
        self.batches = batches
        self._find = find

    @cached_property
    def _rows(self) -> ShippedRows:
        return self._find()

    @property
    def chunk(self) -> IntArray:
        return self._rows.chunk

    @property
    def lo(self) -> IntArray:
        return self._rows.lo

    @property
    def hi(self) -> IntArray:
        return self._rows.hi

    @property
    def lag(self) -> IntArray:
        return self._rows.lag

    @property
    def masked(self) -> BoolArray:
        return self._rows.masked

    @property
    def sample_offsets(self) -> IntArray:
        return self._rows.sample_offsets

    @property
    def mixed(self) -> BoolArray:
        return self._rows.mixed

    @property
    def unlabelled_lag(self) -> IntArray:
        return self._rows.unlabelled_lag

    @property
    def unlabelled_masked(self) -> BoolArray:
        return self._rows.unlabelled_masked

    @property
    def env(self) -> IntArray:
        return self._rows.env

    def _unlabelled(self, rows: IntArray) -> tuple[IntArray, IntArray]:
        """For mixed spans among ``rows``: the indices (into the concatenation of ``rows``' positions)
        of their unlabelled positions, and the row (index into ``rows``) of each."""
        if not self.mixed[rows].any():
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
        """Whether a batch of a shipped span carries the trainer's log-probabilities (SPEC 11's sums)."""
        absent = sum(map(operator.is_, map(attrgetter("trainer_logprobs"), self.batches), repeat(None)))
        if absent == len(self.batches):  # (no span needs finding to say no)
            return False
        return any(self.batches[c].trainer_logprobs is not None for c in distinct(self.chunk))

    def mismatch(self, band: tuple[float, float], env: int | None = None) -> MismatchSums:
        """SPEC 11 sums over the sampled positions of live rollouts, from the records' log-probabilities; of the
        rollouts of one env (the sink's index) when ``env`` is given."""
        total = MismatchSums.zero()
        inside = self.lag >= 0
        if env is not None:
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
    batches = [batch for batch in map(queue.chunks.__getitem__, used) if batch is not None]
    assert len(batches) == len(used)  # a queued rollout's batch is kept
    sample_rows, table = shipped.sample_rows, (s["span_lo"], s["span_hi"], n["part"], n["lo"], n["hi"])

    def find() -> ShippedRows:
        # (table columns as they were at the ship: rows are only ever appended to them, never rewritten)
        span_lo, span_hi, part, lo, hi = table
        # each rollout's chunk as an index into ``batches`` (one batch: the usual ship between two adds)
        chunk_index = np.zeros(len(chunks), dtype=np.int64) if len(used) == 1 else np.searchsorted(used, chunks)
        return shipped_rows(
            span_lo[sample_rows], span_hi[sample_rows], ~shipped.dropped, shipped.sample_rollout, shipped.mask_below,
            shipped.version, shipped.sampled, shipped.frozen, chunk_index, shipped.env, part, lo, hi,
            shipped.trained_version, NOT_SAMPLED,
        )  # fmt: skip

    return ShippedSpans(batches, find)
