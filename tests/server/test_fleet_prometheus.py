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
