"""What a ship hands back (SPEC 4): the :class:`Shipment`, its rollouts as SPEC 3 records, their
``[B, L]`` view, and when asked its positions' lags and SPEC 11 sums (:class:`ShippedSpans`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop
from ..errors import FieldError, TraceError
from ..metrics.compute import rows_by_key
from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..metrics.report import MetricValue, StepReport
from ..records.columnar import LABELS_SPANS, LABELS_TOKENS, WEIGHT_FIELDS, RolloutBatch
from .decision import Judgement
from .queue import RolloutQueue
from .segments import BoolArray, IntArray, distinct, expand_ranges
from .spans import SampleSpans, SpanRanges, as_compiled, check_sample_spans

Band = tuple[float, float]  # SPEC 11's ratio band


@dataclass(frozen=True)
class ShippedRollout:
    """One shipped rollout: its arrays are views of the arrays it arrived in, masked in place."""

    id: str
    batch: RolloutBatch
    index: int  # rollout index within ``batch``
    samples: tuple[int, ...]  # indices (within the rollout) of the samples shipped

    def record(self, arrays: bool = False) -> dict[str, Any]:
        """The rollout as a SPEC 3 record: masked arrays, dropped samples removed; per-position
        fields are lists, or with ``arrays`` numpy arrays."""
        batch, index = self.batch, self.index
        if batch.echo is not None:
            record = dict(batch.echo[index])
        else:
            record = {"id": self.id}
            for name, values in (("group_id", batch.group_ids), ("env", batch.envs)):
                if values is not None and values[index] is not None:
                    record[name] = values[index]
            assert batch.frozen is not None and batch.agentic is not None and batch.completion_version is not None
            if batch.frozen[index]:
                record["source"] = "frozen"
            if batch.dispatch_version[index] >= 0:
                record["dispatch_version"] = int(batch.dispatch_version[index])
            if batch.completion_version[index] >= 0:
                record["completion_version"] = int(batch.completion_version[index])
            if batch.agentic[index]:
                record["agentic"] = True
        first = int(batch.sample_offsets[index])
        record["samples"] = [_sample_record(batch, first + k, arrays) for k in self.samples]
        return record


def _sample_record(batch: RolloutBatch, sample: int, arrays: bool = False) -> dict[str, Any]:
    lo, hi = batch.position_offsets[sample : sample + 2].tolist()
    mask = batch.mask[lo:hi].astype(np.int8)  # (0 or 1)
    out: dict[str, Any] = {"mask": mask if arrays else mask.tolist()}
    assert batch.label_kind is not None
    kind = batch.label_kind[sample]
    if kind == LABELS_SPANS:
        assert batch.span_offsets is not None and batch.span_versions is not None
        assert batch.span_starts is not None
        a, b = batch.span_offsets[sample : sample + 2].tolist()
        out["weight_versions"] = [
            list(pair) for pair in zip(batch.span_versions[a:b].tolist(), batch.span_starts[a:b].tolist())
        ]
    elif kind == LABELS_TOKENS:
        assert batch.token_versions is not None
        versions = np.ascontiguousarray(batch.token_versions[lo:hi], dtype=np.int64)
        out["token_versions"] = versions if arrays else versions.tolist()
    for name in (*WEIGHT_FIELDS, *_LOGPROBS):  # (a view unless float32)
        values = getattr(batch, name)
        if values is not None and batch.present[name][sample]:
            part = values[lo:hi].astype(np.float64, copy=False)
            # a missing log-prob (NaN, ±inf) as null, as orjson writes an array's non-finite floats
            listed = part if arrays else part.tolist()
            finite = arrays or np.isfinite(part).all()
            out[name] = listed if finite else [v if math.isfinite(v) else None for v in listed]
    return out


@dataclass(frozen=True)
class Shipment:
    """A shipped batch with its metrics, and what left the sink for staleness in its window.
    ``rollouts`` is built on first access."""

    step: int
    report: StepReport
    dropped_rollouts: tuple[str, ...]
    dropped_samples: tuple[tuple[str, int], ...]
    held: tuple[str, ...]
    invalid: tuple[TraceError, ...] = field(default=())
    _build_rollouts: Callable[[], tuple[ShippedRollout, ...]] = field(default=tuple, repr=False, compare=False)
    _spans: ShippedSpans | None = field(default=None, repr=False, compare=False)

    @cached_property
    def rollouts(self) -> tuple[ShippedRollout, ...]:
        """The shipped rollouts, in ship order, with their kept samples."""
        return self._build_rollouts()

    @cached_property
    def lags(self) -> npt.NDArray[np.int64]:
        """The lag ``T - v`` of every shipped position (SPEC 11), aligned with the shipped samples'
        arrays concatenated in ship order; ``-1`` where a position is not a sampled position of a
        live rollout. For a trainer that computes :func:`~staleness_metrics.mismatch_sums`."""
        if self._spans is None:
            return np.zeros(0, dtype=np.int64)
        return self._spans.per_position(np.arange(len(self._spans.rows.lo)))[0]

    @cached_property
    def lag_offsets(self) -> npt.NDArray[np.int64]:
        """Where each shipped sample starts in :attr:`lags` (one more entry than samples)."""
        if self._spans is None:
            return np.zeros(1, dtype=np.int64)
        rows = self._spans.rows
        return np.concatenate(([0], np.cumsum(rows.hi - rows.lo)))[rows.sample_offsets]

    def trained_sums(self, band: Band) -> MismatchSums | None:
        """SPEC 11 sums over the covered positions this ship trains (those the policy left of its
        live samples' sampled positions); None when no shipped record has ``trainer_logprobs``."""
        if self.report.mismatch is None or self._spans is None:
            return None
        return self._spans.mismatch(band, trained=True)

    @property
    def metrics(self) -> Mapping[str, MetricValue]:
        """The SPEC 6 metrics dict of this ship."""
        return self.report.metrics

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.rollouts]

    def batches_line(self, arrays: bool = False) -> dict[str, Any]:
        """The ``--batches-out`` line of this ship (SPEC 9); ``arrays`` as in ``record``."""
        return {
            "step": self.step,
            "shipped": [r.record(arrays) for r in self.rollouts],
            "dropped_rollouts": list(self.dropped_rollouts),
            "dropped_samples": [list(s) for s in self.dropped_samples],
            "held": list(self.held),
        }


