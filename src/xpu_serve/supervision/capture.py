"""`Capture`: the incident of a failed incarnation; its evidence recorded before anything is
killed, its bundle finished once the tree is stopped.

Before the stop (`run`): settle (a living tree's last lines, up to 1 s; none after a process
exit, whose last lines are in the pipe), flush (the log pump's queued lines), the kernel
watcher's settle for its record of a fault, other hosts' reports (a group's head), analyse (`diagnosis.Analyzer`: the analysis alone
names the root, completed with the trigger it was fed as a fact: analysis/supervised.py), and
the bundle's first step (`bundle.IncidentBundle.begin`: verdict files, /proc facts, stacks, the
kernel window); its collectors then run in a thread while the tree is stopped. After the stop
(`finish`, in a task that may overlap the next start): the verdict recomputed from the whole
log (the fallout of the death is in it), the logs and bundle.json, then the `incident` event.
A marker (`recovery`) lets the next `up` write the bundle when the supervisor is killed before
the bundle is finished.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xpu_serve import facts, recovery
from xpu_serve.analysis.supervised import fallback_cause
from xpu_serve.config import Config
from xpu_serve.events import Event
from xpu_serve.incarnation import Observer, ProcessInfo, Trigger, Watcher
from xpu_serve.sources.kernel import in_initial_pid_namespace
from xpu_serve.supervision.context import Incarnation
from xpu_serve.supervision.eventlog import EventLog
from xpu_serve.supervision.rewrite import Rewrites, cut_by_full_disk

# Signals after which the kernel usually logs a record naming the faulting library or the OOM
# kill (arch/x86/mm/fault.c show_signal_msg, arch/x86/kernel/traps.c, mm/oom_kill.c): the capture
# gives the kernel watcher a short settle for it when a process died by one (or of unknown status).
_KERNEL_RECORDED_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGKILL"})


@dataclass
class Captured:
    """What a capture produced: the verdict contract (incident.json), the Analyzer's incident
    object (None when the analysis failed) and the bundle folder (None when none was written);
    before the stop the verdict of the log so far, after `Capture.finish` of the whole log."""

    contract: dict[str, Any]
    incident: Any
    bundle: str | None
    restarts: int = 0
    job: Any = None  # the bundle being written (`bundle.IncidentBundle`)
    collecting: asyncio.Future[Any] | None = None  # its collectors, running while the tree stops

    def last_incident(self, at: float) -> dict[str, Any]:
        """state.json's `last_incident` of an incident whose trigger fired at `at` (epoch s)."""
        c = self.contract
        return {
            "cause": c.get("cause", "unknown"),
            "time": at,
            "bundle": self.bundle,
            "summary": c.get("summary"),
        }


