"""CPU per `/metrics` parse for the hang watchdog: `progress.parse_metrics` (a scan for vLLM's
four progress families) against prometheus_client's text parser summing the same families, on
the simulator's exposition text (`sim.api_metrics.Metrics`: vLLM's family names, types and
labels), both timed alternately in this process with thread CPU time.

    .venv/bin/python bench/bench_metrics_parse.py [--runs 5] [--n 300]

Prints per-run ms per parse for each and the ratio; exits 1 if the two disagree on the sums.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402

from xpu_serve.sim.api_metrics import Metrics  # noqa: E402
from xpu_serve.sources import progress  # noqa: E402


def baseline(text: str) -> dict[str, float]:
    """prometheus_client's parser, summing the four families over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in progress._WANTED:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def per_call_ms(fn, text: str, n: int) -> float:
    t0 = time.thread_time()
    for _ in range(n):
        fn(text)
    return (time.thread_time() - t0) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=300)
    a = ap.parse_args()
    text = Metrics("qwen3-30b-a3b").text().decode()
    got, want = progress.parse_metrics(text), baseline(text)
    if (got.running, got.waiting) != (want.get(progress.RUNNING), want.get(progress.WAITING)):
        print(f"disagree: {got} vs {want}")
        return 1
    new, old = [], []
    for _ in range(a.runs):
        new.append(per_call_ms(progress.parse_metrics, text, a.n))
        old.append(per_call_ms(baseline, text, a.n))
    print(f"text {len(text)} bytes; runs {a.runs} x {a.n} parses")
    print("scan ms/parse:              " + " ".join(f"{x:.3f}" for x in new))
    print("prometheus_client ms/parse: " + " ".join(f"{x:.3f}" for x in old))
    mn, mo = statistics.median(new), statistics.median(old)
    print(f"median {mn:.3f} ms vs {mo:.3f} ms: x{mn / mo:.3f} of prometheus_client's parser")
    return 0


if __name__ == "__main__":
    raise SystemExit(with_loadavg(main))
