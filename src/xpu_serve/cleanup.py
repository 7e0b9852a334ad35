"""Stop an incarnation's whole process tree and remove what it leaves behind.

Why our own code and not psutil's `wait_procs` alone: the members to stop are found three ways
(process group, session, and the environment marker of processes that left both, e.g. after
`setsid` or re-parenting) and the shared-memory clean-up needs the owner pids seen while the
tree was alive; psutil is used for port owners.

Order (`stop_tree`): SIGTERM to the process group (and to every other member found) -> wait up to
`grace_s` -> SIGKILL to the group and to every survivor -> verify none is left. Members:

- every process of the engine's session (the engine is started with `start_new_session=True`,
  so session id = process group id = the API server's pid);
- every process whose `/proc/PID/environ` carries `XPU_SERVE_RUN_ID=<this supervisor's id>` and
  `XPU_SERVE_INCARNATION=<N>`, even if re-parented or in a new session. The engine is started
  with `SPT_NOENV=1` so that setproctitle (which vLLM uses for `VLLM::...` titles) does not
  overwrite the environ area that /proc/PID/environ shows (setproctitle README, "SPT_NOENV").

Leftover files (`remove_segments`): the `/dev/shm` entries and `/tmp/vllm_dist_*` paths that
appeared during the incarnation (snapshot before start, diff after stop), removed when our
processes had them mapped or open (`segments_of`), or when they match vLLM's / Python
multiprocessing's names, are not in use by any live process, and no other vLLM process (one
without our run id) started within `FOREIGN_WINDOW_S` before the entry appeared.
Never another program's: anything still in use by a live process is left alone.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from xpu_serve.state import pid_alive

RUN_ID_VAR = "XPU_SERVE_RUN_ID"
INCARNATION_VAR = "XPU_SERVE_INCARNATION"

SHM_DIR = Path("/dev/shm")
TMP_DIR = Path("/tmp")
# Names vLLM and Python multiprocessing give to what they leave behind: vLLM's CPU shm
# communicator `vllm_dist_*-cpushm_N` and dist-init files (`/tmp/vllm_dist_<hex>`),
# multiprocessing.shared_memory `psm_*` (vLLM's shm_broadcast MessageQueue), POSIX semaphores
# of multiprocessing `sem.mp-*`, torch's `torch_*` file-descriptor shm.
_VLLM_NAME_RE = re.compile(r"^(vllm|psm_|sem\.mp-|torch_|wnsm_)")


def _proc_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def read_marker(pid: int) -> tuple[str | None, int | None]:
    """(run_id, incarnation) from /proc/PID/environ; (None, None) when absent or unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None, None
    if b"XPU_SERVE_RUN_ID=" not in env:
        return None, None
    run_id: str | None = None
    inc: int | None = None
    for item in env.split(b"\0"):
        if item.startswith(b"XPU_SERVE_RUN_ID="):
            run_id = item[17:].decode("utf-8", "replace")
        elif item.startswith(b"XPU_SERVE_INCARNATION="):
            try:
                inc = int(item[22:])
            except ValueError:
                inc = None
    return run_id, inc


def _getsid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def find_members(
    run_id: str | None, incarnation: int | None = None, sessions: Iterable[int] = (), pids: Iterable[int] = ()
) -> set[int]:
    """Live (non-zombie) pids that belong to the tree, never our own pid.

    A process belongs when its session id is in `sessions`, or its environment carries
    XPU_SERVE_RUN_ID == run_id (and XPU_SERVE_INCARNATION == incarnation unless that is None),
    or it is in `pids` and still alive.
    """
    me = os.getpid()
    sess = set(sessions)
    found: set[int] = set()
    for pid in _proc_pids():
        if pid == me:
            continue
        if (sess and _getsid(pid) in sess) or (
            run_id is not None and _marker_matches(pid, run_id, incarnation)
        ):
            if pid_alive(pid):
                found.add(pid)
    for pid in pids:
        if pid != me and pid_alive(pid):
            found.add(pid)
    return found


def _marker_matches(pid: int, run_id: str, incarnation: int | None) -> bool:
    rid, inc = read_marker(pid)
    return rid == run_id and (incarnation is None or inc == incarnation)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pgid: int | None, sig: int) -> None:
    if pgid is None or pgid <= 1:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class StopReport:
    """What `stop_tree` did: pids that got SIGTERM, pids that needed SIGKILL, pids left alive
    (empty unless something is unkillable, e.g. stuck in the kernel: state D), seconds taken."""

    terminated: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    seconds: float = 0.0


async def stop_tree(
    pgid: int | None,
    run_id: str | None,
    incarnation: int | None,
    pids: Iterable[int] = (),
    grace_s: float = 20.0,
    kill_now: bool = False,
    poll_s: float = 0.05,
    kill_wait_s: float = 5.0,
) -> StopReport:
    """Stop every member of the tree (see module doc); returns a StopReport, never raises.

    `pgid`: the engine's process group (= session id); `pids`: pids known from discovery.
    With `kill_now` SIGKILL is sent at once (operator's second SIGINT).
    """
    t0 = time.monotonic()
    rep = StopReport()
    sessions = [pgid] if pgid else []
    known = list(pids)
    members = find_members(run_id, incarnation, sessions, known)
    if not kill_now:
        _killpg(pgid, signal.SIGTERM)
        for pid in members:
            _signal(pid, signal.SIGTERM)
        rep.terminated = sorted(members)
        deadline = t0 + grace_s
        while members and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            members = {p for p in members if pid_alive(p)} | find_members(run_id, incarnation, sessions)
            # a process that appeared during the stop (a late spawn) gets SIGTERM too
            for p in members - set(rep.terminated):
                _signal(p, signal.SIGTERM)
                rep.terminated.append(p)
    deadline = time.monotonic() + kill_wait_s
    while True:
        members = {p for p in members if pid_alive(p)} | find_members(run_id, incarnation, sessions)
        if not members:
            break
        _killpg(pgid, signal.SIGKILL)
        for pid in members:
            _signal(pid, signal.SIGKILL)
            if pid not in rep.killed:
                rep.killed.append(pid)
        if time.monotonic() > deadline:
            rep.left = sorted(members)
            break
        await asyncio.sleep(poll_s)
    rep.seconds = time.monotonic() - t0
    return rep


