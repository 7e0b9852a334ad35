"""Bundles that a full disk left incomplete, written again from the incarnation's kept logs once
the disk has room (the disk is full: a feature degrades, supervision goes on, and nothing the
logs still hold is lost).

A bundle counts as cut by a full disk when one of its write errors is ENOSPC or EDQUOT (the
bundle writer's errors carry `OSError.strerror`: `bundle._try`, `BundleWriter`). Its incident's
marker (`recovery.mark_pending`, which names the damaged folder) is written as soon as the disk
takes it, so a supervisor stopped or killed before the rewrite leaves the work to the next `up`
(`recover_pending`). The rewrite is `recovery.recover_one`: the damaged folder's files are set
aside in it and the bundle is written afresh from RUNTIME/logs/N and its facts log.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xpu_serve import recovery
from xpu_serve.supervision.eventlog import EventLog

FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
CHECK_EVERY_S = 5.0
"""Seconds between looks at the free space while a bundle waits for its rewrite."""
HEADROOM_BYTES = 4 << 20
"""Free bytes needed beyond the kept logs' size before a rewrite is tried."""

NOTE = (
    "rewritten: the disk was full when this incident was captured (the first bundle lacked files); "
    "this bundle was written by the same supervisor (pid {pid}) from the logs kept in {log_dir} once "
    "the disk had room: no stacks, no live /proc facts, host facts and kernel log as of the rewrite"
)


def cut_by_full_disk(errors: list[str]) -> bool:
    """True when a bundle writer's error lines say the disk (or the quota) was full."""
    return any(full in e for e in errors for full in FULL)


@dataclass
class _Waiting:
    log_dir: Path
    marker: dict[str, Any]
    marked: bool = False


class Rewrites:
    """`add(log_dir, marker)` a bundle cut by a full disk (on the loop: a task then looks every
    `CHECK_EVERY_S` s); each is rewritten once the disk under RUNTIME has `HEADROOM_BYTES` plus
    the logs' size free, with a `bundle-rewritten` event; `close()` ends the task."""

    def __init__(self, runtime_dir: Path, config: Any, log: EventLog):
        self.runtime_dir, self.config, self.log = runtime_dir, config, log
        self.waiting: list[_Waiting] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, log_dir: Path, marker: dict[str, Any]) -> None:
        w = _Waiting(log_dir, marker)
        self._mark(w)
        self.waiting.append(w)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _serve(self) -> None:
        while self.waiting:
            await asyncio.sleep(CHECK_EVERY_S)
            for w in list(self.waiting):
                try:
                    done = await asyncio.to_thread(self._rewrite, w)
                except Exception as ex:  # (a bug here must not stop supervision)
                    self.log.emit("warning", f"bundle rewrite: {type(ex).__name__}: {ex}")
                    done = True
                if done:
                    self.waiting.remove(w)

    def _mark(self, w: _Waiting) -> None:
        if not w.marked:
            recovery.mark_pending(w.log_dir, w.marker)
            w.marked = recovery.is_pending(w.log_dir)

    def _rewrite(self, w: _Waiting) -> bool:
        """One try (blocking); True when done: the bundle is complete, or the logs are gone."""
        if not w.log_dir.is_dir():
            return True
        if _free(self.runtime_dir) < HEADROOM_BYTES + _size(w.log_dir):
            return False
        self._mark(w)
        if not w.marked:
            return False
        note = NOTE.format(pid=os.getpid(), log_dir=w.log_dir)
        path, contract = recovery.recover_one(
            w.log_dir, self.runtime_dir, self.config, os.getpid(), note=note, again=True
        )
        if path is None or not (Path(path) / "bundle.json").is_file():
            w.marked = False  # (recover_one removed the marker once a folder existed)
            return False
        self.log.emit(
            "bundle-rewritten",
            f"bundle of incarnation {w.marker.get('incarnation')} written again now that the disk has room: "
            f"{path} (cause {contract.get('cause', 'unknown')})",
            bundle=path,
            cause=contract.get("cause"),
        )
        return True


def _free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _size(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total
