"""The client's loopback transport (``http.client`` behind ``httpx.Client``) against real servers: kept-alive
connections survive a service restart, refusals read before the body was sent still come back as the
service's answer, errors are httpx's (so the retry rules hold), and threads can share one client."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from staleness_metrics.client import ServiceError, StalenessClient
from staleness_metrics.client_transport import LoopbackTransport, is_loopback_url
from staleness_metrics.server import ServerSettings

from .conftest import ServeProcess, ThreadServer

pytestmark = pytest.mark.integration


def rollout(rid: str, positions: int = 4) -> dict[str, object]:
    return {"id": rid, "dispatch_version": 0, "samples": [{"mask": [1] * positions}]}


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:9487", True),
        ("http://localhost:9487", True),
        ("http://[::1]:9487", True),
        ("http://127.3.2.1", True),
        ("https://127.0.0.1:9487", False),  # TLS stays with httpx
        ("http://10.0.0.7:9487", False),
        ("http://staleness.internal:9487", False),
    ],
)
def test_only_plain_http_to_loopback_takes_the_loopback_transport(url: str, loopback: bool) -> None:
    assert is_loopback_url(httpx.URL(url)) is loopback
    with StalenessClient(url) as client:
        assert isinstance(client._http._transport, LoopbackTransport) is loopback


def test_a_restarted_service_is_reached_on_a_new_connection(
    serve_process: Callable[..., ServeProcess], tmp_path: Path
) -> None:
    first = serve_process(["--data-dir", str(tmp_path)])
    port = first.url.rsplit(":", 1)[1]
    with StalenessClient(first.url, retries=0) as client:  # no retry: the transport itself must cope
        client.create_run("exp", {"max_staleness": 2})
        client.add("exp", [rollout("a")])
        first.stop()  # SIGTERM: the kept-alive connection is closed by the server as it stops
        second = serve_process(["--data-dir", str(tmp_path), "--port", port])
        assert second.url == first.url
        assert client.add("exp", [rollout("b")])["accepted"] == 1
        assert client.run_info("exp")["queued"] == 2


def test_a_body_refused_by_its_declared_size_gets_the_services_413(
    start_server: Callable[..., ThreadServer],
) -> None:
    server = start_server(ServerSettings(max_body_bytes=2000))
    with StalenessClient(server.url, retries=0) as client:
        client.create_run("exp")
        # 4 MB: the service answers 413 from the headers and closes before the body is all sent.
        with pytest.raises(ServiceError) as refused:
            client.add("exp", [rollout(f"r{i}", 1000) for i in range(1000)])
        assert refused.value.status == 413 and "2000 bytes" in str(refused.value.detail)
        assert client.add("exp", [rollout("small")])["accepted"] == 1  # on a new connection
        assert client.run_info("exp")["queued"] == 1


def test_connection_errors_are_httpx_errors_and_are_retried() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with StalenessClient(f"http://127.0.0.1:{port}", retries=2, backoff=0) as client, pytest.raises(httpx.ConnectError):
        client.health()


def test_threads_share_one_client(server: ThreadServer) -> None:
    with StalenessClient(server.url, retries=0) as client:
        client.create_run("exp")

        def send(worker: int) -> None:
            for k in range(25):
                client.add("exp", [rollout(f"w{worker}-{k}")])

        threads = [threading.Thread(target=send, args=(w,)) for w in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        info = client.run_info("exp")
    assert info["rollouts_received"] == info["queued"] == 8 * 25
    assert info["duplicates_ignored"] == 0
