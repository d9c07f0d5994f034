"""Version spans: the per-sample summary the engine judges instead of individual positions.

Whatever the input form (``weight_versions`` spans, per-position ``token_versions`` or no labels),
each sample is cut into spans of one version label that tile its positions. For each span the engine
keeps how many sampled positions it holds and how many of those carry a loss weight; every later
decision and metric is a reduction over spans, so positions are read once, here, and written only
where they are masked.

Unlabelled positions (``-1``) scattered among equal ``token_versions`` labels do not cut a span: the
span is then two rows over one range, its labelled part and its unlabelled part (dispatch version), so
the number of spans follows the labels, not the unlabelled positions. Finding the runs costs one step
per change of value; nothing sorts or hashes per-position data.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections.abc import Container
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..parallel import PARALLEL_MIN_POSITIONS, run_all
from ..records.columnar import LABELS_NONE, LABELS_SPANS, LABELS_TOKENS, WEIGHT_FIELDS, RolloutBatch
from ..records.validation import Verdicts, check_batch
from .cuts import (
    WEIGHT_NAN,
    WEIGHT_NONFINITE,
    WEIGHT_NONZERO,
    WEIGHT_NOT_POSITIVE,
    CutFlags,
    TokenSpans,
    fusable_weights,
    span_rows,
    token_spans,
    weight_flags,
)
from .segments import expand_ranges, segment_max
from .token_pieces import narrow, token_spans_in_pieces

__all__ = [
    "NO_VERSION_HIGH", "NO_VERSION_LOW", "PART_LABELLED", "PART_UNLABELLED", "PART_WHOLE", "SampleSpans", "SpanRanges",
    "SpanTable", "build_spans", "checked_spans",
]  # fmt: skip

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NO_VERSION_LOW = np.iinfo(np.int64).min // 4  # "no version": below every real threshold
NO_VERSION_HIGH = np.iinfo(np.int64).max // 4

# A span row holds every position of its range, or (a mixed cut of a token-labelled sample, whose
# scattered -1 positions take the dispatch version) only its labelled or only its unlabelled positions.
PART_WHOLE, PART_LABELLED, PART_UNLABELLED = 0, 1, 2
_NO_POSITIONS = np.zeros(0, dtype=np.int64)
# Up to these many samples and mask changes a batch's cuts are assembled in Python lists (_few_cuts).
_FEW_SAMPLES, _FEW_CUTS = 64, 256


@dataclass
class SpanTable:
    """Spans of one batch plus the per-sample and per-rollout facts derived from them."""

    # per span (a row: a cut, or one part of a mixed cut)
    sample: IntArray
    lo: IntArray  # absolute positions in the batch's flat arrays, [lo, hi)
    hi: IntArray
    label: IntArray  # -1 = unlabelled
    version: IntArray  # effective version: the label, or the rollout's dispatch version
    part: npt.NDArray[np.int8]  # PART_WHOLE, or which positions of a mixed cut [lo, hi) the row holds
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
        """The spans of rollouts ``start`` to ``stop - 1`` of ``batch`` (the batch they were cut from), as
        :meth:`RolloutBatch.rollouts_in` gives those rollouts: samples and positions counted from theirs."""
        s0, s1 = int(batch.sample_offsets[start]), int(batch.sample_offsets[stop])
        p0, t0, t1 = int(batch.position_offsets[s0]), int(self.span_offsets[s0]), int(self.span_offsets[s1])
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


class _TokenVersionBelowMinusOne(Exception):
    """A token version below -1 in a sample :func:`build_spans` cut (only raised when asked to check them)."""


def checked_spans(batch: RolloutBatch, known_ids: Container[str] = frozenset()) -> tuple[Verdicts, SpanTable]:
    """:func:`~staleness_metrics.records.validation.check_batch` then :func:`build_spans`: the invalid rollouts and
    the spans of the others.

    The rule on token versions (>= -1) is checked in the pass that cuts them rather than in a pass of
    its own. When that pass finds an offender, or the batch has other errors, the checks run again in
    their usual order, so the first error named for each rollout is the same either way.
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
    """
    pos_off = batch.position_offsets
    n_positions = batch.n_positions
    sample_rollout = _sample_rollout(batch.sample_offsets, batch.n_rollouts)
    valid_sample = ~verdicts.invalid[sample_rollout] if verdicts.errors else np.ones(len(sample_rollout), dtype=bool)
    mask = batch.mask
    few_samples = _few_samples(batch, valid_sample)
    if few_samples is not None:  # (the same flags from Python lists)
        tokened = np.array(few_samples.tokened, dtype=bool)
        others_nonempty = few_samples.others_nonempty
    else:
        nonempty = np.diff(pos_off) > 0
        tokened = valid_sample & (batch.label_kind == LABELS_TOKENS) & nonempty
        others_nonempty = bool((valid_sample & ~tokened & nonempty).any())
    # Token-labelled samples find their mask changes in the compiled pass that cuts them; the others here.
    changes = _mask_changes(mask) if others_nonempty else _NO_POSITIONS

    # Cuts: the spans of one mask value that tile the flat arrays. Samples labelled per position get
    # theirs from runs of token_versions (scattered unlabelled positions do not cut them: they form the
    # cut's unlabelled part); every other sample from its version spans, refined where the mask changes.
    few = few_samples is not None and len(changes) <= _FEW_CUTS
    if few_samples is not None and few:  # (a small batch: the same cuts from Python lists, cheaper there)
        lo_list, label_list, kept_list = _few_cuts(batch, few_samples, changes)
        lo = np.array(lo_list, dtype=np.int64)
    else:
        version_lo, version_label, version_kept = _version_spans(batch, valid_sample, tokened)
        outside: BoolArray | slice = slice(None)
        if tokened.any() and len(changes):
            outside = ~tokened[np.searchsorted(pos_off, changes, "right") - 1]
        lo = np.union1d(version_lo, changes[outside]).astype(np.int64)
        of_version = np.searchsorted(version_lo, lo, "right") - 1
        label, kept = version_label[of_version], version_kept[of_version]
        labelled = np.full(len(lo), -1)  # labelled positions per cut; -1: all of them when the label is >= 0
    present = [name for name in WEIGHT_FIELDS if getattr(batch, name) is not None]
    weights = [getattr(batch, name) for name in present]
    token_flags: npt.NDArray[np.uint8] | None = None  # the weight bits of the token cuts, from their pass
    from_tokens: BoolArray | None = None
    resolved: tuple[IntArray, IntArray, BoolArray] | None = None  # hi, labelled, mixed when already found
    if tokened.any():
        # A small batch with other cuts too reads every cut's weights in one pass below rather than
        # merging the token cuts' bits with the others' (the bits are the same either way).
        read_weights = fusable_weights(weights) and not (few and len(lo))
        found = _token_spans(batch, tokened, weights if read_weights else [])
        if found.below and not token_values:
            raise _TokenVersionBelowMinusOne
        t_lo = found.starts
        if len(lo) == 0:  # every sample labelled per position (the usual token_versions batch): no merge
            from_tokens = np.ones(len(t_lo), dtype=bool)
            lo, label, labelled = t_lo, found.labels, found.labelled
            kept = np.ones(len(t_lo), dtype=bool)
        elif few and len(t_lo) <= _FEW_CUTS:
            lo, label, kept, resolved = _few_arrays(*_few_merged(lo_list, label_list, kept_list, found), n_positions)
        else:
            if few:
                label, kept = np.array(label_list, dtype=np.int64), np.array(kept_list, dtype=bool)
                labelled = np.full(len(lo), -1)
            order = np.argsort(np.concatenate((lo, t_lo)), kind="stable")
            from_tokens = np.concatenate((np.zeros(len(lo), dtype=bool), np.ones(len(t_lo), dtype=bool)))[order]
            lo = np.concatenate((lo, t_lo))[order]
            label = np.concatenate((label, found.labels))[order]
            kept = np.concatenate((kept, np.ones(len(t_lo), dtype=bool)))[order]
            labelled = np.concatenate((labelled, found.labelled))[order]
        if len(found.flags) == len(weights) and weights:
            token_flags = found.flags
    elif few:
        lo, label, kept, resolved = _few_arrays(lo_list, label_list, kept_list, [-1] * len(lo_list), n_positions)
    if resolved is not None:
        hi, labelled, mixed = resolved
    else:
        hi = np.append(lo[1:], n_positions).astype(np.int64)
        labelled = np.where(labelled < 0, np.where(label >= 0, hi - lo, 0), labelled)
        mixed = (labelled > 0) & (labelled < hi - lo)

    value = mask[lo]
    if not few or any(v != 0 and v != 1 for v in value.tolist()):  # (a small batch looks over a short list first)
        bad = kept & (value != 0) & (value != 1)
        if bad.any():
            verdicts.positions(lo[bad].tolist(), "mask", "expected 0 or 1")
    is_sampled = value == 1
    flags: list[npt.NDArray[np.uint8]]
    if token_flags is not None and from_tokens is not None:
        flags = _merged_flags(weights, token_flags, from_tokens, lo, hi)
    else:
        flags = run_all([partial(span_weight_flags, values, lo, hi) for values in weights], n_positions)
    nonzero: dict[str, BoolArray | None] = dict.fromkeys(WEIGHT_FIELDS)
    for name, bits in zip(present, flags):
        nonzero[name] = _nonzero_or_report(getattr(batch, name), name, bits, lo, hi, kept, verdicts)
    if batch.logprobs is not None and not np.isfinite(np.add.reduce(batch.logprobs)):
        offenders = np.flatnonzero(~np.isfinite(batch.logprobs))
        verdicts.positions(offenders[np.unique(np.searchsorted(lo, offenders, "right"), return_index=True)[1]].tolist(),
                           "logprobs", "not a finite number")  # fmt: skip
    rl = nonzero["rl_weights"]
    others = [weighted for name in ("ce_weights", "ref_kl_weights") if (weighted := nonzero[name]) is not None]
    if others:
        other = others[0] | others[1] if len(others) == 2 else others[0]  # a ce or ref-KL weight
        live = is_sampled.copy() if rl is None else is_sampled & (rl | other)  # no rl_weights: 1.0 on the mask
        side = ~is_sampled & other
    else:  # (no ce or ref-KL weight: no cut has one)
        live = is_sampled.copy() if rl is None else is_sampled & rl
        side = np.zeros(len(lo), dtype=bool)

    # Rows: one per kept cut, two per mixed cut (its labelled part, then its unlabelled part), and the
    # per-sample reductions, in one compiled pass over the cuts.
    live_labelled, live_unlabelled = live, live
    if rl is not None:
        rl_doubtful = flags[present.index("rl_weights")] & (WEIGHT_NAN | WEIGHT_NOT_POSITIVE) != 0
        live_labelled, live_unlabelled = _exact_part_liveness(batch, present, lo, hi, rl_doubtful, live, mixed)
    hi = hi[: len(lo)]  # (with no cut, hi held the end of the positions)
    cut_flags = CutFlags(kept, is_sampled, live_labelled, live_unlabelled, side)
    rows = span_rows(lo, hi, label, labelled, cut_flags, pos_off, batch.dispatch_version[sample_rollout],
                     (NO_VERSION_LOW, NO_VERSION_HIGH))  # fmt: skip
    max_sampled = rows.max_sampled_version

    completion = batch.completion_version
    assert completion is not None
    if few:  # the same choice per rollout, over Python lists
        completion = np.array(_few_completions(completion, max_sampled, batch), dtype=np.int64)
    else:
        newest = segment_max(max_sampled, batch.sample_offsets, NO_VERSION_LOW)
        completion = np.where(
            completion >= 0, completion, np.where(newest > NO_VERSION_LOW, newest, batch.dispatch_version)
        )
    return SpanTable(
        sample=rows.sample,
        lo=rows.lo,
        hi=rows.hi,
        label=rows.label,
        version=rows.version,
        part=rows.part,
        sampled=rows.sampled,
        live=rows.live,
        span_offsets=rows.span_offsets,
        n_sampled=rows.n_sampled,
        n_unlabelled=rows.n_unlabelled,
        unmaskable=rows.unmaskable,
        had_train=rows.had_train,
        max_label=rows.max_label,
        max_sampled_version=max_sampled,
        seq_min_version=rows.seq_min_version,
        completion=completion.astype(np.int64, copy=False),
    )


def _token_spans(batch: RolloutBatch, tokened: BoolArray, weights: list[npt.NDArray[Any]]) -> TokenSpans:
    """Cuts of the samples labelled per position: start, label (-1: none) and labelled positions of each,
    and the weight bits of each cut of ``weights`` (empty: none read).

    A cut ends where the mask changes or a different label begins; unlabelled positions (-1) between
    two equal labels stay inside the cut, so scattered unlabelled positions do not multiply the cuts.
    One compiled pass over the labels and the mask, then each cut's weights while it is in cache
    (:func:`~staleness_metrics.engine.cuts.token_spans`).
    """
    tokens = batch.token_versions
    assert tokens is not None
    spans_of = token_spans_in_pieces if narrow(tokens) else token_spans  # narrow: read as int64 a piece at a time
    return spans_of(tokens, batch.mask, batch.position_offsets, np.flatnonzero(tokened), weights)


def _merged_flags(
    weights: list[npt.NDArray[Any]],
    token_flags: npt.NDArray[np.uint8],
    from_tokens: BoolArray,
    lo: IntArray,
    hi: IntArray,
) -> list[npt.NDArray[np.uint8]]:
    """The weight bits of every cut: those of the token cuts (``from_tokens``) from their pass, the others'
    read now (one compiled pass over those cuts only)."""
    others = ~from_tokens
    if not others.any():
        return list(token_flags)
    merged = []
    other_lo, other_hi = lo[others], hi[others]
    for values, bits in zip(weights, token_flags):
        flags = np.empty(len(lo), dtype=np.uint8)
        flags[from_tokens] = bits
        other_flags = weight_flags(values, other_lo, other_hi)
        assert other_flags is not None  # fusable weights are float16/32/64, contiguous: the compiled pass reads them
        flags[others] = other_flags
        merged.append(flags)
    return merged


def _exact_part_liveness(
    batch: RolloutBatch,
    present: list[str],
    lo: IntArray,
    hi: IntArray,
    rl_doubtful: BoolArray,
    live: BoolArray,
    mixed: BoolArray,
) -> tuple[BoolArray, BoolArray]:
    """Per cut, whether its labelled and its unlabelled part has a weighted position of its own: as ``live``
    as the cut, except for live ``mixed`` cuts with an rl weight that is not above 0 somewhere
    (``rl_doubtful``), whose positions are read one by one.

    Both parts are live at once when every rl weight of the cut is above 0."""
    doubt = np.flatnonzero(mixed & live & rl_doubtful)  # a zero (or negative, or NaN) rl weight somewhere in the cut
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


def _version_spans(
    batch: RolloutBatch, valid_sample: BoolArray, tokened: BoolArray
) -> tuple[IntArray, IntArray, BoolArray]:
    """Start, label and keep flag of the version spans of the samples ``valid_sample`` selects, and of
    filler spans (not kept) for the samples of invalid rollouts. Token-labelled valid samples are cut by
    :func:`_token_cuts` instead.
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
    valid_sample = valid_sample & ~tokened
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
    lo = np.concatenate(starts).astype(np.int64)
    order = np.argsort(lo, kind="stable")
    return lo[order], np.concatenate(labels).astype(np.int64)[order], np.concatenate(keep)[order]


