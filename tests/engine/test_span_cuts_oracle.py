"""The span table :func:`build_spans` cuts in one compiled pass equals the one the numpy formulation cut
before: every array and dtype, and every error reported, on random small batches holding each kind of
label, bad values and invalid rollouts. The former formulation is kept here as the oracle: version spans,
mask changes and weight bits in numpy (per-span extrema), token runs from the compiled token cut
(``tests/engine/test_kernels.py`` checks that against numpy runs)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleness_metrics import RolloutBatch
from staleness_metrics.engine.cuts import (
    WEIGHT_NAN,
    WEIGHT_NONFINITE,
    WEIGHT_NONZERO,
    WEIGHT_NOT_POSITIVE,
    CutFlags,
    SpanTable,
    span_rows,
)
from staleness_metrics.engine.segments import expand_ranges, segment_max
from staleness_metrics.engine.spans import (
    NO_VERSION_HIGH,
    NO_VERSION_LOW,
    _TokenVersionBelowMinusOne,
    build_spans,
)
from staleness_metrics.records.columnar import LABELS_NONE, LABELS_SPANS, LABELS_TOKENS, WEIGHT_FIELDS
from staleness_metrics.records.validation import Verdicts, check_batch
from tests.support.cuts import token_spans

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# (clean values, then the wild ones a batch draws now and then: each makes its rollout invalid)
WEIGHT_VALUES = [st.sampled_from([0.0, 0.0, 1.0, 1.0, 0.5, -0.0, -1.0]), st.sampled_from([1.0, -0.0, np.nan, np.inf])]
MASK_VALUES = [st.sampled_from([0.0, 1.0, 1.0]), st.sampled_from([0.0, 1.0, 1.0, 0.5])]
TOKEN_LABELS = [st.sampled_from([-1, -1, 0, 1, 2, 3]), st.sampled_from([-1, 0, 1, -2])]
LOGPROBS = [st.sampled_from([-0.5, -1.0]), st.sampled_from([-0.5, np.nan])]
SPAN_LABELS = st.sampled_from([-1, 0, 1, 2, 3])
DTYPES = st.sampled_from([np.float16, np.float32, np.float64])


@st.composite
def small_batches(draw: st.DrawFn) -> RolloutBatch:
    """A batch of 1-5 rollouts of 1-3 samples of 0-9 positions, each sample unlabelled, labelled by
    spans (now and then out of order or past its end) or per position; masks with runs and a stray
    0.5; weights of one or of mixed float widths with zeros, signs, NaN and infinities; now and then a
    repeated id (an invalid rollout) or a rollout without samples."""
    n_rollouts = draw(st.integers(1, 5))
    wild = int(draw(st.integers(0, 3)) == 0)
    per_rollout = [draw(st.integers(0 if wild else 1, 3)) for _ in range(n_rollouts)]
    n_samples = sum(per_rollout)
    lengths = [draw(st.integers(0, 9)) for _ in range(n_samples)]
    n = sum(lengths)
    kinds = [draw(st.sampled_from([LABELS_NONE, LABELS_SPANS, LABELS_TOKENS])) for _ in range(n_samples)]
    mask: list[float] = []  # runs, so cuts by mask changes are few and real
    for length in lengths:
        run: list[float] = []
        while len(run) < length:
            run += [draw(MASK_VALUES[wild])] * draw(st.integers(1, 4))
        mask += run[:length]
    tokens = [
        draw(TOKEN_LABELS[wild]) if kinds[s] == LABELS_TOKENS else -1
        for s, length in enumerate(lengths)
        for _ in range(length)
    ]
    span_counts, span_starts, span_versions = [], [], []
    for s, length in enumerate(lengths):
        if kinds[s] != LABELS_SPANS or (length == 0 and not wild):  # (spans kind, no spans: unlabelled)
            span_counts.append(0)
            continue
        starts = sorted(draw(st.sets(st.integers(0, max(length - 1, 0)), min_size=1, max_size=3)))
        if wild and draw(st.integers(0, 3)) == 0:  # out of order or past the end: the rollout is invalid
            starts = [*starts[::-1], length + 1] if draw(st.booleans()) else [length + 2, *starts]
        span_counts.append(len(starts))
        span_starts += starts
        span_versions += [draw(SPAN_LABELS) for _ in starts]
    ids = [f"r{i}" for i in range(n_rollouts)]
    if n_rollouts > 1 and wild and draw(st.booleans()):
        ids[-1] = ids[0]
    columns: dict[str, Any] = {}
    if draw(st.booleans()):
        dtypes = [draw(DTYPES)] * 3 if draw(st.integers(0, 3)) else [draw(DTYPES) for _ in range(3)]
        for name, dtype in zip(WEIGHT_FIELDS, dtypes):
            if draw(st.integers(0, 2)):
                columns[name] = np.array(
                    [draw(WEIGHT_VALUES[wild and draw(st.booleans())]) for _ in range(n)], dtype=dtype
                )
    if draw(st.booleans()):
        columns["logprobs"] = np.array(
            [draw(LOGPROBS[wild and draw(st.booleans())]) for _ in range(n)], dtype=np.float32
        )
    dispatch = [draw(st.integers(0, 3)) for _ in range(n_rollouts)]
    return RolloutBatch(
        ids=ids,
        sample_offsets=np.concatenate(([0], np.cumsum(per_rollout))),
        position_offsets=np.concatenate(([0], np.cumsum(lengths))),
        mask=np.array(mask, dtype=draw(st.sampled_from([np.float32, np.float64]))),
        dispatch_version=np.array(dispatch, dtype=np.int64),
        completion_version=np.array([draw(st.sampled_from([-1, d, d + 2])) for d in dispatch], dtype=np.int64),
        token_versions=np.array(tokens, dtype=np.int64) if LABELS_TOKENS in kinds else None,
        span_offsets=np.concatenate(([0], np.cumsum(span_counts))),
        span_versions=np.array(span_versions, dtype=np.int64),
        span_starts=np.array(span_starts, dtype=np.int64),
        label_kind=np.array(kinds, dtype=np.int8),
        **columns,
    )


def outcome(build: Any, batch: RolloutBatch, token_values: bool) -> tuple[Any, dict[int, str]]:
    """The table (or the exception's type) and the errors reported, for one way of building."""
    verdicts = check_batch(batch, token_values=token_values)
    try:
        table: Any = build(batch, verdicts, token_values=token_values)
    except _TokenVersionBelowMinusOne:
        table = _TokenVersionBelowMinusOne
    return table, {index: str(error) for index, error in verdicts.errors.items()}


def assert_same_tables(new: Any, former: Any) -> None:
    if not isinstance(former, SpanTable):
        assert new is former
        return
    for name in SpanTable.__dataclass_fields__:
        got, want = getattr(new, name), getattr(former, name)
        assert got.dtype == want.dtype, name
        assert np.array_equal(got, want), (name, got, want)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_batches(), st.booleans())
