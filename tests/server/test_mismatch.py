"""``POST /v1/runs/{run}/mismatch`` on a real uvicorn server: trainer ranks post SPEC 11 sums for a
shipped step, they merge exactly, a retried post counts once, and bad posts record nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics import MismatchSums, mismatch_sums
from staleness_metrics.client import ServiceError, StalenessClient
from staleness_metrics.config import StalenessConfig
from staleness_metrics.engine.sink import Sink
from staleness_metrics.metrics.bound import BoundTracker, mismatch_metrics
from staleness_metrics.metrics.mismatch import LAG_BUCKETS
from staleness_metrics.monitor import MISMATCH_STEPS_KEPT
from staleness_metrics.server import ExportSettings, RunRegistry, ServerSettings
from staleness_metrics.server.models import MismatchRequest, ShipRequest
from staleness_metrics.server.store import SNAPSHOT_EVERY, SqliteStore

from .conftest import ThreadServer
from .test_client import LosesFirstAnswers

pytestmark = pytest.mark.integration

TOKEN = "mismatch-token"


def rollout(rid: str, dispatch: int, versions: list[int], trainer: list[float | None] | None = None) -> dict[str, Any]:
    sample: dict[str, Any] = {
        "mask": [0, *([1] * len(versions))],
        "token_versions": [-1, *versions],
        "logprobs": [0.0, *([-1.0] * len(versions))],
    }
    if trainer is not None:
        sample["trainer_logprobs"] = [None, *trainer]
    return {"id": rid, "dispatch_version": dispatch, "samples": [sample]}


def dyadic(sums: MismatchSums) -> dict[str, Any]:
    """``sums.to_dict()`` with every float rounded to a multiple of 2**-10: sums of a few of them are exact
    in any order, so a merge over concurrent posts can be compared with ``==``."""
    data = sums.to_dict()
    for bucket in data["lags"].values():
        for name, value in bucket.items():
            if name.startswith("sum_"):
                bucket[name] = round(value * 1024) / 1024
    return data


def rank_sums(seed: int) -> dict[str, Any]:
    """One rank's sums over 200 positions with lags 0..80 (every bucket kind: single lags, 32, 64, inf)."""
    rng = np.random.default_rng(seed)
    lags = rng.integers(0, 81, 200)
    sampler = rng.normal(-1.0, 0.3, 200)
    trainer = sampler + rng.normal(0.0, 0.05, 200) * (1 + lags / 8)
    trainer[rng.random(200) < 0.1] = np.nan  # uncovered
    return dyadic(mismatch_sums(lags, sampler, trainer, masked=lags > 4))


@pytest.fixture
def http(server: ThreadServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url) as client:
        yield client


