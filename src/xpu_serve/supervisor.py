"""The supervisor: a loop over the states of docs/supervision.md that starts, watches and
restarts `vllm serve`.

    starting -> ready -> failed -> capturing -> stopping -> backoff -> starting ...
    any -> stopping -> stopped            (SIGTERM / SIGINT / `xpu-serve stop`: exit 0)
    any -> stopping -> starting           (SIGHUP: planned restart, no backoff)
    failed/capturing/stopping -> gave-up  (crash loop: exit GAVE_UP; unfixable: GAVE_UP_AT_ONCE)

Each state's work is one call into a collaborator (`xpu_serve.supervision`): `Engine` (launch,
discovery, stop and sweep, port), the watchers (every detector is a `Watcher`: process exits,
readiness and /health, fatal lines, the start-up timeout, and the plugged-in ones), `Capture`
(settle, flush, analyse, bundle), the restart policy, `StateFile` and the observers. State
changes go to RUNTIME/state.json and every observer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, cast

from xpu_serve import exitcodes, output, procfs
from xpu_serve.config import Config
from xpu_serve.events import Event
from xpu_serve.incarnation import Observer, Status, Trigger, Watcher, tell
from xpu_serve.redact import Redactor, secrets_in_env, secrets_in_mapping
from xpu_serve.restart_policy import RestartPolicy
from xpu_serve.state import EVENTS_FILE, RuntimeLock
from xpu_serve.supervision import backoff
from xpu_serve.supervision.capture import Capture, Captured, fallback_cause, recover_pending, trigger_fact
from xpu_serve.supervision.context import Incarnation, new_incarnation
from xpu_serve.supervision.engine import Engine
from xpu_serve.supervision.eventlog import EventLog
from xpu_serve.supervision.exits import NO_CONNECTOR_NOTICE, ExitWatcher
from xpu_serve.supervision.requests import Requests
from xpu_serve.supervision.signals import STRAY_SIGNALS, Signals, ignore_from_now_on
from xpu_serve.supervision.statefile import StateFile, state_data
from xpu_serve.supervision.watch import (
    LineWatcher,
    ReadinessWatcher,
    StallWatcher,
    StartupTimeoutWatcher,
    WatcherTasks,
    kernel_watcher,
    wake_all,
)

__all__ = ["STRAY_SIGNALS", "EventLog", "Supervisor", "run_supervisor"]

class Supervisor:
    """Runs the state loop until stopped or given up; `await run()` returns the exit code.

    Args:
        config: the validated Config.
        runtime_dir: RUNTIME (state.json, lock, logs/, bundles/); created if missing.
        log: the supervisor's EventLog (default: text on stderr + RUNTIME/events.jsonl).
        watchers, observers: default `plugins.watchers_for(config)` / `observers_for(config)`.
        echo: echo the engine's output tagged with the incarnation on stdout.
        engine_umask: the umask the engine is started with (`up` runs the supervisor under 077
            and passes the operator's); None: the supervisor's own.

    Secrets (`xpu_serve.redact`: secret-looking keys of the config, environment, engine argv and
    variables) are `***` in every event, log and echo. Files it creates are 0600, folders 0700.
    """

    def __init__(
        self,
        config: Config,
        runtime_dir: Path,
        log: EventLog | None = None,
        watchers: list[Watcher] | None = None,
        observers: list[Observer] | None = None,
        echo: bool = True,
        engine_umask: int | None = None,
    ):
        self.config = config
        self.runtime_dir = Path(runtime_dir)
        self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log = log or EventLog(jsonl_path=self.runtime_dir / EVENTS_FILE)
        self.redactor = Redactor(
            secrets_in_mapping(config.model_dump(mode="json")) + secrets_in_env(os.environ)
        )
        self.log.redact = self.redactor.mapping
        echo_out = cast(TextIO, output.writer(1)) if echo else None
        self.log.watch_output(echo_out)
        # built in run(), once the lock is held (observers may bind a port: metrics)
        self._plugins_given = (watchers, observers)
        self.watchers: list[Watcher] = watchers or []
        self.observers: list[Observer] = observers or []
        self.run_id = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.state = "starting"
        self.incarnation = self.restarts = self.failures = 0
        self.last_incident: dict[str, Any] | None = None
        self.next_restart_at: float | None = None
        self.reason: str | None = None
        self.time_to_ready_s: float | None = None
        self.ctx: Incarnation | None = None
        self.group: Any = None  # the multi-node group's member (`group.watcher`), set in run()
        self.policy = RestartPolicy(config.supervision.restart)
        self.asked = Requests()
        self._lock = RuntimeLock(self.runtime_dir)
        self._create_time = procfs.start_time(os.getpid())  # proves our pid (live_supervisor)
        self._wire(echo_out, -1 if engine_umask is None else engine_umask)

    def _wire(self, echo_out: TextIO | None, engine_umask: int) -> None:
        """The collaborators, each with one job (`xpu_serve.supervision`)."""
        self.statefile = StateFile(self.runtime_dir, self.log, self._lock, self._state_data)
        self.signals = Signals(self.log, self.request_stop, self.request_restart, lambda: wake_all(self.watchers))
        self.engine = Engine(
            self.config,
            self.run_id,
            self.log,
            self.redactor,
            echo_out,
            engine_umask,  # (Popen: -1 = unchanged)
            protected=lambda: self.exits.pids(),
            stop_requested=lambda: self.asked.stop,
        )
        self.exits = ExitWatcher(self.engine, self.log, self._on_record, self._accept_fail, self._live)
        self.lines = LineWatcher([], self.engine.on_line)
        self.readiness = ReadinessWatcher(self.config, self._became_ready)
        # the built-in detectors; the plugged-in watchers run beside them
        self.detectors: list[Any] = [
            self.lines,
            self.readiness,
            StartupTimeoutWatcher(self.config, lambda: self.readiness.last_probe),
        ]
        self.tasks = WatcherTasks(self.log)
        self.capture = Capture(
            self.log,
            self.run_id,
            self.watchers,
            lambda: self.lines.progress,
            self.lines.drain,
            self.engine.prove_segments,
        )

    # ---- requests (signal handlers, tests) -------------------------------------------------

    def request_stop(self, kill_now: bool = False) -> None:
        """Stop the server and exit 0; `kill_now` skips the grace period (SIGKILL at once)."""
        if self.asked.stop and not kill_now:
            return
        self.asked.stop = True
        if kill_now and not self.asked.kill_now:
            self.asked.kill_now = True
            if self.ctx is not None:
                self.log.emit("kill", "second interrupt: killing the server at once")
                self.engine.kill_now(self.ctx)
        self.asked.wake.set()

    def request_restart(self) -> None:
        """Planned restart (SIGHUP): stop and start again at once, not counted as a failure."""
        self.asked.restart = True
        self.asked.wake.set()

    # ---- state -------------------------------------------------------------------------------

    def status(self) -> Status:
        """The current Status (what state.json and observers get)."""
        return Status(
            state=self.state,
            incarnation=self.incarnation,
            restarts=self.restarts,
            supervisor_pid=os.getpid(),
            processes=list(self.ctx.processes.values()) if self.ctx else [],
            last_incident=self.last_incident,
            next_restart_at=self.next_restart_at,
            reason=self.reason,
            shutting_down=self.asked.stop or self.state == "gave-up",
        )

    def _state_data(self) -> dict[str, Any]:
        return state_data(
            self.status(),
            self.ctx,
            self.config,
            run_id=self.run_id,
            supervisor_started_at=self.started_at,
            supervisor_create_time=self._create_time,
            time_to_ready_s=self.time_to_ready_s,
            failures=self.failures,
            kernel=kernel_watcher(self.watchers),
            heartbeat_s=self.statefile.heartbeat_s,
        )

    def _set_state(self, state: str, reason: str | None = None) -> None:
        self.state, self.reason = state, reason
        self.statefile.write()
        self._tell("on_state", self.status())

    def _tell(self, method: str, *args: Any) -> None:
        tell(self.observers, method, *args, warn=lambda m: self.log.emit("warning", m))

    # ---- the run -------------------------------------------------------------------------------

    async def run(self) -> int:
        """Supervise until stopped (returns exitcodes.OK) or given up (GAVE_UP, GAVE_UP_AT_ONCE).

        Raises state.LockedError when another supervisor holds the runtime directory.
        """
        self._lock.acquire()
        self.statefile.refuse_if_predecessor_lives()
        self.watchers, self.observers, ok = _plugins(self.config, *self._plugins_given, self.log)
        if not ok and not self.watchers:  # (the start-up stall is then watched without phases)
            self.detectors.append(StallWatcher(self.config, lambda: self.lines.progress))
        self.capture.watchers = self.watchers
        self.group = _group_member(self.watchers, self.log, self.readiness, self.request_stop)
        self.lines.hooks = [w.on_line for w in self.watchers if callable(getattr(w, "on_line", None))]  # type: ignore[attr-defined]
        self.exits.open()
        loop = asyncio.get_running_loop()
        # As PID 1 (a container without --init) re-parented vLLM orphans would stay zombies.
        services = [self.statefile.heartbeat(), self.exits.serve()] + (
            [self.engine.reap_every()] if os.getpid() == 1 else []
        )
        tasks = [loop.create_task(s) for s in services]
        try:
            return await self._supervise()
        finally:
            with contextlib.suppress(Exception):
                await self.capture.finished()
            await self.tasks.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.exits.shutdown()
            self._lock.release()

    async def _begin(self) -> None:
        """Say who we are, stop the previous supervisor's orphans, finish its pending bundles."""
        e = self.config.engine
        self.log.emit(
            "started",
            f"supervisor pid {os.getpid()} run {self.run_id}, runtime {self.runtime_dir}, "
            f"engine {' '.join(e.command)} {e.model} on {e.host}:{e.port}",
            run_id=self.run_id,
        )
        if self.exits.connector is None:
            self.log.emit("notice", NO_CONNECTOR_NOTICE)
        await self.engine.sweep_previous(self.runtime_dir)
        await recover_pending(self.runtime_dir, self.config, self.log, self.observers)

    # ---- the state loop (docs/supervision.md, "States") ----------------------------------------

    async def _supervise(self) -> int:
        await self._begin()
        while True:
            if self.asked.stop:
                return await self._stopped()
            refused = await self._refused()
            if refused is not None:  # gave-up at once: another program's port, a bad host
                return await self._give_up(exitcodes.GAVE_UP_AT_ONCE, refused)
            ctx = await self._starting()  # starting -> ready, until a trigger, a stop or SIGHUP
            failed = ctx.trigger is not None
            if failed and not self.asked.stop:
                captured = await self._capturing(ctx)  # failed -> capturing
                await self._stopping(ctx, captured)  # -> stopping; the bundle is finished meanwhile
                if self.asked.stop:
                    return await self._stopped()
                code = await self._backoff(ctx, captured)  # -> backoff or gave-up
                if code is not None:
                    return code
                continue
            # a failure that raced with a stop or SIGHUP is still captured
            await self._stopping(ctx, await self._capturing(ctx) if failed else None)
            if self.asked.stop:
                return await self._stopped()
            self.asked.restart = False  # SIGHUP: starting again at once
            self.restarts += 1
            self.log.emit("restart", f"SIGHUP: {self.policy.planned_restart(time.monotonic()).reason}")

    async def _refused(self) -> str | None:
        """Why no engine can be launched (an engine host that does not resolve, a port taken by
        another program: unfixable), or None."""
        bad_host = await self.engine.host_problem()
        if bad_host is not None:
            return f"engine.host: {bad_host}"
        return await self.engine.port_problem(self._lock.path)

    async def _stopped(self) -> int:
        await self.capture.finished()  # the last incident's bundle is finished before the exit
        if self.group is not None:  # a group's head: its followers hear of the stop first
            await self.group.before_exit()
        self._set_state("stopped")
        self.log.emit("stopped", "server stopped; exit 0")
        return exitcodes.OK

    async def _give_up(self, code: int, reason: str) -> int:
        await self.capture.finished()
        self.next_restart_at = None
        self._set_state("gave-up", reason)
        self.log.emit("gave-up", reason, exit_code=code)
        return code

    # ---- starting, ready -----------------------------------------------------------------------

    async def _starting(self) -> Incarnation:
        """Launch incarnation N and run its watchers until a trigger fires, a stop or a planned
        restart is requested. On a failure the watchers keep running through `capturing` (a
        kernel record written just after the process died is still recorded; their ctx.fail()
        calls are ignored); `_stopping` cancels them."""
        self.incarnation += 1
        log_dir = await self.engine.prepare_log_dir(self.runtime_dir, self.incarnation)
        ctx = self.ctx = new_incarnation(
            self.incarnation, self.config, self.run_id, log_dir, self.restarts, self._on_fail, self._on_record, self.log
        )
        self.asked.rearm()  # a request that raced with the launch wakes the wait at once
        self._set_state("starting")
        self.lines.bind(ctx)
        if self.group is not None:  # a group's follower launches after its head, in its epoch
            joined = await self.group.before_launch(lambda: self.asked.pending)
            self.log.emit("group", f"incarnation {ctx.incarnation}: {joined}", epoch=self.group.epoch)
            ctx.group_epoch = self.group.epoch
            if self.asked.pending:
                return ctx  # stopped or restarted while waiting for the head: nothing launched
        if not self.engine.launch(ctx, self.lines.from_pump):
            return ctx
        self.statefile.write()
        self.log.emit(
            "launched",
            f"incarnation {ctx.incarnation}: engine pid {ctx.pgid}: {' '.join(self.redactor.argv(ctx.argv))}",
            incarnation=ctx.incarnation,
            pid=ctx.pgid,
        )
        self.exits.start(ctx)
        loop = asyncio.get_running_loop()
        discovery = loop.create_task(self.engine.discover(ctx, self.exits.watch, self.statefile.write))
        self.tasks.start(ctx, [self.exits, *self.detectors, *self.watchers])
        try:
            await self.asked.wake.wait()
        finally:
            discovery.cancel()
            await asyncio.gather(discovery, return_exceptions=True)
            if ctx.trigger is None:  # stop or planned restart: nothing left to capture
                await self.tasks.cancel()
        return ctx

    def _became_ready(self, ctx: Incarnation, url: str) -> None:
        """starting -> ready (`ReadinessWatcher`)."""
        if ctx is not self.ctx or ctx.trigger is not None:
            return
        ctx.ready_at = time.time()
        self.time_to_ready_s = ctx.ready_at - ctx.started_at
        self.engine.prove_segments(ctx)
        self.log.emit(
            "ready",
            f"incarnation {ctx.incarnation} ready in {self.time_to_ready_s:.2f} s at {url} "
            f"({len(ctx.processes)} processes)",
            incarnation=ctx.incarnation,
            time_to_ready_s=round(self.time_to_ready_s, 3),
        )
        self.policy.on_ready(time.monotonic())
        self._set_state("ready")

    def _live(self) -> bool:
        """A trigger is a failure only while starting or ready."""
        return self.state in ("starting", "ready")

    def _on_record(self, event: Event) -> None:
        ctx = self.ctx
        if ctx is not None:
            ctx.add_fact(event)
        tell(self.observers, "on_event", event)  # (per record: failures ignored)

    def _on_fail(self, trigger: Trigger) -> None:
        """A watcher's trigger (the first one wins). A trigger other than a process exit waits
        while exits are pending or under way (`ExitWatcher.hold`)."""
        ctx = self.ctx
        if ctx is None or ctx.trigger is not None or not self._live():
            return
        if trigger.kind == "process-exit" or not self.exits.hold(ctx, trigger):
            self._accept_fail(trigger)

    def _accept_fail(self, trigger: Trigger) -> None:
        """-> failed."""
        ctx = self.ctx
        if ctx is None or ctx.trigger is not None or not self._live():
            return
        ctx.trigger = trigger
        ctx.failed.set()
        ctx.add_fact(trigger_fact(trigger))
        self.state = "failed"
        self.log.emit(
            "failed",
            f"incarnation {ctx.incarnation}: {trigger.detail} ({trigger.kind})",
            **_failed_fields(ctx, trigger),
        )
        self._set_state("failed")
        self.asked.wake.set()

    # ---- capturing, stopping, backoff --------------------------------------------------------

    async def _capturing(self, ctx: Incarnation) -> Captured:
        """Record the evidence of the incident (analysis, the bundle's live part) before anything
        is killed; the bundle's other collectors start in a thread."""
        assert ctx.trigger is not None
        self._set_state("capturing", ctx.trigger.detail)
        got = await self.capture.run(ctx, self.restarts)
        self.last_incident = got.last_incident(ctx.trigger.at)
        self.statefile.write()
        return got

    async def _stopping(self, ctx: Incarnation, got: Captured | None) -> None:
        """Stop the tree, sweep, verify, remove leftovers, wait for the port (`Engine.stop`).
        After a hang verdict, whose evidence is captured, what cannot exit gets SIGKILL early.
        Then the incident's bundle is finished in a task (`Capture.finish`) that may overlap
        the next start; `_incident` tells of it when it is written."""
        await self.tasks.cancel()
        self._set_state("stopping")
        hang = ctx.trigger is not None and fallback_cause(ctx.trigger.kind, ctx.trigger.detail) == "engine-hang"
        await self.engine.stop(ctx, self.asked.kill_now, hang, self.lines.drain)
        if got is not None:
            self.capture.finish(ctx, got, lambda done: self._incident(ctx, done))

    def _incident(self, ctx: Incarnation, got: Captured) -> None:
        """The incident's bundle is finished: state.json, the `incident` event, observers."""
        assert ctx.trigger is not None
        self.last_incident = got.last_incident(ctx.trigger.at)
        self.statefile.write()
        self.capture.announce(ctx, got)
        self._tell("on_incident", got.contract, got.bundle)

    async def _backoff(self, ctx: Incarnation, got: Captured) -> int | None:
        """The restart policy's decision: gave-up (returns the exit code) or backoff, then None."""
        cause = got.contract.get("cause", "unknown")
        assert ctx.trigger is not None
        self.failures += 1
        d, give_up = backoff.decide(self.policy, cause, ctx.trigger, got.contract.get("summary"))
        if give_up is not None:
            return await self._give_up(d.exit_code if d.exit_code is not None else exitcodes.GAVE_UP, give_up)
        self.asked.rearm()  # SIGHUP while capturing: restart now

        def show(next_restart_at: float | None, blocker: str | None) -> None:
            self.next_restart_at = next_restart_at
            self._set_state("backoff", blocker)

        forced = await backoff.run(d, cause, kernel_watcher(self.watchers), self.asked.wake, self.log, show)
        self.next_restart_at = None
        if self.asked.stop:
            return await self._stopped()
        if forced:
            self.log.emit("restart", "SIGHUP: restarting although the device check has not passed")
        self.asked.restart = False
        self.restarts += 1
        return None


def _plugins(
    config: Config, watchers: list[Watcher] | None, observers: list[Observer] | None, log: EventLog
) -> tuple[list[Watcher], list[Observer], bool]:
    """The plugged-in watchers and observers (`plugins.watchers_for`, `observers_for`) unless
    given; False when building them failed (one warning: a broken plugin must not stop
    supervision)."""
    from xpu_serve import plugins

    got_w, got_o = watchers or [], observers or []
    try:
        got_w = plugins.watchers_for(config) if watchers is None else watchers
        if observers is None:
            got_o = plugins.observers_for(config, got_w, warn=lambda m: log.emit("warning", m))
    except Exception as ex:
        log.emit("warning", f"plugins: {type(ex).__name__}: {ex}")
        return got_w, got_o, False
    return got_w, got_o, True


def _group_member(
    watchers: list[Watcher], log: EventLog, readiness: ReadinessWatcher, request_stop: Callable[[], None]
) -> Any:
    """The multi-node group's watcher (`group.watcher.GroupWatcher`: it has `before_launch`), its
    messages in the event log, readiness gated on every node of the group, a follower stopping
    with its head (`request_stop`); None without a group."""
    for w in watchers:
        if callable(getattr(w, "before_launch", None)):
            w.warn = lambda m: log.emit("group", m)  # type: ignore[attr-defined]
            readiness.gate = w.ready_gate  # type: ignore[attr-defined]
            w.request_stop = request_stop  # type: ignore[attr-defined]
            return w
    return None


def _failed_fields(ctx: Incarnation, trigger: Trigger) -> dict[str, Any]:
    """The fields of the `failed` event: the trigger, when the death happened and was seen."""
    fields: dict[str, Any] = {"incarnation": ctx.incarnation, "trigger": trigger.kind}
    fields.update(
        (k, getattr(trigger, k)) for k in ("process", "rank", "pid", "signal", "exit_code", "at", "at_source")
    )
    fields["detected_at"] = trigger.detected_at if trigger.detected_at is not None else trigger.at
    fields["loop_stall_s"] = trigger.loop_stall_s
    fields["detect_ms"] = round((time.time() - trigger.at) * 1000, 3)
    return fields


def run_supervisor(
    config: Config, runtime_dir: Path, log: EventLog, echo: bool = True, engine_umask: int | None = None
) -> int:
    """Run a Supervisor on a fresh event loop with signal handlers; returns the exit code.

    Raises state.LockedError when the runtime directory is held by another supervisor.
    """
    sup = Supervisor(config, runtime_dir, log=log, echo=echo, engine_umask=engine_umask)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        sup.signals.install(loop)  # (supervision.signals: stop, SIGHUP, SIGUSR1 bundle requests)
        try:
            return await sup.run()
        finally:
            # the server is stopped and swept: from here on a signal has nothing left to do
            ignore_from_now_on(loop)

    return asyncio.run(main())
