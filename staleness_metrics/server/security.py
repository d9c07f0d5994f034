"""Who may talk to the service: loopback by default, a bearer token for anything else.

- :func:`check_bind` is the start-up rule: off loopback the service needs a token.
- :func:`token_guard` is the FastAPI dependency that checks ``Authorization: Bearer <token>`` in
  constant time; the routes that write (and, when asked, the ones that read) depend on it.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

__all__ = ["TOKEN_ENV", "BindRefused", "check_bind", "is_loopback", "token_guard"]

TOKEN_ENV = "STALENESS_METRICS_TOKEN"

_bearer = HTTPBearer(
    auto_error=False,
    description=f"The service token (`serve --token` or `{TOKEN_ENV}`). Required on writes when the "
    "service has a token, and on reads too with `--protect-reads`.",
)


class BindRefused(Exception):
    """The service would listen beyond loopback without a token."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); any other name is not."""
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
            f"refusing to listen on {host} without a token: anyone who can reach it could write to your runs. "
            f"Set --token (or {TOKEN_ENV}); every write then needs 'Authorization: Bearer <token>'. "
            "Or listen on 127.0.0.1 (the default)."
        )


def token_guard(token: str | None) -> Callable[..., None]:
    """A dependency accepting any request when ``token`` is None, else only ``Bearer <token>``."""
    expected = token.encode() if token else None

    def require_token(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        if expected is None:
            return
        if credentials is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing bearer token (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not secrets.compare_digest(credentials.credentials.encode(), expected):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "invalid bearer token",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )

    return require_token
