"""An HTTP proxy in front of an S3 endpoint that delays, refuses and counts requests.

Loopback S3 answers in a fraction of a millisecond and never fails, so neither
the cost of one round trip per image nor the retry path would ever show. The
proxy adds a first-byte latency to every answer (`latency_ms`: what a region is
from a node), answers a fraction of the GET requests (or of other `methods`: a
run dir's uploads are PUTs) 503 SlowDown instead of forwarding them
(`fail_rate`, drawn from a seeded generator: the same requests
fail on every run that makes them in the same order; `drop_share` of those
failures drop the connection instead, a reset with no answer), and refuses every
request whose path contains one of `fail_paths` (an object that keeps failing).
It records how many requests it saw, refused, dropped and held at once
(`peak_in_flight`), which is how the tests see that a batch's objects are
fetched together.
`ddp bench data --latency-ms` reads S3 through it; the tests start it too.
"""

from __future__ import annotations

import argparse
import http.client
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import urlparse

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "expect", "te"}


@dataclass
class Faults:
    latency_ms: float = 0.0
    fail_rate: float = 0.0  # of the requests of `methods` (GETs: reads and listings, the data path)
    drop_share: float = 0.0  # of those failures: the connection reset instead of a 503 SlowDown
    fail_paths: tuple[str, ...] = ()  # requests whose path has one of these: always refused (503)
    seed: int = 0
    methods: tuple[str, ...] = ("GET",)  # what `fail_rate` draws from; a run dir's uploads are PUTs

    def __post_init__(self) -> None:
        if isinstance(self.fail_paths, str):  # one substring, not its characters
            self.fail_paths = (self.fail_paths,)


@dataclass
class Counts:
    requests: int = 0
    refused: int = 0  # answered 503 or dropped
    dropped: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class FaultProxy:
    """`with FaultProxy(upstream, Faults(...)) as proxy:` then point clients at `proxy.url`."""

    def __init__(self, upstream: str, faults: Faults = Faults()) -> None:
        target = urlparse(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.faults, self.counts = faults, Counts()
        self.random = random.Random(faults.seed)
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="fault-proxy",
                                       daemon=True)  # polled for `shutdown` every 50 ms

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def fault(self, method: str, path: str) -> str | None:
        """What this request meets instead of being forwarded: "503", "drop" or None (counted)."""
        with self.counts.lock:
            self.counts.requests += 1
            if any(p in path for p in self.faults.fail_paths):
                fault = "503"
            elif method in self.faults.methods and self.random.random() < self.faults.fail_rate:
                fault = "drop" if self.random.random() < self.faults.drop_share else "503"
            else:
                return None
            self.counts.refused += 1
            self.counts.dropped += fault == "drop"
            return fault


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up (its timeout): no news
            return
        super().handle_error(request, client_address)


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: the tests and the bench read counts
            pass

        def relay(self) -> None:
            counts = proxy.counts
            with counts.lock:
                counts.in_flight += 1
                counts.peak_in_flight = max(counts.peak_in_flight, counts.in_flight)
            try:
                body = self.body()
                if proxy.faults.latency_ms:
                    time.sleep(proxy.faults.latency_ms / 1000)
                fault = proxy.fault(self.command, self.path)
                if fault == "drop":
                    self.drop()
                    return
                if fault:
                    self.answer(503, [("Server", "fault-proxy"), ("Date", formatdate(usegmt=True)),
                                      ("Content-Type", "application/xml")], SLOW_DOWN)
                    return
                status, headers, data = self.forward(body)
                self.answer(status, headers, data)
            finally:
                with counts.lock:
                    counts.in_flight -= 1

        def body(self) -> bytes:
            """The request's body, sent with a length or in chunks."""
            if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)

        def drop(self) -> None:
            """Reset the connection, answering nothing (what a client sees when a node goes away)."""
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        def forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
            upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                response = upstream.getresponse()
                data = b"" if self.command == "HEAD" else response.read()
                kept = [(k, v) for k, v in response.getheaders()
                        if k.lower() not in HOP_BY_HOP | {"content-length"}]
                if self.command == "HEAD":
                    kept.append(("Content-Length", response.getheader("Content-Length") or "0"))
                return response.status, kept, data
            finally:
                upstream.close()

        def answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
            self.send_response_only(status)  # Server and Date: the upstream's (one of each)
            for key, value in headers:
                self.send_header(key, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

    return Handler


class ProxyProcess:
    """A FaultProxy in a process of its own (`python -m ddp_cli.bench.faultproxy`): the bench's proxy
    must not take the GIL of the process it measures. `requests` is its count, read when it stops."""

    def __init__(self, upstream: str, faults: Faults = Faults()) -> None:
        self.args = [sys.executable, "-m", "ddp_cli.bench.faultproxy", upstream,
                     "--latency-ms", str(faults.latency_ms), "--fail-rate", str(faults.fail_rate),
                     "--drop-share", str(faults.drop_share), "--seed", str(faults.seed),
                     *(f"--fail-path={path}" for path in faults.fail_paths)]
        self.url, self.requests = "", 0

    def __enter__(self) -> ProxyProcess:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.proc.kill()
            raise RuntimeError(f"the fault proxy did not start (it said {self.url!r})")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            out, _ = self.proc.communicate(input="", timeout=30)  # stdin closed: report and stop
            self.requests = int(out.split()[0]) if out.strip() else 0
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    """Serve until stdin closes: the URL on the first stdout line, the request count on the last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("upstream")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--drop-share", type=float, default=0.0)
    parser.add_argument("--fail-path", action="append", default=[])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    faults = Faults(latency_ms=args.latency_ms, fail_rate=args.fail_rate, drop_share=args.drop_share,
                    fail_paths=tuple(args.fail_path), seed=args.seed)
    with FaultProxy(args.upstream, faults) as proxy:
        print(proxy.url, flush=True)
        sys.stdin.read()
    print(proxy.counts.requests, flush=True)


if __name__ == "__main__":
    main()
