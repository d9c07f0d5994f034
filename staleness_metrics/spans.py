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

from .columnar import LABELS_NONE, LABELS_SPANS, LABELS_TOKENS, WEIGHT_FIELDS, RolloutBatch
from .segments import segment_max, segment_min, segment_sum
from .validation import Verdicts

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


def build_spans(batch: RolloutBatch, verdicts: Verdicts) -> SpanTable:
    """Cut every sample of ``batch`` into spans of one version label and one mask value.

    Also checks the position values (0/1 mask, finite weights and log-probabilities) and reports
    offenders into ``verdicts``. Samples of rollouts already invalid there get no spans.
    """
    pos_off = batch.position_offsets
    n_samples = batch.n_samples
    n_positions = batch.n_positions
    sample_rollout = np.repeat(np.arange(batch.n_rollouts), np.diff(batch.sample_offsets))
    valid_sample = ~verdicts.invalid[sample_rollout]
    version_lo, version_label, version_kept = _version_spans(batch, valid_sample)

    # Refine version spans where the mask changes: each span is then wholly sampled or wholly not.
    mask = batch.mask
    changes = np.flatnonzero(mask[1:] != mask[:-1]) + 1 if n_positions else np.zeros(0, dtype=np.int64)
    lo = np.union1d(version_lo, changes).astype(np.int64)
    hi = np.append(lo[1:], n_positions).astype(np.int64)
    of_version = np.searchsorted(version_lo, lo, "right") - 1
    label, kept = version_label[of_version], version_kept[of_version]

    value = mask[lo]
    bad = kept & (value != 0) & (value != 1)
    if bad.any():
        verdicts.positions(lo[bad].tolist(), "mask", "expected 0 or 1")
    is_sampled = value == 1
    sampled = np.where(is_sampled, hi - lo, 0).astype(np.int64)
    nonzero = {name: _nonzero_or_report(batch, name, lo, hi, kept, verdicts) for name in WEIGHT_FIELDS}
    if batch.logprobs is not None and not np.isfinite(np.add.reduce(batch.logprobs)):
        offenders = np.flatnonzero(~np.isfinite(batch.logprobs))
        verdicts.positions(offenders[np.unique(np.searchsorted(lo, offenders, "right"), return_index=True)[1]].tolist(),
                           "logprobs", "not a finite number")  # fmt: skip
    rl = nonzero["rl_weights"]
    other = np.zeros(len(lo), dtype=bool)  # a ce or ref-KL weight
    for name in ("ce_weights", "ref_kl_weights"):
        if nonzero[name] is not None:
            other |= nonzero[name]
    live = is_sampled.copy() if rl is None else is_sampled & (rl | other)  # no rl_weights: 1.0 on the mask
    side = ~is_sampled & other

    lo, hi, label, sampled = lo[kept], hi[kept], label[kept], sampled[kept]
    live, side = live[kept], side[kept]
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


def _version_spans(batch: RolloutBatch, valid_sample: BoolArray) -> tuple[IntArray, IntArray, BoolArray]:
    """Start, label and keep flag of the version spans that tile the flat arrays.

    Samples of invalid rollouts get one filler span (not kept), so that spans always tile.
    """
    pos_off = batch.position_offsets
    n_samples = batch.n_samples
    lengths = np.diff(pos_off)
    kind = batch.label_kind
    assert kind is not None
    starts: list[IntArray] = []
    labels: list[IntArray] = []
    keep: list[BoolArray] = []

    def add(where: IntArray, label: IntArray, kept: bool) -> None:
        starts.append(where)
        labels.append(label)
        keep.append(np.full(len(where), kept))

    def unlabelled(selected: BoolArray, kept: bool = True) -> None:
        add(pos_off[:-1][selected], np.full(int(selected.sum()), -1, dtype=np.int64), kept)

    nonempty = lengths > 0
    unlabelled(nonempty & ~valid_sample, kept=False)
    unlabelled(nonempty & valid_sample & (kind == LABELS_NONE))
    spanned = valid_sample & (kind == LABELS_SPANS)
    if spanned.any():
        assert batch.span_offsets is not None and batch.span_versions is not None
        assert batch.span_starts is not None
        span_sample = np.repeat(np.arange(n_samples), np.diff(batch.span_offsets))
        chosen = spanned[span_sample]
        add(pos_off[span_sample[chosen]] + batch.span_starts[chosen], batch.span_versions[chosen], True)
        has_spans = np.diff(batch.span_offsets) > 0
        prefix = spanned & has_spans & nonempty
        prefix[prefix] = batch.span_starts[batch.span_offsets[:-1][prefix]] > 0
        unlabelled(prefix | (spanned & ~has_spans & nonempty))  # positions before the first span
    tokened = valid_sample & (kind == LABELS_TOKENS) & nonempty
    if tokened.any():
        assert batch.token_versions is not None
        tokens = batch.token_versions
        boundary = np.zeros(batch.n_positions, dtype=bool)
        boundary[pos_off[:-1][nonempty]] = True
        boundary[1:] |= tokens[1:] != tokens[:-1]
        boundary &= np.repeat(tokened, lengths)
        where = np.flatnonzero(boundary)
        add(where, tokens[where], True)
    lo = np.concatenate(starts).astype(np.int64)
    order = np.argsort(lo, kind="stable")
    return lo[order], np.concatenate(labels).astype(np.int64)[order], np.concatenate(keep)[order]


def _nonzero_or_report(
    batch: RolloutBatch, name: str, lo: IntArray, hi: IntArray, kept: BoolArray, verdicts: Verdicts
) -> BoolArray | None:
    """Per span: whether the weight array holds a non-zero value (None when the batch has no such
    array). Max and min per span answer that and, being non-finite exactly when a value is, the
    finiteness rule too, without a temporary array of positions."""
    values = getattr(batch, name)
    if values is None or len(lo) == 0:
        return None if values is None else np.zeros(0, dtype=bool)
    high = np.maximum.reduceat(values, lo)
    smallest = values.min()
    # Weights are usually >= 0: then the span maxima alone say "non-zero", and with the global
    # minimum they also say "finite" (NaN and +inf reach the maxima, -inf the minimum).
    low = np.minimum.reduceat(values, lo) if not smallest >= 0 else np.zeros_like(high)
    broken = kept & ~(np.isfinite(high) & np.isfinite(low))
    for span in np.flatnonzero(broken).tolist():  # error path: name the first offending position
        a, b = int(lo[span]), int(hi[span])
        verdicts.positions([a + int(np.flatnonzero(~np.isfinite(values[a:b]))[0])], name, "not a finite number")
    nonzero: BoolArray = (high > 0) | (low < 0)
    return nonzero