def _sample_rollout(sample_offsets: IntArray, n_rollouts: int) -> IntArray:
    """Per sample the index of its rollout (a short Python pass for a few rollouts: cheaper than ``np.repeat``)."""
    offsets: list[int] = sample_offsets.tolist() if n_rollouts <= _FEW_SAMPLES else []
    counts = [b - a for a, b in itertools.pairwise(offsets)]
    if len(counts) != n_rollouts or min(counts, default=0) < 0:  # (many; or numpy names the broken offsets)
        return np.repeat(np.arange(n_rollouts), np.diff(sample_offsets))
    return np.array([rollout for rollout, count in enumerate(counts) for _ in range(count)], dtype=np.intp)


class _FewSamples(NamedTuple):
    """Per-sample flags of a small batch as Python lists (:func:`_few_samples`)."""

    offsets: list[int]  # position offsets
    valid: list[bool]
    nonempty: list[bool]
    kind: list[int]
    tokened: list[bool]  # valid, non-empty and labelled per position
    others_nonempty: bool  # some valid non-empty sample is not labelled per position


def _few_samples(batch: RolloutBatch, valid_sample: BoolArray) -> _FewSamples | None:
    """The per-sample flags :func:`build_spans` needs, from Python lists when the batch has few samples
    (``None`` otherwise, or when the arrays' lengths disagree: numpy then says so)."""
    if batch.n_samples > _FEW_SAMPLES:
        return None
    kinds = batch.label_kind
    assert kinds is not None
    offsets: list[int] = batch.position_offsets.tolist()
    valid: list[bool] = valid_sample.tolist()
    kind: list[int] = kinds.tolist()
    if not len(valid) == len(kind) == len(offsets) - 1:
        return None
    nonempty = [a < b for a, b in itertools.pairwise(offsets)]
    tokened = [v and k == LABELS_TOKENS and n for v, k, n in zip(valid, kind, nonempty, strict=True)]
    others = any(v and not t and n for v, t, n in zip(valid, tokened, nonempty, strict=True))
    return _FewSamples(offsets, valid, nonempty, kind, tokened, others)


