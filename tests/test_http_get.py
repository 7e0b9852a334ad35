"""KeepAliveGet against real HTTP servers on loopback: reuse, server-side close, refusal, timeout."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from xpu_serve.sources.http_get import KeepAliveGet


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    connections = 0
    close_after = False
    status = 200
    delay_s = 0.0


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_GET(self) -> None:
        time.sleep(self.server.delay_s)
        body = f"{self.path} {self.headers.get('Authorization')}".encode()
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(body)))
        if self.server.close_after:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _run(getter: KeepAliveGet, paths: list[str]) -> list:
    async def go() -> list:
        return [await getter.get(p) for p in paths]

    try:
        return asyncio.run(go())
    finally:
        getter.close()


def test_one_connection_serves_every_poll_with_headers(server: _Server) -> None:
    g = KeepAliveGet("127.0.0.1", server.server_address[1], 2.0, {"Authorization": "Bearer k"})
    res = _run(g, ["/health", "/metrics", "/health"])
    assert [(r.status, r.body, r.error) for r in res] == [
        (200, b"/health Bearer k", None),
        (200, b"/metrics Bearer k", None),
        (200, b"/health Bearer k", None),
    ]
    assert server.connections == 1


def test_a_connection_the_server_closes_is_reopened(server: _Server) -> None:
    server.close_after = True
    res = _run(KeepAliveGet("127.0.0.1", server.server_address[1], 2.0), ["/a", "/b", "/c"])
    assert [r.status for r in res] == [200, 200, 200]
    assert server.connections == 3


def test_non_200_is_a_status_not_an_error(server: _Server) -> None:
    server.status = 503
    (r,) = _run(KeepAliveGet("127.0.0.1", server.server_address[1], 2.0), ["/health"])
    assert (r.status, r.error) == (503, None)


def test_refused_port_is_reported_not_raised() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    (r,) = _run(KeepAliveGet("127.0.0.1", port, 2.0), ["/health"])
    assert (r.status, r.error) == (None, "connection refused")


def test_a_server_that_never_answers_times_out_within_bounds() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)  # accepts into the backlog, never reads or answers
    try:
        t0 = time.monotonic()
        (r,) = _run(KeepAliveGet("127.0.0.1", s.getsockname()[1], 0.3), ["/health"])
        assert (r.status, r.error) == (None, "timed out")
        assert time.monotonic() - t0 < 5.0
    finally:
        s.close()


class _Trickle(http.server.BaseHTTPRequestHandler):
    """/trickle: a body of 100 bytes, one every 0.2 s; /endless: a body that never ends."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "100" if self.path == "/trickle" else str(1 << 40))
        self.end_headers()
        try:
            for _ in range(100 if self.path == "/trickle" else 1 << 30):
                self.wfile.write(b"x" if self.path == "/trickle" else b"x" * 65536)
                self.wfile.flush()
                if self.path == "/trickle":
                    time.sleep(0.2)
        except OSError:
            pass

    def log_message(self, *a: object) -> None:
        pass


def test_a_trickling_or_endless_body_costs_at_most_the_deadline_and_max_bytes() -> None:
    srv = _Server(("127.0.0.1", 0), _Trickle)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    g = KeepAliveGet("127.0.0.1", srv.server_address[1], timeout_s=1.0, max_bytes=1 << 20)

    async def main() -> tuple[float, object, float, object]:
        t0 = time.monotonic()
        slow = await g.get("/trickle")  # each byte within the timeout: 20 s without a deadline
        t1 = time.monotonic()
        endless = await g.get("/endless")
        return t1 - t0, slow, time.monotonic() - t1, endless

    try:
        slow_s, slow, endless_s, endless = asyncio.run(main())
    finally:
        g.close()
        srv.shutdown()
        srv.server_close()
    assert slow.error == "timed out" and slow_s < 5, (slow, slow_s)  # type: ignore[attr-defined]
    assert endless.error == "body larger than 1048576 bytes" and endless_s < 5  # type: ignore[attr-defined]
