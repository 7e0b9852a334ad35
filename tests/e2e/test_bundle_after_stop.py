"""The bundle is finished after the tree is stopped: real incidents through `xpu-serve up` on the
simulator (real processes, signals, pipes, files).

The evidence only the live tree gives is taken before the stop; the collectors run while the tree
is stopped; once it is, the rest of the incarnation's log (the fallout of the death, written
after it) goes into the bundle, the verdict is recomputed from it and bundle.json is written
last. A slow `xpu-smi` (a real program on PATH, a shell script that sleeps) holds the host
collector so that the finishing overlaps the next start, a SIGTERM or a kill -9.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.e2e.harness import SimUp


def _slow_xpu_smi(tmp: Path, seconds: float) -> tuple[dict[str, str], Path]:
    """PATH with an `xpu-smi` that notes its pid in the returned file and sleeps `seconds`."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    pids = tmp / "xpu-smi.pids"
    (bindir / "xpu-smi").write_text(f"#!/bin/sh\necho $$ >> {pids}\nsleep {seconds}\necho 'Device ID: 0'\n")
    (bindir / "xpu-smi").chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}, pids


def _diagnose_json(bundle: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", str(bundle), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def _names(up: SimUp) -> list[str]:
    return [str(e.get("event")) for e in up.events()]


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def _bundle_dirs(up: SimUp) -> list[Path]:
    return sorted(p for p in (up.runtime / "bundles").glob("*") if p.is_dir())


def test_worker_segv_bundle_holds_the_fallout_written_after_the_stop(sim_up_factory: Any) -> None:
    """A worker SIGSEGV: the resource tracker's leaked shared-memory warning is written while
    the tree shuts down (after the stop began); it is in the bundle's log, in the consequences
    of incident.json and in report.txt, and the `incident` event comes after the stop."""
    up = sim_up_factory("worker-segv rank=1 after=50 incarnation=1")
    bundle = up.bundle(90)
    up.wait_event("restart-scheduled", 60)
    assert up.stop() == 0
    names = _names(up)
    assert names.index("cleaned") < names.index("incident"), names
    log = (bundle / "logs" / "vllm.log").read_text()
    assert "leaked shared_memory objects" in log
    assert "EngineDeadError" in log
    inc = json.loads((bundle / "incident.json").read_text())
    assert inc["cause"] == "process-crash", inc["summary"]
    assert (inc["root"] or {}).get("process") == "Worker_TP1", inc["root"]
    sigs = {g["signature"]: g for g in inc["consequences"]}
    assert "leaked-resources" in sigs and "engine-dead-message" in sigs, sorted(sigs)
    # the API server's EngineDeadError names EngineCore as its subject (rules.yaml
    # engine_core_reports); the line itself is the API server's
    dead = sigs["engine-dead-message"]
    assert dead["process"] == "EngineCore", dead
    assert log.split("\n")[dead["line"] - 1].startswith("(APIServer pid="), dead
    # report.txt is rendered from the recomputed verdict: its verdict line is the one `diagnose`
    # reaches on the whole log in the bundle (the count of lines that followed included)
    offline = _diagnose_json(bundle)
    assert offline["summary"] == inc["summary"]
    report = " ".join((bundle / "report.txt").read_text().split())
    assert " ".join(inc["summary"].split()) in report, (inc["summary"], report[:300])
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["complete"] is True and manifest["errors"] == [], manifest["errors"]
    assert [c["name"] for c in manifest["collectors"]] == [
        "logs",
        "kernel",
        "stacks",
        "env",
        "config",
        "versions",
        "host",
        "devcoredump",
    ]
    assert not (up.runtime / "logs" / "1" / "incident-pending.json").exists()


def test_bundle_finished_while_the_next_incarnation_starts(sim_up_factory: Any, tmp_path: Path) -> None:
    """The host collector takes about 3 s (a slow xpu-smi): incarnation 2 is launched before the
    bundle of incarnation 1 is finished; the bundle is complete, its log is incarnation 1's
    alone (the next incarnation writes logs/2) and its host.txt has xpu-smi's answer."""
    os_env, _pids = _slow_xpu_smi(tmp_path, 1.0)
    up = sim_up_factory(
        "worker-segv rank=1 after=50 incarnation=1", os_env=os_env, extra={"bundles.collector_timeout_s": 20}
    )
    bundle = up.bundle(120)
    names = _names(up)
    assert names.index("launched", names.index("cleaned")) < names.index("incident"), names
    up.wait_event("ready", 90, after=1)
    assert up.stop() == 0
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["complete"] is True, manifest["errors"]
    host = next(c for c in manifest["collectors"] if c["name"] == "host")
    assert host["status"] == "ok" and host["seconds"] >= 2.0, host
    assert "Device ID: 0" in (bundle / "host.txt").read_text()
    mine = (up.runtime / "logs" / "1" / "vllm.log").read_text()
    assert (bundle / "logs" / "vllm.log").read_text() == mine
    assert "leaked shared_memory objects" in mine
    assert (up.runtime / "logs" / "2" / "vllm.log").is_file()
    inc = json.loads((bundle / "incident.json").read_text())
    assert inc["supervisor"]["incarnation"] == 1 and inc["cause"] == "process-crash"


def test_sigterm_while_the_bundle_is_finished_completes_it_and_exits_0(
    sim_up_factory: Any, tmp_path: Path
) -> None:
    """SIGTERM after the stop of incarnation 1, while its bundle is still being written (xpu-smi
    asleep): the supervisor finishes the bundle, then exits 0."""
    os_env, pids = _slow_xpu_smi(tmp_path, 2.0)
    up = sim_up_factory(
        "worker-segv rank=0 after=50 incarnation=1", os_env=os_env, extra={"bundles.collector_timeout_s": 20}
    )
    up.wait_event("cleaned", 90)
    _wait(pids.exists, 30, "xpu-smi running")
    (folder,) = _bundle_dirs(up)
    assert not (folder / "bundle.json").exists()  # mid-finishing
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    manifest = json.loads((folder / "bundle.json").read_text())
    assert manifest["complete"] is True, manifest["errors"]
    names = _names(up)
    assert names.index("incident") < names.index("stopped"), names
    assert up.events()[-1]["event"] == "stopped"
    assert not (up.runtime / "logs" / "1" / "incident-pending.json").exists()
    assert "leaked shared_memory objects" in (folder / "logs" / "vllm.log").read_text()


def test_a_second_incident_while_the_first_bundle_is_finished(sim_up_factory: Any, tmp_path: Path) -> None:
    """Every incarnation dies (SIGSEGV) while the bundle of the one before is still being
    written (about 3 s of xpu-smi): the second capture does not wait for the first bundle, both
    bundles are complete, each holds its own incarnation's log, and the incidents are told in
    order."""
    os_env, _pids = _slow_xpu_smi(tmp_path, 1.0)
    up = sim_up_factory(
        "worker-segv rank=2 after=50",
        os_env=os_env,
        extra={
            "bundles.collector_timeout_s": 20,
            "supervision.restart": {"initial_delay_s": 0.01, "max_failures": 5},
        },
    )
    second = up.wait_event("incident", 120, after=1)
    names = _names(up)
    failed_2 = [i for i, n in enumerate(names) if n == "failed"][1]
    assert failed_2 < names.index("incident"), names  # captured before the first bundle was done
    assert up.stop() == 0
    first = up.events()
    bundles = [Path(e["bundle"]) for e in first if e.get("event") == "incident"][:2]
    assert Path(second["bundle"]) == bundles[1]
    for n, b in enumerate(bundles, 1):
        manifest = json.loads((b / "bundle.json").read_text())
        assert manifest["complete"] is True, manifest["errors"]
        inc = json.loads((b / "incident.json").read_text())
        assert inc["supervisor"]["incarnation"] == n and inc["cause"] == "process-crash"
        assert (b / "logs" / "vllm.log").read_text() == (
            up.runtime / "logs" / str(n) / "vllm.log"
        ).read_text()
