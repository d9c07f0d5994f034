"""The columnar form of rollouts: flat per-position arrays with sample and rollout offsets, built
around a caller's arrays without a copy (the sink masks them in place) or packed from records by
:mod:`staleness_metrics.records.model`."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .padded_rows import PaddedLayout, padded_columns

__all__ = ["PER_POSITION_FLOATS", "PER_ROLLOUT_ARRAYS", "WEIGHT_FIELDS", "RolloutBatch"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.floating[Any]]

WEIGHT_FIELDS = ("rl_weights", "ce_weights", "ref_kl_weights")
PER_POSITION_FLOATS = (*WEIGHT_FIELDS, "logprobs", "trainer_logprobs")
# The optional arrays of one value per rollout.
PER_ROLLOUT_ARRAYS = ("dispatch_version", "completion_version", "frozen", "agentic", "group_ids", "envs", "echo")

# How a sample labelled its positions (kept so output mirrors input).
LABELS_NONE, LABELS_SPANS, LABELS_TOKENS = 0, 1, 2


def _as_int64(values: Any) -> IntArray:
    return np.ascontiguousarray(values, dtype=np.int64)


@dataclass
class RolloutBatch:
    """Rollouts in columnar form.

    Rollout level (R entries): ``ids``, ``dispatch_version`` (-1 where a frozen rollout has none),
    ``completion_version`` (-1 = default: newest sampled version), ``frozen``, ``agentic``,
    ``group_ids``, ``envs``, and ``sample_offsets`` (R + 1) into the samples.

    Sample level (S entries): ``position_offsets`` (S + 1) into the flat position arrays.

    Position level (P entries): ``mask`` (1 = sampled by the policy, 0 = not), the optional weight
    arrays, ``logprobs`` and ``trainer_logprobs`` (NaN = missing), and ``token_versions`` (-1 =
    unlabelled). Alternatively (or for other samples) version spans: ``span_offsets`` (S + 1) into
    ``span_versions`` / ``span_starts``, whose starts are positions relative to their sample.
    ``label_kind`` says per sample which of the two it uses (0 none, 1 spans, 2 token_versions); it
    defaults from what is given.

    ``present`` (per weight field and log-probability array, per sample) says whether a sample
    carried that array; a missing ``rl_weights`` counts as 1.0 on the mask, missing ce / ref-KL
    weights as 0. Arrays are masked in place: pass copies if the originals must stay untouched.
    """

    ids: Sequence[str]
    sample_offsets: IntArray
    position_offsets: IntArray
    mask: FloatArray
    dispatch_version: IntArray
    completion_version: IntArray | None = None
    frozen: BoolArray | None = None
    agentic: BoolArray | None = None
    group_ids: Sequence[str | None] | None = None
    envs: Sequence[str | None] | None = None
    rl_weights: FloatArray | None = None
    ce_weights: FloatArray | None = None
    ref_kl_weights: FloatArray | None = None
    logprobs: FloatArray | None = None
    # NaN where missing (SPEC 11: uncovered, not an error)
    trainer_logprobs: FloatArray | None = None
    token_versions: IntArray | None = None
    span_offsets: IntArray | None = None
    span_versions: IntArray | None = None
    span_starts: IntArray | None = None
    label_kind: npt.NDArray[np.int8] | None = None
    present: dict[str, BoolArray] = field(default_factory=dict)
    # record fields echoed in shipped output (records only); None: built from the columns
    echo: list[dict[str, Any]] | None = None
    # from_padded's [B, L] rows (engine.shipment.padded_shipment reads it)
    padded: PaddedLayout | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        n_rollouts = len(self.ids)
        self.sample_offsets = _as_int64(self.sample_offsets)
        self.position_offsets = _as_int64(self.position_offsets)
        self.dispatch_version = _as_int64(self.dispatch_version)
        n_samples = len(self.position_offsets) - 1
        if self.completion_version is None:
            self.completion_version = np.full(n_rollouts, -1, dtype=np.int64)
        else:
            self.completion_version = _as_int64(self.completion_version)
        if self.frozen is None:
            self.frozen = np.zeros(n_rollouts, dtype=bool)
        if self.agentic is None:
            self.agentic = np.zeros(n_rollouts, dtype=bool)
        if self.group_ids is None:
            self.group_ids = [None] * n_rollouts
        if self.envs is None:
            self.envs = [None] * n_rollouts
        if self.token_versions is not None:
            self.token_versions = _as_int64(self.token_versions)
        if self.span_offsets is not None:
            self.span_offsets = _as_int64(self.span_offsets)
            self.span_versions = _as_int64(self.span_versions)
            self.span_starts = _as_int64(self.span_starts)
        if self.label_kind is None:
            kind = np.full(n_samples, LABELS_NONE, dtype=np.int8)
            if self.span_offsets is not None:
                kind[np.diff(self.span_offsets) > 0] = LABELS_SPANS
            if self.token_versions is not None:
                kind[:] = LABELS_TOKENS
            self.label_kind = kind
        for name in PER_POSITION_FLOATS:
            if getattr(self, name) is not None and name not in self.present:
                self.present[name] = np.ones(n_samples, dtype=bool)

    @classmethod
    def from_padded(cls, ids: Sequence[str], mask: Any, **columns: Any) -> RolloutBatch:
        """One rollout per row of ``[B, L]`` arrays (:func:`.padded.from_padded`)."""
        return cls(**padded_columns(ids, mask, **columns))

    def rollouts_in(self, start: int, stop: int) -> RolloutBatch:
        """Rollouts ``start`` to ``stop - 1`` as views of this batch's arrays (offsets from 0;
        ``padded`` is None)."""
        s0, s1 = int(self.sample_offsets[start]), int(self.sample_offsets[stop])
        p0, p1 = int(self.position_offsets[s0]), int(self.position_offsets[s1])
        part = copy.copy(self)  # (checked and converted already: no __post_init__ again)
        part.ids = self.ids[start:stop]
        part.sample_offsets = self.sample_offsets[start : stop + 1] - s0
        part.position_offsets = self.position_offsets[s0 : s1 + 1] - p0
        for name in PER_ROLLOUT_ARRAYS:
            if (values := getattr(self, name)) is not None:
                setattr(part, name, values[start:stop])
        for name in (*PER_POSITION_FLOATS, "mask", "token_versions"):
            if (values := getattr(self, name)) is not None:
                setattr(part, name, values[p0:p1])
        if self.label_kind is not None:
            part.label_kind = self.label_kind[s0:s1]
        if self.span_offsets is not None and self.span_versions is not None and self.span_starts is not None:
            t0, t1 = int(self.span_offsets[s0]), int(self.span_offsets[s1])
            part.span_offsets = self.span_offsets[s0 : s1 + 1] - t0
            part.span_versions = self.span_versions[t0:t1]
            part.span_starts = self.span_starts[t0:t1]
        part.present = {name: flags[s0:s1] for name, flags in self.present.items()}
        part.padded = None
        return part

    @property
    def n_rollouts(self) -> int:
        return len(self.ids)

    @property
    def n_samples(self) -> int:
        return len(self.position_offsets) - 1

    @property
    def n_positions(self) -> int:
        return len(self.mask)
