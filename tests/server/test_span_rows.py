"""The span rows a body is allowed to cut: the count is an upper bound of the cuts the engine makes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.server import decode
from staleness_metrics.server.decode import allowed_span_rows, check_span_rows
from staleness_metrics.server.limits import SPAN_ROW_FLOOR
from tests.support.cuts import token_spans


def _cuts(mask: list[int], tokens: list[int]) -> int:
    n = len(mask)
    found = token_spans(
        np.asarray(tokens, dtype=np.int64),
        np.asarray(mask, dtype=np.float64),
        np.asarray([0, n], dtype=np.int64),
        np.asarray([0], dtype=np.int64),
    )
    return len(found.starts)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0, 1]), st.sampled_from([-1, -1, 0, 1, 2])), min_size=1, max_size=60),
    st.integers(1, 7),
)
def test_the_count_bounds_the_engines_cuts_whatever_the_piece_size(
    positions: list[tuple[int, int]], piece: int
) -> None:
    mask = [m for m, _ in positions]
    tokens = [t for _, t in positions]
    original = decode.PIECE_POSITIONS
    decode.PIECE_POSITIONS = piece  # the pieces join as one pass would: same count at every size
    try:
        counted, _ = decode._sample_rows({"mask": np.asarray(mask, np.int8), "token_versions": np.asarray(tokens)})
    finally:
        decode.PIECE_POSITIONS = original
    assert counted == decode._sample_rows({"mask": mask, "token_versions": tokens})[0]
    assert _cuts(mask, tokens) <= counted <= len(positions)


def test_a_body_passes_until_its_rows_pass_the_allowance_and_the_refusal_names_where() -> None:
    body_bytes = 1024 * 128  # allowance: the floor
    assert allowed_span_rows(body_bytes, 128) == SPAN_ROW_FLOOR
    assert allowed_span_rows(100 * SPAN_ROW_FLOOR * 128, 128) == 100 * SPAN_ROW_FLOOR
    half = SPAN_ROW_FLOOR // 2
    flips = np.tile(np.asarray([0, 1], np.int8), half)  # SPAN_ROW_FLOOR rows
    records = [
        {"id": "a", "samples": [{"mask": flips}]},
        {"id": "b", "samples": [{"mask": np.ones(10, np.int8), "weight_versions": [[0, 0], [5, 1], [7, 2]]}]},
    ]
    exceeded = check_span_rows(records, body_bytes, 128)
    assert exceeded is not None
    assert (exceeded.rollout_id, exceeded.index, exceeded.field) == ("b", 1, "samples[0].weight_versions")
    assert f"more than {SPAN_ROW_FLOOR:,} span rows" in exceeded.reason
    assert check_span_rows(records[:1], body_bytes, 128) is None  # exactly the floor
    assert check_span_rows(records, body_bytes, 0) is None  # no cap
    # more spans than positions: a broken rule the library names (one row counted per position)
    many_spans = [{"id": "s", "samples": [{"mask": [1], "weight_versions": [[0, 0]] * (2 * SPAN_ROW_FLOOR)}]}]
    assert check_span_rows(many_spans, body_bytes, 128) is None
    # realistic runs of one long sample: far below, whatever its length
    runs = np.repeat(np.asarray([1, 0] * 500, np.int8), 200)
    assert check_span_rows([{"id": "r", "samples": [{"mask": runs}]}], body_bytes, 128) is None
