"""The positions of a ship, found only when asked: the lag of every shipped position (for a trainer
in another process) and the SPEC 11 sums from the records' log-probabilities."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property, partial
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop
from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..records.columnar import RolloutBatch
from .decision import Judgement
from .queue import RolloutQueue
from .segments import BoolArray, IntArray, distinct, expand_ranges
from .spans import SampleSpans, SpanRanges, as_compiled, check_sample_spans

# the lag of a position outside SPEC 11's population (mask 0 as arrived, or frozen)
NOT_SAMPLED = -1
_LOGPROBS = ("logprobs", "trainer_logprobs")


class ShippedSpans:
    """The spans of a ship's kept samples, found on first use of :attr:`rows`."""

    def __init__(self, batches: Sequence[RolloutBatch], find: Callable[[], ShippedRows]) -> None:
        self.batches = batches
        self._find = find

    @cached_property
    def rows(self) -> ShippedRows:
        return self._find()

    def _per_position(self, rows: IntArray) -> tuple[IntArray, BoolArray]:
        """Lag and masked flag of every position of ``rows``."""
        found = self.rows
        chunk, mixed, lo, hi = found.chunk[rows], found.mixed[rows], found.lo[rows], found.hi[rows]
        lag, masked = np.repeat(found.lag[rows], hi - lo), np.repeat(found.masked[rows], hi - lo)
        if mixed.any():
            starts = np.concatenate(([0], np.cumsum(hi - lo)))
            for c in distinct(chunk[mixed]):
                tokens = self.batches[c].token_versions
                assert tokens is not None
                local = np.flatnonzero(mixed & (chunk == c))
                positions = expand_ranges(lo[local], hi[local])
                owner = np.repeat(local, hi[local] - lo[local])
                unlabelled = tokens[positions] < 0
                at, owner = (starts[owner] + positions - lo[owner])[unlabelled], owner[unlabelled]
                lag[at] = found.unlabelled_lag[rows][owner]
                masked[at] = found.unlabelled_masked[rows][owner]
        return lag, masked

    def lags(self) -> IntArray:
        """The lag of every shipped position, aligned with the shipped samples' arrays."""
        return self._per_position(np.arange(len(self.rows.lo)))[0]

    def lag_offsets(self) -> IntArray:
        """Where each shipped sample starts in :meth:`lags` (one more entry than samples)."""
        lengths = np.concatenate(([0], np.cumsum(self.rows.hi - self.rows.lo)))
        return lengths[self.rows.sample_offsets]

    def carries_trainer_logprobs(self) -> bool:
        """Whether a batch of a shipped span carries the trainer's log-probabilities."""
        if all(batch.trainer_logprobs is None for batch in self.batches):  # (no span to find)
            return False
        return any(self.batches[c].trainer_logprobs is not None for c in distinct(self.rows.chunk))

    def mismatch(self, band: tuple[float, float], env: int | None = None) -> MismatchSums:
        """SPEC 11 sums over the sampled positions of live rollouts (of one env, when given)."""
        total = MismatchSums.zero()
        found = self.rows
        inside = found.lag >= 0
        if env is not None:
            inside &= found.env == env
        for c in distinct(found.chunk[inside]):
            rows = np.flatnonzero(inside & (found.chunk == c))
            lag, masked = self._per_position(rows)
            lo, hi = found.lo[rows], found.hi[rows]
            positions, lengths = expand_ranges(lo, hi), hi - lo
            logprobs, trainer = (_values(self.batches[c], name, lo, positions, lengths) for name in _LOGPROBS)
            total = total + mismatch_sums(lag, logprobs, trainer, masked, band=band)
        return total


def _values(
    batch: RolloutBatch, name: str, lo: IntArray, positions: IntArray, lengths: IntArray
) -> npt.NDArray[np.float64]:
    """``name`` at ``positions``; NaN where the array or the sample's copy of it is absent."""
    values: npt.NDArray[np.float64] | None = getattr(batch, name)
    if values is None:
        return np.full(len(positions), np.nan)
    out = values[positions].astype(np.float64)
    present = batch.present.get(name)
    if present is not None and not present.all():
        sample = np.searchsorted(batch.position_offsets, lo, "right") - 1
        out[~np.repeat(present[sample], lengths)] = np.nan
    return out