def _few_cuts(batch: RolloutBatch, flags: _FewSamples, changes: IntArray) -> tuple[list[int], list[int], list[bool]]:
    """The cuts of the samples not labelled per position, as :func:`_version_spans` and the mask changes
    outside ``tokened`` samples give them (start, label, keep flag), in Python lists: for a small batch,
    where a few list steps cost less than the numpy calls of the general path. The same cuts in the
    same order (stable sorts, the last of equal starts labels a cut, as ``searchsorted(..., "right")``)."""
    offsets, valid, nonempty, kind, tokened = flags[:5]
    samples = range(len(offsets) - 1)
    usable = [v and not t for v, t in zip(valid, tokened, strict=True)]
    # in the order _version_spans concatenates them: fillers, unlabelled samples, spans, span prefixes
    version: list[tuple[int, int, bool]] = [(offsets[i], -1, False) for i in samples if nonempty[i] and not valid[i]]
    version += [(offsets[i], -1, True) for i in samples if nonempty[i] and usable[i] and kind[i] == LABELS_NONE]
    spanned = [i for i in samples if usable[i] and kind[i] == LABELS_SPANS]
    if spanned:
        assert batch.span_offsets is not None and batch.span_versions is not None
        assert batch.span_starts is not None
        span_offsets: list[int] = batch.span_offsets.tolist()
        span_starts: list[int] = batch.span_starts.tolist()
        span_versions: list[int] = batch.span_versions.tolist()
        for i in spanned:
            first, last = span_offsets[i], span_offsets[i + 1]
            version += [(offsets[i] + span_starts[k], span_versions[k], True) for k in range(first, last)]
        version += [
            (offsets[i], -1, True)
            for i in spanned
            if nonempty[i] and (span_offsets[i] == span_offsets[i + 1] or span_starts[span_offsets[i]] > 0)
        ]
    version.sort(key=itemgetter(0))
    version_lo = [start for start, _, _ in version]
    found: list[int] = changes.tolist()
    if found and any(tokened):
        found = [c for c in found if not tokened[bisect_right(offsets, c) - 1]]
    starts = sorted(set(version_lo).union(found)) if found else sorted(set(version_lo))
    of_version = [version[bisect_right(version_lo, start) - 1] for start in starts]
    return starts, [label for _, label, _ in of_version], [kept for _, _, kept in of_version]


