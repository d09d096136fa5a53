"""Transient storage errors: which ones, how often retried, and the one line when they do not stop."""

from __future__ import annotations

import errno
import http.client
import multiprocessing

import pytest
from aiohttp import ClientOSError, ServerDisconnectedError
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from ddp_cli.config import DataConfig
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


@pytest.mark.parametrize("code", ["Throttling", "ThrottlingException", "RequestLimitExceeded",
                                  "RequestTimeout"])
def test_throttling_and_timeout_codes_are_transient_whatever_the_status(code):
    """AWS answers these with a 400: only the error code says that waiting helps."""
    assert transient(client_error(code, 400))
    assert not transient(client_error("InvalidRequest", 400))


def failures_known_by_name() -> list[BaseException]:
    """The transport failures the clients raise that no errno or builtin class marks as transient: only
    their class names tell (alone, without the cause a real one may carry)."""
    from aiohttp import ClientConnectionError, ClientOSError, ClientPayloadError
    from botocore.exceptions import (
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        IncompleteReadError,
        ResponseStreamingError,
    )
    from urllib3.exceptions import ProtocolError

    return [ConnectionClosedError(endpoint_url="http://x/b/k"), ResponseStreamingError(error="reset"),
            IncompleteReadError(actual_bytes=1, expected_bytes=2), EndpointConnectionError(endpoint_url=""),
            ConnectTimeoutError(endpoint_url="http://x"), ClientConnectionError(), ClientOSError(),
            ClientPayloadError("cut short"), ProtocolError("Connection aborted."),
            http.client.IncompleteRead(b"part", 10)]


@pytest.mark.parametrize("error", failures_known_by_name(), ids=lambda e: type(e).__name__)
def test_transport_failures_known_only_by_their_class_name_are_transient(error):
    assert not isinstance(error, ConnectionError | TimeoutError) and getattr(error, "errno", None) is None
    assert error.__cause__ is None and error.__context__ is None
    assert transient(error)


def test_a_cycle_of_causes_ends_the_search():
    first, second = ValueError("a"), KeyError("b")
    first.__context__, second.__context__ = second, first
    assert transient(first) is False


def test_the_policy_is_read_from_the_data_section():
    data = DataConfig(io_retries=3, io_retry_wait_s=0.7, io_concurrency=5)
    assert IoPolicy.of(data) == IoPolicy(retries=3, wait_s=0.7, concurrency=5)


@pytest.mark.processes
def test_the_counter_starts_at_zero_and_sees_the_retries_of_forked_loader_processes(monkeypatch):
    monkeypatch.setattr(retry, "_count", None)  # a fresh process
    assert retry.retries_so_far() == 0
    retry.count_retries()
    assert retry.retries_so_far() == 0
    loader = multiprocessing.get_context("fork").Process(target=lambda: [retry._counted() for _ in range(3)])
    loader.start()
    loader.join(30)
    assert loader.exitcode == 0 and retry.retries_so_far() == 3


def test_an_error_without_a_message_says_so_in_the_one_line(monkeypatch):
    monkeypatch.setattr(retry.time, "sleep", lambda s: None)
    call, _ = failing(99, ConnectionResetError())
    with pytest.raises(DataError, match=r"2 times in a row \(ConnectionResetError: no message\); check"):
        with_retries(call, "s3://b/k", IoPolicy(retries=1))


def test_an_answer_with_only_a_code_or_only_a_status_is_judged_on_what_it_has():
    assert transient(ClientError({"Error": {"Code": "SlowDown"}}, "GetObject"))  # no status
    assert transient(ClientError({"ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject"))  # no code
    assert not transient(ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject"))
