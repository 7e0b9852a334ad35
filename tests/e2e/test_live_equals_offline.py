"""Live equals offline: `xpu-serve diagnose BUNDLE --json` gives the live verdict.

Real incidents run through `xpu-serve up` on the simulator (real processes, real signals, real
pipes); the bundle's incident.json holds the verdict the supervisor reached live, and a real
`xpu-serve diagnose BUNDLE --json` of the same bundle must reach the same cause, the same root
(process, rank, pid) and the same consequence counts: the supervisor's own facts (process exits,
the trigger) are in the bundle's logs/facts.log and the analysis reads them.
"""

from __future__ import annotations

import json
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
