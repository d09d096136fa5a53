"""The fault proxy: what it forwards (ranges, HEAD, PUT, kept-alive connections), what it refuses
(503 SlowDown, seeded; dropped connections; an always-failing path), the latency it adds, and what it
counts. Against a tiny in-process upstream, no S3 server: fast."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddp_cli.bench import faultproxy
from ddp_cli.bench.faultproxy import FaultProxy, Faults


class Upstream:
    """Objects in a dict, served like S3 serves them (Range -> 206), and each request's headers seen."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {"/b/k": bytes(range(256)) * 4}
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                upstream.seen.append(("GET", self.path, dict(self.headers)))
                data = upstream.objects.get(self.path)
                if data is None:
                    return self.reply(404, b"<Error><Code>NoSuchKey</Code></Error>")
                if spec := self.headers.get("Range"):
                    first, last = (int(x) for x in spec.removeprefix("bytes=").split("-"))
                    return self.reply(206, data[first:last + 1])
                self.reply(200, data)

            def do_HEAD(self) -> None:
                upstream.seen.append(("HEAD", self.path, dict(self.headers)))
                self.send_response(200)
                self.send_header("Content-Length", str(len(upstream.objects[self.path])))
                self.end_headers()

            def do_PUT(self) -> None:
                upstream.seen.append(("PUT", self.path, dict(self.headers)))
                upstream.objects[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
                self.reply(200, b"")

            def reply(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def upstream():
    served = Upstream()
    yield served
    served.server.shutdown()
    served.server.server_close()


def connect(proxy: FaultProxy) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]), timeout=10)


def get(proxy: FaultProxy, path: str = "/b/k", **headers: str) -> http.client.HTTPResponse:
    conn = connect(proxy)
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    response.body = response.read()
    conn.close()
    return response


def test_it_forwards_ranges_heads_puts_and_chunked_bodies_on_one_kept_alive_connection(upstream):
    with FaultProxy(upstream.url) as proxy:
        conn = connect(proxy)
        conn.request("GET", "/b/k", headers={"Range": "bytes=10-19"})
        ranged = conn.getresponse()
        assert (ranged.status, ranged.read()) == (206, bytes(range(10, 20)))
        conn.request("HEAD", "/b/k")
        head = conn.getresponse()
        assert (head.status, head.getheader("Content-Length"), head.read()) == (200, "1024", b"")
        conn.request("PUT", "/b/new", body=b"written")
        assert conn.getresponse().read() == b""
        conn.request("PUT", "/b/chunked", body=iter([b"in ", b"chunks"]), encode_chunked=True)
        put = conn.getresponse()
        assert (put.status, put.read()) == (200, b"")
        conn.request("GET", "/b/missing")
        missing = conn.getresponse()
        assert (missing.status, missing.read()) == (404, b"<Error><Code>NoSuchKey</Code></Error>")
        conn.close()
    assert upstream.objects["/b/new"] == b"written" and upstream.objects["/b/chunked"] == b"in chunks"
    assert proxy.counts.requests == 5 and proxy.counts.refused == 0
    assert not any("Expect" in headers or "Transfer-Encoding" in headers for *_, headers in upstream.seen)
    assert [h for h, _ in ranged.getheaders()].count("Server") == 1  # the upstream's, not two


def test_a_fraction_of_gets_is_answered_503_slowdown_the_same_ones_for_the_same_seed(upstream):
    outcomes = []
    for _ in range(2):
        with FaultProxy(upstream.url, Faults(fail_rate=0.3, seed=7)) as proxy:
            outcomes.append([get(proxy).status for _ in range(40)])
        assert proxy.counts.refused == outcomes[-1].count(503)
    assert outcomes[0] == outcomes[1] and 0 < outcomes[0].count(503) < 40
    assert set(outcomes[0]) == {200, 503}
    with FaultProxy(upstream.url, Faults(fail_rate=1.0)) as proxy:
        answer = get(proxy)
        conn = connect(proxy)
        conn.request("PUT", "/b/put", body=b"x")  # only reads fail at random: the data path
        assert conn.getresponse().status == 200
    assert answer.status == 503 and answer.getheader("Content-Type") == "application/xml"
    assert b"<Code>SlowDown</Code>" in answer.body and b"reduce your request rate" in answer.body


def test_a_failing_path_always_fails_and_others_pass(upstream):
    upstream.objects["/b/other"] = b"fine"
    with FaultProxy(upstream.url, Faults(fail_paths="/b/k")) as proxy:  # a string: one substring
        statuses = [get(proxy).status for _ in range(5)]
        other = get(proxy, "/b/other")
    assert statuses == [503] * 5 and (other.status, other.body) == (200, b"fine")
    assert (proxy.counts.requests, proxy.counts.refused) == (6, 5)
    assert [path for _, path, _ in upstream.seen] == ["/b/other"]  # the failures never reached it


def test_a_dropped_connection_is_reset_without_an_answer(upstream):
    with (FaultProxy(upstream.url, Faults(fail_rate=1.0, drop_share=1.0)) as proxy,
          pytest.raises((ConnectionResetError, http.client.RemoteDisconnected))):
        get(proxy)
    assert (proxy.counts.refused, proxy.counts.dropped) == (1, 1) and upstream.seen == []


def test_latency_comes_before_forwarding_and_holds_requests_in_flight(upstream, monkeypatch):
    """No clock: the proxy's sleep is recorded, and two requests held by it are seen in flight at
    once (each waits at a barrier that only both together pass)."""
    events: list[object] = []
    barrier = threading.Barrier(2, timeout=10)

    def sleep(seconds: float) -> None:
        events.append(seconds)
        barrier.wait()  # both requests are inside the proxy now, or this times out

    monkeypatch.setattr(faultproxy.time, "sleep", sleep)
    with FaultProxy(upstream.url, Faults(latency_ms=80)) as proxy:
        threads = [threading.Thread(target=lambda: events.append(get(proxy).status)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
    assert events[:2] == [0.08, 0.08] and events[2:] == [200, 200]
    assert proxy.counts.peak_in_flight == 2 and proxy.counts.in_flight == 0
