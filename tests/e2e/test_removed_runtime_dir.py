"""A second `up` on a runtime directory removed under a live supervisor refuses with LOCKED.

Between the removal and the live supervisor's next state heartbeat (when it re-creates its lock)
the second `up` finds no lock and no state.json; the port its engine holds then names the
supervisor: it holds the removed lock file open. The live server is never touched.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from typing import Any

import pytest

pytestmark = pytest.mark.e2e


def test_second_up_on_removed_runtime_dir_exits_5_and_keeps_the_server(sim_up_factory: Any) -> None:
    # a long heartbeat keeps the window open for the whole test
    up = sim_up_factory("", os_env={"XPU_SERVE_STATE_HEARTBEAT_S": "600"})
    up.wait_event("ready", 60)
    api = next(p for p in up.ps.children() if "xpu_serve.sim" in " ".join(p.cmdline()))
    shutil.rmtree(up.runtime)
    second = subprocess.run([sys.executable, "-m", "xpu_serve", "up", "-c", str(up.config), "--no-echo"],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 5, (second.returncode, second.stderr[-1500:])
    assert "in use by another xpu-serve supervisor" in second.stderr, second.stderr[-1500:]
    assert f"pid {up.proc.pid}" in second.stderr, second.stderr[-1500:]
    assert api.is_running()
    with urllib.request.urlopen(f"http://127.0.0.1:{up.port}/health", timeout=5) as r:
        assert r.status == 200
    assert up.stop() == 0