def test_small_batches_get_the_former_span_table(batch: RolloutBatch, token_values: bool) -> None:
    """What the sink judges (spans, per-sample facts, completion versions) and the errors it names for
    a small batch are those of the former numpy formulation, exactly."""
    former, former_errors = outcome(former_build_spans, batch, token_values)
    new, new_errors = outcome(build_spans, batch, token_values)
    assert new_errors == former_errors
    assert_same_tables(new, former)


# The former formulation, verbatim but for its names.
def former_build_spans(batch: RolloutBatch, verdicts: Verdicts, *, token_values: bool = True) -> SpanTable:
    """Cut every sample of ``batch`` into spans of one version label and one mask value.

    Also checks the position values (0/1 mask, finite weights and log-probabilities) and reports
    offenders into ``verdicts``. Samples of rollouts already invalid there get no spans. Without
    ``token_values`` (the caller did not check that token versions are >= -1), raises
    ``_TokenVersionBelowMinusOne`` when a sample it cuts has one (:func:`checked_spans`).
    """
    pos_off = batch.position_offsets
    n_positions = batch.n_positions
    sample_rollout = np.repeat(np.arange(batch.n_rollouts), np.diff(batch.sample_offsets))
    valid_sample = ~verdicts.invalid[sample_rollout]
    nonempty = np.diff(pos_off) > 0
    tokened = valid_sample & (batch.label_kind == LABELS_TOKENS) & nonempty
    mask = batch.mask
    # Token-labelled samples find their mask changes in the compiled pass that cuts them; the others here.
    changes = (np.flatnonzero(mask[1:] != mask[:-1]) + 1).astype(np.int64)

    # Cuts: the spans of one mask value that tile the flat arrays. Samples labelled per position get
    # theirs from runs of token_versions (scattered unlabelled positions do not cut them: they form the
    # cut's unlabelled part); every other sample from its version spans, refined where the mask changes.
    version_lo, version_label, version_kept = former_version_spans(batch, valid_sample, tokened)
    outside: BoolArray | slice = slice(None)
    if tokened.any() and len(changes):
        outside = ~tokened[np.searchsorted(pos_off, changes, "right") - 1]
    lo = np.union1d(version_lo, changes[outside]).astype(np.int64)
    of_version = np.searchsorted(version_lo, lo, "right") - 1
    label, kept = version_label[of_version], version_kept[of_version]
    labelled = np.full(len(lo), -1)  # labelled positions per cut; -1: all of them when the label is >= 0
    present = [name for name in WEIGHT_FIELDS if getattr(batch, name) is not None]
    weights = [getattr(batch, name) for name in present]
    if tokened.any():
        assert batch.token_versions is not None
        found = token_spans(batch.token_versions, mask, pos_off, np.flatnonzero(tokened))
        if found.below and not token_values:
            raise _TokenVersionBelowMinusOne
        t_lo = found.starts
        if len(lo) == 0:  # every sample labelled per position (the usual token_versions batch): no merge
            lo, label, labelled = t_lo, found.labels, found.labelled
            kept = np.ones(len(t_lo), dtype=bool)
        else:
            order = np.argsort(np.concatenate((lo, t_lo)), kind="stable")
            lo = np.concatenate((lo, t_lo))[order]
            label = np.concatenate((label, found.labels))[order]
            kept = np.concatenate((kept, np.ones(len(t_lo), dtype=bool)))[order]
            labelled = np.concatenate((labelled, found.labelled))[order]
    hi = np.append(lo[1:], n_positions).astype(np.int64)
    labelled = np.where(labelled < 0, np.where(label >= 0, hi - lo, 0), labelled)
    mixed = (labelled > 0) & (labelled < hi - lo)

    value = mask[lo]
    bad = kept & (value != 0) & (value != 1)
    if bad.any():
        verdicts.positions(lo[bad].tolist(), "mask", "expected 0 or 1")
    is_sampled = value == 1
    flags = [weight_flags_by_extrema(values, lo) for values in weights]
    nonzero: dict[str, BoolArray | None] = dict.fromkeys(WEIGHT_FIELDS)
    for name, bits in zip(present, flags):
        nonzero[name] = former_nonzero_or_report(getattr(batch, name), name, bits, lo, hi, kept, verdicts)
    rl = nonzero["rl_weights"]
    other = np.zeros(len(lo), dtype=bool)  # a ce or ref-KL weight
    for name in ("ce_weights", "ref_kl_weights"):
        if nonzero[name] is not None:
            other |= nonzero[name]
    live = is_sampled.copy() if rl is None else is_sampled & (rl | other)  # no rl_weights: 1.0 on the mask
    side = ~is_sampled & other

    # Rows: one per kept cut, two per mixed cut (its labelled part, then its unlabelled part), and the
    # per-sample reductions, in one compiled pass over the cuts.
    live_labelled, live_unlabelled = live, live
    if rl is not None and (mixed & live).any():
        rl_positive = flags[present.index("rl_weights")] & (WEIGHT_NAN | WEIGHT_NOT_POSITIVE) == 0
        live_labelled, live_unlabelled = former_exact_part_liveness(batch, present, lo, hi, rl_positive, live, mixed)
    hi = hi[: len(lo)]  # (with no cut, hi held the end of the positions)
    cut_flags = CutFlags(kept, is_sampled, live_labelled, live_unlabelled, side)
    rows = span_rows(lo, hi, label, labelled, cut_flags, pos_off, batch.dispatch_version[sample_rollout],
                     (NO_VERSION_LOW, NO_VERSION_HIGH))  # fmt: skip
    max_sampled = rows.max_sampled_version

    completion = batch.completion_version
    assert completion is not None
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
        completion=completion.astype(np.int64),
    )


