"""Process exits: the watcher that fails an incarnation when one of its vLLM processes dies.

Each discovered process is watched with a pidfd (`sources.processes.ExitWatch`; exit statuses
from waitpid for our child, the kernel's proc connector or the zombie for the others). Exits
come in bursts when the tree tears itself down (a kill -9 of the API server: its children exit 0
right after, reported in any order), so the first exit opens a window of EXIT_WINDOW_S: the
window decides *when* the incarnation fails, and the trigger names the burst's first abnormal
death (`exit_rank`); who the root cause is, the analysis decides from the exits it is fed
(`facts.process_exit`). Another trigger (a consequence line such as "Worker ... died
unexpectedly" can be read before the API server's death is reported) is held while an exit is
pending or under way (PF_EXITING), and used only when no exit is reported within the window.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from xpu_serve import facts, procfs
from xpu_serve.events import Event
from xpu_serve.incarnation import Trigger
from xpu_serve.sources import processes as proc_src
from xpu_serve.supervision.context import Incarnation
from xpu_serve.supervision.engine import Engine
from xpu_serve.supervision.eventlog import EventLog

# When several watched processes exit within this many seconds, the trigger names the one that
# died first with an abnormal status (signal or non-zero code), not a clean teardown exit.
EXIT_WINDOW_S = 0.15
# The event loop notes the time every TICK_S; a gap over LOOP_STALL_S (the supervisor SIGSTOPped or
# starved of CPU) makes a process exit seen at its end only "no later than" then (`LoopClock.stall`).
TICK_S = 0.25
LOOP_STALL_S = 1.0
NO_CONNECTOR_NOTICE = (
    "exit statuses of EngineCore and workers: from /proc only (the kernel's proc connector "
    "is not available here: a container, or CAP_NET_ADMIN on kernels before 6.6); "
    "a status may be reported as unknown"
)
# Deaths no process inflicts on itself in reaction to a peer's death: a fault (the CPU's or
# the driver's) or a kill from outside (the OOM killer, an operator). SIGABRT, SIGTERM and exit
# codes are how oneCCL, NCCL and vLLM's executor react to a dead peer.
_PRIMARY_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGKILL"})


class LoopClock:
    """How long the supervisor's event loop had not run: `run()` notes the time every TICK_S."""

    def __init__(self) -> None:
        self._last_tick = time.time()  # epoch s
        self._last_gap: tuple[float, float] = (0.0, 0.0)  # the last gap over LOOP_STALL_S: (from, to)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.time()
            if now - self._last_tick > LOOP_STALL_S:
                self._last_gap = (self._last_tick, now)
            self._last_tick = now

    def stall(self, seen: float) -> float | None:
        """Seconds the event loop had not run just before `seen` (epoch s), when over LOOP_STALL_S:
        the current gap, or one the ticker closed at most 2 ticks before `seen`; else None."""
        if seen - self._last_tick > LOOP_STALL_S:
            return seen - self._last_tick
        start, end = self._last_gap
        if end and 0 <= seen - end <= 2 * TICK_S + 0.05:
            return end - start
        return None


