"""The supervisor's own Prometheus metrics (prometheus-client), served with the health probes on
`metrics.listen` (default `127.0.0.1:9400`; `/metrics`, `/livez`, `/readyz`, `/startupz`: see
`xpu_serve.integrations.probes`).

Families (all prefixed `xpu_serve_`; no `_created` series):
- `state{state}` 1 for the current state, 0 for the others (state set, STATES);
- `startup_phase{phase}` 1 for the start-up phase in progress (`sources.startup.PHASES`; `ready`
  once ready; the last start-up's phase in other states), 0 for the others;
- `build_info{version}` 1;
- `incarnation`, `restarts_total`, `last_incident_timestamp_seconds`;
- `incidents_total{cause}`: every cause of `signatures.CAUSES` from 0;
- `ready_timestamp_seconds`: Unix time the current incarnation became ready (0 when not ready);
- `supervisor_start_time_seconds`;
- `time_to_ready_seconds` histogram (incarnation start -> ready);
- `kernel_events_total{kind,device}`: classified kernel records (signature id, PCI device or "");
- `hang_detections_total`;
- `webhook_failures_total`: incident posts that failed (timeout, refused, non-2xx);
- `process_*`: the supervisor process's CPU, memory, open files (prometheus-client's ProcessCollector).
"""

from __future__ import annotations

import time
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

from xpu_serve import __version__
from xpu_serve.events import Event
from xpu_serve.incarnation import Status
from xpu_serve.integrations import probes as probes_mod
from xpu_serve.signatures import CAUSES
from xpu_serve.sources.startup import PHASES

# `_created` series double every counter's series and say nothing a dashboard uses.
prometheus_client.disable_created_metrics()

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
        self.ready_ts = Gauge(
            "xpu_serve_ready_timestamp_seconds", "Unix time the current incarnation became ready (0: not ready)",
            registry=r,
        )
        self.phase = Gauge("xpu_serve_startup_phase", "Start-up phase in progress (1 for the current one)",
                           ["phase"], registry=r)
        Info("xpu_serve_build", "xpu-serve build", registry=r).info({"version": __version__})
        self.webhook_failures = Counter("xpu_serve_webhook_failures", "Incident webhook posts that failed",
                                        registry=r)
        ProcessCollector(registry=r)
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
        for c in CAUSES:
            self.incidents.labels(cause=c)
        self._last_phase = PHASES[0]
        for ph in PHASES:
            self.phase.labels(phase=ph).set_function(self._phase_is(ph))
        self._ready_since: float | None = None
        self._starting_since: float | None = None
        self._last_state: str | None = None
        self._restarts_seen = 0
        self.ready_ts.set_function(lambda: self._ready_since or 0.0)
        self.probes = probes_mod.Probes()
        self.port: int | None = None

    def attach(self, watchers: list[Any]) -> None:
        """Read the hang watchdog (`suspected()`, for /readyz) and the start-up watcher (`phase()`)
        among `watchers`, by their `name` ("hang", "startup-stall")."""
        for w in watchers:
            name = getattr(w, "name", None)
            if name == "hang" and callable(getattr(w, "suspected", None)):
                self.probes.hang = w.suspected
            elif name == "startup-stall" and callable(getattr(w, "phase", None)):
                self._phase_of = w.phase

    _phase_of: Any = None

    def _phase_is(self, phase: str) -> Any:
        return lambda: 1.0 if self._current_phase() == phase else 0.0

    def _current_phase(self) -> str:
        """The phase reported: the watcher's while starting, `ready` while ready, else the last one."""
        if self._last_state == "ready":
            self._last_phase = "ready"
        elif self._last_state == "starting" and self._phase_of is not None:
            ph = self._phase_of()
            if ph in PHASES:
                self._last_phase = ph
        return self._last_phase

    def start(self, listen: str) -> int:
        """Serve /metrics and the probes on `listen` ("HOST:PORT") and start the loop heartbeat
        (when called on the supervisor's loop); returns the bound port. Raises OSError/ValueError."""
        host, port = parse_listen(listen)
        self.server = probes_mod.serve(host, port, self.registry, self.probes)
        self.probes.start_heartbeat()
        self.port = int(self.server.server_address[1])
        return self.port

    def on_state(self, status: Status) -> None:
        """Observer hook: state gauge, incarnation, restarts, time-to-ready, ready time, probes."""
        self.probes.on_state(status)
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
            self._last_phase = PHASES[0]
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
