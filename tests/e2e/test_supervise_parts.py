"""Parts of the supervisor with real processes, files, locks and HTTP (fast; no simulator)."""

from __future__ import annotations

import asyncio
import errno
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from xpu_serve import cleanup, exitcodes, procfs
from xpu_serve.sources import health, processes
from xpu_serve.sources.http_get import KeepAliveGet
from xpu_serve.state import LockedError, RuntimeLock, lock_holder, read_state, write_state


def test_lock_excludes_second_holder_and_is_freed_on_death(tmp_path: Path) -> None:
    lock = RuntimeLock(tmp_path)
    lock.acquire()
    assert lock_holder(tmp_path) == os.getpid()
    # a second process cannot take it, and exits with LOCKED through the CLI path
    code = (
        "import sys; from pathlib import Path; from xpu_serve.state import RuntimeLock, LockedError\n"
        "try:\n RuntimeLock(Path(sys.argv[1])).acquire()\nexcept LockedError as e:\n print(e.holder_pid); sys.exit(5)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == exitcodes.LOCKED
    assert p.stdout.strip() == str(os.getpid())
    lock.release()
    assert lock_holder(tmp_path) is None
    # a holder killed with SIGKILL leaves no stale lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code.replace("sys.exit(5)", "sys.exit(5)") + "import time; time.sleep(60)",
            str(tmp_path),
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while lock_holder(tmp_path) != holder.pid and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lock_holder(tmp_path) == holder.pid
        with pytest.raises(LockedError):
            RuntimeLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    RuntimeLock(tmp_path).acquire()


def test_state_written_atomically(tmp_path: Path) -> None:
    write_state(tmp_path, {"state": "ready", "incarnation": 2})
    assert read_state(tmp_path) == {"state": "ready", "incarnation": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left
    (tmp_path / "state.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_state(tmp_path)


def test_classify_titles() -> None:
    assert processes.classify("VLLM::EngineCore") == ("EngineCore", None)
    assert processes.classify("VLLM::EngineCore_DP0") == ("EngineCore", None)
    assert processes.classify("VLLM::Worker_TP3") == ("Worker_TP3", 3)
    assert processes.classify("VLLM::Worker_PP0_TP1") == ("Worker_TP1", 1)
    assert processes.classify("VLLM::Worker") == ("Worker", 0)
    assert processes.classify("python -m vllm.entrypoints.openai.api_server") is None


def _spawn_titled(title: str, code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([title, "-c", code], executable=sys.executable, start_new_session=True)


def test_discover_and_exit_watch_report_signal_of_grandchild() -> None:
    """A parent with two titled children; SIGSEGV to one grandchild is seen at once with its signal."""
    parent_code = (
        "import subprocess, sys, time\n"
        f"ws = [subprocess.Popen(['VLLM::Worker_TP%d' % r, '-c', 'import time; time.sleep(60)'], executable={sys.executable!r})"
        " for r in range(2)]\n"
        "print(' '.join(str(w.pid) for w in ws), flush=True)\n"
        "time.sleep(0.3)\n"  # reap late, like EngineCore's monitor thread
        "[w.wait() for w in ws]\n"
    )
    parent = subprocess.Popen(
        ["VLLM::EngineCore", "-c", parent_code],
        executable=sys.executable,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        pids = [int(x) for x in parent.stdout.readline().split()]
        want = {("Worker_TP0", 0), ("Worker_TP1", 1)}
        deadline = time.monotonic() + 10
        while True:  # the supervisor re-discovers until the tree is complete; so does the test
            found = processes.discover(parent.pid, root_name="EngineCore")
            if {(i.name, i.rank) for i in found.values()} >= want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert {(i.name, i.rank) for i in found.values()} >= want
        assert found[pids[1]].name == "Worker_TP1"

        async def watch() -> tuple[int, int | None, str | None, float]:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[tuple[int, int | None, str | None, float]] = loop.create_future()
            ew = processes.ExitWatch(loop, lambda *a: fut.done() or fut.set_result(a))
            assert ew.watch(pids[0])
            t0 = time.time()
            os.kill(pids[0], signal.SIGSEGV)
            res = await asyncio.wait_for(fut, 10)
            ew.close()
            assert res[3] - t0 < 1.0
            return res

        pid, code, sig, _ = asyncio.run(watch())
        assert pid == pids[0] and sig == "SIGSEGV" and code is None
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


_BURST_PARENT = (
    "import os, signal, time\n"
    "pids = []\n"
    "for i, sig in enumerate((signal.SIGSEGV, signal.SIGABRT)):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        time.sleep(0.3 + 0.005 * i)\n"
    "        os.kill(os.getpid(), sig)\n"
    "        time.sleep(5)\n"
    "    pids.append(pid)\n"
    "print(' '.join(map(str, pids)), flush=True)\n"
    "for _ in pids:\n"
    "    os.wait()\n"  # reaps at once, as EngineCore's executor does: the zombie is soon gone
)


_THREADS_THEN_EXIT = (
    "import os, subprocess, sys, threading\n"
    "ts = [threading.Thread(target=lambda: None) for _ in range(4)]\n"
    "[t.start() for t in ts]\n"
    "[t.join() for t in ts]\n"
    "subprocess.run(['true'])\n"  # a fork, an exec, an exit of a grandchild
    "sys.exit(7)\n"
)


@pytest.mark.skipif(processes.ProcConnector.open() is None, reason="no proc connector (not root on the host)")
def test_proc_connector_socket_carries_only_leader_exits() -> None:
    """The kernel filter on the connector socket: a child that starts 4 threads, forks and execs
    a grandchild and exits 7 delivers its exit (and the grandchild's), no fork, exec or thread
    exit event; the status read through the filter is the real one."""
    import struct

    conn = processes.ProcConnector.open()
    assert conn is not None
    try:
        p = subprocess.Popen([sys.executable, "-c", _THREADS_THEN_EXIT])
        assert p.wait(30) == 7
        seen: list[tuple[int, int, int]] = []
        deadline = time.monotonic() + 5
        while not any(pid == p.pid for _w, pid, _t in seen) and time.monotonic() < deadline:
            try:
                data = conn.sock.recv(65536)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            what = struct.unpack_from("=I", data, 36)[0]
            pid, tgid = struct.unpack_from("=II", data, 52)
            seen.append((what, pid, tgid))
        assert any(pid == p.pid for _w, pid, _t in seen), "the child's exit never came"
        assert all(w == 0x80000000 and pid == tgid for w, pid, tgid in seen), seen  # (other hosts' exits too)
    finally:
        conn.close()
    conn = processes.ProcConnector.open()
    assert conn is not None
    try:
        p = subprocess.Popen([sys.executable, "-c", _THREADS_THEN_EXIT])
        assert p.wait(30) == 7
        deadline = time.monotonic() + 5
        got = conn.status(p.pid)
        while got is None and time.monotonic() < deadline:
            time.sleep(0.01)
            got = conn.status(p.pid)
        assert got == (7, None)
    finally:
        conn.close()


@pytest.mark.skipif(processes.ProcConnector.open() is None, reason="no proc connector (not root on the host)")
def test_exit_status_of_a_reaped_grandchild_waits_for_the_late_connector_event() -> None:
    """The pidfd fires in exit_notify(), the proc connector's exit event is sent just after it,
    and the parent may reap the zombie in between: the status is asked for again instead of
    being reported unknown (which ranked a worker's SIGSEGV after its peer's later SIGABRT).
    The connector here holds back its first answer for each pid, as the kernel does when the
    pidfd wake-up wins that race; the events themselves are the kernel's."""

    class LateConnector(processes.ProcConnector):
        def __init__(self, sock: socket.socket) -> None:
            super().__init__(sock)
            self.asked: set[int] = set()
            self.held_back = 0

        def status(self, pid: int) -> tuple[int | None, str | None] | None:
            if pid not in self.asked:
                self.asked.add(pid)
                self.held_back += 1
                return None
            return super().status(pid)

    base = processes.ProcConnector.open()
    assert base is not None
    conn = LateConnector(base.sock)
    gone: list[tuple[int, float]] = []

    async def burst() -> list[tuple[int, int | None, str | None, float]]:
        loop = asyncio.get_running_loop()
        got: list[tuple[int, int | None, str | None, float]] = []
        gone.clear()
        done = asyncio.Event()

        def on_exit(pid: int, code: int | None, sig: str | None, at: float) -> None:
            got.append((pid, code, sig, at))
            if len(got) == 2:
                done.set()

        ew = processes.ExitWatch(loop, on_exit, connector=conn, on_gone=lambda pid, at: gone.append((pid, at)))
        p = subprocess.Popen([sys.executable, "-c", _BURST_PARENT], stdout=subprocess.PIPE)
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        for pid in pids:
            assert ew.watch(pid)
        await asyncio.wait_for(done.wait(), 10)
        assert not ew.deferred
        ew.close()
        p.wait()
        by_pid = {g[0]: g for g in got}
        for pid, at in gone:  # announced dead at once, with the time its status is reported with
            assert by_pid[pid][3] == at
        return [by_pid[pid] for pid in pids]

    try:
        for _ in range(12):  # until the zombie was gone at least once (about 3 runs in 4 here)
            before = conn.held_back
            segv, abrt = asyncio.run(burst())
            assert (segv[1], segv[2]) == (None, "SIGSEGV")
            assert (abrt[1], abrt[2]) == (None, "SIGABRT")
            assert segv[3] <= abrt[3]  # the time the pidfd fired, not the time of the answer
            if conn.held_back > before:
                break
        assert conn.held_back > 0, "the zombie was never gone before its status was read"
        assert gone, "a death whose status was held back is announced before its status"
    finally:
        conn.close()


def test_exit_watch_polling_fallback_and_direct_child_status() -> None:
    async def go() -> tuple[int, int | None, str | None, float]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, int | None, str | None, float]] = loop.create_future()
        ew = processes.ExitWatch(loop, lambda *a: fut.done() or fut.set_result(a), poll_interval_s=0.02)
        ew.use_pidfd = False
        p = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.2); sys.exit(7)"])
        ew.watch(p.pid, status=lambda: processes.returncode_status(p.wait()))
        res = await asyncio.wait_for(fut, 10)
        ew.close()
        return res

    _, code, sig, _ = asyncio.run(go())
    assert (code, sig) == (7, None)


def test_stop_tree_finds_reparented_marked_process_and_escalates(tmp_path: Path) -> None:
    """A member that left the session (setsid) and ignores SIGTERM is found by its marker and killed;
    a process of another run id is never touched."""
    env = dict(os.environ, XPU_SERVE_RUN_ID="runA", XPU_SERVE_INCARNATION="3")
    stubborn = (
        "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nos.setsid()\n"
        "open(os.environ['READY'], 'w').write('x')\ntime.sleep(60)\n"
    )
    ready = tmp_path / "ready"
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {stubborn!r}]); time.sleep(60)",
        ],
        env=dict(env, READY=str(ready)),
        start_new_session=True,
    )
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=dict(env, XPU_SERVE_RUN_ID="runB")
    )
    try:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        members = cleanup.find_members("runA", 3, [leader.pid])
        assert leader.pid in members and len(members) == 2 and other.pid not in members
        rep = asyncio.run(cleanup.stop_tree(leader.pid, "runA", 3, [leader.pid], grace_s=0.3))
        leader.wait(5)
        assert rep.left == []
        assert len(rep.killed) == 1  # the stubborn one needed SIGKILL
        assert cleanup.find_members("runA", 3, [leader.pid]) == set()
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        if leader.poll() is None:
            leader.kill()
            leader.wait()


