"""Supervisor footprint while supervising a ready server: idle CPU (% of one core) and RSS.

Runs `xpu-serve up` on the simulator (TP=4, time scale 1, default supervision settings: /health
every 5 s, hang watchdog scraping /metrics every 5 s, kernel watcher as configured by default),
waits until ready plus a warm-up, then samples the supervisor process (all its threads) with
psutil over the window; then again with the hang watchdog off, and with the kernel watcher off
too, to attribute the cost (the watchers are issue 6's; what is left is the supervisor itself). Targets: CPU <= 0.5 % of one core, RSS <= 60 MiB.

Baseline, measured in the same run: the simulated API server process (also idle, same window).

    .venv/bin/python bench/bench_footprint.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import with_loadavg  # noqa: E402
from supervise_common import Supervised, sim_config, tmpdir  # noqa: E402


def measure(
    seconds: float, warmup: float, top: dict[str, object] | None = None, **supervision: object
) -> tuple[float, float, float, float, str]:
    """(supervisor CPU %, supervisor max RSS MiB, API server CPU %, API server RSS MiB, state)."""
    tmp = tmpdir()
    sup = Supervised(
        sim_config(
            tmp,
            tp=4,
            time_scale=1.0,
            health={"interval_s": 5, "failures": 3},
            startup={"stall_s": 120, "timeout_s": 300},
            top=top,
            **supervision,
        )
    )
    try:
        st = sup.ready_state(1, timeout=120)
        time.sleep(warmup)
        me = psutil.Process(sup.proc.pid)
        api = psutil.Process(next(p["pid"] for p in st["processes"] if p["name"] == "APIServer"))
        c0, a0, t0 = me.cpu_times(), api.cpu_times(), time.monotonic()
        rss_max = 0
        while time.monotonic() - t0 < seconds:
            rss_max = max(rss_max, me.memory_info().rss)
            time.sleep(0.5)
        c1, a1, t1 = me.cpu_times(), api.cpu_times(), time.monotonic()
        api_rss = api.memory_info().rss
        still = str(sup.state().get("state"))
    finally:
        sup.close()
    wall = t1 - t0
    cpu = (c1.user + c1.system - c0.user - c0.system) / wall * 100
    acpu = (a1.user + a1.system - a0.user - a0.system) / wall * 100
    return cpu, rss_max / 2**20, acpu, api_rss / 2**20, still


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    args = ap.parse_args()
    cpu, mib, acpu, amib, state = measure(args.seconds, args.warmup)
    print(f"window {args.seconds:.0f} s, TP=4 simulator, state {state}")
    print(f"supervisor, default watchers:   CPU {cpu:.3f} % of one core, RSS max {mib:.1f} MiB")
    cpu2, mib2, _, _, _ = measure(args.seconds, args.warmup, hang={"enabled": False})
    print(f"supervisor, hang watchdog off:  CPU {cpu2:.3f} % of one core, RSS max {mib2:.1f} MiB")
    cpu3, mib3, _, _, _ = measure(
        args.seconds, args.warmup, top={"watchers": {"kernel": {"enabled": False}}}, hang={"enabled": False}
    )
    print(f"supervisor, hang + kernel off:  CPU {cpu3:.3f} % of one core, RSS max {mib3:.1f} MiB")
    print(
        f"baseline simulated API server:  CPU {acpu:.3f} %, RSS {amib:.1f} MiB  (supervisor RSS ratio {mib / amib:.2f})"
    )
    ok = cpu <= 0.5 and mib <= 60
    print(f"targets CPU <= 0.5 %, RSS <= 60 MiB (default watchers): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(with_loadavg(main))
