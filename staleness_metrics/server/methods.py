"""``405 Method Not Allowed`` with the full ``Allow`` header (RFC 9110): Starlette answers from
the first route whose path matches, listing its methods only (one of ``/v1/runs/{run}``'s three)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from starlette.routing import BaseRoute, Match

from .limits import ASGIApp, Message, Receive, Scope, Send

__all__ = ["AllowHeader"]


class AllowHeader:
    """Rewrite the ``Allow`` header of 405 answers from ``routes`` (read when a 405 happens)."""

    def __init__(self, app: ASGIApp, routes: Callable[[], Iterable[BaseRoute]]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_allow(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                allowed = self._allowed(scope)
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                message["headers"] = [*headers, (b"allow", ", ".join(sorted(allowed)).encode())]
            await send(message)

        await self.app(scope, receive, send_with_allow)

    def _allowed(self, scope: Scope) -> set[str]:
        allowed: set[str] = set()
        for route in self.routes():
            match, _ = route.matches({**scope, "method": "GET"})
            methods = getattr(route, "methods", None)
            if match is not Match.NONE and methods:
                allowed |= set(methods)
        return allowed
