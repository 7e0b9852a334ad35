"""The PID-1 reaper reaps orphaned zombies but never a child the supervisor waits for itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from xpu_serve.reaper import reap_orphans, zombie_children


def _wait_zombie(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pid not in zombie_children():
        assert time.monotonic() < deadline, f"{pid} never became a zombie"
        time.sleep(0.01)


def test_reaps_unprotected_zombies_and_leaves_protected_ones() -> None:
    orphan = subprocess.Popen([sys.executable, "-c", "pass"])
    ours = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    _wait_zombie(orphan.pid)
    _wait_zombie(ours.pid)
    reaped = reap_orphans(protected={ours.pid})
    assert orphan.pid in reaped
    assert ours.pid not in reaped
    assert orphan.pid not in zombie_children()
    # the protected child's exit status is still there for its owner
    assert ours.wait(5) == 7
    assert not os.path.exists(f"/proc/{orphan.pid}/stat") or orphan.pid not in zombie_children()


def test_no_zombies_nothing_reaped() -> None:
    assert reap_orphans() == []