def _few_completions(completion: IntArray, max_sampled: IntArray, batch: RolloutBatch) -> list[int]:
    """Per rollout its completion version: the given one (>= 0), else the newest sampled version of its
    samples, else its dispatch version."""
    newest: list[int] = max_sampled.tolist()
    offsets: list[int] = batch.sample_offsets.tolist()
    chosen: list[int] = []
    for given, dispatch, first, last in zip(
        completion.tolist(), batch.dispatch_version.tolist(), offsets, offsets[1:], strict=False
    ):
        sampled = max(newest[first:last], default=NO_VERSION_LOW)
        chosen.append(given if given >= 0 else sampled if sampled > NO_VERSION_LOW else dispatch)
    return chosen


def _few_merged(
    lo: list[int], label: list[int], kept: list[bool], found: TokenSpans
) -> tuple[list[int], list[int], list[bool], list[int]]:
    """The cuts of :func:`_few_cuts` and the token cuts ``found`` in one order (a stable sort on the
    starts): start, label, keep flag and labelled positions (-1: all when labelled) of each."""
    starts = lo + found.starts.tolist()
    order = sorted(range(len(starts)), key=starts.__getitem__)
    labels = label + found.labels.tolist()
    keep = kept + [True] * len(found.starts)
    labelled = [-1] * len(lo) + found.labelled.tolist()
    return (
        [starts[i] for i in order],
        [labels[i] for i in order],
        [keep[i] for i in order],
        [labelled[i] for i in order],
    )


