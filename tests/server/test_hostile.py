"""A hostile or careless client against the real ``serve`` command: no work before the token, no blank
tokens, no empty env, and bounded memory for a large valid body."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from staleness_metrics import MismatchSums, StalenessConfig, StalenessMonitor
from staleness_metrics.errors import ConfigError, TraceError, shortened
from staleness_metrics.records.model import COMPACT_MASK_MIN_POSITIONS
from staleness_metrics.server import ServerSettings
from staleness_metrics.server.store import DATABASE_NAME

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
    """One rollout of 8M positions: peak resident growth stays within 3x the body (docs/service.md, "Limits",
    gives the measured figure), numba's one-time load (about 100 MB a process, on
    the first batch that reaches a compiled loop) taken before, as docs/service.md counts it apart."""
    positions = 8_000_000
    body = b'{"rollouts":[{"id":"big","dispatch_version":0,"samples":[{"mask":[' + b"1," * (positions - 1) + b"1]}]}]}"
    served = serve_process(["--max-body-bytes", str(len(body))])
    pid = served.process.pid
    with httpx.Client(base_url=served.url, timeout=600) as http:
        http.put("/v1/runs/warm", json={}).raise_for_status()
        # as long as a batch whose mask is kept as int8: its cut takes the very loops the big one's does
        warm = {"id": "w", "dispatch_version": 0, "samples": [{"mask": [1] * COMPACT_MASK_MIN_POSITIONS}]}
        http.post("/v1/runs/warm/rollouts", json={"rollouts": [warm]}).raise_for_status()
        http.put("/v1/runs/big", json={}).raise_for_status()
        before = status_kb(pid, "VmRSS") * 1024
        added = http.post("/v1/runs/big/rollouts", content=body, headers={"content-type": "application/json"})
        assert added.status_code == 200 and added.json()["accepted"] == 1
        peak = status_kb(pid, "VmHWM") * 1024
        shipped = http.post("/v1/runs/big/ship", json={"step": 1}).json()
        assert shipped["counts"]["tokens_sampled"] == positions
    assert (peak - before) / len(body) < 3


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


@pytest.mark.parametrize("large_first", [True, False])
def test_a_record_is_the_same_record_in_a_large_body_and_alone(server: ThreadServer, large_first: bool) -> None:
    """A body over 1 MiB reads its long lists straight into arrays, a small one its lists of 1024 items or more:
    the same lists, so a record re-sent in the other kind of body is a duplicate (an integer among floats was
    0.0 in one and 0 in the other, and exactly-once answered 409)."""
    record = {"id": "x", "dispatch_version": 0, "samples": [{"mask": [1] * 300, "logprobs": [-0.123456] * 299 + [0]}]}
    filler = {"id": "long", "dispatch_version": 0, "samples": [{"mask": [1] * 600_000}]}
    bodies = [[filler, record], [record]]
    with httpx.Client(base_url=server.url) as http:
        http.put(f"/v1/runs/{large_first}", json={})
        for rollouts in bodies if large_first else bodies[::-1]:
            answer = http.post(f"/v1/runs/{large_first}/rollouts", json={"rollouts": rollouts})
            assert answer.status_code == 200, answer.text
        assert answer.json()["duplicates"] == 1


def test_a_lenient_run_sets_aside_samples_that_are_not_a_list(server: ThreadServer) -> None:
    """``"samples": 1`` is set aside like any bad record (it answered 500 with the batch half applied)."""
    good = {"id": "a", "dispatch_version": 0, "samples": [{"mask": [1, 1]}]}
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/lenient", json={"strict": False})
        answer = http.post("/v1/runs/lenient/rollouts", json={"rollouts": [good, {**good, "id": "b", "samples": 1}]})
        assert answer.status_code == 200 and answer.json()["invalid"][0]["field"] == "samples"
        assert http.get("/v1/runs/lenient").json()["queued"] == 1


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


# ---------------------------------------------------------------- what the journal cannot store (issue 19)

LONE = "x\\ud800"  # the JSON text of a string with a lone surrogate


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("strict", [True, False])
def test_unstorable_records_get_422_and_the_run_keeps_serving(
    serve_process: Callable[..., ServeProcess], tmp_path: Path, strict: bool
) -> None:
    served = serve_process(["--data-dir", str(tmp_path)])
    cases = {
        "id": f'{{"id": "{LONE}", "dispatch_version": 0, "samples": [{{"mask": [1]}}]}}',
        "group_id": f'{{"id": "g", "group_id": "{LONE}", "dispatch_version": 0, "samples": [{{"mask": [1]}}]}}',
        "env": f'{{"id": "e", "env": "{LONE}", "dispatch_version": 0, "samples": [{{"mask": [1]}}]}}',
        "samples[0].mask[1]": '{"id": "b", "dispatch_version": 0, "samples": [{"mask": [1, 1180591620717411303424]}]}',
        "samples[0].rl_weights[0]": '{"id": "w", "dispatch_version": 0, "samples": [{"mask": [1], '
        '"rl_weights": [-99999999999999999999]}]}',
    }
    with httpx.Client(base_url=served.url, timeout=60) as http:
        http.put("/v1/runs/exp", json={"strict": strict}).raise_for_status()
        for field, record in cases.items():
            answer = post_raw(http, "/v1/runs/exp/rollouts", f'{{"rollouts": [{record}]}}')
            assert answer.status_code == 422, (field, answer.text)
            [error] = answer.json()["detail"]
            assert error["field"] == field
            assert error["rollout_id"] == {"id": "x\\ud800"}.get(field, error["rollout_id"])  # printable
            assert error["rollout_id"] is not None and error["index"] == 0
        ship = post_raw(http, "/v1/runs/exp/ship", f'{{"step": 1, "ids": ["{LONE}"]}}')
        assert ship.status_code == 422 and ship.json()["detail"][0]["field"] == "body.ids", ship.text
        # nothing was applied, and the run answers reads and writes as before
        assert http.get("/v1/runs/exp").json()["rollouts_received"] == 0
        good = {"id": "ok", "dispatch_version": 0, "samples": [{"mask": [1, 1]}]}
        assert http.post("/v1/runs/exp/rollouts", json={"rollouts": [good]}).json()["accepted"] == 1
        assert http.post("/v1/runs/exp/ship", json={"step": 1}).json()["shipped"] == ["ok"]
        assert http.get("/v1/runs/exp/steps").status_code == 200
        assert len(list(http.get("/v1/runs/exp/events").iter_lines())) == 2
        assert http.get("/metrics").status_code == 200


def test_lenient_runs_still_set_aside_what_can_be_stored(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={"strict": False})
        bad = {"id": "neg", "dispatch_version": 0, "samples": [{"mask": [1, 2]}]}
        answer = http.post("/v1/runs/exp/rollouts", json={"rollouts": [bad]}).json()
        assert answer["accepted"] == 0 and answer["invalid"][0]["field"] == "samples[0].mask[1]"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("depth", "limit"), [(300, 0), (5000, 0), (5000, 20_000)])
def test_deep_nesting_is_a_client_error_on_every_route(server: ThreadServer, depth: int, limit: int) -> None:
    """(A recursion limit of 20,000 lets the standard library read 5,000 levels, as Python 3.13 does: the
    answer is orjson's, on every Python.)"""
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit or old_limit)
    try:
        _post_deep_bodies(server, depth)
    finally:
        sys.setrecursionlimit(old_limit)


