"""RUNTIME/state.json as the supervisor keeps it: written on every change and every heartbeat,
the lock file and events.jsonl re-made when the runtime directory was removed under them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xpu_serve import cleanup
from xpu_serve.config import Config
from xpu_serve.incarnation import Status
from xpu_serve.state import LockedError, RuntimeLock, read_state, status_dict, write_state
from xpu_serve.supervision.context import Incarnation
from xpu_serve.supervision.eventlog import EventLog

# Seconds between rewrites of state.json while nothing changes (its `written_at` then tells
# `status` whether the file is current: a full disk leaves it stale). Env XPU_SERVE_STATE_HEARTBEAT_S.
STATE_HEARTBEAT_S = 5.0


def heartbeat_s() -> float:
    """`XPU_SERVE_STATE_HEARTBEAT_S` (at least 0.05 s), else STATE_HEARTBEAT_S."""
    try:
        hb = os.environ.get("XPU_SERVE_STATE_HEARTBEAT_S", "")
        return max(0.05, float(hb)) if hb else STATE_HEARTBEAT_S
    except ValueError:
        return STATE_HEARTBEAT_S


class StateFile:
    """`write()` writes `data()` (a `state.status_dict`) to RUNTIME/state.json (`state.write_state`:
    atomic, or in place on a full disk); a failing write is one warning per streak."""

    def __init__(
        self, runtime_dir: Path, log: EventLog, lock: RuntimeLock, data: Callable[[], dict[str, Any]]
    ):
        self.runtime_dir, self.log, self.lock, self._data = runtime_dir, log, lock, data
        self.heartbeat_s = heartbeat_s()
        self._failing = False
        self._lock_problem: str | None = None  # the last lock warning emitted (once per streak)

    async def heartbeat(self) -> None:
        """Rewrite state.json every `heartbeat_s` seconds (its `written_at` proves it is current)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self.write()

    def write(self) -> None:
        self._verify_lock()
        try:
            how = write_state(self.runtime_dir, self._data())
        except OSError as ex:
            if not self._failing:  # once per failing streak, not every heartbeat
                self.log.emit("warning", f"cannot write state.json (it is stale from now on): {ex}")
            self._failing = True
            return
        if how != "atomic" and not self._failing:
            self.log.emit("warning", "state.json: no space for an atomic write; rewritten in place")
        self._failing = how != "atomic"

    def refuse_if_predecessor_lives(self) -> None:
        """Raise LockedError when the supervisor state.json names still runs (`live_supervisor`:
        its pid, start time and cmdline) and has not written a final state (stopped, gave-up):
        its lock file was removed with the runtime directory, and its tree is live, not orphans
        to stop."""
        try:
            prev = read_state(self.runtime_dir)
        except (OSError, ValueError):
            return  # (reported when the previous run is swept)
        # (a supervisor that wrote its final state has released its lock and is exiting)
        done = prev.get("state") in ("stopped", "gave-up") if prev else True
        holder = cleanup.live_supervisor(prev) if prev and not done else None
        if holder is not None:
            self.lock.release()
            raise LockedError(self.lock.path, holder, "; it still runs though its lock file was removed")

    def _verify_lock(self) -> None:
        """Re-create and re-lock RUNTIME/supervisor.lock when its file is gone or replaced
        (`RuntimeLock.verify`); one warning per occurrence. Reopens events.jsonl likewise, first."""
        got = self.lock.verify()
        reopen = getattr(self.log, "reopen_if_moved", None)
        if callable(reopen):
            reopen()
        if got is not None and got[0] != self._lock_problem:
            self.log.emit("warning", got[0], lock=str(self.lock.path), relocked=got[1])
        self._lock_problem = None if got is None or got[1] else got[0]


def state_data(
    status: Status, ctx: Incarnation | None, config: Config, kernel: Any, **fields: Any
) -> dict[str, Any]:
    """What state.json holds (docs/supervision.md, "Runtime directory"): `status`, the
    incarnation's `cleanup` facts (what the next `up` needs to stop it after a kill -9), the
    engine's address, the kernel watcher's source (`kernel`: the KernelWatcher or None) and
    `fields` (run_id, supervisor_started_at, supervisor_create_time, time_to_ready_s, failures,
    heartbeat_s)."""
    e = config.engine
    cleanup_info: dict[str, Any] = {"run_id": fields.get("run_id")}
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
        status,
        engine={"host": e.host, "port": e.port, "served_model_name": e.served_model_name or e.model},
        config_path=str(config.source_path) if config.source_path else None,
        pgid=ctx.pgid if ctx else None,
        cleanup=cleanup_info,
        kernel_watch=kernel_watch_status(kernel, config),
        **fields,
    )
    data["group_epoch"] = ctx.group_epoch if ctx is not None else None  # (the launch's, group/watcher.py)
    if ctx is not None:  # ProcessInfo cannot say "exited, status unknown": add exited_at
        data["processes"] = [dict(vars(p), exited_at=ctx.exited.get(p.pid)) for p in ctx.processes.values()]
    return data


def kernel_watch_status(kernel: Any, config: Config) -> dict[str, Any] | None:
    """`KernelWatcher.source_status()` ({source, reason, overruns}) for state.json and `status`;
    {"source": None, "reason": "disabled ..."} when no kernel watcher is attached."""
    if kernel is None:
        off = not config.watchers.kernel.enabled
        why = "disabled (watchers.kernel.enabled: false)" if off else "no kernel log watcher attached"
        return {"source": None, "reason": f"kernel log watch {why}", "overruns": 0}
    try:
        return dict(kernel.source_status())
    except Exception:
        return None