def _few_arrays(
    starts: list[int], labels: list[int], keep: list[bool], labelled: list[int], n_positions: int
) -> tuple[IntArray, IntArray, BoolArray, tuple[IntArray, IntArray, BoolArray]]:
    """The cut arrays of a small batch from its lists: start, label, keep flag, end (the next start; the
    end of the positions with no cut), labelled positions (-1 resolved: all of the cut when it is
    labelled, else none) and whether the cut is mixed (some of its positions labelled, not all)."""
    ends = [*starts[1:], n_positions]
    counts = [
        (end - start if label >= 0 else 0) if count < 0 else count
        for start, end, label, count in zip(starts, ends, labels, labelled, strict=False)
    ]
    return (
        np.array(starts, dtype=np.int64),
        np.array(labels, dtype=np.int64),
        np.array(keep, dtype=bool),
        (
            np.array(ends, dtype=np.int64),
            np.array(counts, dtype=np.int64),
            np.array([0 < n < end - start for start, end, n in zip(starts, ends, counts, strict=False)], dtype=bool),
        ),
    )


def _mask_changes(mask: npt.NDArray[np.floating[Any]]) -> IntArray:
    """Positions where the mask value differs from the previous position's (in parallel chunks)."""
    n = len(mask)
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    if n < PARALLEL_MIN_POSITIONS:  # one pass on this thread: no chunking to pay for
        return (np.flatnonzero(mask[1:] != mask[:-1]) + 1).astype(np.int64, copy=False)
    edges = np.linspace(1, n, num=5, dtype=np.int64)

    def changes(a: int, b: int) -> IntArray:
        return np.flatnonzero(mask[a:b] != mask[a - 1 : b - 1]) + a

    parts = run_all([partial(changes, int(a), int(b)) for a, b in itertools.pairwise(edges)], n)
    return np.concatenate(parts).astype(np.int64)


