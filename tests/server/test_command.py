"""The ``serve`` command line: help with examples, the defaults of SPEC 10, start-up failures, restarts."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from staleness_metrics.cli.commands import serve
from staleness_metrics.errors import ConfigError
from staleness_metrics.server import ServerSettings

from .conftest import ROOT, ServeProcess, child_env, serve_command


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_defaults_are_the_specs() -> None:
    args = parse()
    assert (args.host, args.port, args.token) == ("127.0.0.1", 9487, None)
    assert args.func is serve.run


def test_help_shows_examples() -> None:
    result = subprocess.run(
        serve_command(["--help"]), cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert "examples:" in result.stdout and "curl -X PUT localhost:9487/v1/runs/exp-42" in result.stdout
    assert "STALENESS_METRICS_TOKEN" in result.stdout


@pytest.mark.integration
def test_port_taken_exits_1_with_a_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            serve_command(["--port", str(port)]), cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_unreadable_token_file_exits_2() -> None:
    result = subprocess.run(
        serve_command(["--token-file", "/nonexistent/token"]), cwd=ROOT, env=child_env(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "cannot read the token file" in result.stderr


def test_a_port_beyond_65535_is_refused_not_wrapped(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.run(parse("--port", "99999")) == 2  # the socket layer would have listened on 34463
    assert "--port must be 0..65535, got 99999" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "reason"),
    [(["--body-bytes-per-span-row", "-1"], f"must be in 0..{2**53}, got -1"),
     (["--max-body-bytes", "0"], f"must be in 1..{2**53}, got 0")],
)  # fmt: skip
def test_a_negative_span_row_allowance_or_no_body_is_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    assert serve.run(parse(*argv)) == 2
    assert capsys.readouterr().err == f"staleness-metrics serve: {argv[0]}: {reason}\n"


@pytest.mark.parametrize(
    ("settings", "field"),
    [({"protect_reads": True}, "protect_reads"), ({"max_body_bytes": 0}, "max_body_bytes"),
     ({"max_body_bytes": -1}, "max_body_bytes"), ({"max_body_bytes": "1000"}, "max_body_bytes"),
     ({"body_bytes_per_span_row": -1}, "body_bytes_per_span_row")],
)  # fmt: skip
def test_server_settings_refuse_what_serve_refuses(settings: dict[str, Any], field: str) -> None:
    """create_app took them: reads open without a word, every request a 413, a TypeError in the app."""
    with pytest.raises(ConfigError) as refused:
        ServerSettings(**settings)
    assert refused.value.field == field


@pytest.mark.integration
def test_the_span_row_allowance_is_the_command_lines(serve_process: Callable[..., ServeProcess]) -> None:
    """100,000 mask flips: more rows than a 200 KB body may cut by default (65,536), queued with no cap."""
    flips = {"id": "f", "dispatch_version": 0, "samples": [{"mask": [0, 1] * 50_000}]}
    for flag, expected in ((), 413), (("--body-bytes-per-span-row", "0"), 200):
        served = serve_process(list(flag))
        with httpx.Client(base_url=served.url, timeout=120) as http:
            http.put("/v1/runs/exp", json={}).raise_for_status()
            answer = http.post("/v1/runs/exp/rollouts", json={"rollouts": [flips]})
        assert answer.status_code == expected, answer.text[:300]
        if expected == 413:
            [error] = answer.json()["detail"]
            assert (error["rollout_id"], error["field"]) == ("f", "samples[0].mask")


def test_an_empty_token_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert serve.run(parse("--token-file", str(empty))) == 2  # not a service without a token
    assert f"cannot read the token file: {empty} is empty" in capsys.readouterr().err


@pytest.mark.integration
def test_a_restart_serves_every_stored_run_as_it_was(
    tmp_path: Path, serve_process: Callable[..., ServeProcess]
) -> None:
    """Runs are loaded in the background after a restart; whichever is asked first is loaded first, and
    each answers as before the restart (the last one asked first, /metrics after)."""
    names = [f"run-{i}" for i in range(5)]
    first = serve_process(["--data-dir", str(tmp_path)])
    with httpx.Client(base_url=first.url, timeout=60) as http:
        for i, name in enumerate(names):
            assert http.put(f"/v1/runs/{name}", json={"max_staleness": 1 + i}).status_code == 201
            records = [{"id": f"r{j}", "dispatch_version": 0, "samples": [{"mask": [1] * (j + 1)}]} for j in range(3)]
            assert http.post(f"/v1/runs/{name}/rollouts", json={"rollouts": records}).status_code == 200
            assert http.post(f"/v1/runs/{name}/ship", json={"step": 1 + i}).status_code == 200
        before = {name: http.get(f"/v1/runs/{name}").json() for name in names}
    first.stop()  # SIGTERM: a clean shutdown (a final snapshot of every run)

    again = serve_process(["--data-dir", str(tmp_path)])
    with httpx.Client(base_url=again.url, timeout=60) as http:
        assert http.get(f"/v1/runs/{names[-1]}").json() == before[names[-1]]
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json()["runs"] == len(names) and health.json()["unavailable"] == {}
        assert {name: http.get(f"/v1/runs/{name}").json() for name in names} == before
        assert {run["run"] for run in http.get("/v1/runs").json()["runs"]} == set(names)


def test_the_command_line_imports_no_server_dependencies() -> None:
    """``staleness-metrics --help`` and every other subcommand start without FastAPI, uvicorn or W&B:
    the service imports them when it starts."""
    code = (
        "import sys, staleness_metrics.cli; "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'wandb', 'opentelemetry', 'starlette') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


@pytest.fixture
def never_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command line refused at start: never served (a test that would otherwise serve until killed)."""
    uvicorn = pytest.importorskip("uvicorn")
    monkeypatch.setattr(uvicorn.Server, "run", lambda *_, **__: pytest.fail("started serving"))


@pytest.mark.usefixtures("never_served")
def test_protect_reads_without_a_token_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It started and served every read to anyone, without a word."""
    monkeypatch.delenv("STALENESS_METRICS_TOKEN", raising=False)
    assert serve.run(parse("--in-memory", "--port", "0", "--protect-reads")) == 2
    needs = "--protect-reads: needs a token, or it would protect nothing"
    assert capsys.readouterr().err == f"staleness-metrics serve: {needs}\n"


@pytest.mark.usefixtures("never_served")
def test_a_token_and_a_token_file_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file was silently ignored."""
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file-0123456789\n")
    assert serve.run(parse("--in-memory", "--token", "on-the-line-0123456789", "--token-file", str(token_file))) == 2
    assert capsys.readouterr().err == "staleness-metrics serve: --token and --token-file: give one of them\n"


@pytest.mark.usefixtures("never_served")
@pytest.mark.parametrize(
    ("environment", "named"),
    [({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
     ({"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "xml", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
      "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")],
)  # fmt: skip
def test_an_otlp_protocol_from_the_environment_is_checked_as_the_flag_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], environment: dict[str, str], named: str
) -> None:
    """The service started, and every run lacked OTLP with only a log line not naming the variable."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert serve.run(parse("--in-memory", "--port", "0")) == 2
    got = environment[named]
    assert capsys.readouterr().err == (
        f"staleness-metrics serve: ${named}: expected http/protobuf or grpc, got {got!r}\n"
    )