def shipped_spans(queue: RolloutQueue, shipped: Judgement) -> ShippedSpans:
    """The spans of the shipped, kept samples in ship order, with each one's lag (SPEC 11)."""
    s, n = queue.samples, queue.spans
    chunks = queue.rollouts.chunk[shipped.rows]
    used = distinct(chunks)
    batches = list(queue.batches_of(used).values())
    sample_rows, table = shipped.sample_rows, (s.span_lo, s.span_hi, n.part, n.lo, n.hi)

    def find() -> ShippedRows:
        span_lo, span_hi, part, lo, hi = table
        chunk_index = np.zeros(len(chunks), dtype=np.int64) if len(used) == 1 else np.searchsorted(used, chunks)
        return shipped_rows(
            SampleSpans(span_lo[sample_rows], span_hi[sample_rows], shipped.sample_rollout), SpanRanges(part, lo, hi),
            shipped.version, shipped.sampled, (~shipped.dropped, shipped.mask_below),
            (shipped.frozen, chunk_index, shipped.env), shipped.trained_version,
        )  # fmt: skip

    return ShippedSpans(batches, find)


class ShippedRows(NamedTuple):
    """The kept span rows of a ship in ship order: ``lag`` is ``T - version`` for sampled positions
    of live rollouts (else :data:`NOT_SAMPLED`); a ``mixed`` row's unlabelled positions have their
    own ``unlabelled_lag`` and ``unlabelled_masked``."""

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


@CompiledLoop(callees={"check_sample_spans": (check_sample_spans, {})})
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
    if len(kept_sample) != n_samples or len(mask_below) != n_samples:
        raise ValueError("shipped_rows: the sample arrays differ in length")
    if len(rollout_chunk) != len(frozen) or len(rollout_env) != len(frozen):
        raise ValueError("shipped_rows: the rollout arrays differ in length")
    n = check_sample_spans(samples, table, version, sampled, len(frozen))
    lag = np.empty(n, dtype=np.int64)
    masked = np.empty(n, dtype=np.bool_)
    n_kept = 0
    kept_samples = 0
    i = 0
    for k in range(n_samples):
        live = not frozen[sample_rollout[k]]
        for r in range(span_lo[k], span_hi[k]):
            lag[i] = trained - version[i] if live and sampled[i] > 0 else not_sampled
            masked[i] = version[i] < mask_below[k]
            n_kept += kept_sample[k] and part[r] != 2  # a mixed span once, by its first row
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
    return (chunk, lo, hi, out_lag, out_masked, sample_offsets, mixed, unlabelled_lag,
            unlabelled_masked, env)  # fmt: skip


def shipped_rows(
    samples: SampleSpans,
    table: SpanRanges,
    version: IntArray,
    sampled: IntArray,
    per_sample: tuple[BoolArray, IntArray],
    per_rollout: tuple[BoolArray, IntArray, IntArray],
    trained: int,
) -> ShippedRows:
    """The rows of kept shipped ``samples``, in one pass (``per_sample``: kept, threshold;
    ``per_rollout``: frozen, chunk, env)."""
    as_int = partial(np.ascontiguousarray, dtype=np.int64)
    as_bool = partial(np.ascontiguousarray, dtype=np.bool_)
    (kept_sample, mask_below), (frozen, rollout_chunk, rollout_env) = per_sample, per_rollout
    per_rollout = (as_bool(frozen), as_int(rollout_chunk), as_int(rollout_env))
    found = _shipped_rows(
        *as_compiled(samples, table), as_int(version), as_int(sampled),
        (as_bool(kept_sample), as_int(mask_below)), per_rollout, int(trained), NOT_SAMPLED,
    )  # fmt: skip
    return ShippedRows(*found)