def _post_deep_bodies(server: ThreadServer, depth: int) -> None:
    deep = nested(depth)
    bodies = {
        ("PUT", "/v1/runs/new"): f'{{"policy": {deep}}}',
        ("POST", "/v1/runs/exp/rollouts"): f'{{"rollouts": [{{"id": "r", "samples": {deep}}}]}}',
        ("POST", "/v1/runs/exp/sweep"): f'{{"step": {deep}}}',
        ("POST", "/v1/runs/exp/ship"): f'{{"step": 1, "ids": {deep}}}',
        ("POST", "/v1/runs/exp/mismatch"): f'{{"step": 1, "sums": {{"lags": {deep}}}}}',
    }
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={"strict": False})
        for (method, path), text in bodies.items():
            answer = http.request(method, path, content=text.encode(), headers={"content-type": "application/json"})
            assert answer.status_code in (400, 422), (path, answer.status_code, answer.text[:200])
            assert answer.status_code == (400 if depth > 1000 else 422), path  # one answer per depth
        assert http.get("/v1/runs/exp").json()["queued"] == 0


def test_a_huge_or_deeply_nested_wrong_value_is_named_in_a_short_reason(server: ThreadServer) -> None:
    """The reason quotes the start of the value, not all of it: a 600 KB value makes a short answer."""
    deep: object = [1]
    for _ in range(100):  # within what the journal stores (128 levels), wrong all the same
        deep = [deep]
    wide = {"id": "wide", "dispatch_version": 0, "samples": [{"mask": [1]}], "group_id": list(range(100_000))}
    nested = {"id": "nested", "dispatch_version": 0, "samples": [{"mask": [1]}], "group_id": deep}
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={"strict": False})
        answer = http.post("/v1/runs/exp/rollouts", json={"rollouts": [wide, nested]})
        assert answer.status_code == 200
        invalid = {item["rollout_id"]: item for item in answer.json()["invalid"]}
    assert {rid: item["field"] for rid, item in invalid.items()} == {"wide": "group_id", "nested": "group_id"}
    assert invalid["wide"]["reason"].startswith("expected a string, got [0, 1, 2, 3")
    assert all(len(item["reason"]) < 400 for item in invalid.values())
    assert "more characters" in invalid["wide"]["reason"]


