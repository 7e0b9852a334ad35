"""Periodic GETs of the engine's `/health` and `/metrics` over one kept-alive HTTP/1.1 connection.

The supervisor polls both every second for as long as the engine runs; httpx's AsyncClient costs
about 3.4 ms of CPU per request on these machines against 0.5 ms for the standard library's
`http.client` on a reused connection (bench/bench_footprint.py has the idle figure), so the polls
use `http.client` in a one-thread executor and the rarer requests (readiness, canary) keep httpx.

    getter = KeepAliveGet("127.0.0.1", 8000, timeout_s=2.0, headers={"Authorization": "Bearer ..."})
    res = await getter.get("/health")     # GetResult(status=200, body=b"", error=None)
    getter.close()

A request that fails on a reused connection (the server closed it between polls) is retried once
on a new connection; errors come back as `GetResult.error` ("connection refused", "timed out",
"body larger than N bytes", "ExceptionName: text"), never raised. The body is read against a
deadline of `timeout_s` from the request's start and at most `max_bytes` of it: a server that
trickles bytes, or never ends its body, costs at most that and the connection.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class GetResult:
    """One GET: HTTP status (None when no response came), body bytes, error text or None."""

    status: int | None
    body: bytes = b""
    error: str | None = None


def _error_text(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(e).__name__}: {e}"


class KeepAliveGet:
    """GET `path` on HOST:PORT over one persistent connection; one request at a time.

    host: a name or address (IPv6 without brackets); timeout_s: connect and read timeout, and
    the deadline of the whole body, seconds; max_bytes: the largest body read.
    """

    def __init__(
        self, host: str, port: int, timeout_s: float, headers: dict[str, str] | None = None,
        max_bytes: int = 8 << 20,
    ):
        self.host, self.port, self.timeout_s, self.max_bytes = host.strip("[]"), port, timeout_s, max_bytes
        self.headers = dict(headers or {})
        self._conn: http.client.HTTPConnection | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xpu-serve-get")

    def _request(self, path: str) -> GetResult:
        for attempt in (0, 1):
            fresh = self._conn is None
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            deadline = time.monotonic() + self.timeout_s
            if self._conn.sock is not None:  # (a reused one: _body cut its timeout)
                self._conn.sock.settimeout(self.timeout_s)
            try:
                self._conn.request("GET", path, headers=self.headers)
                r = self._conn.getresponse()
                body = self._body(r, deadline)
                if body is None:
                    self._drop()
                    return GetResult(r.status, error=f"body larger than {self.max_bytes} bytes")
                if r.will_close:
                    self._drop()
                return GetResult(r.status, body)
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                if fresh or attempt or isinstance(e, (socket.timeout, TimeoutError)):
                    return GetResult(None, error=_error_text(e))
        return GetResult(None, error="no response")  # not reached: the loop returns

    def _body(self, r: http.client.HTTPResponse, deadline: float) -> bytes | None:
        """The body, read by chunks with the socket timeout cut to what is left of `deadline`
        (TimeoutError past it); None past `max_bytes`."""
        chunks: list[bytes] = []
        got = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("body not done by the deadline")
            if self._conn is not None and self._conn.sock is not None:
                self._conn.sock.settimeout(left)
            chunk = r.read1(65536)
            if not chunk:
                r.close()  # as read() does at the end: the connection can send the next request
                return b"".join(chunks)
            got += len(chunk)
            if got > self.max_bytes:
                return None
            chunks.append(chunk)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def get(self, path: str) -> GetResult:
        """GET `path`; waits in the executor thread, so the event loop stays free."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._request, path)

    def close(self) -> None:
        """Close the connection and the executor (a request in progress ends by its timeout)."""
        self._pool.submit(self._drop)
        self._pool.shutdown(wait=False)
