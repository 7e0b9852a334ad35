"""Process source: discover the vLLM process tree and watch each process for its exit.

Tree discovery. vLLM V1 runs the API server (the process we launch), which spawns the engine
core, which spawns one worker per TP rank. vLLM names them with setproctitle
(vllm/utils/system_utils.py: `bind_process_name` / `set_process_title`, titles
`VLLM::EngineCore`, `VLLM::EngineCore_DP0`, `VLLM::Worker_TP0`, `VLLM::Worker_PP0_TP1`, and
`VLLM::Worker` with TP=1), so `/proc/PID/cmdline` tells the ranks apart while the kernel's `comm`
is cut to 15 bytes (`VLLM::Worker_TP` for every rank). Log prefixes `(Worker_TP0 pid=N)` map
pids to ranks too (`learn_prefix`).

Exit watch. `ExitWatch` opens a pidfd per process (`os.pidfd_open`, Linux >= 5.3) and registers
it with the asyncio loop (`add_reader`): the loop wakes the moment the process exits, at no cost
while it runs. Where pidfds are not available it polls `/proc/PID/stat`. The exit status is known
for our direct child (waitpid, via the `status` hook) and, for grandchildren, read from the
zombie's `/proc/PID/stat` field 52 (`exit_code`, Linux >= 3.5, proc(5)) in the short window
before their own parent reaps them; otherwise it is reported as unknown.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from xpu_serve import procfs
from xpu_serve.incarnation import ProcessInfo

# VLLM::EngineCore, VLLM::EngineCore_DP0, VLLM::Worker, VLLM::Worker_TP3, VLLM::Worker_PP0_TP1,
# VLLM::Worker_DP1_TP0 (vllm/v1/executor/multiproc_executor.py, vllm/v1/engine/core.py).
_TITLE_RE = re.compile(r"^VLLM::(EngineCore|Worker)((?:_[A-Z]{2}\d+)*)")
_TP_RE = re.compile(r"_TP(\d+)")


def classify(cmdline: str) -> tuple[str, int | None] | None:
    """(name, rank) for a vLLM process title, else None.

    "VLLM::EngineCore_DP0" -> ("EngineCore", None); "VLLM::Worker_TP2" -> ("Worker_TP2", 2);
    "VLLM::Worker" -> ("Worker", 0) (TP=1 has a single worker, rank 0).
    """
    m = _TITLE_RE.match(cmdline)
    if not m:
        return None
    if m.group(1) == "EngineCore":
        return "EngineCore", None
    suffix = m.group(2)
    tp = _TP_RE.search(suffix)
    if tp:
        return f"Worker_TP{tp.group(1)}", int(tp.group(1))
    return "Worker" + suffix, 0


def discover(root_pid: int, root_name: str = "APIServer") -> dict[int, ProcessInfo]:
    """The vLLM processes under (and including) `root_pid`, pid -> ProcessInfo.

    The root is named `root_name`; descendants are kept only when their title classifies as
    EngineCore or a worker (the multiprocessing resource tracker and compile helpers are left
    out: they are stopped with the process group, not watched). Processes that vanish during the
    walk are skipped. Never raises for a gone root: returns {}.
    """
    found: dict[int, ProcessInfo] = {}
    try:
        root = psutil.Process(root_pid)
        found[root_pid] = ProcessInfo(name=root_name, pid=root_pid, started_at=root.create_time())
        children = root.children(recursive=True)
    except psutil.Error:
        return found
    titled: dict[int, tuple[psutil.Process, tuple[str, int | None]]] = {}
    for child in children:
        cmd = procfs.title(child.pid)
        c = classify(cmd) if cmd else None
        if c is not None:
            titled[child.pid] = (child, c)
    for pid, (child, c) in titled.items():
        try:
            started, ppid = child.create_time(), child.ppid()
        except psutil.Error:
            continue
        if ppid in titled and titled[ppid][1][0] == c[0]:
            # a fork of that process still carrying its title (a helper before its exec): not
            # the rank. Measured with the real engine: a short-lived "VLLM::Worker_TP1" child of
            # node 1's worker during its KV cache set-up, taken for the worker, failed the group.
            continue
        found[pid] = ProcessInfo(name=c[0], pid=pid, rank=c[1], started_at=started)
    return found


def learn_prefix(processes: dict[int, ProcessInfo], name: str | None, pid: int | None) -> None:
    """Use a vLLM log prefix `(Worker_TP1 pid=N)` to name a known pid (and its rank) in place.

    Only pids already in `processes` are updated (the prefix pid is in the engine's pid namespace,
    which is ours unless the engine runs in a container; unknown pids are ignored).
    """
    if not name or pid is None or pid not in processes:
        return
    info = processes[pid]
    tp = _TP_RE.search(name)
    if "Worker" in name and tp:  # Worker_TP1, VllmWorker_TP1 (older vLLM "VllmWorker TP1")
        info.name, info.rank = f"Worker_TP{tp.group(1)}", int(tp.group(1))
    elif name.startswith("EngineCore"):
        info.name, info.rank = "EngineCore", None


def zombie_status(pid: int) -> tuple[int | None, str | None]:
    """(exit_code, signal_name) of an exited, not yet reaped process from /proc/PID/stat.

    Field 52 of /proc/PID/stat is the wait status (proc(5), "exit_code (since Linux 3.5)");
    only meaningful while the process is a zombie. (None, None) when unknown or already reaped.
    """
    tail = procfs.stat_fields(pid)
    # tail[0] is field 3 (state); field 52 is tail[49].
    if not tail or tail[0] not in (b"Z", b"X") or len(tail) < 50:
        return None, None
    try:
        return decode_wait_status(int(tail[49]))
    except ValueError:
        return None, None


def decode_wait_status(status: int) -> tuple[int | None, str | None]:
    """A waitpid(2) status -> (exit_code, None) or (None, "SIGSEGV")."""
    if os.WIFSIGNALED(status):
        return None, signal_name(os.WTERMSIG(status))
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def signal_name(signum: int) -> str:
    """11 -> "SIGSEGV"; unknown numbers -> "SIG<n>"."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


