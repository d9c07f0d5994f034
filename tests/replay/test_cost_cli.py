"""What staleness costs from the command line: ``replay`` reports the SPEC 11 family of records that carry
``trainer_logprobs``, and ``what-if`` the cost of what each bound lets train. A hand-made stream, values
computed by hand."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from staleness_metrics.cli import main
from staleness_metrics.config import PolicyName, StalenessConfig
from staleness_metrics.demo import Simulation
from staleness_metrics.metrics.mismatch import mismatch_sums
from staleness_metrics.replay.sources import as_replay_events
from staleness_metrics.replay.stream import replay


def k3(d: float) -> float:
    return math.exp(d) - 1 - d


# Step 3 trains version T = 2. Positions and their lag (T - version) and d = trainer - sampler:
#   a: prompt (mask 0), then lags 2, 2, 1 with d = -0.5, +0.5, 0
#   b: lags 1, 1 with d = 0, +0.25
#   c: lags 0, 0 with d = -0.1, uncovered (null)
EVENTS: list[dict[str, Any]] = [
    {"type": "rollout", "rollout": {"id": "a", "dispatch_version": 0, "samples": [{
        "mask": [0, 1, 1, 1], "token_versions": [-1, 0, 0, 1],
        "logprobs": [0.0, -1.0, -1.0, -1.0], "trainer_logprobs": [None, -1.5, -0.5, -1.0]}]}},
    {"type": "rollout", "rollout": {"id": "b", "dispatch_version": 1, "samples": [{
        "mask": [1, 1], "token_versions": [1, 1], "logprobs": [-2.0, -2.0], "trainer_logprobs": [-2.0, -1.75]}]}},
    {"type": "rollout", "rollout": {"id": "c", "dispatch_version": 2, "samples": [{
        "mask": [1, 1], "token_versions": [2, 2], "logprobs": [-1.0, -1.0], "trainer_logprobs": [-1.1, None]}]}},
    {"type": "ship", "step": 3},
]  # fmt: skip

K3_0 = k3(-0.1)
K3_1 = (k3(0.0) + k3(0.0) + k3(0.25)) / 3
K3_2 = (k3(-0.5) + k3(0.5)) / 2


@pytest.fixture
def events(tmp_path: Path) -> Path:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    return path


def test_replay_reports_the_family_computed_by_hand(events: Path, tmp_path: Path) -> None:
    out = tmp_path / "metrics.jsonl"
    argv = ["replay", str(events), "--max-staleness", "8", "--floor-min-tokens", "1", "--metrics-out", str(out)]
    assert main(argv) == 0
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    family = {k: v for k, v in row.items() if k.startswith(("staleness/mismatch/", "staleness/bound/"))}
    # SPEC 14: lag 0's one token is the floor (floor_min_tokens 1), and the budget: the floor
    # (0.0048) is crossed from lag 1 on (0.0065 more): the suggestion is 0; bound 8 is past lag 2.
    assert family.pop("staleness/mismatch/floor_source") == "lag0"
    expected = {
        "staleness/mismatch/lag_0/tokens": 1,
        "staleness/mismatch/lag_0/k3": K3_0,
        "staleness/mismatch/lag_0/abs_log_ratio": 0.1,
        "staleness/mismatch/lag_0/out_of_band": 0.0,
        "staleness/mismatch/lag_0/ess": 1.0,
        "staleness/mismatch/lag_1/tokens": 3,
        "staleness/mismatch/lag_1/k3": K3_1,
        "staleness/mismatch/lag_1/abs_log_ratio": 0.25 / 3,
        "staleness/mismatch/lag_1/out_of_band": 0.0,
        "staleness/mismatch/lag_1/ess": (2 + math.exp(0.25)) ** 2 / (3 * (2 + math.exp(0.5))),
        "staleness/mismatch/lag_1/excess_k3": K3_1 - K3_0,
        "staleness/mismatch/lag_2/tokens": 2,
        "staleness/mismatch/lag_2/k3": K3_2,
        "staleness/mismatch/lag_2/abs_log_ratio": 0.5,
        "staleness/mismatch/lag_2/out_of_band": 0.0,
        "staleness/mismatch/lag_2/ess": (math.exp(-0.5) + math.exp(0.5)) ** 2 / (2 * (math.exp(-1) + math.exp(1))),
        "staleness/mismatch/lag_2/excess_k3": K3_2 - K3_0,
        "staleness/mismatch/k3": (K3_0 + 3 * K3_1 + 2 * K3_2) / 6,
        "staleness/mismatch/excess_k3": (3 * K3_1 + 2 * K3_2) / 5 - K3_0,
        "staleness/mismatch/coverage": 6 / 7,
        "staleness/mismatch/floor": K3_0,
        "staleness/mismatch/floor_age": 0,
        "staleness/mismatch/budget": K3_0,
        "staleness/mismatch/curve/lag_1": K3_1 - K3_0,
        "staleness/mismatch/curve/lag_2": K3_2 - K3_0,
        "staleness/bound/suggested": 0,
        "staleness/bound/crossed": 1,
        "staleness/bound/excess_at_bound": K3_2 - K3_0,
    }
    assert family == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("missing", ["null", "NaN", "-Infinity"])
def test_replay_reads_a_sampler_logprob_lacking_a_value_as_uncovered(missing: str, tmp_path: Path) -> None:
    """SPEC 11 (either value): c's sampler value at its first position missing too leaves nothing of c
    covered; the line is read (exit 0, through the fast reader or not), and --batches-out writes null."""
    lines = [json.dumps(e) for e in EVENTS]
    lines[2] = lines[2].replace('"logprobs": [-1.0, -1.0]', f'"logprobs": [{missing}, -1.0]')
    path, out, batches = tmp_path / "events.jsonl", tmp_path / "metrics.jsonl", tmp_path / "batches.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(path), "--metrics-out", str(out), "--batches-out", str(batches)]) == 0
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["staleness/mismatch/coverage"] == 5 / 7 and "staleness/mismatch/lag_0/tokens" not in row
    [shipped] = [r for r in json.loads(batches.read_text())["shipped"] if r["id"] == "c"]
    assert shipped["samples"][0]["logprobs"] == [None, -1.0]


def test_what_if_adds_the_cost_of_what_each_bound_lets_train(events: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["what-if", str(events), "--max-staleness", "0..2", "--floor-min-tokens", "1", "--json"]) == 0
    rows = {r["max_staleness"]: r for r in json.loads(capsys.readouterr().out)}
    # Bound 0 masks every lag >= 1: only c's covered lag-0 token trains; no stale token, so no excess.
    assert (rows[0]["trained_covered"], rows[0]["trained_excess_k3"]) == (1, None)
    assert rows[0]["trained_k3"] == pytest.approx(K3_0)
    # Bound 1 masks a's two lag-2 tokens: the lag-1 tokens and the lag-0 one train.
    assert rows[1]["trained_covered"] == 4
    assert rows[1]["trained_k3"] == pytest.approx((K3_0 + 3 * K3_1) / 4)
    assert rows[1]["trained_excess_k3"] == pytest.approx(K3_1 - K3_0)
    # Bound 2 masks nothing: the cost is the whole run's family.
    assert rows[2]["trained_covered"] == 6
    assert rows[2]["trained_k3"] == pytest.approx((K3_0 + 3 * K3_1 + 2 * K3_2) / 6)
    assert rows[2]["trained_excess_k3"] == pytest.approx((3 * K3_1 + 2 * K3_2) / 5 - K3_0)

    assert main(["what-if", str(events), "--max-staleness", "1,2", "--floor-min-tokens", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    header = re.split(r"\s{2,}", table[0].strip())
    assert header[header.index("held") + 1 : header.index("held") + 3] == ["trained k3", "trained excess k3"]
    at_one = dict(zip(header, re.split(r"\s{2,}", table[2].strip()), strict=True))
    assert (at_one["max_staleness"], at_one["trained k3"], at_one["trained excess k3"]) == (
        "1",
        f"{(K3_0 + 3 * K3_1) / 4:.4g}",
        f"{K3_1 - K3_0:.4g}",
    )


def test_what_if_without_trainer_logprobs_has_no_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = [json.loads(json.dumps(e)) for e in EVENTS]
    for event in plain[:-1]:
        for sample in event["rollout"]["samples"]:
            del sample["trainer_logprobs"]
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in plain))
    assert main(["what-if", str(path), "--max-staleness", "1", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["trained_covered"], row["trained_k3"], row["trained_excess_k3"]) == (None, None, None)
    assert main(["what-if", str(path), "--max-staleness", "1"]) == 0
    assert "trained" not in capsys.readouterr().out


@pytest.mark.parametrize("policy", ["token", "episode", "group", "xtuner"])
def test_the_trained_cost_leaves_out_exactly_what_the_sink_masked(policy: str) -> None:
    """One decision: per ship and lag bucket, trained tokens = covered tokens - those the sink counted masked;
    and the sums equal those of the shipped records' arrays where their masks train (what a trainer reads)."""
    rng = np.random.default_rng(3)
    events: list[dict[str, Any]] = []
    for _, step in zip(range(12), Simulation(4).steps(), strict=False):
        for event in step.events():
            for sample in event.get("rollout", {}).get("samples", []):
                n = len(sample["mask"])
                sample["logprobs"] = (-rng.exponential(0.7, n)).tolist()
                trainer = (np.asarray(sample["logprobs"]) + rng.normal(0, 0.3, n)).tolist()
                sample["trainer_logprobs"] = [None if rng.random() < 0.05 else v for v in trainer]
            events.append(event)
    for bound in (0, 2, 5):
        config = StalenessConfig(policy=cast(PolicyName, policy), max_staleness=bound)
        total_trained = 0
        for shipment in replay(as_replay_events(events), config):
            trained = shipment.trained_sums(config.mismatch_band)
            everything = shipment.report.mismatch
            if everything is None:  # at bound 0 a ship may take nothing: no sums on either side
                assert trained is None and shipment.ids == []
                continue
            assert trained is not None
            assert trained.tokens.tolist() == (everything.tokens - everything.masked).tolist()
            assert trained.masked.sum() == 0
            samples = [s for r in shipment.rollouts for s in r.record(arrays=True)["samples"]]
            lags = np.where(np.concatenate([s["mask"] for s in samples]) > 0, shipment.lags, -1)
            sampler, trainer = (np.concatenate([s[name] for s in samples]) for name in ("logprobs", "trainer_logprobs"))
            from_records = mismatch_sums(lags, sampler, trainer, band=config.mismatch_band)
            assert from_records.tokens.tolist() == trained.tokens.tolist()
            np.testing.assert_allclose(from_records.sum_k3, trained.sum_k3, rtol=1e-12, atol=1e-12)
            total_trained += trained.covered
        assert total_trained > 0
