"""stop_tree after a hang verdict: members that cannot exit get SIGKILL early (real processes, real
signals). A rank blocked in a collective stands as a process that ignores SIGTERM; a member still
stopped after SIGCONT as a ptrace-stopped child (state t: SIGCONT does not resume it)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

from xpu_serve import cleanup, procfs

# leader ignores SIGTERM and forks: a child that ignores SIGTERM, and a child that stops under
# ptrace (PTRACE_TRACEME then SIGSTOP: the leader is its tracer and never resumes it)
TREE = r"""
import ctypes, os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    while True: time.sleep(1)
if os.fork() == 0:
    ctypes.CDLL(None, use_errno=True).ptrace(0, 0, None, None)
    os.kill(os.getpid(), signal.SIGSTOP)
    while True: time.sleep(1)
print("up", flush=True)
while True: time.sleep(1)
"""


def _start_tree(run_id: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, XPU_SERVE_RUN_ID=run_id, XPU_SERVE_INCARNATION="1")
    p = subprocess.Popen(
        [sys.executable, "-c", TREE], env=env, stdout=subprocess.PIPE, start_new_session=True
    )
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        members = cleanup.find_members(run_id, 1, [p.pid])
        if len(members) == 3 and any(procfs.state(m) == "t" for m in members):
            return p
        time.sleep(0.05)
    raise AssertionError(f"tree not up: {members}")


def _stop(p: subprocess.Popen[bytes], run_id: str, hang: bool) -> cleanup.StopReport:
    try:
        return asyncio.run(cleanup.stop_tree(p.pid, run_id, 1, [p.pid], grace_s=10.0, hang=hang))
    finally:
        p.wait(timeout=10)


def test_hang_stop_kills_what_cannot_exit_early() -> None:
    run_id = uuid.uuid4().hex
    p = _start_tree(run_id)
    traced = next(m for m in cleanup.find_members(run_id, 1, [p.pid]) if procfs.state(m) == "t")
    rep = _stop(p, run_id, hang=True)
    assert rep.seconds < 5.0, rep
    assert rep.left == [] and cleanup.find_members(run_id, 1) == set()
    assert len(rep.early) == 3 and sorted(rep.killed) == sorted(rep.terminated)
    assert rep.early[traced] == "hung (state T)"
    assert rep.early[p.pid] == "in a collective"
    assert rep.early_text() == "3 SIGKILL early: hung (state T), in a collective"


def test_graceful_stop_keeps_full_grace() -> None:
    run_id = uuid.uuid4().hex
    p = _start_tree(run_id)
    rep = _stop(p, run_id, hang=False)
    assert rep.seconds >= 9.0, rep
    assert rep.early == {} and rep.early_text() == ""
    assert len(rep.killed) == 3 and rep.left == []
    assert p.returncode == -signal.SIGKILL
