"""What staleness costs, through a real Prometheus: the recording rules and the dashboards' PromQL over the
scraped sums give the W&B values of the run, and of two processes merged.

Exactness: a rate's extrapolation factor is the same for every series of one scrape target whose first
sample in the window is 0, so ratios of rates are exact up to float rounding. The tests therefore expose
the families at 0 first (an empty ship, zero sums) and wait for a scrape before any data; the two
processes push to one Pushgateway, scraped as one target, as jobs Prometheus cannot scrape do.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from staleness_metrics.config import StalenessConfig
from staleness_metrics.dashboards.rules import MISMATCH_RECORDS
from staleness_metrics.exporters.prometheus import PrometheusExporter, PrometheusPushExporter
from staleness_metrics.metrics.metric_table import LAG, LENGTH
from staleness_metrics.metrics.mismatch import MismatchSums, mismatch_sums
from staleness_metrics.metrics.report import Tally
from staleness_metrics.monitor import StalenessMonitor
from tests.dashboards.grafana_queries import dashboards, fill, panels
from tests.exporters.reports import random_rollouts
from tests.support.prometheus import (
    PushgatewayServer,
    RulesPrometheusServer,
    requires_prometheus,
    requires_pushgateway,
)

# No env breakdown: every length series is env="". A few lag-0 tokens per step give SPEC 14's floor.
CONFIG = StalenessConfig(max_staleness=3, floor_min_tokens=2)
REL = 1e-9  # Prometheus sums series in no fixed order: float rounding only

pytestmark = [pytest.mark.integration, requires_prometheus]


def live_sums(rng: np.random.Generator, n: int) -> MismatchSums:
    """Trainer-side sums of ``n`` positions: lags up to 80, a drift growing with the lag, a few NaN."""
    lags = rng.integers(0, 81, n)
    sampler = -rng.random(n) * 3
    trainer = sampler + rng.normal(0.0, 0.02, n) + 0.01 * lags * rng.random(n)
    trainer[rng.random(n) < 0.05] = np.nan
    return mismatch_sums(lags, sampler, trainer, masked=lags > CONFIG.max_staleness)


def floor_of(monitor: StalenessMonitor, step: int) -> float:
    """SPEC 14's floor of the step's merged trainer sums: what the floor gauge shows after the step."""
    metrics = monitor.mismatch_metrics(step)
    assert metrics is not None
    return float(metrics["staleness/mismatch/floor"])


def merged_excess(parts: list[tuple[MismatchSums, float]]) -> dict[str, float]:
    """The excess the fleet panels show over several runs: each run's tokens over its own floor,
    Σ (Σk3 - tokens · floor) / Σ tokens, per lag bucket from 1 (keyed by the lag label) and over every stale
    token (key "")."""
    out = {}
    for i, value in enumerate(LAG.values[1:], start=1):
        tokens = sum(int(s.tokens[i]) for s, _ in parts)
        if tokens:
            out[value] = sum(float(s.sum_k3[i]) - int(s.tokens[i]) * f for s, f in parts) / tokens
    stale = sum(int(s.tokens[1:].sum()) for s, _ in parts)
    out[""] = sum(float(s.sum_k3[1:].sum()) - int(s.tokens[1:].sum()) * f for s, f in parts) / stale
    return out


def by_label(result: list[dict[str, object]], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}  # type: ignore[index, union-attr]


def wandb_by_lag(metrics: Mapping[str, float | int], stat: str) -> dict[str, float]:
    """The W&B keys ``staleness/mismatch/lag_<b>/<stat>``, keyed by the Prometheus lag label value."""
    out = {}
    for bucket, value in zip(LAG.buckets, LAG.values, strict=True):
        key = f"staleness/mismatch/lag_{bucket}/{stat}"
        if key in metrics:
            out[value] = float(metrics[key])
    return out


def length_values(tally: Tally) -> dict[str, object]:
    """SPEC 12 of a (merged) tally, as the core's W&B keys define them."""
    sampled, removed = tally.length_sampled, tally.length_removed
    return {
        "sampled": int(sampled.sum()) / tally.length_samples,
        "trained": (int(sampled.sum()) - int(removed.sum())) / tally.length_samples,
        "removed": {LENGTH.values[i]: int(removed[i]) / int(sampled[i]) for i in np.flatnonzero(sampled)},
    }


def approx(values: Mapping[str, float]) -> object:
    return pytest.approx(dict(values), rel=REL, abs=1e-15)


