"""Consequences counted as events, not lines: which consequence lines are one event.

Three shapes of one event (the rest: one line, one event):

- the lines of one Python traceback (one `Event.group`, analysis/traceback.py);
- the lines of one (signature, process, rank) of a known process (a pid, a process name or a
  rank) in a short burst: each within `BURST_S` seconds of the previous one by their clock (the
  log's own stamp or the one carried from the line above, `timeorder.tkey`; the kernel's seconds
  since boot), or, with no clock on either, within `BURST_LINES` lines of the same file. A line
  of an unknown process is one event (three processes' identical unprefixed lines are three);
- the lines of one rank's teardown burst of a collective library (the rows with `teardown_burst`
  in data/signatures.yaml: oneCCL's KVS and PMI finalize errors, printed by each rank's atexit
  finalize in oneCCL's internal_kvs.cpp and pmi_resizable_simple_internal.cpp): a run of such
  lines in one file, each within `RUN_GAP` lines of the previous one, is one event per (process,
  rank); its lines without a process or rank ("write: error: buf ...") are one event per run, and
  none when a line of the same burst in the incident names a rank or process (they are those
  ranks' lines, printed without their prefix: `unnamed_of_named`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from xpu_serve.analysis.incident import Group
from xpu_serve.analysis.timeorder import boot, tkey
from xpu_serve.events import Event

BURST_S = 2.0  # seconds between two lines of one process's event
BURST_LINES = 32  # lines between two unstamped lines of one process's event (same file)
RUN_GAP = 8  # lines between two lines of one teardown run (same file)
MAX_RUNS = 1024  # open teardown runs kept (file, burst)

Key = tuple[str, "str | None", "int | None"]


def _seconds(k: tuple[int, ...]) -> float:
    """A time key (month, day, hour, minute, second, microsecond) as seconds (months of 31 days:
    only differences of close keys are used)."""
    mo, d, h, mi, s, us = k
    return ((((mo * 31 + d) * 24 + h) * 60 + mi) * 60 + s) + us / 1e6


def one_event(last: Event, ev: Event) -> bool:
    """True when `ev` continues the event whose latest line is `last` (same signature, process
    and rank; see the module docstring): the same traceback, or a known process's short burst."""
    if last.group is not None and last.group == ev.group and last.file == ev.file:
        return True
    if ev.pid is None and ev.process is None and ev.rank is None:
        return False
    ba, bb = boot(last), boot(ev)
    if ba is not None and bb is not None:
        return abs(bb - ba) <= BURST_S
    ka, kb = tkey(last), tkey(ev)
    if ka is not None and kb is not None:
        close = abs(_seconds(kb) - _seconds(ka)) <= BURST_S
        return close and (last.file == ev.file or (last.time is not None and ev.time is not None))
    if ka is None and kb is None and last.file == ev.file:
        return abs((ev.line or 0) - (last.line or 0)) <= BURST_LINES
    return False


@dataclass
class _Run:
    last: int
    keys: set[Key] = field(default_factory=set)


class TeardownRuns(dict[tuple["str | None", str], _Run]):
    """The open teardown run per (file, burst) (see the module docstring); a dict, so that a
    restart of vLLM in the input empties it with the store's other containers."""

    def new_event(self, ev: Event, burst: str, key: Key) -> bool:
        """True when teardown line `ev` (of group `key`) starts an event: the first line of its
        key in its run."""
        line = ev.line or 0
        rk = (ev.file, burst)
        run = self.get(rk)
        if run is None or not 0 <= line - run.last <= RUN_GAP:
            if run is None and len(self) >= MAX_RUNS:
                self.clear()
            run = self[rk] = _Run(line)
        run.last = line
        if key in run.keys:
            return False
        run.keys.add(key)
        return True


def named_bursts(groups: Iterable[Group]) -> set[str]:
    """The teardown bursts of which some event names its process or rank."""
    return {g.burst for g in groups if g.burst and (g.process is not None or g.rank is not None)}


def unnamed_of_named(g: Group, named: set[str]) -> bool:
    """True for the events of a burst's lines without process or rank when some event of that
    burst names its rank (`named_bursts`): those lines are the named ranks' own (a paste or a
    per-process log split that lost their prefix), not events of their own."""
    return g.burst in named and g.process is None and g.rank is None
