"""The supervisor's own Prometheus endpoint (default `127.0.0.1:9400/metrics`), via prometheus-client.

Families (all prefixed `xpu_serve_`):
- `state{state="ready"}` 1 for the current state, 0 for the others (StateSetStyle gauge);
- `incarnation`, `restarts_total`, `incidents_total{cause}`, `last_incident_timestamp_seconds`;
- `uptime_seconds`: seconds since the current incarnation became ready (0 when not ready);
- `supervisor_start_time_seconds`;
- `time_to_ready_seconds` histogram (incarnation start -> ready);
- `kernel_events_total{kind,device}`: classified kernel records (signature id, PCI device or "");
- `hang_detections_total`.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from xpu_serve.events import Event
from xpu_serve.incarnation import Status

STATES = ("starting", "ready", "failed", "capturing", "stopping", "backoff", "gave-up", "stopped")
_DEVICE_KEYS = ("device", "pci")


def parse_listen(listen: str) -> tuple[str, int]:
    """"HOST:PORT" or "[::1]:PORT" -> (host, port). Raises ValueError on a bad address."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not (0 <= int(port) <= 65535):
        raise ValueError(f"metrics.listen: expected HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class SupervisorMetrics:
    """An `Observer` that keeps the supervisor's Prometheus metrics in its own registry.

    `start(listen)` serves them over HTTP in a daemon thread and returns the bound port (useful with
    port 0). Hooks never raise into the supervisor.
    """

    def __init__(self, clock: Any = time.time):
        self.clock = clock
        self.registry = CollectorRegistry()
        r = self.registry
        self.state = Gauge("xpu_serve_state", "Current supervisor state (1 for the current one)", ["state"], registry=r)
        self.incarnation = Gauge("xpu_serve_incarnation", "Current incarnation number", registry=r)
        self.restarts = Counter("xpu_serve_restarts", "Restarts of the server", registry=r)
        self.incidents = Counter("xpu_serve_incidents", "Incidents by root cause", ["cause"], registry=r)
        self.last_incident = Gauge(
            "xpu_serve_last_incident_timestamp_seconds", "Unix time of the last incident", registry=r
        )
        self.uptime = Gauge("xpu_serve_uptime_seconds", "Seconds since the current incarnation became ready", registry=r)
        self.start_time = Gauge("xpu_serve_supervisor_start_time_seconds", "Unix time the supervisor started", registry=r)
        self.time_to_ready = Histogram(
            "xpu_serve_time_to_ready_seconds",
            "Incarnation start to ready",
            buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
            registry=r,
        )
        self.kernel_events = Counter(
            "xpu_serve_kernel_events", "Classified kernel records", ["kind", "device"], registry=r
        )
        self.hangs = Counter("xpu_serve_hang_detections", "Hangs detected by the watchdog", registry=r)
        self.start_time.set(self.clock())
        for s in STATES:
            self.state.labels(state=s).set(0)
        self._ready_since: float | None = None
        self._starting_since: float | None = None
        self._last_state: str | None = None
        self._restarts_seen = 0
        self.uptime.set_function(lambda: (self.clock() - self._ready_since) if self._ready_since else 0.0)
        self.port: int | None = None

    def start(self, listen: str) -> int:
        """Serve /metrics on `listen` ("HOST:PORT"); returns the bound port. Raises OSError/ValueError."""
        host, port = parse_listen(listen)
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(server.server_address[1])
        return self.port

    def on_state(self, status: Status) -> None:
        """Observer hook: state gauge, incarnation, restarts, time-to-ready and uptime."""
        now = self.clock()
        for s in STATES:
            self.state.labels(state=s).set(1 if s == status.state else 0)
        self.incarnation.set(status.incarnation)
        if status.restarts > self._restarts_seen:
            self.restarts.inc(status.restarts - self._restarts_seen)
            self._restarts_seen = status.restarts
        if status.state == "starting" and self._last_state != "starting":
            self._starting_since = now
            self._ready_since = None
        elif status.state == "ready" and self._last_state != "ready":
            if self._starting_since is not None:
                self.time_to_ready.observe(max(0.0, now - self._starting_since))
            self._ready_since = now
        elif status.state != "ready":
            self._ready_since = None
        self._last_state = status.state

    def on_incident(self, incident: dict[str, Any], bundle_path: str | None) -> None:
        """Observer hook: incidents by cause, last-incident time, hang detections."""
        cause = str(incident.get("cause") or "unknown")
        self.incidents.labels(cause=cause).inc()
        self.last_incident.set(self.clock())
        if cause in ("engine-hang",):
            self.hangs.inc()

    def on_event(self, event: Event) -> None:
        """Observer hook: count classified kernel records by signature and PCI device."""
        if event.source != "kernel" or not event.signature:
            return
        device = ""
        for key in _DEVICE_KEYS:
            value = event.extra.get(key)
            if value:
                device = str(value)
                break
        self.kernel_events.labels(kind=event.signature, device=device).inc()
