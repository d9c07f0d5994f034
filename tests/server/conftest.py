"""Real uvicorn servers on 127.0.0.1 for the service tests: in a thread, or the ``serve`` command in a
subprocess. Both pick a free port and are stopped by the fixtures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from staleness_metrics.server import ServerSettings, create_app
from staleness_metrics.server.limits import uvicorn_header_options

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 60.0  # only guards against a hang; never asserted as a speed
# One TLS context for the tests' one-off requests (``httpx.get(..., verify=TLS)``): httpx otherwise builds
# one per call from the CA bundle (40-150 ms each), most of the time of a test that makes hundreds of them.
# The services under test speak plain HTTP; the context is only what httpx wants to have.
TLS = httpx.create_ssl_context()


class ThreadServer:
    """uvicorn serving the app on 127.0.0.1:<free port> in a background thread, with the header size cap
    and deadline ``serve`` uses (its defaults)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", **uvicorn_header_options())
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def start(self) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()


@pytest.fixture
def start_server() -> Iterator[Callable[..., ThreadServer]]:
    """``start_server(ServerSettings(...))`` -> a started :class:`ThreadServer` (stopped at teardown)."""
    servers: list[ThreadServer] = []

    def start(settings: ServerSettings | None = None) -> ThreadServer:
        server = ThreadServer(settings or ServerSettings()).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server: Callable[..., ThreadServer]) -> ThreadServer:
    """A service without a token (loopback)."""
    return start_server()


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    url: str

    def stop(self) -> tuple[int, str]:
        """SIGTERM (uvicorn shuts down gracefully, flushing exporters); returns the exit code and stderr."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            _, stderr = self.process.communicate(timeout=STARTUP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate()
        return self.process.returncode, stderr


def serve_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "tests.server.launch", "serve", *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALENESS_METRICS_", "OTEL_", "WANDB_"))}
    env.update(extra or {})
    return env


@pytest.fixture
def serve_process() -> Iterator[Callable[..., ServeProcess]]:
    """``serve_process([args], env)`` runs ``staleness-metrics serve --port 0 ...`` and waits for its URL
    (``--in-memory`` unless ``args`` name a ``--data-dir``: nothing is written under the project)."""
    started: list[ServeProcess] = []

    def start(args: Sequence[str] = (), env: dict[str, str] | None = None) -> ServeProcess:
        memory = [] if "--data-dir" in args else ["--in-memory"]
        process = subprocess.Popen(
            serve_command(["--port", "0", "--log-level", "warning", *memory, *args]),
            cwd=ROOT,
            env=child_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        if match is None:
            process.kill()
            _, stderr = process.communicate()
            raise AssertionError(f"serve did not start: {line!r} {stderr}")
        served = ServeProcess(process, match.group(0))
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()
