"""A hostile or careless client against the real ``serve`` command: no work before the token, no blank
tokens, no empty env, and bounded memory for a large valid body."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from staleness_metrics.server import ServerSettings

from .conftest import ROOT, ServeProcess, ThreadServer, child_env, serve_command

pytestmark = pytest.mark.integration

TOKEN = "hostile-test-token"
BODY_BYTES = 56 * 1024 * 1024


def status_kb(pid: int, key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def send_headers_and_a_little(url: str, path: str, headers: dict[str, str]) -> bytes:
    """Declare a 56 MB body, send 64 KB of it, and read the answer (the server must answer without the rest)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {BODY_BYTES}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode() + b'{"rollouts": [' + b"1," * 32 * 1024)
        sock.settimeout(60)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_unauthenticated_writes_get_401_before_the_body_is_read(serve_process: Callable[..., ServeProcess]) -> None:
    served = serve_process(env={"STALENESS_METRICS_TOKEN": TOKEN})
    pid = served.process.pid
    with httpx.Client(base_url=served.url) as http:
        assert http.put("/v1/runs/exp", json={}, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 201
        # malformed JSON without a token: 401, not 422 (the body is not looked at)
        malformed = http.post(
            "/v1/runs/exp/rollouts", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert malformed.status_code == 401
    before = status_kb(pid, "VmRSS")
    answers: list[bytes] = []

    def hostile(headers: dict[str, str]) -> None:
        answers.append(send_headers_and_a_little(served.url, "/v1/runs/exp/rollouts", headers))

    threads = [
        threading.Thread(target=hostile, args=(h,))
        for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}, {})
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4
    for answer in answers:  # answered although 56 MB were declared and 64 KB sent
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert b"www-authenticate: bearer" in answer.lower()
    grown_kb = status_kb(pid, "VmHWM") - before
    assert grown_kb < 16 * 1024, f"server grew {grown_kb} kB for four refused 56 MB bodies"


def test_a_large_valid_body_costs_a_small_multiple_of_its_size(serve_process: Callable[..., ServeProcess]) -> None:
    """One rollout of 8M positions: peak resident growth stays within 8x the body (docs/service.md states
    the figure bench/service_durability.py measures)."""
    positions = 8_000_000
    body = b'{"rollouts":[{"id":"big","dispatch_version":0,"samples":[{"mask":[' + b"1," * (positions - 1) + b"1]}]}]}"
    served = serve_process(["--max-body-bytes", str(len(body))])
    pid = served.process.pid
    with httpx.Client(base_url=served.url, timeout=600) as http:
        http.put("/v1/runs/big", json={}).raise_for_status()
        before = status_kb(pid, "VmRSS") * 1024
        added = http.post("/v1/runs/big/rollouts", content=body, headers={"content-type": "application/json"})
        assert added.status_code == 200 and added.json()["accepted"] == 1
        peak = status_kb(pid, "VmHWM") * 1024
        shipped = http.post("/v1/runs/big/ship", json={"step": 1}).json()
        assert shipped["counts"]["tokens_sampled"] == positions
    assert (peak - before) / len(body) < 8


def test_long_lists_read_as_arrays_give_the_same_errors_and_duplicates(server: ThreadServer) -> None:
    """The array fast path changes no answer: a bad value deep in a long mask is named as before, and a
    re-sent long record is a duplicate."""
    n = 5000
    good = {"id": "long", "dispatch_version": 0, "samples": [{"mask": [1] * n, "rl_weights": [0.5] * n}]}
    bad_mask = [1] * n
    bad_mask[4321] = 2
    bad = {"id": "bad", "dispatch_version": 0, "samples": [{"mask": bad_mask}]}
    floaty = {"id": "floaty", "dispatch_version": 0, "samples": [{"mask": [1.0] * n}]}
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={})
        assert http.post("/v1/runs/exp/rollouts", json={"rollouts": [good]}).json()["accepted"] == 1
        assert http.post("/v1/runs/exp/rollouts", json={"rollouts": [good]}).json()["duplicates"] == 1
        [error] = http.post("/v1/runs/exp/rollouts", json={"rollouts": [bad]}).json()["detail"]
        assert (error["field"], error["reason"]) == ("samples[0].mask[4321]", "expected 0, 1 or a boolean, got 2")
        [error] = http.post("/v1/runs/exp/rollouts", json={"rollouts": [floaty]}).json()["detail"]
        assert error["field"] == "samples[0].mask[0]" and "got 1.0" in error["reason"]
        shipped = http.post("/v1/runs/exp/ship", json={"step": 1, "include_rollouts": True}).json()
        assert shipped["rollouts"][0]["samples"][0]["rl_weights"] == [0.5] * n


@pytest.mark.parametrize("token", ["", " ", "\t \n"])
def test_blank_tokens_are_refused_at_start(token: str) -> None:
    result = subprocess.run(
        serve_command(["--token", token, "--port", "0", "--in-memory"]), cwd=ROOT, env=child_env(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "refusing a blank token from --token" in result.stderr
    assert result.stdout == ""  # it never served
    with pytest.raises(ValueError, match="blank"):
        ServerSettings(token=token)


def test_a_blank_token_in_the_environment_is_refused() -> None:
    result = subprocess.run(
        serve_command(["--host", "0.0.0.0", "--port", "0", "--in-memory"]), cwd=ROOT,
        env=child_env({"STALENESS_METRICS_TOKEN": "   "}), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "refusing a blank token from STALENESS_METRICS_TOKEN" in result.stderr
    assert result.stdout == ""


def test_empty_env_is_refused_naming_the_field(server: ThreadServer) -> None:
    record = {"id": "r", "env": "", "dispatch_version": 0, "samples": [{"mask": [1]}]}
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={"env_breakdown": True})
        response = http.post("/v1/runs/exp/rollouts", json={"rollouts": [record]})
        assert response.status_code == 422
        [error] = response.json()["detail"]
        assert (error["rollout_id"], error["field"]) == ("r", "env")
        assert error["reason"] == "must be a non-empty string when present"
        assert http.get("/v1/runs/exp").json()["queued"] == 0


def test_serve_refuses_a_data_directory_it_cannot_use(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "tests.server.launch", "serve", "--port", "0", "--data-dir", str(not_a_dir)],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1 and "cannot load the data directory" in result.stderr
    assert result.stdout == ""  # it never announced a URL


def test_two_services_cannot_share_a_data_directory(serve_process: Callable[..., ServeProcess], tmp_path: Path) -> None:
    serve_process(["--data-dir", str(tmp_path)])
    result = subprocess.run(
        serve_command(["--port", "0", "--data-dir", str(tmp_path)]), cwd=ROOT, env=child_env(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1 and f"another service is using {tmp_path}" in result.stderr
