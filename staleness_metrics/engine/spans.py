"""Version spans: the per-sample summary the engine judges instead of individual positions.

Whatever the input form (``weight_versions`` spans, per-position ``token_versions`` or no labels),
each sample is cut into spans of one version label that tile its positions. For each span the engine
keeps how many sampled positions it holds and how many of those carry a loss weight; every later
decision and metric is a reduction over spans, so positions are read once, here, and written only
where they are masked.

Unlabelled positions (``-1``) scattered among equal ``token_versions`` labels do not cut a span: the
span is then two rows over one range, its labelled part and its unlabelled part (dispatch version),
so the number of spans follows the labels, not the unlabelled positions. Finding the runs costs one
step per change of value; nothing sorts or hashes per-position data.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from ..records.validation import Verdicts, check_batch
from .cuts import (
    WEIGHT_NAN,
    WEIGHT_NONFINITE,
    WEIGHT_NONZERO,
    WEIGHT_NOT_POSITIVE,
    CutFlags,
    SampleLabels,
    sample_cuts,
    span_rows,
)
from .segments import expand_ranges, segment_max

__all__ = [
    "NO_VERSION_HIGH", "NO_VERSION_LOW", "PART_LABELLED", "PART_UNLABELLED", "PART_WHOLE", "SampleSpans", "SpanRanges",
    "SpanTable", "build_spans", "checked_spans",
]  # fmt: skip

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NO_VERSION_LOW = np.iinfo(np.int64).min // 4  # "no version": below every real threshold
NO_VERSION_HIGH = np.iinfo(np.int64).max // 4

# A span row holds every position of its range, or (a mixed cut of a token-labelled
# sample, whose scattered -1 positions take the dispatch version) only its labelled or
# only its unlabelled positions.
PART_WHOLE, PART_LABELLED, PART_UNLABELLED = 0, 1, 2
_NO_POSITIONS = np.zeros(0, dtype=np.int64)


@dataclass
class SpanTable:
    """Spans of one batch plus the per-sample and per-rollout facts derived from them."""

    # per span (a row: a cut, or one part of a mixed cut)
    sample: IntArray
    lo: IntArray  # absolute positions in the batch's flat arrays, [lo, hi)
    hi: IntArray
    label: IntArray  # -1 = unlabelled
    version: IntArray  # effective version: the label, or the rollout's dispatch version
    # PART_WHOLE, or which positions of a mixed cut [lo, hi) the row holds
    part: npt.NDArray[np.int8]
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
    # per rollout
    completion: IntArray

    def rollouts_in(self, batch: RolloutBatch, start: int, stop: int) -> SpanTable:
        """The spans of rollouts ``start`` to ``stop - 1`` of ``batch`` (the batch they were
        cut from), as :meth:`RolloutBatch.rollouts_in` gives those rollouts: samples and
        positions counted from theirs."""
        s0, s1 = int(batch.sample_offsets[start]), int(batch.sample_offsets[stop])
        p0, t0, t1 = (
            int(batch.position_offsets[s0]),
            int(self.span_offsets[s0]),
            int(self.span_offsets[s1]),
        )
        return SpanTable(
            sample=self.sample[t0:t1] - s0, lo=self.lo[t0:t1] - p0, hi=self.hi[t0:t1] - p0,
            label=self.label[t0:t1], version=self.version[t0:t1], part=self.part[t0:t1],
            sampled=self.sampled[t0:t1], live=self.live[t0:t1], span_offsets=self.span_offsets[s0 : s1 + 1] - t0,
            n_sampled=self.n_sampled[s0:s1], n_unlabelled=self.n_unlabelled[s0:s1], unmaskable=self.unmaskable[s0:s1],
            had_train=self.had_train[s0:s1], max_label=self.max_label[s0:s1],
            max_sampled_version=self.max_sampled_version[s0:s1], seq_min_version=self.seq_min_version[s0:s1],
            completion=self.completion[start:stop],
        )  # fmt: skip


class SpanRanges(NamedTuple):
    """The span table's columns a compiled pass over span rows reads: each row's part and range."""

    part: npt.NDArray[np.int8]
    lo: IntArray
    hi: IntArray


class SampleSpans(NamedTuple):
    """Judged samples as a compiled pass over their span rows reads them: each sample's rows
    ``[span_lo, span_hi)`` of the span table (in judgement order) and its local rollout."""

    span_lo: IntArray
    span_hi: IntArray
    sample_rollout: IntArray


def sample_spans(samples: SampleSpans) -> tuple[IntArray, ...]:
    """``samples`` as a compiled pass reads them (contiguous int64 arrays)."""
    return tuple(np.ascontiguousarray(values, dtype=np.int64) for values in samples)


def span_ranges(table: SpanRanges) -> tuple[npt.NDArray[Any], ...]:
    """``table`` as a compiled pass reads it (contiguous int8 parts, int64 ranges)."""
    part = np.ascontiguousarray(table.part, dtype=np.int8)
    return part, np.ascontiguousarray(table.lo, dtype=np.int64), np.ascontiguousarray(table.hi, dtype=np.int64)


def check_sample_spans(
    samples: tuple[IntArray, IntArray, IntArray],
    table: tuple[npt.NDArray[np.int8], IntArray, IntArray],
    version: IntArray,
    sampled: IntArray,
    n_rollouts: int,
) -> int:  # pragma: no cover - compiled
    """A compiled pass's check, before any read, that the span rows and rollouts ``samples`` name
    lie in ``table`` and ``n_rollouts``, with a ``version`` and ``sampled`` per row; the rows'
    count. (A callee: :data:`SAMPLE_SPAN_CALLEES`.)"""
    span_lo, span_hi, sample_rollout = samples
    part, lo, hi = table
    if len(span_hi) != len(span_lo) or len(sample_rollout) != len(span_lo):
        raise ValueError("the sample arrays differ in length")
    if len(lo) != len(part) or len(hi) != len(part):
        raise ValueError("the span table's columns differ in length")
    n = 0
    for k in range(len(span_lo)):
        if not (0 <= span_lo[k] <= span_hi[k] <= len(part)):
            raise IndexError("a sample's span rows outside the span table")
        if not (0 <= sample_rollout[k] < n_rollouts):
            raise IndexError("a sample of no rollout")
        n += span_hi[k] - span_lo[k]
    if len(version) != n or len(sampled) != n:
        raise ValueError("one version and one sampled count per span row expected")
    return n


SAMPLE_SPAN_CALLEES: dict[str, tuple[Callable[..., Any], Mapping[str, Any]]] = {
    "check_sample_spans": (check_sample_spans, {})
}


class _TokenVersionBelowMinusOne(Exception):
    """A token version below -1 in a sample :func:`build_spans` cut (only raised when
    asked to check them)."""


def checked_spans(batch: RolloutBatch, known_ids: Container[str] = frozenset()) -> tuple[Verdicts, SpanTable]:
    """:func:`~staleness_metrics.records.validation.check_batch` then :func:`build_spans`: the
    invalid rollouts and the spans of the others.

    The rule on token versions (>= -1) is checked in the pass that cuts them rather than in a pass
    of its own. When that pass finds an offender, or the batch has other errors, the checks run
    again in their usual order, so the first error named for each rollout is the same either way.
    """
    verdicts = check_batch(batch, known_ids, token_values=False)
    if not verdicts.errors:
        try:
            return verdicts, build_spans(batch, verdicts, token_values=False)
        except _TokenVersionBelowMinusOne:
            pass
    verdicts = check_batch(batch, known_ids)
    return verdicts, build_spans(batch, verdicts)


def build_spans(batch: RolloutBatch, verdicts: Verdicts, *, token_values: bool = True) -> SpanTable:
    """Cut every sample of ``batch`` into spans of one version label and one mask value.

    Also checks the position values (0/1 mask, finite weights and log-probabilities) and reports
    offenders into ``verdicts``. Samples of rollouts already invalid there get no spans. Without
    ``token_values`` (the caller did not check that token versions are >= -1), raises
    ``_TokenVersionBelowMinusOne`` when a sample it cuts has one (:func:`checked_spans`).

    Cuts (:func:`~staleness_metrics.engine.cuts.sample_cuts`, one compiled pass at every size): a
    sample labelled per position gets them from runs of ``token_versions`` (scattered unlabelled
    positions do not cut it: they form the cut's unlabelled part), every other sample from its
    version spans; both are cut again where the mask changes. Rows: one per cut, two per mixed cut
    (its labelled part, then its unlabelled part), and the per-sample reductions, in one compiled
    pass over the cuts.
    """
    pos_off = batch.position_offsets
    sample_rollout = np.repeat(np.arange(batch.n_rollouts), np.diff(batch.sample_offsets))
    cut = np.diff(pos_off) > 0
    if verdicts.errors:
        cut &= ~verdicts.invalid[sample_rollout]
    present = [name for name in WEIGHT_FIELDS if getattr(batch, name) is not None]
    weights = [getattr(batch, name) for name in present]
    cuts = sample_cuts(_labels_of(batch), batch.mask, pos_off, np.flatnonzero(cut), weights)
    if cuts.below and not token_values:
        raise _TokenVersionBelowMinusOne
    lo, hi = cuts.starts, cuts.ends
    value = batch.mask[lo]  # (a cut holds one mask value)
    bad = (value != 0) & (value != 1)
    if bad.any():
        verdicts.positions(lo[bad].tolist(), "mask", "expected 0 or 1")
    nonzero = {
        name: _nonzero_or_report(values, name, bits, lo, hi, verdicts)
        for name, values, bits in zip(present, weights, cuts.flags)
    }
    if batch.logprobs is not None and not np.isfinite(np.add.reduce(batch.logprobs)):
        offenders = np.flatnonzero(~np.isfinite(batch.logprobs))  # the first of each sample named
        first = np.unique(np.searchsorted(pos_off, offenders, "right"), return_index=True)[1]
        verdicts.positions(offenders[first].tolist(), "logprobs", "not a finite number")
    is_sampled = value == 1
    rl = nonzero.get("rl_weights")
    other = nonzero.get("ce_weights", nonzero.get("ref_kl_weights"))  # a ce or ref-KL weight
    if "ce_weights" in nonzero and "ref_kl_weights" in nonzero:
        other = nonzero["ce_weights"] | nonzero["ref_kl_weights"]
    weighted = rl if other is None or rl is None else rl | other
    live = is_sampled if weighted is None else is_sampled & weighted  # (no rl weights: 1.0)
    side = np.zeros(len(lo), dtype=bool) if other is None else ~is_sampled & other
    live_labelled, live_unlabelled = live, live
    if rl is not None:
        rl_bits = cuts.flags[present.index("rl_weights")]
        rl_doubtful = rl_bits & (WEIGHT_NAN | WEIGHT_NOT_POSITIVE) != 0
        mixed = (cuts.labelled > 0) & (cuts.labelled < hi - lo)
        parts = _exact_part_liveness(batch, present, lo, hi, rl_doubtful, live, mixed)
        live_labelled, live_unlabelled = parts
    flags = CutFlags(np.ones(len(lo), dtype=bool), is_sampled, live_labelled, live_unlabelled, side)
    dispatch = batch.dispatch_version[sample_rollout]
    no_version = (NO_VERSION_LOW, NO_VERSION_HIGH)
    rows = span_rows(lo, hi, cuts.labels, cuts.labelled, flags, pos_off, dispatch, no_version)
    completion = batch.completion_version
    assert completion is not None
    newest = segment_max(rows.max_sampled_version, batch.sample_offsets, NO_VERSION_LOW)
    default = np.where(newest > NO_VERSION_LOW, newest, batch.dispatch_version)
    return SpanTable(*rows, completion=np.where(completion >= 0, completion, default))  # (int64)


def _labels_of(batch: RolloutBatch) -> SampleLabels:
    """How ``batch``'s samples label their positions, as the cut reads it (arrays the batch lacks:
    empty)."""
    kinds = batch.label_kind
    assert kinds is not None

    def given(values: IntArray | None) -> IntArray:
        return _NO_POSITIONS if values is None else values

    tokens, offsets = given(batch.token_versions), given(batch.span_offsets)
    starts, versions = given(batch.span_starts), given(batch.span_versions)
    return SampleLabels(kinds, tokens, offsets, starts, versions)


def _exact_part_liveness(
    batch: RolloutBatch,
    present: list[str],
    lo: IntArray,
    hi: IntArray,
    rl_doubtful: BoolArray,
    live: BoolArray,
    mixed: BoolArray,
) -> tuple[BoolArray, BoolArray]:
    """Per cut, whether its labelled and its unlabelled part has a weighted position of its own: as
    ``live`` as the cut, except for live ``mixed`` cuts with an rl weight that is not above 0
    somewhere (``rl_doubtful``), whose positions are read one by one.

    Both parts are live at once when every rl weight of the cut is above 0."""
    # a zero (or negative, or NaN) rl weight somewhere in the cut
    doubt = np.flatnonzero(mixed & live & rl_doubtful)
    if len(doubt) == 0:
        return live, live
    labelled_part, unlabelled_part = live.copy(), live.copy()
    tokens = batch.token_versions
    assert tokens is not None
    positions = expand_ranges(lo[doubt], hi[doubt])
    weighted = np.zeros(len(positions), dtype=bool)
    for name in present:
        weighted |= getattr(batch, name)[positions] != 0
    owner = np.repeat(np.arange(len(doubt)), hi[doubt] - lo[doubt])
    key = 2 * owner + (tokens[positions] < 0)
    alive = np.bincount(key[weighted], minlength=2 * len(doubt)) > 0
    labelled_part[doubt], unlabelled_part[doubt] = alive[0::2], alive[1::2]
    return labelled_part, unlabelled_part


def _nonzero_or_report(
    values: npt.NDArray[np.floating[Any]],
    name: str,
    flags: npt.NDArray[np.uint8],
    lo: IntArray,
    hi: IntArray,
    verdicts: Verdicts,
) -> BoolArray:
    """Per cut: whether the weight array holds a non-zero value (a cut holding a NaN does not). A
    non-finite value is searched for by position only in such cuts, to name the first offender."""
    broken = flags & WEIGHT_NONFINITE != 0
    for span in np.flatnonzero(broken).tolist() if broken.any() else ():
        a, b = int(lo[span]), int(hi[span])
        verdicts.positions([a + int(np.flatnonzero(~np.isfinite(values[a:b]))[0])], name, "not a finite number")
    nonzero: BoolArray = flags & (WEIGHT_NONZERO | WEIGHT_NAN) == WEIGHT_NONZERO
    return nonzero