def test_every_reason_is_cut_once_at_300_characters(server: ThreadServer) -> None:
    """A configuration's or mismatch sums' reason quoting a 1 MB value is cut as a record's is, and a
    record's reason, cut by the library already, keeps its count (it is not cut again)."""
    huge_policy = {"policy": "k" * 1_000_000}
    long_sums = {"uncovered": [1] * 100_000, "lags": {}}
    record = {"id": "a", "dispatch_version": [1] * 100_000, "samples": [{"mask": [1]}]}
    with pytest.raises(ConfigError) as config_error:
        StalenessConfig.from_mapping(huge_policy)
    with pytest.raises(ValueError) as sums_error:
        MismatchSums.from_dict(long_sums)
    with pytest.raises(TraceError) as trace_error:
        StalenessMonitor(StalenessConfig()).add([record])
    expected = {
        ("PUT", "/v1/runs/new"): (huge_policy, "policy", shortened(config_error.value.reason)),
        ("POST", "/v1/runs/exp/mismatch"): (
            {"step": 1, "sums": long_sums},
            "sums.uncovered",
            shortened(getattr(sums_error.value, "reason", "")),
        ),
        ("POST", "/v1/runs/exp/rollouts"): ({"rollouts": [record]}, "dispatch_version", trace_error.value.reason),
    }
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.put("/v1/runs/exp", json={}).raise_for_status()
        http.post("/v1/runs/exp/ship", json={"step": 1}).raise_for_status()
        for (method, path), (body, field, reason) in expected.items():
            answer = http.request(method, path, json=body)
            assert answer.status_code == 422, (path, answer.text[:300])
            [error] = answer.json()["detail"]
            assert (error["field"], error["reason"]) == (field, reason), path
            assert len(reason) < 340 and reason.endswith("more characters)")


@pytest.mark.parametrize("sign", ["", "-"])
def test_an_integer_too_long_to_convert_is_named_as_out_of_range(server: ThreadServer, sign: str) -> None:
    """Past 4,300 digits Python converts no integer (quadratic time): such an integer is refused as any
    integer outside int64 is, 422 naming the field (and the rollout), not a bare 400."""
    number = sign + "9" * 5000
    cases = {
        ("POST", "/v1/runs/exp/rollouts"): (
            f'{{"rollouts": [{{"id": "a", "dispatch_version": {number}, "samples": [{{"mask": [1]}}]}}]}}',
            "dispatch_version",
        ),
        ("PUT", "/v1/runs/new"): (f'{{"max_staleness": {number}}}', "max_staleness"),
        ("POST", "/v1/runs/exp/sweep"): (f'{{"step": {number}}}', "body.step"),
        ("POST", "/v1/runs/exp/ship"): (f'{{"step": {number}}}', "body.step"),
        ("POST", "/v1/runs/exp/mismatch"): (
            f'{{"step": 1, "sums": {{"uncovered": {number}, "lags": {{}}}}}}',
            "sums.uncovered",
        ),
    }
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={}).raise_for_status()
        for (method, path), (text, field) in cases.items():
            answer = http.request(method, path, content=text.encode(), headers={"content-type": "application/json"})
            assert answer.status_code == 422, (path, answer.text[:300])
            [error] = answer.json()["detail"]
            assert error["field"] == field, (path, error)
            assert error["rollout_id"] == ("a" if path.endswith("rollouts") else None)
        assert http.get("/v1/runs/exp").json()["rollouts_received"] == 0


