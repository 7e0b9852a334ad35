"""The runtime directory's shared files: `state.json` (written atomically) and the supervisor lock.

Layout of RUNTIME (the config's `runtime_dir`, or `up --runtime-dir`):

    RUNTIME/state.json        the supervisor's current Status plus what a successor needs to clean up
    RUNTIME/supervisor.lock   fcntl lock held by the running supervisor (its pid inside, for people)
    RUNTIME/events.jsonl      the supervisor's own events, one JSON object per line
    RUNTIME/logs/<N>/         logs of incarnation N
    RUNTIME/bundles/          diagnostic bundles

`state.json` is the shape of `xpu_serve.incarnation.Status` (state, incarnation, restarts,
supervisor_pid, processes, last_incident, next_restart_at, reason) plus: `run_id`, `updated_at` and
`written_at` (epoch s of this write), `heartbeat_s` (the supervisor rewrites the file at least this
often, so `status` can tell a stale file: e.g. the disk was full),
`supervisor_started_at`, `supervisor_create_time` (the supervisor process's start time, epoch s,
psutil create_time: proves its pid, `cleanup.live_supervisor`), `engine` ({host, port, served_model_name}), `pgid`, `time_to_ready_s`,
`failures`, and `cleanup` ({run_id, incarnation, pgid, pids: [{pid, create_time}], shm: [paths]}):
what the next `up` needs to sweep after this supervisor was killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from xpu_serve.fsread import read_regular
from xpu_serve.incarnation import Status

STATE_FILE = "state.json"
LOCK_FILE = "supervisor.lock"
EVENTS_FILE = "events.jsonl"


class LockedError(Exception):
    """Another supervisor holds RUNTIME/supervisor.lock, or runs on RUNTIME although its lock
    file is gone (`detail` says so). `holder_pid` is its pid when known."""

    def __init__(self, path: Path, holder_pid: int | None, detail: str = ""):
        who = f"pid {holder_pid}" if holder_pid else "another process"
        super().__init__(
            f"{path}: runtime directory is in use by another xpu-serve supervisor ({who}){detail}"
        )
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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o600)  # (a file of an earlier run)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def verify(self) -> tuple[str, bool] | None:
        """Re-lock when the lock file's path no longer names the file we hold locked.

        The path is compared with the held descriptor by (st_dev, st_ino): a removed runtime
        directory (tmpfiles cleaning /tmp, an `rm -rf`) or a file put in its place leaves us
        holding a lock nobody else can see, and a second `up` would take a fresh one. Then the
        file (and its directory) is created again and locked. Returns None when all is well,
        else (message, relocked): relocked False when another process holds the new file (the
        old descriptor is kept; call again later). Never raises.
        """
        if self._fd is None:
            return None
        try:
            held = os.fstat(self._fd)
            now = os.stat(self.path)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return None
            what = "was replaced by another file"
        except FileNotFoundError:
            what = "is gone"
        except OSError:
            return None  # (unreadable directory: nothing we can prove or fix)
        old, self._fd = self._fd, None
        try:
            self.acquire()
        except LockedError as e:
            self._fd = old
            return f"lock file {self.path} {what}; cannot re-lock it yet: {e}", False
        except OSError as e:
            self._fd = old
            return f"lock file {self.path} {what}; cannot re-create it: {e.strerror or e}", False
        os.close(old)
        return f"lock file {self.path} {what} (runtime directory removed?); re-created and re-locked it", True


def lock_holder(runtime_dir: Path) -> int | None:
    """Pid of the live supervisor holding the lock of `runtime_dir`, or None when nobody holds it
    (also when the lock file is no regular file: opened without blocking, a FIFO never hangs
    `status`, `stop` or a probe)."""
    path = Path(runtime_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
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
    d["updated_at"] = d["written_at"] = time.time()
    return d


# state.json is padded with spaces (valid JSON whitespace) to a multiple of this many bytes, so
# that when the atomic write cannot get new blocks (ENOSPC, EDQUOT: a full runtime directory) the
# file can still be rewritten in place over the blocks it already has.
STATE_PAD_BYTES = 16384


def _padded(data: dict[str, Any]) -> bytes:
    body = (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode()
    size = -(-len(body) // STATE_PAD_BYTES) * STATE_PAD_BYTES
    return body + b" " * (size - len(body))


def write_state(runtime_dir: Path, data: dict[str, Any]) -> str:
    """Write RUNTIME/state.json; returns "atomic" or "in-place" (how it was written).

    Normally atomic (temp file in the same directory, fsync, rename): readers see the old or the
    new file. The file is padded with spaces to a multiple of STATE_PAD_BYTES; when the temp file
    cannot be created or written for lack of space or inodes (ENOSPC, EDQUOT) and the new content
    fits in the existing file, the existing file is overwritten in place (one pwrite, fsync: no new blocks needed), and
    "in-place" is returned; a reader may then see a torn file for an instant (`read_state`
    retries). Raises OSError when neither works.
    """
    runtime_dir = Path(runtime_dir)
    payload = _padded(data)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".state.", suffix=".tmp", dir=runtime_dir)
    except OSError as e:  # no inode left for the temp file (ENOSPC too): in place, as below
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not _write_in_place(runtime_dir / STATE_FILE, payload):
            raise
        return "in-place"
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # private to the supervisor's user (status reads it as that user or root)
        os.replace(tmp, runtime_dir / STATE_FILE)
        return "atomic"
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not _write_in_place(
            runtime_dir / STATE_FILE, payload
        ):
            raise
        return "in-place"
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_in_place(path: Path, payload: bytes) -> bool:
    """Overwrite `path` from offset 0 with `payload` padded to the file's size, when it fits."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if len(payload) > size:
            return False
        buf = payload + b" " * (size - len(payload))
        done = 0
        while done < len(buf):
            done += os.pwrite(fd, buf[done:], done)
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# state.json is a few KiB (a TP=64 tree with every segment is well under 1 MiB)
MAX_STATE_BYTES = 4 << 20


def read_state(runtime_dir: Path) -> dict[str, Any] | None:
    """Read RUNTIME/state.json; None when absent.

    Raises ValueError ("PATH: not valid JSON: ...", "PATH: not UTF-8 text", "PATH: not a JSON
    object") and OSError (unreadable). An invalid read is retried 3 times 20 ms apart (a reader
    may meet an in-place rewrite, see `write_state`).
    """
    path = Path(runtime_dir) / STATE_FILE
    err = ""
    for attempt in range(4):
        if attempt:
            time.sleep(0.02)
        try:
            raw = read_regular(path, MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return None
        if raw is None:
            raise ValueError(f"{path}: not a regular file")
        if len(raw) > MAX_STATE_BYTES:
            raise ValueError(f"{path}: larger than {MAX_STATE_BYTES} bytes: not a state file of xpu-serve")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            err = f"{path}: not UTF-8 text"
            continue
        except json.JSONDecodeError as e:
            err = f"{path}: not valid JSON: {e}"
            continue
        except RecursionError:
            err = f"{path}: not valid JSON: nested too deeply"
            continue
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a JSON object")
        return data
    raise ValueError(err)
