"""Recovery time: SIGKILL of `Worker_TP0` -> the server answering a completion again, at the
minimum restart delay (sim TP=4, time scale 0.01, `restart.initial_delay_s` 0.01 s).

Runs `xpu-serve up` on the simulator, kills the ready incarnation's worker 0 with SIGKILL, then
POSTs a 1-token `/v1/completions` every 20 ms until one answers 200; the figure is kill -> that
answer, and kill -> the next incarnation's `launched` event (the supervisor's own part: exit
seen, capture, stop; without the simulated engine's start-up, which dominates under load). Each kill also checks the incident's bundle exists and is complete (`bundle.json`).
With `--compare-src DIR` the same is measured with another tree's src/ (e.g. a `git archive` of
an earlier commit), alternated with this one (`--rounds` rounds of `--kills` kills each: this,
compare, this, compare...), for a before/after in one run.

    .venv/bin/python bench/bench_recovery.py [--kills 5] [--rounds 1] [--compare-src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import with_loadavg  # noqa: E402
from supervise_common import Supervised, sim_config, tmpdir  # noqa: E402


def _answer(base: str, deadline: float) -> float | None:
    """Monotonic time of the first 200 completion before `deadline`, else None."""
    body = {"model": "bench", "prompt": "hi", "max_tokens": 1}
    with httpx.Client(timeout=1.0, trust_env=False) as c:
        while time.monotonic() < deadline:
            try:
                if c.post(f"{base}/v1/completions", json=body).status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    return None


def run_kills(kills: int, env: dict[str, str] | None, relaunch: list[float] | None = None) -> list[float]:
    """Seconds kill -> answering, one per kill; raises when a bundle is missing or incomplete.
    `relaunch` gets kill -> the next incarnation's `launched` event (the supervisor's own part,
    without the simulated engine's start-up)."""
    tmp = tmpdir()
    cfg = sim_config(tmp, tp=4)
    port = json.loads(json.dumps(__import__("yaml").safe_load(cfg.read_text())))["engine"]["port"]
    base = f"http://127.0.0.1:{port}"
    sup = Supervised(cfg, env=env)
    out: list[float] = []
    try:
        for i in range(1, kills + 1):
            st = sup.ready_state(i, timeout=120)
            worker = next(p["pid"] for p in st["processes"] if p["name"] == "Worker_TP0")
            time.sleep(0.3)  # ready and idle
            t0, t0_wall = time.monotonic(), time.time()
            os.kill(worker, signal.SIGKILL)
            sup.wait_event("failed", count=i, timeout=30)
            t1 = _answer(base, t0 + 60)
            if t1 is None:
                raise RuntimeError(f"kill {i}: not answering within 60 s")
            out.append(t1 - t0)
            if relaunch is not None:
                relaunch.append(float(sup.wait_event("launched", count=i + 1, timeout=30)["ts"]) - t0_wall)
            inc = sup.wait_event("incident", count=i, timeout=30)
            bundle = Path(inc.get("bundle") or "")
            if not (bundle / "bundle.json").is_file():
                raise RuntimeError(f"kill {i}: bundle {bundle} missing")
    finally:
        sup.close()
    return out


def _figures(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--compare-src", type=Path)
    a = ap.parse_args()
    runs: dict[str, list[float]] = {"this": []}
    relaunch: dict[str, list[float]] = {"this": []}
    for _ in range(a.rounds):
        runs["this"] += run_kills(a.kills, None, relaunch["this"])
        if a.compare_src:
            env = {**os.environ, "PYTHONPATH": str(a.compare_src.resolve())}
            runs.setdefault("compare", []).extend(run_kills(a.kills, env, relaunch.setdefault("compare", [])))
    for name, xs in runs.items():
        print(f"{name:8s} kill -> answering: median {statistics.median(xs):.3f} s (" + _figures(xs) + ")")
        ys = relaunch[name]
        print(f"{name:8s} kill -> relaunched: median {statistics.median(ys):.3f} s (" + _figures(ys) + ")")
    if a.compare_src:
        r = statistics.median(runs["this"]) / statistics.median(runs["compare"])
        r2 = statistics.median(relaunch["this"]) / statistics.median(relaunch["compare"])
        print(f"this is x{r:.2f} of compare (kill -> relaunched x{r2:.2f})")
    ok = statistics.median(runs["this"]) <= 2.0
    print(f"target <= 2.0 s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(with_loadavg(main))
