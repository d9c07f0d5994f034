"""Security: the token on writes (and reads when asked), and no start off loopback without a token."""

from __future__ import annotations

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
