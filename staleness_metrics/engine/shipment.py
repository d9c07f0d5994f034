"""What a ship hands back (SPEC 4): the :class:`Shipment`, its rollouts as SPEC 3 records, and
:func:`padded_shipment`, the way back to a padded batch's ``[B, L]`` arrays."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import FieldError, TraceError
from ..metrics.report import MetricValue, StepReport
from ..records.columnar import LABELS_SPANS, LABELS_TOKENS, WEIGHT_FIELDS, RolloutBatch
from .segments import BoolArray
from .shipped_positions import ShippedSpans


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
    mask = batch.mask[lo:hi].astype(np.int64)
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
    present = batch.present
    for name in _ARRAY_FIELDS:  # (a view unless float32)
        values = getattr(batch, name)
        if values is not None and present[name][sample]:
            part = values[lo:hi].astype(np.float64, copy=False)
            out[name] = part if arrays else part.tolist()
    if batch.trainer_logprobs is not None and present["trainer_logprobs"][sample]:
        values = batch.trainer_logprobs[lo:hi].astype(np.float64)
        # (orjson writes a non-finite float of an array as null itself)
        out["trainer_logprobs"] = values if arrays else [v if math.isfinite(v) else None for v in values.tolist()]
    return out


# written as they are (trainer_logprobs: missing ones as null)
_ARRAY_FIELDS = (*WEIGHT_FIELDS, "logprobs")


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
        return self._spans.lags() if self._spans is not None else np.zeros(0, dtype=np.int64)

    @cached_property
    def lag_offsets(self) -> npt.NDArray[np.int64]:
        """Where each shipped sample starts in :attr:`lags` (one more entry than samples)."""
        return self._spans.lag_offsets() if self._spans is not None else np.zeros(1, dtype=np.int64)

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
        if values is None:
            return None
        return np.where(keep, values.reshape(shape), np.zeros((), dtype=values.dtype))

    mask = read_back(batch.mask)
    assert mask is not None
    weights = {name: read_back(getattr(batch, name)) for name in WEIGHT_FIELDS}
    return PaddedShipment(shipped=shipped, mask=mask, **weights)
