"""The root cause of a live incident is the first process death the supervisor saw.

A worker that exits 1 makes the other ranks abort in oneCCL's finalize (SIGABRT, a heavier
signature than an exit code): those later deaths are consequences, the exit 1 is the root.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.parametrize("rank", [1, 2])
def test_worker_exit_1_is_the_root_not_the_later_sigabrt(sim_up_factory: Any, rank: int) -> None:
    up = sim_up_factory(f"worker-exit rank={rank} code=1 after=50 incarnation=1")
    ev = up.wait_event("incident", 60)
    bundle = Path(ev["bundle"])
    incident = json.loads((bundle / "incident.json").read_text())
    assert up.stop() == 0
    root = incident["root"]
    assert (root["process"], root["rank"]) == (f"Worker_TP{rank}", rank), root
    assert incident["cause"] == "process-crash"


@pytest.mark.parametrize(("fault", "process"), [("api-crash signal=SEGV", "APIServer"),
                                                ("engine-crash signal=SEGV", "EngineCore")])
def test_unprefixed_segv_dump_names_the_process_that_died(sim_up_factory: Any, fault: str, process: str) -> None:
    # faulthandler's "Fatal Python error: Segmentation fault" has no process prefix; the
    # supervisor saw which process died by SIGSEGV, so the verdict names that one
    up = sim_up_factory(f"{fault} after=50 incarnation=1")
    ev = up.wait_event("incident", 60)
    incident = json.loads((Path(ev["bundle"]) / "incident.json").read_text())
    assert up.stop() == 0
    assert incident["root"]["process"] == process, incident["root"]
    assert incident["summary"].startswith(f"{process} (pid "), incident["summary"]
    assert "SIGSEGV" in incident["summary"], incident["summary"]
