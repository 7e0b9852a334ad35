"""Which kernel records of a bundle are the supervised tree's: the live kernel watcher's
ownership rule (`sources.kernel.attributable`) applied offline to a bundle's kernel.log.

A bundle's kernel.log is the kernel's window around the incident, other programs' records
included (another test suite's segfaults on the same machine). The processes the supervisor knew
are in incident.json `supervisor.processes` (name, pid, rank) and its pid namespace in
`supervisor.initial_pid_ns` (absent in older bundles: then a comm match is allowed, as live in a
nested namespace). A record of a foreign pid is left out, as live: never a root. Without a process
list (a plain log file) there is no owner: every pid is eligible.
"""

from __future__ import annotations

import json
from pathlib import Path

from xpu_serve.events import Event
from xpu_serve.fsread import read_regular
from xpu_serve.incarnation import ProcessInfo
from xpu_serve.sources.kernel import Correlator, attributable, expected_comm


def recorded_processes(bundle: str | Path) -> tuple[list[ProcessInfo], bool | None]:
    """(the processes of incident.json `supervisor.processes`, `supervisor.initial_pid_ns`) of a
    bundle; ([], None) when unreadable. Never raises."""
    try:
        doc = json.loads(read_regular(Path(bundle) / "incident.json", 8 << 20, follow=False) or b"{}")
        sup = doc.get("supervisor") or {}
        rows = sup.get("processes") or []
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        return [], None
    out = []
    for p in rows if isinstance(rows, list) else []:
        if isinstance(p, dict) and isinstance(p.get("pid"), int) and isinstance(p.get("name"), str):
            rank = p.get("rank") if isinstance(p.get("rank"), int) else None
            out.append(ProcessInfo(p["name"], p["pid"], rank))
    ns = sup.get("initial_pid_ns")
    return out, ns if isinstance(ns, bool) else None


def owners(processes: list[ProcessInfo], initial_ns: bool | None) -> Correlator:
    """A Correlator over recorded (no longer live) processes: no /proc reads; comm is vLLM's
    expected one (`expected_comm`) where a comm match is allowed (a nested pid namespace), else
    unset so the pid decides (as live when the comm could not be read). No incarnation start:
    the bundle's kernel.log window is already bounded, and ownership is what is checked here."""
    corr = Correlator(started_at=None, initial_ns=initial_ns if initial_ns is not None else False)
    corr.processes = {p.pid: p for p in processes}
    if not corr.initial_ns:
        corr.comm = {p.pid: expected_comm(p) for p in processes}
    return corr


class KernelOwners:
    """The offline ownership check of an Analyzer: `foreign(ev, cause)` says whether a kernel
    record is another program's. Such records are left out, as the live watcher leaves them out
    (so the verdict, notes included, is the live one); `foreign_count` counts them."""

    def __init__(self, corr: Correlator):
        self.corr = corr
        self.foreign_count = 0

    def foreign(self, ev: Event, cause: str | None) -> bool:
        """True when the kernel record `ev` (classified with `cause`) is not the tree's."""
        wall = ev.time.timestamp() if ev.time is not None else None
        c = self.corr.match(ev.pid, ev.process, wall)
        if attributable(ev, c.ours, cause):
            return False
        self.foreign_count += 1
        return True
