"""Transient storage errors, retried with bounded exponential backoff and counted.

At scale an S3 run meets throttling (503 SlowDown), 5xx answers, connection
resets and timeouts: one in many thousand requests, but a run makes millions.
Such a request is retried `io_retries` times, waiting `io_retry_wait_s`, then
twice as long each time (capped at 10 s, jittered so that ranks do not retry in
step); an object that keeps failing ends the run (exit 3) naming it, the last
checkpoint intact. Any other error (a missing key, refused credentials) is not
retried: waiting would not change it.

botocore and s3fs retry on their own, hidden, uncounted and beyond our budget
(25 attempts of a GET answered 503, measured): `storage.s3_filesystem` turns both
off, so this module is the one that retries. Left on: aiohttp sends a GET once
more when its connection is reset before any answer (how a kept-alive connection
that the server closed ends; a second reset reaches us as EndpointConnectionError).
What s3fs raises, seen through the fault proxy: a 503 as OSError(EBUSY) caused by
botocore's ClientError; a reset as EndpointConnectionError caused by aiohttp's
ClientOSError; a slow answer as ReadTimeoutError. `transient` follows the causes.

Every retry is counted in a counter in shared memory made by the rank before its
loader processes fork (`count_retries`), so the trainer reads what its loader
processes retried (`io_retries` in metrics.jsonl and `train --json`).
"""

from __future__ import annotations

import errno
import multiprocessing
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ddp_cli.errors import DataError

T = TypeVar("T")
MAX_WAIT_S = 10.0
TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout",
                   "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}
TRANSIENT_ERRNOS = {errno.EBUSY, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
                    errno.EREMOTEIO}


@dataclass(frozen=True)
class IoPolicy:
    """How a reader of remote objects retries (data.io_retries, data.io_retry_wait_s) and how many requests
    it keeps in flight (data.io_concurrency)."""

    retries: int = 5
    wait_s: float = 0.2
    concurrency: int = 16

    @classmethod
    def of(cls, data: object) -> IoPolicy:
        return cls(data.io_retries, data.io_retry_wait_s, data.io_concurrency)


def transient(e: BaseException) -> bool:
    """Whether `e` (or what caused it: s3fs re-raises botocore's errors as OSErrors) is worth a retry."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _transient_one(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _transient_one(e: BaseException) -> bool:
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        error = response.get("Error", {})
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error.get("Code") in TRANSIENT_CODES or status >= 500 or status == 429
    name = type(e).__name__
    if name in ("ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError",
                "ResponseStreamingError", "IncompleteReadError", "ServerDisconnectedError",
                "ClientConnectionError", "ClientOSError", "ClientPayloadError", "FSTimeoutError",
                "ProtocolError", "IncompleteRead", "RemoteDisconnected"):
        return True
    if isinstance(e, TimeoutError | ConnectionError):
        return True
    return isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS


_count: multiprocessing.sharedctypes.Synchronized | None = None


def count_retries() -> None:
    """Make this process's retry counter in shared memory, before its loader processes fork."""
    global _count
    if _count is None:
        _count = multiprocessing.get_context("fork").Value("q", 0)


def retries_so_far() -> int:
    """Retries made by this process and its forked loader processes so far."""
    return _count.value if _count is not None else 0


def _counted() -> None:
    if _count is not None:
        with _count.get_lock():
            _count.value += 1


def with_retries(call: Callable[[], T], where: str, policy: IoPolicy = IoPolicy()) -> T:
    """`call()`, retried on transient errors; DataError naming `where` when the budget is spent."""
    for attempt in range(policy.retries + 1):
        try:
            return call()
        except Exception as e:
            if not transient(e):
                raise
            if attempt == policy.retries:
                raise DataError(f"{where}: the storage failed {attempt + 1} times in a row "
                                f"({type(e).__name__}: {str(e).strip() or 'no message'}); check the endpoint "
                                "and its status, or raise data.io_retries") from e
            _counted()
            wait = min(MAX_WAIT_S, policy.wait_s * 2**attempt)
            time.sleep(wait * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")  # pragma: no cover
