"""Benchmark: `diagnose` throughput (lines/s) and peak memory on big mixed logs, one core.

Generates a mixed log from the fixture cases' lines (vLLM prefixed lines, stats lines, uvicorn
access lines, oneCCL lines, tracebacks, kernel records), repeated with fresh pids/timestamps
not needed (the analysis keeps counts, not lines), at 1M and 2M lines, then runs the real
`diagnose_files` on each in a fresh subprocess (so peak RSS is per size) and prints lines/s,
peak RSS, and the RSS ratio 2M/1M (≈1.0 means memory independent of input size).
Baseline in the same process: a plain `for line in file` read loop (lines/s). "One core": the
analysis is single-threaded; lines per CPU-second is the figure that does not depend on what else
the machine runs (wall-clock lines/s is printed too).

The "realistic" mix (`--mix realistic`, also run by default) is a healthy busy server's log of
the same lines with one incident in the middle: what `diagnose` of a long production log reads.

Usage: python bench/bench_diagnose.py [--lines 1000000] [--runs 3] [--mix mixed|realistic|both] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "fixtures" / "cases"


def fixture_lines() -> list[str]:
    lines: list[str] = []
    for p in sorted(CASES.glob("*/*")):
        if p.suffix in (".log", ".txt"):
            lines.extend(p.read_text(encoding="utf-8", errors="replace").splitlines())
    return lines


INCIDENT = CASES / "b70-worker0-died-ccl" / "input.log"


def make_log(path: Path, n: int, mix: str = "mixed") -> None:
    """A mixed log of n lines. Per 20 lines: 1 line taken in turn from the fixture cases (crashes,
    tracebacks, oneCCL errors, kernel records, start-up lines), 1 periodic stats line, and 18
    lines of a busy healthy server (uvicorn access lines with and without prefix, worker INFO
    lines, kernel records that match no signature). `mix` "realistic": the same healthy server
    without the fixture lines, and one incident (a worker's death and oneCCL's teardown errors:
    the b70-worker0-died-ccl case) in the middle."""
    src = fixture_lines()
    incident = INCIDENT.read_text(encoding="utf-8").splitlines() if mix == "realistic" else []
    stats = (
        "(APIServer pid=2406) INFO 04-14 22:34:43 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
        "Avg generation throughput: 47.0 tokens/s, Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: 14.3%, "
        "Prefix cache hit rate: 0.6%"
    )
    healthy = [
        '(APIServer pid=2406) INFO:     10.0.0.2:1385 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        'INFO:     127.0.0.1:57856 - "GET /health HTTP/1.1" 200 OK',
        '(APIServer pid=2406) INFO:     10.0.0.7:40112 - "POST /v1/completions HTTP/1.1" 200 OK',
        "(Worker_TP1 pid=7987) INFO 03-26 04:15:12 [utils.py:59] _KV_CACHE_LAYOUT_OVERRIDE variable detected.",
        'INFO:     127.0.0.1:57880 - "GET /metrics HTTP/1.1" 200 OK',
        "(EngineCore_DP0 pid=2674) DEBUG 04-14 22:34:44 [core.py:812] EngineCore waiting for work.",
        "[  364.213117] xe 0000:86:00.0: Using 46-bit DMA addresses",
        "(APIServer pid=2406) INFO 04-14 22:34:45 [chat_utils.py:560] Detected the chat template content format.",
        '(APIServer pid=2406) INFO:     10.0.0.2:1386 - "GET /v1/models HTTP/1.1" 200 OK',
    ]
    with open(path, "w", encoding="utf-8") as f:
        k = 0
        for i in range(n):
            r = i % 20
            if incident and i == n // 2:
                f.write("\n".join(incident) + "\n")
            if r == 19 and not incident:
                f.write(src[k % len(src)] + "\n")
                k += 1
            elif r == 9:
                f.write(stats + "\n")
            else:
                f.write(healthy[i % len(healthy)] + "\n")


def child(path: str) -> None:
    from xpu_serve.diagnosis import diagnose_files

    t0 = time.perf_counter()
    n = 0
    with open(path, "rb") as f:
        for _ in f:
            n += 1
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    c0 = time.process_time()
    inc = diagnose_files([path])
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "lines": n,
                "seconds": dt,
                "lines_per_s": n / dt,
                "cpu_seconds": cpu,
                "lines_per_cpu_s": n / cpu,
                "read_lines_per_s": n / t_read,
                "peak_rss_bytes": rss,
                "cause": inc.cause,
            }
        )
    )


def run_mix(tmp: Path, mix: str, lines: int, runs_per: int) -> None:
    """Time `diagnose` on the `mix` log at `lines` and 2 x `lines` lines; print the medians."""
    results = []
    for n in (lines, 2 * lines):
        p = tmp / f"{mix}-{n}.log"
        if not p.exists():
            make_log(p, n, mix)
        runs = []
        for _ in range(max(1, runs_per)):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(p)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            )
            runs.append(json.loads(out.stdout))
        r = {k: statistics.median(x[k] for x in runs) for k in runs[0] if k != "cause"}
        r["cause"] = runs[0]["cause"]
        r["bytes"] = p.stat().st_size
        results.append(r)
        print(
            f"{mix:>9} {n:>9} lines {r['bytes'] / 1e6:7.1f} MB, median of {len(runs)}: "
            f"{r['lines_per_cpu_s']:>10,.0f} lines per CPU-second, {r['lines_per_s']:>10,.0f} lines/s wall "
            f"({r['seconds']:.2f} s; plain read loop {r['read_lines_per_s']:,.0f} lines/s, "
            f"ratio {r['lines_per_s'] / r['read_lines_per_s']:.3f}), peak RSS {r['peak_rss_bytes'] / 2**20:.1f} MiB,"
            f" cause {r['cause']}"
        )
    ratio = results[1]["peak_rss_bytes"] / results[0]["peak_rss_bytes"]
    print(f"{mix:>9} peak RSS ratio {2 * lines}/{lines} lines: {ratio:.2f} (1.0 = memory independent of size)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--keep", help="directory to keep the generated logs in")
    ap.add_argument("--runs", type=int, default=3, help="runs per size (fresh process each); median printed")
    ap.add_argument("--mix", choices=("mixed", "realistic", "both"), default="both")
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return 0
    tmp = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="xpu-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    for mix in ("mixed", "realistic") if a.mix == "both" else (a.mix,):
        run_mix(tmp, mix, a.lines, a.runs)
    if not a.keep:
        for p in tmp.glob("*.log"):
            p.unlink()
        tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main() if "--child" in sys.argv else with_loadavg(main))
