"""The client with a mock transport: odd answers from a proxy, run names, ids given as one string."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from staleness_metrics.client import ServiceError, StalenessClient
from staleness_metrics.errors import StalenessError


def client_answering(answer: httpx.Response, paths: list[str]) -> StalenessClient:
    def handle(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.raw_path.decode())
        return answer

    return StalenessClient("http://127.0.0.1:9", retries=0, transport=httpx.MockTransport(handle))


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(400, json=["not", "the", "service's", "shape"]),
        httpx.Response(422, json={"detail": ["a string, not an error item"]}),
        httpx.Response(502, text="<html>bad gateway</html>"),
    ],
)
def test_an_answer_not_in_the_services_shape_is_a_service_error(answer: httpx.Response) -> None:
    with client_answering(answer, []) as client, pytest.raises(ServiceError) as error:
        client.add("exp", [])
    assert error.value.status == answer.status_code


def test_run_names_are_quoted_into_the_path() -> None:
    paths: list[str] = []
    with client_answering(httpx.Response(200, json={}), paths) as client:
        client.run_info("a/b?c")
        client.sweep("exp", step=3)
    assert paths == ["/v1/runs/a%2Fb%3Fc", "/v1/runs/exp/sweep"]  # never another route


def test_ids_given_as_one_string_are_refused() -> None:
    paths: list[str] = []
    with client_answering(httpx.Response(200, json={}), paths) as client, pytest.raises(TypeError, match="r-1"):
        client.ship("exp", step=2, ids="r-1")  # type: ignore[arg-type]  # would ship "r", "-" and "1"
    assert paths == []


def test_no_answer_after_the_retries_is_a_service_error() -> None:
    """A training loop catching the library's errors catches this one too (it was httpx's own)."""
    attempts: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(request.url.path)
        raise httpx.ConnectError("connection refused", request=request)

    transport = httpx.MockTransport(refuse)
    client = StalenessClient("http://127.0.0.1:9", retries=2, backoff=0, transport=transport)
    with client, pytest.raises(ServiceError, match="no answer from") as error:
        client.ship("exp", step=1)
    assert error.value.status is None and isinstance(error.value.__cause__, httpx.ConnectError)
    assert attempts == ["/v1/runs/exp/ship"] * 3


@pytest.mark.parametrize(
    ("setting", "value"),
    [("backoff", -1.0), ("backoff", math.nan), ("backoff", math.inf), ("backoff", None), ("retries", "2"),
     ("retries", -3), ("retries", True), ("timeout", -1.0), ("timeout", math.nan), ("timeout", "30")],
)  # fmt: skip
def test_a_bad_setting_is_refused_when_the_client_is_made_naming_it(setting: str, value: Any) -> None:
    """They surfaced only once the service failed to answer, as time.sleep's or httpx's own errors."""
    unused = httpx.MockTransport(lambda request: pytest.fail("sent a request"))
    with pytest.raises(StalenessError) as refused:
        StalenessClient("http://127.0.0.1:9", transport=unused, **{setting: value})
    assert refused.value.field == setting


def test_no_timeout_no_backoff_and_no_retries_are_settings() -> None:
    paths: list[str] = []
    for timeout in (None, math.inf, 0.5):
        answer = httpx.MockTransport(lambda request: paths.append(request.url.path) or httpx.Response(200, json={}))
        with StalenessClient(timeout=timeout, retries=0, backoff=0, transport=answer) as client:
            client.run_info("exp")
    assert paths == ["/v1/runs/exp"] * 3


def test_many_retries_without_backoff_end_in_a_service_error() -> None:
    """The wait doubled past 2**1024 raised OverflowError (even with backoff 0) instead."""
    attempts: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(request.url.path)
        raise httpx.ConnectError("connection refused", request=request)

    client = StalenessClient("http://127.0.0.1:9", retries=1100, backoff=0, transport=httpx.MockTransport(refuse))
    with client, pytest.raises(ServiceError, match="no answer from"):
        client.health()
    assert len(attempts) == 1101


@pytest.mark.parametrize(("field", "call"), [
    ("idempotency_key", lambda c: c.ship("exp", step=1, idempotency_key="clé-1")),
    ("idempotency_key", lambda c: c.record_mismatch("exp", 1, {"lags": {}}, idempotency_key="ключ")),
    ("token", lambda c: StalenessClient("http://127.0.0.1:9", "tök€n")),
])  # fmt: skip
def test_a_header_value_not_ascii_is_refused_naming_its_argument(field: str, call: Any) -> None:
    """httpx raised a bare UnicodeEncodeError naming no argument (the token's at the first call)."""
    paths: list[str] = []
    with client_answering(httpx.Response(200, json={}), paths) as client, pytest.raises(StalenessError) as refused:
        call(client)
    assert refused.value.field == field and paths == []