def test_recording_rules_over_the_scraped_sums_give_the_wandb_values(tmp_path: Path) -> None:
    run = "cost-run"
    exporter = PrometheusExporter(port=0)
    monitor = StalenessMonitor(CONFIG, [exporter], run=run)
    rng = random.Random(5)
    nrng = np.random.default_rng(5)
    try:
        assert exporter.port is not None
        with RulesPrometheusServer(tmp_path, [f"127.0.0.1:{exporter.port}"], job="trainer") as prom:
            monitor.ship(1)  # empty: the length families at 0
            monitor.record_mismatch(1, MismatchSums.zero())  # the mismatch families at 0
            zero = f'sum(rl_staleness_mismatch_tokens_total{{run="{run}"}}) + sum(rl_staleness_length_samples_total)'
            prom.wait_until(lambda: prom.query_value(zero) == 0)

            total, tally = MismatchSums.zero(), Tally()
            for step in range(8, 14):
                monitor.add(random_rollouts(rng, step, 8, prefix="c"))
                report = monitor.ship(step).report
                assert report.mismatch is not None  # the sink path
                total, tally = total + report.mismatch, tally + report.tally
                live = live_sums(nrng, 500)  # the live path, for the same step
                monitor.record_mismatch(step, live)
                total = total + live
            # Over the window, the excess is the window's k3 minus the latest floor (the floor gauge): SPEC 11's
            # excess keys of the window's sums over that floor.
            floor = floor_of(monitor, 13)
            expected = total.metrics(floor=floor)
            assert "staleness/mismatch/excess_k3" in expected and "staleness/mismatch/lag_0/excess_k3" not in expected

            def recorded(key: str, label: str = "") -> dict[str, float]:
                return by_label(prom.query(f'{MISMATCH_RECORDS[key]}{{run="{run}"}}'), label)

            def settled() -> bool:  # the rules evaluated over the final counters (rules that read recorded
                # series trail the others by one evaluation, so wait for the last of them too)
                return recorded("k3_by_lag", "lag") == approx(wandb_by_lag(expected, "k3")) and recorded(
                    "excess_k3"
                ) == approx({"": expected["staleness/mismatch/excess_k3"]})

            prom.wait_until(settled)
            assert prom.query_value(f'rl_staleness_mismatch_floor_nats{{run="{run}"}}') == floor
            assert recorded("k3_by_lag", "lag") == approx(wandb_by_lag(expected, "k3"))
            assert recorded("excess_k3_by_lag", "lag") == approx(wandb_by_lag(expected, "excess_k3"))
            assert recorded("ess_by_lag", "lag") == approx(wandb_by_lag(expected, "ess"))
            assert recorded("out_of_band_by_lag", "lag") == approx(wandb_by_lag(expected, "out_of_band"))
            assert set(recorded("k3_by_lag", "lag")) == {v for v, n in zip(LAG.values, total.tokens) if n}
            assert recorded("k3") == approx({"": expected["staleness/mismatch/k3"]})
            assert recorded("excess_k3") == approx({"": expected["staleness/mismatch/excess_k3"]})
            length = length_values(tally)
            assert recorded("sampled_length_mean") == approx({"": length["sampled"]})  # type: ignore[dict-item]
            assert recorded("trained_length_mean") == approx({"": length["trained"]})  # type: ignore[dict-item]
            assert recorded("removed_share_by_length", "length") == approx(length["removed"])  # type: ignore[arg-type]
            # the raw counters are the core's sums exactly
            tokens = by_label(prom.query(f'rl_staleness_mismatch_tokens_total{{run="{run}"}}'), "lag")
            assert tokens == {v: float(n) for v, n in zip(LAG.values, total.tokens, strict=True)}
            uncovered = prom.query_value(f'rl_staleness_mismatch_uncovered_tokens_total{{run="{run}"}}')
            assert uncovered == total.uncovered
    finally:
        monitor.close()


FLEET_PANELS = {
    "k3": "Fleet mismatch k3 by lag",
    "excess_k3": "Excess k3 over the floor by lag",
    "ess": "Fleet effective sample size by lag",
    "out_of_band": "Fleet out-of-band share by lag",
    "removed": "Removed share by length bucket (fleet)",
}


def fleet_query(title: str) -> str:
    (panel,) = (p for p in panels(dashboards()["staleness-fleet.json"]) if p["title"] == title)
    (target,) = panel["targets"]
    return str(target["expr"])


