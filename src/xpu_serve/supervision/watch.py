"""The built-in detectors, each a `Watcher` (`xpu_serve.incarnation`: `name`, `run(ctx)` for the
life of one incarnation, `ctx.fail(trigger)` on a failure, `ctx.record(event)` for evidence):

- `LineWatcher`: every line of the engine's output, from the log pump, to the plugged-in
  watchers' `on_line` hooks (on the pump's thread), the engine (ownership, pid -> rank) and the
  Analyzer; a line the Analyzer calls fatal fails the incarnation ("fatal-line");
- `ReadinessWatcher`: starting -> ready (`/health` 200 and `/v1/models` listing the served
  model), then `/health` every `supervision.health.interval_s` ("health" after N failures);
- `StartupTimeoutWatcher`: not ready after `supervision.startup.timeout_s` ("startup-timeout");
- `StallWatcher`: no line for `supervision.startup.stall_s` while starting ("startup-stall"),
  used when the plugged-in watchers could not be built (`watchers.StartupWatcher` names the
  phase otherwise).

Process exits are `exits.ExitWatcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from xpu_serve import facts
from xpu_serve.config import Config
from xpu_serve.events import Event
from xpu_serve.incarnation import Trigger, Watcher
from xpu_serve.sources import health as health_src
from xpu_serve.sources.http_get import KeepAliveGet
from xpu_serve.supervision.context import Incarnation
from xpu_serve.supervision.eventlog import EventLog


def is_fatal(analyzer: Any, ev: Any) -> bool:
    """Is this classified line one on which the incarnation is dead? The signature table says so
    (`fatal: true` rows of data/signatures.yaml, through `diagnosis.Analyzer.is_fatal(event)`)."""
    if ev is None or not getattr(ev, "signature", None):
        return False
    fn = getattr(analyzer, "is_fatal", None)
    return bool(fn(ev)) if callable(fn) else False


def kernel_watcher(watchers: list[Any]) -> Any:
    """The kernel log watcher among the plugged-in watchers (by what it can do: `source_status`
    and `restart_blocker`, `watchers.KernelWatcher`), or None."""
    for w in watchers:
        if callable(getattr(w, "source_status", None)) and callable(getattr(w, "restart_blocker", None)):
            return w
    return None


def wake_all(watchers: list[Any]) -> None:
    """Call `wake()` of every watcher that has one (SIGUSR1: the bundle-request watcher scans
    its folder once); a watcher's error is ignored."""
    for w in watchers:
        fn = getattr(w, "wake", None)
        if callable(fn):
            with contextlib.suppress(Exception):
                fn()


async def until_failed(ctx: Incarnation, aw: Awaitable[None]) -> None:
    """Run `aw` until it returns or the incarnation failed (it is then cancelled); its exception
    propagates."""
    task = asyncio.ensure_future(aw)
    failed = asyncio.ensure_future(ctx.failed.wait())
    try:
        await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
    finally:
        for t in (task, failed):
            t.cancel()
        await asyncio.gather(task, failed, return_exceptions=True)


