"""The client's default transport to a service on loopback: HTTP/1.1 over kept-alive ``http.client``
connections (the standard library), behind the same ``httpx.Client``.

httpx's own transport (httpcore and h11, both pure Python) costs about 0.3 ms of CPU per small request
more than ``http.client`` (measured in ``bench/service.py`` terms: a small add is about 3 ms end to end on
the 2-core machine), and a sidecar's client makes one request per batch and per ship. Only plain ``http``
to a loopback address takes this path; anything else (TLS, a remote host, proxies from the environment)
keeps httpx's transport. Errors are raised as httpx's, so retries and error handling are the same.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
from typing import Any

import httpx

__all__ = ["LoopbackTransport", "is_loopback_url"]

_CONNECTION_ERRORS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.RemoteDisconnected)


def is_loopback_url(url: httpx.URL) -> bool:
    """True for ``http://`` URLs to localhost or a loopback address."""
    import ipaddress

    if url.scheme != "http":
        return False
    host = url.host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LoopbackTransport(httpx.BaseTransport):
    """Idle connections are kept per (host, port) and reused; a connection the server closed while idle
    (its keep-alive timeout) is noticed before reuse, and a request whose reused connection turns out to
    be gone before any answer arrived is sent once more on a new one (as httpcore does)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        host, port = request.url.host, request.url.port or 80
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        body = request.read()
        reused = self._take((host, port))
        connection = reused or self._connect(request, host, port, timeouts)
        try:
            try:
                status, headers, content, will_close = self._exchange(connection, request, body, timeouts)
            except _CONNECTION_ERRORS:
                if reused is None:
                    raise
                connection.close()  # the server closed it as the request went out: once more on a new one
                connection = self._connect(request, host, port, timeouts)
                status, headers, content, will_close = self._exchange(connection, request, body, timeouts)
        except TimeoutError as error:
            connection.close()
            raise httpx.ReadTimeout(str(error) or "timed out", request=request) from error
        except (OSError, http.client.HTTPException) as error:
            connection.close()
            raise httpx.ReadError(str(error) or type(error).__name__, request=request) from error
        if will_close:
            connection.close()
        else:
            with self._lock:
                self._idle.setdefault((host, port), []).append(connection)
        return httpx.Response(status, headers=headers, content=content, request=request)

    def _take(self, key: tuple[str, int]) -> http.client.HTTPConnection | None:
        while True:
            with self._lock:
                idle = self._idle.get(key)
                if not idle:
                    return None
                connection = idle.pop()
            sock = connection.sock
            # Readable while idle: the server closed it (or sent something unasked): not reusable.
            if sock is not None and not select.select([sock], [], [], 0)[0]:
                return connection
            connection.close()

    @staticmethod
    def _connect(request: httpx.Request, host: str, port: int, timeouts: dict[str, Any]) -> http.client.HTTPConnection:
        connection = http.client.HTTPConnection(host, port, timeout=timeouts.get("connect"))
        try:
            connection.connect()
        except TimeoutError as error:
            connection.close()
            raise httpx.ConnectTimeout(str(error) or "timed out", request=request) from error
        except OSError as error:
            connection.close()
            raise httpx.ConnectError(str(error), request=request) from error
        assert connection.sock is not None
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection

    @staticmethod
    def _exchange(
        connection: http.client.HTTPConnection, request: httpx.Request, body: bytes, timeouts: dict[str, Any]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
        assert connection.sock is not None
        connection.sock.settimeout(timeouts.get("read"))
        connection.putrequest(
            request.method, request.url.raw_path.decode("ascii"), skip_host=True, skip_accept_encoding=True
        )
        for name, value in request.headers.raw:
            if name.lower() != b"accept-encoding":  # answers are read as sent: ask for no encoding
                connection.putheader(name, value)
        connection.putheader("Accept-Encoding", "identity")
        try:
            connection.endheaders(body or None)
        except _CONNECTION_ERRORS as sent:
            # A server may answer before it reads the whole body (413, 401) and close: read that answer.
            try:
                response = connection.getresponse()
            except (OSError, http.client.HTTPException):
                raise sent from None
        else:
            response = connection.getresponse()
        content = response.read()
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.getheaders()]
        return response.status, headers, content, response.will_close

    def close(self) -> None:
        with self._lock:
            idle = [connection for connections in self._idle.values() for connection in connections]
            self._idle.clear()
        for connection in idle:
            connection.close()
