"""The watchers `up` attaches to every incarnation (see `plugins.watchers_for`).

- `KernelWatcher` ("kernel"): follows the kernel log (`sources.kernel`), records classified
  records, fails the incarnation at once on a `segfault`/`traps`/OOM-kill record of one of its
  processes (before vLLM notices), remembers GPU faults (engine reset, job timeout, page fault,
  GuC error) so a hang can be blamed on them, and holds restarts while a device is wedged
  (`restart_blocker()`, `device_ready()`).
- `HangWatcher` ("hang"): once ready, scrapes `/metrics` for progress (`sources.progress`), falls
  back to the periodic stats lines, and optionally sends a canary request while idle. On a hang:
  stacks of every live vLLM process first (py-spy), then the incident.
- `StartupWatcher` ("startup-stall"): start-up milestones per rank (`sources.startup`); no
  progress for `supervision.startup.stall_s` is a `startup-hang` naming the phase and the ranks
  that did not reach it. Its name tells the supervisor to leave stall detection to it.

Line hook: the supervisor calls `on_line(line, file, lineno)` on every watcher that has one, for
every line of the engine's output, on the log pump's writer thread (cheap, non-blocking and
thread-safe: a substring test, rarely a regex). Nothing tails vllm.log.

Failure: the watchers keep running while the supervisor captures the incident (their ctx.fail()
calls are ignored then, their ctx.record() calls still count) and are cancelled just before the
tree is stopped. The kernel watcher's `settle(ctx, pids)` lets a crash record that the kernel
prints just after the process died reach the verdict.

All three are created once per supervisor and `run(ctx)` once per incarnation; state that
belongs to an incarnation is reset at the start of `run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from xpu_serve import aio, facts, output, procfs
from xpu_serve.events import Event
from xpu_serve.incarnation import IncarnationContext, ProcessInfo, Trigger
from xpu_serve.sources import kernel as ksrc
from xpu_serve.sources import progress as prog
from xpu_serve.sources.health import probe_address
from xpu_serve.sources.http_get import KeepAliveGet
from xpu_serve.sources.kernel import GPU_DRIVERS as _GPU_DRIVERS
from xpu_serve.sources.kernel import is_gpu_fault
from xpu_serve.sources.startup import StartupTracker
from xpu_serve.supervision.rankstate import rank_states_fact, steady_states

# Causes of kernel records that mean "this process is dead now" (signature table causes).
_CRASH_CAUSES = {"umd-segfault", "process-crash", "host-oom"}
# Fallback when the record is not classified: the kernel's own wording (arch/x86/mm/fault.c
# show_signal_msg, arch/x86/kernel/traps.c do_trap/show_signal, mm/oom_kill.c).
_CRASH_WORDS = (
    ": segfault at ",
    "traps: ",
    " trap invalid opcode",
    " general protection fault",
    "Killed process ",
    "oom-kill:",
)


def _warn(msg: str) -> None:
    output.writer(2).write(f"xpu-serve: warning: {msg}\n")  # (never blocks the loop: xpu_serve.output)


def _failed(ctx: IncarnationContext) -> bool:
    """The incarnation already failed (the supervisor's context carries its first `trigger`):
    the watchers still run while it captures, but a hang or a stall declared now would only
    describe the dying tree, so those watchers stay quiet."""
    return getattr(ctx, "trigger", None) is not None


def _live(ctx: IncarnationContext) -> list[ProcessInfo]:
    return [p for p in list(ctx.processes.values()) if p.exit_code is None and p.signal is None]


def _signal_of(ev: Event) -> str | None:
    t = ev.text
    if "segfault at" in t:
        return "SIGSEGV"
    if "invalid opcode" in t:
        return "SIGILL"
    if "general protection" in t:
        return "SIGSEGV"
    if "Killed process" in t or "oom-kill:" in t:
        return "SIGKILL"
    if "divide error" in t:
        return "SIGFPE"
    return None


def is_crash_record(ev: Event) -> bool:
    """A kernel record saying a process died or was killed (segfault, trap, OOM kill)."""
    if ev.cause in _CRASH_CAUSES:
        return True
    return any(w in ev.text for w in _CRASH_WORDS)


def is_wedged(ev: Event) -> bool:
    """A record saying the device is wedged (xe: `device wedged`, i915: `wedged`)."""
    return "wedged" in ev.text.lower() and (is_gpu_fault(ev) or ev.text.startswith(_GPU_DRIVERS))


# How long after an exit a crash record read from /dev/kmsg may still arrive (KernelWatcher.settle).
KMSG_SETTLE_S = 0.05


def _readable(fd: int | None) -> bool:
    """True when `fd` has data to read now (poll(2) with no wait); False for None or an error
    (a closed fd: nothing more will be read from it)."""
    if fd is None:
        return False
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return False


class KernelWatcher:
    """Kernel log watch for one supervisor (config `watchers.kernel`).

    Args:
        config: the Config.
        kmsg_path, sysfs_drm: roots read (tests point them elsewhere).

    State others read:
        source_kind / source_reason: the source in use and why (fallback reasons), for `status`.
        overruns: kmsg ring-buffer overruns seen (records lost).
        gpu_faults: recent GPU fault events (deque of (monotonic time, Event)).
        wedged: PCI address (or "unknown") -> the event that reported it wedged.
    """

    name = "kernel"

    def __init__(
        self,
        config: Any,
        kmsg_path: str = ksrc.KMSG_PATH,
        sysfs_drm: str = "/sys/class/drm",
        settle_s: float | None = None,
    ):
        self.config = config
        self.cfg = config.watchers.kernel
        # how long the capture waits for a crash record after a process died by a signal
        # (`settle`); `watchers.kernel.settle_s` when the config has it, else 0.5 s
        self.settle_s = float(settle_s if settle_s is not None else getattr(self.cfg, "settle_s", 0.5))
        self.crash_pids: set[int | None] = set()  # this incarnation's processes with a crash record
        self._crash_seen: asyncio.Event | None = None
        self._reading = False
        self._fd: int | None = None  # the kmsg reader's fd while it reads
        self.kmsg_path = kmsg_path
        self.sysfs_drm = sysfs_drm
        self.source_kind: str | None = None
        self.source_reason: str | None = None
        self.overruns = 0
        self.last_seq: int | None = None
        self.gpu_faults: deque[tuple[float, Event]] = deque(maxlen=256)
        self.wedged: dict[str, Event] = {}
        self.recent: deque[str] = deque(maxlen=5000)
        self._seen: set[tuple[Any, Any]] = set()
        self._seen_order: deque[tuple[Any, Any]] = deque()
        self._warned = False
        self._lock = threading.Lock()

    # ---- what the supervisor and `status` can ask ------------------------------------------

    def source_status(self) -> dict[str, Any]:
        """{"source": kind or None, "reason": why (fallbacks) or None, "overruns": int}."""
        return {"source": self.source_kind, "reason": self.source_reason, "overruns": self.overruns}

    def restart_blocker(self) -> str | None:
        """Why a restart must wait (a wedged device), or None when it may go on."""
        with self._lock:
            if not self.wedged:
                return None
            devs = ", ".join(sorted(self.wedged))
        check = self.cfg.device_check
        if not check:
            return None
        return f"device {devs} wedged; waiting for `{' '.join(check)}` to exit 0"

    def device_ready(self, timeout_s: float = 30.0) -> bool:
        """Run the configured `watchers.kernel.device_check` once (blocking, at most `timeout_s`).

        True when no device is wedged, when no check command is configured (nothing to wait
        for; the wedge stays in the incident), or when the command exited 0 (then the wedge is
        forgotten). False when it exited non-zero, timed out or could not run.
        """
        with self._lock:
            if not self.wedged:
                return True
        check = self.cfg.device_check
        if not check:
            return True
        try:
            r = subprocess.run(check, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if r.returncode == 0:
            with self._lock:
                self.wedged.clear()
            return True
        return False

    async def wait_device_ready(self, poll_s: float = 5.0, timeout_s: float | None = None) -> bool:
        """Await `device_ready()` every `poll_s` seconds until True (or `timeout_s` passed: False)."""
        t0 = time.monotonic()
        while True:
            if await asyncio.to_thread(self.device_ready, min(30.0, poll_s * 6)):
                return True
            if timeout_s is not None and time.monotonic() - t0 >= timeout_s:
                return False
            await asyncio.sleep(poll_s)

    async def settle(self, ctx: IncarnationContext, pids: list[int], max_s: float | None = None) -> bool:
        """Wait (at most `max_s`, default `settle_s` seconds) for a crash record (segfault, trap,
        OOM kill) of this incarnation's processes, called by the supervisor while capturing when
        `pids` died by a signal the kernel logs. A fault's record is printed before its signal
        is sent (arch/x86/mm/fault.c show_signal_msg, then force_sig_fault); the OOM killer's
        "Killed process" line right after its SIGKILL (mm/oom_kill.c __oom_kill_process), while
        the victim is still freeing its memory. From `/dev/kmsg`, read as soon as it is readable,
        such a record is in the ring buffer by the time the exit is seen: the settle ends as soon
        as the watch has read the buffer to its end (its fd not readable; within KMSG_SETTLE_S).
        journalctl and files deliver later (a file is read every 50 ms), so they get the whole
        `settle_s`. True when one is (or was already) recorded; False at once when the watch is
        not reading (no source, not running), else False after the wait."""
        if not pids or not self._reading or self._crash_seen is None:
            return False
        if self._crash_seen.is_set():
            return True
        limit = self.settle_s if max_s is None else max_s
        if self.source_kind != "kmsg":
            return await aio.wait_event(self._crash_seen, limit)
        end = time.monotonic() + min(limit, KMSG_SETTLE_S)
        # (the reader handles what it reads before it awaits again: an fd with nothing to read
        # means every record in the ring buffer now has been handled)
        while _readable(self._fd) and time.monotonic() < end and not self._crash_seen.is_set():
            await asyncio.sleep(0.002)
        return self._crash_seen.is_set()

    def recent_gpu_faults(self, within_s: float) -> list[Event]:
        """GPU fault events seen in the last `within_s` seconds (oldest first)."""
        now = time.monotonic()
        return [ev for t, ev in list(self.gpu_faults) if now - t <= within_s]

    # ---- the watch ---------------------------------------------------------------------------

    async def run(self, ctx: IncarnationContext) -> None:
        if not self.cfg.enabled:
            return
        self.crash_pids = set()
        self._crash_seen = asyncio.Event()
        since = ctx.started_at - self.cfg.lookback_s
        src = await asyncio.to_thread(
            ksrc.open_source, self.cfg.source, self.cfg.path, since, self.last_seq, self.kmsg_path
        )
        self.source_kind, self.source_reason = src.kind, src.reason
        self._fd = getattr(src, "fd", None)
        if src.kind == "none":
            if not self._warned:
                self._warned = True
                _warn(f"kernel log watch off: {src.reason}")
            return
        if src.reason and not self._warned:
            self._warned = True
            _warn(f"kernel log from {src.kind}: {src.reason}")
        corr = ksrc.Correlator(ctx.started_at)
        corr.update(ctx.processes)
        refresher = asyncio.get_running_loop().create_task(self._refresh(ctx, corr))
        self._reading = True
        try:
            async for rec in src.records():
                self._take(rec, src, ctx, corr)
        except asyncio.CancelledError:
            # The incarnation is over (another trigger won, e.g. the pidfd exit of the process
            # whose segfault record is in the log already): a last look, so that evidence is recorded.
            for rec in src.drain():
                self._take(rec, src, ctx, corr)
            raise
        finally:
            self._reading = False
            self._fd = None
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            src.close()

    def _take(
        self, rec: ksrc.KernelRecord, src: ksrc.KernelSource, ctx: IncarnationContext, corr: ksrc.Correlator
    ) -> None:
        if rec.seq is not None:
            self.last_seq = rec.seq if self.last_seq is None else max(self.last_seq, rec.seq)
        self.overruns = src.overruns
        corr.update(ctx.processes)
        self.handle(rec, ctx, corr)

    async def _refresh(self, ctx: IncarnationContext, corr: ksrc.Correlator) -> None:
        # Cache comm/NSpid while processes are alive: a crashed one's /proc entry is gone by the time its record is read.
        # Once ready the tree is known (late finds also reach corr.update through _take): a slower
        # pace keeps the idle supervisor cheap.
        while True:
            corr.update(ctx.processes)
            await asyncio.sleep(0.25 if ctx.ready_at is None else 2.0)

    def _device_ranks(self, ctx: IncarnationContext) -> tuple[dict[str, int], str]:
        mask = None
        for p in _live(ctx):
            env = procfs.environ(p.pid)
            if env is not None:
                mask = env.get("ZE_AFFINITY_MASK")
                break
        if mask is None:
            mask = self.config.environment.vars.get("ZE_AFFINITY_MASK")
        return ksrc.device_ranks(self.config.engine.tensor_parallel_size, mask, self.sysfs_drm)

    def handle(self, rec: ksrc.KernelRecord, ctx: IncarnationContext, corr: ksrc.Correlator) -> Event | None:
        """Parse, classify, correlate and act on one record; returns the event when it was recorded."""
        self.recent.append(rec.line)
        ev = ksrc.to_event(rec)
        if ev is None:
            return None
        wall = rec.wall
        c = corr.match(ev.pid, ev.process, wall)
        if c.ours:
            _take_ours(ev, c)
        gpu = is_gpu_fault(ev)
        if gpu and ev.extra.get("device"):
            self._rank_of_device(ev, ctx)
        if not ksrc.attributable(ev, c.ours) or not (c.ours or gpu or ev.signature):
            # another program's segfault/OOM is not our evidence; unclassified records without a
            # process are not either (classified ones, firmware and driver notices, are context)
            return None
        before = wall is not None and wall < ctx.started_at - 1.0
        if before:
            # Look-back (before this incarnation started): the previous incarnation's incident
            # already has it. Only a wedged device still matters now (it explains what follows
            # and holds restarts); other old faults are not this incarnation's evidence.
            if not (gpu and is_wedged(ev)):
                return None
            ev.extra["before_start"] = True
        if not self._first_time(rec):
            return None  # already recorded (look-back windows of two incarnations overlap)
        ctx.record(ev)
        if gpu:
            if not before:
                self.gpu_faults.append((time.monotonic(), ev))
            if is_wedged(ev):
                with self._lock:
                    self.wedged[str(ev.extra.get("device") or "unknown")] = ev
        if c.ours and is_crash_record(ev) and (wall is None or wall >= ctx.started_at - 2.0):
            self._fail_on_crash(ev, c, ctx)
        return ev

    def _rank_of_device(self, ev: Event, ctx: IncarnationContext) -> None:
        """The TP rank whose device a GPU record names (`rank_by`), or why none (`rank_note`)."""
        dev = str(ev.extra.get("device"))
        ranks, how = self._device_ranks(ctx)
        if dev in ranks:
            ev.rank = ranks[dev]
            ev.extra["rank_by"] = how
        else:
            ev.extra["rank_note"] = how if not ranks else f"device {dev} not among the ranks' devices ({how})"

    def _first_time(self, rec: ksrc.KernelRecord) -> bool:
        """False for a record already handled (by sequence number, else boot time and text)."""
        key = (rec.seq, None) if rec.seq is not None else (rec.boot_s, rec.message)
        if key in self._seen:
            return False
        self._seen.add(key)
        self._seen_order.append(key)
        if len(self._seen_order) > 10000:
            self._seen.discard(self._seen_order.popleft())
        return True

    def _fail_on_crash(self, ev: Event, c: ksrc.Correlation, ctx: IncarnationContext) -> None:
        """A kernel crash record (segfault, trap, OOM kill) of one of our processes fails the
        incarnation at once (the process exit may be seen later)."""
        who = ev.process or "process"
        pid = c.info.pid if c.info is not None else ev.pid
        self.crash_pids.add(pid)
        if self._crash_seen is not None:
            self._crash_seen.set()
        ctx.fail(
            Trigger(
                kind="kernel",
                detail=f"kernel: {who} (pid {pid}): {ev.text[:200]}",
                at=time.time(),
                process=c.info.name if c.info is not None else ev.process,
                rank=c.info.rank if c.info is not None else None,
                pid=pid,
                signal=_signal_of(ev),
                event=ev,
            )
        )


def _take_ours(ev: Event, c: ksrc.Correlation) -> None:
    """An event correlated to one of our processes (`Correlator.match`) takes its name and rank;
    the kernel's comm and how it was matched stay in `extra`."""
    ev.extra["correlated_by"] = c.by
    ev.extra["comm"] = ev.process
    if c.info is not None:
        ev.extra["our_pid"] = c.info.pid
        ev.process = c.info.name
        ev.rank = c.info.rank
    if c.note:
        ev.extra["note"] = c.note


class _LineFed:
    """Engine output lines for a watcher, from the supervisor's line hook: it calls `on_line` for
    every line on the log pump's writer thread (so `on_line` must be cheap and thread-safe)."""

    def on_line(self, line: str, file: str | None = None, lineno: int | None = None) -> None:
        """Feed one engine output line (called by the supervisor for every line; cheap, non-blocking)."""
        self._line(line)

    def _line(self, line: str) -> None:
        raise NotImplementedError


StackDumper = Callable[[list[int], float], dict[int, str]]


def _default_dumper(pids: list[int], timeout_s: float) -> dict[int, str]:
    from xpu_serve.collectors import dump_stacks

    return dump_stacks(pids, timeout_s)


class HangWatcher(_LineFed):
    """Hang watchdog (config `supervision.hang`), active once the incarnation is ready.

    Every `metrics_interval_s` it scrapes `/metrics`; with requests running or waiting and no
    token counter growth for `after_s`, it is a hang. While /metrics is unavailable (three
    intervals without a good scrape) the periodic stats lines fed through `on_line` decide. With
    `canary: true`, when idle for `canary_interval_s`, a 1-token completion must answer within
    `canary_timeout_s`. On a hang: `dump_stacks(pids, timeout)` of every live process (py-spy,
    `bundles.collector_timeout_s` per process; each rank's process state sampled just before, and
    both recorded as `facts.rank_states`), then `ctx.record(facts.hang(...))` (stacks in
    the event's extra["stacks"], pid -> text; GPU faults seen by the kernel watcher in
    extra["kernel_faults"]) and `ctx.fail(Trigger(kind="hang", event=that event))`.
    """

    name = "hang"

    def __init__(self, config: Any, kernel: KernelWatcher | None = None, dump: StackDumper | None = None):
        self.config = config
        self.cfg = config.supervision.hang
        self.kernel = kernel
        self.dump = dump or _default_dumper
        self.stats = prog.StatsLineProgress(self.cfg.after_s)
        self.last_verdict: prog.HangVerdict | None = None
        self._stats_lock = threading.Lock()  # on_line runs on the log pump's writer thread
        # the current incarnation's /metrics progress while watching (read by `suspected`)
        self._metrics: prog.MetricsProgress | None = None
        self._metrics_ok_at: float | None = None

    def suspect_after_s(self) -> float:
        """No progress with work in flight for this long (seconds) makes a hang suspected:
        two scrape intervals (one slow step is not a hang), at least a third of `after_s`."""
        return max(2 * self.cfg.metrics_interval_s, self.cfg.after_s / 3)

    def suspected(self) -> str | None:
        """Why a hang is suspected before the verdict (one line), or None. Thread-safe: read by
        the readiness probe's HTTP thread. Progress comes from /metrics while it answers (within
        three intervals), else from the stats lines."""
        metrics, ok_at = self._metrics, self._metrics_ok_at
        if metrics is None:
            return None
        now = time.monotonic()
        if ok_at is not None and now - ok_at <= 3 * self.cfg.metrics_interval_s:
            stalled = metrics.stalled_s(now)
        else:
            with self._stats_lock:
                stalled = self.stats.stalled_s(now)
        if stalled is None or stalled < self.suspect_after_s():
            return None
        return (
            f"hang suspected: no token progress for {stalled:.1f} s with requests in flight "
            f"(verdict at {self.cfg.after_s:g} s)"
        )

    def _line(self, line: str) -> None:
        # the periodic stats line is the fallback progress signal
        if "Avg prompt throughput" not in line:
            return
        st = prog.parse_stats_line(line)
        if st is not None:
            with self._stats_lock:
                self.stats.observe(time.monotonic(), st, time.time())

    async def run(self, ctx: IncarnationContext) -> None:
        if not self.cfg.enabled:
            return
        await self._watch(ctx)

    async def _watch(self, ctx: IncarnationContext) -> None:
        while ctx.ready_at is None:
            if _failed(ctx):
                return
            await asyncio.sleep(0.1)
        with self._stats_lock:
            self.stats = prog.StatsLineProgress(self.cfg.after_s)
        rounds = _HangRounds(self)
        try:
            while True:
                verdict = await rounds.next()
                if _failed(ctx):
                    return
                if verdict is not None:
                    await self._on_hang(ctx, verdict)
                    return
                await asyncio.sleep(rounds.pause_s())
        finally:
            self._metrics = None
            await rounds.close()

    async def _on_hang(self, ctx: IncarnationContext, v: prog.HangVerdict) -> None:
        detected_at = time.time()
        self.last_verdict = v
        live = _live(ctx)
        pids = [p.pid for p in live]
        timeout = float(getattr(getattr(self.config, "bundles", None), "collector_timeout_s", 10.0))
        states = await asyncio.to_thread(steady_states, pids)  # before py-spy attaches
        try:
            stacks = await asyncio.to_thread(self.dump, pids, timeout) if pids else {}
        except Exception as ex:  # stacks are evidence, never a reason not to fail
            stacks = {pid: f"# stack dump failed: {type(ex).__name__}: {ex}\n" for pid in pids}
        ranks = rank_states_fact(live, states, stacks, at=detected_at)
        if ranks is not None:
            ctx.record(ranks)
        by = {
            "metrics": "xpu-serve hang watchdog (/metrics)",
            "stats-line": "xpu-serve hang watchdog (stats lines)",
            "canary": "xpu-serve canary request",
        }[v.detected_by]
        last = datetime.fromtimestamp(v.last_progress_at) if v.last_progress_at is not None else None
        ev = facts.hang(v.no_progress_s, v.running, v.waiting, last, detected_by=by, at=detected_at)
        ev.extra["stacks"] = stacks
        faults = self.kernel.recent_gpu_faults(v.no_progress_s + 60.0) if self.kernel is not None else []
        if faults:
            ev.extra["kernel_faults"] = [f.text for f in faults]
        ctx.record(ev)
        detail = f"engine hang: {ev.text} (detected by {by})"
        if faults:
            detail += f"; kernel GPU fault before it: {faults[0].text[:160]}"
        trig = Trigger(kind="hang", detail=detail, at=detected_at, event=ev)
        trig.stacks = stacks  # type: ignore[attr-defined]  # the supervisor hands getattr(trig, "stacks") to the bundle
        ctx.fail(trig)


class _HangRounds:
    """One `HangWatcher` watch, a round every `metrics_interval_s`: a `/metrics` scrape (the
    stats lines decide while it has failed for 3 intervals), and the canary while idle. `next()`
    returns a verdict or None; `close()` ends the connection and a canary in flight."""

    def __init__(self, w: HangWatcher):
        e = w.config.engine
        self.w, self.interval = w, w.cfg.metrics_interval_s
        self.metrics = w._metrics = prog.MetricsProgress(w.cfg.after_s)
        w._metrics_ok_at = None
        self.ok_at: float | None = None  # monotonic s of the last good scrape
        self.last_canary = time.monotonic()
        self.canary: asyncio.Task[prog.CanaryResult] | None = None
        self.getter = KeepAliveGet(
            probe_address(e.host), e.port, max(1.0, min(self.interval, 10.0)), max_bytes=prog.MAX_METRICS_BYTES
        )

    async def next(self) -> prog.HangVerdict | None:
        sample = await prog.scrape_metrics(self.getter)
        now = time.monotonic()
        verdict: prog.HangVerdict | None = None
        if sample is not None:
            self.ok_at = self.w._metrics_ok_at = now
            verdict = self.metrics.observe(now, sample, time.time())
        elif self.ok_at is None or now - self.ok_at > 3 * self.interval:
            with self.w._stats_lock:
                verdict = self.w.stats.check(now)
        if self.canary is not None and self.canary.done():
            res, self.canary = self.canary.result(), None
            self.last_canary = time.monotonic()
            if res.hung and verdict is None:
                verdict = self._canary_verdict(res)
        if verdict is None and self._canary_due(now):
            e, cfg = self.w.config.engine, self.w.cfg
            self.canary = asyncio.get_running_loop().create_task(
                prog.canary_request(
                    probe_address(e.host), e.port, e.served_model_name or e.model, cfg.canary_timeout_s, e.api_key
                )
            )
        return verdict

    def _idle(self, now: float) -> bool:
        if self.ok_at is not None and now - self.ok_at <= 3 * self.interval:
            return self.metrics.idle
        with self.w._stats_lock:
            return self.w.stats.idle or self.w.stats.last is None

    def _canary_due(self, now: float) -> bool:
        cfg = self.w.cfg
        return (
            cfg.canary and self.canary is None and self._idle(now) and now - self.last_canary >= cfg.canary_interval_s
        )

    def _canary_verdict(self, res: prog.CanaryResult) -> prog.HangVerdict:
        """A canary that timed out: the counts /metrics showed (the canary itself is not user
        work in flight)."""
        last = self.metrics.last
        return prog.HangVerdict(
            res.duration_s,
            int(last.running or 0) if last is not None else 0,
            int(last.waiting or 0) if last is not None else 0,
            (self.metrics.last_progress_wall or time.time() - res.duration_s),
            "canary",
        )

    def pause_s(self) -> float:
        """Seconds to the next round: shorter while a canary is out (its answer is a verdict)."""
        return min(self.interval, 0.5) if self.canary is not None else self.interval

    async def close(self) -> None:
        self.getter.close()
        if self.canary is not None:
            self.canary.cancel()
            with contextlib.suppress(BaseException):
                await self.canary


class StartupWatcher(_LineFed):
    """Start-up stall watch (config `supervision.startup.stall_s`) until the incarnation is ready.

    Fed through `on_line`; checks every min(1 s, stall_s / 10). A stall records
    `facts.startup_stall(stalled_s, phase, missing_ranks)` and fails with
    `Trigger(kind="startup-stall", rank=the missing rank when there is exactly one)`.
    It never fires before it was fed a line in this incarnation (a supervisor without the
    line hook must not make every start-up look stalled).
    """

    name = "startup-stall"

    def __init__(self, config: Any):
        self.config = config
        self.tracker: StartupTracker | None = None
        self._created_wall = 0.0
        self._lock = threading.Lock()

    def _new_tracker(self) -> StartupTracker:
        self._created_wall = time.time()
        return StartupTracker(
            world_size=self.config.engine.tensor_parallel_size,
            stall_s=self.config.supervision.startup.stall_s,
            started=time.monotonic(),
        )

    def phase(self) -> str | None:
        """The start-up phase in progress (`sources.startup.PHASES`; "ready" once ready), None
        outside a start-up. Thread-safe (read by the metrics endpoint's HTTP thread); meaningful
        only while the supervisor's state is `starting`."""
        with self._lock:
            t = self.tracker
            if t is None:
                return None
            return "ready" if t.is_ready else t.current_phase()[0]

    def _line(self, line: str) -> None:
        with self._lock:
            t = self.tracker
            if t is None:
                t = self.tracker = self._new_tracker()
            self._fed = True
            if not t.is_ready:
                t.on_line(line, time.monotonic())

    async def run(self, ctx: IncarnationContext) -> None:
        with self._lock:
            # Lines that arrived since this incarnation started are kept; older state is not.
            if self.tracker is None or self._created_wall < ctx.started_at - 0.5:
                self.tracker = self._new_tracker()
                self.tracker.last_progress = time.monotonic() - max(0.0, time.time() - ctx.started_at)
                self._fed = False
        stall_s = self.config.supervision.startup.stall_s
        tick = min(1.0, stall_s / 10)
        try:
            while ctx.ready_at is None and not _failed(ctx):
                await asyncio.sleep(tick)
                if _failed(ctx):
                    return
                with self._lock:
                    t = self.tracker
                    if t is None:
                        continue
                    for p in list(ctx.processes.values()):
                        if p.rank is not None:
                            t.set_rank(p.pid, p.rank)
                    st = t.stall(time.monotonic()) if self._fed else None
                if st is not None:
                    ev = facts.startup_stall(st.stalled_s, st.phase, st.missing_ranks)
                    ev.extra["last_phase"] = st.last_phase
                    ev.extra["reached"] = {k: sorted(v) for k, v in t.reached.items()}
                    ctx.record(ev)
                    ctx.fail(
                        Trigger(
                            kind="startup-stall",
                            detail=ev.text,
                            at=time.time(),
                            rank=st.missing_ranks[0] if len(st.missing_ranks) == 1 else None,
                            event=ev,
                        )
                    )
                    return
        finally:
            with self._lock:
                self.tracker = None

    _fed = False
