"""RUNTIME/state.json as the supervisor keeps it: written on every change and every heartbeat,
the lock file and events.jsonl re-made when the runtime directory was removed under them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xpu_serve.state import RuntimeLock, write_state
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
