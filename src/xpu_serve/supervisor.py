"""The supervisor: an asyncio state machine that starts, watches and restarts `vllm serve`.

States (written to RUNTIME/state.json on every change, told to every observer):

    starting -> ready -> failed -> capturing -> stopping -> backoff -> starting ...
    any -> stopping -> stopped            (SIGTERM / SIGINT / `xpu-serve stop`: exit 0)
    failed/capturing/stopping -> gave-up  (crash loop: exit GAVE_UP; unfixable: GAVE_UP_AT_ONCE)

One incarnation = one launch of the engine command (in its own session and process group, with
the rendered environment plus XPU_SERVE_INCARNATION=N and XPU_SERVE_RUN_ID=<id of this
supervisor>). Failure triggers: any watched vLLM process exits (pidfd), `/health` fails N probes
in a row, a fatal line (per the Analyzer's signatures), the start-up stall timer or the overall
start-up limit, and whatever the plugged-in watchers report via `IncarnationContext.fail`.

On failure, in this order: record the incident (analysis + bundle, before anything is killed),
stop the whole tree and sweep survivors (`cleanup.stop_tree`), remove the incarnation's
/dev/shm and /tmp/vllm_dist_* leftovers, wait for the port, then back off (restart policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, BinaryIO, TextIO, cast

from xpu_serve import aio, cleanup, exitcodes, facts, logdirs, output, recovery
from xpu_serve.config import Config
from xpu_serve.events import Event, split_process_prefix
from xpu_serve.incarnation import Observer, ProcessInfo, Status, Trigger, Watcher
from xpu_serve.redact import Redactor, secrets_in_argv, secrets_in_env, secrets_in_mapping
from xpu_serve.restart_policy import RestartPolicy
from xpu_serve.sources import health as health_src
from xpu_serve.sources import processes as proc_src
from xpu_serve.sources.vllm_output import LogPump
from xpu_serve.state import EVENTS_FILE, LockedError, RuntimeLock, read_state, status_dict, write_state
from xpu_serve.vllm_command import render

# Causes (cases/README.md) a restart cannot fix.
UNFIXABLE_CAUSES = {"config-error"}
# Seconds between runs of `watchers.kernel.device_check` while a wedged device holds the restart.
DEVICE_CHECK_INTERVAL_S = 2.0
# Seconds between rewrites of state.json while nothing changes (its `written_at` then tells
# `status` whether the file is current: a full disk leaves it stale). Env XPU_SERVE_STATE_HEARTBEAT_S.
STATE_HEARTBEAT_S = 5.0
# When several watched processes exit within this many seconds, the trigger names the one that
# died first with an abnormal status (signal or non-zero code), not a clean teardown exit.
EXIT_WINDOW_S = 0.15
# uvicorn access lines of these paths (status < 400) are not echoed (xpu_serve.sources.vllm_output)
ECHO_QUIET_PATHS = ("/health", "/metrics", "/v1/models")
# The event loop notes the time every TICK_S; a gap over LOOP_STALL_S (the supervisor SIGSTOPped or
# starved of CPU) makes a process exit seen at its end only "no later than" then (`_loop_stall`).
TICK_S = 0.25
LOOP_STALL_S = 1.0
REAP_INTERVAL_S = 0.5  # PID 1: how often re-parented zombies of the engine sessions are reaped
# Signals whose default action ends the process and that the supervisor has no use for (signal(7)):
# handled as "logged, ignored" so that a stray one does not orphan the server. SIGQUIT (core dump,
# asked for on purpose), SIGKILL/SIGSTOP (cannot be caught) and the synchronous fault signals are
# left alone; SIGPIPE is already ignored by Python.
STRAY_SIGNALS: tuple[int, ...] = tuple(
    getattr(signal, n)
    for n in ("SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGPWR", "SIGIO", "SIGSTKFLT", "SIGXCPU", "SIGXFSZ")
    if hasattr(signal, n)
) + tuple(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))


def set_aside_old_logs(log_dir: Path) -> Path | None:
    """Move RUNTIME/logs/N left by an earlier supervisor run out of the way; returns where to.

    Every run numbers its incarnations from 1, so without this a new run (a systemd restart, the
    next `up` after a kill -9) appended to the old run's ``logs/1/vllm.log`` and per-process files:
    its line numbers (`LogPump.locate`, evidence) pointed at the old run's lines and its bundles
    carried the old run's crash as if it were this one's. A non-empty `log_dir` becomes
    ``logs/N.prev`` (replacing an older one: at most one earlier run's logs are kept, except that
    a ``logs/N.prev`` holding an incident without a bundle, `recovery.is_pending`, is renamed
    ``logs/N.prev.K``, K = 2, 3..., instead of removed); a log relay of the old run still draining
    an orphan's pipes writes on into the moved file. None when there was nothing to move or the
    move failed (read-only or broken runtime directory: the old behaviour, appending)."""
    try:
        with os.scandir(log_dir) as it:
            if next(it, None) is None:
                return None
    except OSError:  # (absent, not a directory: mkdir says what is wrong)
        return None
    prev = log_dir.with_name(log_dir.name + ".prev")
    try:
        if prev.is_symlink() or (prev.exists() and not prev.is_dir()):
            prev.unlink()
        elif prev.exists() and recovery.is_pending(prev):
            k = 2
            while os.path.lexists(f"{prev}.{k}"):
                k += 1
            os.replace(prev, f"{prev}.{k}")
        elif prev.exists():
            shutil.rmtree(prev)  # (never follows symlinks inside)
        os.replace(log_dir, prev)
    except OSError:
        return None
    return prev


# --------------------------------------------------------------------------------------------
# The supervisor's own event log: one line per event, text or JSON, plus RUNTIME/events.jsonl.
# --------------------------------------------------------------------------------------------


# Level of each supervisor event (EventLog.emit): a root cause or giving up is an error; what
# needs a look but is handled is a warning; routine progress is info.
EVENT_LEVELS = {
    "incident": "error", "failed": "error", "gave-up": "error",
    "detected": "warning", "warning": "warning", "orphans": "warning", "restart-held": "warning",
    "kill": "warning", "output-dropped": "warning", "reaped": "debug",
}
# syslog priorities of the levels (sd-daemon.h: SD_ERR 3, SD_WARNING 4, SD_INFO 6, SD_DEBUG 7)
SYSLOG_PRIORITY = {"error": 3, "warning": 4, "info": 6, "debug": 7}


def _is_journal_stream(stream: IO[str], journal_stream: str) -> bool:
    """True when `stream`'s file is the one $JOURNAL_STREAM ("DEVICE:INODE", decimal) names."""
    dev, _, ino = journal_stream.partition(":")
    try:
        st = os.fstat(stream.fileno())
        return dev.isdigit() and ino.isdigit() and (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError, AttributeError):
        return False


