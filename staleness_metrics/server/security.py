"""Who may talk to the service: loopback by default (:func:`check_bind`), a bearer token for
anything else, checked by :class:`TokenFirst` before the body is read."""

from __future__ import annotations

import ipaddress
import re
import secrets
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .limits import send_json

TOKEN_ENV = "STALENESS_METRICS_TOKEN"
_PORT = re.compile(r":\d*\Z")  # of a Host header

BEARER_SCHEME: dict[str, Any] = {  # components.securitySchemes.HTTPBearer of the OpenAPI document
    "type": "http",
    "description": f"The service token (`serve --token` or `{TOKEN_ENV}`). Required on writes when "
    "the service has a token, and on reads too with `--protect-reads`.",
    "scheme": "bearer",
}


class BindRefused(Exception):
    """The service would listen beyond loopback without a token."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_bind(host: str, token: str | None) -> None:
    """Raise :class:`BindRefused` when ``host`` is not loopback and there is no token."""
    if not token and not is_loopback(host):
        raise BindRefused(
            f"refusing to listen on {host} without a token: anyone who can reach it could write to "
            f"your runs. Set --token (or {TOKEN_ENV}); every write then needs 'Authorization: "
            "Bearer <token>'. Or listen on 127.0.0.1 (the default)."
        )


def check_token(token: str | None) -> None:
    """``ValueError`` for a blank token (never taken for "no token", or served as a secret)."""
    if token is not None and not token.strip():
        raise ValueError("the token is blank; give a real secret (e.g. $(openssl rand -hex 32)) or none")


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Open to anyone even with --protect-reads: liveness probes and the API description.
OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class TokenFirst:
    """401 from the headers alone for a write (``protect_reads``: a read too) lacking the token;
    without one (so on loopback), 421 for a ``Host`` naming no loopback address (DNS rebinding)."""

    def __init__(self, app: ASGIApp, token: str | None, protect_reads: bool = False) -> None:
        self.app = app
        self.expected = token.strip().encode() if token else None  # (a header value carries no outer blanks)
        self.protect_reads = protect_reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = Headers(raw=scope.get("headers", [])).get("host", "") if self.expected is None else ""
        if host and not is_loopback(_PORT.sub("", host)):  # (no Host: not a browser's request)
            await send_json(send, 421, "only loopback names are served (no token)")
            return
        if scope["type"] != "http" or self.expected is None or not self._guarded(scope):
            await self.app(scope, receive, send)
            return
        scheme, _, credentials = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            detail = "missing bearer token (Authorization: Bearer <token>)"
            await send_json(send, 401, detail, (b"www-authenticate", b"Bearer"))
        elif not secrets.compare_digest(credentials.encode("latin-1").strip(), self.expected):
            challenge = b'Bearer error="invalid_token"'
            await send_json(send, 401, "invalid bearer token", (b"www-authenticate", challenge))
        else:
            await self.app(scope, receive, send)

    def _guarded(self, scope: Scope) -> bool:
        read = scope["method"] in SAFE_METHODS
        return not read or (self.protect_reads and scope["path"] not in OPEN_PATHS)
