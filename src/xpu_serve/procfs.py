"""Facts about a process from `/proc`, read with psutil; by hand only what psutil does not expose.

Every function takes a pid (in this process's pid namespace) and never raises for a process
that is gone, a zombie or not readable (another user's environ): it returns None (or False, [])
instead. Formats: proc(5).

Read by hand, because psutil has no call for them:
- `comm`: psutil's `name()` replaces a 15-byte comm with the start of argv[0]; the kernel log
  prints the comm itself (include/linux/sched.h TASK_COMM_LEN).
- `nspids`: the `NSpid:` line of /proc/PID/status (fs/proc/array.c), the pid in each namespace.
- `mapped_paths`, `fd_targets`: psutil's `memory_maps()` reads smaps (a page walk per mapping)
  and `open_files()` regular files only, with fdinfo per fd; the shared-memory sweep polls
  these and needs /dev/shm paths, deleted ones marked, at the cost of maps and readlink alone.
- `catches_signal`: the `SigCgt:` mask of /proc/PID/status (fs/proc/array.c render_sigset_t).
- `stat_fields`: /proc/PID/stat after the command name, for the session id (field 6) and the
  wait status of a zombie (field 52, `exit_code`, Linux >= 3.5) that psutil does not give.
"""

from __future__ import annotations

import os

import psutil

# psutil status -> the one-letter state of /proc/PID/stat field 3 (fs/proc/array.c task_state_array).
_STATE_LETTER = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_WAKING: "W",
    psutil.STATUS_PARKED: "P",
    psutil.STATUS_IDLE: "I",
}


def cmdline(pid: int) -> list[str] | None:
    """argv of `pid` (empty arguments dropped), None when gone or empty (a zombie, a kernel
    thread). A process that set its title (vLLM's `VLLM::Worker_TP0` via setproctitle) shows
    the title's words."""
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return None
    return [a for a in argv if a] or None


def title(pid: int) -> str | None:
    """argv of `pid` joined by spaces ("VLLM::Worker_TP1", "python -m vllm..."), None when gone."""
    argv = cmdline(pid)
    return None if argv is None else " ".join(argv)


def environ(pid: int) -> dict[str, str] | None:
    """The initial environment of `pid` (/proc/PID/environ), None when gone or not readable.
    setproctitle blanks it unless the process ran with SPT_NOENV=1."""
    try:
        return dict(psutil.Process(pid).environ())
    except psutil.Error:
        return None


def cwd(pid: int) -> str | None:
    """Working directory of `pid`, None when gone or not readable."""
    try:
        return psutil.Process(pid).cwd() or None
    except psutil.Error:
        return None


def exe(pid: int) -> str | None:
    """The executable of `pid` (/proc/PID/exe: symlinks resolved), None when gone or not readable."""
    try:
        return psutil.Process(pid).exe() or None
    except psutil.Error:
        return None


def state(pid: int) -> str | None:
    """One-letter state of `pid` (R, S, D, T, t, Z, X, I...; proc(5) field 3), None when gone."""
    try:
        st = psutil.Process(pid).status()
    except psutil.Error:
        return None
    return _STATE_LETTER.get(st, "?")


def alive(pid: int) -> bool:
    """True when a process with this pid exists and is not a zombie."""
    return state(pid) not in (None, "Z", "X")


def start_time(pid: int) -> float | None:
    """Start time of `pid` (epoch s, psutil `create_time`: boot time + /proc/PID/stat field 22),
    None when gone. Two reads for one process give the same value: it proves a pid."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, ValueError):
        return None


def same_process(pid: int, started_at: float, tolerance_s: float) -> bool:
    """True when `pid` is still the process that started at `started_at` (epoch s, `start_time`)."""
    now = start_time(pid)
    return now is not None and abs(now - started_at) < tolerance_s


def still_running(pid: int, started_at: object, tolerance_s: float) -> bool:
    """True when `pid` is alive and, when `started_at` (epoch s) is a number, is still the
    process that started then (not a later process given the same pid)."""
    if not alive(pid):
        return False
    if not isinstance(started_at, (int, float)) or isinstance(started_at, bool):
        return True
    return same_process(pid, float(started_at), tolerance_s)


def children(pid: int) -> list[int]:
    """Pids of every descendant of `pid` (recursive), [] when gone."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def pids() -> list[int]:
    """Every pid in /proc."""
    return psutil.pids()


def comm(pid: int) -> str | None:
    """/proc/PID/comm (at most 15 bytes), None when gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().rstrip("\n")
    except OSError:
        return None


def nspids(pid: int) -> list[int]:
    """`NSpid:` of /proc/PID/status: the pid in every namespace from this /proc's down; [] if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def mapped_paths(pid: int) -> set[str] | None:
    """Paths mapped by `pid`: the 6th field of /proc/PID/maps ("/dev/shm/x", "/x (deleted)",
    also "[heap]"), None when gone or not readable."""
    out: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    out.add(parts[5].rstrip(b"\n").decode("utf-8", "replace"))
    except OSError:
        return None
    return out


def fd_targets(pid: int) -> list[str]:
    """What each open fd of `pid` points at (readlink of /proc/PID/fd/N: a path, " (deleted)"
    appended when unlinked, or "socket:[ino]", "pipe:[ino]"); [] when gone or not readable."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def catches_signal(pid: int, signum: int) -> bool | None:
    """Does `pid` catch `signum`? Bit signum-1 of `SigCgt:`. None when the file cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def stat_fields(pid: int | str) -> list[bytes] | None:
    """/proc/PID/stat from field 3 (state) on: index i is field i + 3. None when gone. The
    command name (field 2) may hold spaces and ')', so the split starts after the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].split()
