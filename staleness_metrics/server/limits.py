"""Request size caps: :class:`BodySizeLimit` and :func:`header_limited_protocol`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# span rows (60-130 bytes each) a body may cut: one per this many bytes, at least SPAN_ROW_FLOOR
DEFAULT_BODY_BYTES_PER_SPAN_ROW = 128
SPAN_ROW_FLOOR = 65_536


async def send_json(send: Send, status: int, detail: str, *extra: tuple[bytes, bytes]) -> None:
    """Answer ``{"detail": detail}`` and close the connection (the rest is unread)."""
    body = json.dumps({"detail": detail}).encode()
    length = (b"content-length", b"%d" % len(body))
    headers = [(b"content-type", b"application/json"), length, *extra, (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """413 for a body over ``max_bytes``: from ``Content-Length`` before any byte is read, else
    counted as it streams through (unbuffered); past the cap the application sees a disconnect."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refusal = f"request body larger than {max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            declared = int(Headers(scope=scope).get("content-length", ""))
        except ValueError:  # absent, or malformed (the server refuses it): counting applies
            declared = None
        if declared is not None and declared > self.max_bytes:
            await send_json(send, 413, self.refusal)
            return
        size, refused, started = 0, False, False

        async def counted() -> Message:
            nonlocal size, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    refused = True
                    if not started:
                        await send_json(send, 413, self.refusal)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if refused:  # the 413 was the answer; whatever the application says after it is dropped
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not refused:
                raise


DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_HEADER_TIMEOUT = 10.0


def header_limited_protocol(max_header_bytes: int, header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a size cap (431) and a deadline (408) for the headers, and
    the same deadline between two pieces of a body (as nginx's ``client_body_timeout``)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderLimitedProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._await_headers()
            self._arm(self._headers_too_slow)

        def _await_headers(self) -> None:  # each request on the connection is counted afresh
            self._awaiting_headers, self._in_body = True, False
            self._header_bytes, self._header_tail = 0, b""

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers:  # counted first: the parser may end the headers in this read
                # empty lines may come before a request; its blank line may straddle two reads
                seen = self._header_tail + data if self._header_tail else data.lstrip(b"\r\n")
                end = seen.find(b"\r\n\r\n")
                self._header_bytes += len(data) if end < 0 else end + 4 + len(data) - len(seen)
                self._header_tail = seen[-3:]
                if self._header_bytes > max_header_bytes:
                    self._refuse(431, "request line and headers over the size cap")
                    return
                if self._deadline is None:
                    self._arm(self._headers_too_slow)
            elif self._in_body:
                self._arm(self._body_too_slow)
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._awaiting_headers = False
            self._in_body = True
            self._arm(self._body_too_slow)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            self._await_headers()
            super().on_message_complete()

        def _arm(self, then: Callable[[], None]) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, then)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_too_slow(self) -> None:
            self._deadline = None
            if not self._awaiting_headers or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm(self._headers_too_slow)  # still answering the previous request: its turn first
            elif self._header_bytes:
                self._refuse(408, "the request's headers did not arrive in time")
            else:
                self.transport.close()  # an idle connection that never sent a request

        def _body_too_slow(self) -> None:
            self._deadline = None
            if not self._in_body or self.transport.is_closing():
                return
            if self.pipeline:  # queued behind an earlier request: the reads wait for its answer
                self._arm(self._body_too_slow)
            elif self.cycle is not None and not self.cycle.response_started:
                self._refuse(408, "the request's body stopped arriving")
            else:
                self.transport.close()

        def _refuse(self, code: int, detail: str) -> None:
            self._disarm()
            self._awaiting_headers = self._in_body = False
            body = json.dumps({"detail": detail}).encode()
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (code, HTTPStatus(code).phrase.encode(), len(body), body)
            )
            self.transport.close()

    return HeaderLimitedProtocol


def uvicorn_header_options(
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, header_timeout: float = DEFAULT_HEADER_TIMEOUT
) -> dict[str, Any]:
    """``uvicorn.Config`` options capping request headers (h11's own cap without httptools)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return {"http": "h11", "h11_max_incomplete_event_size": max_header_bytes}
    return {"http": header_limited_protocol(max_header_bytes, header_timeout)}


LARGE_ALLOCATION_BYTES = 1024 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def return_large_frees_to_the_os() -> bool:
    """Give every allocation of :data:`LARGE_ALLOCATION_BYTES` or more its own memory map (glibc;
    False elsewhere): a body's peak is then what the request holds, not what earlier ones left."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # (it returns an int: ctypes' default)
    return bool(mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES))