def _open_private_append(path: Path) -> IO[str]:
    """`path` opened for appending lines, created 0600 (and made 0600 if an earlier run left it wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o600)
    return open(fd, "a", buffering=1)  # noqa: SIM115 (lives as long as the log)


class EventLog:
    """The supervisor's own events, one line each, on `stream` (stderr by default).

    Text: `2026-11-30T09:00:00.123Z xpu-serve: ready: incarnation 1 in 3.2 s`.
    JSON (`fmt="json"`): {"time": ISO, "ts": epoch s, "event": "ready", "level": "info", "msg": ...,
    **fields}. Every event is also appended as JSON to RUNTIME/events.jsonl (mode 0600) when
    `jsonl_path` is set. `level` (debug/info/warning/error) is `emit(level=)` or else
    EVENT_LEVELS[event] (default info). When `stream` is connected to journald ($JOURNAL_STREAM
    names its device:inode, systemd.exec(5)), each line starts with `<N>`, the syslog priority
    (sd-daemon(3): SD_ERR "<3>" ... SD_DEBUG "<7>"), which journald strips and stores as PRIORITY,
    so `journalctl -p err` selects the errors.
    The default stream is `xpu_serve.output.writer(2)`: a reader that stops reading never
    blocks `emit`; lines it could not take are dropped, and where they were an `output-dropped`
    event (`dropped`: lines, `stream`) is written, to events.jsonl too (`watch_output`).
    `redact`, when set (the supervisor sets its known secrets' `Redactor.mapping`), is applied to
    every record before it is written anywhere.
    """

    def __init__(self, fmt: str = "text", stream: IO[str] | None = None, jsonl_path: Path | None = None):
        self.fmt = fmt
        self.stream: IO[str] = stream if stream is not None else cast(IO[str], output.writer(2))
        self.redact: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._lock = threading.Lock()  # events.jsonl: the loop and the output writers' threads
        self._jsonl: IO[str] | None = None
        self._jsonl_path = jsonl_path
        if jsonl_path is not None:
            with contextlib.suppress(OSError):
                self._jsonl = _open_private_append(jsonl_path)
        self.journal = _is_journal_stream(self.stream, os.environ.get("JOURNAL_STREAM", ""))
        self.watch_output(self.stream)

    def watch_output(self, stream: Any) -> None:
        """Record the drops of `stream` (an `output.LineWriter`; others are ignored) as
        `output-dropped` events: its summary line is that event's line."""
        if isinstance(stream, output.LineWriter):
            stream.summary = lambda n, name=stream.name: self._dropped(name, n)

    def _dropped(self, name: str, n: int) -> str:
        rec, line = self._record(
            "output-dropped", f"{n} lines dropped ({name} not read)", "warning", {"dropped": n, "stream": name}
        )
        self._append(rec)
        return line

    def _record(self, event: str, msg: str, level: str | None, fields: dict[str, Any]) -> tuple[dict[str, Any], str]:
        ts = time.time()
        iso = datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        level = level or EVENT_LEVELS.get(event, "info")
        rec = {"time": iso, "ts": ts, "event": event, "level": level, "msg": msg, **fields}
        if self.redact is not None:
            rec = self.redact(rec)
        line = json.dumps(rec, default=str) if self.fmt == "json" else f"{iso} xpu-serve: {event}: {rec['msg']}"
        if self.journal:
            line = f"<{SYSLOG_PRIORITY.get(level, 6)}>{line}"
        return rec, line

    def _append(self, rec: dict[str, Any]) -> None:
        with self._lock:
            if self._jsonl is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._jsonl.write(json.dumps(rec, default=str) + "\n")

    def emit(self, event: str, msg: str, level: str | None = None, **fields: Any) -> None:
        rec, line = self._record(event, msg, level, fields)
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(line + "\n")
            self.stream.flush()
        self._append(rec)

    def reopen_if_moved(self) -> None:
        """Open events.jsonl again when its path no longer names the open file (the runtime
        directory was removed or the file rotated away), so events still reach RUNTIME."""
        path, f = self._jsonl_path, self._jsonl
        if path is None:
            return
        try:
            if f is not None:
                held, now = os.fstat(f.fileno()), os.stat(path)
                if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                    return
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            return
        try:
            new = _open_private_append(path)
        except OSError:
            return
        self.close()
        self._jsonl = new

    def close(self) -> None:
        """Close events.jsonl; a full disk at the final flush loses those lines, never the exit code."""
        with self._lock:
            if self._jsonl is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._jsonl.close()
                self._jsonl = None


# --------------------------------------------------------------------------------------------
# Adapters to the modules other engineers own (imported lazily, with fallbacks until they land).
# --------------------------------------------------------------------------------------------


def _new_analyzer() -> Any:
    try:
        from xpu_serve.diagnosis import Analyzer
    except ImportError:
        return None
    try:
        return Analyzer()
    except Exception:
        return None


def _is_fatal(analyzer: Any, ev: Any) -> bool:
    """Is this classified line one on which the incarnation is dead? The signature table says so
    (`fatal: true` rows of data/signatures.yaml, through `diagnosis.Analyzer.is_fatal(event)`)."""
    if ev is None or not getattr(ev, "signature", None):
        return False
    fn = getattr(analyzer, "is_fatal", None)
    return bool(fn(ev)) if callable(fn) else False


# Signals after which the kernel usually logs a record naming the faulting library or the OOM
# kill (arch/x86/mm/fault.c show_signal_msg, arch/x86/kernel/traps.c, mm/oom_kill.c): the capture
# gives the kernel watcher a short settle for it when a process died by one (or of unknown status).
_KERNEL_RECORDED_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGKILL"})


# --------------------------------------------------------------------------------------------
# One incarnation: the IncarnationContext that watchers and the bundle writer see.
# --------------------------------------------------------------------------------------------


@dataclass
class Incarnation:
    """`xpu_serve.incarnation.IncarnationContext` of one launch, plus the supervisor's bookkeeping.

    Extra attributes for the bundle writer: `log_dir` (RUNTIME/logs/N), `run_id`, `pgid`,
    `trigger` (the first failure), `analyzer`, `argv`, `env` (the overrides we set),
    `restarts`, `exits` (pid -> (exit_code, signal)), `stop` (StopReport once stopped).
    """

    incarnation: int
    config: Config
    runtime_dir: Path
    run_id: str
    started_at: float
    log_dir: Path
    on_fail: Callable[[Trigger], None]
    on_record: Callable[[Event], None]
    ready_at: float | None = None
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    pgid: int | None = None
    trigger: Trigger | None = None
    analyzer: Any = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    shm_before: set[str] | None = None
    shm_owned: set[str] = field(default_factory=set)
    stop: cleanup.StopReport | None = None
    pump: LogPump | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: int | None = None

    def fail(self, trigger: Trigger) -> None:
        """Declare the incarnation failed; thread-safe; the first trigger wins."""
        self._call(self.on_fail, trigger)

    def record(self, event: Event) -> None:
        """Add evidence to the live analysis; thread-safe."""
        self._call(self.on_record, event)

    def _call(self, fn: Callable[[Any], None], arg: Any) -> None:
        if self._loop is not None and threading.get_ident() != self._thread:
            self._loop.call_soon_threadsafe(fn, arg)
        else:
            fn(arg)


class _Stop(Exception):
    pass


# --------------------------------------------------------------------------------------------
# The supervisor.
# --------------------------------------------------------------------------------------------


class Supervisor:
    """Runs the state machine until stopped or given up; `await run()` returns the exit code.

    Args:
        config: the validated Config.
        runtime_dir: RUNTIME (state.json, lock, logs/, bundles/); created if missing.
        log: the supervisor's EventLog (default: text on stderr + RUNTIME/events.jsonl).
        watchers, observers: default `plugins.watchers_for(config)` / `observers_for(config)`.
        echo: echo the engine's output tagged with the incarnation on stdout.
        engine_umask: the umask the engine is started with (`up` runs the supervisor under 077
            and passes the operator's); None: the supervisor's own.

    Secrets: the known secret values (`xpu_serve.redact`: secret-looking keys of the config, the
    environment, the engine's argv and variables) are replaced by `***` in every event, the
    logs and the echo. Files and directories it creates are 0600 / 0700.

    Signals (installed by `install_signal_handlers`): SIGTERM/SIGINT graceful stop (exit 0),
    a second SIGINT kills the tree at once, SIGHUP a planned restart (not a failure).
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
        self.redactor = Redactor(secrets_in_mapping(config.model_dump(mode="json")) + secrets_in_env(os.environ))
        self.log.redact = self.redactor.mapping
        self._engine_umask = -1 if engine_umask is None else engine_umask  # (Popen: -1 = unchanged)
        self._echo_out = cast(TextIO, output.writer(1)) if echo else None
        self.log.watch_output(self._echo_out)
        # built in run(), once the lock is held (observers may bind a port: metrics)
        self._plugins_given = (watchers, observers)
        self.watchers: list[Watcher] = watchers or []
        self.observers: list[Observer] = observers or []
        self.echo = echo
        self.run_id = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.state = "starting"
        self.incarnation = 0
        self.restarts = 0
        self.failures = 0
        self.last_incident: dict[str, Any] | None = None
        self.next_restart_at: float | None = None
        self.reason: str | None = None
        self.time_to_ready_s: float | None = None
        self.ctx: Incarnation | None = None
        self.policy = RestartPolicy(config.supervision.restart)
        self._wake = asyncio.Event()
        self._stop_requested = False
        self._kill_now = False
        self._restart_requested = False
        self._sigint_count = 0
        self._signal_logged: dict[int, float] = {}  # signal -> monotonic time last logged (_repeat)
        self._lock = RuntimeLock(self.runtime_dir)
        self._lock_problem: str | None = None  # the last lock warning emitted (once per streak)
        self._create_time = cleanup.proc_start_time(os.getpid())  # proves our pid (live_supervisor)
        self._popen: subprocess.Popen[bytes] | None = None
        self._engine_sessions: set[int] = set()  # session ids of this run's engines (PID-1 reaper)
        self.reaped: list[int] = []  # orphaned zombies reaped as PID 1 (xpu_serve.reaper)
        self._last_progress = time.monotonic()
        self._discover_now = asyncio.Event()
        self._exitwatch: proc_src.ExitWatch | None = None
        self._connector: proc_src.ProcConnector | None = None
        self._carry_candidates: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._line_q: deque[tuple[str, int]] = deque()
        self._drain_scheduled = False
        self._log_file = ""
        self._exited: dict[int, float] = {}  # pid -> exit time (epoch s), this incarnation
        # watchers' `on_line(line, file, lineno)`, called on the pump's writer thread
        self._line_hooks: list[Callable[[str, str, int], None]] = []
        # watcher tasks of the current incarnation: they outlive the trigger (evidence that
        # arrives while capturing is still recorded) and are cancelled just before the stop
        self._watch_tasks: list[asyncio.Task[None]] = []
        # process exits seen within EXIT_WINDOW_S of the first one, before the trigger is chosen
        self._pending_exits: list[tuple[Incarnation, Trigger]] = []
        self._announced = False  # this burst's `detected` event was emitted
        self._exit_timer: asyncio.TimerHandle | None = None
        self._pending_other: tuple[Incarnation, Trigger] | None = None
        self._exit_window_end = 0.0  # monotonic s: the window may be extended up to this
        # pid -> epoch s: watched processes already dying (PF_EXITING or gone) when the first exit
        # of the burst was reported; their death began no later than that
        self._dying_at: dict[int, float] = {}
        self._last_tick = time.time()  # the event loop's last tick (`_tick`), epoch s
        self._last_gap: tuple[float, float] = (0.0, 0.0)  # the last gap over LOOP_STALL_S: (from, to)
        try:
            hb = os.environ.get("XPU_SERVE_STATE_HEARTBEAT_S", "")
            self.heartbeat_s = max(0.05, float(hb)) if hb else STATE_HEARTBEAT_S
        except ValueError:
            self.heartbeat_s = STATE_HEARTBEAT_S
        self._state_write_failing = False

    # ---- requests (signal handlers, tests) -------------------------------------------------

    def request_stop(self, kill_now: bool = False) -> None:
        """Stop the server and exit 0; `kill_now` skips the grace period (SIGKILL at once)."""
        if self._stop_requested and not kill_now:
            return
        self._stop_requested = True
        if kill_now and not self._kill_now:
            self._kill_now = True
            ctx = self.ctx
            if ctx is not None:
                self.log.emit("kill", "second interrupt: killing the server at once")
                cleanup.signal_tree(
                    ctx.pgid, self.run_id, ctx.incarnation, signal.SIGKILL, list(ctx.processes), _starts(ctx)
                )
        self._wake.set()

    def request_restart(self) -> None:
        """Planned restart (SIGHUP): stop and start again at once, not counted as a failure."""
        self._restart_requested = True
        self._wake.set()

    def request_scan(self) -> None:
        """SIGUSR1 (`xpu-serve bundle` dropped a request): wake every watcher that has `wake()`
        (the bundle-request watcher scans its folder once)."""
        for w in self.watchers:
            fn = getattr(w, "wake", None)
            if callable(fn):
                with contextlib.suppress(Exception):
                    fn()

    def _repeat(self, signum: int) -> bool:
        """True for the same signal again within a second of the last one logged: a storm of
        SIGTERM/SIGHUP (a script in a loop) wrote one event line per signal (break-it 4: 300
        lines for 300 signals); the request is the same, so it is acted on but not logged."""
        now = time.monotonic()
        last = self._signal_logged.get(signum)
        if last is not None and now - last < 1.0:
            return True
        self._signal_logged[signum] = now
        return False

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGUSR1:
            self.request_scan()
        elif signum == signal.SIGHUP:
            if not self._repeat(signum):
                self.log.emit("signal", "SIGHUP: planned restart")
            self.request_restart()
        elif signum == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count <= 2 or not self._repeat(signum):
                self.log.emit(
                    "signal", "SIGINT: stopping" if self._sigint_count == 1 else "SIGINT again: kill at once"
                )
            self.request_stop(kill_now=self._sigint_count > 1)
        else:
            if not self._repeat(signum):
                self.log.emit("signal", f"{signal_name(signum)}: stopping")
            self.request_stop()

    def _on_stray_signal(self, signum: int) -> None:
        """A signal whose default action would end the supervisor (and leave the vLLM tree
        orphaned) but that means nothing to it: logged (at most once a second per signal), ignored."""
        if not self._repeat(signum):
            self.log.emit(
                "signal",
                f"{signal_name(signum)}: ignored (SIGTERM or SIGINT stops, SIGHUP restarts, SIGUSR1 takes a bundle)",
            )

    def install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGTERM/SIGINT stop, SIGHUP planned restart, SIGUSR1 scan for `xpu-serve bundle` requests.

        Every other signal whose default action terminates the process (`STRAY_SIGNALS`: SIGUSR2,
        SIGALRM, SIGPROF, real-time signals...) is logged and ignored: a stray `kill -USR2` must
        not kill the supervisor and orphan a running server. These are Python-level handlers, not
        SIG_IGN, so the engine's processes still get the default dispositions after exec."""
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            loop.add_signal_handler(s, self._on_signal, s)
        for stray in STRAY_SIGNALS:
            with contextlib.suppress(ValueError, RuntimeError, OSError):
                loop.add_signal_handler(stray, self._on_stray_signal, stray)

    # ---- state -------------------------------------------------------------------------------

    def status(self) -> Status:
        """The current Status (what state.json and observers get)."""
        procs = list(self.ctx.processes.values()) if self.ctx else []
        return Status(
            state=self.state,
            incarnation=self.incarnation,
            restarts=self.restarts,
            supervisor_pid=os.getpid(),
            processes=procs,
            last_incident=self.last_incident,
            next_restart_at=self.next_restart_at,
            reason=self.reason,
            shutting_down=self._stop_requested or self.state == "gave-up",
        )

    def _verify_lock(self) -> None:
        """Re-create and re-lock RUNTIME/supervisor.lock when its file is gone or replaced
        (`RuntimeLock.verify`); one warning per occurrence. Reopens events.jsonl likewise, first."""
        got = self._lock.verify()
        reopen = getattr(self.log, "reopen_if_moved", None)
        if callable(reopen):
            reopen()
        if got is not None and got[0] != self._lock_problem:
            self.log.emit("warning", got[0], lock=str(self._lock.path), relocked=got[1])
        self._lock_problem = None if got is None or got[1] else got[0]

    def _write_state(self) -> None:
        self._verify_lock()
        ctx = self.ctx
        e = self.config.engine
        cleanup_info: dict[str, Any] = {"run_id": self.run_id}
        if ctx is not None:
            cleanup_info.update(
                incarnation=ctx.incarnation,
                pgid=ctx.pgid,
                pids=[{"pid": p.pid, "create_time": p.started_at} for p in ctx.processes.values()],
                shm=sorted(ctx.shm_owned),
                # what appeared since the launch: candidates for the next `up` after a SIGKILL
                new_segments=sorted(cleanup.snapshot_segments() - ctx.shm_before) if ctx.shm_before else [],
                started_at=ctx.started_at,
            )
        data = status_dict(
            self.status(),
            run_id=self.run_id,
            supervisor_started_at=self.started_at,
            supervisor_create_time=self._create_time,
            engine={"host": e.host, "port": e.port, "served_model_name": e.served_model_name or e.model},
            config_path=str(self.config.source_path) if self.config.source_path else None,
            pgid=ctx.pgid if ctx else None,
            time_to_ready_s=self.time_to_ready_s,
            failures=self.failures,
            cleanup=cleanup_info,
            kernel_watch=self._kernel_watch_status(),
            heartbeat_s=self.heartbeat_s,
        )
        if ctx is not None:  # ProcessInfo cannot say "exited, status unknown": add exited_at
            data["processes"] = [
                dict(vars(p), exited_at=self._exited.get(p.pid)) for p in ctx.processes.values()
            ]
        try:
            how = write_state(self.runtime_dir, data)
        except OSError as ex:
            if not self._state_write_failing:  # once per failing streak, not every heartbeat
                self.log.emit("warning", f"cannot write state.json (it is stale from now on): {ex}")
            self._state_write_failing = True
            return
        if how != "atomic" and not self._state_write_failing:
            self.log.emit("warning", "state.json: no space for an atomic write; rewritten in place")
        self._state_write_failing = how != "atomic"

    def _kernel_watcher(self) -> Any:
        """The kernel log watcher among the plugged-in watchers (duck-typed), or None."""
        for w in self.watchers:
            if callable(getattr(w, "source_status", None)) and callable(getattr(w, "restart_blocker", None)):
                return w
        return None

    def _kernel_watch_status(self) -> dict[str, Any] | None:
        """`KernelWatcher.source_status()` ({source, reason, overruns}) for state.json and `status`;
        {"source": None, "reason": "disabled ..."} when no kernel watcher is attached."""
        kw = self._kernel_watcher()
        if kw is None:
            off = not self.config.watchers.kernel.enabled
            why = "disabled (watchers.kernel.enabled: false)" if off else "no kernel log watcher attached"
            return {"source": None, "reason": f"kernel log watch {why}", "overruns": 0}
        try:
            return dict(kw.source_status())
        except Exception:
            return None

    def _set_state(self, state: str, reason: str | None = None) -> None:
        self.state = state
        self.reason = reason
        self._write_state()
        st = self.status()
        for ob in self.observers:
            try:
                ob.on_state(st)
            except Exception as ex:  # an observer must never break supervision
                self.log.emit("warning", f"observer {type(ob).__name__} failed: {ex}")

    # ---- main loop -------------------------------------------------------------------------

    async def run(self) -> int:
        """Supervise until stopped (returns exitcodes.OK) or given up (GAVE_UP, GAVE_UP_AT_ONCE).

        Raises state.LockedError when another supervisor holds the runtime directory.
        """
        self._lock.acquire()
        self._refuse_if_predecessor_lives()
        watchers, observers = self._plugins_given
        if watchers is None or observers is None:
            from xpu_serve import plugins

            try:
                self.watchers = plugins.watchers_for(self.config) if watchers is None else watchers
                self.observers = (
                    plugins.observers_for(self.config, self.watchers, warn=lambda m: self.log.emit("warning", m))
                    if observers is None
                    else observers
                )
            except Exception as ex:  # a broken plugin must not stop supervision
                self.log.emit("warning", f"plugins: {type(ex).__name__}: {ex}")
        self._line_hooks = [
            w.on_line  # type: ignore[attr-defined]
            for w in self.watchers
            if callable(getattr(w, "on_line", None))
        ]
        loop = asyncio.get_running_loop()
        self._connector = (
            proc_src.ProcConnector.open() if os.environ.get("XPU_SERVE_PROC_CONNECTOR") != "0" else None
        )
        drain_task = None
        heartbeat = loop.create_task(self._heartbeat())
        ticker = loop.create_task(self._tick())
        # As PID 1 (a container without --init) re-parented vLLM orphans would stay zombies.
        reaper_task = loop.create_task(self._reap_every(REAP_INTERVAL_S)) if os.getpid() == 1 else None
        if self._connector is not None:
            # Drained lazily (each exit report drains it) plus once a second so the socket buffer
            # never overflows: waking the loop for every process exit on a busy host costs more.
            self._connector.interest = set()
            drain_task = loop.create_task(_drain_every(self._connector, 1.0))
        try:
            return await self._run()
        finally:
            await self._cancel_watchers()
            heartbeat.cancel()
            ticker.cancel()
            if reaper_task is not None:
                reaper_task.cancel()
            await asyncio.gather(heartbeat, ticker, *([reaper_task] if reaper_task else []), return_exceptions=True)
            if self._exitwatch:
                self._exitwatch.close()
            if drain_task is not None:
                drain_task.cancel()
            if self._connector is not None:
                self._connector.close()
            self._lock.release()

    def _refuse_if_predecessor_lives(self) -> None:
        """Raise LockedError when the supervisor state.json names still runs (`live_supervisor`:
        its pid, start time and cmdline) and has not written a final state (stopped, gave-up):
        its lock file was removed with the runtime directory, and its tree is live, not orphans
        to stop."""
        try:
            prev = read_state(self.runtime_dir)
        except (OSError, ValueError):
            return  # (reported by _sweep_previous)
        # (a supervisor that wrote its final state has released its lock and is exiting)
        done = prev.get("state") in ("stopped", "gave-up") if prev else True
        holder = cleanup.live_supervisor(prev) if prev and not done else None
        if holder is not None:
            self._lock.release()
            raise LockedError(self._lock.path, holder, "; it still runs though its lock file was removed")

    async def _reap_every(self, interval_s: float) -> None:
        """PID 1 only: every `interval_s` seconds reap the zombies of this run's engine sessions
        that the supervisor does not wait for itself (the API server it launched, processes whose
        exit the process watch has not reported yet: their status is read from the zombie)."""
        while True:
            await asyncio.sleep(interval_s)
            self._reap_now(set())

    def _reap_now(self, also: set[int]) -> None:
        """PID 1: reap the zombies of `also` (stopped members) and of the engine sessions now."""
        from xpu_serve.reaper import reap_orphans

        keep = set(self._exitwatch.pids) if self._exitwatch is not None else set()
        if self._popen is not None and self._popen.returncode is None:
            keep.add(self._popen.pid)
        try:
            got = reap_orphans(protected=keep, sessions=self._engine_sessions, also=also)
        except Exception as ex:  # never stop supervision over housekeeping
            self.log.emit("warning", f"reaper: {type(ex).__name__}: {ex}")
            return
        if got:
            self.reaped.extend(got)
            del self.reaped[:-1000]
            self.log.emit("reaped", f"reaped {len(got)} orphaned zombie(s): {got}", pids=got)

    async def _tick(self) -> None:
        """Note the time every TICK_S; remember the last gap over LOOP_STALL_S (`_loop_stall`)."""
        while True:
            await asyncio.sleep(TICK_S)
            now = time.time()
            if now - self._last_tick > LOOP_STALL_S:
                self._last_gap = (self._last_tick, now)
            self._last_tick = now

    def _loop_stall(self, seen: float) -> float | None:
        """Seconds the event loop had not run just before `seen` (epoch s), when over LOOP_STALL_S:
        the current gap, or one the ticker closed at most 2 ticks before `seen`; else None."""
        if seen - self._last_tick > LOOP_STALL_S:
            return seen - self._last_tick
        start, end = self._last_gap
        if end and 0 <= seen - end <= 2 * TICK_S + 0.05:
            return end - start
        return None

    async def _heartbeat(self) -> None:
        """Rewrite state.json every `heartbeat_s` seconds (its `written_at` proves it is current)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._write_state()

    async def _run(self) -> int:
        e = self.config.engine
        self.log.emit(
            "started",
            f"supervisor pid {os.getpid()} run {self.run_id}, runtime {self.runtime_dir}, "
            f"engine {' '.join(e.command)} {e.model} on {e.host}:{e.port}",
            run_id=self.run_id,
        )
        if self._connector is None:
            self.log.emit(
                "notice",
                "exit statuses of EngineCore and workers: from /proc only (the kernel's proc connector "
                "is not available here: a container, or CAP_NET_ADMIN on kernels before 6.6); "
                "a status may be reported as unknown",
            )
        await self._sweep_previous()
        await self._recover_pending()
        while True:
            if self._stop_requested:
                return self._finish_stopped()
            bad_host = await self._host_problem()
            if bad_host is not None:
                return self._give_up(exitcodes.GAVE_UP_AT_ONCE, f"engine.host: {bad_host}")
            if not cleanup.port_free(e.host, e.port):
                # ours were swept above; whoever holds the port now is another program
                # a listener we can name is another program: no point waiting for it
                owners = cleanup.port_owners(e.port)
                holder = cleanup.holder_of_removed_lock(owners, self._lock.path)
                if holder is not None:
                    # the engine of a supervisor whose runtime directory was removed under it
                    self._lock.release()
                    raise LockedError(self._lock.path, holder, "; it still runs though its lock file was removed")
                if owners or not await cleanup.wait_port_free(
                    e.host, e.port, self.config.supervision.stop.port_free_timeout_s
                ):
                    owners = owners or cleanup.port_owners(e.port)
                    who = ", ".join(f"pid {p} ({_comm(p)})" for p in owners) or "an unknown process"
                    return self._give_up(
                        exitcodes.GAVE_UP_AT_ONCE,
                        f"port {e.host}:{e.port} is taken by another program: {who}",
                    )
            outcome = await self._incarnation()
            ctx = self.ctx
            assert ctx is not None
            if ctx.trigger is not None and not self._stop_requested and not self._restart_requested_only():
                code = await self._handle_failure(ctx)
                if code is not None:
                    return code
                continue
            # stop or planned restart (a failure that raced with a stop is still captured)
            if ctx.trigger is not None:
                await self._capture(ctx)
            await self._stop_incarnation(ctx)
            if self._stop_requested:
                return self._finish_stopped()
            if outcome == "restart":
                self._restart_requested = False
                self.restarts += 1
                d = self.policy.planned_restart(time.monotonic())
                self.log.emit("restart", f"SIGHUP: {d.reason}")
                continue

    async def _host_problem(self) -> str | None:
        """Why engine.host cannot be served (`preflight.resolve_problem`, the message of `check`),
        or None. A resolver that does not answer (EAI_AGAIN) is asked again every second for up to
        `supervision.stop.port_free_timeout_s`."""
        from xpu_serve.preflight import resolve_problem

        e = self.config.engine
        deadline = time.monotonic() + self.config.supervision.stop.port_free_timeout_s
        while True:
            bad = await asyncio.to_thread(resolve_problem, e.host, e.port)
            if bad is None or not bad[1] or time.monotonic() >= deadline or self._stop_requested:
                return None if bad is None else bad[0]
            await asyncio.sleep(1.0)

    def _restart_requested_only(self) -> bool:
        ctx = self.ctx
        return self._restart_requested and (ctx is None or ctx.trigger is None)

    def _finish_stopped(self) -> int:
        self._set_state("stopped")
        self.log.emit("stopped", "server stopped; exit 0")
        return exitcodes.OK

    def _give_up(self, code: int, reason: str) -> int:
        self.next_restart_at = None
        self._set_state("gave-up", reason)
        self.log.emit("gave-up", reason, exit_code=code)
        return code

    async def _handle_failure(self, ctx: Incarnation) -> int | None:
        """failed -> capturing -> stopping -> backoff (or gave-up). Returns an exit code to end with."""
        incident = await self._capture(ctx)
        await self._stop_incarnation(ctx)
        if self._stop_requested:
            return self._finish_stopped()
        cause = incident.get("cause", "unknown")
        trig = ctx.trigger
        assert trig is not None
        fatal = cause in UNFIXABLE_CAUSES or trig.kind == "config"
        self.failures += 1
        d = self.policy.on_failure(time.monotonic(), fatal=fatal)
        if d.action == "give-up":
            code = d.exit_code if d.exit_code is not None else exitcodes.GAVE_UP
            if fatal:
                why = f"{cause}: {incident.get('summary') or trig.detail} (a restart cannot fix this)"
            else:
                why = f"{d.reason}; last cause: {cause}"
            return self._give_up(code, why)
        delay = d.delay_s
        kw = self._kernel_watcher()
        blocker: str | None = None
        if kw is not None:
            try:
                blocker = kw.restart_blocker()
            except Exception as ex:
                self.log.emit("warning", f"restart_blocker: {type(ex).__name__}: {ex}")
        self.next_restart_at = time.time() + delay
        self._set_state("backoff", blocker)
        self.log.emit(
            "restart-scheduled",
            f"restart in {delay:.2f} s ({d.reason}; cause {cause})"
            + (f"; held until the device is ready: {blocker}" if blocker else ""),
            delay_s=round(delay, 3),
            ceiling_s=d.ceiling_s,
            cause=cause,
            blocker=blocker,
        )
        self._wake.clear()
        if self._restart_requested:  # SIGHUP while capturing: restart now
            self._wake.set()
        # the device check runs from the start of the backoff, alongside the delay
        forced = False
        ready_task = (
            asyncio.get_running_loop().create_task(kw.wait_device_ready(DEVICE_CHECK_INTERVAL_S))
            if blocker
            else None
        )
        try:
            await aio.wait_event(self._wake, delay)
            if ready_task is not None and not ready_task.done() and not self._wake.is_set():
                self.next_restart_at = None
                self._set_state("backoff", blocker)
                self.log.emit("restart-held", f"restart held: {blocker}", reason=blocker)
                wake = asyncio.get_running_loop().create_task(self._wake.wait())
                try:
                    await asyncio.wait({ready_task, wake}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake.cancel()
            forced = ready_task is not None and not ready_task.done()
            if ready_task is not None and ready_task.done() and not ready_task.cancelled():
                if ready_task.exception() is None:
                    self.log.emit("device-ready", "device check passed: restarting")
                else:
                    self.log.emit("warning", f"device check failed: {ready_task.exception()}; restarting")
        finally:
            if ready_task is not None and not ready_task.done():
                ready_task.cancel()
                await asyncio.gather(ready_task, return_exceptions=True)
        self.next_restart_at = None
        if self._stop_requested:
            return self._finish_stopped()
        if forced and not self._stop_requested:
            self.log.emit("restart", "SIGHUP: restarting although the device check has not passed")
        self._restart_requested = False
        self.restarts += 1
        return None

    # ---- previous supervisor's orphans ------------------------------------------------------

    async def _sweep_previous(self) -> None:
        try:
            prev = read_state(self.runtime_dir)
        except ValueError as ex:
            self.log.emit("warning", str(ex))
            return
        if not prev:
            return
        # Only processes proven to be the previous run's are touched (issue 4, item 1): the
        # marker XPU_SERVE_RUN_ID=<old run id> in their environ, or the start time recorded for
        # their pid; the old process group only while its leader is proven (its id is reused
        # once the leader and its group are gone).
        info = prev.get("cleanup")
        if not isinstance(info, dict):
            info = {}
        old_run = info.get("run_id") if isinstance(info.get("run_id"), str) and info.get("run_id") else None
        pgid = info.get("pgid")
        if not isinstance(pgid, int) or isinstance(pgid, bool) or pgid <= 1:
            pgid = None
        starts: dict[int, float] = {}
        raw_pids = info.get("pids")
        for p in raw_pids if isinstance(raw_pids, list) else []:
            try:
                pid, ct = int(p["pid"]), p.get("create_time")
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            if isinstance(ct, (int, float)) and not isinstance(ct, bool):
                starts[pid] = float(ct)
        members = cleanup.find_members(old_run, None, [pgid] if pgid else [], list(starts), starts)
        members.discard(os.getpid())
        # the segments the orphans map or hold open are proven theirs (a kill -9 of the previous
        # supervisor right after launch leaves state.json without any): read before stopping them
        orphan_shm = cleanup.segments_of(members) if members else set()
        orphan_starts = [t for t in (cleanup.proc_start_time(p) for p in members) if t is not None]
        if members:
            self.log.emit(
                "orphans",
                f"previous supervisor (pid {prev.get('supervisor_pid')}, run {old_run}) left "
                f"{len(members)} process(es): {sorted(members)}; stopping them",
                pids=sorted(members),
            )
            rep = await cleanup.stop_tree(
                pgid,
                old_run,
                None,
                members,
                grace_s=self.config.supervision.stop.grace_s,
                starts=starts,
            )
            if rep.left:
                self.log.emit("warning", f"could not stop orphan(s) {rep.left}")
        started = info.get("started_at")
        seg = cleanup.remove_segments(
            None,
            set(info.get("shm") or []) | orphan_shm,
            float(started)
            if isinstance(started, (int, float))
            else min(orphan_starts, default=time.time()),  # (killed before it recorded the launch)
            old_run,
            candidates=set(info.get("new_segments") or []),
        )
        if seg.removed:
            kept = (
                f"; {len(seg.kept)} other new segment(s) not proven its were left alone" if seg.kept else ""
            )
            self.log.emit(
                "orphans",
                f"removed {len(seg.removed)} leftover segment(s) of the previous supervisor{kept}",
                removed=seg.removed,
                kept=seg.kept,
            )
        # what we could not attribute now is looked at again after our first incarnation
        self._carry_candidates = set(seg.kept)
        # say that the previous supervisor died (kill -9, OOM killer, power loss) and, when it died
        # while capturing, that an incident has no finished bundle: before, a kill -9 mid-capture
        # whose tree had already exited left no trace in the next run's events (break-it 4)
        pstate = prev.get("state")
        if isinstance(pstate, str) and pstate not in ("stopped", "gave-up"):
            inc = prev.get("incarnation")
            msg = (
                f"previous supervisor (pid {prev.get('supervisor_pid')}, run {old_run}) ended without a clean "
                f"stop while {pstate} (incarnation {inc})"
            )
            if pstate in ("failed", "capturing"):
                reason = prev.get("reason")
                msg += (
                    f"; the incident it was capturing{f' ({reason})' if isinstance(reason, str) and reason else ''}"
                    f" has no finished bundle: writing it from the logs kept in {self.runtime_dir}/logs/{inc}"
                )
            self.log.emit("orphans", msg, previous_state=pstate, previous_incarnation=inc)

    # ---- one incarnation -------------------------------------------------------------------

    async def _incarnation(self) -> str:
        """Launch and watch one incarnation; returns "failed", "stop" or "restart"."""
        loop = asyncio.get_running_loop()
        self.incarnation += 1
        n = self.incarnation
        log_dir = self.runtime_dir / "logs" / str(n)
        prev = await loop.run_in_executor(None, set_aside_old_logs, log_dir)
        if prev is not None:
            self.log.emit(
                "logs", f"logs of an earlier run in {log_dir} moved to {prev}", incarnation=n, moved_to=str(prev)
            )
        log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(OSError):
            os.chmod(log_dir.parent, 0o700)  # RUNTIME/logs (mkdir's mode is only for the leaf)
        await self._prune_logs(log_dir)
        ctx = Incarnation(
            incarnation=n,
            config=self.config,
            runtime_dir=self.runtime_dir,
            run_id=self.run_id,
            started_at=time.time(),
            log_dir=log_dir,
            on_fail=self._on_fail,
            on_record=self._on_record,
            restarts=self.restarts,
            _loop=loop,
            _thread=threading.get_ident(),
        )
        ctx.analyzer = _new_analyzer()
        self.ctx = ctx
        self._exited = {}
        self._pending_exits = []
        self._announced = False
        self._pending_other = None
        self._dying_at = {}
        if self._exit_timer is not None:
            self._exit_timer.cancel()
            self._exit_timer = None
        self._wake.clear()
        if self._stop_requested or self._restart_requested:  # a request that raced with the launch
            self._wake.set()
        self._set_state("starting")
        try:
            rendered = render(self.config)
        except Exception as ex:  # ConfigError from rendering: unfixable
            ctx.fail(Trigger(kind="config", detail=f"cannot render the engine command: {ex}", at=time.time()))
            return "failed"
        env = dict(os.environ)
        overrides = dict(rendered.env)
        overrides.update(
            {
                cleanup.INCARNATION_VAR: str(n),
                cleanup.RUN_ID_VAR: self.run_id,
                # keep /proc/PID/environ readable after setproctitle (our sweep reads the marker there)
                "SPT_NOENV": "1",
                "PYTHONUNBUFFERED": overrides.get("PYTHONUNBUFFERED", "1"),
            }
        )
        env.update(overrides)
        ctx.argv, ctx.env = rendered.argv, overrides
        self.redactor.add(secrets_in_env(rendered.env) + secrets_in_argv(rendered.argv))
        ctx.shm_before = cleanup.snapshot_segments()
        try:
            popen = subprocess.Popen(
                rendered.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
                close_fds=True,
                umask=self._engine_umask,
            )
        except OSError as ex:
            ctx.fail(
                Trigger(kind="config", detail=_cannot_start(rendered.argv[0], ex), at=time.time())
            )
            return "failed"
        self._popen = popen
        ctx.pgid = popen.pid
        self._engine_sessions.add(popen.pid)  # start_new_session: its pid is the session id
        ctx.started_at = time.time()
        # the kernel's start time (psutil create_time, as discovery records for the others): the
        # proof that a pid is still this process when the tree is stopped (cleanup.is_proven);
        # our unreaped child cannot have been replaced yet
        api_start = cleanup.proc_start_time(popen.pid)
        ctx.processes[popen.pid] = ProcessInfo(
            name="APIServer", pid=popen.pid, started_at=api_start if api_start is not None else ctx.started_at
        )
        self._write_state()
        self.log.emit(
            "launched",
            f"incarnation {n}: engine pid {popen.pid}: {' '.join(self.redactor.argv(rendered.argv))}",
            incarnation=n,
            pid=popen.pid,
        )
        ew = proc_src.ExitWatch(loop, self._on_exit, connector=self._connector, on_gone=self._on_gone)
        self._exitwatch = ew
        ew.watch(popen.pid, status=lambda: proc_src.returncode_status(popen.poll()))
        self._loop = loop
        pump = self._start_pump(loop, ctx, popen)
        ctx.pump = pump
        self._last_progress = time.monotonic()
        tasks = [
            loop.create_task(self._discover(ctx)),
            loop.create_task(self._readiness(ctx)),
        ]
        self._watch_tasks = [loop.create_task(self._run_watcher(w, ctx)) for w in self.watchers]
        try:
            await self._wake.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if ctx.trigger is None:  # stop or planned restart: nothing left to capture
                await self._cancel_watchers()
        # On a failure the watchers keep running through `capturing` (a kernel record written
        # just after the process died is still recorded; their ctx.fail() calls are ignored);
        # `_stop_incarnation` cancels them once the bundle is written.
        if ctx.trigger is not None:
            return "failed"
        return "stop" if self._stop_requested else "restart"

    async def _prune_logs(self, current: Path) -> None:
        """Log retention (`logdirs.prune_logs`, config `logs`); a `logs` event names what went."""
        lc = self.config.logs
        rep = await asyncio.to_thread(
            logdirs.prune_logs, current.parent, lc.keep_incarnations, lc.max_bytes, current
        )
        if rep.removed:
            self.log.emit(
                "logs",
                f"removed {len(rep.removed)} old log folder(s) (logs.keep_incarnations "
                f"{lc.keep_incarnations}, logs.max_bytes {lc.max_bytes}): {', '.join(rep.removed)}",
                removed=rep.removed,
            )
        for err in rep.errors[:3]:
            self.log.emit("warning", f"log retention: {err}")

    async def _cancel_watchers(self) -> None:
        """Cancel the current incarnation's watcher tasks and wait for them (idempotent)."""
        tasks, self._watch_tasks = self._watch_tasks, []
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start_pump(
        self, loop: asyncio.AbstractEventLoop, ctx: Incarnation, popen: subprocess.Popen[bytes]
    ) -> LogPump:
        """Start the log pump (it owns the pipes from here on); lines reach `_on_line` on the loop."""
        pump = LogPump(
            ctx.log_dir,
            incarnation=ctx.incarnation,
            echo=self._echo_out,
            on_line=self._line_from_pump,
            # the supervisor's own probes (health, readiness, hang watchdog) would fill journald /
            # docker logs with an access line every few seconds; they stay in vllm.log
            echo_quiet_paths=ECHO_QUIET_PATHS,
            secrets=self.redactor.secrets,
        )
        self._log_file = str(pump.log_path)
        pump.start(cast(BinaryIO, popen.stdout), cast(BinaryIO, popen.stderr))
        return pump

    def _line_from_pump(self, line: str, lineno: int) -> None:
        """Pump writer thread: hand the line to the watchers' `on_line` hooks (cheap, thread-safe:
        a substring test each), queue it for the loop, wake the loop once per batch (not per line)."""
        for hook in self._line_hooks:
            try:
                hook(line, self._log_file, lineno)
            except Exception:  # a watcher's bug must not cost the pump its lines
                pass
        self._line_q.append((line, lineno))
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            with contextlib.suppress(RuntimeError):  # loop closed at exit
                self._loop.call_soon_threadsafe(self._drain_lines)

    def _drain_lines(self) -> None:
        self._drain_scheduled = False
        q = self._line_q
        while q:
            line, lineno = q.popleft()
            self._on_line(line, self._log_file, lineno)

    async def _run_watcher(self, w: Watcher, ctx: Incarnation) -> None:
        try:
            await w.run(ctx)
        except asyncio.CancelledError:
            raise
        except Exception as ex:
            self.log.emit(
                "warning", f"watcher {getattr(w, 'name', type(w).__name__)} failed: {type(ex).__name__}: {ex}"
            )

    # ---- live inputs -----------------------------------------------------------------------

    def _on_line(self, line: str, file: str, lineno: int) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        self._last_progress = time.monotonic()
        ctx.shm_owned |= cleanup.dist_paths_in_line(line)  # our own init file, named by our tree
        name, pid, _ = split_process_prefix(line)
        if pid is not None:
            if pid in ctx.processes:
                proc_src.learn_prefix(ctx.processes, name, pid)
            elif ctx.ready_at is None:
                self._discover_now.set()
        an = ctx.analyzer
        if an is None:
            return
        try:
            ev = an.feed_line(line, file, lineno)
        except Exception:
            return
        if ctx.trigger is None and _is_fatal(an, ev):
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

    def _on_record(self, event: Event) -> None:
        ctx = self.ctx
        if ctx is not None and ctx.analyzer is not None:
            with contextlib.suppress(Exception):
                ctx.analyzer.add_event(event)
        for ob in self.observers:
            fn = getattr(ob, "on_event", None)
            if callable(fn):
                with contextlib.suppress(Exception):
                    fn(event)

    def _on_exit(self, pid: int, code: int | None, sig: str | None, at: float) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        info = ctx.processes.get(pid)
        if info is None or pid in self._exited:  # (the API server may be reported twice: _child_died)
            return
        info.exit_code, info.signal = code, sig
        seen = at
        died = self._exitwatch.died_at.pop(pid, None) if self._exitwatch is not None else None
        at = died if died is not None else seen
        self._exited[pid] = at
        self._on_record(facts.process_exit(info.name, pid, info.rank, code, sig, at))
        if sig:
            how = f"killed by {sig}"
        elif code is not None:
            how = f"exit code {code}"
        else:
            how = "exit status unknown"
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
            loop_stall_s=self._loop_stall(seen),
        )
        if ctx.trigger is not None or self.state not in ("starting", "ready"):
            return
        if not self._pending_exits and not self._announced:
            # the failure is known now; naming the first death may take the exit window below
            self._announce(ctx, trig.detail, pid, at)
        # Exits come in a burst when the tree tears itself down (kill -9 of the API server: its
        # children exit 0 right after; the order the exits are reported in is not the order of
        # death). Collect the burst, then name the first abnormal death (`_exit_rank`).
        if pid in self._dying_at:
            trig.at = min(trig.at, self._dying_at[pid])
        self._pending_exits.append((ctx, trig))
        self._open_window(ctx, min(at, time.time()))
        # An abnormal death (a signal, a non-zero code) reported while no other watched process
        # is dying is the first death: decide now, so detection keeps its milliseconds (the
        # window only matters for teardown bursts, whose first report may be a clean exit 0).
        abnormal = sig is not None or (code is not None and code != 0)
        deferred = self._exitwatch is not None and bool(self._exitwatch.deferred)
        if abnormal and len(self._pending_exits) == 1 and not deferred and not any(
            p not in self._exited for p in self._dying_at
        ):
            self._commit_exits()

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
        if ctx is None or info is None or pid in self._exited or self._announced:
            return
        if ctx.trigger is None and self.state in ("starting", "ready") and not self._pending_exits:
            self._announce(ctx, f"{info.name} (pid {pid}) died", pid, at)

    def _open_window(self, ctx: Incarnation, first: float) -> None:
        """Start the exit window (once per burst). A watched process whose exit the kernel is
        still carrying out (a SIGKILLed API server unmapping its memory while its children already
        saw their pipes close and exited) died no later than `first` (epoch s)."""
        if self._exit_timer is not None:
            return
        for other in ctx.processes:
            if other not in self._exited and _exiting(other):
                self._dying_at.setdefault(other, first)
        loop = self._loop or asyncio.get_running_loop()
        self._exit_window_end = time.monotonic() + EXIT_WINDOW_S + 1.0
        self._exit_timer = loop.call_later(EXIT_WINDOW_S, self._commit_exits)

    def _commit_exits(self) -> None:
        """End of the exit window: fail the incarnation with the best-ranked exit (`_exit_rank`),
        else with the other trigger held while exits were under way."""
        if self._exit_timer is not None:
            self._exit_timer.cancel()
            self._exit_timer = None
        self._child_died()
        waiting = [p for p in self._dying_at if p not in self._exited]
        if self._exitwatch is not None:
            waiting += self._exitwatch.deferred  # dead, status still on its way (ExitWatch)
        if waiting and time.monotonic() < self._exit_window_end:
            # wait (at most 1 s more) for the exits already under way to be reported
            loop = self._loop or asyncio.get_running_loop()
            self._exit_timer = loop.call_later(0.05, self._commit_exits)
            return
        pending, self._pending_exits = self._pending_exits, []
        self._announced = False
        other, self._pending_other = self._pending_other, None
        mine = [t for c, t in pending if c is self.ctx]
        if mine:
            self._accept_fail(min(mine, key=_exit_rank))
        elif other is not None and other[0] is self.ctx:
            self._accept_fail(other[1])

    def _child_died(self) -> bool:
        """Our direct child (the API server) was killed by a signal but its exit is not reported
        yet (waitpid, via Popen.poll, knows): report it now. True when it did."""
        ctx, popen = self.ctx, self._popen
        if ctx is None or popen is None or ctx.pgid != popen.pid or popen.pid in self._exited:
            return False
        rc = popen.poll()
        if rc is None or rc >= 0:
            return False
        code, sig = proc_src.returncode_status(rc)
        self._on_exit(popen.pid, code, sig, time.time())
        return True

    def _on_fail(self, trigger: Trigger) -> None:
        """A trigger fired (the first one wins). Process exits are ranked in `_commit_exits`;
        another trigger (a consequence line such as "Worker ... died unexpectedly" can be read
        before the API server's death is reported) is held while an exit is pending or under way
        (PF_EXITING), and used only when no exit is reported within the window."""
        ctx = self.ctx
        if ctx is None or ctx.trigger is not None or self.state not in ("starting", "ready"):
            return
        if trigger.kind == "process-exit":
            self._accept_fail(trigger)
            return
        self._child_died()
        if self._pending_exits or self._exit_timer is not None:
            if self._pending_other is None:
                self._pending_other = (ctx, trigger)
            return
        now = time.time()
        if any(p not in self._exited and _exiting(p) for p in ctx.processes):
            self._pending_other = (ctx, trigger)
            self._open_window(ctx, min(trigger.at, now))
            return
        self._accept_fail(trigger)

    def _accept_fail(self, trigger: Trigger) -> None:
        ctx = self.ctx
        if ctx is None or ctx.trigger is not None or self.state not in ("starting", "ready"):
            return
        ctx.trigger = trigger
        lat_ms = (time.time() - trigger.at) * 1000
        self.state = "failed"
        self.log.emit(
            "failed",
            f"incarnation {ctx.incarnation}: {trigger.detail} ({trigger.kind})",
            incarnation=ctx.incarnation,
            trigger=trigger.kind,
            process=trigger.process,
            rank=trigger.rank,
            pid=trigger.pid,
            signal=trigger.signal,
            exit_code=trigger.exit_code,
            at=trigger.at,
            at_source=trigger.at_source,
            detected_at=trigger.detected_at if trigger.detected_at is not None else trigger.at,
            loop_stall_s=trigger.loop_stall_s,
            detect_ms=round(lat_ms, 3),
        )
        self._set_state("failed")
        self._wake.set()

    # ---- discovery, readiness, health ----------------------------------------------------

    def _expected_names(self) -> set[str]:
        tp = self.config.engine.tensor_parallel_size
        workers = {"Worker"} if tp == 1 else {f"Worker_TP{r}" for r in range(tp)}
        return {"APIServer", "EngineCore"} | workers

    async def _discover(self, ctx: Incarnation) -> None:
        """Find the tree's processes while starting (100 ms polls until all expected are seen,
        then on demand when a log line names an unknown pid); watch each for exit."""
        assert ctx.pgid is not None and self._exitwatch is not None
        expected = self._expected_names()
        while True:
            found = proc_src.discover(ctx.pgid)
            changed = False
            for pid, info in found.items():
                if pid not in ctx.processes:
                    ctx.processes[pid] = info
                    self._exitwatch.watch(pid)
                    changed = True
            # segments our processes map or hold open: the only proof of ownership we get
            live = [p for p in ctx.processes if p not in self._exited]
            seen = cleanup.segments_of(live)
            if changed or not seen <= ctx.shm_owned:
                ctx.shm_owned |= seen
                self._write_state()
            names = {p.name for p in ctx.processes.values()}
            self._discover_now.clear()
            if ctx.ready_at is not None and expected <= names:
                await self._discover_now.wait()
            else:
                # all found: keep watching for new segments until ready, at a slower pace
                await aio.wait_event(self._discover_now, 0.1 if not expected <= names else 0.5)

    async def _readiness(self, ctx: Incarnation) -> None:
        """starting -> ready, then /health failure counting; start-up stall and overall limits."""
        e = self.config.engine
        sv = self.config.supervision
        url = health_src.base_url(e.host, e.port)
        served = e.served_model_name or e.model
        poll = min(0.25, sv.health.interval_s)
        async with health_src.make_client(sv.health.timeout_s, e.api_key) as client:
            t0 = time.monotonic()
            own_stall = not any(getattr(w, "name", "") == "startup-stall" for w in self.watchers)
            while True:
                ok, detail = await health_src.probe_ready(client, url, served)
                if ok:
                    break
                now = time.monotonic()
                if now - t0 > sv.startup.timeout_s:
                    ctx.fail(
                        Trigger(
                            kind="startup-timeout",
                            at=time.time(),
                            detail=f"not ready after {sv.startup.timeout_s:g} s (last probe: {detail})",
                        )
                    )
                    return
                if own_stall and now - self._last_progress > sv.startup.stall_s:
                    stalled = now - self._last_progress
                    ev = facts.startup_stall(stalled, "unknown", [])
                    self._on_record(ev)
                    ctx.fail(
                        Trigger(
                            kind="startup-stall",
                            at=time.time(),
                            event=ev,
                            detail=f"no start-up progress for {stalled:.1f} s",
                        )
                    )
                    return
                await asyncio.sleep(poll)
            ctx.ready_at = time.time()
            self.time_to_ready_s = ctx.ready_at - ctx.started_at
            ctx.shm_owned |= cleanup.segments_of(ctx.processes)
            self.log.emit(
                "ready",
                f"incarnation {ctx.incarnation} ready in {self.time_to_ready_s:.2f} s at {url} "
                f"({len(ctx.processes)} processes)",
                incarnation=ctx.incarnation,
                time_to_ready_s=round(self.time_to_ready_s, 3),
            )
            self.policy.on_ready(time.monotonic())
            self._set_state("ready")
            mon = health_src.HealthMonitor(
                client,
                url,
                sv.health.interval_s,
                sv.health.failures,
                on_failure=lambda n, d: self._health_failed(ctx, n, d),
            )
            await mon.run()

    def _health_failed(self, ctx: Incarnation, n: int, detail: str) -> None:
        ev = facts.health_failed(n, detail)
        self._on_record(ev)
        ctx.fail(Trigger(kind="health", detail=ev.text, at=time.time(), event=ev))

    # ---- failure handling --------------------------------------------------------------------

    async def _settle(self, quiet_s: float = 0.15, max_s: float = 1.0) -> None:
        """Let the dying tree's last lines arrive (pipes are drained by the pump)."""
        t_end = time.monotonic() + max_s
        while time.monotonic() < t_end:
            if time.monotonic() - self._last_progress >= quiet_s:
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
            if pid in self._exited
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

    async def _capture(self, ctx: Incarnation) -> dict[str, Any]:
        """Record the incident: analysis and bundle, before anything is killed."""
        self._set_state("capturing", ctx.trigger.detail if ctx.trigger is not None else None)
        recovery.mark_pending(ctx.log_dir, self._pending_marker(ctx))
        await self._settle()
        if ctx.pump is not None:
            await asyncio.to_thread(ctx.pump.flush, 2.0)
            self._drain_lines()
        await self._settle_kernel(ctx)
        ctx.shm_owned |= cleanup.segments_of(ctx.processes)
        trig = ctx.trigger
        assert trig is not None
        incident_obj: Any = None
        contract: dict[str, Any] = {}
        if ctx.analyzer is not None:
            try:
                incident_obj = ctx.analyzer.incident()
                contract = dict(incident_obj.to_contract())
            except Exception as ex:
                self.log.emit("warning", f"analysis failed: {type(ex).__name__}: {ex}")
        complete_contract(contract, trig, ctx.processes)
        contract["supervisor"] = {
            "trigger": {k: v for k, v in vars(trig).items() if k != "event"},
            "incarnation": ctx.incarnation,
            "restarts": self.restarts,
            "started_at": ctx.started_at,
            "ready_at": ctx.ready_at,
            "failed_at": trig.at,
            "processes": [vars(p).copy() for p in ctx.processes.values()],
        }
        bundle_path = await self._write_bundle(ctx, trig, incident_obj, contract)
        if bundle_path:
            recovery.clear_pending(ctx.log_dir)
        cause = contract.get("cause", "unknown")
        self.last_incident = {
            "cause": cause,
            "time": trig.at,
            "bundle": bundle_path,
            "summary": contract.get("summary"),
        }
        self._write_state()
        self.log.emit(
            "incident",
            f"incarnation {ctx.incarnation}: cause {cause}: {contract.get('summary') or trig.detail}"
            + (f"; bundle {bundle_path}" if bundle_path else ""),
            cause=cause,
            bundle=bundle_path,
        )
        self._print_report(ctx, incident_obj, bundle_path)
        for ob in self.observers:
            try:
                ob.on_incident(contract, bundle_path)
            except Exception as ex:
                self.log.emit("warning", f"observer {type(ob).__name__} failed: {ex}")
        return contract

    def _pending_marker(self, ctx: Incarnation) -> dict[str, Any]:
        """What the next `up` needs to write this incident's bundle after a kill -9 (`recovery`)."""
        trig = ctx.trigger
        return {
            "run_id": self.run_id,
            "supervisor_pid": os.getpid(),
            "incarnation": ctx.incarnation,
            "restarts": self.restarts,
            "started_at": ctx.started_at,
            "ready_at": ctx.ready_at,
            "trigger": {k: v for k, v in vars(trig).items() if k != "event"} if trig is not None else None,
            "processes": [dict(vars(p), exited_at=self._exited.get(p.pid)) for p in ctx.processes.values()],
        }

    async def _recover_pending(self) -> None:
        """Write the bundles of the incidents a killed supervisor was capturing (`recovery`), from
        their kept logs, before any log folder is moved or pruned; one `incident` event each."""
        for d in recovery.pending_dirs(self.runtime_dir / "logs"):
            path, contract = await asyncio.to_thread(
                recovery.recover_one, d, self.runtime_dir, self.config, os.getpid()
            )
            cause = contract.get("cause", "unknown")
            self.log.emit(
                "incident",
                f"recovered incident of {d}: cause {cause}: {contract.get('summary') or ''}"
                + (f"; bundle {path}" if path else "; no bundle could be written (the logs are kept)")
                + " (its capture was cut by a kill -9 of the supervisor)",
                cause=cause,
                bundle=path,
                recovered=True,
            )
            for ob in self.observers:
                with contextlib.suppress(Exception):
                    ob.on_incident(contract, path)

    def _print_report(self, ctx: Incarnation, incident: Any, bundle_path: str | None) -> None:
        """The compact one-screen report (`report.render_compact`) as one "report" event, its
        FILE:LINE references relative to the bundle."""
        if incident is None:
            return
        try:
            from xpu_serve.report import render_compact

            lines = render_compact(incident, files=_bundle_files(ctx))
        except Exception as ex:
            self.log.emit("warning", f"report failed: {type(ex).__name__}: {ex}")
            return
        head = f"incarnation {ctx.incarnation}" + (f"; full report {bundle_path}/report.txt" if bundle_path else "")
        self.log.emit("report", "\n".join([head, *("  " + ln for ln in lines)]), lines=lines)

    async def _write_bundle(
        self, ctx: Incarnation, trig: Trigger, incident: Any, contract: dict[str, Any]
    ) -> str | None:
        """The bundle (xpu_serve.bundle), written in a thread so signals are still handled."""
        try:
            from xpu_serve.bundle import write_incident_bundle
        except ImportError:
            return await asyncio.to_thread(_minimal_bundle, ctx, contract)
        report_text = _report_text(incident, contract, ctx)
        # the hang watchdog dumps the stacks before it fails the incarnation (event.extra["stacks"])
        stacks = trig.event.extra.get("stacks") if trig.event is not None else None
        if not isinstance(stacks, dict):
            stacks = None
        res = await asyncio.to_thread(write_incident_bundle, ctx, trig, contract, report_text, stacks)
        if getattr(res, "errors", None):
            self.log.emit("warning", f"bundle incomplete: {'; '.join(str(e) for e in res.errors[:3])}")
        path = getattr(res, "path", None)
        return str(path) if path else None

    async def _stop_incarnation(self, ctx: Incarnation) -> None:
        """stopping: stop the tree, sweep, verify, remove leftovers, wait for the port."""
        await self._cancel_watchers()
        self._set_state("stopping")
        if self._exitwatch is not None:
            self._exitwatch.close()
            self._exitwatch = None
        sv = self.config.supervision
        ctx.shm_owned |= cleanup.segments_of(ctx.processes)  # last proof of ownership (issue 4 item 6)
        rep = await cleanup.stop_tree(
            ctx.pgid,
            self.run_id,
            ctx.incarnation,
            list(ctx.processes),
            grace_s=sv.stop.grace_s,
            kill_now=self._kill_now,
            starts=_starts(ctx),
            # a hang verdict's evidence is captured: what cannot exit gets SIGKILL early
            hang=ctx.trigger is not None and _fallback_cause(ctx.trigger) == "engine-hang",
        )
        ctx.stop = rep
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=1.0)
        if os.getpid() == 1:
            # PID 1: members that left the engine's session (setsid, a detached grandchild) were
            # swept by the run marker and are now our zombies; the periodic reaper only looks at
            # the engine's sessions, so reap them here (the API server is Popen's to wait for).
            self._reap_now(set(rep.terminated) | set(rep.killed))
        if ctx.pump is not None:
            await asyncio.to_thread(ctx.pump.wait_eof, 2.0)
            stats = await asyncio.to_thread(ctx.pump.close, 2.0)
            self._drain_lines()
            if stats.dropped_lines:
                self.log.emit(
                    "warning", f"incarnation {ctx.incarnation}: log pump dropped {stats.dropped_lines} lines"
                )
        if rep.left:
            self.log.emit("warning", f"incarnation {ctx.incarnation}: process(es) {rep.left} survive SIGKILL")
        seg = cleanup.remove_segments(
            ctx.shm_before, ctx.shm_owned, ctx.started_at, self.run_id, candidates=self._carry_candidates
        )
        self._carry_candidates = set()
        e = self.config.engine
        port_ok = await cleanup.wait_port_free(e.host, e.port, sv.stop.port_free_timeout_s)
        self.log.emit(
            "cleaned",
            f"incarnation {ctx.incarnation}: stopped in {rep.seconds:.2f} s ({len(rep.terminated)} SIGTERM, "
            f"{len(rep.killed)} SIGKILL, {len(rep.left)} left"
            + (f"; {rep.early_text()}" if rep.early else "")
            + f"); removed {len(seg.removed)} segment(s)"
            + ("" if port_ok else f"; port {e.port} still taken"),
            killed=rep.killed,
            left=rep.left,
            removed=seg.removed,
            kept=seg.kept,
        )


