"""Request body cap: an ASGI middleware that answers 413 before the application parses anything.

It trusts neither ``Content-Length`` (checked first, for a cheap early answer) nor its absence: the body
is read here, counting bytes as they stream in (chunked uploads included), and handed to the application
only when it fits. The application parses the whole body anyway, so buffering it costs nothing extra.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodySizeLimit"]

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodySizeLimit:
    """Refuse HTTP requests whose body exceeds ``max_bytes`` with ``413 {"detail": ...}``."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": f"request body larger than {self.max_bytes} bytes"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),  # the rest of the body is not read
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed header itself; counting still applies
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that yields ``messages`` first, then defers to the real one (disconnects)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