class ExitWatcher:
    """The `Watcher` of process exits of the current incarnation.

    Args:
        engine: the Engine (our child's status from waitpid); log: the EventLog (`detected`).
        record: evidence for the analysis (`facts.process_exit` of every exit).
        accept: fail the incarnation with this trigger (the supervisor's; first one wins).
        live: true while an exit is a failure (states starting and ready).

    `start(ctx)` watches the API server from its launch; `watch(pid)` each process discovery
    finds; `run(ctx)` holds the watch until cancelled (just before the tree is stopped).
    `serve()` runs for the supervisor's life (the loop clock, the proc connector's drain).
    """

    name = "process-exits"

    def __init__(
        self,
        engine: Engine,
        log: EventLog,
        record: Callable[[Event], None],
        accept: Callable[[Trigger], None],
        live: Callable[[], bool],
    ):
        self.engine, self.log, self._record, self._accept, self._live = engine, log, record, accept, live
        self.clock = LoopClock()
        self.connector: proc_src.ProcConnector | None = None  # `open()`
        self.ctx: Incarnation | None = None
        self._watch: proc_src.ExitWatch | None = None
        self._reset()

    def _reset(self) -> None:
        # process exits seen within EXIT_WINDOW_S of the first one, before the trigger is chosen
        self._pending: list[Trigger] = []
        self._announced = False  # this burst's `detected` event was emitted
        self._timer: asyncio.TimerHandle | None = None
        self._held: Trigger | None = None  # another trigger, held while exits are under way
        self._window_end = 0.0  # monotonic s: the window may be extended up to this
        # pid -> epoch s: watched processes already dying (PF_EXITING or gone) when the first exit
        # of the burst was reported; their death began no later than that
        self._dying_at: dict[int, float] = {}

    # ---- lifetime ----------------------------------------------------------------------------

    def open(self) -> None:
        """Subscribe to the kernel's proc connector when allowed (env XPU_SERVE_PROC_CONNECTOR=0:
        never); without it EngineCore's and the workers' statuses come from /proc."""
        if os.environ.get("XPU_SERVE_PROC_CONNECTOR") != "0":
            self.connector = proc_src.ProcConnector.open()
        if self.connector is not None:
            # Drained lazily (each exit report drains it) plus once a second so the socket buffer
            # never overflows: waking the loop for every process exit on a busy host costs more.
            self.connector.interest = set()

    async def serve(self) -> None:
        """For the supervisor's life: the loop clock and the proc connector's periodic drain."""
        tasks = [asyncio.ensure_future(self.clock.run())]
        if self.connector is not None:
            tasks.append(asyncio.ensure_future(_drain_every(self.connector, 1.0)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def start(self, ctx: Incarnation) -> None:
        """Watch incarnation `ctx`, starting with its API server (our child: waitpid's status)."""
        self.close()
        self.ctx = ctx
        self._watch = proc_src.ExitWatch(
            asyncio.get_running_loop(), self._on_exit, connector=self.connector, on_gone=self._on_gone
        )
        popen = self.engine.popen
        if popen is not None:
            self._watch.watch(popen.pid, status=lambda: proc_src.returncode_status(popen.poll()))

    def watch(self, pid: int) -> None:
        if self._watch is not None:
            self._watch.watch(pid)

    def pids(self) -> set[int]:
        """The pids watched whose exit was not reported yet (the PID-1 reaper leaves them)."""
        return set(self._watch.pids) if self._watch is not None else set()

    async def run(self, ctx: Incarnation) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.close()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._timer is not None:
            self._timer.cancel()
        self._reset()

    def shutdown(self) -> None:
        self.close()
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    # ---- exits -------------------------------------------------------------------------------

    def _on_exit(self, pid: int, code: int | None, sig: str | None, at: float) -> None:
        ctx = self.ctx
        info = ctx.processes.get(pid) if ctx is not None else None
        if ctx is None or info is None or pid in ctx.exited:  # (the API server may be reported twice)
            return
        info.exit_code, info.signal = code, sig
        seen = at
        died = self._watch.died_at.pop(pid, None) if self._watch is not None else None
        at = died if died is not None else seen
        ctx.exited[pid] = at
        self._record(facts.process_exit(info.name, pid, info.rank, code, sig, at))
        how = (
            f"killed by {sig}" if sig else f"exit code {code}" if code is not None else "exit status unknown"
        )
        trig = Trigger(
            kind="process-exit",
            detail=f"{info.name} (pid {pid}) died: {how}",
            at=at,
            process=info.name,
            rank=info.rank,
            pid=pid,
            exit_code=code,
            signal=sig,
            detected_at=seen,
            at_source="kernel" if died is not None else "detection",
            loop_stall_s=self.clock.stall(seen),
        )
        if ctx.trigger is not None or not self._live():
            return
        if not self._pending and not self._announced:
            # the failure is known now; naming the first death may take the exit window below
            self._announce(ctx, trig.detail, pid, at)
        if pid in self._dying_at:
            trig.at = min(trig.at, self._dying_at[pid])
        self._pending.append(trig)
        self._open_window(ctx, min(at, time.time()))
        # An abnormal death (a signal, a non-zero code) reported while no other watched process
        # is dying is the first death: decide now, so detection keeps its milliseconds (the
        # window only matters for teardown bursts, whose first report may be a clean exit 0).
        abnormal = sig is not None or (code is not None and code != 0)
        deferred = self._watch is not None and bool(self._watch.deferred)
        if (
            abnormal
            and len(self._pending) == 1
            and not deferred
            and all(p in ctx.exited for p in self._dying_at)
        ):
            self._commit()

    def _announce(self, ctx: Incarnation, detail: str, pid: int, at: float) -> None:
        """The `detected` event: the first death of a burst is known (once per burst)."""
        self._announced = True
        self.log.emit(
            "detected",
            f"incarnation {ctx.incarnation}: {detail}",
            incarnation=ctx.incarnation,
            pid=pid,
            detect_ms=round((time.time() - at) * 1000, 3),
        )

    def _on_gone(self, pid: int, at: float) -> None:
        """ExitWatch: `pid` died at `at` (epoch s); its exit status is still on its way."""
        ctx = self.ctx
        info = ctx.processes.get(pid) if ctx is not None else None
        if ctx is None or info is None or pid in ctx.exited or self._announced:
            return
        if ctx.trigger is None and self._live() and not self._pending:
            self._announce(ctx, f"{info.name} (pid {pid}) died", pid, at)

    def _open_window(self, ctx: Incarnation, first: float) -> None:
        """Start the exit window (once per burst). A watched process whose exit the kernel is
        still carrying out (a SIGKILLed API server unmapping its memory while its children already
        saw their pipes close and exited) died no later than `first` (epoch s)."""
        if self._timer is not None:
            return
        for other in ctx.processes:
            if other not in ctx.exited and exiting(other):
                self._dying_at.setdefault(other, first)
        self._window_end = time.monotonic() + EXIT_WINDOW_S + 1.0
        self._timer = asyncio.get_running_loop().call_later(EXIT_WINDOW_S, self._commit)

    def _commit(self) -> None:
        """End of the exit window: fail the incarnation with the best-ranked exit (`exit_rank`),
        else with the other trigger held while exits were under way."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._child_died()
        ctx = self.ctx
        waiting = [p for p in self._dying_at if ctx is None or p not in ctx.exited]
        if self._watch is not None:
            waiting += self._watch.deferred  # dead, status still on its way (ExitWatch)
        if waiting and time.monotonic() < self._window_end:
            # wait (at most 1 s more) for the exits already under way to be reported
            self._timer = asyncio.get_running_loop().call_later(0.05, self._commit)
            return
        pending, self._pending = self._pending, []
        self._announced = False
        held, self._held = self._held, None
        if pending:
            self._accept(min(pending, key=exit_rank))
        elif held is not None:
            self._accept(held)

    def _child_died(self) -> None:
        """Our direct child (the API server) was killed by a signal but its exit is not reported
        yet (waitpid, via Popen.poll, knows): report it now."""
        ctx = self.ctx
        if ctx is None or ctx.pgid is None or ctx.pgid in ctx.exited:
            return
        got = self.engine.child_status(ctx)
        if got is not None:
            self._on_exit(ctx.pgid, got[0], got[1], time.time())

    def hold(self, ctx: Incarnation, trigger: Trigger) -> bool:
        """A trigger other than a process exit fired: True when it is held because exits are
        pending or under way (used at the window's end if no exit is reported), False when it
        can fail the incarnation now."""
        if ctx is not self.ctx:  # (not launched: nothing of it is watched)
            return False
        self._child_died()
        if self._pending or self._timer is not None:
            if self._held is None:
                self._held = trigger
            return True
        if any(p not in ctx.exited and exiting(p) for p in ctx.processes):
            self._held = trigger
            self._open_window(ctx, min(trigger.at, time.time()))
            return True
        return False


def exiting(pid: int) -> bool:
    """True when `pid` is gone, a zombie, or exiting: PF_EXITING (0x4, include/linux/sched.h,
    set by exit_signals() at the start of do_exit) in the flags field (9) of /proc/PID/stat."""
    fields = procfs.stat_fields(pid)
    if fields is None:
        return True
    try:
        return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & 0x4)
    except (IndexError, ValueError):
        return False


def exit_rank(t: Trigger) -> tuple[int, float, int]:
    """Sort key of process-exit triggers in one burst: abnormal deaths (a signal or a non-zero
    code) first, then unknown statuses, then clean exits (code 0: the teardown); earliest first.
    Deaths dated alike (a process still exiting when a peer's exit was reported is dated at that
    report, `_open_window`: which of the two began dying first is unknown) rank a fault or an
    outside kill before an abort or exit code, the usual reaction to the peer's death (a worker
    SIGKILLed while its slow exit let EngineCore abort the others first)."""
    if t.signal or (t.exit_code is not None and t.exit_code != 0):
        grade = 0
    elif t.exit_code is None:
        grade = 1
    else:
        grade = 2
    return grade, t.at, 0 if t.signal in _PRIMARY_SIGNALS else 1


async def _drain_every(conn: proc_src.ProcConnector, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        conn.drain()
