"""procfs: process facts of real processes (a child with a title, an environment, a stopped
state, a zombie, a grandchild, a mapped /dev/shm file)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from xpu_serve import procfs

CHILD = r"""
import mmap, os, subprocess, sys, time
shm = f"/dev/shm/xpu-serve-procfs-test-{os.getpid()}"
with open(shm, "wb") as f:
    f.write(b"\0" * 4096)
fd = os.open(shm, os.O_RDWR)
m = mmap.mmap(fd, 4096)
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(shm, g.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[bytes], str, int]]:
    env = dict(os.environ, XPU_SERVE_RUN_ID="procfs-test", XPU_SERVE_INCARNATION="4")
    p = subprocess.Popen([sys.executable, "-c", CHILD, "keep"], env=env, stdout=subprocess.PIPE)
    assert p.stdout is not None
    shm, gpid = p.stdout.readline().decode().split()
    try:
        yield p, shm, int(gpid)
    finally:
        os.kill(int(gpid), signal.SIGKILL)
        p.kill()
        p.wait()
        if os.path.exists(shm):
            os.unlink(shm)


def test_facts_of_a_live_child(child: tuple[subprocess.Popen[bytes], str, int]) -> None:
    p, shm, gpid = child
    assert procfs.cmdline(p.pid) == [sys.executable, "-c", CHILD, "keep"]
    assert procfs.title(p.pid) == " ".join([sys.executable, "-c", CHILD, "keep"])
    env = procfs.environ(p.pid)
    assert env is not None and env["XPU_SERVE_RUN_ID"] == "procfs-test" and env["XPU_SERVE_INCARNATION"] == "4"
    assert procfs.state(p.pid) in ("S", "R")
    assert procfs.alive(p.pid)
    start = procfs.start_time(p.pid)
    assert start is not None and abs(start - time.time()) < 60
    assert procfs.same_process(p.pid, start, 0.05) and not procfs.same_process(p.pid, start - 1.0, 0.05)
    assert procfs.still_running(p.pid, start, 0.05) and procfs.still_running(p.pid, None, 0.05)
    assert procfs.children(p.pid) == [gpid]
    assert p.pid in procfs.pids()
    assert procfs.comm(p.pid) == os.path.basename(sys.executable)[:15]
    assert procfs.nspids(p.pid)[0] == p.pid
    fields = procfs.stat_fields(p.pid)
    assert fields is not None and int(fields[1]) == os.getpid()  # field 4: ppid
    maps = procfs.mapped_paths(p.pid)
    assert maps is not None and shm in maps
    assert shm in procfs.fd_targets(p.pid)


def test_stopped_then_zombie_then_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while procfs.state(p.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procfs.state(p.pid) == "T" and procfs.alive(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        while procfs.state(p.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procfs.state(p.pid) == "Z" and not procfs.alive(p.pid)
        fields = procfs.stat_fields(p.pid)
        assert fields is not None and fields[0] == b"Z" and int(fields[49]) == signal.SIGKILL  # field 52
        assert procfs.cmdline(p.pid) is None and procfs.environ(p.pid) is None
    finally:
        p.kill()
        p.wait()
    for fn in (procfs.cmdline, procfs.environ, procfs.state, procfs.start_time, procfs.comm, procfs.stat_fields,
               procfs.mapped_paths):
        assert fn(p.pid) is None, fn
    assert not procfs.alive(p.pid) and procfs.children(p.pid) == [] and procfs.fd_targets(p.pid) == []
    assert procfs.nspids(p.pid) == [] and not procfs.still_running(p.pid, None, 1.0)