def snapshot_segments() -> set[str]:
    """Paths of every entry in /dev/shm and of /tmp/vllm_dist_* right now."""
    out: set[str] = set()
    try:
        out.update(str(SHM_DIR / n) for n in os.listdir(SHM_DIR))
    except OSError:
        pass
    try:
        out.update(str(TMP_DIR / n) for n in os.listdir(TMP_DIR) if n.startswith("vllm_dist_"))
    except OSError:
        pass
    return out


def _is_segment_path(path: str) -> bool:
    return path.startswith("/dev/shm/") or path.startswith("/tmp/vllm_dist_")


def segments_of(pids: Iterable[int]) -> set[str]:
    """/dev/shm and /tmp/vllm_dist_* paths mapped (/proc/PID/maps) or open (/proc/PID/fd) by `pids`.

    Deleted files (" (deleted)") are skipped. Unreadable processes are skipped.
    """
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    i = line.find(b" /")
                    if i < 0:
                        continue
                    p = line[i + 1 :].rstrip(b"\n").decode("utf-8", "replace")
                    if _is_segment_path(p) and not p.endswith(" (deleted)"):
                        found.add(p)
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                p = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if _is_segment_path(p) and not p.endswith(" (deleted)"):
                found.add(p)
    return found


def _top_path(p: str) -> str:
    """/tmp/vllm_dist_x/sub -> /tmp/vllm_dist_x (we remove top-level entries only)."""
    if p.startswith("/tmp/vllm_dist_"):
        return "/tmp/" + p[5:].split("/", 1)[0]
    return p


def foreign_vllm_starts(run_id: str | None) -> list[float]:
    """Start times (epoch s) of the live `VLLM::` processes that do not carry our run id
    (another server's EngineCore and workers)."""
    me = os.getpid()
    starts: list[float] = []
    for pid in _proc_pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                head = f.read(6)
        except OSError:
            continue
        if head == b"VLLM::" and pid_alive(pid) and read_marker(pid)[0] != run_id:
            t = _create_time(pid)
            if t is not None:
                starts.append(t)
    return starts


def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


FOREIGN_WINDOW_S = 120.0
"""A foreign vLLM process started this long (or less) before a segment appeared could have made it:
vLLM creates its segments during distributed init, seconds after its workers start."""


@dataclass
class SegmentReport:
    """`remove_segments` result: paths removed, and paths left with the reason for each."""

    removed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


def remove_segments(
    before: set[str] | None,
    owned: set[str],
    since: float,
    run_id: str | None,
    candidates: set[str] | None = None,
) -> SegmentReport:
    """Remove the leftovers of one incarnation (call after its processes are gone).

    `before`: `snapshot_segments()` taken before the launch (None: unknown, e.g. after a
    supervisor crash; then only `candidates` are considered); `owned`: paths our processes had
    mapped or open; `since`: launch time (epoch s), entries older than that are never removed
    unless owned; `candidates`: extra paths to consider (from a previous state.json).
    Never raises; what could not be removed is in `kept` with the reason.
    """
    rep = SegmentReport()
    cand: set[str] = set(candidates or ())
    if before is not None:
        cand |= snapshot_segments() - before
    cand |= {_top_path(p) for p in owned}
    cand = {_top_path(p) for p in cand}
    if not cand:
        return rep
    in_use = {_top_path(p) for p in segments_of(_proc_pids())}
    foreign: list[float] | None = None
    owned_top = {_top_path(p) for p in owned}
    for path in sorted(cand):
        if not os.path.lexists(path):
            continue
        if path in in_use:
            rep.kept[path] = "in use by a live process"
            continue
        if path not in owned_top:
            name = os.path.basename(path)
            try:
                mtime = os.lstat(path).st_ctime
            except OSError:
                continue
            if not _VLLM_NAME_RE.match(name):
                rep.kept[path] = "not a vLLM name and not mapped by our processes"
                continue
            if mtime < since - 1.0:
                rep.kept[path] = "older than the incarnation"
                continue
            if foreign is None:
                foreign = foreign_vllm_starts(run_id)
            if any(mtime - FOREIGN_WINDOW_S <= t <= mtime + 1.0 for t in foreign):
                rep.kept[path] = "another vLLM started when it appeared and we never saw ours use it"
                continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            rep.removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            rep.kept[path] = f"cannot remove: {e.strerror}"
    return rep


def port_free(host: str, port: int) -> bool:
    """True when a listening socket could bind HOST:PORT now (SO_REUSEADDR, like uvicorn)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = (
        host if host not in ("", "0.0.0.0", "::") else ("::" if family == socket.AF_INET6 else "0.0.0.0")
    )
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError:
            return False
    return True


def port_owners(port: int) -> list[int]:
    """Pids listening on TCP `port` (psutil; may be empty without the rights to see them)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted(
        {c.pid for c in conns if c.pid and c.laddr and c.laddr.port == port and c.status == "LISTEN"}
    )


async def wait_port_free(host: str, port: int, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until HOST:PORT can be bound; False after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not port_free(host, port):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