def shipped_run(
    http: httpx.Client, run: str = "exp", step: int = 4, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    assert http.put(f"/v1/runs/{run}", json=config or {"max_staleness": 8}).status_code == 201
    rollouts = [rollout("a", 1, [1, 2, 3]), rollout("b", 3, [3, 3])]
    assert http.post(f"/v1/runs/{run}/rollouts", json={"rollouts": rollouts}).status_code == 200
    response = http.post(f"/v1/runs/{run}/ship", json={"step": step, "include_rollouts": True})
    assert response.status_code == 200
    shipped: dict[str, Any] = response.json()
    return shipped


def step_row(http: httpx.Client, step: int, run: str = "exp") -> dict[str, Any]:
    [row] = [r for r in http.get(f"/v1/runs/{run}/steps").json()["steps"] if r["step"] == step]
    return row


def test_ship_returns_the_lags_a_trainer_needs(http: httpx.Client) -> None:
    shipped = shipped_run(http, step=4)
    # Step 4 trains on version 3: lag = 3 - version per sampled position; the prompt position (mask 0)
    # is outside the population.
    by_id = dict(zip(shipped["shipped"], shipped["lags"]))
    assert by_id == {"a": [[-1, 2, 1, 0]], "b": [[-1, 0, 0]]}
    for record, lags in zip(shipped["rollouts"], shipped["lags"]):
        assert [len(s["mask"]) for s in record["samples"]] == [len(sample) for sample in lags]


def test_concurrent_posts_for_one_step_merge_exactly(server: ThreadServer, http: httpx.Client) -> None:
    config = {"max_staleness": 8, "floor_min_tokens": 40}  # SPEC 14 from the merged posts' tokens
    shipped_run(http, step=4, config=config)
    posts = [rank_sums(seed) for seed in range(24)]
    answers: list[int] = []
    errors: list[BaseException] = []

    def poster(mine: list[dict[str, Any]]) -> None:
        try:
            with httpx.Client(base_url=server.url) as client:
                for sums in mine:
                    response = client.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": sums})
                    assert response.status_code == 200, response.text
                    answers.append(response.json()["posts"])
        except BaseException as error:  # surfaced below: a thread's assertion would vanish otherwise
            errors.append(error)

    threads = [threading.Thread(target=poster, args=(posts[i::6],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(answers) == list(range(1, 25))  # every post merged once, one at a time

    expected = MismatchSums.zero()
    for sums in posts:
        expected = expected + MismatchSums.from_dict(sums)
    row = step_row(http, 4)
    assert row["mismatch"] == expected.to_dict()
    family = {k: v for k, v in row["metrics"].items() if k.startswith(("staleness/mismatch/", "staleness/bound/"))}
    # As the library computes them from the merged total: SPEC 11 over SPEC 14's floor, and SPEC 14's keys.
    assert family == mismatch_metrics(expected, BoundTracker(StalenessConfig(**config)).observe(4, expected))
    assert {
        "staleness/mismatch/lag_0/k3", "staleness/mismatch/lag_inf/ess", "staleness/mismatch/excess_k3",
        "staleness/mismatch/floor", "staleness/bound/suggested",
    } <= set(family)  # fmt: skip
    assert family["staleness/mismatch/floor_source"] == "lag0"
    # The ship's own SPEC 6 keys are still there.
    assert row["metrics"]["staleness/rollout/max"] == 2 and row["metrics"]["staleness/max_staleness"] == 8


def test_a_replayed_idempotency_key_counts_once(http: httpx.Client) -> None:
    shipped_run(http, step=4)
    first_sums, second_sums = rank_sums(1), rank_sums(2)
    key = {"Idempotency-Key": "rank-0-step-4"}
    first = http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": first_sums}, headers=key).json()
    assert first["posts"] == 1 and not first["replayed"]
    retry = http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": first_sums}, headers=key).json()
    assert retry == {**first, "replayed": True}
    other = http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": second_sums}, headers=key)
    assert other.status_code == 422 and other.json()["detail"][0]["field"] == "Idempotency-Key"
    assert step_row(http, 4)["mismatch"] == MismatchSums.from_dict(first_sums).to_dict()

    second = http.post(
        "/v1/runs/exp/mismatch", json={"step": 4, "sums": second_sums}, headers={"Idempotency-Key": "r1"}
    )
    assert second.json()["posts"] == 2
    merged = MismatchSums.from_dict(first_sums) + MismatchSums.from_dict(second_sums)
    assert step_row(http, 4)["mismatch"] == merged.to_dict()


def test_client_retries_after_lost_answers_merge_once(server: ThreadServer, http: httpx.Client) -> None:
    shipped_run(http, step=4)
    sums = MismatchSums.from_dict(rank_sums(3))
    transport = LosesFirstAnswers()
    with StalenessClient(server.url, transport=transport, backoff=0.0) as client:
        first = client.record_mismatch("exp", 4, sums)
        assert first["replayed"] and first["posts"] == 1  # the answer to the first attempt was lost
        second = client.record_mismatch("exp", 4, sums.to_dict())  # a second rank with the same numbers
        assert second["posts"] == 2
        rows = [row for row in client.steps("exp") if row["step"] == 4]
    assert transport.lost == 2
    assert rows[-1]["mismatch"] == (sums + sums).to_dict()
    assert rows[-1]["metrics"]["staleness/mismatch/k3"] == (sums + sums).metrics()["staleness/mismatch/k3"]


def _bad_sums() -> list[tuple[str, Any, str]]:
    missing = rank_sums(4)
    del missing["lags"]["7"]
    negative = rank_sums(4)
    negative["lags"]["0"]["tokens"] = -1
    too_many = rank_sums(4)
    too_many["lags"]["3"]["masked"] = too_many["lags"]["3"]["tokens"] + 1
    huge = rank_sums(4)
    huge["lags"]["inf"]["out_of_band"] = 2**70
    nan = rank_sums(4)
    nan["lags"]["64"]["sum_k3"] = "NaN"
    empty_with_sums = MismatchSums.zero().to_dict()
    empty_with_sums["uncovered"] = 1
    empty_with_sums["lags"]["2"]["sum_k3"] = 0.5
    unknown = rank_sums(4)
    unknown["lags"]["17"] = unknown["lags"]["0"]
    impossible = rank_sums(4)  # finite, but past what its tokens can add (d is clamped to ±20)
    impossible["lags"]["0"].update(tokens=1, sum_k3=1.7e308, sum_ratio=1.0, sum_ratio_sq=1.0)
    return [
        ("missing bucket", missing, "sums.lags.7"),
        ("negative count", negative, "sums.lags.0.tokens"),
        ("more masked than tokens", too_many, "sums.lags.3.masked"),
        ("int64 overflow", huge, "sums.lags.inf.out_of_band"),
        ("not a number", nan, "sums.lags.64.sum_k3"),
        ("sums in an empty bucket", empty_with_sums, "sums.lags.2.sum_k3"),
        ("a k3 no pass could make", impossible, "sums.lags.0.sum_k3"),
        ("unknown bucket", unknown, "sums.lags.17"),
        ("no lags", {"uncovered": 0}, "sums.lags"),
    ]


@pytest.mark.parametrize(("case", "sums", "field"), _bad_sums(), ids=[c[0] for c in _bad_sums()])
def test_invalid_sums_are_422_naming_the_field_and_record_nothing(
    http: httpx.Client, case: str, sums: Any, field: str
) -> None:
    shipped_run(http, step=4)
    response = http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": sums})
    assert response.status_code == 422, case
    [error] = response.json()["detail"]
    assert error["field"] == field and error["reason"], case
    row = step_row(http, 4)
    assert row["mismatch"] is None
    assert not [k for k in row["metrics"] if k.startswith("staleness/mismatch/")]


def test_unknown_run_and_unshipped_step_record_nothing(http: httpx.Client) -> None:
    sums = rank_sums(5)
    missing = http.post("/v1/runs/nope/mismatch", json={"step": 1, "sums": sums})
    assert missing.status_code == 404 and "PUT /v1/runs/nope" in missing.json()["detail"]

    shipped_run(http, step=4)
    never = http.post("/v1/runs/exp/mismatch", json={"step": 5, "sums": sums})
    assert never.status_code == 422
    [error] = never.json()["detail"]
    assert error["field"] == "step" and "5" in error["reason"]
    for bad_step in (0, "4", 2**60):
        assert http.post("/v1/runs/exp/mismatch", json={"step": bad_step, "sums": sums}).status_code == 422
    assert step_row(http, 4)["mismatch"] is None
    # The step becomes postable once shipped.
    assert http.post("/v1/runs/exp/ship", json={"step": 5}).status_code == 200
    assert http.post("/v1/runs/exp/mismatch", json={"step": 5, "sums": sums}).json()["posts"] == 1


def test_posts_need_the_token_and_fit_the_size_cap(start_server: Callable[..., ThreadServer]) -> None:
    server = start_server(ServerSettings(token=TOKEN, max_body_bytes=4096))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url) as http:
        assert http.put("/v1/runs/exp", json={}, headers=auth).status_code == 201
        records = [rollout("a", 0, [0, 0])]
        assert http.post("/v1/runs/exp/rollouts", json={"rollouts": records}, headers=auth).status_code == 200
        assert http.post("/v1/runs/exp/ship", json={"step": 1}, headers=auth).status_code == 200
        sums = {"step": 1, "sums": rank_sums(6)}
        assert http.post("/v1/runs/exp/mismatch", json=sums).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert http.post("/v1/runs/exp/mismatch", json=sums, headers=wrong).status_code == 401
        padded = {**sums, "sums": {**sums["sums"], "padding": "x" * 5000}}
        assert http.post("/v1/runs/exp/mismatch", json=padded, headers=auth).status_code == 413
        assert step_row(http, 1)["mismatch"] is None
        assert http.post("/v1/runs/exp/mismatch", json=sums, headers=auth).status_code == 200
        assert step_row(http, 1)["mismatch"] == MismatchSums.from_dict(sums["sums"]).to_dict()


def test_records_with_trainer_logprobs_report_the_family_as_the_library(http: httpx.Client) -> None:
    assert http.put("/v1/runs/exp", json={"max_staleness": 8, "floor_min_tokens": 3}).status_code == 201
    records = [
        rollout("a", 1, [1, 2, 3], trainer=[-1.25, None, -0.5]),  # one uncovered position
        rollout("b", 3, [3, 3], trainer=[-1.0, -2.0]),
    ]
    assert http.post("/v1/runs/exp/rollouts", json={"rollouts": records}).status_code == 200
    metrics = http.post("/v1/runs/exp/ship", json={"step": 4}).json()["metrics"]
    sink = Sink(StalenessConfig(max_staleness=8, floor_min_tokens=3))
    sink.add(records)
    expected = {k: v for k, v in sink.ship(4).metrics.items() if k.startswith("staleness/mismatch/")}
    assert {k: v for k, v in metrics.items() if k.startswith("staleness/mismatch/")} == expected
    # Lag 0: a's version-3 position (d = 0.5) and b's two (d = 0 and -1); lag 2: a's first (d = -0.25).
    assert expected["staleness/mismatch/lag_0/tokens"] == 3 and expected["staleness/mismatch/lag_2/tokens"] == 1
    k3 = [np.expm1(d) - d for d in (0.5, 0.0, -1.0, -0.25)]
    assert expected["staleness/mismatch/lag_0/k3"] == pytest.approx(sum(k3[:3]) / 3)
    assert expected["staleness/mismatch/lag_2/excess_k3"] == pytest.approx(k3[3] - sum(k3[:3]) / 3)
    assert expected["staleness/mismatch/coverage"] == pytest.approx(4 / 5)


def test_a_run_configured_to_adapt_moves_its_bound_from_posted_sums(http: httpx.Client) -> None:
    config = {"max_staleness": 3, "adapt_every": 1, "adapt_low": 1, "adapt_high": 4, "floor_min_tokens": 100,
              "mismatch_budget": 0.01, "cost_window": 1}  # fmt: skip
    shipped_run(http, step=4, config=config)
    info = http.get("/v1/runs/exp").json()
    assert {key: info["config"][key] for key in config} == config
    sums = MismatchSums.zero().to_dict()
    for lag, k3 in (("0", 0.001), ("1", 0.005), ("2", 0.05)):  # lag 2 costs more than the budget: suggested 1
        sums["lags"][lag].update(tokens=100, sum_k3=100 * k3, sum_ratio=100.0, sum_ratio_sq=100.0)
    answer = http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": sums}).json()
    assert (answer["metrics"]["staleness/bound/suggested"], answer["metrics"]["staleness/bound/crossed"]) == (1, 1)
    assert answer["metrics"]["staleness/mismatch/floor_source"] == "lag0"
    ship = http.post("/v1/runs/exp/ship", json={"step": 5}).json()
    assert ship["metrics"]["staleness/max_staleness"] == 2  # one step toward the suggestion, from the next ship


def test_every_bucket_name_is_accepted(http: httpx.Client) -> None:
    shipped_run(http, step=4, config={"floor_min_tokens": 1})
    sums = MismatchSums.zero().to_dict()
    for i, name in enumerate(LAG_BUCKETS):
        sums["lags"][name].update(
            tokens=i + 1, sum_k3=0.25 * (i + 1), sum_ratio=float(i + 1), sum_ratio_sq=float(i + 1)
        )
    answer = http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": sums}).json()
    assert answer["tokens"] == sum(range(1, len(LAG_BUCKETS) + 1))
    assert answer["metrics"]["staleness/mismatch/lag_inf/k3"] == 0.25
    assert answer["metrics"]["staleness/mismatch/excess_k3"] == 0.0


def test_client_raises_service_error_naming_the_field(server: ThreadServer, http: httpx.Client) -> None:
    shipped_run(http, step=4)
    bad = rank_sums(7)
    bad["lags"]["5"]["tokens"] = -3
    with StalenessClient(server.url) as client, pytest.raises(ServiceError) as raised:
        client.record_mismatch("exp", 4, bad)
    assert raised.value.status == 422 and raised.value.detail[0]["field"] == "sums.lags.5.tokens"


def test_posted_sums_reach_the_service_prometheus_counters(server: ThreadServer, http: httpx.Client) -> None:
    shipped_run(http, step=4)
    posts = [rank_sums(seed) for seed in (11, 12, 13)]
    for sums in posts:
        assert http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": sums}).status_code == 200
    merged = MismatchSums.zero()
    for sums in posts:
        merged = merged + MismatchSums.from_dict(sums)
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    tokens = {
        s.labels["lag"]: s.value
        for s in families["rl_staleness_mismatch_tokens"].samples
        if s.name.endswith("_total") and s.labels.get("run") == "exp"
    }
    expected = {("+Inf" if b == "inf" else b): float(n) for b, n in zip(LAG_BUCKETS, merged.tokens.tolist()) if n}
    assert {lag: value for lag, value in tokens.items() if value} == expected
    [uncovered] = [
        s.value
        for s in families["rl_staleness_mismatch_uncovered_tokens"].samples
        if s.name.endswith("_total") and s.labels.get("run") == "exp"
    ]
    assert uncovered == merged.uncovered


def test_posted_sums_replace_the_family_a_ship_computed_from_records(http: httpx.Client) -> None:
    assert http.put("/v1/runs/exp", json={"max_staleness": 8}).status_code == 201
    records = [rollout("a", 1, [1, 2, 3], trainer=[-1.25, -1.0, -0.5])]
    assert http.post("/v1/runs/exp/rollouts", json={"rollouts": records}).status_code == 200
    assert http.post("/v1/runs/exp/ship", json={"step": 4}).status_code == 200
    before = step_row(http, 4)
    assert before["metrics"]["staleness/mismatch/lag_2/tokens"] == 1 and before["mismatch"] is None
    posted = MismatchSums.zero().to_dict()
    posted["lags"]["5"].update(tokens=2, sum_k3=0.5, sum_ratio=2.0, sum_ratio_sq=2.0)
    assert http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": posted}).status_code == 200
    after = step_row(http, 4)
    assert {k: v for k, v in after["metrics"].items() if k.startswith("staleness/mismatch/")} == {
        "staleness/mismatch/lag_5/tokens": 2,
        "staleness/mismatch/lag_5/k3": 0.25,
        "staleness/mismatch/lag_5/abs_log_ratio": 0.0,
        "staleness/mismatch/lag_5/out_of_band": 0.0,
        "staleness/mismatch/lag_5/ess": 1.0,
        "staleness/mismatch/k3": 0.25,
        "staleness/mismatch/coverage": 1.0,
    }
    assert after["metrics"]["staleness/token/mean"] == before["metrics"]["staleness/token/mean"]


def test_only_the_last_ship_of_a_step_carries_the_posted_sums(http: httpx.Client) -> None:
    assert http.put("/v1/runs/exp", json={}).status_code == 201
    for rid in ("a", "b"):
        assert http.post("/v1/runs/exp/rollouts", json={"rollouts": [rollout(rid, 0, [0])]}).status_code == 200
        assert http.post("/v1/runs/exp/ship", json={"step": 2}).status_code == 200
    assert http.post("/v1/runs/exp/mismatch", json={"step": 2, "sums": rank_sums(8)}).status_code == 200
    rows = http.get("/v1/runs/exp/steps").json()["steps"]
    assert [(row["ship"], row["mismatch"] is not None) for row in rows] == [(1, False), (2, True)]


def test_a_merge_that_would_overflow_is_refused_and_the_total_kept(http: httpx.Client) -> None:
    """Each post is in range, their merge is not: a count past int64 (which numpy would wrap to a negative
    total that no restart could load). A sum cannot pass float64: each is capped per token."""
    shipped_run(http, step=4)
    big = MismatchSums.zero().to_dict()
    big["lags"]["1"].update(tokens=2**63 - 1, sum_k3=1.0, sum_ratio=1.0, sum_ratio_sq=1.0)
    assert http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": big}).status_code == 200
    again = http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": big})
    assert again.status_code == 422 and again.json()["detail"][0]["field"] == "sums"
    assert step_row(http, 4)["mismatch"] == MismatchSums.from_dict(big).to_dict()
    assert http.get("/v1/runs/exp").json()["step"] == 4  # and the run serves on


def test_the_journal_keeps_the_sums_as_read_not_the_keys_it_ignores(tmp_path: Path) -> None:
    """A key the sums do not have is ignored, and never reaches the journal: a string it cannot write or a value
    nested past its writer's limit applied the post and then broke the run (503 until a restart lost it)."""
    registry = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    run, _ = registry.create("exp", StalenessConfig())
    run.add([rollout("r0", 0, [0, 0])])
    run.ship(ShipRequest(step=1))
    deep: Any = []
    for _ in range(300):
        deep = [deep]
    for extra in ("\ud800", deep):
        sums = {**rank_sums(0), "note": extra}
        assert run.record_mismatch(MismatchRequest(step=1, sums=sums)).posts in (1, 2)
    before = [row.model_dump() for row in run.steps()]
    registry.store.close()
    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore() == 1
    assert [row.model_dump() for row in restored.get("exp").steps()] == before
    assert restored.get("exp").monitor.mismatch(1) == MismatchSums.from_dict(rank_sums(0)).merged(
        MismatchSums.from_dict(rank_sums(0))
    )
    restored.close()


def test_posts_survive_a_restart_from_snapshot_and_journal(tmp_path: Path) -> None:
    """Posts are journalled like every write: a registry restored from the store (no clean shutdown, as
    after kill -9) has the same merged sums, /steps rows, Prometheus counters and idempotency answers."""
    registry = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    run, _ = registry.create("exp", StalenessConfig())
    run.add([rollout(f"r{i}", 0, [0, 0]) for i in range(4)])
    run.ship(ShipRequest(step=1))
    run.ship(ShipRequest(step=2))
    # More journal rows than a snapshot interval: part of the posts is in the snapshot, part in the tail.
    for i in range(SNAPSHOT_EVERY + 40):
        request = MismatchRequest(step=1 + i % 2, sums=rank_sums(i % 7))
        run.record_mismatch(request, idempotency_key=f"k{i}")
    before = [row.model_dump() for row in run.steps()]
    batch_lag3 = {"run": "exp", "env": "", "lag": "3"}
    counters = run.registry.get_sample_value("rl_staleness_mismatch_tokens_total", batch_lag3)
    registry.store.close()

    stored = {r.name: r for r in SqliteStore(tmp_path).load()}["exp"]
    assert stored.snapshot is not None and 0 < len(stored.tail) < SNAPSHOT_EVERY
    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore() == 1
    again = restored.get("exp")
    assert [row.model_dump() for row in again.steps()] == before
    assert before[0]["mismatch"] is not None and before[1]["mismatch"] is not None
    assert again.monitor.mismatch(1) == MismatchSums.from_dict(before[0]["mismatch"])
    assert counters is not None and counters > 0  # the Prometheus counters come back exact
    restored_counters = again.registry.get_sample_value(
        "rl_staleness_mismatch_tokens_total", {"run": "exp", "env": "", "lag": "3"}
    )
    assert restored_counters == counters
    # Keys from the snapshot and from the tail still answer once.
    for i in (0, SNAPSHOT_EVERY + 39):
        replay = again.record_mismatch(MismatchRequest(step=1 + i % 2, sums=rank_sums(i % 7)), idempotency_key=f"k{i}")
        assert replay.replayed
    assert [row.model_dump() for row in again.steps()] == before
    restored.close()


def test_a_long_run_keeps_the_newest_steps_sums_and_older_rows_keep_their_totals(tmp_path: Path) -> None:
    """A run's snapshot kept every step's posted sums (15 MB after 2,000 steps, rebuilt every 256 rows
    under the run's lock): it keeps the newest ``MISMATCH_STEPS_KEPT`` steps', as the monitor does, and an
    older step's total is in its ``/steps`` row, across restarts. A late post for a step already
    forgotten counts in the counters and starts from zero, as in the monitor; the row keeps its total."""
    registry = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    run, _ = registry.create("exp", StalenessConfig())
    for step in range(1, MISMATCH_STEPS_KEPT + 7):
        run.add([rollout(f"r{step}", step - 1, [step - 1])])
        run.ship(ShipRequest(step=step))
        for seed in (step % 5, 7)[: 1 + (step == 1)]:  # two ranks' posts for the first step
            run.record_mismatch(MismatchRequest(step=step, sums=rank_sums(seed)))
    state = run.state_dict()
    kept = [step for step, *_ in state["mismatch"]]
    assert sorted(kept) == [step for step, _ in state["monitor"]["mismatch"]] == list(range(7, MISMATCH_STEPS_KEPT + 7))
    rows = [row.model_dump() for row in run.steps()]
    first = MismatchSums.from_dict(rank_sums(1)).merged(MismatchSums.from_dict(rank_sums(7)))
    assert (
        rows[0]["mismatch"] == first.to_dict()
        and rows[0]["metrics"]["staleness/mismatch/lag_0/tokens"] == first.tokens[0]
    )
    assert all(row["mismatch"] == rank_sums(row["step"] % 5) for row in rows[1:])

    def lag0_tokens() -> float | None:
        return run.registry.get_sample_value(
            "rl_staleness_mismatch_tokens_total", {"run": "exp", "env": "", "lag": "0"}
        )

    counted, late = lag0_tokens(), MismatchSums.from_dict(rank_sums(3))
    answer = run.record_mismatch(MismatchRequest(step=1, sums=rank_sums(3)))
    assert (answer.posts, answer.tokens) == (1, late.covered) and run.monitor.mismatch(1) is None
    assert lag0_tokens() == (counted or 0) + int(late.tokens[0])
    assert [row.model_dump() for row in run.steps()] == rows
    registry.store.close()  # no final snapshot, as after kill -9

    restored = RunRegistry(ExportSettings(), SqliteStore(tmp_path))
    assert restored.restore() == 1
    again = restored.get("exp")
    assert [row.model_dump() for row in again.steps()] == rows
    assert len(again.state_dict()["mismatch"]) == MISMATCH_STEPS_KEPT
    restored.close()


def test_sums_posted_per_env_reach_the_env_keys_and_counters(http: httpx.Client) -> None:
    """Issue 22 item 6: a post may name the env its sums are of; with the env breakdown they count in the
    step's total and in the env's (its keys in the answer, its series in Prometheus); a bad env is refused."""
    assert http.put("/v1/runs/exp", json={"max_staleness": 8, "env_breakdown": True}).status_code == 201
    records = [{**rollout("a", 3, [3, 3]), "env": "math"}, {**rollout("b", 3, [3]), "env": "code"}]
    assert http.post("/v1/runs/exp/rollouts", json={"rollouts": records}).status_code == 200
    assert http.post("/v1/runs/exp/ship", json={"step": 4}).status_code == 200
    math = dyadic(mismatch_sums([0, 1, 1], [-1.0] * 3, [-1.0, -1.5, -0.5]))
    code = dyadic(mismatch_sums([2], [-1.0], [-2.0]))
    for sums, env in ((math, "math"), (code, "code")):
        response = http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": sums, "env": env})
        assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["tokens"] == 4 and answer["posts"] == 2
    assert answer["metrics"]["staleness/env/code/mismatch/lag_2/tokens"] == 1
    assert answer["metrics"]["staleness/mismatch/lag_1/tokens"] == 2
    # the step's merged keys are of every env posted for it, not of the last post's env only
    assert answer["metrics"]["staleness/env/math/mismatch/lag_1/tokens"] == 2
    row = step_row(http, 4)["metrics"]
    assert {k: v for k, v in row.items() if "/mismatch/" in k} == {
        k: v for k, v in answer["metrics"].items() if "/mismatch/" in k
    }

    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    tokens = {
        (s.labels["env"], s.labels["lag"]): s.value
        for s in families["rl_staleness_mismatch_tokens"].samples
        if s.name.endswith("_total") and s.labels.get("run") == "exp" and s.value
    }
    assert tokens == {("", "0"): 1, ("", "1"): 2, ("", "2"): 1, ("math", "0"): 1, ("math", "1"): 2, ("code", "2"): 1}

    for env in ("", 7, "\ud800"):
        bad = http.post(
            "/v1/runs/exp/mismatch",
            content=json.dumps({"step": 4, "sums": code, "env": env}),
            headers={"content-type": "application/json"},
        )
        assert bad.status_code == 422, env
        [error] = bad.json()["detail"]
        # the schema names it body.env (as other schema errors), the library's check env (as sums, step)
        assert error["field"].removeprefix("body.") == "env" and error["reason"], (env, error)
    assert http.post("/v1/runs/exp/mismatch", json={"step": 4, "sums": code}).json()["posts"] == 3  # nothing recorded


def test_the_client_posts_sums_per_env_and_a_restart_keeps_the_envs_posted_before(tmp_path: Path) -> None:
    """``StalenessClient.record_mismatch(..., env=...)`` posts an env's sums; a post after a restart
    (the monitor's published keys start afresh) still answers with the envs posted before it."""
    settings = ServerSettings(token=TOKEN, data_dir=tmp_path)
    math = dyadic(mismatch_sums([0, 1, 1], [-1.0] * 3, [-1.0, -1.5, -0.5]))
    code = dyadic(mismatch_sums([2], [-1.0], [-2.0]))
    records = [{**rollout("a", 3, [3, 3]), "env": "math"}, {**rollout("b", 3, [3]), "env": "code"}]
    server = ThreadServer(settings).start()
    try:
        with StalenessClient(server.url, token=TOKEN) as client:
            client.create_run("exp", StalenessConfig(max_staleness=8, env_breakdown=True))
            client.add("exp", records)
            client.ship("exp", 4)
            first = client.record_mismatch("exp", 4, math, env="math")
    finally:
        server.stop()
    assert first["metrics"]["staleness/env/math/mismatch/lag_1/tokens"] == 2
    server = ThreadServer(settings).start()
    try:
        with StalenessClient(server.url, token=TOKEN) as client:
            answer = client.record_mismatch("exp", 4, MismatchSums.from_dict(code), env="code")
            [row] = [row for row in client.steps("exp") if row["step"] == 4]
    finally:
        server.stop()
    assert answer["posts"] == 2 and answer["tokens"] == 4
    for keys in (answer["metrics"], row["metrics"]):
        assert keys["staleness/env/math/mismatch/lag_1/tokens"] == 2, keys
        assert keys["staleness/env/code/mismatch/lag_2/tokens"] == 1
        assert keys["staleness/mismatch/lag_1/tokens"] == 2
