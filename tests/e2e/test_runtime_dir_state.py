"""The runtime directory under attack, as real processes: removed while a supervisor runs, its
evidence after a kill -9 mid-capture, its log retention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e


def _up_once(config: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run another `up` on `config` expecting it to end by itself; one that keeps running is
    stopped with SIGTERM (it stops its own tree) and fails the test."""
    argv = [sys.executable, "-m", "xpu_serve", "up", "-c", str(config), "--no-echo"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        raise AssertionError(f"the second `up` kept running (exit {p.returncode}):\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def test_removed_runtime_dir_does_not_let_a_second_up_kill_the_live_server(up_factory: Any) -> None:
    """`rm -rf RUNTIME` while supervisor A serves (tmpfiles cleaning /tmp does this): A's heartbeat
    writes state.json again, but the lock file is gone, so a second `up` got a fresh lock, stopped
    A's live tree as "orphans" and launched its own engine. Now the second `up` exits 5 naming A's
    pid, A keeps serving, and A re-creates and re-locks its lock file and says so in one event."""
    u = up_factory()
    u.start(env={"XPU_SERVE_STATE_HEARTBEAT_S": "0.3"})
    st = u.wait_tree(1)
    a_pid = u.proc.pid
    tree = {p["pid"] for p in st["processes"]}
    subprocess.run(["rm", "-rf", str(u.runtime)], check=True, timeout=30)
    assert not (u.runtime / "supervisor.lock").exists()
    u.wait_for(lambda: u.state().get("supervisor_pid") == a_pid, 15, "A's heartbeat writing state.json")
    r = _up_once(u.config)
    assert r.returncode == 5, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"pid {a_pid}" in lines[0], r.stderr
    assert u.proc.poll() is None
    assert all(os.path.exists(f"/proc/{p}") for p in tree)  # nobody stopped A's tree
    with urllib.request.urlopen(f"http://127.0.0.1:{u.port}/v1/models", timeout=10) as resp:
        assert resp.status == 200 and "sim" in resp.read().decode()
    u.wait_for(lambda: any("lock" in e["msg"] for e in u.events("warning")), 15, "A's lock warning")
    warn = [e for e in u.events("warning") if "lock" in e["msg"]]
    assert len(warn) == 1 and "re-locked" in warn[0]["msg"] and "gone" in warn[0]["msg"], warn
    assert (u.runtime / "supervisor.lock").read_text().strip() == str(a_pid)
    assert u.state()["state"] == "ready" and u.state()["incarnation"] == 1
    # the lock is real again: a third `up` is refused by the lock itself
    r = _up_once(u.config)
    assert r.returncode == 5 and f"pid {a_pid}" in r.stderr, r.stderr
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    assert not u.our_pids()


def test_second_up_refuses_while_the_recorded_supervisor_lives_without_its_lock_file(
    up_factory: Any,
) -> None:
    """Only the lock file removed (state.json still names A): the second `up` takes a fresh lock,
    but A's pid, start time and cmdline prove A runs, so it exits 5 naming A's pid and stops
    nothing; A keeps serving."""
    u = up_factory()
    u.start(env={"XPU_SERVE_STATE_HEARTBEAT_S": "60"})  # A re-locks only after the second `up`
    st = u.wait_tree(1)
    a_pid = u.proc.pid
    tree = {p["pid"] for p in st["processes"]}
    (u.runtime / "supervisor.lock").unlink()
    r = _up_once(u.config)
    assert r.returncode == 5, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"pid {a_pid}" in lines[0] and "lock file was removed" in lines[0], r.stderr
    assert u.proc.poll() is None and all(os.path.exists(f"/proc/{p}") for p in tree)
    assert not u.events("orphans")
    with urllib.request.urlopen(f"http://127.0.0.1:{u.port}/health", timeout=10) as resp:
        assert resp.status == 200
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    assert not u.our_pids()


def _json_lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
