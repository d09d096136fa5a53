"""An HTTP proxy in front of an S3 endpoint that delays, refuses and counts requests.

Loopback S3 answers in a fraction of a millisecond and never fails, so neither
the cost of one round trip per image nor the retry path would ever show. The
proxy adds a first-byte latency to every answer (`latency_ms`: what a region is
from a node), answers a fraction of the GET requests 503 SlowDown instead of
forwarding them (`fail_rate`, drawn from a seeded generator: the same requests
fail on every run that makes them in the same order), and refuses every request
whose path contains `fail_paths` (an object that keeps failing). It records
how many requests it saw, refused and held at once (`peak_in_flight`), which is
how the tests see that a batch's objects are fetched together.
`ddp bench data --latency-ms` reads S3 through it; the tests start it too.
"""

from __future__ import annotations

import argparse
import http.client
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import urlparse

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


@dataclass
class Faults:
    latency_ms: float = 0.0
    fail_rate: float = 0.0  # of the GET requests (object reads and listings: the data path)
    fail_paths: tuple[str, ...] = ()  # requests whose path has one of these: always refused
    seed: int = 0


@dataclass
class Counts:
    requests: int = 0
    refused: int = 0
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
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

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

    def refuses(self, method: str, path: str) -> bool:
        """Whether this request is answered 503 instead of forwarded (and counted)."""
        with self.counts.lock:
            self.counts.requests += 1
            refused = (any(p in path for p in self.faults.fail_paths)
                       or (method == "GET" and self.random.random() < self.faults.fail_rate))
            self.counts.refused += refused
            return refused


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
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.faults.latency_ms:
                    time.sleep(proxy.faults.latency_ms / 1000)
                if proxy.refuses(self.command, self.path):
                    self.answer(503, [("Content-Type", "application/xml")], SLOW_DOWN)
                    return
                status, headers, data = self.forward(body)
                self.answer(status, headers, data)
            finally:
                with counts.lock:
                    counts.in_flight -= 1

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
            self.send_response(status)
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
                     "--seed", str(faults.seed)]
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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with FaultProxy(args.upstream, Faults(args.latency_ms, args.fail_rate, seed=args.seed)) as proxy:
        print(proxy.url, flush=True)
        sys.stdin.read()
    print(proxy.counts.requests, flush=True)


if __name__ == "__main__":
    main()
