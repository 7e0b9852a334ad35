"""Start-up cost of `xpu-serve diagnose`: wall time of the whole command on an empty log (import,
argument parsing, loading the packaged signature and code tables, an empty report), against a
bare `python -c pass` measured in the same run, so the ratio is in interpreter starts.

    .venv/bin/python bench/bench_diagnose_startup.py [--runs 20] [--compare-src DIR]

The commands run alternately, `--runs` times each, after one warm-up each (page cache, .pyc);
medians printed. `xpu-serve diagnose` is `python -m xpu_serve diagnose` with this checkout's src/
first on PYTHONPATH; `--compare-src DIR` adds the same command on another tree's src/ (e.g. a
`git archive` of an earlier commit) to the alternation, for a before/after in one run. PYTHONDONTWRITEBYTECODE
is removed from the children's environment: an installed package has its .pyc files, and without
them every run recompiles the project's sources (~0.1 s on a 2-core VM); the same goes for the
packaged tables' marshal cache (`xpu_serve/yamldata.py`), written by the warm-up run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402

# exit codes of a run that did its work: 0, and 6 (NO_VERDICT, xpu_serve/exitcodes.py: `diagnose`
# of an empty input finds nothing that supports a verdict)
DONE = (0, 6)


def wall(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds from spawn to exit of `cmd`; raises RuntimeError when it exits with another code
    than DONE."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    dt = time.perf_counter() - t0
    if r.returncode not in DONE:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.decode(errors='replace')[-300:]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--compare-src", type=Path, help="another tree's src/ to time the same way")
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    trees = {"this tree": Path(__file__).resolve().parents[1] / "src"}
    if a.compare_src:
        trees["compare"] = a.compare_src.resolve()
    with tempfile.TemporaryDirectory(prefix="xpu-bench-") as tmp:
        empty = Path(tmp) / "empty.log"
        empty.write_bytes(b"")
        cmds = {name: [sys.executable, "-m", "xpu_serve", "diagnose", str(empty)] for name in trees}
        envs = {name: dict(env, PYTHONPATH=str(src)) for name, src in trees.items()}
        cmds["python -c pass"], envs["python -c pass"] = [sys.executable, "-c", "pass"], env
        times: dict[str, list[float]] = {name: [] for name in cmds}
        try:
            for name in cmds:  # warm-up
                wall(cmds[name], envs[name])
            for _ in range(a.runs):
                for name in cmds:
                    times[name].append(wall(cmds[name], envs[name]))
        except RuntimeError as e:
            print(f"bench_diagnose_startup: {e.args[0].splitlines()[0]}", file=sys.stderr)
            return 1
    base = statistics.median(times["python -c pass"])
    print(f"runs: {a.runs} each, alternated")
    for name, ts in times.items():
        what = f"diagnose (empty file), {name} ({trees[name]})" if name in trees else f"{name} (baseline)"
        m = statistics.median(ts)
        print(f"{what}: median {m:.3f} s (min {min(ts):.3f}, max {max(ts):.3f}), x{m / base:.1f} baseline")
    return 0


if __name__ == "__main__":
    raise SystemExit(with_loadavg(main))
