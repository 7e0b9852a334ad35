"""Live equals offline: `xpu-serve diagnose BUNDLE --json` gives the live verdict.

Real incidents run through `xpu-serve up` on the simulator (real processes, real signals, real
pipes); the bundle's incident.json holds the verdict the supervisor reached live, and a real
`xpu-serve diagnose BUNDLE --json` of the same bundle must reach the same cause, the same root
(process, rank, pid) and the same consequence counts: the supervisor's own facts (process exits,
the trigger) are in the bundle's logs/facts.log and the analysis reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _offline(bundle: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", str(bundle), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode in (0, 6), out.stderr
    return dict(json.loads(out.stdout))


def _root(c: dict[str, Any]) -> tuple[Any, ...]:
    r = c.get("root") or {}
    return (r.get("process"), r.get("rank"), r.get("pid"))


def _counts(c: dict[str, Any]) -> list[tuple[Any, ...]]:
    return sorted(
        (str(g["signature"]), str(g["process"]), str(g["rank"]), int(g["count"])) for g in c["consequences"]
    )


NO_CONNECTOR = {"XPU_SERVE_PROC_CONNECTOR": "0"}  # a worker's exit status may then be lost


@pytest.mark.parametrize(
    ("fault", "os_env"),
    [
        ("worker-segv rank=1 after=50", {}),  # a native crash: SIGSEGV of a worker, the others abort
        ("worker-exit rank=2 code=1 after=50", {}),  # an exit code, seen only by the supervisor
        ("engine-crash signal=KILL after=50", {}),  # SIGKILL: no dump, no line of the dying process
        ("ccl-init-fail rank=1", {}),  # a start-up failure in oneCCL's init
        ("worker-segv rank=0 after=50", NO_CONNECTOR),  # the signal may come from the worker's dump
    ],
    ids=["worker-segv", "worker-exit", "engine-kill", "ccl-init-fail", "worker-segv-no-connector"],
)
def test_diagnose_of_the_bundle_gives_the_live_verdict(
    sim_up_factory: Any, fault: str, os_env: dict[str, str], tmp_path: Path
) -> None:
    # the kernel log is a file of this test's own: another program's segfault in the machine's
    # kernel log (another suite's simulator) is in the bundle's raw kernel.log window, where the
    # live watcher ignored it as not ours (a pid outside the tree)
    kern = tmp_path / "kernel.txt"
    kern.write_text("")
    up = sim_up_factory(
        f"{fault} incarnation=1", os_env=os_env, extra={"watchers.kernel": {"source": "file", "path": str(kern)}}
    )
    bundle = up.bundle(90)
    up.wait_event("restart-scheduled", 60)
    assert up.stop() == 0
    live = json.loads((bundle / "incident.json").read_text())
    offline = _offline(bundle)
    assert live["cause"] != "unknown", live
    assert offline["cause"] == live["cause"], (offline["summary"], live["summary"])
    assert _root(offline) == _root(live), (offline["root"], live["root"])
    assert _counts(offline) == _counts(live)
    assert sum(g["count"] for g in live["consequences"]) > 0, live["consequences"]
    assert offline["notes"] == live["notes"]
    assert offline["summary"] == live["summary"]
    assert (bundle / "logs" / "facts.log").is_file()


@pytest.mark.parametrize(
    "fault",
    ["worker-exit rank=2 code=1 after=50", "worker-segv rank=1 after=50 kernel={kern}"],
    ids=["worker-exit", "worker-segv-kernel-record"],
)
def test_another_programs_segfault_in_the_bundles_kernel_log_is_not_evidence(
    sim_up_factory: Any, fault: str, tmp_path: Path
) -> None:
    """A segfault of a pid outside the supervised tree, in libze like ours, put first in the
    bundle's kernel.log (another suite's crash on the same machine): `diagnose BUNDLE` applies
    the live watcher's ownership rule with the bundle's process list and gives the live verdict;
    the same kernel.log alone (no process list) still makes it the root."""
    from xpu_serve.sim.kernel import segfault_records, write_records

    kern = tmp_path / "kernel.txt"
    kern.write_text("")
    up = sim_up_factory(
        f"{fault.format(kern=kern)} incarnation=1", extra={"watchers.kernel": {"source": "file", "path": str(kern)}}
    )
    bundle = up.bundle(90)
    up.wait_event("restart-scheduled", 60)
    assert up.stop() == 0
    live = json.loads((bundle / "incident.json").read_text())
    foreign_pid = os.getpid()  # this test's process: alive, and not in the supervised tree
    assert foreign_pid not in {p["pid"] for p in live["supervisor"]["processes"]}
    before = _offline(bundle)  # without the foreign record
    foreign = tmp_path / "foreign.txt"
    write_records(str(foreign), segfault_records("python3", foreign_pid, 0))
    k = bundle / "kernel.log"
    k.write_text(foreign.read_text() + k.read_text())
    offline = _offline(bundle)
    assert offline["cause"] == live["cause"], (offline["summary"], live["summary"])
    assert _root(offline) == _root(live), (offline["root"], live["root"])
    # the counts, notes and summary are those of the bundle without the foreign record: the
    # xe copy-engine resets of a kernel= fault go on after the death, so how many of them the
    # live verdict counted depends on when its watch was stopped; and a kernel record's notes and
    # time differ live and offline (live names the correlated process and knows the boot time)
    assert _counts(offline) == _counts(before)
    assert offline["notes"] == before["notes"]
    assert offline["summary"] == before["summary"]
    assert str(foreign_pid) not in json.dumps(offline["root"])
    alone = _offline(k)  # a plain log file: every pid is eligible, as before
    assert alone["cause"] == "umd-segfault", alone["summary"]
    if "worker-exit" in fault:
        assert alone["root"]["pid"] == foreign_pid, alone["root"]
