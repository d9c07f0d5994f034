"""Version spans, the per-sample summary the engine judges instead of positions: each sample cut
into spans of one version label and mask value, so positions are read once, here."""

from __future__ import annotations

import contextlib
from collections.abc import Container
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from ..records.validation import Verdicts, check_batch, mark_duplicates
from . import cuts
from .segments import BoolArray, IntArray, expand_ranges, segment_max

NO_VERSION_LOW = np.iinfo(np.int64).min // 4  # "no version": below every real threshold
NO_VERSION_HIGH = np.iinfo(np.int64).max // 4

PART_WHOLE, PART_LABELLED, PART_UNLABELLED = 0, 1, 2
_NO_POSITIONS = np.zeros(0, dtype=np.int64)


class SpanRanges(NamedTuple):
    """Each span row's part and range, as a compiled pass reads them."""

    part: npt.NDArray[np.int8]
    lo: IntArray
    hi: IntArray


class SampleSpans(NamedTuple):
    """Judged samples' rows ``[span_lo, span_hi)`` of the span table and local rollouts."""

    span_lo: IntArray
    span_hi: IntArray
    sample_rollout: IntArray


def as_compiled(samples: SampleSpans, table: SpanRanges) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    as_int = partial(np.ascontiguousarray, dtype=np.int64)
    part = np.ascontiguousarray(table.part, dtype=np.int8)
    return tuple(map(as_int, samples)), (part, as_int(table.lo), as_int(table.hi))


def check_sample_spans(
    samples: tuple[IntArray, IntArray, IntArray],
    table: tuple[npt.NDArray[np.int8], IntArray, IntArray],
    version: IntArray,
    sampled: IntArray,
    n_rollouts: int,
) -> int:  # pragma: no cover - compiled
    """A compiled pass's check that ``samples`` lie in ``table``; the rows' count."""
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


class _TokenVersionBelowMinusOne(Exception):
    """A token version below -1 in a sample :func:`build_spans` cut without checking them."""


def checked_spans(batch: RolloutBatch, known_ids: Container[str] = frozenset()) -> tuple[Verdicts, cuts.SpanTable]:
    """:func:`~staleness_metrics.records.validation.check_batch`, :func:`build_spans`, then
    ``mark_duplicates``: each rollout's first error named as the checks in this order name it."""
    verdicts = check_batch(batch, token_values=False)
    spans = None
    if not verdicts.errors:
        with contextlib.suppress(_TokenVersionBelowMinusOne):
            spans = build_spans(batch, verdicts, token_values=False)
    if spans is None:
        verdicts = check_batch(batch)
        spans = build_spans(batch, verdicts)
    mark_duplicates(verdicts, known_ids)  # (a duplicate's spans are cut, and never queued)
    return verdicts, spans


def build_spans(batch: RolloutBatch, verdicts: Verdicts, *, token_values: bool = True) -> cuts.SpanTable:
    """Cut every sample of ``batch`` into spans, checking the position values into ``verdicts``
    (rollouts invalid there get no spans); without ``token_values``, raises
    ``_TokenVersionBelowMinusOne`` on a token version below -1."""
    pos_off = batch.position_offsets
    sample_rollout = np.repeat(np.arange(batch.n_rollouts), np.diff(batch.sample_offsets))
    cut = np.diff(pos_off) > 0
    if verdicts.errors:
        cut &= ~verdicts.invalid[sample_rollout]
    readable = batch.unmaskable() is None  # (else every rollout is invalid: no weight is read)
    present = [name for name in WEIGHT_FIELDS if getattr(batch, name) is not None and readable]
    weights = [getattr(batch, name) for name in present]
    assert batch.label_kind is not None
    given = (batch.token_versions, batch.span_offsets, batch.span_starts, batch.span_versions)
    labels = cuts.SampleLabels(batch.label_kind, *(_NO_POSITIONS if a is None else a for a in given))
    found = cuts.sample_cuts(labels, batch.mask, pos_off, np.flatnonzero(cut), weights)
    if found.below and not token_values:
        raise _TokenVersionBelowMinusOne
    lo, hi = found.starts, found.ends
    value = batch.mask[lo]  # (a cut holds one mask value)
    bad = (value != 0) & (value != 1)
    if bad.any():
        verdicts.positions(lo[bad].tolist(), "mask", "expected 0 or 1")
    nonzero = {
        name: _nonzero_or_report(values, name, bits, lo, hi, verdicts)
        for name, values, bits in zip(present, weights, found.flags)
    }
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
        rl_bits = found.flags[present.index("rl_weights")]
        rl_doubtful = rl_bits & (cuts.WEIGHT_NAN | cuts.WEIGHT_NOT_POSITIVE) != 0
        mixed = (found.labelled > 0) & (found.labelled < hi - lo)
        parts = _exact_part_liveness(batch, present, lo, hi, rl_doubtful, live, mixed)
        live_labelled, live_unlabelled = parts
    flags = cuts.CutFlags(np.ones(len(lo), dtype=bool), is_sampled, live_labelled, live_unlabelled, side)
    dispatch = batch.dispatch_version[sample_rollout]
    no_version = (NO_VERSION_LOW, NO_VERSION_HIGH)
    rows = cuts.span_rows(lo, hi, found.labels, found.labelled, flags, pos_off, dispatch, no_version)
    completion = batch.completion_version
    assert completion is not None
    newest = segment_max(rows.max_sampled_version, batch.sample_offsets, NO_VERSION_LOW)
    default = np.where(newest > NO_VERSION_LOW, newest, batch.dispatch_version)
    rows.completion = np.where(completion >= 0, completion, default)  # (int64)
    return rows


def _exact_part_liveness(
    batch: RolloutBatch,
    present: list[str],
    lo: IntArray,
    hi: IntArray,
    rl_doubtful: BoolArray,
    live: BoolArray,
    mixed: BoolArray,
) -> tuple[BoolArray, BoolArray]:
    """Per cut, whether its labelled and its unlabelled part has a weighted position."""
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
    """Per cut: a non-zero (not NaN) weight; names the first non-finite value of a cut."""
    broken = flags & cuts.WEIGHT_NONFINITE != 0
    for span in np.flatnonzero(broken).tolist() if broken.any() else ():
        a, b = int(lo[span]), int(hi[span])
        verdicts.positions([a + int(np.flatnonzero(~np.isfinite(values[a:b]))[0])], name, "not a finite number")
    nonzero: BoolArray = flags & (cuts.WEIGHT_NONZERO | cuts.WEIGHT_NAN) == cuts.WEIGHT_NONZERO
    return nonzero
