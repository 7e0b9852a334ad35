"""Config loading under hostile input (issue 2): wall time and peak Python memory of
`load_config` on the worst files the limits allow, against loading configs/demo.yaml in the
same process.

    .venv/bin/python bench/bench_config.py [--runs 5]

Prints one line per case: median seconds, tracemalloc peak (MiB), ratio to the baseline, and
the first problem line (or "ok").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from xpu_serve.config import MAX_FILE_BYTES, ConfigError, load_config  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402


def cases() -> dict[str, str]:
    bomb = ["engine: {model: m}", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    bomb += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    fill = MAX_FILE_BYTES - 100
    return {
        "billion laughs (9**9 strings)": "\n".join(bomb) + "\n",
        "duplicate keys to 1 MiB": "engine: {model: m}\n" + "a: 1\n" * (fill // 5),
        "1 MiB comment line": "engine: {model: m}\n#" + "x" * fill + "\n",
        "1 MiB plain scalar": "engine: {model: m}\nx: " + "x" * fill + "\n",
        "flow nesting [ x 5000": "engine: {model: m}\nx: " + "[" * 5000 + "\n",
        "4990 engine.args (valid)": "engine:\n  model: m\n  args:\n"
        + "".join(f"    flag-{i}: {i}\n" for i in range(4990)),
        "5000 unknown keys": "engine:\n  model: m\n" + "".join(f"  k{i}: 1\n" for i in range(4990)),
    }


def _load(path: Path) -> str:
    try:
        load_config(path)
    except ConfigError as e:
        return f"{len(e.problems)} line(s): {e.problems[0].split(': ', 1)[1][:90]}"
    return "ok"


def measure(path: Path, runs: int) -> tuple[float, float, str]:
    """(median wall seconds of `runs` loads, tracemalloc peak MiB of one more load, outcome);
    timed runs without tracemalloc, which slows PyYAML several-fold."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        first = _load(path)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    _load(path)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return statistics.median(times), peak, first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    base, base_peak, _ = measure(ROOT / "configs" / "demo.yaml", args.runs)
    print(f"baseline configs/demo.yaml: {base:.4f} s, peak {base_peak:.1f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in cases().items():
            p = Path(tmp) / "c.yaml"
            p.write_text(text)
            t, peak, first = measure(p, args.runs)
            print(f"{name}: {t:.3f} s (x{t / base:.1f}), peak {peak:.1f} MiB, {first}")
    return 0


if __name__ == "__main__":
    sys.exit(with_loadavg(main))
