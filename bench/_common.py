"""Shared by every bench script: the load average a run ran under, printed at its start and end
(the machines these figures come from are shared and noisy; bench/README.md quotes it).

    from _common import with_loadavg
    raise SystemExit(with_loadavg(main))

The bench directory is on sys.path when a script runs as `python bench/bench_x.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def loadavg_line(when: str) -> str:
    """'load average at WHEN: 1-min 5-min 15-min' from os.getloadavg() (runnable processes)."""
    one, five, fifteen = os.getloadavg()
    return f"load average at {when}: {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min, {os.cpu_count()} cores)"


def with_loadavg(main: Callable[[], int]) -> int:
    """Run `main`, printing the load average before and after it; returns main's exit code."""
    print(loadavg_line("start"), flush=True)
    try:
        return main()
    finally:
        print(loadavg_line("end"), flush=True)