def complete_contract(contract: dict[str, Any], trig: Trigger, processes: dict[int, ProcessInfo]) -> None:
    """Finish the verdict contract (in place) with what the supervisor saw itself: the signal a
    process of unknown exit status died by when its own crash dump names it (`signal_from_verdict`;
    also set on `trig` and its ProcessInfo), and the trigger's cause and detail when nothing in
    the logs supports a verdict (`_fallback_cause`)."""
    sig = signal_from_verdict(contract, trig)
    if sig is not None:
        # the exit status was lost (the worker's parent reaped it first, no proc connector
        # here) but the root is the process's own crash dump naming the signal
        trig.signal = sig
        info = processes.get(trig.pid) if trig.pid is not None else None
        if info is not None and info.signal is None and info.exit_code is None:
            info.signal = sig
        notes = contract.setdefault("notes", [])
        if isinstance(notes, list):
            notes.append(
                f"{trig.process} (pid {trig.pid}): exit status not seen by the supervisor; "
                f"signal {sig} taken from its crash dump"
            )
    timing = _death_time_note(trig)
    if timing:
        notes = contract.setdefault("notes", [])
        if isinstance(notes, list):
            notes.append(timing)
    if contract.get("cause") in (None, "", "unknown"):
        # nothing in the logs supports a verdict: say what the supervisor itself saw
        fb = _fallback_cause(trig)
        contract["cause"] = fb
        if fb != "unknown" or not contract.get("summary"):
            contract["summary"] = trig.detail