def weight_flags_by_extrema(values: npt.NDArray[Any], lo: IntArray) -> npt.NDArray[np.uint8]:
    """The ``cuts.WEIGHT_*`` bits per span from numpy's ``reduceat`` extrema (spans from each ``lo`` to the next)."""
    flags = np.zeros(len(lo), dtype=np.uint8)
    if len(lo) == 0:
        return flags
    high, low = np.maximum.reduceat(values, lo), np.minimum.reduceat(values, lo)
    nan = np.isnan(high) | np.isnan(low)  # reduceat propagates NaN
    flags[nan] |= WEIGHT_NAN | WEIGHT_NONZERO
    flags[~(np.isfinite(high) & np.isfinite(low))] |= WEIGHT_NONFINITE
    flags[(high > 0) | (low < 0)] |= WEIGHT_NONZERO
    flags[~(low > 0)] |= WEIGHT_NOT_POSITIVE  # NaN is not > 0 either
    return flags


def former_nonzero_or_report(
    values: npt.NDArray[np.floating[Any]],
    name: str,
    flags: npt.NDArray[np.uint8],
    lo: IntArray,
    hi: IntArray,
    kept: BoolArray,
    verdicts: Verdicts,
) -> BoolArray:
    broken = kept & (flags & WEIGHT_NONFINITE != 0)
    for span in np.flatnonzero(broken).tolist():
        a, b = int(lo[span]), int(hi[span])
        verdicts.positions([a + int(np.flatnonzero(~np.isfinite(values[a:b]))[0])], name, "not a finite number")
    nonzero: BoolArray = flags & (WEIGHT_NONZERO | WEIGHT_NAN) == WEIGHT_NONZERO
    return nonzero


