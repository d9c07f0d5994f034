"""The positions of a ship, for what needs more than spans: the lag of every shipped
position (handed to a trainer in another process) and the SPEC 11 sums from
log-probabilities the records carry.

The sink describes a ship by its spans (runs of one version inside one sample, wholly sampled or
not); this module finds a ship's spans and expands them to positions only when asked, in one
vectorised pass per chunk.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from functools import cached_property, partial
from itertools import repeat
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop
from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..records.columnar import RolloutBatch
from .decision import Judgement
from .queue import RolloutQueue
from .segments import distinct, expand_ranges
from .spans import SampleSpans, SpanRanges

__all__ = ["NOT_SAMPLED", "ShippedRows", "ShippedSpans", "shipped_rows", "shipped_spans"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# the lag of a position outside SPEC 11's population (mask 0 as arrived, or frozen)
NOT_SAMPLED = -1


class ShippedSpans:
    """The spans of a ship's kept samples, in ship order (rollouts, then samples, then positions).

    ``lag`` is ``T - version`` for sampled positions of live rollouts and :data:`NOT_SAMPLED`
    otherwise; ``masked`` says the policy masked the span; ``chunk`` indexes ``batches``;
    ``sample_offsets`` groups the spans per shipped sample. A span of a ``token_versions`` sample
    may hold scattered unlabelled positions (``mixed``): ``lag`` and ``masked`` are then its
    labelled positions', ``unlabelled_lag`` and ``unlabelled_masked`` those of its positions whose
    token version is -1; ``env`` is the env index of each span's rollout (the sink's numbering).

    The spans are found on first use (``find``: one compiled pass over what the ship read), so a
    ship whose lags and log-probability sums nobody asks for never pays for them.
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
        """For mixed spans among ``rows``: the indices (into the concatenation of ``rows``'
        positions) of their unlabelled positions, and the row (index into ``rows``) of each."""
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
        """The lag of every shipped position, aligned with the shipped
        samples' arrays concatenated."""
        return self._per_position(np.arange(len(self.lo)))[0]

    def lag_offsets(self) -> IntArray:
        """Where each shipped sample starts in :meth:`lags` (one more entry than samples)."""
        lengths = np.concatenate(([0], np.cumsum(self.hi - self.lo)))
        return lengths[self.sample_offsets]

    def carries_trainer_logprobs(self) -> bool:
        """Whether a batch of a shipped span carries the trainer's
        log-probabilities (SPEC 11's sums)."""
        absent = sum(map(operator.is_, map(attrgetter("trainer_logprobs"), self.batches), repeat(None)))
        if absent == len(self.batches):  # (no span needs finding to say no)
            return False
        return any(self.batches[c].trainer_logprobs is not None for c in distinct(self.chunk))

    def mismatch(self, band: tuple[float, float], env: int | None = None) -> MismatchSums:
        """SPEC 11 sums over the sampled positions of live rollouts, from the records'
        log-probabilities; of the rollouts of one env (the sink's index) when ``env`` is given."""
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
    """``name`` at ``positions``; NaN (missing) where the array or the sample's
    copy of it is absent."""
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
    batch: RolloutBatch,
    lo: IntArray,
    hi: IntArray,
    lag: IntArray,
    masked: BoolArray,
    band: tuple[float, float],
) -> MismatchSums:
    """Sums over the positions of spans ``[lo, hi)`` of one batch; ``lag`` and
    ``masked`` per position."""
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
    """The spans of the shipped, kept samples in ship order, with each one's lag (SPEC 11): one
    compiled pass over the shipped samples' span rows (:func:`shipped_rows`)."""
    s, n = queue.samples, queue.spans
    chunks = queue.rollouts.chunk[shipped.rows]
    used = distinct(chunks)
    batches = list(queue.batches_of(used).values())
    sample_rows, table = shipped.sample_rows, (s.span_lo, s.span_hi, n.part, n.lo, n.hi)

    def find() -> ShippedRows:
        # (table columns as they were at the ship: rows are only ever appended
        # to them, never rewritten)
        span_lo, span_hi, part, lo, hi = table
        # each rollout's chunk as an index into ``batches`` (one batch: the
        # usual ship between two adds)
        chunk_index = np.zeros(len(chunks), dtype=np.int64) if len(used) == 1 else np.searchsorted(used, chunks)
        return shipped_rows(
            SampleSpans(span_lo[sample_rows], span_hi[sample_rows], shipped.sample_rollout), SpanRanges(part, lo, hi),
            shipped.version, shipped.sampled, (~shipped.dropped, shipped.mask_below),
            (shipped.frozen, chunk_index, shipped.env), shipped.trained_version,
        )  # fmt: skip

    return ShippedSpans(batches, find)


class ShippedRows(NamedTuple):
    """The kept span rows of a ship as :func:`shipped_rows` writes them (see
    ``shipped_positions.ShippedSpans``)."""

    chunk: IntArray
    lo: IntArray
    hi: IntArray
    lag: IntArray
    masked: BoolArray
    sample_offsets: IntArray
    mixed: BoolArray
    unlabelled_lag: IntArray
    unlabelled_masked: BoolArray
    env: IntArray


