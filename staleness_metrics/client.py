"""A small synchronous client for ``staleness-metrics serve`` (needs ``httpx``; docs/service.md).
Calls are retried with the same body, which never counts anything twice. Errors are the library's:
``TraceError`` for an invalid record, ``ConfigError`` for an invalid configuration."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any, TypedDict, cast
from urllib.parse import quote

from .config import StalenessConfig, check_int
from .errors import ConfigError, FieldError, FieldTypeError, StalenessError, TraceError
from .exporters.base import MissingExtra, seconds
from .metrics.mismatch import MismatchSums

try:
    import httpx
except ModuleNotFoundError as exc:
    raise MissingExtra("StalenessClient", exc.name, "client") from exc

_RETRY_STATUSES = frozenset({502, 503, 504})


class AddResult(TypedDict):
    run: str
    accepted: int
    duplicates: int
    invalid: list[dict[str, Any]]
    queued: int


class ShipResult(TypedDict):
    run: str
    ship: int
    step: int
    shipped: list[str]
    dropped_rollouts: list[str]
    dropped_samples: list[list[Any]]
    held: list[str]
    invalid: list[dict[str, Any]]
    metrics: dict[str, float | int | str]
    counts: dict[str, int]
    rollouts: list[dict[str, Any]] | None
    lags: list[list[list[int]]] | None
    replayed: bool


class StepRow(TypedDict):
    ship: int
    step: int
    metrics: dict[str, float | int | str]
    counts: dict[str, int]
    token_histogram: list[int]
    rollout_histogram: list[int]
    mismatch: dict[str, Any] | None


class MismatchResult(TypedDict):
    run: str
    step: int
    posts: int
    tokens: int
    metrics: dict[str, float | int | str]
    replayed: bool


class ServiceError(StalenessError):
    """The service refused a request (``status`` and its ``detail``), or never answered (``status``
    None: every attempt failed to connect or timed out)."""

    def __init__(self, status: int | None, detail: Any) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"HTTP {status}: {detail}" if status is not None else str(detail))


class StalenessClient:
    """Talks to one service. ``retries``: extra attempts after a transient failure, ``backoff``
    seconds doubling between them (6.2 s in all by default: a restart's time). ``transport``: for
    tests (``httpx.MockTransport``). A ship or mismatch post sends one idempotency key (given, or a
    new random one) with every retry."""

    def __init__(self, base_url: str = "http://127.0.0.1:9487", token: str | None = None, *,
                 timeout: float = 30.0, retries: int = 5, backoff: float = 0.2,
                 transport: httpx.BaseTransport | None = None) -> None:  # fmt: skip
        if token and not token.isascii():  # (a header is ASCII: httpx would fail at the first call)
            raise FieldError("token", "expected ASCII text (a bearer token)")
        headers = {"Authorization": f"Bearer {token.strip()}"} if token else {}
        # checked now: a bad value would surface only once the service fails, as an unrelated error
        self._retries, self._backoff = check_int("retries", retries, 0), seconds(backoff, "backoff")
        if self._backoff == math.inf:  # (seconds() reads None as inf: no bound, no wait ending)
            raise FieldError("backoff", f"expected finite seconds, got {backoff!r}")
        limit = None if (timeout := seconds(timeout, "timeout")) == math.inf else timeout
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=limit, transport=transport)

    def create_run(self, run: str, config: StalenessConfig | Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Create ``run`` (or find it with the same configuration); returns the run's info."""
        body = asdict(config) if isinstance(config, StalenessConfig) else dict(config or {})
        return cast(dict[str, Any], self._request("PUT", _run_path(run), json=body))

    def run_info(self, run: str) -> dict[str, Any]:
        """Configuration, step, queue length and totals of ``run``."""
        return cast(dict[str, Any], self._request("GET", _run_path(run)))

    def delete_run(self, run: str) -> None:
        self._request("DELETE", _run_path(run), gone_ok=True)

    def add(self, run: str, rollouts: Iterable[Mapping[str, Any]]) -> AddResult:
        """Queue finished rollouts (SPEC 3 records); safe to retry with the same records."""
        body = {"rollouts": list(rollouts)}
        return cast(AddResult, self._request("POST", _run_path(run, "rollouts"), json=body))

    def sweep(self, run: str, step: int) -> dict[str, Any]:
        return cast(dict[str, Any], self._request("POST", _run_path(run, "sweep"), json={"step": step}))

    def ship(self, run: str, step: int, ids: Iterable[str] | None = None, *,
             include_rollouts: bool = False, idempotency_key: str | None = None,
             ) -> ShipResult:  # fmt: skip
        """Ship the batch for ``step`` (all queued rollouts, or ``ids``)."""
        body: dict[str, Any] = {"step": step, "include_rollouts": include_rollouts}
        if isinstance(ids, str):  # list("r-1") would ship "r", "-" and "1"
            raise FieldTypeError("ids", f"expected an iterable of rollout ids, got the string {ids!r}")
        if ids is not None:
            body["ids"] = list(ids)
        return cast(ShipResult, self._post_once(_run_path(run, "ship"), body, idempotency_key))

    def record_mismatch(self, run: str, step: int, sums: MismatchSums | Mapping[str, Any], *,
                        env: str | None = None, idempotency_key: str | None = None,
                        ) -> MismatchResult:  # fmt: skip
        """Post trainer-side mismatch sums (SPEC 11: a :class:`~staleness_metrics.MismatchSums` or
        its ``to_dict()``) of the shipped ``step``, of ``env`` if given (one post per env and rank);
        posts for one step merge."""
        as_dict = sums.to_dict() if isinstance(sums, MismatchSums) else dict(sums)
        path, body = _run_path(run, "mismatch"), {"step": step, "sums": as_dict, "env": env}
        return cast(MismatchResult, self._post_once(path, body, idempotency_key))

    def steps(self, run: str, since: int = 0) -> list[StepRow]:
        """The metrics history: one row per ship with ``step > since``."""
        page = self._request("GET", _run_path(run, "steps"), params={"since": since})
        return cast(list[StepRow], page["steps"])

    def metrics(self) -> str:
        """The Prometheus text exposition of every run."""
        return self._send("GET", "/metrics").text

    def health(self) -> dict[str, Any]:
        return cast(dict[str, Any], self._request("GET", "/healthz"))

    def _post_once(self, path: str, body: dict[str, Any], key: str | None) -> Any:
        if key is not None and not (isinstance(key, str) and key.isascii()):
            raise FieldError("idempotency_key", f"expected ASCII text (an HTTP header), got {key!r}")
        headers = {"Idempotency-Key": key or uuid.uuid4().hex}
        return self._request("POST", path, json=body, headers=headers)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, path, **kwargs)
        return None if response.status_code == 204 or not response.content else response.json()

    def _send(self, method: str, path: str, *, gone_ok: bool = False, **kwargs: Any) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt >= self._retries:
                    raise ServiceError(None, f"no answer from {self._http.base_url}: {exc!r}") from exc
            else:
                if response.status_code not in _RETRY_STATUSES or attempt >= self._retries:
                    if gone_ok and attempt > 0 and response.status_code == 404:
                        return response  # an earlier attempt did it
                    _raise_for(response)
                    return response
            time.sleep(self._backoff * 2 ** min(attempt, 30))  # (2**1024 is past any float)
            attempt += 1

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> StalenessClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _run_path(run: str, action: str | None = None) -> str:
    """The run's URL path (quoted: a stray ``/`` or ``?`` cannot reach another route)."""
    path = f"/v1/runs/{quote(run, safe='')}"
    return path if action is None else f"{path}/{action}"


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    # A proxy in between may answer with anything: only the service's own shape is read.
    detail: Any = body.get("detail", response.text) if isinstance(body, dict) else response.text
    if response.status_code == 422 and isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        if first.get("rollout_id") is not None or first.get("index") is not None:
            raise TraceError(first.get("rollout_id"), first.get("field", ""), first.get("reason", ""))
        if response.request.method == "PUT":  # only run creation takes a PUT body: a configuration
            raise ConfigError(f"{first.get('field')}: {first.get('reason')}")
    raise ServiceError(response.status_code, detail)