def returncode_status(returncode: int | None) -> tuple[int | None, str | None]:
    """A `subprocess.Popen.returncode` (negative for signals) -> (exit_code, signal_name)."""
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, signal_name(-returncode)
    return returncode, None


ExitCallback = Callable[[int, "int | None", "str | None", float], None]
"""on_exit(pid, exit_code, signal_name, at_epoch_seconds)."""


# A grandchild's exit status missing from the proc connector when its pidfd fired is asked for
# again after each of these delays (seconds; at most 41 ms added to a detection whose status
# would otherwise be unknown; the event usually follows within microseconds).
CONNECTOR_RETRY_S = (0.001, 0.005, 0.01, 0.025)


@dataclass
class _Watched:
    pid: int
    fd: int | None
    status: Callable[[], tuple[int | None, str | None]] | None


class ExitWatch:
    """Watch processes for exit on an asyncio loop; calls `on_exit(pid, code, signal, at)` once each.

    The status comes from `status` (direct child), else the zombie's /proc/PID/stat, else the
    `connector` (a `ProcConnector`, when the host allows one), else it is unknown (None, None).

    `watch(pid, status=None)`: start watching; `status` (optional) returns the exit status for
    a direct child (e.g. from `Popen.poll()`); others get `zombie_status`. Returns False when the
    process is already gone (on_exit is then called soon, with an unknown status).
    Uses pidfds when `os.pidfd_open` works, else polls every `poll_interval_s` seconds.
    `on_gone(pid, at)` (optional) is called at once for such a deferred report, so the death
    is known before its status. `deferred`: pids that have exited but whose report waits (at most sum(CONNECTOR_RETRY_S)
    s) for the connector's exit status. Must be used from the loop's thread. `close()` stops all watches.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_exit: ExitCallback,
        poll_interval_s: float = 0.05,
        connector: ProcConnector | None = None,
        on_gone: Callable[[int, float], None] | None = None,
    ):
        self._loop = loop
        self._connector = connector
        self._on_exit = on_exit
        self._on_gone = on_gone
        self._poll_interval_s = poll_interval_s
        self._watched: dict[int, _Watched] = {}
        self._poll_task: asyncio.Task[None] | None = None
        self.deferred: set[int] = set()  # exited; report waits for the connector's status
        # pid -> the kernel's exit time (epoch s, from the connector) of a reported exit, when
        # known; the `at` of on_exit is the time the exit was seen (a stopped loop sees it late)
        self.died_at: dict[int, float] = {}
        self.use_pidfd = hasattr(os, "pidfd_open")
        self.closed = False

    @property
    def pids(self) -> set[int]:
        return set(self._watched)

    def watch(self, pid: int, status: Callable[[], tuple[int | None, str | None]] | None = None) -> bool:
        if self.closed or pid in self._watched:
            return True
        fd: int | None = None
        if self.use_pidfd:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._loop.call_soon(self._report, _Watched(pid, None, status))
                return False
            except OSError:  # ENOSYS (old kernel), EPERM (seccomp): fall back to polling
                self.use_pidfd = False
        w = _Watched(pid, fd, status)
        self._watched[pid] = w
        if self._connector is not None:
            if self._connector.interest is None:
                self._connector.interest = set()
            self._connector.interest.add(pid)
        if fd is not None:
            self._loop.add_reader(fd, self._fired, pid)
        elif self._poll_task is None:
            self._poll_task = self._loop.create_task(self._poll())
        return True

    def _fired(self, pid: int) -> None:
        w = self._watched.pop(pid, None)
        if w is None:
            return
        self._report(w)  # read the zombie's status first: its parent may reap it any moment
        self._release(w)

    def _release(self, w: _Watched) -> None:
        if w.fd is not None:
            self._loop.remove_reader(w.fd)
            os.close(w.fd)
            w.fd = None

    def _report(self, w: _Watched, at: float | None = None, tries: int = 0) -> None:
        at = time.time() if at is None else at
        code, sig = (None, None)
        if w.status is not None:
            code, sig = w.status()
        if code is None and sig is None:
            code, sig = zombie_status(w.pid)
        if code is None and sig is None and self._connector is not None:
            st = self._connector.status(w.pid)
            if st is not None:
                code, sig = st
            elif tries < len(CONNECTOR_RETRY_S) and not self.closed:
                # The kernel wakes pidfd waiters in exit_notify() and sends the connector's exit
                # event just after it (kernel/exit.c do_exit: proc_exit_connector); the parent
                # (EngineCore) may have reaped the zombie in between. Ask again shortly instead
                # of reporting an unknown status, which would rank this death after a peer's
                # later SIGABRT. `at` stays the time the pidfd fired.
                if tries == 0 and self._on_gone is not None:
                    self._on_gone(w.pid, at)  # dead now; its status follows
                self.deferred.add(w.pid)
                self._loop.call_later(CONNECTOR_RETRY_S[tries], self._report, w, at, tries + 1)
                return
        self.deferred.discard(w.pid)
        if self._connector is not None:
            died = self._connector.died_at(w.pid)
            if died is not None and died <= at + 0.001:
                self.died_at[w.pid] = died
            if self._connector.interest is not None:
                self._connector.interest.discard(w.pid)
        self._on_exit(w.pid, code, sig, at)

    async def _poll(self) -> None:
        while self._watched:
            await asyncio.sleep(self._poll_interval_s)
            for pid, w in list(self._watched.items()):
                if w.fd is None and not procfs.alive(pid):
                    self._watched.pop(pid, None)
                    self._report(w)
        self._poll_task = None

    def unwatch(self, pid: int) -> None:
        w = self._watched.pop(pid, None)
        if w is not None:
            self._release(w)

    def close(self) -> None:
        self.closed = True
        for w in list(self._watched.values()):
            self._release(w)
        self._watched.clear()
        if self._poll_task is not None:
            self._poll_task.cancel()
            self._poll_task = None


# --------------------------------------------------------------------------------------------
# Exit statuses of any process from the kernel's process-events connector (netlink).
# --------------------------------------------------------------------------------------------

# linux/netlink.h, linux/connector.h, linux/cn_proc.h. Written with `struct` (no library wraps the
# proc connector in the well-kept set); needs the initial user and pid namespaces (not a
# container), and CAP_NET_ADMIN on kernels before 6.6 (drivers/connector/cn_proc.c).
_NETLINK_CONNECTOR = 11
_CN_IDX_PROC = 1
_CN_VAL_PROC = 1
_PROC_CN_MCAST_LISTEN = 1
_PROC_EVENT_EXIT = 0x80000000
_NLMSG_DONE = 3
_NLMSG_HDR = "=IHHII"  # len, type, flags, seq, pid
_CN_MSG = "=IIIIHH"  # id.idx, id.val, seq, ack, len, flags
_EVENT_HDR = "=IIQ"  # what, cpu, timestamp_ns
_EXIT_EVENT = "=IIII"  # process_pid, process_tgid, exit_code, exit_signal
_SO_ATTACH_FILTER = 26  # asm-generic/socket.h
# Offsets in one connector datagram: nlmsghdr (16) + cn_msg (20), then struct proc_event: `what`,
# and in its exit event `process_pid`, `process_tgid`.
_WHAT_AT, _PID_AT, _TGID_AT = 36, 52, 56


def _exit_filter() -> bytes:
    """A classic BPF program (linux/filter.h `struct sock_filter` array) that keeps only the exit
    events of thread-group leaders: every fork, exec, comm change and thread exit on the host is
    dropped in the kernel instead of waking and costing the supervisor a parse (on a busy host
    they are most of the connector's traffic). BPF_ABS loads read big-endian words, the event's
    fields are in host order: the constant is the host bytes of PROC_EVENT_EXIT read big-endian."""
    import struct

    exit_be = int.from_bytes(struct.pack("=I", _PROC_EVENT_EXIT), "big")
    ld_w_abs, jeq_k, jeq_x, tax, ret_k = 0x20, 0x15, 0x1D, 0x07, 0x06
    prog = [
        (ld_w_abs, 0, 0, _WHAT_AT),
        (jeq_k, 0, 5, exit_be),  # not an exit: drop
        (ld_w_abs, 0, 0, _PID_AT),
        (tax, 0, 0, 0),
        (ld_w_abs, 0, 0, _TGID_AT),
        (jeq_x, 0, 1, 0),  # a thread, not its group's leader: drop
        (ret_k, 0, 0, 0xFFFFFFFF),
        (ret_k, 0, 0, 0),
    ]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def _attach_exit_filter(sock: socket.socket) -> bool:
    """Attach `_exit_filter` (SO_ATTACH_FILTER, `struct sock_fprog`: length, pointer to the
    program; the kernel copies it). False when the kernel refuses: every event is then read."""
    import array
    import struct

    prog = array.array("B", _exit_filter())
    addr, _n = prog.buffer_info()
    fprog = struct.pack("@HP", len(prog) // 8, addr)
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
    except OSError:
        return False
    return True


def _monotonic_ns_to_epoch(ts_ns: int) -> float:
    """A CLOCK_MONOTONIC time (ns) as epoch seconds, by the offset between the two clocks now."""
    return time.time() - (time.monotonic_ns() - ts_ns) / 1e9


class ProcConnector:
    """Exit statuses of every process on the host, from the kernel's proc connector.

    `open()` returns None when unavailable (not the initial namespaces, no CAP_NET_ADMIN on a
    kernel before 6.6, no connector). `drain()` reads every pending event without blocking and records
    tgid -> (exit_code, signal_name) for thread-group leaders; `status(pid)` pops one.
    Kept for at most `keep` pids (oldest dropped). The socket's fd can be given to the event loop.
    """

    def __init__(self, sock: socket.socket, keep: int = 4096):
        self.sock = sock
        self.keep = keep
        self.interest: set[int] | None = None  # record only these pids (None: every process)
        self._status: dict[int, tuple[int | None, str | None]] = {}
        self._died: dict[int, float] = {}  # tgid -> the kernel's exit time, epoch s

    @classmethod
    def open(cls) -> ProcConnector | None:
        import struct

        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
        except (OSError, AttributeError):
            return None
        try:
            for opt in (33, socket.SO_RCVBUF):  # SO_RCVBUFFORCE (root) else SO_RCVBUF: 4 MiB
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
                    break
                except OSError:
                    continue
            _attach_exit_filter(sock)
            sock.bind((0, _CN_IDX_PROC))
            payload = struct.pack("=I", _PROC_CN_MCAST_LISTEN)
            cn = struct.pack(_CN_MSG, _CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(payload), 0) + payload
            nl = struct.pack(_NLMSG_HDR, 16 + len(cn), _NLMSG_DONE, 0, 0, 0) + cn
            sock.send(nl)
            sock.setblocking(False)
        except OSError:
            sock.close()
            return None
        return cls(sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> None:
        import struct

        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ENOBUFS: events were lost; go on with what comes next
                continue
            off = 0
            while off + 16 <= len(data):
                nlen = struct.unpack_from(_NLMSG_HDR, data, off)[0]
                if nlen < 16:
                    break
                body = off + 16 + 20
                if body + 16 + 16 <= len(data):
                    what, _cpu, ts_ns = struct.unpack_from(_EVENT_HDR, data, body)
                    if what == _PROC_EVENT_EXIT:
                        pid, tgid, code, _sig = struct.unpack_from(_EXIT_EVENT, data, body + 16)
                        if pid == tgid and (self.interest is None or tgid in self.interest):
                            if len(self._status) >= self.keep:
                                self._status.pop(next(iter(self._status)))
                            self._status[tgid] = decode_wait_status(code)
                            if len(self._died) >= self.keep:
                                self._died.pop(next(iter(self._died)))
                            self._died[tgid] = _monotonic_ns_to_epoch(ts_ns)
                off += (nlen + 3) & ~3

    def status(self, pid: int) -> tuple[int | None, str | None] | None:
        self.drain()
        return self._status.pop(pid, None)

    def died_at(self, pid: int) -> float | None:
        """When the kernel sent `pid`'s exit event (epoch s; the event's `timestamp_ns`,
        ktime_get_ns() in drivers/connector/cn_proc.c proc_exit_connector, i.e. CLOCK_MONOTONIC),
        popped; None when no event was seen for it."""
        self.drain()
        return self._died.pop(pid, None)

    def close(self) -> None:
        self.sock.close()
