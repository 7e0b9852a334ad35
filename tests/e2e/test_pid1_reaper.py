"""`xpu-serve up` as PID 1 of its own PID namespace (a container without --init) reaps the
re-parented vLLM orphans it stops, so no zombie is left under it.

Real: `unshare --pid --fork --mount-proc` (root only; skipped with the reason elsewhere), the
simulator's API server SIGKILLs itself while its EngineCore and workers ignore the death
(`orphans`), so they are re-parented to the supervisor; the supervisor sweeps them, they exit and
become its zombies, and the reaper must collect them while the restart goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from tests.e2e.harness import Up
from xpu_serve.reaper import zombie_children

pytestmark = pytest.mark.e2e


def _can_unshare() -> str | None:
    if os.geteuid() != 0:
        return "needs root for unshare --pid --mount-proc"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True, timeout=10
    )
    if r.returncode != 0:
        return f"unshare refused here: {r.stderr.strip()[:200]}"
    return None


def _namespace_init(unshare_pid: int, timeout: float = 10.0) -> psutil.Process:
    """The host-side process of the namespace's PID 1 (unshare's forked child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = psutil.Process(unshare_pid).children()
        if kids:
            return kids[0]
        time.sleep(0.02)
    raise AssertionError("unshare started no child")


def _start_as_pid1(u: Up) -> psutil.Process:
    """Start `xpu-serve up` on `u`'s config as PID 1 of a new PID namespace (unshare, as docker
    without --init); returns the namespace's PID 1 as seen from the host, once its state.json
    says pid 1."""
    u.out = open(u.tmp / "up-0.out", "w")  # noqa: SIM115  (closed by kill_all)
    u.proc = subprocess.Popen(  # type: ignore[assignment]
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m", "xpu_serve", "up",
         "-c", str(u.config), "--log-format", "json"],
        stdout=u.out,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    sup = _namespace_init(u.proc.pid)  # type: ignore[union-attr]
    u.wait_for(lambda: u.state().get("supervisor_pid") == 1, 30, "state.json of the PID-1 supervisor")
    u.run_ids.add(u.state()["run_id"])
    return sup


def test_pid1_supervisor_reaps_reparented_orphans(up_factory: Any) -> None:
    why = _can_unshare()
    if why:
        pytest.skip(why)
    u: Up = up_factory(faults="api-crash signal=KILL after=2 incarnation=1; orphans incarnation=1")
    sup = _start_as_pid1(u)
    st = u.wait_tree(2, timeout=60)  # incarnation 1 crashed (API server SIGKILL) and was replaced
    assert st["restarts"] == 1
    failed = u.events("failed")[0]
    assert failed["process"] == "APIServer" and failed["signal"] == "SIGKILL", failed
    # the orphans of incarnation 1 were re-parented to the supervisor, stopped, and reaped
    u.wait_for(lambda: not zombie_children(parent=sup.pid), 10, "no zombie left under the PID-1 supervisor")
    reaped = [p for e in u.events("reaped") for p in e["pids"]]
    # at least the re-parented EngineCore (its workers are re-parented too when it dies first),
    # never a process of the running incarnation 2 (pids are the namespace's)
    assert reaped, "the re-parented orphans were reaped"
    assert not set(reaped) & {p["pid"] for p in st["processes"]}, (reaped, st["processes"])
    # the supervisor's own children (the new API server, the log relay) are never reaped behind its back
    cleaned = u.events("cleaned")[0]
    assert cleaned["left"] == [], cleaned
    # unshare(1) forwards no signal (and --kill-child SIGKILLs the child if unshare dies): stop
    # the supervisor itself; unshare exits with its status
    os.kill(sup.pid, signal.SIGTERM)
    assert u.proc.wait(30) == 0
    assert not zombie_children(parent=sup.pid)
    assert json.loads((u.runtime / "state.json").read_text())["state"] == "stopped"


def test_pid1_supervisor_reaps_detached_grandchildren_it_sweeps(up_factory: Any) -> None:
    """An engine command that leaves a detached grandchild (setsid: a session of its own, not the
    engine's) is swept by the run marker; as PID 1 the supervisor is its parent once the API server
    is gone, so the zombie it becomes must be reaped too, not left under PID 1 for ever."""
    why = _can_unshare()
    if why:
        pytest.skip(why)
    u: Up = up_factory(
        engine={
            "command": ["sh", "-c", 'setsid sleep 1000 & exec "$0" -m xpu_serve.sim serve "$@"', sys.executable]
        }
    )
    sup = _start_as_pid1(u)
    u.wait_tree(1, timeout=60)
    sleeper = [p for p in sup.children(recursive=True) if p.name() == "sleep"]
    assert sleeper, "the detached grandchild runs"
    os.kill(sup.pid, signal.SIGHUP)  # planned restart: incarnation 1 is stopped and swept
    u.wait_tree(2, timeout=60)
    cleaned = u.events("cleaned")[0]
    assert cleaned["left"] == [], cleaned
    u.wait_for(lambda: not zombie_children(parent=sup.pid), 10,
               f"no zombie left under the PID-1 supervisor: {zombie_children(parent=sup.pid)}")
    assert not psutil.pid_exists(sleeper[0].pid) or sleeper[0].status() != psutil.STATUS_ZOMBIE
    os.kill(sup.pid, signal.SIGTERM)
    assert u.proc.wait(30) == 0