# Non-negative finite floats, read as unsigned integers of the same width, are exactly those below
# the bit pattern of +inf (the sign bit is the top bit; +0.0 is 0), in the same order. One max per
# span over that view then says both "every value finite and >= +0.0" and "some value non-zero",
# and leaves NaN and signed zeros to the float path.
_UNSIGNED_VIEW = {np.dtype(np.float32): (np.uint32, 0x7F800000), np.dtype(np.float64): (np.uint64, 0x7FF << 52)}


def span_weight_flags(values: npt.NDArray[Any], lo: IntArray, hi: IntArray) -> npt.NDArray[np.uint8]:
    """Per span (``lo``, ``hi``: the cuts, tiling the array) the ``cuts.WEIGHT_*`` bits of a weight array:
    one compiled pass for float16/32/64 (:func:`~staleness_metrics.engine.cuts.weight_flags`), else numpy."""
    if len(lo) == 0:  # (``hi`` then still holds the end of the positions)
        return np.zeros(0, dtype=np.uint8)
    flags = weight_flags(values, lo, hi)
    if flags is None:
        flags = weight_flags_by_extrema(values, lo)
    return flags


def weight_flags_by_extrema(values: npt.NDArray[Any], lo: IntArray) -> npt.NDArray[np.uint8]:
    """The ``cuts.WEIGHT_*`` bits per span from numpy's ``reduceat`` extrema (spans from each ``lo``
    to the next): the engine's former formulation, kept for dtypes the compiled pass does not read."""
    high, low = _span_extrema(values, lo, minima=True)
    flags = np.zeros(len(lo), dtype=np.uint8)
    if len(lo) == 0:
        return flags
    nan = np.isnan(high) | np.isnan(low)  # reduceat propagates NaN
    flags[nan] |= WEIGHT_NAN | WEIGHT_NONZERO
    flags[~(np.isfinite(high) & np.isfinite(low))] |= WEIGHT_NONFINITE
    flags[(high > 0) | (low < 0)] |= WEIGHT_NONZERO
    flags[~(low > 0)] |= WEIGHT_NOT_POSITIVE  # NaN is not > 0 either
    return flags