def test_mismatch_sums_nested_as_deep_as_the_reader_reads_are_named(server: ThreadServer) -> None:
    """Deep nesting the JSON reader reads (900 levels) is 422 naming the field, on /mismatch too."""
    deep = "[" * 900 + "1" + "]" * 900
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={}).raise_for_status()
        http.post("/v1/runs/exp/ship", json={"step": 1}).raise_for_status()
        text = f'{{"step": 1, "sums": {{"uncovered": {deep}, "lags": {{}}}}}}'
        answer = post_raw(http, "/v1/runs/exp/mismatch", text)
        assert answer.status_code == 422, answer.text[:200]
        assert answer.json()["detail"][0]["field"] == "sums.uncovered"


# ---------------------------------------------------------------- headers (issue 19)


def raw_exchange(url: str, data: bytes, wait: float = 60) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        with contextlib.suppress(OSError):  # the server may close while a huge header is still being sent
            sock.sendall(data)
        sock.settimeout(wait)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
        return answer


def test_an_oversized_header_gets_431(serve_process: Callable[..., ServeProcess]) -> None:
    served = serve_process(["--max-header-bytes", "16384"])
    pid = served.process.pid
    before = status_kb(pid, "VmRSS")
    huge = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (8 * 1024 * 1024) + b"\r\n\r\n"
    answer = raw_exchange(served.url, huge)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert status_kb(pid, "VmHWM") - before < 8 * 1024  # never buffered: well under the 8 MB sent
    with httpx.Client(base_url=served.url) as http:  # headers under the cap are served
        assert http.get("/healthz", headers={"X-Fine": "a" * 8000}).status_code == 200


def header_block(size: int, last: bytes = b"Connection: close\r\n") -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * size + b"\r\n" + last + b"\r\n"


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer from a kept-alive connection (its head and body may come in two reads)."""
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < int(
        re.search(rb"content-length: (\d+)", answer, re.IGNORECASE)[1]  # type: ignore[index]
    ):
        chunk = sock.recv(65536)
        assert chunk, answer
        answer += chunk
    return answer


def test_a_header_block_read_at_once_is_held_to_the_cap(serve_process: Callable[..., ServeProcess]) -> None:
    """Counted before the parser sees the read: a whole block in one read used to pass uncounted."""
    served = serve_process(["--max-header-bytes", "2048"])
    for size, opening in ((4000, b""), (60_000, b""), (4000, b"\r\n\r\n")):  # empty lines may open a request
        answer = raw_exchange(served.url, opening + header_block(size))
        assert answer.startswith(b"HTTP/1.1 431"), (size, opening, answer[:200])
    assert raw_exchange(served.url, b"\r\n" * 5000).startswith(b"HTTP/1.1 431")
    assert raw_exchange(served.url, header_block(1500)).startswith(b"HTTP/1.1 200")
    # a body in the same read is not part of the headers, and neither is a body past a terminator
    # split between two reads
    body = b"{}" + b" " * 8000
    post = b"PUT /v1/runs/r HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    post += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    assert raw_exchange(served.url, post + body).startswith(b"HTTP/1.1 201")
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(post.replace(b"/r ", b"/s ")[:-1])
        time.sleep(0.3)
        sock.sendall(b"\n" + body)
        assert read_answer(sock).startswith(b"HTTP/1.1 201")


def test_each_request_on_a_kept_alive_connection_has_its_headers_counted(
    serve_process: Callable[..., ServeProcess],
) -> None:
    served = serve_process(["--max-header-bytes", "2048"])
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(60)
        for _ in range(3):  # under the cap each time, although together they are over it
            sock.sendall(header_block(1500, last=b""))
            answer = read_answer(sock)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        sock.sendall(header_block(4000, last=b""))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_slow_headers_are_cut_off_while_the_service_answers(serve_process: Callable[..., ServeProcess]) -> None:
    served = serve_process(["--header-timeout", "1"])
    host, port = served.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(20)]
    slow = socket.create_connection((host, int(port)))
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
    with httpx.Client(base_url=served.url) as http:
        assert http.get("/healthz").status_code == 200  # answered meanwhile
    slow.settimeout(60)
    answer = b""
    while chunk := slow.recv(65536):  # returns once the server closes the connection
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    for sock in idle:  # connections that never sent a request are closed too
        sock.settimeout(60)
        assert sock.recv(1) == b""
        sock.close()
    slow.close()


def test_a_body_that_stops_arriving_is_cut_off(serve_process: Callable[..., ServeProcess]) -> None:
    served = serve_process(["--header-timeout", "1"])
    stalled = b"POST /v1/runs/x/rollouts HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    stalled += b'Content-Length: 1000\r\n\r\n{"rollouts": ['
    answer = raw_exchange(served.url, stalled)  # returns once the server closes the connection
    assert answer.startswith(b"HTTP/1.1 408") and b"body stopped arriving" in answer, answer[:200]


def request(method: str, path: str, body: bytes | None = None) -> bytes:
    sent = b"" if body is None else b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    return f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n".encode() + sent + b"\r\n" + (body or b"")


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` answers (status, body) in the order they came: one read may hold several."""
    answers: list[tuple[int, bytes]] = []
    data = b""
    while len(answers) < count:
        head, blank, rest = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE) if blank else None
        if length is not None and len(rest) >= int(length[1]):
            answers.append((int(head.split(b" ")[1]), rest[: int(length[1])]))
            data = rest[int(length[1]) :]
            continue
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with unread bytes (the rest of the pipeline) on its side
            chunk = b""
        assert chunk, f"closed after {len(answers)} answers {answers}, then {data[:200]!r}"
        data += chunk
    return answers