def test_remove_segments_only_ours(tmp_path: Path) -> None:
    """New segments our process mapped are removed; one another live process maps is kept."""
    since = time.time()
    before = cleanup.snapshot_segments()
    tag = f"{os.getpid()}_{int(since * 1000)}"
    ours = Path(f"/dev/shm/psm_xstest_ours_{tag}")
    theirs = Path(f"/dev/shm/psm_xstest_theirs_{tag}")
    holder_code = (
        "import mmap, os, sys, time\nfd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); os.ftruncate(fd, 4096)\n"
        "m = mmap.mmap(fd, 4096); print('ok', flush=True); time.sleep(60)\n"
    )
    mine = subprocess.Popen([sys.executable, "-c", holder_code, str(ours)], stdout=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", holder_code, str(theirs)], stdout=subprocess.PIPE)
    try:
        for p in (mine, other):
            assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
        owned = cleanup.segments_of([mine.pid])
        assert str(ours) in owned and str(theirs) not in owned
        mine.kill()
        mine.wait()
        rep = cleanup.remove_segments(before, owned, since, "no-such-run")
        assert str(ours) in rep.removed and not ours.exists()
        assert rep.kept.get(str(theirs)) == "in use by a live process" and theirs.exists()
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
        for f in (ours, theirs):
            f.unlink(missing_ok=True)


def test_port_helpers() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        assert not cleanup.port_free("127.0.0.1", port)
        assert os.getpid() in cleanup.port_owners(port)
        assert asyncio.run(cleanup.wait_port_free("127.0.0.1", port, 0.2)) is False
    finally:
        s.close()
    assert cleanup.port_free("127.0.0.1", port)


def test_readiness_needs_health_and_served_name() -> None:
    models: list[str] = []
    status = {"health": 200}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":
                self.send_response(status["health"])
                self.end_headers()
                return
            body = json.dumps({"object": "list", "data": [{"id": m} for m in models]}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed_port = free.getsockname()[1]
    free.close()

    async def go() -> list[tuple[bool, str]]:
        out = []
        getter = KeepAliveGet(health.probe_address("0.0.0.0"), port, 2.0)
        try:
            out.append(await health.probe_ready(getter, "tiny"))
            models.append("tiny")
            out.append(await health.probe_ready(getter, "tiny"))
            status["health"] = 503
            out.append(await health.probe_ready(getter, "tiny"))
            fired: list[tuple[int, str]] = []
            mon = health.HealthMonitor(getter, 0.01, 3, lambda n, d: fired.append((n, d)))
            t = asyncio.create_task(mon.run())
            while not fired:
                await asyncio.sleep(0.01)
            t.cancel()
            out.append((False, f"{fired[0][0]} {fired[0][1]}"))
        finally:
            getter.close()
        nobody = KeepAliveGet("127.0.0.1", closed_port, 2.0)
        try:
            out.append(await health.probe_ready(nobody, "tiny"))
        finally:
            nobody.close()
        return out

    try:
        res = asyncio.run(go())
    finally:
        srv.shutdown()
    assert res[0][0] is False and "does not list 'tiny'" in res[0][1]
    assert res[1] == (True, "ready")
    assert res[2] == (False, "/health: HTTP 503")
    assert res[3] == (False, "3 HTTP 503")
    assert res[4] == (False, "/health: connection refused")


# ---- issue 4: never signal what is not proven ours; SIGCONT; state under ENOSPC; status shapes ----


def _setsid_sleep() -> subprocess.Popen[bytes]:
    """A foreign process leading its own session and group (`setsid sleep 300`), no marker."""
    return subprocess.Popen(["sleep", "300"], start_new_session=True, env={"PATH": os.environ["PATH"]})


def test_foreign_group_with_a_recorded_pgid_is_never_signalled() -> None:
    """A live group whose id equals a recorded pgid is not ours unless its leader is proven (marker
    or start time): stop_tree leaves it alone; the right start time proves it."""
    sleeper = _setsid_sleep()
    try:
        real = procfs.start_time(sleeper.pid)
        assert real is not None
        wrong = {sleeper.pid: real - 3600.0}  # what an old state.json recorded for that pid
        assert cleanup.find_members("0123456789ab", None, [sleeper.pid], [sleeper.pid], wrong) == set()
        assert not cleanup.is_proven(sleeper.pid, "0123456789ab", None, wrong)
        rep = asyncio.run(
            cleanup.stop_tree(sleeper.pid, "0123456789ab", None, [sleeper.pid], 0.3, starts=wrong)
        )
        assert rep.terminated == [] and rep.killed == [] and sleeper.poll() is None
        sigs = cleanup.signal_tree(sleeper.pid, "0123456789ab", None, signal.SIGKILL, [sleeper.pid], wrong)
        assert sigs == set() and sleeper.poll() is None
        # the start time recorded for the very process proves it (and only then is it stopped)
        assert cleanup.is_proven(sleeper.pid, None, None, {sleeper.pid: real})
        rep = asyncio.run(
            cleanup.stop_tree(sleeper.pid, None, None, [sleeper.pid], 3.0, starts={sleeper.pid: real})
        )
        assert rep.terminated == [sleeper.pid] and sleeper.wait(5) == -signal.SIGTERM
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        sleeper.wait()


def test_stop_tree_continues_a_stopped_member() -> None:
    """A SIGSTOPped member (Python SIGTERM handler) acts on SIGTERM only once continued: stop_tree
    sends SIGCONT after SIGTERM, so the stop takes well under grace_s and needs no SIGKILL."""
    env = dict(os.environ, XPU_SERVE_RUN_ID="runC", XPU_SERVE_INCARNATION="1")
    code = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(60)\n"
    p = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        time.sleep(0.3)  # the handler is installed
        os.kill(p.pid, signal.SIGSTOP)
        rep = asyncio.run(cleanup.stop_tree(p.pid, "runC", 1, [p.pid], grace_s=20.0))
        assert p.wait(5) == 0  # its own handler ran: exit 0, not a SIGKILL
        assert rep.killed == [] and rep.seconds < 5.0
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def _mount_tmpfs(mnt: Path, options: str) -> Path:
    """Mount a real tmpfs with `options` at `mnt` (made here); skips the test where mount is not
    permitted (not root). The caller unmounts it (`umount -l`)."""
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    return mnt


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Any:
    """A real 2 MB tmpfs (root only; skipped where mount is not permitted); lazily unmounted."""
    mnt = _mount_tmpfs(tmp_path / "tiny", "size=2m")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill_disk(directory: Path) -> None:
    """Write RUNTIME-local filler files until the filesystem says ENOSPC."""
    i = 0
    while True:
        try:
            with open(directory / f"filler-{i}", "wb") as f:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            if i > 0:
                return
            i += 1  # fill the last partial block with a small file too


def test_state_rewritten_in_place_when_the_disk_is_full(tiny_tmpfs: Path) -> None:
    write_state(tiny_tmpfs, {"state": "ready", "incarnation": 1})
    fill_disk(tiny_tmpfs)
    with pytest.raises(OSError):
        (tiny_tmpfs / "probe").write_bytes(b"x" * 65536)
    assert write_state(tiny_tmpfs, {"state": "ready", "incarnation": 2, "x": "y" * 2000}) == "in-place"
    assert read_state(tiny_tmpfs) == {"state": "ready", "incarnation": 2, "x": "y" * 2000}
    assert not [p for p in tiny_tmpfs.iterdir() if p.name.startswith(".state.")]  # no temp left
    # a state larger than the padded file cannot be written in place: OSError, old file intact
    with pytest.raises(OSError):
        write_state(tiny_tmpfs, {"state": "ready", "incarnation": 3, "x": "z" * 40000})
    assert read_state(tiny_tmpfs)["incarnation"] == 2  # type: ignore[index]



def test_state_rewritten_in_place_when_no_inode_is_left(tmp_path: Path) -> None:
    """A real tmpfs with 8 inodes (root only): the temp file of the atomic write cannot even be
    created (ENOSPC from open); state.json is rewritten in place instead of going stale."""
    mnt = _mount_tmpfs(tmp_path / "ino", "size=4m,nr_inodes=8")
    try:
        assert write_state(mnt, {"state": "ready", "incarnation": 1}) == "atomic"
        i = 0
        with pytest.raises(OSError) as full:
            while True:
                (mnt / f"f{i}").touch()
                i += 1
        assert full.value.errno == errno.ENOSPC
        assert write_state(mnt, {"state": "ready", "incarnation": 2}) == "in-place"
        assert read_state(mnt) == {"state": "ready", "incarnation": 2}
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

@pytest.mark.parametrize(
    "content",
    [
        b'{"processes": "x"}',
        b'{"processes": ["x"]}',
        b'{"processes": [{"pid": "12", "name": 3}]}',
        b'{"engine": [1, 2]}',
        b'{"last_incident": "boom"}',
        b'{"last_incident": {"time": "noon"}}',
        b'{"time_to_ready_s": "fast"}',
        b'{"next_restart_at": 1e300}',
        b'{"kernel_watch": 7}',
        b'{"state": {"a": 1}, "incarnation": "two"}',
        b"[1, 2, 3]",
        b'{"state": "ready", "incarn',
        b"\xff\xfe\x00garbage\x89PNG",
        b"",
        b"[" * 100000,
    ],
)
def test_status_on_malformed_state_is_one_line_exit_2(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "state.json").write_bytes(content)
    for extra in ([], ["--json"]):
        r = subprocess.run(
            [sys.executable, "-m", "xpu_serve", "status", "--runtime-dir", str(tmp_path), *extra],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if content == b'{"next_restart_at": 1e300}':  # a well-typed but absurd time: shown, no crash
            assert r.returncode == 1 and "Traceback" not in r.stderr, r
            assert extra or "out of range" in r.stdout, r.stdout
            continue
        assert r.returncode == 2, (content, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert str(tmp_path / "state.json") in r.stderr


def test_status_flags_a_stale_state_while_the_supervisor_runs(tmp_path: Path) -> None:
    lock = RuntimeLock(tmp_path)
    lock.acquire()  # this process plays the running supervisor
    try:
        old = time.time() - 60
        write_state(
            tmp_path,
            {
                "state": "ready",
                "incarnation": 1,
                "supervisor_pid": os.getpid(),
                "written_at": old,
                "updated_at": old,
                "heartbeat_s": 2.0,
            },
        )
        cmd = [sys.executable, "-m", "xpu_serve", "status", "--runtime-dir", str(tmp_path)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "MAY BE STALE" in r.stdout and "last written 60 s ago" in r.stdout, r
        j = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=30).stdout)
        assert j["state_stale"] is True and 59 < j["state_age_s"] < 90
        now = time.time()
        write_state(
            tmp_path,
            {
                "state": "ready",
                "incarnation": 1,
                "supervisor_pid": os.getpid(),
                "written_at": now,
                "updated_at": now,
                "heartbeat_s": 2.0,
            },
        )
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "STALE" not in r.stdout
    finally:
        lock.release()
