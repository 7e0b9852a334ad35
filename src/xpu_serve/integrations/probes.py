"""Health probes of the supervisor and the HTTP listener that serves them with `/metrics`.

One listener (`metrics.listen`, default `127.0.0.1:9400`), a standard-library
`ThreadingHTTPServer` in a daemon thread, so a slow client never blocks the supervisor's asyncio
loop. Answers (body: one line of text, `text/plain`):

| path | 200 when | else |
| --- | --- | --- |
| `/metrics` | always (Prometheus text format, `prometheus_client.generate_latest`) | |
| `/livez` | the supervisor's event loop ticked (a task on it stamps the time every `BEAT_S` s) less than `LIVE_STALE_S` s ago | 503 |
| `/readyz` | state `ready` and no hang suspected (the hang watchdog saw no token progress with requests in flight for `HangWatcher.suspect_after_s()`) | 503, the reason |
| `/startupz` | the first start-up is over: an incarnation was ready once, or the first incarnation left `starting` (it failed: from then on the supervisor's own restart policy and `/livez` take over), or the supervisor gave up or stopped | 503 |
| anything else | | 404 |

`/startupz` is meant for a Kubernetes startupProbe: it holds the liveness probe off while the
model loads, and never overlaps the supervisor's own backoff (a kubelet restart during a
start-up crash loop would stack a second backoff on the supervisor's).
HEAD is answered like GET without a body; query strings are ignored, and so is the scheme and
host of an absolute-form target (`GET http://host:9400/readyz`, RFC 9112 section 3.2.2).

The listener never costs the supervisor its file descriptors or threads: at most
`MAX_CONNECTIONS` connections are served at once (one more is closed at once, unread), and each
is shut down `REQUEST_DEADLINE_S` after it was accepted, whatever it sent by then (a client
that connects and sends nothing, or a byte a second, would otherwise hold a descriptor and a
thread for ever, and a thousand of them would make the supervisor's own `open()` fail).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from xpu_serve.incarnation import Status

PROBE_PATHS = ("/livez", "/readyz", "/startupz")
METRICS_PATH = "/metrics"
BEAT_S = 1.0  # loop heartbeat period, seconds
LIVE_STALE_S = 5.0  # /livez fails when the last loop heartbeat is older than this, seconds
_PAST_STARTUP = frozenset({"gave-up", "stopped"})
MAX_CONNECTIONS = 32  # served at once; a scraper and three probers need 4
REQUEST_DEADLINE_S = 5.0  # a connection is shut down this long after accept, seconds
SWEEP_S = 0.5  # serve_forever's poll interval: how often late connections are swept, seconds


class Probes:
    """Probe answers from the supervisor's state (`on_state`, called on its loop), the loop
    heartbeat (`start_heartbeat`) and the hang watchdog (`hang`: a callable returning why a
    hang is suspected, or None). Every `*z()` returns (HTTP status, one-line reason)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.state: str | None = None
        self.reason: str | None = None
        self.next_restart_at: float | None = None
        self.past_startup = False
        self.hang: Callable[[], str | None] | None = None
        self.last_beat: float | None = None
        self._task: asyncio.Task[None] | None = None

    def on_state(self, status: Status) -> None:
        """Record the state; the first start-up is over once anything but `starting` was seen
        after it began (ready, failed, gave-up, stopped)."""
        if status.state != "starting" and self.state is not None:
            self.past_startup = True
        if status.state in _PAST_STARTUP or status.state == "ready":
            self.past_startup = True
        self.state, self.reason, self.next_restart_at = status.state, status.reason, status.next_restart_at

    def start_heartbeat(self) -> bool:
        """Start the heartbeat task on the running asyncio loop; False when none runs (then
        `/livez` stays 503: no loop to vouch for)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if self._task is None or self._task.done():
            self.last_beat = self.clock()
            self._task = loop.create_task(self._beat())
        return True

    async def _beat(self) -> None:
        while True:
            self.last_beat = self.clock()
            await asyncio.sleep(BEAT_S)

    def livez(self) -> tuple[int, str]:
        if self.last_beat is None:
            return 503, "no event-loop heartbeat yet"
        age = self.clock() - self.last_beat
        if age > LIVE_STALE_S:
            return 503, f"event loop stalled: last heartbeat {age:.1f} s ago (limit {LIVE_STALE_S:g} s)"
        return 200, "ok"

    def readyz(self) -> tuple[int, str]:
        if self.state != "ready":
            return 503, self._not_ready()
        why = None
        if self.hang is not None:
            with contextlib.suppress(Exception):  # a probe answers, whatever the watchdog does
                why = self.hang()
        return (503, why) if why else (200, "ready")

    def _not_ready(self) -> str:
        if self.state is None:
            return "supervisor starting"
        text = f"state {self.state}"
        if self.state == "backoff" and self.next_restart_at is not None:
            text += f", restart in {max(0.0, self.next_restart_at - time.time()):.1f} s"
        if self.reason:
            text += f": {self.reason}"
        return " ".join(text.split())  # one line

    def startupz(self) -> tuple[int, str]:
        if self.past_startup:
            return 200, f"past the first start-up (state {self.state})"
        return 503, "first start-up in progress"


def _handler(registry: CollectorRegistry, probes: Probes) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[], tuple[int, str]]] = {
        "/livez": probes.livez,
        "/readyz": probes.readyz,
        "/startupz": probes.startupz,
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = urlsplit(self.path).path if "://" in self.path else self.path.split("?", 1)[0]
            if path == METRICS_PATH:
                code, data, ctype = 200, generate_latest(registry), CONTENT_TYPE_LATEST
            elif path in routes:
                code, text = routes[path]()
                data, ctype = (text + "\n").encode(), "text/plain; charset=utf-8"
            else:
                code, data, ctype = 404, b"not found: /metrics /livez /readyz /startupz\n", "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # scrapes and probes every few seconds would flood the supervisor's stderr

    return Handler


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most MAX_CONNECTIONS connections, each shut down
    REQUEST_DEADLINE_S after accept (swept by `service_actions`, which `serve_forever` calls
    every `SWEEP_S`; the shutdown wakes the handler thread blocked in recv or send)."""

    daemon_threads = True
    request_queue_size = 64  # listen backlog (socketserver's 5 drops the SYNs of a burst)
    max_connections = MAX_CONNECTIONS
    deadline_s = REQUEST_DEADLINE_S

    def __init__(self, *args: Any, **kwargs: Any):
        self._open: dict[socket.socket, float] = {}  # connection -> deadline (time.monotonic)
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            full = len(self._open) >= self.max_connections
            if not full:
                self._open[request] = time.monotonic() + self.deadline_s
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._open_lock:
            late = [s for s, deadline in self._open.items() if deadline <= now]
        for s in late:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class _Server6(_BoundedServer):
    address_family = socket.AF_INET6



def serve(host: str, port: int, registry: CollectorRegistry, probes: Probes) -> ThreadingHTTPServer:
    """Bind HOST:PORT and serve in a daemon thread; returns the server (`server_address[1]` is
    the bound port, useful with port 0). Raises OSError when the address cannot be bound."""
    cls = _Server6 if ":" in host else _BoundedServer
    server = cls((host, port), _handler(registry, probes))
    threading.Thread(
        target=server.serve_forever, args=(SWEEP_S,), name="xpu-serve-metrics", daemon=True
    ).start()
    return server