class Capture:
    """Settle, flush, analyse, bundle: `await run(ctx, restarts)` before the stop, then
    `finish(ctx, got, done)` after it.

    Args:
        log: the EventLog; run_id: this supervisor's run.
        watchers: the plugged-in watchers (those with `settle(ctx, pids)` get their short settle).
        progress: monotonic s of the engine's last line; drain: hand the queued lines on.
        prove_segments: record the segments the tree maps now (`Engine.prove_segments`).
    """

    def __init__(
        self,
        log: EventLog,
        run_id: str,
        watchers: list[Watcher],
        progress: Callable[[], float],
        drain: Callable[[], None],
        prove_segments: Callable[[Incarnation], None],
    ):
        self.log, self.run_id, self.watchers = log, run_id, watchers
        self._progress, self._drain, self._prove = progress, drain, prove_segments
        self._finishing: list[asyncio.Task[None]] = []
        self.rewrites: Rewrites | None = None  # bundles a full disk cut, made at the first

    async def run(self, ctx: Incarnation, restarts: int) -> Captured:
        """Before the stop: settle, flush, analyse, and the bundle's first step (`IncidentBundle.
        begin`: the verdict files and what only the live tree gives); its collectors then run in
        a thread while the tree is stopped. `finish` completes it after the stop."""
        trig = ctx.trigger
        assert trig is not None
        recovery.mark_pending(ctx.log_dir, self._pending_marker(ctx, restarts))
        if trig.kind != "process-exit":
            # a dead process's last lines are in the pipe at its exit (the flush reads them); a
            # living tree may still be writing what the trigger followed
            await self._settle()
        if ctx.pump is not None:
            await asyncio.to_thread(ctx.pump.flush, 2.0)
            self._drain()
        await self._settle_kernel(ctx)
        await self._settle_reports(ctx)
        self._prove(ctx)
        got = self._verdict(ctx, trig, restarts)
        got.job = await asyncio.to_thread(self._begin_bundle, ctx, trig, got)
        got.bundle = str(got.job.run.path) if got.job.run.path else None
        loop = asyncio.get_running_loop()
        got.collecting = loop.run_in_executor(None, got.job.collect)
        return got

    def finish(self, ctx: Incarnation, got: Captured, done: Callable[[Captured], None]) -> None:
        """After the stop (the tree's log closed): the bundle's last step in a task, with the
        verdict recomputed from the whole log (the fallout of the death is in it now); then
        `done(got)`. The next incarnation may start meanwhile; `finished()` waits for it."""
        earlier = [t for t in self._finishing if not t.done()]
        task = asyncio.get_running_loop().create_task(self._finish(ctx, got, done, earlier))
        self._finishing = [*earlier, task]

    async def finished(self) -> None:
        """Wait for the bundles `finish` is writing, if any (the supervisor exits only after them).
        Bundles still waiting for room on a full disk are left to the next `up` (their markers)."""
        tasks, self._finishing = self._finishing, []
        for task in tasks:
            await asyncio.shield(task)
        if self.rewrites is not None:
            await self.rewrites.close()

    async def _finish(
        self,
        ctx: Incarnation,
        got: Captured,
        done: Callable[[Captured], None],
        earlier: list[asyncio.Task[None]],
    ) -> None:
        """`finish`'s task, after the bundles of `earlier` incidents (retention must not prune a
        bundle being written); never raises (a bug here must not stop supervision)."""
        try:
            await self._finish_bundle(ctx, got, earlier)
        except Exception as ex:
            self.log.emit("warning", f"bundle: {type(ex).__name__}: {ex}")
        try:
            done(got)
        except Exception as ex:  # (an observer's failure must not lose the incident)
            self.log.emit("warning", f"incident: {type(ex).__name__}: {ex}")

    async def _finish_bundle(
        self, ctx: Incarnation, got: Captured, earlier: list[asyncio.Task[None]]
    ) -> None:
        trig = ctx.trigger
        assert trig is not None
        if got.collecting is not None:
            await got.collecting
        for task in earlier:
            await asyncio.shield(task)
        again = self._verdict(ctx, trig, got.restarts)
        if _same_root(got.contract, again.contract):
            got.contract, got.incident = again.contract, again.incident
        else:  # a record written once the stop began is its fallout, never the root
            self.log.emit("warning", f"bundle: the verdict after the stop named another root "
                          f"({again.contract.get('cause')}); the verdict made before the stop is kept")
        if got.job is None:
            return
        text = report_text(got.incident, got.contract, ctx)
        res = await asyncio.to_thread(got.job.finish, got.contract, text)
        if res.errors and res.path is not None:  # (no folder at all: `run` said so)
            self.log.emit("warning", f"bundle incomplete: {'; '.join(str(e) for e in res.errors[:3])}")
        if cut_by_full_disk(res.errors):
            self._rewrite_later(ctx, got, res.path)
        elif res.path is not None:
            recovery.clear_pending(ctx.log_dir)

    def _rewrite_later(self, ctx: Incarnation, got: Captured, path: Path | None) -> None:
        if self.rewrites is None:
            self.rewrites = Rewrites(ctx.runtime_dir, ctx.config, self.log)
        marker = self._pending_marker(ctx, got.restarts)
        self.rewrites.add(ctx.log_dir, {**marker, "bundle": str(path)} if path is not None else marker)
        self.log.emit("warning", f"bundle of incarnation {ctx.incarnation}: the disk is full; it is written "
                      "again from the kept logs once the disk has room")

    def _verdict(self, ctx: Incarnation, trig: Trigger, restarts: int) -> Captured:
        """The analysis of everything fed so far, as the contract with the supervisor's facts."""
        incident: Any = None
        contract: dict[str, Any] = {}
        if ctx.analyzer is not None:
            try:
                incident = ctx.analyzer.incident()  # (the trigger is a fact it was fed)
                contract = dict(incident.to_contract())
                take_signal(incident, trig, ctx.processes)
            except Exception as ex:
                self.log.emit("warning", f"analysis failed: {type(ex).__name__}: {ex}")
        without_verdict(contract, trig)
        contract["supervisor"] = {
            "trigger": _trigger_fields(trig),
            "incarnation": ctx.incarnation,
            "restarts": restarts,
            "started_at": ctx.started_at,
            "ready_at": ctx.ready_at,
            "failed_at": trig.at,
            "processes": [vars(p).copy() for p in ctx.processes.values()],
            # whether the kernel prints these pids (diagnose BUNDLE's kernel ownership rule)
            "initial_pid_ns": in_initial_pid_namespace(),
        }
        return Captured(contract, incident, None, restarts=restarts)

    def _begin_bundle(self, ctx: Incarnation, trig: Trigger, got: Captured) -> Any:
        """`IncidentBundle.begin` (blocking); a problem is a warning, never the end of supervision."""
        from xpu_serve.bundle import IncidentBundle

        # the hang watchdog dumps the stacks before it fails the incarnation (event.extra["stacks"])
        stacks = trig.event.extra.get("stacks") if trig.event is not None else None
        job = IncidentBundle(
            ctx,
            trig,
            got.contract,
            report_text(got.incident, got.contract, ctx),
            stacks if isinstance(stacks, dict) else None,
            # a kill -9 from the folder's creation on: the next `up` finishes this folder
            on_open=lambda path: recovery.mark_pending(
                ctx.log_dir, {**self._pending_marker(ctx, got.restarts), "bundle": str(path)}
            ),
        )
        res = job.begin()
        if res.path is None:
            self.log.emit("warning", f"bundle incomplete: {'; '.join(str(e) for e in res.errors[:3])}")
        return job

    def announce(self, ctx: Incarnation, got: Captured) -> None:
        """The `incident` event, then the compact report (`report.render_compact`) as one
        `report` event with FILE:LINE references relative to the bundle."""
        trig = ctx.trigger
        cause = got.contract.get("cause", "unknown")
        self.log.emit(
            "incident",
            f"incarnation {ctx.incarnation}: cause {cause}: {got.contract.get('summary') or (trig.detail if trig else '')}"
            + (f"; bundle {got.bundle}" if got.bundle else ""),
            cause=cause,
            bundle=got.bundle,
        )
        if got.incident is None:
            return
        try:
            from xpu_serve.report import render_compact

            lines = render_compact(got.incident, files=_bundle_files(ctx))
        except Exception as ex:
            self.log.emit("warning", f"report failed: {type(ex).__name__}: {ex}")
            return
        head = f"incarnation {ctx.incarnation}" + (
            f"; full report {got.bundle}/report.txt" if got.bundle else ""
        )
        self.log.emit("report", "\n".join([head, *("  " + ln for ln in lines)]), lines=lines)

    async def _settle(self, quiet_s: float = 0.15, max_s: float = 1.0) -> None:
        """Let the dying tree's last lines arrive (pipes are drained by the pump)."""
        t_end = time.monotonic() + max_s
        while time.monotonic() < t_end:
            if time.monotonic() - self._progress() >= quiet_s:
                return
            await asyncio.sleep(0.05)

    async def _settle_kernel(self, ctx: Incarnation) -> None:
        """A process died by a signal the kernel logs (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGKILL for
        an OOM kill) or of unknown status: give the kernel watcher its short settle
        (`KernelWatcher.settle`, at most its `settle_s`) so the record naming the library is in
        the verdict even when the kernel log delivers it after the exit was seen."""
        died = [
            pid
            for pid, info in ctx.processes.items()
            if pid in ctx.exited
            and (info.signal in _KERNEL_RECORDED_SIGNALS or (info.signal is None and info.exit_code is None))
        ]
        if not died:
            return
        for w in self.watchers:
            fn = getattr(w, "settle", None)
            if callable(fn):
                try:
                    await fn(ctx, died)
                except Exception as ex:
                    self.log.emit("warning", f"kernel settle: {type(ex).__name__}: {ex}")

    async def _settle_reports(self, ctx: Incarnation) -> None:
        """Watchers whose evidence arrives from other hosts (`settle_reports(ctx)`: a group's head
        waits briefly for its followers' word, group/watcher.py) get it before the verdict."""
        for w in self.watchers:
            fn = getattr(w, "settle_reports", None)
            if callable(fn):
                try:
                    await fn(ctx)
                except Exception as ex:
                    self.log.emit("warning", f"reports settle: {type(ex).__name__}: {ex}")

    def _pending_marker(self, ctx: Incarnation, restarts: int) -> dict[str, Any]:
        """What the next `up` needs to write this incident's bundle after a kill -9 (`recovery`)."""
        trig = ctx.trigger
        return {
            "run_id": self.run_id,
            "supervisor_pid": os.getpid(),
            "incarnation": ctx.incarnation,
            "restarts": restarts,
            "started_at": ctx.started_at,
            "ready_at": ctx.ready_at,
            "trigger": _trigger_fields(trig) if trig is not None else None,
            "processes": [dict(vars(p), exited_at=ctx.exited.get(p.pid)) for p in ctx.processes.values()],
        }


