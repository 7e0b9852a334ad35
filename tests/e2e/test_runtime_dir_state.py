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

from .harness import with_suppress

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


def test_kill9_mid_capture_gets_a_recovered_bundle_before_the_logs_move(up_factory: Any, tmp_path: Path) -> None:
    """A worker SIGSEGV, and the supervisor SIGKILLed while it finishes the bundle after the stop
    (a slow `xpu-smi` holds the host collector; the next incarnation may be starting): the next
    `up` finishes the bundle folder the capture began from the kept logs (recovered: true, cause
    process-crash; one bundle of the incident, not a partial one beside a recovered one) before
    it moves them, and a third `up` leaves that bundle and its logs alone."""
    fake = tmp_path / "bin"
    fake.mkdir()
    pids = tmp_path / "xpu-smi.pids"
    (fake / "xpu-smi").write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 60\n")
    (fake / "xpu-smi").chmod(0o755)
    u = up_factory(faults="worker-segv rank=0 after=50 incarnation=1")
    u.cfg["bundles"]["collector_timeout_s"] = 30
    u.write_config()
    try:
        u.start(env={"PATH": f"{fake}:{os.environ['PATH']}"})
        u.wait_for(lambda: u.events("cleaned") and pids.exists(), 60, "the bundle finished in xpu-smi")
        assert (u.runtime / "logs" / "1" / "incident-pending.json").exists()
        u.proc.kill()
        u.proc.wait(10)
    finally:
        for pid in pids.read_text().split() if pids.exists() else []:
            with_suppress(lambda p=int(pid): os.kill(p, signal.SIGKILL))
    begun = sorted((u.runtime / "bundles").glob("*"))
    assert len(begun) == 1 and not (begun[0] / "bundle.json").exists(), begun
    u.cfg["environment"]["vars"]["XPU_SERVE_SIM_FAULTS"] = ""
    u.cfg["bundles"]["collector_timeout_s"] = 3
    u.write_config()
    u.start()
    u.wait_tree(1)
    evs = u.events()
    rec = [i for i, e in enumerate(evs) if e["event"] == "incident" and e.get("recovered")]
    moved = [i for i, e in enumerate(evs) if e["event"] == "logs"]
    assert len(rec) == 1 and moved and rec[0] < moved[0], [e["event"] for e in evs]
    ev = evs[rec[0]]
    assert ev["cause"] == "process-crash", ev
    bundle = Path(ev["bundle"])
    # the folder the cut capture began is finished, not left partial beside a second bundle;
    # what the capture wrote there before the kill is kept in cut-capture/
    assert sorted((u.runtime / "bundles").glob("*")) == begun == [bundle]
    assert json.loads((bundle / "cut-capture" / "incident.json").read_text())["cause"] == "process-crash"
    manifest = json.loads((bundle / "bundle.json").read_text())
    incident = json.loads((bundle / "incident.json").read_text())
    assert manifest["recovered"] is True and incident["recovered"] is True
    assert incident["cause"] == "process-crash"
    assert "kill -9 of the supervisor" in incident["notes"][0], incident["notes"]
    trig = incident["supervisor"]["trigger"]
    assert trig["process"] == "Worker_TP0" and trig["signal"] == "SIGSEGV", trig
    crash = (bundle / "logs" / "vllm.log").read_text()
    assert "Segmentation fault" in crash
    assert not (u.runtime / "logs" / "1.prev" / "incident-pending.json").exists()
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    u.start()  # the third `up`: replaces logs/1.prev (the second run's); the bundle stays
    u.wait_tree(1)
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    assert (bundle / "logs" / "vllm.log").read_text() == crash
    assert json.loads((bundle / "bundle.json").read_text())["recovered"] is True
    assert len([e for e in u.events("incident") if e.get("recovered")]) == 1
    assert not u.our_pids()


def test_log_retention_keeps_the_newest_incarnations_and_the_unbundled(up_factory: Any) -> None:
    """A crash loop left one logs/N per restart (121 folders after 120 restarts). Now, with
    logs.keep_incarnations 3: after real restarts exactly the newest 3 incarnations' folders
    remain, plus a folder whose incident has no bundle (its marker, as a bundle that could not be
    written leaves it, put there once the supervisor runs); an earlier run's folder is removed."""
    u = up_factory(faults="worker-exit rank=1 code=1 after=20")
    u.cfg["supervision"]["restart"] = {
        "initial_delay_s": 0.1, "multiplier": 1, "max_delay_s": 0.2, "max_failures": 50,
    }
    u.cfg["logs"] = {"keep_incarnations": 3}
    u.write_config()
    logs = u.runtime / "logs"

    def folder(name: str, pending: bool) -> None:
        (logs / name).mkdir(parents=True)
        (logs / name / "vllm.log").write_text(f"earlier run {name}\n")
        if pending:
            (logs / name / "incident-pending.json").write_text('{"incarnation": 9}\n')
        os.utime(logs / name / "vllm.log", (time.time() - 3600, time.time() - 3600))

    folder("8.prev", False)
    u.start()
    u.wait_for(lambda: (u.state().get("incarnation") or 0) >= 1, 30, "incarnation 1 (after the recovery)")
    folder("9.prev", True)
    u.wait_for(lambda: (u.state().get("incarnation") or 0) >= 6, 120, "incarnation 6")
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    n = u.state()["incarnation"]
    left = sorted(p.name for p in logs.iterdir())
    assert left == sorted([str(n - 2), str(n - 1), str(n), "9.prev"]), (n, left)
    removed = [x for e in u.events("logs") for x in e.get("removed", [])]
    assert "8.prev" in removed and "9.prev" not in removed and str(n) not in removed, removed
    assert (logs / "9.prev" / "incident-pending.json").exists()
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