def test_pipelined_requests_are_each_answered_in_order(serve_process: Callable[..., ServeProcess]) -> None:
    served = serve_process()
    host, port = served.url.removeprefix("http://").split(":")
    exchanges = [
        [request("GET", "/healthz"), request("PUT", "/v1/runs/a", b"{}")],
        [request("PUT", "/v1/runs/b", b"{}"), request("GET", "/v1/runs/b"), request("GET", "/healthz")],
    ]
    answers: list[tuple[int, bytes]] = []
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(60)
        for requests in exchanges:
            sock.sendall(b"".join(requests))  # one write: the server reads them together
            answers.extend(read_answers(sock, len(requests)))
    assert [code for code, _ in answers] == [200, 201, 201, 200, 200], answers
    health_before, run_a, run_b, read_b, health_after = [json.loads(body) for _, body in answers]
    assert [health_before["runs"], health_after["runs"]] == [0, 2]  # each read where it was sent
    assert [run_a["run"], run_b["run"], read_b["run"]] == ["a", "b", "b"]


def test_a_pipelined_body_waiting_for_its_turn_is_not_cut_off(serve_process: Callable[..., ServeProcess]) -> None:
    """A request queued behind one answered for longer than --header-timeout: its body waits unread (the
    service holds the reads meanwhile), and that is no client stalling. It answered 408 and closed the
    connection before the earlier request's answer, which was lost."""
    served = serve_process(["--header-timeout", "0.3"])
    host, port = served.url.removeprefix("http://").split(":")
    rollout = b'{"rollouts":[{"id":"big","dispatch_version":0,"samples":[{"mask":[' + b"1," * 4_000_000
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(120)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(request("PUT", "/v1/runs/big", b"{}"))
        assert read_answers(sock, 1)[0][0] == 201
        started = time.monotonic()
        # seconds to apply (the first batch also loads numba's compiled loops)
        sock.sendall(request("POST", "/v1/runs/big/rollouts", rollout + b"1]}]}]}"))
        queued = request("PUT", "/v1/runs/queued", b"{}")
        sock.sendall(queued[:-1])  # its body split in two writes: one byte waits for the reads to resume
        time.sleep(0.1)
        sock.sendall(queued[-1:] + request("GET", "/healthz"))
        answers = read_answers(sock, 3)
        assert time.monotonic() - started > 0.3, "the first request was answered too fast to queue the next"
    assert [code for code, _ in answers] == [200, 201, 200], answers
    assert json.loads(answers[0][1])["accepted"] == 1 and json.loads(answers[2][1])["runs"] == 2


def test_sigterm_ends_a_body_still_trickling_in(serve_process: Callable[..., ServeProcess]) -> None:
    """Each byte comes within the deadline, so only the shutdown's grace ends the request: before, the
    service waited for the client to finish or go, however long that took."""
    served = serve_process(["--header-timeout", "5"])
    assert httpx.put(f"{served.url}/v1/runs/x", json={}).status_code == 201
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/runs/x/rollouts HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{"
        )
        served.process.terminate()
        deadline = time.monotonic() + 60
        while served.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                sock.sendall(b" ")
            time.sleep(0.5)
        assert served.process.poll() is not None, "still serving a minute after SIGTERM"


