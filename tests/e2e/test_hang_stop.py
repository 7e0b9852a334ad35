"""After a hang verdict the stop does not wait the whole grace: a simulator worker and the
EngineCore held stopped by the test's ptrace (state t: SIGCONT does not resume it, as on real vLLM a SIGSTOPped or wedged
rank cannot act on SIGTERM) makes the canary time out; without the early SIGKILL the stop then
takes the full `stop.grace_s`, with it well under."""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path
from typing import Any

GRACE_S = 10.0
PTRACE_ATTACH = 16


def _pid_of(up: Any, name: str) -> int:
    st = json.loads((up.runtime / "state.json").read_text())
    return next(int(p["pid"]) for p in st["processes"] if p["name"] == name)


def test_hang_verdict_stop_is_below_grace(sim_up_factory: Any, tmp_path: Path) -> None:
    kern = tmp_path / "kernel.txt"
    kern.write_text("")
    hang = {
        "after_s": 30,
        "metrics_interval_s": 0.2,
        "canary": True,
        "canary_interval_s": 1.0,
        "canary_timeout_s": 1.5,
    }
    up = sim_up_factory(
        "",
        extra={
            "supervision.hang": hang,
            "supervision.stop": {"grace_s": GRACE_S},
            "watchers.kernel": {"source": "file", "path": str(kern)},
        },
        env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3000"},
    )
    try:
        up.wait_event("ready", 60)
        libc = ctypes.CDLL(None, use_errno=True)
        # the EngineCore too: the simulator's EngineCore SIGKILLs its workers on its own shutdown
        for name in ("Worker_TP1", "EngineCore"):
            assert libc.ptrace(PTRACE_ATTACH, _pid_of(up, name), None, None) == 0, name
        failed = up.wait_event("failed", 60)
        cleaned = up.wait_event("cleaned", 60)
        ready2 = up.wait_event("ready", 60, after=1)
    finally:
        up.stop()
    m = re.search(r"stopped in ([0-9.]+) s", cleaned["msg"])
    assert m, cleaned["msg"]
    stop_s = float(m.group(1))
    print(f"\n{failed['msg']}\n{cleaned['msg']}\nfailed -> ready again {ready2['ts'] - failed['ts']:.2f} s")
    assert stop_s < GRACE_S / 2, cleaned["msg"]
    assert "SIGKILL early: hung (state T)" in cleaned["msg"], cleaned["msg"]
