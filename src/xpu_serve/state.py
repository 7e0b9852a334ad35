"""The runtime directory's shared files: `state.json` (written atomically) and the supervisor lock.

Layout of RUNTIME (the config's `runtime_dir`, or `up --runtime-dir`):

    RUNTIME/state.json        the supervisor's current Status plus what a successor needs to clean up
    RUNTIME/supervisor.lock   fcntl lock held by the running supervisor (its pid inside, for people)
    RUNTIME/events.jsonl      the supervisor's own events, one JSON object per line
    RUNTIME/logs/<N>/         logs of incarnation N
    RUNTIME/bundles/          diagnostic bundles

`state.json` is the shape of `xpu_serve.incarnation.Status` (state, incarnation, restarts,
supervisor_pid, processes, last_incident, next_restart_at, reason) plus: `run_id`, `updated_at`,
`supervisor_started_at`, `engine` ({host, port, served_model_name}), `pgid`, `time_to_ready_s`,
`failures`, and `cleanup` ({run_id, incarnation, pgid, pids: [{pid, create_time}], shm: [paths]}):
what the next `up` needs to sweep after this supervisor was killed with SIGKILL.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from xpu_serve.incarnation import Status

STATE_FILE = "state.json"
LOCK_FILE = "supervisor.lock"
EVENTS_FILE = "events.jsonl"


class LockedError(Exception):
    """Another supervisor holds RUNTIME/supervisor.lock. `holder_pid` is its pid when readable."""

    def __init__(self, path: Path, holder_pid: int | None):
        who = f"pid {holder_pid}" if holder_pid else "another process"
        super().__init__(f"{path}: runtime directory is in use by another xpu-serve supervisor ({who})")
        self.path = path
        self.holder_pid = holder_pid


class RuntimeLock:
    """An exclusive, non-blocking `fcntl.flock` on RUNTIME/supervisor.lock for the supervisor's life.

    The kernel drops the lock when the holder dies (even by SIGKILL), so a stale lock never
    blocks the next `up`. The engine never inherits the descriptor (O_CLOEXEC).

    Raises (from `acquire`): LockedError when another process holds it; OSError when the
    directory cannot be created or written.
    """

    def __init__(self, runtime_dir: Path):
        self.path = Path(runtime_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = int(os.pread(fd, 32, 0).decode().strip() or 0) or None
            except (OSError, ValueError):
                holder = None
            os.close(fd)
            raise LockedError(self.path, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def lock_holder(runtime_dir: Path) -> int | None:
    """Pid of the live supervisor holding the lock of `runtime_dir`, or None when nobody holds it."""
    path = Path(runtime_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return int(os.pread(fd, 32, 0).decode().strip() or 0) or -1
            except (OSError, ValueError):
                return -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def status_dict(status: Status, **extra: Any) -> dict[str, Any]:
    """`Status` as the JSON object written to state.json, with `extra` top-level keys merged in."""
    d = dataclasses.asdict(status)
    d.update(extra)
    d["updated_at"] = time.time()
    return d


def write_state(runtime_dir: Path, data: dict[str, Any]) -> None:
    """Write RUNTIME/state.json atomically (temp file in the same directory, fsync, rename).

    Readers see either the old or the new file, never a partial one. Raises OSError.
    """
    runtime_dir = Path(runtime_dir)
    fd, tmp = tempfile.mkstemp(prefix=".state.", suffix=".tmp", dir=runtime_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, runtime_dir / STATE_FILE)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_state(runtime_dir: Path) -> dict[str, Any] | None:
    """Read RUNTIME/state.json; None when absent. Raises ValueError when it is not a JSON object."""
    path = Path(runtime_dir) / STATE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")
