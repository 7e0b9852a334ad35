"""Run one bench script alternately against two source trees and print the median of each figure.

    .venv/bin/python bench/ab.py [--rounds 7] BASE_SRC NEW_SRC bench/bench_kmsg.py 30000

BASE_SRC / NEW_SRC are directories holding the `xpu_serve` package (e.g. a `git archive` of
main's `src` unpacked in a mkdtemp directory, and this tree's `src`), put first on PYTHONPATH.
Runs alternate (base, new, base, new...) so load on a shared machine hits both alike. A figure
is every output line `LABEL: NUMBER UNIT...` with a rate (`records/s`, `MB/s`) or time unit (`s`, `ms`, `us`); lines whose label
differs between runs are matched by label. Prints, per label: base median, new median, new/base.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

_FIGURE_RE = re.compile(r"^([^:]+):\s+([\d,]+(?:\.\d+)?)\s+(\S+)")
_TIME_UNITS = ("s", "ms", "us")


def figures(text: str) -> dict[str, tuple[float, str]]:
    """LABEL -> (value, unit) of every figure line in a bench script's output."""
    out: dict[str, tuple[float, str]] = {}
    for line in text.splitlines():
        m = _FIGURE_RE.match(line)
        if m and ("/" in m.group(3) or m.group(3) in _TIME_UNITS):
            out[m.group(1).strip()] = (float(m.group(2).replace(",", "")), m.group(3))
    return out


def run(src: str, argv: list[str]) -> dict[str, tuple[float, str]]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    r = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=True)
    return figures(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("script", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    got: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    units: dict[str, str] = {}
    for _ in range(a.rounds):
        for side in ("base", "new"):
            for label, (value, unit) in run(getattr(a, side), a.script).items():
                got[side].setdefault(label, []).append(value)
                units[label] = unit
    print(f"{a.rounds} alternating rounds of {' '.join(a.script)}; load average {os.getloadavg()[0]:.2f}")
    for label in got["base"]:
        if label not in got["new"]:
            continue
        b, n = statistics.median(got["base"][label]), statistics.median(got["new"][label])
        print(f"{label}: base {b:,.0f} new {n:,.0f} {units[label]} (new/base {n / b:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
