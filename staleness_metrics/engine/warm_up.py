"""Every compiled loop of the package compiled (or loaded from numba's disk cache) ahead."""

from __future__ import annotations

import numpy as np

from ..metrics.compute import PopulationColumns, WindowCounts, population_summary
from ..metrics.mismatch import mismatch_runs
from ..records.jsonio import zero_one_floats
from ..records.validation import BatchRows, plain_values
from .cuts import CutFlags, SampleLabels, sample_cuts, span_rows
from .judging import slice_rows, stale_rows, zero_spans
from .policies.token import token_decision
from .shipment import shipped_rows
from .spans import SampleSpans, SpanRanges


def warm_up() -> None:
    """Compile (or load from numba's disk cache) every loop ahead, for float32 and float64."""
    tokens = np.array([0, -1, 1], dtype=np.int64)
    offsets = np.array([0, 3], dtype=np.int64)
    lo, hi, count = (np.array([value], dtype=np.int64) for value in (0, 3, 1))
    yes = np.ones(1, dtype=bool)
    flags = CutFlags(yes, yes, yes, yes, ~yes)
    span_rows(lo, hi, count, count, flags, np.array([0, 3]), count, (-(1 << 60), 1 << 60))
    slice_rows(np.array([0]), np.array([0]), np.array([1]), np.array([0]), np.array([1]))
    samples, table = SampleSpans(lo, count, lo), SpanRanges(np.zeros(1, np.int8), lo, hi)
    shipped_rows(samples, table, count, count, (yes, count), (~yes, lo, lo), 2)
    stale_rows(samples, table, count, count, (lo, hi, yes), lo)
    columns = PopulationColumns(~yes, count, count, np.array([0, 1]), ~yes, count, count, np.array([0, 1]), count,
                                count, yes)  # fmt: skip
    population_summary(1, lo, columns, np.array([256]), 4096, np.array([[50, 100]]))
    WindowCounts().add(np.array([0]), "tokens_dropped", np.array([1]))
    zero_one_floats([np.ones(1)])
    token_decision(1, ~yes, np.array([0, 1]), count, ~yes, yes, ~yes, np.array([0, 1]), count, yes)
    for dtype in (np.float32, np.float64):
        arrays = [np.ones(3, dtype=dtype) for _ in range(4)]
        for kind in (0, 1, 2):  # (1-3 weights alike; spans of a sample labelled by spans: none)
            kinds = np.array([kind], dtype=np.int8)
            labels = SampleLabels(kinds, tokens, np.zeros(2, np.int64), lo[:0], lo[:0])
            sample_cuts(labels, arrays[0], offsets, np.array([0], dtype=np.int64), arrays[1:])
            sample_cuts(labels, arrays[0], offsets, np.array([0], dtype=np.int64))
        zero_spans(arrays, tokens, lo, hi, np.array([2], dtype=np.int8), count)
        mismatch_runs(tokens, arrays[0], arrays[1], np.zeros(3, dtype=bool), 0.5, 2.0, offsets, 20.0)
        mismatch_runs(tokens, arrays[0], arrays[1], None, 0.5, 2.0, offsets, 20.0)
        weights = (arrays[1], arrays[2], arrays[3])
        rows = BatchRows(1, np.array([0, 1]), offsets, count, count, np.array([2], dtype=np.int8), 0b111)
        plain_values(rows, arrays[0], weights, tokens)
    # dtypes a large body keeps as is: each, compiled in a request, costs ~60 MB of compiler memory
    mask = np.ones(3, dtype=np.int8)
    kinds = np.array([2], dtype=np.int8)
    for versions in (np.int8, np.int16, np.int32, np.int64):
        tokens = np.array([0, -1, 1], dtype=versions)
        labels = SampleLabels(kinds, tokens, np.zeros(2, np.int64), lo[:0], lo[:0])
        for given in ((), (np.ones(3, dtype=np.float64),)):
            sample_cuts(labels, mask, offsets, np.array([0], dtype=np.int64), given)
            zero_spans([mask, *given], tokens, lo, hi, np.array([2], dtype=np.int8), count)
