"""The ``serve`` command line: help with examples, the defaults of SPEC 10, and start-up failures."""

from __future__ import annotations

import argparse
import socket
import subprocess
from pathlib import Path

import pytest

from staleness_metrics.commands import serve

from .conftest import ROOT, child_env, serve_command


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


def test_an_empty_token_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert serve.run(parse("--token-file", str(empty))) == 2  # not a service without a token
    assert f"cannot read the token file: {empty} is empty" in capsys.readouterr().err