def _span_extrema(
    values: npt.NDArray[Any], lo: IntArray, minima: bool = False
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Per span maximum and minimum of ``values`` (as floats), read once in the common case.

    When every value is finite and >= +0.0 the minimum is read only if ``minima`` is asked, and is
    zeros otherwise: then only "non-zero" and "finite" are asked of it, and zeros answer both the same way.
    """
    if len(lo) == 0:
        return values[:0], values[:0]
    view = _UNSIGNED_VIEW.get(values.dtype)
    if view is not None and values.flags.c_contiguous:
        unsigned, infinity = view
        bits = values.view(unsigned)
        top = np.maximum.reduceat(bits, lo)
        if bool((top < infinity).all()):  # the same order as the floats: the bits are the extrema
            bottom = np.minimum.reduceat(bits, lo) if minima else np.zeros_like(top)
            return top.view(values.dtype), bottom.view(values.dtype)
    return np.maximum.reduceat(values, lo), np.minimum.reduceat(values, lo)


def _nonzero_or_report(
    values: npt.NDArray[np.floating[Any]],
    name: str,
    flags: npt.NDArray[np.uint8],
    lo: IntArray,
    hi: IntArray,
    kept: BoolArray,
    verdicts: Verdicts,
) -> BoolArray:
    """Per span: whether the weight array holds a non-zero value (a span holding a NaN does not, as
    numpy's extrema said). A non-finite value is searched for by position only in such spans, to name
    the first offender."""
    broken = kept & (flags & WEIGHT_NONFINITE != 0)
    for span in np.flatnonzero(broken).tolist() if broken.any() else ():
        a, b = int(lo[span]), int(hi[span])
        verdicts.positions([a + int(np.flatnonzero(~np.isfinite(values[a:b]))[0])], name, "not a finite number")
    nonzero: BoolArray = flags & (WEIGHT_NONZERO | WEIGHT_NAN) == WEIGHT_NONZERO
    return nonzero