async def recover_pending(
    runtime_dir: Path, config: Config, log: EventLog, observers: list[Observer]
) -> None:
    """Write the bundles of the incidents a killed supervisor was capturing (`recovery`), from
    their kept logs, before any log folder is moved or pruned; one `incident` event each."""
    for d in recovery.pending_dirs(runtime_dir / "logs"):
        path, contract = await asyncio.to_thread(recovery.recover_one, d, runtime_dir, config, os.getpid())
        cause = contract.get("cause", "unknown")
        log.emit(
            "incident",
            f"recovered incident of {d}: cause {cause}: {contract.get('summary') or ''}"
            + (f"; bundle {path}" if path else "; no bundle could be written (the logs are kept)")
            + " (its capture was cut by a kill -9 of the supervisor)",
            cause=cause,
            bundle=path,
            recovered=True,
        )
        for ob in observers:
            try:
                ob.on_incident(contract, path)
            except Exception:  # an observer must never break supervision
                pass


def _trigger_fields(trig: Trigger) -> dict[str, Any]:
    return {k: v for k, v in vars(trig).items() if k != "event"}


def trigger_fact(trig: Trigger) -> Event:
    """The trigger as a fact for the analysis and the facts log (`facts.trigger`)."""
    fields = {k: v for k, v in _trigger_fields(trig).items() if k not in ("kind", "detail", "at")}
    return facts.trigger(trig.kind, trig.detail, trig.at, fields)


