"""The HTTP API on a real uvicorn server: runs, rollouts, ships, history, metrics, limits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.config import StalenessConfig
from staleness_metrics.engine.sink import Sink
from staleness_metrics.errors import ConfigError
from staleness_metrics.server import ServerSettings
from tests.support.prometheus import promtool_check_metrics, requires_promtool

from .conftest import ThreadServer

pytestmark = pytest.mark.integration


def rollout(rid: str, dispatch: int = 0, versions: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    versions = versions if versions is not None else [dispatch, dispatch, dispatch]
    return {
        "id": rid,
        "dispatch_version": dispatch,
        "samples": [{"mask": [0, *([1] * len(versions))], "token_versions": [-1, *versions]}],
        **extra,
    }


@pytest.fixture
def http(server: ThreadServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url) as client:
        yield client


def make_run(http: httpx.Client, run: str = "exp", **config: Any) -> None:
    assert http.put(f"/v1/runs/{run}", json=config).status_code == 201


def test_run_creation_validates_like_the_library(http: httpx.Client) -> None:
    created = http.put("/v1/runs/exp", json={"policy": "xtuner", "max_staleness": 2, "max_token_staleness": 1})
    assert created.status_code == 201
    assert created.json()["config"]["max_token_staleness"] == 1
    again = http.put("/v1/runs/exp", json={"policy": "xtuner", "max_staleness": 2, "max_token_staleness": 1})
    assert again.status_code == 200  # same configuration: idempotent
    assert http.put("/v1/runs/exp", json={"max_staleness": 3}).status_code == 409

    renamed = http.put("/v1/runs/old", json={"max_off_policy_steps": 4})
    assert renamed.status_code == 422
    [error] = renamed.json()["detail"]
    assert error["field"] == "max_off_policy_steps" and "max_staleness" in error["reason"]
    for bad, field in (({"max_staleness": -1}, "max_staleness"), ({"sync_interval": 2}, "sync_interval"),
                       ({"max_staleness": "8"}, "max_staleness"), ({"policy": "fifo"}, "policy"),
                       ({"max_staleness": 10**30}, "max_staleness")):  # fmt: skip
        response = http.put("/v1/runs/bad", json=bad)
        assert response.status_code == 422, bad
        assert response.json()["detail"][0]["field"] == field
    assert http.get("/v1/runs/bad").status_code == 404  # nothing was created
    assert [r["run"] for r in http.get("/v1/runs").json()["runs"]] == ["exp"]


def test_unknown_run_is_404_not_created(http: httpx.Client) -> None:
    response = http.post("/v1/runs/typo/rollouts", json={"rollouts": [rollout("a")]})
    assert response.status_code == 404 and "PUT /v1/runs/typo" in response.json()["detail"]
    assert http.post("/v1/runs/typo/ship", json={"step": 1}).status_code == 404
    assert http.get("/v1/runs/typo/steps").status_code == 404
    assert http.get("/v1/runs").json()["runs"] == []


def test_invalid_record_is_422_and_nothing_of_the_batch_is_applied(http: httpx.Client) -> None:
    make_run(http)
    bad = rollout("r2")
    bad["samples"][0]["token_versions"] = [-1, 0]  # shorter than the mask
    response = http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("r1"), bad, rollout("r3")]})
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert (error["rollout_id"], error["index"], error["field"]) == ("r2", 1, "samples[0].token_versions")
    assert error["reason"]
    info = http.get("/v1/runs/exp").json()
    assert (info["queued"], info["rollouts_received"]) == (0, 0)
    # The corrected batch goes in whole: the rejected one left no id behind.
    fixed = http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("r1"), rollout("r2"), rollout("r3")]})
    assert fixed.json()["accepted"] == 3


@pytest.mark.parametrize("strict", [True, False])
def test_missing_id_and_out_of_range_integers_are_422(http: httpx.Client, strict: bool) -> None:
    """In lenient runs too (docs/service.md): the service counts each rollout once by its id; a record that
    is not an object is named by its index (it was null)."""
    make_run(http, strict=strict)
    no_id = {"dispatch_version": 0, "samples": [{"mask": [1]}]}
    for bad, field in ((no_id, "id"), ("oops", "body.rollouts.1"), (None, "body.rollouts.1")):
        response = http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("a"), bad]})
        assert response.status_code == 422
        assert response.json()["detail"][0] | {"reason": ""} == {
            "field": field,
            "rollout_id": None,
            "index": 1,
            "reason": "",
        }
    huge = rollout("b", completion_version=2**70)
    response = http.post("/v1/runs/exp/rollouts", json={"rollouts": [huge]})
    assert response.status_code == 422
    assert response.json()["detail"][0]["field"] == "completion_version"
    assert http.get("/v1/runs/exp").json()["queued"] == 0


def test_negative_versions_are_refused(http: httpx.Client) -> None:
    make_run(http)
    for bad, field in (
        (rollout("a", completion_version=-1), "completion_version"),
        (rollout("b", source="frozen", dispatch_version=-1), "dispatch_version"),
    ):
        response = http.post("/v1/runs/exp/rollouts", json={"rollouts": [bad]})
        assert response.status_code == 422, bad
        [error] = response.json()["detail"]
        assert (error["rollout_id"], error["field"]) == (bad["id"], field)
        assert "got -1" in error["reason"]
    assert http.get("/v1/runs/exp").json()["queued"] == 0


def test_resent_batches_are_counted_once(http: httpx.Client) -> None:
    make_run(http)
    batch = {"rollouts": [rollout("a"), rollout("b")]}
    assert http.post("/v1/runs/exp/rollouts", json=batch).json() | {"queued": 0} == {
        "run": "exp", "accepted": 2, "duplicates": 0, "invalid": [], "queued": 0,
    }  # fmt: skip
    again = http.post("/v1/runs/exp/rollouts", json=batch).json()
    assert (again["accepted"], again["duplicates"], again["queued"]) == (0, 2, 2)
    mixed = http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("b"), rollout("c"), rollout("c")]}).json()
    assert (mixed["accepted"], mixed["duplicates"], mixed["queued"]) == (1, 2, 3)
    # The same id with other content is a client bug, not a re-send: refused whole.
    conflict = http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("d"), rollout("a", dispatch=1)]})
    assert conflict.status_code == 409 and "'a'" in conflict.json()["detail"]
    info = http.get("/v1/runs/exp").json()
    assert (info["queued"], info["rollouts_received"], info["duplicates_ignored"]) == (3, 3, 4)
    shipped = http.post("/v1/runs/exp/ship", json={"step": 1}).json()
    assert sorted(shipped["shipped"]) == ["a", "b", "c"] and shipped["counts"]["tokens_sampled"] == 9


def test_lenient_run_sets_invalid_records_aside_once(http: httpx.Client) -> None:
    make_run(http, strict=False)
    bad = rollout("bad")
    bad["samples"][0]["mask"] = [0, 1, 2, 1]
    batch = {"rollouts": [rollout("good"), bad]}
    first = http.post("/v1/runs/exp/rollouts", json=batch).json()
    assert first["accepted"] == 1
    assert [(e["rollout_id"], e["index"], e["field"]) for e in first["invalid"]] == [("bad", 1, "samples[0].mask[2]")]
    again = http.post("/v1/runs/exp/rollouts", json=batch).json()
    assert (again["accepted"], again["duplicates"], again["invalid"]) == (0, 2, [])
    shipped = http.post("/v1/runs/exp/ship", json={"step": 1}).json()
    assert shipped["counts"]["rollouts_invalid"] == 1 and shipped["shipped"] == ["good"]


def test_ship_matches_the_library_and_masks(http: httpx.Client) -> None:
    make_run(http, max_staleness=1)
    records = [rollout("old", 0, [0, 1, 2]), rollout("new", 2, [2, 2]), rollout("stale", 0, [0, 0])]
    http.post("/v1/runs/exp/rollouts", json={"rollouts": records})
    response = http.post("/v1/runs/exp/ship", json={"step": 4, "include_rollouts": True}).json()

    sink = Sink(StalenessConfig(max_staleness=1))
    sink.add([rollout("old", 0, [0, 1, 2]), rollout("new", 2, [2, 2]), rollout("stale", 0, [0, 0])])
    expected = sink.ship(4)
    assert response["metrics"] == dict(expected.metrics)
    assert response["shipped"] == expected.ids and response["dropped_rollouts"] == ["stale"]
    assert response["dropped_samples"] == [["stale", 0]]
    assert response["rollouts"] == [r.record() for r in expected.rollouts]
    old = next(r for r in response["rollouts"] if r["id"] == "old")
    assert old["samples"][0]["mask"] == [0, 0, 0, 1]  # versions 0 and 1 are below T - max_staleness = 2


def test_ship_idempotency_key_answers_once(http: httpx.Client) -> None:
    make_run(http)
    http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("a")]})
    key = {"Idempotency-Key": "ship-1"}
    first = http.post("/v1/runs/exp/ship", json={"step": 1}, headers=key).json()
    http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("b")]})
    retry = http.post("/v1/runs/exp/ship", json={"step": 1}, headers=key).json()
    assert retry == {**first, "replayed": True}  # "b" stays queued: the retry shipped nothing
    assert http.get("/v1/runs/exp").json()["queued"] == 1
    other = http.post("/v1/runs/exp/ship", json={"step": 2}, headers=key)
    assert other.status_code == 422 and other.json()["detail"][0]["field"] == "Idempotency-Key"
    assert len(http.get("/v1/runs/exp/steps").json()["steps"]) == 1


def test_steps_never_decrease_and_history_pages_by_step(http: httpx.Client) -> None:
    make_run(http)
    for i, step in enumerate((1, 2, 2, 5)):
        http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout(f"r{i}", 0)]})
        assert http.post("/v1/runs/exp/ship", json={"step": step}).status_code == 200
    response = http.post("/v1/runs/exp/ship", json={"step": 4})
    assert response.status_code == 409 and "never decrease" in response.json()["detail"]
    assert http.post("/v1/runs/exp/sweep", json={"step": 3}).status_code == 409
    steps = http.get("/v1/runs/exp/steps", params={"since": 1}).json()["steps"]
    assert [(row["ship"], row["step"]) for row in steps] == [(2, 2), (3, 2), (4, 5)]
    assert http.get("/v1/runs/exp/steps", params={"since": 5}).json()["steps"] == []
    assert http.get("/v1/runs/exp/steps", params={"since": -1}).status_code == 422


def test_ship_time_version_check_names_the_rollout(http: httpx.Client) -> None:
    make_run(http)
    http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout("ahead", 3, [3, 3])]})
    response = http.post("/v1/runs/exp/ship", json={"step": 2})  # trains on version 1
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert (error["rollout_id"], error["field"]) == ("ahead", "dispatch_version")
    assert http.get("/v1/runs/exp/steps").json()["steps"] == []


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_of_every_run_in_one_exposition(http: httpx.Client) -> None:
    make_run(http, "a", max_staleness=1)
    make_run(http, "b", max_staleness=5)
    for run in ("a", "b"):
        http.post(f"/v1/runs/{run}/rollouts", json={"rollouts": [rollout("x", 0, [0, 0]), rollout("y", 2, [2])]})
        http.post(f"/v1/runs/{run}/ship", json={"step": 4})
    text = http.get("/metrics").text
    assert text.count("# TYPE rl_staleness_tokens_sampled_total counter") == 1
    parsed = families(text)
    by_run = {s.labels["run"]: s.value for s in parsed["rl_staleness_rollouts_dropped"].samples}
    assert by_run == {"a": 1.0, "b": 0.0}
    bounds = {s.labels["run"]: s.value for s in parsed["rl_staleness_max_staleness"].samples}
    assert bounds == {"a": 1.0, "b": 5.0}
    assert http.delete("/v1/runs/a").status_code == 204
    remaining = families(http.get("/metrics").text)["rl_staleness_max_staleness"].samples
    assert [s.labels["run"] for s in remaining] == ["b"]
    assert http.get("/v1/runs/a").status_code == 404
    openmetrics = http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


@requires_promtool
def test_metrics_pass_promtool(http: httpx.Client) -> None:
    make_run(http, "a", env_breakdown=True)
    make_run(http, "b")
    for run in ("a", "b"):
        records = [rollout("x", 0, [0, 0], env="math"), rollout("y", 1, [1], env="code")]
        http.post(f"/v1/runs/{run}/rollouts", json={"rollouts": records})
        http.post(f"/v1/runs/{run}/ship", json={"step": 3})
    exposition = http.get("/metrics").content
    assert b'rl_staleness_tokens_sampled_total{env="math",run="a"} 2.0' in exposition  # both runs are in it
    assert b'rl_staleness_tokens_sampled_total{env="",run="b"} 3.0' in exposition
    result = promtool_check_metrics(exposition)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""  # no lint warning either


@pytest.mark.parametrize("chunked", [False, True])
def test_request_bodies_are_capped(start_server: Callable[..., ThreadServer], chunked: bool) -> None:
    server = start_server(ServerSettings(max_body_bytes=2000))
    with httpx.Client(base_url=server.url) as http:
        make_run(http)
        small = httpx.Request("POST", "/", json={"rollouts": [rollout("a")]}).content
        big = httpx.Request("POST", "/", json={"rollouts": [rollout(f"r{i}") for i in range(40)]}).content
        assert len(small) < 2000 < len(big)

        def post(body: bytes) -> httpx.Response:
            content: Any = iter([body[i : i + 500] for i in range(0, len(body), 500)]) if chunked else body
            return http.post("/v1/runs/exp/rollouts", content=content, headers={"Content-Type": "application/json"})

        refused = post(big)
        assert refused.status_code == 413 and "2000 bytes" in refused.json()["detail"]
        assert http.get("/v1/runs/exp").json()["queued"] == 0
        assert post(small).status_code == 200


def test_healthz(http: httpx.Client) -> None:
    make_run(http)
    assert http.get("/healthz").json() == {"status": "ok", "version": "0.1.0", "runs": 1, "unavailable": {}}


def test_the_document_names_each_answers_model(server: ThreadServer) -> None:
    """Handlers return their answers already written as JSON; the document still describes them."""
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    expected = {
        ("/healthz", "get", "200"): "Health",
        ("/v1/runs", "get", "200"): "RunList",
        ("/v1/runs/{run}", "put", "201"): "RunInfo",
        ("/v1/runs/{run}", "put", "200"): "RunInfo",
        ("/v1/runs/{run}", "get", "200"): "RunInfo",
        ("/v1/runs/{run}/rollouts", "post", "200"): "AddResult",
        ("/v1/runs/{run}/sweep", "post", "200"): "RunInfo",
        ("/v1/runs/{run}/ship", "post", "200"): "ShipResult",
        ("/v1/runs/{run}/mismatch", "post", "200"): "MismatchResult",
        ("/v1/runs/{run}/steps", "get", "200"): "StepsPage",
    }
    for (path, method, code), model in expected.items():
        schema = paths[path][method]["responses"][code]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model}"}, (path, method, code)


def test_the_document_says_a_log_prob_may_be_null_as_the_service_reads_it(http: httpx.Client) -> None:
    """SPEC 11: a sampler or trainer log-prob lacking a value is uncovered; the document said numbers only."""
    doc = http.get("/openapi.json").json()
    body = doc["paths"]["/v1/runs/{run}/rollouts"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    sample = body["properties"]["rollouts"]["items"]["properties"]["samples"]["items"]
    for name in ("logprobs", "trainer_logprobs"):
        array = sample["properties"][name]["anyOf"][0]
        assert array["items"] == {"anyOf": [{"type": "number"}, {"type": "null"}]}, name
    make_run(http)
    record = {"id": "a", "dispatch_version": 0, "samples": [{"mask": [1, 1], "logprobs": [None, -0.5]}]}
    assert http.post("/v1/runs/exp/rollouts", json={"rollouts": [record]}).status_code == 200


def test_a_config_error_is_answered_from_its_field_and_reason(server: ThreadServer) -> None:
    """The 422 names the setting the library's ConfigError names (its .field), even one whose name has a
    space, and its reason, word for word."""
    with httpx.Client(base_url=server.url) as http:
        for body in ({"max stale": 1}, {"policy": "nope"}, {"max_staleness": -1}):
            with pytest.raises(ConfigError) as raised:
                StalenessConfig.from_mapping(body)
            answer = http.put("/v1/runs/cfg", json=body)
            assert answer.status_code == 422
            assert answer.json()["detail"] == [
                {"field": raised.value.field, "reason": raised.value.reason, "rollout_id": None, "index": None}
            ]
            assert raised.value.field == next(iter(body))
