"""A ship's spans and shipped rollouts are found when first asked for (its lags, its log-probability sums,
its records): asked for after many more adds, ships and compactions of the sink, they are what they were at
the ship."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import Sink, StalenessConfig


def records(seed: int, step: int, count: int, trainer: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        samples = []
        for _ in range(int(rng.integers(1, 3))):
            n = int(rng.integers(1, 12))
            versions = rng.integers(max(step - 4, 0), step, n)
            versions[rng.random(n) < 0.2] = -1  # scattered unlabelled positions: mixed spans
            mask = (rng.random(n) < 0.8).astype(int)
            logprobs = rng.normal(-1, 0.3, n).tolist()
            sample = {"mask": mask.tolist(), "token_versions": versions.tolist(), "logprobs": logprobs}
            if trainer:  # (SPEC 11's sums from the records: the spans are found at the ship)
                sample["trainer_logprobs"] = rng.normal(-1, 0.3, n).tolist()
            samples.append(sample)
        out.append({"id": f"{seed}-{step}-{i}", "dispatch_version": max(step - 2, 0), "samples": samples})
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bound=st.integers(0, 3), ships=st.integers(2, 8), trainer=st.booleans())
def test_lags_read_late_equal_lags_read_at_the_ship(seed: int, bound: int, ships: int, trainer: bool) -> None:
    config = StalenessConfig(max_staleness=bound, adapt_every=None)
    at_once, late = Sink(config, compact_min_rows=0), Sink(config, compact_min_rows=0)
    now: list[tuple[list[int], list[int], dict[str, Any]]] = []
    kept = []
    for step in range(1, ships + 1):
        for sink in (at_once, late):
            sink.add(records(seed + step, step, 1 + (seed + step) % 4, trainer))
        shipped = at_once.ship(step)
        now.append((shipped.lags.tolist(), shipped.lag_offsets.tolist(), shipped.batches_line()))
        kept.append(late.ship(step))
        assert kept[-1].report.metrics == shipped.report.metrics
    assert late.tracked_rollouts == late.queued  # compacted at every ship: the tables read at the ship are gone
    assert [(s.lags.tolist(), s.lag_offsets.tolist(), s.batches_line()) for s in kept] == now
