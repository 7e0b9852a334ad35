"""The stuck rank of a hang, from real processes: real py-spy dumps of Python processes blocked in
a collective-named wait or elsewhere, real SIGSTOP, read by the hang watchdog's own functions
(`supervision.rankstate`) and named (or not) by the one analysis (`Analyzer`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from xpu_serve import facts
from xpu_serve.analysis.stacks import OUTSIDE, UNKNOWN, collective_wait
from xpu_serve.collectors import dump_stacks, find_py_spy
from xpu_serve.diagnosis import Analyzer
from xpu_serve.incarnation import ProcessInfo
from xpu_serve.report import render_text
from xpu_serve.supervision.rankstate import rank_states_fact, steady_states

# A rank: the main thread blocks in a function named like vLLM's (a collective or elsewhere), a
# second thread blocks in a queue get, as a worker's death monitor does.
RANK = """
import sys, threading, queue
def all_reduce(): threading.Event().wait()
def acquire_read(): threading.Event().wait()
def forward_pass(): threading.Event().wait()
threading.Thread(target=queue.Queue().get, daemon=True, name="WorkerDeathMonitor").start()
print("ready", flush=True)
{"all_reduce": all_reduce, "acquire_read": acquire_read, "forward_pass": forward_pass}[sys.argv[1]]()
"""

needs_py_spy = pytest.mark.skipif(find_py_spy() is None, reason="py-spy not installed")


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    script = tmp_path / "rank.py"
    script.write_text(RANK)

    def start(where: list[str]) -> list[subprocess.Popen[str]]:
        for w in where:
            p = subprocess.Popen([sys.executable, str(script), w], stdout=subprocess.PIPE, text=True)
            started.append(p)
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        return started

    yield start  # type: ignore[misc]
    for p in started:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)


def _verdict(procs: list[subprocess.Popen[str]], stop: list[int]) -> dict[str, object]:
    """Stop the ranks `stop` (SIGSTOP), then do what the hang watchdog does: states, stacks, the
    facts; the analysis' verdict as JSON."""
    for r in stop:
        os.kill(procs[r].pid, signal.SIGSTOP)
    time.sleep(0.1)
    workers = [ProcessInfo(f"Worker_TP{r}", p.pid, r) for r, p in enumerate(procs)]
    pids = [w.pid for w in workers]
    states = steady_states(pids)
    stacks = dump_stacks(pids, 20.0)
    an = Analyzer()
    ev = rank_states_fact(workers, states, stacks)
    assert ev is not None
    an.add_event(ev)
    an.add_event(facts.hang(92.0, 1, 0, datetime(2026, 12, 2, 5, 0, 0)))
    inc = an.incident()
    return {**inc.to_contract(), "_report": render_text(inc)}  # (the one-screen report beside the JSON)


@needs_py_spy
def test_real_dumps_are_classified(ranks) -> None:  # type: ignore[no-untyped-def]
    procs = ranks(["all_reduce", "acquire_read", "forward_pass"])
    stacks = dump_stacks([p.pid for p in procs], 20.0)
    assert "Thread" in stacks[procs[0].pid]
    got = [collective_wait(stacks[p.pid]) for p in procs]
    assert got == ["all_reduce", "shm_broadcast acquire_read", OUTSIDE], stacks
    assert collective_wait("# py-spy not installed: no stack dump\n") == UNKNOWN
    assert collective_wait("") == UNKNOWN


@needs_py_spy
def test_one_rank_outside_the_collective_is_named(ranks) -> None:  # type: ignore[no-untyped-def]
    procs = ranks(["all_reduce", "forward_pass", "all_reduce", "all_reduce"])
    v = _verdict(procs, [])
    assert v["cause"] == "engine-hang"
    root = v["root"]
    assert isinstance(root, dict) and (root["process"], root["rank"], root["pid"]) == (
        "Worker_TP1",
        1,
        procs[1].pid,
    )
    assert str(v["summary"]).startswith(
        "Worker_TP1 (rank 1) is outside the collective while ranks 0,2,3 wait in all_reduce; the engine stopped"
    ), v["summary"]


@needs_py_spy
def test_the_one_stopped_rank_is_named(ranks) -> None:  # type: ignore[no-untyped-def]
    procs = ranks(["all_reduce", "all_reduce", "all_reduce"])  # stopped inside the collective itself
    v = _verdict(procs, [2])
    root = v["root"]
    assert isinstance(root, dict) and (root["process"], root["rank"]) == ("Worker_TP2", 2)
    assert str(v["summary"]).startswith(
        "Worker_TP2 (rank 2) stopped (state T) while ranks 0,1 wait in all_reduce"
    )
    assert "ROOT CAUSE: stuck TP rank (Worker_TP2, rank 2, pid " in v["_report"], v["_report"]


@needs_py_spy
def test_two_stopped_ranks_name_nobody(ranks) -> None:  # type: ignore[no-untyped-def]
    procs = ranks(["all_reduce", "forward_pass", "all_reduce", "forward_pass"])
    v = _verdict(procs, [1, 3])
    assert v["cause"] == "engine-hang"
    root = v["root"]
    assert isinstance(root, dict) and root["rank"] is None and root["process"] is None, root
    assert "stuck_rank" not in (v["hang"] or {})  # type: ignore[operator]
    assert str(v["summary"]).startswith("The engine stopped making progress")


@needs_py_spy
def test_two_ranks_outside_name_nobody(ranks) -> None:  # type: ignore[no-untyped-def]
    procs = ranks(["all_reduce", "forward_pass", "forward_pass"])
    v = _verdict(procs, [])
    root = v["root"]
    assert isinstance(root, dict) and root["rank"] is None, root
