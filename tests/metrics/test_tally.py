"""``Tally.summed``: a run's totals folded in one pass are exactly the ships' tallies added in order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics.metrics.report import _COUNT_FIELDS, _COUNTS_FIELDS, Tally

counts = st.lists(st.integers(0, 2**40), min_size=0, max_size=6).map(lambda v: np.array(v, dtype=np.int64))


@st.composite
def tallies(draw: st.DrawFn) -> Tally:
    fields = {name: draw(st.integers(0, 2**40)) for name in _COUNT_FIELDS}
    fields.update({name: draw(counts) for name in _COUNTS_FIELDS})
    return Tally(**fields)


@settings(max_examples=150, deadline=None)
@given(st.lists(tallies(), min_size=1, max_size=8))
def test_summed_is_the_chain_of_adds(parts: list[Tally]) -> None:
    chained = parts[0]
    for part in parts[1:]:
        chained = chained + part
    summed = Tally.summed(parts)
    for name in _COUNT_FIELDS:
        assert getattr(summed, name) == getattr(chained, name), name
    for name in _COUNTS_FIELDS:
        got, want = getattr(summed, name), getattr(chained, name)
        assert got.dtype == np.int64 and got.tolist() == want.tolist(), name  # same length, not only equal


def test_a_sinks_totals_are_read_the_same_however_often() -> None:
    from staleness_metrics import Sink, StalenessConfig

    def run(read_every_ship: bool) -> Tally:
        sink = Sink(StalenessConfig(max_staleness=1))
        for step in range(1, 8):
            sink.add({"id": f"r{step}", "dispatch_version": max(0, step - 3), "samples": [{"mask": [0, 1, 1]}]})
            sink.ship(step)
            if read_every_ship:
                assert sink.totals.rollouts_shipped + sink.totals.rollouts_dropped == step
        return sink.totals

    once, every = run(False), run(True)
    assert once == every and once.rollouts_dropped > 0 and once.tokens_sampled > 0
