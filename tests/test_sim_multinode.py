"""The simulator's multi-node mode: two simulators on loopback form a TP=2 group (the head with
rank 0, a `--headless` follower with rank 1 connected to the head's master port over TCP), serve
a completion through the head, and fail the way the real CPU engine does across two network
namespaces (../shared/notes/multi-node.md) when the follower's worker or the head dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from xpu_serve.sim.harness import SimRun, free_port

pytestmark = pytest.mark.timeout(120)

COMPLETION = {"model": "sim", "prompt": "hello", "max_tokens": 4}


def _group(tmp_path: Path, master_port: int) -> tuple[SimRun, SimRun]:
    flags = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
             "--distributed-executor-backend", "mp"]
    head = SimRun(tmp_path / "head", tp=2, args=[*flags, "--node-rank", "0"])
    follower = SimRun(tmp_path / "follower", tp=2, args=[*flags, "--node-rank", "1", "--headless"])
    return head, follower


@pytest.fixture
def group(tmp_path: Path) -> Iterator[tuple[SimRun, SimRun]]:
    head, follower = _group(tmp_path, free_port())
    try:
        follower.start()  # before the head: its worker retries until the master port listens
        head.start()
        head.wait_ready(60)
        yield head, follower
    finally:
        for run in (head, follower):
            run.kill_all()
            run.cleanup_leftovers()
        assert head.wait_gone(10) == [] and follower.wait_gone(10) == []


def _worker_pid(run: SimRun, name: str) -> int:
    return run.pids_by_name()[name]


def test_group_forms_and_serves_through_the_head(group: tuple[SimRun, SimRun]) -> None:
    head, follower = group
    status, body = head.post("/v1/completions", COMPLETION)
    assert status == 200, body
    # each node runs only its own TP rank, and rank 1's worker reached the head's master port
    assert set(head.pids_by_name()) >= {"Worker_TP0"} and "Worker_TP1" not in head.pids_by_name()
    assert "Worker_TP1" in follower.pids_by_name() and "Worker_TP0" not in follower.pids_by_name()
    port = head.argv[head.argv.index("--master-port") + 1]
    line = follower.wait_for_line(r"world_size=2 rank=1 local_rank=0 distributed_init_method=(\S+)")
    assert line.group(1) == f"tcp://127.0.0.1:{port}"
    assert "APIServer" not in follower.log()  # headless: no API server


def test_follower_worker_killed_gives_the_measured_lines(group: tuple[SimRun, SimRun]) -> None:
    head, follower = group
    os.kill(_worker_pid(follower, "Worker_TP1"), signal.SIGKILL)
    follower.wait_for_line(r"Worker proc VllmWorker-1 died unexpectedly")
    assert follower.wait_exit(15) == 1
    # idle: the head waits only on its local workers and says nothing; /health stays 200
    time.sleep(1.0)
    assert head.get("/health")[0] == 200
    assert "Connection closed by peer" not in head.log()
    # the next request: rank 0's collective fails with gloo's error naming the follower's address
    status, _ = head.post("/v1/completions", COMPLETION)
    assert status == 500
    m = head.wait_for_line(r"Connection closed by peer \[127\.0\.0\.1\]:(\d+)")
    assert int(m.group(1)) > 0
    head.wait_for_line(r"EngineCore encountered a fatal error")
    head.wait_for_line(r"EngineDeadError")
    assert head.wait_exit(30) == 0  # the head exits (0, as vLLM after an engine failure)


def test_head_killed_follower_stays_alive_and_silent(group: tuple[SimRun, SimRun]) -> None:
    head, follower = group
    assert follower.proc is not None
    head.kill_all()
    time.sleep(1.5)
    size = len(follower.log())
    time.sleep(1.5)
    assert follower.proc.poll() is None  # still running
    assert len(follower.log()) == size  # and silent
    assert any(p.pid == _worker_pid(follower, "Worker_TP1") for p in follower.processes())


def test_bad_multinode_flags_one_line_exit_2(tmp_path: Path) -> None:
    cases = [
        (["-tp", "2", "--nnodes", "2", "--node-rank", "1"], "--headless goes with --node-rank 1..nnodes-1"),
        (["-tp", "3", "--nnodes", "2"], "--tensor-parallel-size 3 does not split over --nnodes 2"),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--headless"], "--node-rank: must be 0..1"),
    ]
    for flags, expected in cases:
        r = subprocess.run([sys.executable, "-m", "xpu_serve.sim", "serve", "m", *flags], capture_output=True,
                           text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (flags, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and re.search(re.escape(expected), r.stderr), r.stderr


def test_follower_worker_killed_under_load_resets_the_heads_step(group: tuple[SimRun, SimRun]) -> None:
    head, follower = group
    got: list[int] = []
    long = {**COMPLETION, "max_tokens": 4000}
    t = threading.Thread(target=lambda: got.append(head.post("/v1/completions", long)[0]))
    t.start()
    time.sleep(0.5)  # the request is in its steps
    os.kill(_worker_pid(follower, "Worker_TP1"), signal.SIGKILL)
    head.wait_for_line(r"Read error \[127\.0\.0\.1\]:\d+: Connection reset by peer")
    t.join(30)
    assert got == [500]
    assert head.wait_exit(30) == 0
    follower.wait_for_line(r"Worker proc VllmWorker-1 died unexpectedly")


def test_follower_mainprocess_killed_its_worker_serves_on(group: tuple[SimRun, SimRun]) -> None:
    head, follower = group
    assert follower.proc is not None
    worker = _worker_pid(follower, "Worker_TP1")
    os.kill(follower.proc.pid, signal.SIGKILL)  # the follower's MainProcess alone
    follower.wait_for_line(r"Worker_TP1 pid=\d+\) INFO .* Parent process exited, terminating worker")
    status, body = head.post("/v1/completions", COMPLETION)
    assert status == 200, body  # the orphaned worker still takes part in the head's steps
    os.kill(worker, signal.SIGTERM)
    time.sleep(1.0)
    assert any(p.pid == worker for p in follower.processes())  # SIGTERM ignored: only SIGKILL ends it
