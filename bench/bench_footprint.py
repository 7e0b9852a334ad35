"""Supervisor footprint while supervising a ready server: idle CPU (% of one core) and RSS of the
supervisor and of its log relay (the `python -I -S log_relay.py` child), each and together.

Runs `xpu-serve up` on the simulator (TP=4, time scale 1; `/health` and the hang watchdog's
`/metrics` both every `--poll` seconds, kernel watcher as configured by default), waits until
ready plus a warm-up, then samples both processes with psutil over the window; then again with the
hang watchdog off, and with the kernel watcher off too, to attribute the cost. Targets with 1 s
polls: supervisor CPU <= 0.3 % of one core, supervisor + relay RSS <= 60 MiB.

Baseline in the same run: the simulated API server process (also idle, same window); with
`--compare-src DIR` also the same measurement of another tree's src/ (e.g. a `git archive` of an
earlier commit), alternated with this one `--rounds` times.

    .venv/bin/python bench/bench_footprint.py [--seconds 30] [--poll 1] [--compare-src DIR --rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import with_loadavg  # noqa: E402
from supervise_common import Supervised, sim_config, tmpdir  # noqa: E402


@dataclass
class Footprint:
    """CPU in % of one core over the window, RSS in MiB (max over the window)."""

    cpu: float
    rss: float
    relay_cpu: float
    relay_rss: float
    api_cpu: float
    api_rss: float
    state: str


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def _relay(sup: psutil.Process) -> psutil.Process | None:
    for c in sup.children():
        try:
            if any(a.endswith("log_relay.py") for a in c.cmdline()):
                return c
        except psutil.Error:
            continue
    return None


def measure(
    seconds: float, warmup: float, poll: float, env: dict[str, str] | None, top: dict[str, object] | None = None,
    **supervision: object,
) -> Footprint:
    tmp = tmpdir()
    supervision.setdefault("hang", {"metrics_interval_s": poll})
    cfg = sim_config(tmp, tp=4, time_scale=1.0, health={"interval_s": poll, "failures": 3},
                     startup={"stall_s": 120, "timeout_s": 300}, top=top, **supervision)
    sup = Supervised(cfg, env=env)
    try:
        st = sup.ready_state(1, timeout=120)
        time.sleep(warmup)
        me = psutil.Process(sup.proc.pid)
        relay = _relay(me)
        api = psutil.Process(next(p["pid"] for p in st["processes"] if p["name"] == "APIServer"))
        procs = [me, api] + ([relay] if relay else [])
        c0, t0 = [_cpu(p) for p in procs], time.monotonic()
        rss = [0] * len(procs)
        while time.monotonic() - t0 < seconds:
            rss = [max(r, p.memory_info().rss) for r, p in zip(rss, procs, strict=True)]
            time.sleep(0.5)
        c1, t1 = [_cpu(p) for p in procs], time.monotonic()
        still = str(sup.state().get("state"))
    finally:
        sup.close()
    pct = [(b - a) / (t1 - t0) * 100 for a, b in zip(c0, c1, strict=True)]
    mib = [r / 2**20 for r in rss]
    rc, rr = (pct[2], mib[2]) if relay else (0.0, 0.0)
    return Footprint(pct[0], mib[0], rc, rr, pct[1], mib[1], still)


def line(label: str, f: Footprint) -> str:
    return (f"{label}: supervisor CPU {f.cpu:.3f} %, RSS {f.rss:.1f} MiB; relay CPU {f.relay_cpu:.3f} %, "
            f"RSS {f.relay_rss:.1f} MiB; together RSS {f.rss + f.relay_rss:.1f} MiB (state {f.state})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--poll", type=float, default=1.0, help="/health and /metrics period, seconds")
    ap.add_argument("--compare-src", type=Path, help="another tree's src/, alternated with this one")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--attribute", action="store_true", help="also measure with the watchers switched off")
    a = ap.parse_args()
    envs = {"this": None}
    if a.compare_src:
        envs["compare"] = {**os.environ, "PYTHONPATH": str(a.compare_src.resolve())}
    print(f"window {a.seconds:.0f} s, TP=4 simulator, polls every {a.poll:g} s")
    got: dict[str, list[Footprint]] = {k: [] for k in envs}
    for _ in range(a.rounds):
        for name, env in envs.items():
            f = measure(a.seconds, a.warmup, a.poll, env)
            got[name].append(f)
            print(line(f"{name:8s}", f), flush=True)
    if a.attribute:
        print(line("hang off", measure(a.seconds, a.warmup, a.poll, None, hang={"enabled": False})))
        print(line("hang+kernel off", measure(a.seconds, a.warmup, a.poll, None,
                                              top={"watchers": {"kernel": {"enabled": False}}}, hang={"enabled": False})))
    this = got["this"]
    cpu, rss = statistics.median(f.cpu for f in this), statistics.median(f.rss + f.relay_rss for f in this)
    api = statistics.median(f.api_cpu for f in this)
    print(f"median this: supervisor CPU {cpu:.3f} %, supervisor + relay RSS {rss:.1f} MiB; "
          f"baseline simulated API server CPU {api:.3f} % (x{cpu / api if api else float('nan'):.2f})")
    if a.compare_src:
        c = statistics.median(f.cpu for f in got["compare"])
        print(f"median compare: supervisor CPU {c:.3f} %: this is x{cpu / c if c else float('nan'):.2f} of it")
    ok = cpu <= 0.3 and rss <= 60
    print(f"targets supervisor CPU <= 0.3 %, supervisor + relay RSS <= 60 MiB: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(with_loadavg(main))