def take_signal(incident: Any, trig: Trigger, processes: dict[int, ProcessInfo]) -> None:
    """The signal the analysis read from the trigger's process's own crash dump when the
    supervisor did not see its exit status (`Incident.trigger_signal`): set on `trig` and on
    that process's ProcessInfo (incident.json's `supervisor`)."""
    sig = getattr(incident, "trigger_signal", None)
    if not isinstance(sig, str):
        return
    trig.signal = sig
    info = processes.get(trig.pid) if trig.pid is not None else None
    if info is not None and info.signal is None and info.exit_code is None:
        info.signal = sig


def without_verdict(contract: dict[str, Any], trig: Trigger) -> None:
    """A contract without an analysis (it failed or could not be built): the trigger's cause
    and detail (`analysis.supervised.fallback_cause`)."""
    if contract.get("cause") in (None, "", "unknown"):
        contract["cause"] = fallback_cause(trig.kind, trig.detail)
        contract["summary"] = trig.detail


def _bundle_files(ctx: Any) -> Any:
    """`report.bundle_paths` of this incarnation: its log folder and the kernel log file it follows."""
    from xpu_serve.report import bundle_paths

    kcfg = ctx.config.watchers.kernel
    return bundle_paths(ctx.log_dir, kcfg.path if kcfg.source == "file" else None)


def report_text(incident: Any, contract: dict[str, Any], ctx: Any) -> str:
    """The people's report (`report.render_text(incident)`, what `diagnose` prints) with FILE:LINE
    relative to the bundle (logs/vllm.log:123), or a short fallback."""
    if incident is not None:
        try:
            from xpu_serve.report import render_text

            return render_text(incident, files=_bundle_files(ctx))
        except Exception:
            pass
    return f"cause: {contract.get('cause')}\n{contract.get('summary') or ''}\n"


def _same_root(first: dict[str, Any], again: dict[str, Any]) -> bool:
    """The recomputed verdict (`again`, after the stop) keeps the first one's cause and root
    (process, rank, pid): the fallout adds consequences, it does not move the root."""
    def key(c: dict[str, Any]) -> tuple[Any, ...]:
        r = c.get("root") or {}
        return c.get("cause"), r.get("process"), r.get("rank"), r.get("pid")

    return key(first) == key(again)