def _death_time_note(trig: Trigger) -> str | None:
    """A note when the supervisor saw a process exit late (its loop stalled), saying how well
    the time of death is known; None otherwise."""
    if trig.kind != "process-exit" or not trig.loop_stall_s or trig.detected_at is None:
        return None
    iso = _iso(trig.detected_at)
    who = f"{trig.process} (pid {trig.pid})"
    stall = f"the supervisor had not run for {trig.loop_stall_s:.1f} s (stopped or starved)"
    if trig.at_source == "kernel":
        return f"{who}: died at {_iso(trig.at)} (the kernel's exit event), seen at {iso}: {stall}"
    return (
        f"{who}: seen dead at {iso} after {stall}; it died no later than that, and the real time "
        "of death is unknown (no kernel exit event: the proc connector is not available)"
    )


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


async def _drain_every(conn: proc_src.ProcConnector, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        conn.drain()


def _starts(ctx: Incarnation) -> dict[int, float]:
    """pid -> start time (epoch s, psutil create_time) of the incarnation's known processes."""
    return {pid: p.started_at for pid, p in ctx.processes.items() if isinstance(p.started_at, (int, float))}


def signal_from_verdict(contract: dict[str, Any], trig: Trigger) -> str | None:
    """The signal ("SIGSEGV"...) a process-exit trigger of unknown status died by, as its own
    crash dump says, or None.

    Only when the trigger is a process exit with neither code nor signal known, and the verdict's
    root (`contract["root"]`: process, pid, text, evidence) is that same process (by pid, or by name
    when the root has no pid, as for an unprefixed dump the analysis attributed to it), and the
    root's text or one of its evidence lines is a crash dump the signature table reads a signal
    name from (`signame`: "Fatal Python error: Segmentation fault", "!!!!!!! Segfault encountered
    !!!!!!!"; `diagnosis.death_signal` maps it)."""
    from xpu_serve.diagnosis import death_signal
    from xpu_serve.signatures import load_table

    if trig.kind != "process-exit" or trig.signal is not None or trig.exit_code is not None:
        return None
    root = contract.get("root")
    if not isinstance(root, dict):
        return None
    same = root.get("pid") == trig.pid if root.get("pid") is not None else root.get("process") == trig.process
    if not same:
        return None
    texts = [root.get("text")] + [e.get("text") for e in root.get("evidence") or [] if isinstance(e, dict)]
    table = load_table()
    for text in texts:
        if not isinstance(text, str):
            continue
        ev = Event(source="vllm", text=text, raw=text)
        m = table.match(ev)
        if m is None or "signame" not in m[1].groupdict():
            continue
        ev.extra["signame"] = m[1].group("signame")
        got = death_signal(ev)
        if got:
            return got
    return None


def _exiting(pid: int) -> bool:
    """True when `pid` is gone, a zombie, or exiting: PF_EXITING (0x4, include/linux/sched.h,
    set by exit_signals() at the start of do_exit) in the flags field (9) of /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & 0x4)
    except (IndexError, ValueError):
        return False


# Deaths no process inflicts on itself in reaction to a peer's death: a fault (the CPU's or
# the driver's) or a kill from outside (the OOM killer, an operator). SIGABRT, SIGTERM and exit
# codes are how oneCCL, NCCL and vLLM's executor react to a dead peer.
_PRIMARY_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGKILL"})


def _exit_rank(t: Trigger) -> tuple[int, float, int]:
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


def _cannot_start(program: str, ex: OSError) -> str:
    """One line for an engine command that cannot be executed. ENOENT for a file that exists
    means its `#!` interpreter is missing (execve(2)); say so rather than "No such file"."""
    import errno as errno_mod
    import shutil

    path = shutil.which(program) or program
    if ex.errno == errno_mod.ENOENT and os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                first = f.readline(256)
        except OSError:
            first = b""
        if first.startswith(b"#!"):
            interp = first[2:].strip().decode("utf-8", "replace").split(" ")[0]
            return f"cannot start {program!r}: its #! interpreter {interp!r} does not exist"
    return f"cannot start {program!r}: {ex.strerror}"


def _fallback_cause(trig: Trigger) -> str:
    return {
        "process-exit": "process-crash",
        # /health timing out while every process lives is a hung server; failing (503, refused)
        # follows a death the process watch may not have reported
        "health": "engine-hang" if trig.detail.endswith(": timed out") else "process-crash",
        "startup-stall": "startup-hang",
        "startup-timeout": "startup-hang",
        "hang": "engine-hang",
        "config": "config-error",
    }.get(trig.kind, "unknown")


def _bundle_files(ctx: Any) -> Any:
    """`report.bundle_paths` of this incarnation: its log folder and the kernel log file it follows."""
    from xpu_serve.report import bundle_paths

    kcfg = ctx.config.watchers.kernel
    return bundle_paths(ctx.log_dir, kcfg.path if kcfg.source == "file" else None)


def _report_text(incident: Any, contract: dict[str, Any], ctx: Any) -> str:
    """The people's report (`report.render_text(incident)`, what `diagnose` prints) with FILE:LINE
    relative to the bundle (logs/vllm.log:123), or a short fallback."""
    if incident is not None:
        try:
            from xpu_serve.report import render_text

            return render_text(incident, files=_bundle_files(ctx))
        except Exception:
            pass
    return f"cause: {contract.get('cause')}\n{contract.get('summary') or ''}\n"


def _minimal_bundle(ctx: Incarnation, contract: dict[str, Any]) -> str:
    """Until `xpu_serve.bundle` lands: RUNTIME/bundles/<UTC>-i<N>-<cause>/incident.json only."""
    t = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    d = Path(ctx.runtime_dir) / "bundles" / f"{t}-i{ctx.incarnation}-{contract.get('cause', 'unknown')}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    (d / "incident.json").write_text(json.dumps(contract, indent=2, default=str) + "\n")
    return str(d)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def signal_name(signum: int) -> str:
    return proc_src.signal_name(signum)


def run_supervisor(
    config: Config, runtime_dir: Path, log: EventLog, echo: bool = True, engine_umask: int | None = None
) -> int:
    """Run a Supervisor on a fresh event loop with signal handlers; returns the exit code.

    Raises state.LockedError when the runtime directory is held by another supervisor.
    """
    sup = Supervisor(config, runtime_dir, log=log, echo=echo, engine_umask=engine_umask)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        sup.install_signal_handlers(loop)
        try:
            return await sup.run()
        finally:
            # the server is stopped and swept: from here on a signal has nothing left to do. Left
            # to asyncio, closing the loop restored the default actions, and a SIGTERM of a storm
            # arriving then killed the exiting supervisor (exit -15 instead of 0; break-it 4)
            _ignore_signals_from_now_on(loop)

    return asyncio.run(main())


def _ignore_signals_from_now_on(loop: asyncio.AbstractEventLoop) -> None:
    """Replace the loop's signal handlers by SIG_IGN (the loop would reset them to SIG_DFL when it
    closes). The main thread blocks them meanwhile, so the switch has no default-action window."""
    sigs = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, *STRAY_SIGNALS}
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        for s in sigs:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                loop.remove_signal_handler(s)
                signal.signal(s, signal.SIG_IGN)
    finally:
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
