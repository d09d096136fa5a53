"""Transient storage errors: which ones, how often retried, and the one line when they do not stop."""

from __future__ import annotations

import errno

import pytest
from aiohttp import ClientOSError, ServerDisconnectedError
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from ddp_cli.data.fetch import retry
from ddp_cli.data.fetch.retry import IoPolicy, transient, with_retries
from ddp_cli.errors import DataError


def client_error(code: str, status: int) -> ClientError:
    response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "GetObject")


def translated(cause: BaseException, number: int) -> OSError:
    """What s3fs raises: an OSError whose cause is botocore's error."""
    try:
        raise OSError(number, "translated") from cause
    except OSError as e:
        return e


def chained(inner: BaseException, outer: BaseException) -> BaseException:
    """`outer` raised while handling `inner`, without `from`: only `__context__` links them (how s3fs
    re-raises some throttling errors)."""
    try:
        try:
            raise inner
        except type(inner):
            raise outer  # noqa: B904
    except type(outer) as e:
        assert e.__cause__ is None and e.__context__ is inner
        return e


def reset_by_peer() -> EndpointConnectionError:
    """aiobotocore's EndpointConnectionError, caused by aiohttp's ClientOSError, caused by the reset."""
    try:
        try:
            raise ClientOSError(errno.ECONNRESET, "Connection reset by peer")
        except ClientOSError as e:
            raise EndpointConnectionError(endpoint_url="http://x/b/k", error=e) from e
    except EndpointConnectionError as e:
        return e


@pytest.mark.parametrize(("error", "expected"), [
    (client_error("SlowDown", 503), True),
    (client_error("InternalError", 500), True),
    (client_error("TooManyRequests", 429), True),  # throttled: no code of ours, only the status says so
    (client_error("GatewayTimeout", 599), True),  # any 5xx, whatever its code
    (client_error("Unnamed", 500), True),  # the first 5xx
    (client_error("Unnamed", 499), False),  # the last 4xx
    (client_error("NoSuchKey", 404), False),
    (client_error("AccessDenied", 403), False),
    (translated(client_error("SlowDown", 503), errno.EBUSY), True),
    (ReadTimeoutError(endpoint_url="http://x"), True),
    (reset_by_peer(), True),  # what s3fs raised for a reset connection through the fault proxy
    (ServerDisconnectedError(), True),
    (ConnectionResetError(), True),
    (OSError(errno.EBUSY, "busy"), True),
    (chained(client_error("SlowDown", 503), OSError(errno.EIO, "read failed")), True),  # context only
    (chained(ConnectionResetError(), RuntimeError("wrapped")), True),
    (chained(client_error("NoSuchKey", 404), OSError(errno.EIO, "read failed")), False),
    (FileNotFoundError("nope"), False),
    (PermissionError("refused"), False),
])
def test_transient_errors_are_throttling_5xx_resets_and_timeouts(error, expected):
    assert transient(error) is expected


def failing(times: int, error: BaseException):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "data"
    return call, calls


def test_a_transient_failure_is_retried_and_counted(monkeypatch):
    monkeypatch.setattr(retry.time, "sleep", lambda s: waits.append(s))
    waits: list[float] = []
    retry.count_retries()
    before = retry.retries_so_far()
    call, calls = failing(3, client_error("SlowDown", 503))
    assert with_retries(call, "s3://b/k", IoPolicy(retries=5, wait_s=0.1)) == "data"
    assert len(calls) == 4 and retry.retries_so_far() - before == 3
    for wait, base in zip(waits, (0.1, 0.2, 0.4), strict=True):  # doubling, jittered down by at most half
        assert base / 2 <= wait <= base


def test_the_wait_doubles_up_to_ten_seconds(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", waits.append)
    call, _ = failing(9, ConnectionResetError())
    with_retries(call, "k", IoPolicy(retries=9, wait_s=1.0))
    assert max(waits) <= 10.0 and waits[-1] >= 5.0  # capped, jittered down by at most half


def test_a_failure_past_the_budget_is_one_line_naming_the_object(monkeypatch):
    monkeypatch.setattr(retry.time, "sleep", lambda s: None)
    call, calls = failing(99, client_error("SlowDown", 503))
    with pytest.raises(DataError, match=r"^s3://b/k: the storage failed 3 times in a row "
                                        r"\(ClientError: .*SlowDown.*raise data.io_retries$"):
        with_retries(call, "s3://b/k", IoPolicy(retries=2))
    assert len(calls) == 3


def test_other_errors_are_not_retried():
    call, calls = failing(1, FileNotFoundError("s3://b/k"))
    with pytest.raises(FileNotFoundError):
        with_retries(call, "s3://b/k")
    assert len(calls) == 1
