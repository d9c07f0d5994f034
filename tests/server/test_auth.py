"""Security: the token on writes (and reads when asked), no start off loopback without a token, and
what a web page in the operator's browser cannot do (post without a CORS preflight, rebind a name)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from staleness_metrics.client import StalenessClient
from staleness_metrics.server import ServerSettings
from staleness_metrics.server.security import is_loopback

from .conftest import ROOT, ServeProcess, ThreadServer, child_env, serve_command

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-for-tests"
RECORD = {"id": "r1", "dispatch_version": 0, "samples": [{"mask": [1, 1]}]}
WRITES = [
    ("PUT", "/v1/runs/exp", {"max_staleness": 2}),
    ("POST", "/v1/runs/exp/rollouts", {"rollouts": [RECORD]}),
    ("POST", "/v1/runs/exp/sweep", {"step": 1}),
    ("POST", "/v1/runs/exp/ship", {"step": 1}),
    ("DELETE", "/v1/runs/exp", None),
]
READS = ["/metrics", "/v1/runs", "/v1/runs/exp", "/v1/runs/exp/steps"]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_writes_need_the_token(start_server: Callable[..., ThreadServer]) -> None:
    server = start_server(ServerSettings(token=TOKEN))
    with httpx.Client(base_url=server.url) as http:
        for method, path, body in WRITES:
            for headers in ({}, bearer("wrong"), bearer(TOKEN + "x"), {"Authorization": f"Basic {TOKEN}"}):
                response = http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.headers["www-authenticate"].startswith("Bearer")
        assert http.get("/v1/runs").json() == {"runs": []}  # nothing got through
        for method, path, body in WRITES:
            response = http.request(method, path, json=body, headers=bearer(TOKEN))
            assert response.status_code in (200, 201, 204), (method, path, response.text)
        for path in [*READS[:2], "/healthz", "/openapi.json"]:  # reads stay open by default
            assert http.get(path).status_code == 200


def test_protect_reads(start_server: Callable[..., ThreadServer]) -> None:
    server = start_server(ServerSettings(token=TOKEN, protect_reads=True))
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={}, headers=bearer(TOKEN))
        for path in READS:
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers=bearer("nope")).status_code == 401, path
            assert http.get(path, headers=bearer(TOKEN)).status_code == 200, path
        assert http.get("/healthz").status_code == 200  # liveness probes carry no token


def test_without_a_token_on_loopback_writes_are_open(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url) as http:
        assert http.put("/v1/runs/exp", json={}).status_code == 201


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "example.org"])
def test_refuses_to_start_off_loopback_without_a_token(host: str) -> None:
    result = subprocess.run(
        serve_command(["--host", host, "--port", "0"]), cwd=ROOT, env=child_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"refusing to listen on {host} without a token" in result.stderr
    assert "STALENESS_METRICS_TOKEN" in result.stderr
    assert result.stdout == ""  # it never announced a URL


def test_an_empty_token_is_no_token() -> None:
    result = subprocess.run(
        serve_command(["--host", "0.0.0.0", "--port", "0"]), cwd=ROOT, env=child_env({"STALENESS_METRICS_TOKEN": ""}),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "refusing" in result.stderr


def test_token_from_the_environment_and_from_a_file(serve_process: Callable[..., ServeProcess], tmp_path: Path) -> None:
    from_env = serve_process(env={"STALENESS_METRICS_TOKEN": f" {TOKEN}\n"})  # (as $(cat FILE) would not strip)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    from_file = serve_process(["--token-file", str(token_file)])
    for served in (from_env, from_file):
        with httpx.Client(base_url=served.url) as http:
            assert http.put("/v1/runs/exp", json={}).status_code == 401
            assert http.put("/v1/runs/exp", json={}, headers=bearer(TOKEN)).status_code == 201
        with StalenessClient(served.url, token=TOKEN + "\n") as client:  # outer blanks go, as the service's
            assert client.create_run("exp")["run"] == "exp"


def test_loopback_rule() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "my-host", "localhost.evil.org"))


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_a_post_that_is_not_json_is_refused_unread(server: ThreadServer, content_type: str | None) -> None:
    """A page on any site may POST those media types to 127.0.0.1 without a CORS preflight (a form, a
    no-cors fetch): every POST route refuses them as the JSON routes refused text/plain, 422 on ``body``."""
    headers = {"Origin": "https://evil.example", **({} if content_type is None else {"Content-Type": content_type})}
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={}).raise_for_status()
        for path, body in (("rollouts", {"rollouts": [RECORD]}), ("sweep", {"step": 1}), ("ship", {"step": 1})):
            answer = http.post(f"/v1/runs/exp/{path}", content=json.dumps(body), headers=headers)
            assert answer.status_code == 422, (path, answer.text)
            [error] = answer.json()["detail"]
            assert error["field"] == "body" and "JSON" in error["reason"], path
        assert http.get("/v1/runs/exp").json()["rollouts_received"] == 0
        plus_json = {"Content-Type": "application/vnd.api+json; charset=utf-8"}  # any JSON media type does
        added = http.post("/v1/runs/exp/rollouts", content=json.dumps({"rollouts": [RECORD]}), headers=plus_json)
        assert added.json()["accepted"] == 1


def test_without_a_token_only_loopback_names_are_served(start_server: Callable[..., ThreadServer]) -> None:
    """DNS rebinding: a page on rebind.evil.example, its name then pointed at 127.0.0.1, would be same-origin
    with a tokenless service. Such a Host gets 421 on every route (its trailing-slash redirect too); a
    loopback name on any port is served, and with a token the token decides (the Host is not looked at)."""
    server = start_server()
    port = server.url.rsplit(":", 1)[1]
    evil = {"Host": f"rebind.evil.example:{port}"}
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={}).raise_for_status()
        for method, path, body in [*WRITES, ("GET", "/v1/runs", None), ("GET", "/v1/runs/exp/", None)]:
            answer = http.request(method, path, json=body, headers=evil)
            assert answer.status_code == 421 and "location" not in answer.headers, (method, path)
        assert [run["run"] for run in http.get("/v1/runs").json()["runs"]] == ["exp"]
        assert http.get("/v1/runs/exp").json()["rollouts_received"] == 0
        for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "127.0.0.2:80"):
            assert http.get("/v1/runs/exp", headers={"Host": host}).status_code == 200, host
    tokened = start_server(ServerSettings(token=TOKEN))
    with httpx.Client(base_url=tokened.url) as http:
        assert http.put("/v1/runs/exp", json={}, headers={**evil, **bearer(TOKEN)}).status_code == 201
        assert http.put("/v1/runs/other", json={}, headers=evil).status_code == 401