class WatcherTasks:
    """The watcher tasks of the current incarnation: they outlive the trigger (evidence that
    arrives while capturing is still recorded) and are cancelled just before the stop. A
    watcher that raises is one `warning` event; supervision goes on."""

    def __init__(self, log: EventLog):
        self.log = log
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, ctx: Incarnation, watchers: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(w, ctx)) for w in watchers]

    async def _run(self, w: Watcher, ctx: Incarnation) -> None:
        try:
            await w.run(ctx)
        except asyncio.CancelledError:
            raise
        except Exception as ex:
            self.log.emit(
                "warning", f"watcher {getattr(w, 'name', type(w).__name__)} failed: {type(ex).__name__}: {ex}"
            )

    async def cancel(self) -> None:
        """Cancel the tasks and wait for them (idempotent)."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class LineWatcher:
    """Routes the log pump's lines; fails the incarnation on a fatal line.

    `from_pump(line, lineno)` runs on the pump's writer thread: the `hooks` (the plugged-in
    watchers' `on_line(line, file, lineno)`, cheap and thread-safe) see the line there; it is
    queued for the loop, woken once per batch (not per line). On the loop (`drain`), each line
    goes to `engine_line(ctx, line)` and the Analyzer (`feed_line`); `progress` (monotonic s) is
    the time of the last line. `run(ctx)` binds the current incarnation.
    """

    name = "fatal-line"

    def __init__(
        self, hooks: list[Callable[[str, str, int], None]], engine_line: Callable[[Incarnation, str], None]
    ):
        self.hooks, self._engine_line = hooks, engine_line
        self.progress = time.monotonic()
        self.ctx: Incarnation | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._q: deque[tuple[str, int]] = deque()
        self._scheduled = False
        self._file = ""

    def bind(self, ctx: Incarnation) -> None:
        """Route the lines of `ctx` from now on; called before its launch."""
        self.ctx, self._loop, self._file = ctx, asyncio.get_running_loop(), ""
        self.progress = time.monotonic()

    async def run(self, ctx: Incarnation) -> None:
        self.drain()
        await asyncio.Event().wait()

    def from_pump(self, line: str, lineno: int) -> None:
        if not self._file and self.ctx is not None and self.ctx.pump is not None:
            self._file = str(self.ctx.pump.log_path)
        for hook in self.hooks:
            try:
                hook(line, self._file, lineno)
            except Exception:  # a watcher's bug must not cost the pump its lines
                pass
        self._q.append((line, lineno))
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # loop closed at exit
                self._loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        """Hand every queued line on (the loop's thread)."""
        self._scheduled = False
        q = self._q
        while q:
            line, lineno = q.popleft()
            self._on_line(line, self._file, lineno)

    def _on_line(self, line: str, file: str, lineno: int) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        self.progress = time.monotonic()
        self._engine_line(ctx, line)
        an = ctx.analyzer
        if an is None:
            return
        try:
            ev = an.feed_line(line, file, lineno)
        except Exception:
            return
        if ctx.trigger is None and is_fatal(an, ev):
            ctx.fail(
                Trigger(
                    kind="fatal-line",
                    detail=line.strip()[:300],
                    at=time.time(),
                    process=getattr(ev, "process", None),
                    rank=getattr(ev, "rank", None),
                    pid=getattr(ev, "pid", None),
                    event=ev,
                )
            )


class ReadinessWatcher:
    """starting -> ready, then `/health` failure counting (`sources.health`), until the
    incarnation fails. `on_ready(ctx, url)` is the supervisor's; `last_probe` the last
    readiness probe's detail ("connection refused", "/v1/models does not list ...").

    In a multi-node group `gate(ctx)` (`group.watcher.GroupWatcher.ready_gate`) is awaited before
    `on_ready`: every node joined. A follower (`vllm serve --headless`: no API server) has no
    probe: it is ready when the gate opens, and its health is the group's."""

    name = "health"

    def __init__(self, config: Config, on_ready: Callable[[Incarnation, str], None]):
        self.config, self._on_ready = config, on_ready
        self.last_probe = "no probe yet"
        self.gate: Callable[[Incarnation], Awaitable[None]] | None = None

    async def run(self, ctx: Incarnation) -> None:
        await until_failed(ctx, self._watch(ctx))

    async def _watch(self, ctx: Incarnation) -> None:
        e, sv = self.config.engine, self.config.supervision
        url = health_src.base_url(e.host, e.port)
        served = e.served_model_name or e.model
        poll = min(0.25, sv.health.interval_s)
        self.last_probe = "no probe yet"
        g = self.config.group
        if g is not None and g.role == "follower":
            self.last_probe = f"waiting for the group's head {g.head_url} to be ready"
            if self.gate is not None:
                await self.gate(ctx)
            self._on_ready(ctx, g.head_url)
            await asyncio.Event().wait()
        getter = KeepAliveGet(
            health_src.probe_address(e.host), e.port, sv.health.timeout_s, health_src.auth_headers(e.api_key)
        )
        try:
            while True:
                ok, self.last_probe = await health_src.probe_ready(getter, served)
                if ok:
                    break
                await asyncio.sleep(poll)
            if self.gate is not None:
                self.last_probe = "waiting for every node of the group to join"
                await self.gate(ctx)
            self._on_ready(ctx, url)
            mon = health_src.HealthMonitor(
                getter, sv.health.interval_s, sv.health.failures, on_failure=lambda n, d: _health_failed(ctx, n, d)
            )
            await mon.run()
        finally:
            getter.close()


def _health_failed(ctx: Incarnation, n: int, detail: str) -> None:
    ev = facts.health_failed(n, detail)
    ctx.record(ev)
    ctx.fail(Trigger(kind="health", detail=ev.text, at=time.time(), event=ev))


async def _while_starting(ctx: Incarnation, config: Config, check: Callable[[], Trigger | None]) -> None:
    """Until `ctx` is ready or failed, every min(0.25 s, `supervision.health.interval_s`): fail
    it with the trigger `check()` returns, if any."""
    poll = min(0.25, config.supervision.health.interval_s)
    while ctx.ready_at is None and ctx.trigger is None:
        trig = check()
        if trig is not None:
            ctx.fail(trig)
            return
        await asyncio.sleep(poll)


class StartupTimeoutWatcher:
    """Fails an incarnation not ready `supervision.startup.timeout_s` after its launch; the
    detail quotes the last readiness probe (`last_probe()`)."""

    name = "startup-timeout"

    def __init__(self, config: Config, last_probe: Callable[[], str]):
        self.config, self._last_probe = config, last_probe

    async def run(self, ctx: Incarnation) -> None:
        timeout_s = self.config.supervision.startup.timeout_s
        t0 = time.monotonic()

        def check() -> Trigger | None:
            if time.monotonic() - t0 <= timeout_s:
                return None
            detail = f"not ready after {timeout_s:g} s (last probe: {self._last_probe()})"
            return Trigger(kind="startup-timeout", at=time.time(), detail=detail)

        await _while_starting(ctx, self.config, check)


class StallWatcher:
    """Fails a start-up without a new line for `supervision.startup.stall_s` (`progress()`:
    monotonic s of the last line); records `facts.startup_stall` (phase unknown)."""

    name = "startup-stall"

    def __init__(self, config: Config, progress: Callable[[], float]):
        self.config, self._progress = config, progress

    async def run(self, ctx: Incarnation) -> None:
        def check() -> Trigger | None:
            stalled = time.monotonic() - self._progress()
            if stalled <= self.config.supervision.startup.stall_s:
                return None
            ev: Event = facts.startup_stall(stalled, "unknown", [])
            ctx.record(ev)
            detail = f"no start-up progress for {stalled:.1f} s"
            return Trigger(kind="startup-stall", at=time.time(), event=ev, detail=detail)

        await _while_starting(ctx, self.config, check)