# ---------------------------------------------------------------- memory per body (issue 19)


def peak_growth(pid: int, send: Callable[[], httpx.Response]) -> tuple[httpx.Response, int]:
    """The server's peak resident growth (bytes) while ``send`` runs: VmHWM reset first (clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = status_kb(pid, "VmRSS")
    answer = send()
    return answer, (status_kb(pid, "VmHWM") - before) * 1024


BASELINE = 48 * 1024 * 1024  # fixed costs of any large request (thread stacks, allocator arenas)


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_peak_memory_per_body_stays_within_three_times_its_size(
    serve_process: Callable[..., ServeProcess], tmp_path: Path, store: str
) -> None:
    served = serve_process(["--max-body-bytes", str(64 * 2**20), *(["--data-dir", str(tmp_path)] * (store == "disk"))])
    pid = served.process.pid
    size = 32 * 2**20
    empty_objects = b'{"rollouts":[' + b"{}," * (size // 3) + b"{}]}"
    per = 2000
    one = (
        '{"id":"r%d","dispatch_version":0,"samples":[{"mask":[' + ",".join(["1"] * per) + '],"logprobs":['
        + ",".join(["-0.123456"] * per) + '],"weight_versions":[[0,0],[1,1000]]}]}'
    )  # fmt: skip
    valid = ('{"rollouts":[' + ",".join(one % i for i in range(size // len(one))) + "]}").encode()
    mask_only = b'{"rollouts":[{"id":"m","dispatch_version":0,"samples":[{"mask":[' + b"1," * (size // 2) + b"1]}]}]}"
    # 5.6M spans on a one-position sample: refused naming the span, as the batch checks name it
    spans = (
        b'{"rollouts":[{"id":"s","dispatch_version":0,"samples":[{"mask":[1],"weight_versions":['
        + b"[0,0]," * (size // 6)
        + b"[0,0]]}]}]}"
    )
    quarter = size // 4
    weights = (
        b'{"rollouts":[{"id":"w","dispatch_version":0,"samples":[{"mask":['
        + b"1," * quarter
        + b'1],"rl_weights":['
        + b"1," * quarter
        + b"1]}]}]}"
    )
    tokens = (
        b'{"rollouts":[{"id":"t","dispatch_version":0,"samples":[{"mask":['
        + b"1," * quarter
        + b'1],"token_versions":['
        + b"0," * quarter
        + b"0]}]}]}"
    )
    with httpx.Client(base_url=served.url, timeout=600) as http:
        # The engine's compiled loops load numba once per process (about 100 MB resident): loaded first,
        # so that each body is measured for its own cost
        http.put("/v1/runs/warm", json={}).raise_for_status()
        n = 70_000
        warm = {"id": "w", "dispatch_version": 0, "samples": [{"mask": [1] * n, "rl_weights": [1.0] * n}]}
        http.post("/v1/runs/warm/rollouts", json={"rollouts": [warm]}).raise_for_status()
        # a run per body, as bench/service.py measures: a body's own cost (the case after the loop adds a
        # run's snapshot to it)
        cases = (
            ("objects", empty_objects, 413),
            ("valid", valid, 200),
            ("mask", mask_only, 200),
            ("spans", spans, 422),
            ("weights", weights, 200),
            ("tokens", tokens, 200),
        )
        for run, body, expected in cases:
            http.put(f"/v1/runs/{run}", json={}).raise_for_status()
            answer, grown = peak_growth(
                pid,
                lambda body=body, run=run: http.post(
                    f"/v1/runs/{run}/rollouts", content=body, headers={"content-type": "application/json"}
                ),
            )
            assert answer.status_code == expected, answer.text[:300]
            # 3x the body, with a data directory too: its journal row is hashed and written a piece at a
            # time (docs/service.md, "Limits", gives the measured figures)
            assert grown < 3 * len(body) + BASELINE, f"{grown / len(body):.1f}x a {len(body)} byte body"
            if run == "tokens":  # small versions stay int8 in the queue, cut a piece at a time: about 1.6x
                assert grown < 2.5 * len(body), f"{grown / len(body):.2f}x a {len(body)} byte body"
            if expected == 422:
                [error] = answer.json()["detail"]
                assert (error["rollout_id"], error["field"], error["reason"]) == (
                    "s",
                    "samples[0].weight_versions[1]",
                    "span starts must strictly increase",
                )
        # Two mask bodies queued in one run: the second's journal row passes SNAPSHOT_BYTES, so with a data
        # directory that request also snapshots the run (its whole queue, both bodies' masks), written a
        # piece at a time: still within 3x of the one body
        http.put("/v1/runs/snapshot", json={}).raise_for_status()
        for number in (1, 2):
            body = mask_only.replace(b'"id":"m"', b'"id":"m%d"' % number, 1)
            answer, grown = peak_growth(
                pid,
                lambda body=body: http.post(
                    "/v1/runs/snapshot/rollouts", content=body, headers={"content-type": "application/json"}
                ),
            )
            assert answer.status_code == 200, answer.text[:300]
            assert grown < 3 * len(body) + BASELINE, f"{grown / len(body):.1f}x a {len(body)} byte body"
        if store == "disk":
            with contextlib.closing(sqlite3.connect(tmp_path / DATABASE_NAME)) as db:
                taken = db.execute("SELECT seq FROM snapshots WHERE run = 'snapshot'").fetchone()
            assert taken == (2,)  # the request measured last took the snapshot
        assert http.get("/v1/runs/snapshot").json()["queued"] == 2
        assert http.get("/v1/runs/valid").json()["queued"] == size // len(one)
        shipped = http.post("/v1/runs/valid/ship", json={"step": 2}).json()  # labels up to version 1
        assert shipped["counts"]["tokens_sampled"] == size // len(one) * per
        shipped = http.post("/v1/runs/mask/ship", json={"step": 1}).json()
        assert shipped["counts"]["tokens_sampled"] == size // 2 + 1
        for run in ("weights", "tokens"):
            shipped = http.post(f"/v1/runs/{run}/ship", json={"step": 1}).json()
            assert shipped["counts"]["tokens_sampled"] == quarter + 1


MANY = 200_000


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("ship", b'{"step": 1, "ids": [' + b",".join([b"0"] * MANY) + b"]}", 422),
        ("rollouts", b'{"rollouts": [' + b",".join([b"0"] * MANY) + b"]}", 422),
        ("sweep", b'{"step": 1, ' + b",".join(b'"%x": 0' % key for key in range(MANY)) + b"}", 422),
        # a body of millions of tiny values is refused before it is built, on every route
        ("sweep", b'{"step": 1, "x": [' + b"[]," * (4 * MANY * 7) + b"[]]}", 413),
    ],
    ids=["ids", "rollouts", "keys", "tiny-values"],
)
def test_a_body_of_many_errors_gets_a_short_answer_in_bounded_memory(
    serve_process: Callable[..., ServeProcess], path: str, body: bytes, expected: int
) -> None:
    """A body whose every value is wrong (an integer id, an unknown key) got an error item per value:
    some 1 KB of memory each, 50x the body in the answer. Now the first bad item of a list, one error
    for many unknown keys, within 3x the body as any other body."""
    served = serve_process()
    with httpx.Client(base_url=served.url, timeout=300) as http:
        http.put("/v1/runs/exp", json={}).raise_for_status()
        answer, grown = peak_growth(served.process.pid, lambda: post_raw(http, f"/v1/runs/exp/{path}", body.decode()))
    assert answer.status_code == expected, answer.text[:300]
    assert len(answer.content) < 1000, f"a {len(answer.content)} byte answer"
    assert grown < 3 * len(body) + BASELINE, f"{grown / len(body):.1f}x a {len(body)} byte body"


def test_a_422_lists_twenty_errors_and_counts_the_rest(server: ThreadServer) -> None:
    """Unknown keys up to the cap are each named, as any error; past twenty, one item counts the rest."""
    body = {f"key{number}": 0 for number in range(23)}  # 23 unknown keys and no step: 24 errors
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/runs/exp", json={}).raise_for_status()
        detail = http.post("/v1/runs/exp/ship", json=body).json()["detail"]
    assert [item["field"] for item in detail[:20]] == ["body.step", *(f"body.key{number}" for number in range(19))]
    assert detail[20:] == [{"field": "body", "reason": "4 more errors", "rollout_id": None, "index": None}]


def _runs(values: tuple[bytes, bytes], run: int, positions: int) -> bytes:
    """``positions`` comma-separated values, alternating between the two every ``run`` positions."""
    pair = (values[0] + b",") * run + (values[1] + b",") * run
    return (pair * (positions // (2 * run) + 1))[: 2 * positions - 1]


def test_a_body_cutting_a_span_row_per_position_gets_413_within_three_times_its_size(
    serve_process: Callable[..., ServeProcess],
) -> None:
    """Valid bodies whose mask or versions change at every position would each hold about 60 bytes of span
    table per position (2 bytes of body): refused before any table is built, naming rollout, field and
    reason; a body of the same size with runs of realistic length, and a small alternating one, are queued."""
    served = serve_process(["--max-body-bytes", str(64 * 2**20)])
    pid = served.process.pid
    size = 12 * 2**20
    half = size // 2

    def body(rid: str, sample: bytes) -> bytes:
        return b'{"rollouts":[{"id":"%s","dispatch_version":0,"samples":[{%s}]}]}' % (rid.encode(), sample)

    mask_flips = body("m", b'"mask":[' + _runs((b"0", b"1"), 1, half) + b"]")
    ones = b'"mask":[' + _runs((b"1", b"1"), 1, half // 2) + b"]"
    version_flips = body("t", ones + b',"token_versions":[' + _runs((b"0", b"1"), 1, half // 2) + b"]")
    # a multi-turn rollout: the mask changes every 100 positions, the version every 1000
    turn_mask = b'"mask":[' + _runs((b"1", b"0"), 100, half // 2) + b"]"
    turns = body("r", turn_mask + b',"token_versions":[' + _runs((b"3", b"4"), 1000, half // 2) + b"]")
    # one span row per 140 bytes of body, just within the default allowance (one per 128)
    near_cap = body("c", b'"mask":[' + _runs((b"1", b"0"), 70, half) + b"]")
    small = body("s", b'"mask":[' + _runs((b"0", b"1"), 1, 60_000) + b"]")  # under the 65,536 rows always allowed
    with httpx.Client(base_url=served.url, timeout=600) as http:
        http.put("/v1/runs/warm", json={}).raise_for_status()  # numba loaded first, as in the test above
        n = 70_000
        warm_mask = ([1] * 50 + [0] * 50) * (n // 100)  # a mask that changes and versions: every compiled loop
        warm = {"id": "w", "dispatch_version": 0, "samples": [{"mask": warm_mask, "token_versions": [0] * n}]}
        http.post("/v1/runs/warm/rollouts", json={"rollouts": [warm]}).raise_for_status()
        cases = (
            ("mask", mask_flips, 413, "m", "samples[0].mask"),
            ("versions", version_flips, 413, "t", "samples[0].token_versions"),
            ("turns", turns, 200, "", ""),
            ("cap", near_cap, 200, "", ""),
            ("small", small, 200, "", ""),
        )
        for run, sent, expected, rollout, field in cases:
            http.put(f"/v1/runs/{run}", json={}).raise_for_status()
            answer, grown = peak_growth(
                pid,
                lambda sent=sent, run=run: http.post(
                    f"/v1/runs/{run}/rollouts", content=sent, headers={"content-type": "application/json"}
                ),
            )
            assert answer.status_code == expected, answer.text[:300]
            # 1.8x for each 12 MiB body (the parse): the refused ones build no span table (docs/service.md)
            allowance = 3 * len(sent) + (BASELINE if len(sent) < 2**20 else 0)
            assert grown < allowance, f"{run}: {grown / len(sent):.1f}x a {len(sent)} byte body"
            if expected == 413:
                [error] = answer.json()["detail"]
                assert (error["rollout_id"], error["field"], error["index"]) == (rollout, field, 0)
                assert "span rows" in error["reason"] and "--body-bytes-per-span-row" in error["reason"]
                assert http.get(f"/v1/runs/{run}").json()["queued"] == 0  # nothing of it was applied
            else:
                assert answer.json()["accepted"] == 1


def test_a_wrong_method_gets_405_listing_the_methods_the_path_takes(server: ThreadServer) -> None:
    """RFC 9110: a 405 names in ``Allow`` every method the path takes, routes of included routers too."""
    expected = {
        ("DELETE", "/healthz"): "GET",
        ("PUT", "/metrics"): "GET",
        ("GET", "/v1/runs/exp/rollouts"): "POST",
        ("POST", "/v1/runs/exp"): "DELETE, GET, PUT",
        ("GET", "/v1/runs/exp/ship"): "POST",
        ("PATCH", "/docs"): "GET, HEAD",
    }
    with httpx.Client(base_url=server.url) as http:
        for (method, path), allow in expected.items():
            response = http.request(method, path)
            assert (response.status_code, response.headers.get("allow")) == (405, allow), (method, path)
