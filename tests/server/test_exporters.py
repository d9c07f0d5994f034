"""The service's runs reach the same exporters as the library's: OTLP over the wire to a receiver,
W&B offline runs read back from their files, and an exporter that cannot start only costs a count."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.server import ExportSettings, ServerSettings
from tests.exporters.wandb_reader import read_records, read_run
from tests.support.otlp import OtlpReceiver, attributes_of, metrics_by_name

from .conftest import ServeProcess, ThreadServer

pytestmark = pytest.mark.integration


def rollout(rid: str, dispatch: int, versions: list[int]) -> dict[str, object]:
    return {
        "id": rid,
        "dispatch_version": dispatch,
        "samples": [{"mask": [1] * len(versions), "token_versions": versions}],
    }


def drive(url: str) -> dict[str, list[dict[str, Any]]]:
    """Two runs, three ships; returns each run's /steps rows."""
    with httpx.Client(base_url=url) as http:
        for run, bound in (("alpha", 1), ("beta", 4)):
            assert http.put(f"/v1/runs/{run}", json={"max_staleness": bound}).status_code == 201
            http.post(f"/v1/runs/{run}/rollouts", json={"rollouts": [rollout("x", 0, [0, 1, 2]), rollout("y", 2, [2])]})
            assert http.post(f"/v1/runs/{run}/ship", json={"step": 4}).status_code == 200
        http.post("/v1/runs/alpha/rollouts", json={"rollouts": [rollout("z", 3, [3, 4])]})
        assert http.post("/v1/runs/alpha/ship", json={"step": 5}).status_code == 200
        return {run: http.get(f"/v1/runs/{run}/steps").json()["steps"] for run in ("alpha", "beta")}


def wandb_runs(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """History rows of each offline run file under ``directory``, by W&B run name."""
    runs = {}
    for path in sorted(directory.rglob("run-*.wandb")):
        history = read_run(path).history  # waits for the exit record: the run was finished
        names = [r.run.display_name for r in read_records(path) if r.WhichOneof("record_type") == "run"]
        runs[names[0]] = history
    return runs


def test_otlp_and_wandb_from_the_serve_command(serve_process: Callable[..., ServeProcess], tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        served = serve_process(
            ["--otlp-endpoint", receiver.endpoint, "--wandb-project", "staleness-tests", "--wandb-mode", "offline",
             "--wandb-dir", str(tmp_path)],
            env={"WANDB_SILENT": "true"},
        )  # fmt: skip
        steps = drive(served.url)
        requests = receiver.wait_for(3)
        served.stop()  # SIGTERM: the service closes its runs, flushing every exporter

    shipped: dict[str, float] = {}
    for request in requests:
        metric = metrics_by_name(request)["rl.staleness.rollouts.shipped"]
        for point in metric.sum.data_points:
            run = attributes_of(point)["run"]
            shipped[run] = max(shipped.get(run, 0), point.as_int)
    for run, rows in steps.items():
        assert shipped[run] == sum(row["counts"]["rollouts_shipped"] for row in rows)

    logged = wandb_runs(tmp_path)
    assert sorted(logged) == ["alpha", "beta"]  # one W&B run per service run, named after it
    for run, rows in steps.items():
        history = [row for row in logged[run] if "trainer/step" in row]
        assert [row["trainer/step"] for row in history] == [row["step"] for row in rows]
        for logged_row, row in zip(history, rows):
            for key, value in row["metrics"].items():
                assert logged_row[key] == pytest.approx(value), (run, key)


def test_an_exporter_that_cannot_start_is_counted_not_fatal(start_server: Callable[..., ThreadServer]) -> None:
    broken = ExportSettings(otlp=True, otlp_protocol="carrier-pigeon")
    server = start_server(ServerSettings(exporters=broken))
    with httpx.Client(base_url=server.url) as http:
        assert http.put("/v1/runs/exp", json={}).status_code == 201
        http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("a", 0, [0])]})
        assert http.post("/v1/runs/exp/ship", json={"step": 1}).status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    errors = {
        s.labels["exporter"]: s.value
        for s in families["rl_staleness_export_errors"].samples
        if s.name.endswith("_total")
    }
    assert errors == {"prometheus": 0.0, "otlp": 1.0}
    assert families["rl_staleness_rollouts_shipped"].samples[0].value == 1.0
