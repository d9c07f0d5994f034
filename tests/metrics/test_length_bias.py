"""SPEC 12 by hand: what masking and drops remove, by response length."""

from __future__ import annotations

from typing import Any

import pytest

from staleness_metrics import Sink, StalenessConfig


def rollout(rid: str, spans: list[tuple[int, int]], env: str | None = None, dispatch: int = 0) -> dict[str, Any]:
    """One sample of sum(lengths) sampled positions, ``spans`` = [(version, length), ...]."""
    starts, start = [], 0
    for version, length in spans:
        starts.append([version, start])
        start += length
    record: dict[str, Any] = {
        "id": rid,
        "dispatch_version": dispatch,
        "samples": [{"mask": [1] * start, "weight_versions": starts}],
    }
    if env is not None:
        record["env"] = env
    return record


def test_masked_tails_and_drops_by_length_bucket() -> None:
    sink = Sink(StalenessConfig(max_staleness=2, env_breakdown=True))
    sink.add(
        [
            rollout("short", [(5, 100)], env="math"),  # fresh: trains whole
            rollout("mid", [(1, 300), (5, 400)], env="code", dispatch=1),  # 700 positions, 300 masked
            rollout("long", [(0, 3000), (5, 1000)], env="code"),  # 4000 positions, 3000 masked
            rollout("huge", [(6, 20_000)], env="math", dispatch=6),  # 20000 positions, fresh
        ]
    )
    sink.add(rollout("gone", [(1, 2000)], env="math", dispatch=1))  # every position stale: dropped
    shipment = sink.ship(7)  # T = 6, bound 4
    m = shipment.metrics
    assert shipment.dropped_rollouts == ("gone",)
    samples = 5
    sampled = 100 + 700 + 4000 + 20_000 + 2000
    removed = 300 + 3000 + 2000
    assert m["staleness/length/sampled/mean"] == sampled / samples
    assert m["staleness/length/trained/mean"] == (sampled - removed) / samples
    assert m["staleness/length/bucket_256/masked"] == 0.0
    assert m["staleness/length/bucket_1k/masked"] == 300 / 700
    assert m["staleness/length/bucket_4k/masked"] == (3000 + 2000) / (4000 + 2000)
    assert "staleness/length/bucket_16k/masked" not in m  # no sample of 4097..16384 sampled positions
    assert m["staleness/length/bucket_inf/masked"] == 0.0
    # the env breakdown repeats the keys per env
    assert m["staleness/env/code/length/sampled/mean"] == (700 + 4000) / 2
    assert m["staleness/env/math/length/trained/mean"] == (100 + 20_000) / 3
    assert m["staleness/env/math/length/bucket_4k/masked"] == 1.0
    # the tallies behind the Prometheus counters
    tally = shipment.report.tally
    assert tally.length_samples == samples
    assert tally.length_sampled.tolist() == [100, 700, 6000, 0, 20_000]
    assert tally.length_removed.tolist() == [0, 300, 5000, 0, 0]


@pytest.mark.parametrize(("length", "bucket"), [(256, "256"), (257, "1k"), (1024, "1k"), (4097, "16k"), (16385, "inf")])
def test_bucket_edges(length: int, bucket: str) -> None:
    sink = Sink(StalenessConfig())
    sink.add(rollout("r", [(0, length)]))
    metrics = sink.ship(1).metrics
    assert [k for k in metrics if k.startswith("staleness/length/bucket_")] == [
        f"staleness/length/bucket_{bucket}/masked"
    ]


def test_frozen_rollouts_and_samples_without_sampled_positions() -> None:
    sink = Sink(StalenessConfig())
    sink.add({"id": "f", "source": "frozen", "samples": [{"mask": [1, 1, 1]}]})
    assert not any(k.startswith("staleness/length/") for k in sink.ship(1).metrics)  # frozen: not in the population
    sink.add({"id": "p", "dispatch_version": 0, "samples": [{"mask": [0, 0]}, {"mask": [1, 1, 1, 1]}]})
    metrics = sink.ship(1).metrics
    assert metrics["staleness/length/sampled/mean"] == 2.0  # the prompt-only sample counts as 0 in the mean
    assert metrics["staleness/length/bucket_256/masked"] == 0.0
