"""Version spans: the per-sample summary the engine judges instead of individual positions.

Whatever the input form (``weight_versions`` spans, per-position ``token_versions`` or no labels),
each sample is cut into spans of one version label that tile its positions. For each span the engine
keeps how many sampled positions it holds and how many of those carry a loss weight; every later
decision and metric is a reduction over spans, so positions are read once, here, and written only
where they are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .columnar import LABELS_NONE, LABELS_SPANS, LABELS_TOKENS, RolloutBatch
from .segments import segment_max, segment_min, segment_sum

__all__ = ["NO_VERSION_HIGH", "NO_VERSION_LOW", "SpanTable", "build_spans"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NO_VERSION_LOW = np.iinfo(np.int64).min // 4  # "no version": below every real threshold
NO_VERSION_HIGH = np.iinfo(np.int64).max // 4


@dataclass
class SpanTable:
    """Spans of one batch plus the per-sample and per-rollout facts derived from them."""

    # per span
    sample: IntArray
    lo: IntArray  # absolute positions in the batch's flat arrays, [lo, hi)
    hi: IntArray
    label: IntArray  # -1 = unlabelled
    version: IntArray  # effective version: the label, or the rollout's dispatch version
    sampled: IntArray  # positions with mask 1 as the sample arrived
    live: BoolArray  # some sampled position carries a loss weight
    # per sample
    span_offsets: IntArray
    n_sampled: IntArray
    n_unlabelled: IntArray
    unmaskable: BoolArray  # a weight on a mask-0 position: never masked, so always trainable
    had_train: BoolArray
    max_label: IntArray  # newest label on any position (-1: none), for the ship-time bound check
    max_sampled_version: IntArray  # NO_VERSION_LOW when the sample has no sampled position
    seq_min_version: IntArray  # xtuner's sequence version; NO_VERSION_HIGH when none
    min_sampled_version: IntArray  # NO_VERSION_HIGH when none
    # per rollout
    completion: IntArray


def build_spans(batch: RolloutBatch, invalid_rollout: BoolArray) -> SpanTable:
    """Cut every sample of ``batch`` into spans; samples of invalid rollouts get no spans."""
    pos_off = batch.position_offsets
    n_samples = batch.n_samples
    n_positions = batch.n_positions
    sample_rollout = np.repeat(np.arange(batch.n_rollouts), np.diff(batch.sample_offsets))
    lengths = np.diff(pos_off)
    kind = batch.label_kind
    assert kind is not None
    valid_sample = ~invalid_rollout[sample_rollout]

    starts: list[IntArray] = []
    labels: list[IntArray] = []
    keep: list[BoolArray] = []

    def add(where: IntArray, label: IntArray, kept: bool) -> None:
        starts.append(where)
        labels.append(label)
        keep.append(np.full(len(where), kept))

    nonempty = lengths > 0
    # Invalid samples get a filler span so that spans keep tiling the flat arrays.
    filler = nonempty & ~valid_sample
    add(pos_off[:-1][filler], np.full(int(filler.sum()), -1, dtype=np.int64), False)
    plain = nonempty & valid_sample & (kind == LABELS_NONE)
    add(pos_off[:-1][plain], np.full(int(plain.sum()), -1, dtype=np.int64), True)

    spanned = valid_sample & (kind == LABELS_SPANS)
    if spanned.any():
        assert batch.span_offsets is not None and batch.span_versions is not None
        assert batch.span_starts is not None
        span_sample = np.repeat(np.arange(n_samples), np.diff(batch.span_offsets))
        chosen = spanned[span_sample]
        add(pos_off[span_sample[chosen]] + batch.span_starts[chosen], batch.span_versions[chosen], True)
        first = batch.span_offsets[:-1]
        has_spans = np.diff(batch.span_offsets) > 0
        prefix = spanned & has_spans & nonempty
        prefix[prefix] = batch.span_starts[first[prefix]] > 0
        # a spans sample with no span at all is entirely unlabelled
        prefix |= spanned & ~has_spans & nonempty
        add(pos_off[:-1][prefix], np.full(int(prefix.sum()), -1, dtype=np.int64), True)

    tokened = valid_sample & (kind == LABELS_TOKENS) & nonempty
    if tokened.any():
        assert batch.token_versions is not None
        tokens = batch.token_versions
        boundary = np.zeros(n_positions, dtype=bool)
        boundary[pos_off[:-1][nonempty]] = True
        boundary[1:] |= tokens[1:] != tokens[:-1]
        boundary &= np.repeat(tokened, lengths)
        where = np.flatnonzero(boundary)
        add(where, tokens[where], True)

    lo = np.concatenate(starts).astype(np.int64)
    label = np.concatenate(labels).astype(np.int64)
    kept = np.concatenate(keep)
    order = np.argsort(lo, kind="stable")
    lo, label, kept = lo[order], label[order], kept[order]
    hi = np.append(lo[1:], n_positions).astype(np.int64)

    mask = batch.mask
    if len(lo):
        # float32 sums of 0/1 are exact below 2**24 positions a span; longer spans sum in float64
        exact = mask.dtype == np.float64 or int(np.max(hi - lo)) < 1 << 24
        sampled = np.add.reduceat(mask, lo, dtype=None if exact else np.float64).astype(np.int64)
        live, side = _weighted_spans(batch, lo)
    else:
        sampled = np.zeros(0, dtype=np.int64)
        live = side = np.zeros(0, dtype=bool)

    lo, hi, label, sampled, live, side = (a[kept] for a in (lo, hi, label, sampled, live, side))
    sample = (np.searchsorted(pos_off, lo, "right") - 1).astype(np.int64)
    span_offsets = np.concatenate(([0], np.cumsum(np.bincount(sample, minlength=n_samples)))).astype(np.int64)
    dispatch = batch.dispatch_version[sample_rollout][sample]
    version = np.where(label >= 0, label, dispatch)

    n_sampled = segment_sum(sampled, span_offsets)
    n_unlabelled = segment_sum(np.where(label < 0, sampled, 0), span_offsets)
    unmaskable = segment_sum(side, span_offsets) > 0
    had_train = unmaskable | (segment_sum(live, span_offsets) > 0)
    max_label = segment_max(label, span_offsets, -1)
    has_sampled = sampled > 0
    max_sampled = segment_max(np.where(has_sampled, version, NO_VERSION_LOW), span_offsets, NO_VERSION_LOW)
    min_sampled = segment_min(np.where(has_sampled, version, NO_VERSION_HIGH), span_offsets, NO_VERSION_HIGH)
    seq_counts = (label >= 0) | has_sampled
    seq_min = segment_min(np.where(seq_counts, version, NO_VERSION_HIGH), span_offsets, NO_VERSION_HIGH)

    completion = batch.completion_version
    assert completion is not None
    newest = segment_max(max_sampled, batch.sample_offsets, NO_VERSION_LOW)
    completion = np.where(
        completion >= 0, completion, np.where(newest > NO_VERSION_LOW, newest, batch.dispatch_version)
    )
    return SpanTable(
        sample=sample,
        lo=lo,
        hi=hi,
        label=label,
        version=version,
        sampled=sampled,
        live=live,
        span_offsets=span_offsets,
        n_sampled=n_sampled,
        n_unlabelled=n_unlabelled,
        unmaskable=unmaskable,
        had_train=had_train,
        max_label=max_label,
        max_sampled_version=max_sampled,
        seq_min_version=seq_min,
        min_sampled_version=min_sampled,
        completion=completion.astype(np.int64),
    )


def _weighted_spans(batch: RolloutBatch, lo: IntArray) -> tuple[BoolArray, BoolArray]:
    """Per span: whether a sampled position carries a loss weight, and whether a mask-0 position
    carries a ce / ref-KL weight (which masking never touches). One boolean pass per array."""
    n = len(batch.mask)
    other: BoolArray | None = None  # ce or ref-KL weight != 0
    for values in (batch.ce_weights, batch.ref_kl_weights):
        if values is not None:
            if other is None:
                other = np.not_equal(values, 0)
            else:
                np.logical_or(other, np.not_equal(values, 0), out=other)
    is_sampled = np.not_equal(batch.mask, 0)
    if batch.rl_weights is None:  # a missing rl_weights is 1.0 on the mask
        live = np.logical_or.reduceat(is_sampled, lo) if n else np.zeros(0, dtype=bool)
    else:
        weighted = np.not_equal(batch.rl_weights, 0)
        if other is not None:
            np.logical_or(weighted, other, out=weighted)
        np.logical_and(weighted, is_sampled, out=weighted)
        live = np.logical_or.reduceat(weighted, lo)
    if other is None:
        return live, np.zeros(len(lo), dtype=bool)
    np.logical_and(other, np.logical_not(is_sampled, out=is_sampled), out=other)
    return live, np.logical_or.reduceat(other, lo)