def former_exact_part_liveness(
    batch: RolloutBatch,
    present: list[str],
    lo: IntArray,
    hi: IntArray,
    rl_positive: BoolArray,
    live: BoolArray,
    mixed: BoolArray,
) -> tuple[BoolArray, BoolArray]:
    """Per cut, whether its labelled and its unlabelled part has a weighted position of its own: as ``live``
    as the cut, except for live ``mixed`` cuts with an rl weight that is not above 0 somewhere
    (``rl_positive`` false), whose positions are read one by one.

    Both parts are live at once when every rl weight of the cut is above 0."""
    cuts = np.flatnonzero(mixed & live)
    doubt = cuts[~rl_positive[cuts]]  # a zero (or negative, or NaN) rl weight somewhere in the cut
    labelled_part, unlabelled_part = live.copy(), live.copy()
    if len(doubt) == 0:
        return labelled_part, unlabelled_part
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


def former_version_spans(
    batch: RolloutBatch, valid_sample: BoolArray, tokened: BoolArray
) -> tuple[IntArray, IntArray, BoolArray]:
    """Start, label and keep flag of the version spans of the samples ``valid_sample`` selects, and of
    filler spans (not kept) for the samples of invalid rollouts. Token-labelled valid samples are cut by
    :func:`token_spans` instead.
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
