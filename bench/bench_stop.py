"""Stop time of a hung tree: `stop_tree(hang=True)` (after a hang verdict) vs the graceful stop
(`hang=False`, the baseline: a crash, a planned restart), alternated in one process on the same tree.

The tree stands for a TP group after a hang: a leader and a rank that ignore SIGTERM (blocked in
a collective: their SIGTERM handlers never run their clean-up) and a rank stopped under ptrace
(state t: SIGCONT does not resume it). Prints each run and the medians; ratio = hang / graceful.

    .venv/bin/python bench/bench_stop.py [PAIRS] [GRACE_S]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid

from xpu_serve import cleanup, procfs

TREE = r"""
import ctypes, os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    while True: time.sleep(1)
if os.fork() == 0:
    ctypes.CDLL(None, use_errno=True).ptrace(0, 0, None, None)
    os.kill(os.getpid(), signal.SIGSTOP)
    while True: time.sleep(1)
print("up", flush=True)
while True: time.sleep(1)
"""


def one_stop(hang: bool, grace_s: float) -> cleanup.StopReport:
    """Start the tree, wait until its 3 members are up (one in state t), stop it; the report."""
    run_id = uuid.uuid4().hex
    env = dict(os.environ, XPU_SERVE_RUN_ID=run_id, XPU_SERVE_INCARNATION="1")
    p = subprocess.Popen(
        [sys.executable, "-c", TREE], env=env, stdout=subprocess.PIPE, start_new_session=True
    )
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    while not any(procfs.state(m) == "t" for m in cleanup.find_members(run_id, 1, [p.pid])):
        time.sleep(0.05)
    rep = asyncio.run(cleanup.stop_tree(p.pid, run_id, 1, [p.pid], grace_s=grace_s, hang=hang))
    p.wait(timeout=10)
    return rep


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    grace_s = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    hang_s: list[float] = []
    base_s: list[float] = []
    for i in range(pairs):
        h, b = one_stop(True, grace_s), one_stop(False, grace_s)
        hang_s.append(h.seconds)
        base_s.append(b.seconds)
        print(f"pair {i + 1}: hang {h.seconds:.3f} s ({h.early_text()}), graceful {b.seconds:.3f} s")
    mh, mb = statistics.median(hang_s), statistics.median(base_s)
    print(f"median: hang {mh:.3f} s, graceful {mb:.3f} s (grace_s {grace_s}); ratio x{mh / mb:.3f}")


if __name__ == "__main__":
    main()
