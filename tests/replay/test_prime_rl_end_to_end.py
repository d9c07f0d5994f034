"""End to end on records built by verifiers' own classes (tests/support/prime_rl_writer.py): per-token
version labels, a sampled node shared by two branches, a trainer stream cut inside a node, each replayed and
checked against a computation of this file's own; and the committed current-layout example compared with the
values it logged as prime-rl logs them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from staleness_metrics.cli import main
from staleness_metrics.config import StalenessConfig
from staleness_metrics.replay.sources import read_run_events
from staleness_metrics.replay.sources.prime_rl.compare import DROPPED, compare_prime_rl
from staleness_metrics.replay.stream import replay
from tests.support.examples import EXAMPLES

pytest.importorskip("verifiers")
from tests.support.prime_rl_writer import NodeSpec, PrimeRunWriter, make_episode, make_trace

EXAMPLE = EXAMPLES / "prime-rl-run-current"


def _k3(d: float) -> float:
    return math.expm1(d) - d


def test_labels_shared_nodes_and_a_cut_trainer_stream_from_verifiers_records(tmp_path: Path) -> None:
    writer = PrimeRunWriter(tmp_path, chunk_bytes=2_000, frame_bytes=500)
    # trace a: prompt (3) -> reply (2 prompt-side + 4 sampled) -> tool (2) -> reply (1 + 2 sampled); one branch
    a = make_trace("a", [NodeSpec(None, 3), NodeSpec(0, 2, (-0.5,) * 4), NodeSpec(1, 2), NodeSpec(2, 1, (-1.0,) * 2)])
    # trace b: two branches sharing the sampled node 1 (trained in branch 0 only)
    b = make_trace(
        "b", [NodeSpec(None, 2), NodeSpec(0, 0, (-0.25,) * 3), NodeSpec(1, 1, (-0.5,)), NodeSpec(1, 2, (-0.75,) * 2)]
    )
    first = make_episode("E1", [a], env="math", step=3, policy=(1, 3))
    second = make_episode("E2", [b], env="code", step=3, policy=(2, 2))
    writer.labels["E1"] = {(0, 1): [(2, 1), (3, 3)]}  # node 1: k0 unlabelled (-> 1), k1-2 version 2, k3 version 3
    writer.log_episodes([first, second], 4)
    writer.ship([first, second], 4)
    writer.train([first, second], 4, logprob=lambda e, t, br, pos, lp: lp + 0.1, truncate={("a", 0): 8})
    writer.close()

    read = read_run_events(tmp_path)
    shipments = replay(iter(read), StalenessConfig(floor_min_tokens=1))
    assert [s.report.step for s in shipments] == [4]
    metrics = shipments[0].report.metrics
    # T = 3. a: sampled positions 5-8 (node 1) lags 2 (unlabelled: dispatch 1), 1, 1, 0; 12-13 (node 3) lag 2.
    # b: branch 0 positions 2-4 lag 1, 6 lag 1; branch 1 positions 7-8 only (node 1 trained in branch 0): lag 1.
    lags = [2, 1, 1, 0, 2, 2, 1, 1, 1, 1, 1, 1]  # a: 6 positions, b: 4 then 2
    assert metrics["staleness/token/mean"] == pytest.approx(sum(lags) / len(lags))
    assert metrics["staleness/token/unlabelled"] == pytest.approx(9 / 12)
    assert metrics["staleness/rollout/max"] == 2 and metrics["staleness/rollout/newest/max"] == 1
    # a's stream is cut at 8 positions: 5, 6, 7 covered (0 is never), 8 and 12-13 not; the rest all covered
    # (the trainer's value is the sampler's rounded + 0.1, so d = 0.1 up to rounding)
    covered = {"0": 0, "1": 2 + 4 + 2, "2": 1}
    for bucket, tokens in covered.items():
        if tokens:
            assert metrics[f"staleness/mismatch/lag_{bucket}/tokens"] == tokens
            assert metrics[f"staleness/mismatch/lag_{bucket}/k3"] == pytest.approx(_k3(0.1), rel=2e-3)
    assert "staleness/mismatch/lag_0/tokens" not in metrics  # position 8 (lag 0) is past the cut
    assert metrics["staleness/mismatch/coverage"] == pytest.approx(9 / 12)


def test_the_example_reproduces_every_value_prime_rl_logged(tmp_path: Path) -> None:
    """At the run's own bound (5), every logged off_policy/* and mismatch_kl/* value equals ours or prime-rl's
    own rule recomputed from the records; only the dropped count can differ, for the reason it gives."""
    read = read_run_events(EXAMPLE, max_staleness=5)
    shipments = replay(iter(read), StalenessConfig(max_staleness=5))
    rows = compare_prime_rl(EXAMPLE, [s.report for s in shipments], notes=read.notes)
    assert {r.step for r in rows} == set(range(1, 21))
    assert {r.legacy_key for r in rows} >= {"off_policy/mean", "off_policy/in_queue/max", "mismatch_kl/all/mean"}
    for row in rows:
        if row.status == "mismatch":
            assert row.legacy_key == "off_policy/dropped" and row.note == DROPPED, row
            continue
        assert row.status in ("match", "prime_rl_rule"), row
        if row.legacy_rule is not None:  # prime-rl's rule from the records gives what prime-rl logged
            assert row.legacy_rule == pytest.approx(row.historical, rel=0.05, abs=2e-5), row
    frozen_steps = {r.step for r in rows if r.frozen}
    assert frozen_steps and all(
        r.status == "prime_rl_rule" for r in rows if r.step in frozen_steps and r.legacy_key == "off_policy/mean"
    )


def test_report_and_what_if_of_the_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.html"
    assert main(["report", str(EXAMPLE), "-o", str(out)]) == 0
    html = out.read_text()
    for section in ("What staleness costs", "Choosing the bound", "Logged prime-rl values vs recomputed"):
        assert section in html
    assert main(["what-if", str(EXAMPLE), "--max-staleness", "0..6"]) == 0
    assert "suggested bound 3" in capsys.readouterr().out