@CompiledLoop
def _shipped_rows(
    samples: tuple[IntArray, IntArray, IntArray],
    table: tuple[npt.NDArray[np.int8], IntArray, IntArray],
    version: IntArray,
    sampled: IntArray,
    per_sample: tuple[BoolArray, IntArray],
    per_rollout: tuple[BoolArray, IntArray, IntArray],
    trained: int,
    not_sampled: int,
) -> tuple[Any, ...]:  # pragma: no cover - compiled
    span_lo, span_hi, sample_rollout = samples
    part, table_lo, table_hi = table
    kept_sample, mask_below = per_sample
    frozen, rollout_chunk, rollout_env = per_rollout
    n_samples = len(span_lo)
    if len(span_hi) != n_samples or len(kept_sample) != n_samples or len(sample_rollout) != n_samples:
        raise ValueError("shipped_rows: the sample arrays differ in length")
    if len(mask_below) != n_samples:
        raise ValueError("shipped_rows: the sample arrays differ in length")
    n_rollouts = len(frozen)
    if len(rollout_chunk) != n_rollouts or len(rollout_env) != n_rollouts:
        raise ValueError("shipped_rows: the rollout arrays differ in length")
    table_rows = len(part)
    if len(table_lo) != table_rows or len(table_hi) != table_rows:
        raise ValueError("shipped_rows: the span table's columns differ in length")
    n = 0
    # checked before any read: the rows, samples and rollouts named exist
    for k in range(n_samples):
        if not (0 <= span_lo[k] <= span_hi[k] <= table_rows):
            raise IndexError("shipped_rows: a sample's span rows outside the span table")
        if not (0 <= sample_rollout[k] < n_rollouts):
            raise IndexError("shipped_rows: a sample of no rollout")
        n += span_hi[k] - span_lo[k]
    if len(version) != n or len(sampled) != n:
        raise ValueError("shipped_rows: one version and one sampled count per span row expected")
    # Per row (in judgement order): lag and masked flag, read by a row and by the
    # labelled part before it.
    lag = np.empty(n, dtype=np.int64)
    masked = np.empty(n, dtype=np.bool_)
    n_kept = 0
    kept_samples = 0
    i = 0
    for k in range(n_samples):
        rollout = sample_rollout[k]
        live = not frozen[rollout]
        for r in range(span_lo[k], span_hi[k]):
            lag[i] = trained - version[i] if live and sampled[i] > 0 else not_sampled
            masked[i] = version[i] < mask_below[k]
            # a mixed span once, by its first row (spans.PART_*)
            n_kept += kept_sample[k] and part[r] != 2
            i += 1
        kept_samples += kept_sample[k]
    chunk = np.empty(n_kept, dtype=np.int64)
    lo = np.empty(n_kept, dtype=np.int64)
    hi = np.empty(n_kept, dtype=np.int64)
    out_lag = np.empty(n_kept, dtype=np.int64)
    out_masked = np.empty(n_kept, dtype=np.bool_)
    mixed = np.empty(n_kept, dtype=np.bool_)
    unlabelled_lag = np.empty(n_kept, dtype=np.int64)
    unlabelled_masked = np.empty(n_kept, dtype=np.bool_)
    env = np.empty(n_kept, dtype=np.int64)
    sample_offsets = np.zeros(kept_samples + 1, dtype=np.int64)
    last = max(n - 1, 0)
    i = 0
    j = 0
    kept_k = 0
    for k in range(n_samples):
        rollout = sample_rollout[k]
        for r in range(span_lo[k], span_hi[k]):
            if kept_sample[k] and part[r] != 2:
                partner = min(i + 1, last)  # the unlabelled part follows its labelled part
                chunk[j] = rollout_chunk[rollout]
                lo[j] = table_lo[r]
                hi[j] = table_hi[r]
                out_lag[j] = lag[i]
                out_masked[j] = masked[i]
                mixed[j] = part[r] == 1
                unlabelled_lag[j] = lag[partner]
                unlabelled_masked[j] = masked[partner]
                env[j] = rollout_env[rollout]
                j += 1
            i += 1
        if kept_sample[k]:
            kept_k += 1
            sample_offsets[kept_k] = j
    return (
        chunk,
        lo,
        hi,
        out_lag,
        out_masked,
        sample_offsets,
        mixed,
        unlabelled_lag,
        unlabelled_masked,
        env,
    )


def shipped_rows(
    samples: SampleSpans,
    table: SpanRanges,
    version: IntArray,
    sampled: IntArray,
    per_sample: tuple[BoolArray, IntArray],
    per_rollout: tuple[BoolArray, IntArray, IntArray],
    trained: int,
) -> ShippedRows:
    """The span rows of shipped ``samples``, in one pass over their rows of the span ``table``
    (``version`` and ``sampled`` per row in that order); ``per_sample``: whether each is kept,
    and its masking threshold; ``per_rollout``: whether each is frozen, its chunk and its env.
    Each row's lag (``trained - version`` where its rollout is not frozen and it has sampled
    positions, else :data:`NOT_SAMPLED`) and masked flag (``version`` below its sample's
    threshold). Kept are the rows of kept samples that are not an unlabelled part; for each, its
    chunk and env (by its sample's rollout), range, lag, masked flag, whether it is a labelled
    part, the next row's lag and masked flag (a labelled part's unlabelled part), and per kept
    sample the offsets of its kept rows.

    Raises ``ValueError`` on arrays of different lengths, ``IndexError`` on rows
    or rollouts outside them.
    """
    as_int = partial(np.ascontiguousarray, dtype=np.int64)
    as_bool = partial(np.ascontiguousarray, dtype=np.bool_)
    (kept_sample, mask_below), (frozen, rollout_chunk, rollout_env) = per_sample, per_rollout
    found = _shipped_rows(
        (as_int(samples.span_lo), as_int(samples.span_hi), as_int(samples.sample_rollout)),
        (np.ascontiguousarray(table.part, dtype=np.int8), as_int(table.lo), as_int(table.hi)), as_int(version),
        as_int(sampled), (as_bool(kept_sample), as_int(mask_below)),
        (as_bool(frozen), as_int(rollout_chunk), as_int(rollout_env)), int(trained), NOT_SAMPLED,
    )  # fmt: skip
    return ShippedRows(*found)
