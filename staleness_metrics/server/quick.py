"""The quick lane: small adds and ships to a run held in memory, answered on the event loop.

A small add or ship does about a millisecond of work of its own, and the service around it cost as much
again: the hop to the thread pool and back (two thread wake-ups, each waiting for a core on a busy
machine), then FastAPI's routing, dependency solving and request models, on every request.
:class:`QuickLane` answers such requests itself, on the event loop, when that cannot stall the other
connections (:func:`quickly`): the run is held in memory (a write to a data directory waits for the disk,
and finding a run there may load it), its lock is free at once and its queue small (:meth:`.Run.quick`).

Everything else goes to the application as if the lane were not there, its body replayed untouched: a
run that is busy, missing or persisted, a body that is large, streamed without a length, not JSON, or
not a valid request. A request the lane took is read and answered by the very functions the routes use,
so its answer, and its errors (through the application's own exception handlers), are the routes' own.
The lane sits inside the token check and the body size cap, which see every request as before.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from .decode import paused_gc
from .limits import ASGIApp, Message, Receive, Scope, Send
from .models import RUN_NAME_PATTERN, ShipRequest
from .registry import RunRegistry
from .runs import Run

__all__ = ["QUICK_BODY_BYTES", "QuickLane", "quickly"]

T = TypeVar("T")

QUICK_BODY_BYTES = 64 * 1024  # a body up to this size is read and applied in about a millisecond
IDEMPOTENCY_KEY_MAX = 255  # as the ship route's header declares it (longer: its 422)

_PATH = re.compile(r"/v1/runs/(?P<run>" + RUN_NAME_PATTERN.strip("^$") + r")/(?P<call>rollouts|ship)")

ExceptionHandler = Callable[[Request, Any], Response | Awaitable[Response]]


def quickly(registry: RunRegistry, run: str, call: Callable[[Run], T]) -> tuple[bool, T | None]:
    """``(True, call(run))`` when the call can be made on the event loop, ``(False, None)`` when it must go to
    a worker thread (see the module's docstring). Errors are raised as from the worker."""
    if registry.store.persistent:
        return False, None
    target = registry.get(run)
    with target.quick() as free:
        if free:
            return True, call(target)
    return False, None


class QuickLane:
    """ASGI middleware answering small adds and ships on the event loop (see the module's docstring).

    ``add`` applies a body to a run (the rollouts route's function), ``respond`` writes a model as the routes
    do, and ``handlers`` are the application's exception handlers (read at each error: installed after).
    """

    def __init__(
        self,
        app: ASGIApp,
        registry: RunRegistry,
        add: Callable[[Run, list[bytearray]], BaseModel],
        respond: Callable[[BaseModel], Response],
        handlers: Callable[[], Mapping[Any, ExceptionHandler]],
    ) -> None:
        self.app = app
        self.registry = registry
        self.add = add
        self.respond = respond
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _PATH.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        length = _small_length(scope) if match is not None and scope["method"] == "POST" else None
        if match is None or length is None or self.registry.store.persistent:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []  # as received: replayed to the application if the lane does not answer
        body = bytearray()
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # a disconnect, or the size cap's refusal
                await self.app(scope, _replay(messages, receive), send)
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        try:
            if match["call"] == "ship":
                answered = self._ship(scope, match["run"], bytes(body))
            else:
                held = [body]
                del body
                with paused_gc():
                    answered = quickly(self.registry, match["run"], lambda target: self.add(target, held))
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            handled = handler(Request(scope, _replay(messages, receive)), exc)
            response = await handled if inspect.isawaitable(handled) else handled
        else:
            done, result = answered
            if not done or result is None:
                await self.app(scope, _replay(messages, receive), send)
                return
            response = self.respond(result)
        await response(scope, receive, send)

    def _ship(self, scope: Scope, run: str, body: bytes) -> tuple[bool, BaseModel | None]:
        """The ship, when the request is one the route would take as it is; else ``(False, None)`` before
        anything is applied (the route then answers it, errors included)."""
        content_type: bytes | None = None
        keys: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"idempotency-key":
                keys.append(value)
        if content_type is None or content_type.strip().lower() != b"application/json" or len(keys) > 1:
            return False, None
        key = keys[0].decode("latin-1") if keys else None  # as Starlette reads a header
        if key is not None and not 1 <= len(key) <= IDEMPOTENCY_KEY_MAX:
            return False, None
        try:
            request = ShipRequest.model_validate(json.loads(body))  # the route's reading of it
        except (ValueError, RecursionError, ValidationError):  # not JSON, or not a valid ship: the route says why
            return False, None
        return quickly(self.registry, run, lambda target: target.ship(request, key))

    def _handler(self, exc: Exception) -> ExceptionHandler | None:
        handlers = self.handlers()
        for kind in type(exc).__mro__:  # the most specific, as Starlette looks them up
            if kind in handlers and kind not in (Exception, BaseException):  # those answer 500, outside
                return handlers[kind]
        return None


def _small_length(scope: Scope) -> int | None:
    """The declared body length when it is small enough for the lane, else None (streamed bodies too)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return None
            return length if 0 <= length <= QUICK_BODY_BYTES else None
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` giving ``messages`` first, then what the connection sends next."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
