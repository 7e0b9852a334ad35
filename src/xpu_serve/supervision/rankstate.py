"""The `rank-states` fact of a hang (`facts.rank_states`): each TP rank's process state and where
its stack waits, read by the hang watchdog before anything is killed (analysis/stuck.py reads it).

A process state is kept only when every sample shows it: `D` (uninterruptible sleep) is also
the state of a short disk or page-fault wait, so one read is not evidence. The samples are taken
before py-spy runs: py-spy's ptrace attach shows as `t` (tracing stop) while it reads a process.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from xpu_serve import facts, procfs
from xpu_serve.analysis.stacks import UNKNOWN, collective_wait
from xpu_serve.events import Event
from xpu_serve.incarnation import ProcessInfo


def steady_states(pids: Iterable[int], samples: int = 3, gap_s: float = 0.05) -> dict[int, str | None]:
    """pid -> its one-letter state (proc(5) field 3) when all `samples` reads `gap_s` seconds
    apart agree, else None (it changed, or the process is gone)."""
    pids = list(pids)
    seen: dict[int, set[str | None]] = {pid: set() for pid in pids}
    for i in range(max(1, samples)):
        if i:
            time.sleep(gap_s)
        for pid in pids:
            seen[pid].add(procfs.state(pid))
    return {pid: next(iter(s)) if len(s) == 1 else None for pid, s in seen.items()}


def rank_states_fact(
    workers: list[ProcessInfo], states: dict[int, str | None], stacks: dict[int, str], at: float | None = None
) -> Event | None:
    """The `rank-states` fact of the workers with a TP rank (None when there are none): their
    state (`states`) and the collective their py-spy dump waits in (`stacks`, pid -> text)."""
    ranked = sorted((p for p in workers if p.rank is not None), key=lambda p: (p.rank or 0, p.pid))
    if not ranked:
        return None
    rows = [
        {
            "process": p.name,
            "rank": p.rank,
            "pid": p.pid,
            "state": states.get(p.pid),
            "wait": collective_wait(stacks[p.pid]) if p.pid in stacks else UNKNOWN,
        }
        for p in ranked
    ]
    return facts.rank_states(rows, at=at)