@requires_pushgateway
@pytest.mark.parametrize("seed", [1, 2])
def test_two_processes_merged_by_prometheus_rates_equal_the_merged_runs_wandb_values(tmp_path: Path, seed: int) -> None:
    """Rollouts and trainer sums split at random between two processes (two runs, one Pushgateway): the
    fleet dashboard's ratios over both equal the W&B values of the merged sums, and each run's recording
    rules its own."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    runs = (f"proc-a{seed}", f"proc-b{seed}")
    gateway = PushgatewayServer(tmp_path / "gateway").start()
    pushers = [PrometheusPushExporter(gateway.address, job="trainer") for _ in runs]
    monitors = [StalenessMonitor(CONFIG, [p], run=r) for p, r in zip(pushers, runs, strict=True)]
    try:
        with RulesPrometheusServer(tmp_path / "prometheus", [gateway.address], job="gateway") as prom:
            for monitor in monitors:
                monitor.ship(1)
                monitor.record_mismatch(1, MismatchSums.zero())
            assert all(p.flush(timeout=60) for p in pushers)
            both = "|".join(runs)
            zero = f'count(rl_staleness_mismatch_tokens_total{{run=~"{both}"}} == 0)'
            prom.wait_until(lambda: prom.query_value(zero) == len(runs) * len(LAG.values))

            sums = [MismatchSums.zero() for _ in runs]
            tallies = [Tally() for _ in runs]
            for step in range(8, 12):
                records = random_rollouts(rng, step, 10, prefix=f"s{seed}")
                side = [rng.random() < 0.5 for _ in records]
                for i, monitor in enumerate(monitors):
                    monitor.add([r for r, to_b in zip(records, side, strict=True) if to_b == bool(i)])
                    report = monitor.ship(step).report
                    tallies[i] = tallies[i] + report.tally
                    if report.mismatch is not None:
                        sums[i] = sums[i] + report.mismatch
                    live = live_sums(nrng, int(nrng.integers(50, 400)))
                    monitor.record_mismatch(step, live)
                    sums[i] = sums[i] + live
            assert all(p.flush(timeout=60) for p in pushers)
            merged = (sums[0] + sums[1]).metrics()
            floors = [floor_of(monitor, 11) for monitor in monitors]
            excess = merged_excess(list(zip(sums, floors, strict=True)))
            covered = (sums[0] + sums[1]).covered
            prom.wait_until(
                lambda: prom.query_value(f'sum(rl_staleness_mismatch_tokens_total{{run=~"{both}"}})') == covered
            )
            values = {"job": "gateway", "instance": ".*", "run": both, "env": ".*", "__rate_interval": "5m"}

            def fleet(key: str, label: str) -> dict[str, float]:
                return by_label(prom.query(fill(fleet_query(FLEET_PANELS[key]), values)), label)

            def settled() -> bool:  # a scrape after the last push is in the window's last sample
                return fleet("k3", "lag") == approx(wandb_by_lag(merged, "k3"))

            prom.wait_until(settled)
            for stat in ("k3", "ess", "out_of_band"):
                assert fleet(stat, "lag") == approx(wandb_by_lag(merged, stat)), stat
            # the excess: each run's tokens over its own floor (its floor gauge), merged
            assert floors[0] != floors[1]
            assert fleet("excess_k3", "lag") == approx({k: v for k, v in excess.items() if k})
            merged_length = length_values(tallies[0] + tallies[1])
            assert fleet("removed", "length") == approx(merged_length["removed"])  # type: ignore[arg-type]
            # per run, the recording rules give each process's own values
            for run, own, floor in zip(runs, sums, floors, strict=True):
                rule = f'{MISMATCH_RECORDS["k3_by_lag"]}{{run="{run}"}}'
                prom.wait_until(lambda rule=rule, own=own: by_label(prom.query(rule), "lag") == approx(
                    wandb_by_lag(own.metrics(), "k3")
                ))  # fmt: skip
                # The excess rule reads recorded series: it may trail the k3 rule by one evaluation.
                excess_rule = f'{MISMATCH_RECORDS["excess_k3"]}{{run="{run}"}}'
                prom.wait_until(lambda rule=excess_rule: prom.query_value(rule) is not None)
                assert prom.query_value(excess_rule) == pytest.approx(
                    own.metrics(floor=floor)["staleness/mismatch/excess_k3"], rel=REL
                )
            # what a per-process average would give is not the merged value: the sums matter
            naive = np.mean([s.metrics()["staleness/mismatch/k3"] for s in sums])
            assert naive != pytest.approx(merged["staleness/mismatch/k3"], rel=1e-6)
    finally:
        for monitor in monitors:
            monitor.close()
        gateway.stop()
