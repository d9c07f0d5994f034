"""A real Prometheus server on loopback for tests: scrape targets, then ask PromQL over the HTTP API.

Reusable by any test module::

    from tests.support.prometheus import PrometheusServer, requires_prometheus

    @requires_prometheus
    def test_something(tmp_path):
        with PrometheusServer(tmp_path, targets=["127.0.0.1:9487"]) as prom:
            prom.wait_until(lambda: prom.query_value('rl_staleness_train_step') == 3)

or through the ``prometheus_server`` fixture factory (import it into your conftest.py):
``server = prometheus_server(targets=[...])``. Skipped (with the reason) only when the ``prometheus``
binary is missing on a developer machine; under CI (which installs Debian's ``prometheus`` 2.42) a
missing binary fails the test.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import pytest

from tests.support.programs import missing_program, requires_program

__all__ = [
    "PrometheusServer",
    "PushgatewayServer",
    "free_port",
    "prometheus_server",
    "promtool_check_metrics",
    "requires_prometheus",
    "requires_promtool",
    "requires_pushgateway",
]

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
PUSHGATEWAY = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")

_NO_PROMETHEUS = "the prometheus binary is not installed (Debian package prometheus)"
_NO_PROMTOOL = "promtool is not installed (Debian package prometheus)"
_NO_PUSHGATEWAY = "prometheus-pushgateway is not installed (Debian package prometheus-pushgateway)"

requires_prometheus = requires_program(PROMETHEUS, _NO_PROMETHEUS)
requires_promtool = requires_program(PROMTOOL, _NO_PROMTOOL)
requires_pushgateway = requires_program(PUSHGATEWAY, _NO_PUSHGATEWAY)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def promtool_check_metrics(exposition: bytes) -> subprocess.CompletedProcess[str]:
    """Run ``promtool check metrics`` on a text exposition (exit 0 = clean)."""
    if PROMTOOL is None:
        missing_program(_NO_PROMTOOL)
    return subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition.decode(), capture_output=True, text=True, timeout=60
    )


class _ChildProcess:
    """A server binary run by a test: stopped on exit, killed if it will not stop."""

    _process: subprocess.Popen[bytes] | None

    def start(self: _Server) -> _Server:
        raise NotImplementedError

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _ready(self, process: subprocess.Popen[bytes], url: str, ready_timeout: float, log: Callable[[], str]) -> bool:
        """Whether ``process`` answers ``url`` ready (False: it exited); not ready in time raises."""
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self._process = None
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{type(self).__name__} not ready after {ready_timeout} s: {log()}")

    def __enter__(self: _Server) -> _Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


_Server = TypeVar("_Server", bound=_ChildProcess)


class PrometheusServer(_ChildProcess):
    """``prometheus`` on 127.0.0.1 scraping ``targets`` every ``scrape_interval`` (job ``job``)."""

    def __init__(
        self,
        workdir: Path,
        targets: Sequence[str],
        *,
        job: str = "staleness",
        scrape_interval: str = "1s",
        extra_flags: Sequence[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.targets = list(targets)
        self.job = job
        self.scrape_interval = scrape_interval
        self.extra_flags = list(extra_flags)
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        config = self.workdir / "prometheus.yml"
        targets = ", ".join(json.dumps(t) for t in self.targets)
        config.write_text(
            "global:\n"
            f"  scrape_interval: {self.scrape_interval}\n"
            f"  evaluation_interval: {self.scrape_interval}\n"
            "scrape_configs:\n"
            f"  - job_name: {json.dumps(self.job)}\n"
            f"    scrape_interval: {self.scrape_interval}\n"
            f"    scrape_timeout: {self.scrape_interval}\n"
            "    static_configs:\n"
            f"      - targets: [{targets}]\n"
        )
        return config

    def start(self, ready_timeout: float = 60.0) -> PrometheusServer:
        if PROMETHEUS is None:
            missing_program(_NO_PROMETHEUS)
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        # free_port() only says the port was free a moment ago: another process on a busy machine may
        # take it before Prometheus binds, so a bind failure is retried on a fresh port.
        for _ in range(3):
            self.port = free_port()
            if self._ready(self._launch(config), f"{self.url}/-/ready", ready_timeout, self.log_text):
                return self
            if "address already in use" not in self.log_text():
                raise RuntimeError(f"prometheus exited: {self.log_text()}")
        raise RuntimeError(f"prometheus could not bind a free port: {self.log_text()}")

    def _launch(self, config: Path) -> subprocess.Popen[bytes]:
        log = (self.workdir / "prometheus.log").open("wb")
        self._process = subprocess.Popen(
            [
                PROMETHEUS or "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
                *self.extra_flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        return self._process

    def log_text(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ----------------------------------------------------------------- PromQL
    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus API {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query now; the ``result`` list of a vector (``metric`` labels and ``value``)."""
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_value(self, expr: str) -> float | None:
        """The value of an instant query that returns one series (None when it returns none)."""
        result = self.query(expr)
        if not result:
            return None
        if len(result) > 1:
            raise AssertionError(f"{expr} returned {len(result)} series: {result}")
        return float(result[0]["value"][1])

    def query_values(self, expr: str, by: str) -> dict[str, float]:
        """Series of an instant query keyed by the value of label ``by``."""
        return {r["metric"].get(by, ""): float(r["value"][1]) for r in self.query(expr)}

    def targets_up(self) -> bool:
        """Every configured target was scraped successfully at least once."""
        return self.query_value(f'count(up{{job="{self.job}"}} == 1)') == len(self.targets)

    def wait_until(self, condition: Callable[[], bool], timeout: float = 60.0, interval: float = 0.25) -> None:
        """Poll ``condition`` until it holds; fails the test (with Prometheus's log) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if condition():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout} s; prometheus log:\n{self.log_text()}")
            time.sleep(interval)


RULES = Path(__file__).resolve().parents[2] / "exporters" / "prometheus" / "staleness.rules.yml"


class RulesPrometheusServer(PrometheusServer):
    """The test server with the generated rules loaded, as exporters/prometheus/prometheus.yml loads them."""

    def _write_config(self) -> Path:
        config = super()._write_config()
        with config.open("a") as out:
            out.write(f"rule_files:\n  - {RULES}\n")
        return config


class PushgatewayServer(_ChildProcess):
    """``prometheus-pushgateway`` on 127.0.0.1 (a free port unless ``port`` is given)."""

    def __init__(self, workdir: Path, port: int = 0) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self._chosen = not port  # (a port of our choosing is chosen again when another took it)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, ready_timeout: float = 60.0) -> PushgatewayServer:
        if PUSHGATEWAY is None:
            missing_program(_NO_PUSHGATEWAY)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):  # (as PrometheusServer.start: a free port may be taken before the bind)
            if attempt:
                self.port = free_port()
            log = (self.workdir / "pushgateway.log").open("wb")
            self._process = subprocess.Popen(
                # Debian's build persists to /var/lib/prometheus by default: a file every gateway on the
                # machine would share (and load groups from); tests keep their metrics in memory only.
                [PUSHGATEWAY, f"--web.listen-address={self.address}", "--log.level=warn", "--persistence.file="],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            logged = self.workdir / "pushgateway.log"
            if self._ready(self._process, f"http://{self.address}/-/ready", ready_timeout, logged.read_text):
                return self
            text = (self.workdir / "pushgateway.log").read_text(errors="replace")
            if not self._chosen or "address already in use" not in text:
                raise RuntimeError("pushgateway exited: " + text)
        raise RuntimeError("pushgateway could not bind a free port: " + text)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=10) as response:
            text: str = response.read().decode()
            return text


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[Callable[..., PrometheusServer]]:
    """Factory fixture: ``prometheus_server(targets=[...], **options)`` starts a server (stopped at
    teardown)."""
    started: list[PrometheusServer] = []

    def start(targets: Sequence[str], **options: Any) -> PrometheusServer:
        server = PrometheusServer(tmp_path / f"prometheus-{len(started)}", targets, **options)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()
