"""Parts of the supervisor with real processes, files, locks and HTTP (fast; no simulator)."""

from __future__ import annotations

import asyncio
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

import pytest

from xpu_serve import cleanup, exitcodes
from xpu_serve.sources import health, processes
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
        found = processes.discover(parent.pid, root_name="EngineCore")
        assert {(i.name, i.rank) for i in found.values()} >= {("Worker_TP0", 0), ("Worker_TP1", 1)}
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
    url = health.base_url("0.0.0.0", srv.server_address[1])

    async def go() -> list[tuple[bool, str]]:
        out = []
        async with health.make_client(2.0) as c:
            out.append(await health.probe_ready(c, url, "tiny"))
            models.append("tiny")
            out.append(await health.probe_ready(c, url, "tiny"))
            status["health"] = 503
            out.append(await health.probe_ready(c, url, "tiny"))
            fired: list[tuple[int, str]] = []
            mon = health.HealthMonitor(c, url, 0.01, 3, lambda n, d: fired.append((n, d)))
            t = asyncio.create_task(mon.run())
            while not fired:
                await asyncio.sleep(0.01)
            t.cancel()
            out.append((False, f"{fired[0][0]} {fired[0][1]}"))
        return out

    try:
        res = asyncio.run(go())
    finally:
        srv.shutdown()
    assert res[0][0] is False and "does not list 'tiny'" in res[0][1]
    assert res[1] == (True, "ready")
    assert res[2] == (False, "/health: HTTP 503")
    assert res[3] == (False, "3 HTTP 503")