@dataclass(frozen=True)
class PaddedShipment:
    """A ship seen as the caller's ``[B, L]`` arrays: ``shipped[i]``, whether this ship shipped row
    ``i``; ``mask`` and each present weight array, masked on shipped rows and 0 on every other."""

    shipped: BoolArray
    mask: npt.NDArray[Any]
    rl_weights: npt.NDArray[Any] | None
    ce_weights: npt.NDArray[Any] | None
    ref_kl_weights: npt.NDArray[Any] | None


def padded_shipment(shipment: Shipment, batch: RolloutBatch) -> PaddedShipment:
    """The ``[B, L]`` arrays the loss reads after ``shipment``, for the rows of ``batch`` (from
    :meth:`~staleness_metrics.RolloutBatch.from_padded`); other batches' rows are ignored."""
    layout = batch.padded
    if layout is None:
        raise FieldError("batch", "padded_shipment reads a batch built by from_padded; this one was not")
    picked = [r.index for r in shipment.rollouts if r.batch is batch and r.samples]
    shipped = np.zeros(layout.rows, dtype=bool)
    shipped[np.asarray(picked, dtype=np.int64)] = True
    keep = shipped[:, None]
    shape = (layout.rows, layout.width)

    def read_back(values: npt.NDArray[Any] | None) -> npt.NDArray[Any] | None:
        return None if values is None else np.where(keep, values.reshape(shape), np.zeros((), dtype=values.dtype))

    mask = read_back(batch.mask)
    assert mask is not None
    weights = {name: read_back(getattr(batch, name)) for name in WEIGHT_FIELDS}
    return PaddedShipment(shipped=shipped, mask=mask, **weights)


NOT_SAMPLED = -1  # lag of a position outside SPEC 11's population (mask 0 as arrived, or frozen)
_LOGPROBS = ("logprobs", "trainer_logprobs")


class ShippedSpans:
    """A ship's kept spans in ship order with each one's lag (SPEC 11), found on first use."""

    def __init__(self, queue: RolloutQueue, shipped: Judgement) -> None:
        s, n = queue.samples, queue.spans
        self.chunks = queue.rollouts.chunk[shipped.rows]  # per shipped rollout
        self.used = distinct(self.chunks)
        self.batches = list(queue.batches_of(self.used).values())  # of the chunks ``used``
        self._shipped, self._table = shipped, (s.span_lo, s.span_hi, n.part, n.lo, n.hi)

    @cached_property
    def rows(self) -> ShippedRows:
        span_lo, span_hi, part, lo, hi = self._table
        shipped, chunks, used = self._shipped, self.chunks, self.used
        sample_rows = shipped.sample_rows
        chunk_index = np.zeros(len(chunks), dtype=np.int64) if len(used) == 1 else np.searchsorted(used, chunks)
        return shipped_rows(
            SampleSpans(span_lo[sample_rows], span_hi[sample_rows], shipped.sample_rollout), SpanRanges(part, lo, hi),
            shipped.version, shipped.sampled, (~shipped.dropped, shipped.mask_below),
            (shipped.frozen, chunk_index, shipped.env), shipped.trained_version,
        )  # fmt: skip

    def per_position(self, rows: IntArray) -> tuple[IntArray, BoolArray]:
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

    def carries_trainer_logprobs(self) -> bool:
        """Whether a batch of a shipped span carries the trainer's log-probabilities."""
        if all(batch.trainer_logprobs is None for batch in self.batches):  # (no span to find)
            return False
        return any(self.batches[c].trainer_logprobs is not None for c in distinct(self.rows.chunk))

    @cached_property
    def _live_rows(self) -> dict[int | None, IntArray]:  # all (None), and by env: grouped once
        live = np.flatnonzero(self.rows.lag >= 0)
        return {None: live, **dict(rows_by_key(live, self.rows.env))}

    def mismatch(self, band: Band, env: int | None = None, trained: bool = False) -> MismatchSums:
        """SPEC 11 sums over the sampled positions of live rollouts (of one env, when given;
        ``trained``: those the policy did not mask)."""
        total = MismatchSums.zero()
        found = self.rows
        inside = self._live_rows.get(env, self._live_rows[None][:0])
        for c, rows in rows_by_key(inside, found.chunk):  # (in chunk order: the sums' order as ever)
            lag, masked = self.per_position(rows)
            if trained:
                lag[masked] = NOT_SAMPLED
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
    n_kept = kept_samples = i = 0
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
    i = j = kept_k = 0
    for k in range(n_samples):
        rollout = sample_rollout[k]
        for r in range(span_lo[k], span_hi[k]):
            if kept_sample[k] and part[r] != 2:
                partner = min(i + 1, last)  # the unlabelled part follows its labelled part
                chunk[j] = rollout_chunk[rollout]
                lo[j], hi[j] = table_lo[r], table_hi[r]
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
    return ShippedRows(*_shipped_rows(
        *as_compiled(samples, table), as_int(version), as_int(sampled),
        (as_bool(kept_sample), as_int(mask_below)), per_rollout, int(trained), NOT_SAMPLED,
    ))  # fmt: skip
