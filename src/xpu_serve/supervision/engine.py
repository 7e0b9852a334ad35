"""`Engine`: the engine's process tree, from launch to the free port.

Launch (own session and process group, the run marker in the environment, the log pump on its
pipes), process-tree discovery (`sources.processes.discover`) and ownership proof (segments
mapped or open by our processes, `cleanup.segments_of`), the ordered stop and sweep
(`cleanup.stop_tree`), shared-memory clean-up (`cleanup.remove_segments`), the port and host
checks before a launch, the previous supervisor's orphans, and PID-1 reaping.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TextIO, cast

from xpu_serve import aio, cleanup, logdirs, procfs
from xpu_serve.config import Config
from xpu_serve.events import split_process_prefix
from xpu_serve.incarnation import ProcessInfo, Trigger
from xpu_serve.redact import Redactor, secrets_in_argv, secrets_in_env
from xpu_serve.sources import processes as proc_src
from xpu_serve.sources.log_pump import LogPump
from xpu_serve.state import LockedError, read_state
from xpu_serve.supervision.context import Incarnation
from xpu_serve.supervision.eventlog import EventLog
from xpu_serve.vllm_command import render

GROUP_EPOCH_VAR = "XPU_SERVE_GROUP_EPOCH"
"""The engine's environment variable holding its multi-node group's epoch (group/watcher.py)."""

# uvicorn access lines of these paths (status < 400) are not echoed (xpu_serve.sources.log_pump)
ECHO_QUIET_PATHS = ("/health", "/metrics", "/v1/models")
REAP_INTERVAL_S = 0.5  # PID 1: how often re-parented zombies of the engine sessions are reaped


class Engine:
    """The engine's process tree for one supervisor run.

    Args:
        config: the validated Config; run_id: this supervisor's run marker (12 hex digits).
        log: the EventLog; redactor: the known secrets (the engine's argv and env are added).
        echo: the stream the engine's output is echoed on (tagged `[iN] `), or None.
        engine_umask: the umask the engine starts with (-1: the supervisor's own).
        protected: pids the PID-1 reaper must leave alone (exits not reported yet).
        stop_requested: true once a stop was requested (ends the waits before a launch).
    """

    def __init__(
        self,
        config: Config,
        run_id: str,
        log: EventLog,
        redactor: Redactor,
        echo: TextIO | None,
        engine_umask: int,
        protected: Callable[[], set[int]],
        stop_requested: Callable[[], bool],
    ):
        self.config, self.run_id, self.log, self.redactor = config, run_id, log, redactor
        self.echo, self.umask, self._protected = echo, engine_umask, protected
        self._stop_requested = stop_requested
        self.popen: subprocess.Popen[bytes] | None = None
        self.sessions: set[int] = set()  # session ids of this run's engines (PID-1 reaper)
        self.reaped: list[int] = []  # orphaned zombies reaped as PID 1 (xpu_serve.reaper)
        self.discover_now = asyncio.Event()  # a log line named a pid not discovered yet
        self._carry_candidates: set[str] = set()  # the previous run's segments not proven its

    # ---- before a launch -------------------------------------------------------------------

    async def host_problem(self) -> str | None:
        """Why engine.host cannot be served (`preflight.resolve_problem`, the message of `check`),
        or None. A resolver that does not answer (EAI_AGAIN) is asked again every second for up to
        `supervision.stop.port_free_timeout_s`, or until a stop is requested."""
        from xpu_serve.preflight import resolve_problem

        e = self.config.engine
        deadline = time.monotonic() + self.config.supervision.stop.port_free_timeout_s
        while True:
            bad = await asyncio.to_thread(resolve_problem, e.host, e.port)
            if bad is None or not bad[1] or time.monotonic() >= deadline or self._stop_requested():
                return None if bad is None else bad[0]
            await asyncio.sleep(1.0)

    async def port_problem(self, lock_path: Path) -> str | None:
        """Why the port cannot be served (another program holds it), or None. Ours were swept
        before. Raises LockedError when the holder is the engine of a supervisor whose runtime
        directory was removed under it."""
        e = self.config.engine
        if cleanup.port_free(e.host, e.port):
            return None
        owners = cleanup.port_owners(e.port)
        holder = cleanup.holder_of_removed_lock(owners, lock_path)
        if holder is not None:
            raise LockedError(lock_path, holder, "; it still runs though its lock file was removed")
        # a listener we can name is another program: no point waiting for it
        if not owners and await cleanup.wait_port_free(
            e.host, e.port, self.config.supervision.stop.port_free_timeout_s
        ):
            return None
        owners = owners or cleanup.port_owners(e.port)
        who = ", ".join(f"pid {p} ({_comm(p)})" for p in owners) or "an unknown process"
        return f"port {e.host}:{e.port} is taken by another program: {who}"

    async def prepare_log_dir(self, runtime_dir: Path, n: int) -> Path:
        """RUNTIME/logs/N, 0700, an earlier run's folder of that name set aside and the log
        retention applied (`logdirs`); `logs` events say what moved or went."""
        log_dir = runtime_dir / "logs" / str(n)
        prev = await asyncio.to_thread(logdirs.set_aside_old_logs, log_dir)
        if prev is not None:
            self.log.emit(
                "logs",
                f"logs of an earlier run in {log_dir} moved to {prev}",
                incarnation=n,
                moved_to=str(prev),
            )
        log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(OSError):
            os.chmod(log_dir.parent, 0o700)  # RUNTIME/logs (mkdir's mode is only for the leaf)
        lc = self.config.logs
        rep = await asyncio.to_thread(
            logdirs.prune_logs, log_dir.parent, lc.keep_incarnations, lc.max_bytes, log_dir
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
        return log_dir

    # ---- launch ------------------------------------------------------------------------------

    def launch(self, ctx: Incarnation, on_line: Callable[[str, int], None]) -> bool:
        """Start the engine command of incarnation `ctx` and the log pump on its pipes (lines go
        to `on_line(line, lineno)` on the pump's thread). False, with a "config" trigger on
        `ctx`, when the command cannot be rendered or executed (unfixable)."""
        try:
            rendered = render(self.config)
        except Exception as ex:  # ConfigError from rendering: unfixable
            ctx.fail(Trigger(kind="config", detail=f"cannot render the engine command: {ex}", at=time.time()))
            return False
        overrides = dict(rendered.env)
        overrides.update(
            {
                cleanup.INCARNATION_VAR: str(ctx.incarnation),
                cleanup.RUN_ID_VAR: self.run_id,
                # keep /proc/PID/environ readable after setproctitle (our sweep reads the marker there)
                "SPT_NOENV": "1",
                "PYTHONUNBUFFERED": overrides.get("PYTHONUNBUFFERED", "1"),
            }
        )
        if ctx.group_epoch is not None:  # the multi-node group's epoch of this launch
            overrides[GROUP_EPOCH_VAR] = str(ctx.group_epoch)
        ctx.argv, ctx.env = rendered.argv, overrides
        self.redactor.add(secrets_in_env(rendered.env) + secrets_in_argv(rendered.argv))
        ctx.shm_before = cleanup.snapshot_segments()
        try:
            popen = subprocess.Popen(
                rendered.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **overrides},
                start_new_session=True,
                close_fds=True,
                umask=self.umask,
            )
        except OSError as ex:
            ctx.fail(Trigger(kind="config", detail=_cannot_start(rendered.argv[0], ex), at=time.time()))
            return False
        self.popen = popen
        ctx.pgid = popen.pid
        self.sessions.add(popen.pid)  # start_new_session: its pid is the session id
        ctx.started_at = time.time()
        # the kernel's start time (psutil create_time, as discovery records for the others): the
        # proof that a pid is still this process when the tree is stopped (cleanup.is_proven);
        # our unreaped child cannot have been replaced yet
        api_start = procfs.start_time(popen.pid)
        ctx.processes[popen.pid] = ProcessInfo(
            name="APIServer", pid=popen.pid, started_at=api_start if api_start is not None else ctx.started_at
        )
        self._start_pump(ctx, popen, on_line)
        return True

    def _start_pump(
        self, ctx: Incarnation, popen: subprocess.Popen[bytes], on_line: Callable[[str, int], None]
    ) -> None:
        """Start the log pump (`ctx.pump`; it owns the pipes from here on)."""
        pump = LogPump(
            ctx.log_dir,
            incarnation=ctx.incarnation,
            echo=self.echo,
            on_line=on_line,
            # the supervisor's own probes (health, readiness, hang watchdog) would fill journald /
            # docker logs with an access line every few seconds; they stay in vllm.log
            echo_quiet_paths=ECHO_QUIET_PATHS,
            secrets=self.redactor.secrets,
        )
        ctx.pump = pump
        pump.start(cast(BinaryIO, popen.stdout), cast(BinaryIO, popen.stderr))

    def child_status(self, ctx: Incarnation) -> tuple[int | None, str | None] | None:
        """(exit code, signal) of our direct child, the API server of `ctx`, when waitpid knows
        it died by a signal; else None."""
        popen = self.popen
        if popen is None or ctx.pgid != popen.pid:
            return None
        rc = popen.poll()
        if rc is None or rc >= 0:
            return None
        return proc_src.returncode_status(rc)

    # ---- discovery and ownership -------------------------------------------------------------

    def expected_names(self) -> set[str]:
        tp = self.config.engine.tensor_parallel_size
        workers = {"Worker"} if tp == 1 else {f"Worker_TP{r}" for r in range(tp)}
        return {"APIServer", "EngineCore"} | workers

    async def discover(
        self, ctx: Incarnation, on_new: Callable[[int], None], changed: Callable[[], None]
    ) -> None:
        """Find the tree's processes (100 ms polls until all expected are seen, then every 0.5 s
        until ready, then when a log line names an unknown pid); `on_new(pid)` for each new one,
        `changed()` when the tree or its proven segments grew. Runs until cancelled."""
        assert ctx.pgid is not None
        expected = self.expected_names()
        while True:
            found = proc_src.discover(ctx.pgid)
            grew = False
            for pid, info in found.items():
                if pid not in ctx.processes:
                    ctx.processes[pid] = info
                    on_new(pid)
                    grew = True
            # segments our processes map or hold open: the only proof of ownership we get
            seen = cleanup.segments_of([p for p in ctx.processes if p not in ctx.exited])
            if grew or not seen <= ctx.shm_owned:
                ctx.shm_owned |= seen
                changed()
            names = {p.name for p in ctx.processes.values()}
            self.discover_now.clear()
            if ctx.ready_at is not None and expected <= names:
                await self.discover_now.wait()
            else:
                await aio.wait_event(self.discover_now, 0.1 if not expected <= names else 0.5)

    def on_line(self, ctx: Incarnation, line: str) -> None:
        """A line of the engine's output: our own `/tmp/vllm_dist_*` init file named by our tree
        is proven ours; a `(Worker_TP1 pid=N)` prefix confirms pid -> rank or wakes discovery."""
        ctx.shm_owned |= cleanup.dist_paths_in_line(line)
        name, pid, _ = split_process_prefix(line)
        if pid is not None:
            if pid in ctx.processes:
                proc_src.learn_prefix(ctx.processes, name, pid)
            elif ctx.ready_at is None:
                self.discover_now.set()

    def prove_segments(self, ctx: Incarnation) -> None:
        """Record the segments the tree maps or holds open now (at ready, capture, stop)."""
        ctx.shm_owned |= cleanup.segments_of(ctx.processes)

    # ---- stop --------------------------------------------------------------------------------

    def kill_now(self, ctx: Incarnation) -> None:
        """SIGKILL the whole tree at once (a second SIGINT); the stop then sweeps as usual."""
        cleanup.signal_tree(
            ctx.pgid, self.run_id, ctx.incarnation, signal.SIGKILL, list(ctx.processes), ctx.starts()
        )

    async def stop(self, ctx: Incarnation, kill_now: bool, hang: bool, drain: Callable[[], None]) -> None:
        """The ordered stop of incarnation `ctx`: the tree (`cleanup.stop_tree`; `hang`: SIGKILL
        early what cannot exit, the evidence is captured), the pump's last lines (`drain()` hands
        them on), the leftovers proven ours, the port; one `cleaned` event."""
        sv = self.config.supervision
        self.prove_segments(ctx)  # last proof of ownership, right before the stop
        rep = await cleanup.stop_tree(
            ctx.pgid,
            self.run_id,
            ctx.incarnation,
            list(ctx.processes),
            grace_s=sv.stop.grace_s,
            kill_now=kill_now,
            starts=ctx.starts(),
            hang=hang,
        )
        ctx.stop = rep
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=1.0)
        if os.getpid() == 1:
            # PID 1: members that left the engine's session (setsid, a detached grandchild) were
            # swept by the run marker and are now our zombies; the periodic reaper only looks at
            # the engine's sessions, so reap them here (the API server is Popen's to wait for).
            self.reap_now(set(rep.terminated) | set(rep.killed))
        await self._close_pump(ctx, drain)
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

    async def _close_pump(self, ctx: Incarnation, drain: Callable[[], None]) -> None:
        if ctx.pump is None:
            return
        await asyncio.to_thread(ctx.pump.wait_eof, 2.0)
        stats = await asyncio.to_thread(ctx.pump.close, 2.0)
        drain()
        if stats.dropped_lines:
            self.log.emit(
                "warning", f"incarnation {ctx.incarnation}: log pump dropped {stats.dropped_lines} lines"
            )

    # ---- PID 1 -------------------------------------------------------------------------------

    async def reap_every(self, interval_s: float = REAP_INTERVAL_S) -> None:
        """PID 1 only: every `interval_s` seconds reap the zombies of this run's engine sessions
        that the supervisor does not wait for itself (the API server it launched, processes whose
        exit the process watch has not reported yet: their status is read from the zombie)."""
        while True:
            await asyncio.sleep(interval_s)
            self.reap_now(set())

    def reap_now(self, also: set[int]) -> None:
        """PID 1: reap the zombies of `also` (stopped members) and of the engine sessions now."""
        from xpu_serve.reaper import reap_orphans

        keep = self._protected()
        if self.popen is not None and self.popen.returncode is None:
            keep.add(self.popen.pid)
        try:
            got = reap_orphans(protected=keep, sessions=self.sessions, also=also)
        except Exception as ex:  # never stop supervision over housekeeping
            self.log.emit("warning", f"reaper: {type(ex).__name__}: {ex}")
            return
        if got:
            self.reaped.extend(got)
            del self.reaped[:-1000]
            self.log.emit("reaped", f"reaped {len(got)} orphaned zombie(s): {got}", pids=got)

    # ---- the previous supervisor's orphans ---------------------------------------------------

    async def sweep_previous(self, runtime_dir: Path) -> None:
        """Stop what the previous supervisor of this runtime directory left running (its
        state.json says what) and remove its segments; a malformed state.json is a warning.
        Only processes proven its are touched: the marker XPU_SERVE_RUN_ID=<old run id> in their
        environ, or the start time recorded for their pid; the old process group only while its
        leader is proven (its id is reused once the leader and its group are gone)."""
        try:
            prev = read_state(runtime_dir)
        except ValueError as ex:
            self.log.emit("warning", str(ex))
            return
        if not prev:
            return
        info = prev.get("cleanup")
        info = info if isinstance(info, dict) else {}
        old_run, pgid, starts = _previous_tree(info)
        members = cleanup.find_members(old_run, None, [pgid] if pgid else [], list(starts), starts)
        members.discard(os.getpid())
        # the segments the orphans map or hold open are proven theirs (a kill -9 of the previous
        # supervisor right after launch leaves state.json without any): read before stopping them
        orphan_shm = cleanup.segments_of(members) if members else set()
        orphan_starts = [t for t in (procfs.start_time(p) for p in members) if t is not None]
        if members:
            self.log.emit(
                "orphans",
                f"previous supervisor (pid {prev.get('supervisor_pid')}, run {old_run}) left "
                f"{len(members)} process(es): {sorted(members)}; stopping them",
                pids=sorted(members),
            )
            rep = await cleanup.stop_tree(
                pgid, old_run, None, members, grace_s=self.config.supervision.stop.grace_s, starts=starts
            )
            if rep.left:
                self.log.emit("warning", f"could not stop orphan(s) {rep.left}")
        self._remove_previous_segments(info, old_run, orphan_shm, orphan_starts)
        note = _unclean_end(prev, old_run, runtime_dir)
        if note is not None:
            self.log.emit(
                "orphans",
                note,
                previous_state=prev.get("state"),
                previous_incarnation=prev.get("incarnation"),
            )

    def _remove_previous_segments(
        self, info: dict[str, Any], old_run: str | None, orphan_shm: set[str], orphan_starts: list[float]
    ) -> None:
        """Remove the previous run's segments (`info`: its state.json `cleanup`) and those its
        orphans mapped (`orphan_shm`); what is not proven its is looked at again after our first
        incarnation."""
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
        self._carry_candidates = set(seg.kept)


def _previous_tree(info: dict[str, Any]) -> tuple[str | None, int | None, dict[int, float]]:
    """(run id, process group, pid -> start time) from state.json's `cleanup`, each None or
    empty where the field is missing or malformed."""
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
    return old_run, pgid, starts


def _unclean_end(prev: dict[str, Any], old_run: str | None, runtime_dir: Path) -> str | None:
    """The `orphans` line saying the previous supervisor died (kill -9, OOM killer, power loss)
    in a state other than stopped or gave-up and, when it died while capturing, that an incident
    has no finished bundle; None after a clean end."""
    pstate = prev.get("state")
    if not isinstance(pstate, str) or pstate in ("stopped", "gave-up"):
        return None
    inc = prev.get("incarnation")
    msg = (
        f"previous supervisor (pid {prev.get('supervisor_pid')}, run {old_run}) ended without a clean "
        f"stop while {pstate} (incarnation {inc})"
    )
    if pstate in ("failed", "capturing"):
        reason = prev.get("reason")
        msg += (
            f"; the incident it was capturing{f' ({reason})' if isinstance(reason, str) and reason else ''}"
            f" has no finished bundle: writing it from the logs kept in {runtime_dir}/logs/{inc}"
        )
    return msg


def _cannot_start(program: str, ex: OSError) -> str:
    """One line for an engine command that cannot be executed. ENOENT for a file that exists
    means its `#!` interpreter is missing (execve(2)); say so rather than "No such file"."""
    path = shutil.which(program) or program
    if ex.errno == errno.ENOENT and os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                first = f.readline(256)
        except OSError:
            first = b""
        if first.startswith(b"#!"):
            interp = first[2:].strip().decode("utf-8", "replace").split(" ")[0]
            return f"cannot start {program!r}: its #! interpreter {interp!r} does not exist"
    return f"cannot start {program!r}: {ex.strerror}"


def _comm(pid: int) -> str:
    return procfs.comm(pid) or "?"
