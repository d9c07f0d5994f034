"""docs/service.md's fleet recipe, run for real: Prometheus scrapes the service, and a fleet-wide quantile
comes from the summed histogram buckets of several runs, agreeing with the runs' own histories."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.prometheus import PrometheusServer, requires_prometheus

from .conftest import ThreadServer

pytestmark = [pytest.mark.integration, requires_prometheus]


def rollout(rid: str, dispatch: int, versions: list[int]) -> dict[str, object]:
    return {
        "id": rid,
        "dispatch_version": dispatch,
        "samples": [{"mask": [1] * len(versions), "token_versions": versions}],
    }


def nearest_rank(histogram: np.ndarray, q: float) -> int:
    """SPEC 6: the ceil(q*N)-th smallest value."""
    rank = math.ceil(q * histogram.sum())
    return int(np.searchsorted(np.cumsum(histogram), rank))


def test_fleet_quantile_from_summed_buckets(server: ThreadServer, tmp_path: Path) -> None:
    fleet = np.zeros(32, dtype=np.int64)
    with httpx.Client(base_url=server.url) as http:
        for run, (dispatch, newest) in {"trainer-1": (0, 2), "trainer-2": (3, 9), "trainer-3": (5, 5)}.items():
            http.put(f"/v1/runs/{run}", json={"max_staleness": 16})
            records = [rollout(f"{run}-{i}", dispatch, [dispatch + (newest - dispatch) * k // 4 for k in range(5)])
                       for i in range(3)]  # fmt: skip
            http.post(f"/v1/runs/{run}/rollouts", json={"rollouts": records})
            http.post(f"/v1/runs/{run}/ship", json={"step": 11})
            for row in http.get(f"/v1/runs/{run}/steps").json()["steps"]:
                fleet[: len(row["token_histogram"])] += np.asarray(row["token_histogram"], dtype=np.int64)

    with PrometheusServer(tmp_path, targets=[server.url.removeprefix("http://")]) as prom:
        prom.wait_until(lambda: prom.query_value("count(rl_staleness_train_step)") == 3)
        total = prom.query_value("sum(rl_staleness_token_steps_count)")
        assert total == fleet.sum()
        buckets = prom.query_values("sum by (le) (rl_staleness_token_steps_bucket)", by="le")
        assert buckets["5.0"] == fleet[:6].sum() and buckets["+Inf"] == fleet.sum()
        for q in (0.5, 0.9, 0.99):
            promql = prom.query_value(f"histogram_quantile({q}, sum by (le) (rl_staleness_token_steps_bucket))")
            exact = nearest_rank(fleet, q)
            assert promql is not None and exact - 1 < promql <= exact, (q, promql, exact)


def costly_rollout(
    rid: str, dispatch: int, newest: int, rng: np.random.Generator, *, covered: bool
) -> dict[str, object]:
    """Versions from ``dispatch`` to ``newest``; trainer log-probs drifting with the version gap (SPEC 11), or
    all missing when not ``covered`` (uncovered positions: counted, never an error)."""
    n = 8
    versions = [dispatch + (newest - dispatch) * k // (n - 1) for k in range(n)]
    sampler = (-rng.random(n) * 2).round(6)
    trainer = sampler + 0.05 * (newest - np.asarray(versions)) * rng.random(n) + rng.normal(0, 0.01, n)
    return {
        "id": rid,
        "dispatch_version": dispatch,
        "samples": [
            {
                "mask": [1] * n,
                "token_versions": versions,
                "logprobs": sampler.tolist(),
                "trainer_logprobs": trainer.round(6).tolist() if covered else [None] * n,
            }
        ],
    }


def test_fleet_mismatch_by_lag_from_rates_equals_the_merged_runs_values(server: ThreadServer, tmp_path: Path) -> None:
    """Several runs behind one service (one scrape target): the fleet dashboard's k3 and excess by lag, from
    rates of the summed counters, equal the values of the runs' merged sums (their /steps rows, merged); the
    excess counts each run's tokens over its own floor (SPEC 14's floor gauge)."""
    from staleness_metrics.metrics.metric_table import LAG
    from tests.dashboards.grafana_queries import dashboards, fill, panels

    rng = np.random.default_rng(4)
    runs = {"cost-1": (2, 6), "cost-2": (0, 9), "cost-3": (4, 5)}
    with (
        httpx.Client(base_url=server.url) as http,
        PrometheusServer(tmp_path, targets=[server.url.removeprefix("http://")], job="service") as prom,
    ):
        for run in runs:  # first ship: every position uncovered, so the families start at 0
            http.put(f"/v1/runs/{run}", json={"max_staleness": 4, "floor_min_tokens": 2})
            http.post(
                f"/v1/runs/{run}/rollouts", json={"rollouts": [costly_rollout(f"{run}-0", 0, 0, rng, covered=False)]}
            )
            http.post(f"/v1/runs/{run}/ship", json={"step": 1})
        zero = 'count(rl_staleness_mismatch_tokens_total{run=~"cost-.*"} == 0)'
        prom.wait_until(lambda: prom.query_value(zero) == len(runs) * len(LAG.values))

        tokens: dict[str, float] = {}
        k3_sums: dict[str, float] = {}
        above_floor: dict[str, float] = {}  # Σ over runs of tokens · (k3 - the run's floor)
        for run, (dispatch, newest) in runs.items():
            records = [costly_rollout(f"{run}-{i}", dispatch, newest, rng, covered=True) for i in range(1, 5)]
            http.post(f"/v1/runs/{run}/rollouts", json={"rollouts": records})
            http.post(f"/v1/runs/{run}/ship", json={"step": newest + 1})
            for row in http.get(f"/v1/runs/{run}/steps").json()["steps"]:
                for bucket, value in zip(LAG.buckets, LAG.values, strict=True):
                    n = row["metrics"].get(f"staleness/mismatch/lag_{bucket}/tokens")
                    if n:
                        tokens[value] = tokens.get(value, 0) + n
                        k3 = row["metrics"][f"staleness/mismatch/lag_{bucket}/k3"]
                        k3_sums[value] = k3_sums.get(value, 0.0) + n * k3
                        if bucket != "0":
                            floor = row["metrics"]["staleness/mismatch/floor"]
                            above_floor[value] = above_floor.get(value, 0.0) + n * (k3 - floor)
        merged_k3 = {lag: k3_sums[lag] / tokens[lag] for lag in tokens}
        assert "0" in merged_k3 and len(merged_k3) >= 4

        (panel,) = (p for p in panels(dashboards()["staleness-fleet.json"]) if p["title"] == "Fleet mismatch k3 by lag")
        (heat,) = (
            p for p in panels(dashboards()["staleness-fleet.json"]) if p["title"] == "Excess k3 over the floor by lag"
        )
        values = {"job": "service", "instance": ".*", "run": "cost-.*", "env": ".*", "__rate_interval": "5m"}

        def by_lag(expr: str) -> dict[str, float]:
            return prom.query_values(fill(expr, values), by="lag")

        total = sum(tokens.values())
        prom.wait_until(lambda: prom.query_value('sum(rl_staleness_mismatch_tokens_total{run=~"cost-.*"})') == total)
        prom.wait_until(lambda: by_lag(panel["targets"][0]["expr"]) == pytest.approx(merged_k3, rel=1e-9))
        excess = by_lag(heat["targets"][0]["expr"])
        expected = {lag: above / tokens[lag] for lag, above in above_floor.items()}
        assert excess == pytest.approx(expected, rel=1e-9, abs=1e-15)
