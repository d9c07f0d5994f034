"""The Python client against a real server: retries after lost answers count nothing twice, and
errors come back as the library's exceptions; without httpx, its import names the extra to install."""

from __future__ import annotations

import importlib
import sys

import httpx
import pytest

from staleness_metrics.client import ServiceError, StalenessClient
from staleness_metrics.config import StalenessConfig
from staleness_metrics.errors import ConfigError, TraceError

from .conftest import ThreadServer

pytestmark = pytest.mark.integration


def rollout(rid: str, dispatch: int = 0) -> dict[str, object]:
    return {"id": rid, "dispatch_version": dispatch, "samples": [{"mask": [1, 1], "token_versions": [dispatch] * 2}]}


class LosesFirstAnswers(httpx.BaseTransport):
    """Delivers every request to the server, but loses the answer to the first copy of each one (as a
    timeout after the server applied it would)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: set[tuple[str, str, bytes]] = set()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()
        key = (request.method, str(request.url), request.content)
        if key not in self.seen:
            self.seen.add(key)
            self.lost += 1
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


class Unavailable(httpx.BaseTransport):
    """Answers 503 ``failures`` times, then forwards."""

    def __init__(self, failures: int) -> None:
        self.inner = httpx.HTTPTransport()
        self.failures = failures

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.failures > 0:
            self.failures -= 1
            return httpx.Response(503, json={"detail": "try later"}, request=request)
        return self.inner.handle_request(request)


def test_retries_after_lost_answers_count_once(server: ThreadServer) -> None:
    transport = LosesFirstAnswers()
    with StalenessClient(server.url, transport=transport, backoff=0) as client:
        assert client.create_run("exp", StalenessConfig(max_staleness=3))["config"]["max_staleness"] == 3
        added = client.add("exp", [rollout("a"), rollout("b")])
        assert (added["accepted"], added["duplicates"]) == (0, 2)  # the retry saw its first copy applied
        shipped = client.ship("exp", step=1)
        assert shipped["replayed"] and sorted(shipped["shipped"]) == ["a", "b"]
        client.delete_run("exp")
        assert transport.lost == 4
    with StalenessClient(server.url) as check:
        with pytest.raises(ServiceError) as gone:
            check.run_info("exp")
        assert gone.value.status == 404


def test_counts_after_retries(server: ThreadServer) -> None:
    with StalenessClient(server.url, transport=LosesFirstAnswers(), backoff=0) as client:
        client.create_run("exp")
        client.add("exp", [rollout("a"), rollout("b")])
        client.ship("exp", step=1)
        info = client.run_info("exp")
        assert (info["rollouts_received"], info["duplicates_ignored"], info["ships"]) == (2, 2, 1)
        assert info["totals"]["rollouts_shipped"] == 2 and info["totals"]["tokens_sampled"] == 4
        assert [row["ship"] for row in client.steps("exp")] == [1]


def test_transient_503_is_retried(server: ThreadServer) -> None:
    with StalenessClient(server.url, transport=Unavailable(2), backoff=0) as client:
        assert client.health()["status"] == "ok"
    with StalenessClient(server.url, transport=Unavailable(5), retries=2, backoff=0) as client:
        with pytest.raises(ServiceError) as refused:
            client.health()
        assert refused.value.status == 503


def test_errors_are_the_library_errors(server: ThreadServer) -> None:
    with StalenessClient(server.url) as client:
        with pytest.raises(ConfigError, match="max_staleness"):
            client.create_run("exp", {"max_off_policy_steps": 2})
        client.create_run("exp")
        bad = rollout("bad")
        bad["samples"] = [{"mask": [1, 1], "token_versions": [0]}]
        with pytest.raises(TraceError) as invalid:
            client.add("exp", [rollout("ok"), bad])
        assert (invalid.value.rollout_id, invalid.value.field) == ("bad", "samples[0].token_versions")
        with pytest.raises(ServiceError) as missing:
            client.add("nope", [rollout("a")])
        assert missing.value.status == 404
        client.add("exp", [rollout("v3", dispatch=3)])
        with pytest.raises(TraceError) as ahead:
            client.ship("exp", step=2)
        assert (ahead.value.rollout_id, ahead.value.field) == ("v3", "dispatch_version")
        assert "rl_staleness_export_errors_total" in client.metrics()


def test_without_fastapi_the_service_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fastapi", None)  # not installed
    for name in [m for m in sys.modules if m.startswith("staleness_metrics.server")]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh
    with pytest.raises(ImportError) as caught:
        importlib.import_module("staleness_metrics.server")
    needs = "The service needs fastapi: pip install 'staleness-metrics[server]'"
    assert (str(caught.value), caught.value.name) == (needs, "fastapi")


def test_without_httpx_the_import_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)  # not installed
    monkeypatch.delitem(sys.modules, "staleness_metrics.client")  # imported afresh
    with pytest.raises(ImportError) as caught:
        importlib.import_module("staleness_metrics.client")
    needs = "StalenessClient needs httpx: pip install 'staleness-metrics[client]'"
    assert (str(caught.value), caught.value.name) == (needs, "httpx")
