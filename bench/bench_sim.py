"""Simulator start-up and shutdown figures (docs/simulator.md, bench/README.md).

    .venv/bin/python bench/bench_sim.py [--runs 5] [--tp 4] [--scale 0.01]

Prints, as medians over the runs: seconds from launch to /health 200 (the whole TP tree started,
all start-up lines printed), seconds from SIGTERM to the API server's exit with every process
gone, and the baseline measured in the same process: one bare interpreter start
(`python -c "import xpu_serve.sim"`), so the ratio says how many interpreter starts a simulated
start-up costs (the tree is 1 + 1 + 1 + TP Python processes).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from xpu_serve.sim.harness import SimRun

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.01)
    a = ap.parse_args()

    base = []
    for _ in range(a.runs):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import xpu_serve.sim"], check=True)
        base.append(time.monotonic() - t0)

    ready, stop = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            with SimRun(f"{tmp}/{i}", tp=a.tp, scale=a.scale) as sim:
                ready.append(sim.wait_ready(60))
                t0 = time.monotonic()
                sim.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                sim.wait_exit(30)
                left = sim.wait_gone(30)
                stop.append(time.monotonic() - t0)
                assert not left, left

    b, r, s = statistics.median(base), statistics.median(ready), statistics.median(stop)
    print(f"interpreter start (baseline): median {b:.3f} s over {a.runs}")
    print(f"sim TP={a.tp} scale={a.scale} launch -> /health 200: median {r:.3f} s (x{r / b:.1f} baseline)")
    print(f"sim TP={a.tp} SIGTERM -> all processes gone: median {s:.3f} s (x{s / b:.1f} baseline)")
    return 0


if __name__ == "__main__":
    sys.exit(with_loadavg(main))
