"""Contracts between the supervisor and what plugs into it (watchers, observers, bundles).

The supervisor (`supervisor.py`, its collaborators in `supervision/`) owns the state machine; everything else talks to it only
through these types:

- a `Watcher` runs as an asyncio task for the life of one incarnation and may call
  `ctx.fail(trigger)` (a failure: the supervisor captures the incident, then stops the tree)
  or `ctx.record(event)` (evidence for the analysis, not a failure by itself);
- an `Observer` is told about every state change and every incident (systemd notify,
  Prometheus metrics, webhook);
- the bundle writer is called with the `IncarnationContext`, the `Trigger` and the verdict
  before anything is killed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from xpu_serve.events import Event


@dataclass
class Trigger:
    """Why the supervisor decided the incarnation failed.

    Attributes:
        kind: "process-exit", "health", "fatal-line", "kernel", "hang", "startup-stall",
            "startup-timeout", "operator" (a `bundle`/SIGHUP request), "config"; in a multi-node
            group (`group.watcher.GROUP_TRIGGERS`) "node-death", "node-unreachable",
            "rendezvous-stall", "group-restart", "head-lost".
        detail: one line for people, e.g. "Worker_TP0 (pid 4242) killed by SIGSEGV".
        at: wall-clock time of the failure, seconds since the epoch: for a process exit the
            kernel's exit time when known (`at_source` "kernel"), else when the supervisor saw it
            (`at_source` "detection": the death was no later than that); else the detection.
        process, rank, pid: the process it is about, when there is one.
        exit_code: the exit code, or None; signal: the signal name ("SIGSEGV") or None.
        event: the `Event` that fired it (a fatal line, a kernel record), when there is one.
        detected_at: (process exits) when the supervisor saw the exit, epoch s.
        at_source: (process exits) "kernel" (the proc connector's exit event) or "detection".
        loop_stall_s: (process exits) seconds the supervisor's event loop had not run just before
            it saw the exit (SIGSTOPped, starved), when over a second: the exit may lie anywhere
            in that gap.
    """

    kind: str
    detail: str
    at: float
    process: str | None = None
    rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    event: Event | None = None
    detected_at: float | None = None
    at_source: str | None = None
    loop_stall_s: float | None = None


@dataclass
class ProcessInfo:
    """One vLLM process of the incarnation: role name ("APIServer", "EngineCore", "Worker_TP0"),
    rank (TP rank for workers, else None), pid (in our pid namespace), start time (epoch seconds),
    and once it exited: exit_code or signal name."""

    name: str
    pid: int
    rank: int | None = None
    started_at: float | None = None
    exit_code: int | None = None
    signal: str | None = None


class IncarnationContext(Protocol):
    """What a watcher or the bundle writer can see of the live incarnation."""

    incarnation: int
    config: Any  # xpu_serve.config.Config
    runtime_dir: Any  # pathlib.Path
    started_at: float  # epoch seconds
    ready_at: float | None  # epoch seconds, None while starting
    processes: dict[int, ProcessInfo]  # pid -> info, updated as the tree is discovered

    def fail(self, trigger: Trigger) -> None:
        """Declare the incarnation failed (idempotent: the first trigger wins)."""

    def record(self, event: Event) -> None:
        """Add evidence to the live analysis (kernel records, health facts...)."""


class Watcher(Protocol):
    """A per-incarnation watch (kernel log, hang watchdog, start-up stall...)."""

    name: str

    async def run(self, ctx: IncarnationContext) -> None:
        """Watch until cancelled; call ctx.fail()/ctx.record() as things happen."""


@dataclass
class Status:
    """A snapshot of the supervisor, as written to `RUNTIME/state.json`."""

    state: str  # starting, ready, failed, capturing, stopping, backoff, gave-up, stopped
    incarnation: int
    restarts: int
    supervisor_pid: int
    processes: list[ProcessInfo] = field(default_factory=list)
    last_incident: dict[str, Any] | None = None  # {cause, time, bundle}
    next_restart_at: float | None = None
    reason: str | None = None  # e.g. why restart is delayed (wedged device), why it gave up
    # the supervisor itself is ending (stop requested, or gave up), not stopping one incarnation
    shutting_down: bool = False


class Observer(Protocol):
    """Told about state changes and incidents; must never block or raise into the supervisor.

    An observer may also define `on_event(event: Event) -> None`: the supervisor then calls it
    for every event recorded through `IncarnationContext.record()` (kernel records, hang facts),
    e.g. for the Prometheus counters of kernel events by kind and device.
    """

    def on_state(self, status: Status) -> None: ...

    def on_incident(self, incident: dict[str, Any], bundle_path: str | None) -> None: ...


def tell(observers: list[Observer], method: str, *args: Any, warn: Callable[[str], None] | None = None) -> None:
    """Call `method` of every observer that has it. An observer must never break supervision:
    a failure is `warn(message)`, or ignored without `warn` (for `on_event`, run per record)."""
    for ob in observers:
        fn = getattr(ob, method, None)
        try:
            if callable(fn):
                fn(*args)
        except Exception as ex:
            if warn is not None:
                warn(f"observer {type(ob).__name__} failed: {ex}")
