"""The evidence store: what the analysis keeps of its input, bounded whatever the input size.

Root candidates and precursors keep the first `MAX_PER_SIGNATURE` events of each signature (and
exact counts); consequences are counted as events (analysis/occurrence.py) per (signature,
process, rank), or per (teardown burst, process, rank), in at most `MAX_GROUPS` groups; start-up milestones keep their first and last event and the ranks that reached them; the
pid maps hold what vLLM's prefixes taught ("(Worker_TP1 pid=4242)" -> rank 1). Filled by the
feeding and classification in `diagnosis.Analyzer`, read by the verdict (analysis/verdict.py).
"""

from __future__ import annotations

import re
from typing import Any

from xpu_serve.analysis.clock import Clock
from xpu_serve.analysis.deaths import WORKER_RE, normalize_process
from xpu_serve.analysis.incident import Group, Milestone
from xpu_serve.analysis.kernel_owner import KernelOwners
from xpu_serve.analysis.occurrence import TeardownRuns, one_event
from xpu_serve.analysis.rules import Rules, load_rules
from xpu_serve.events import Event, parse_line
from xpu_serve.incarnation import Trigger
from xpu_serve.signatures import Signature, SignatureTable, load_table

MAX_PER_SIGNATURE = 16  # root/precursor events kept per signature (first ones; counts are exact)
MAX_GROUPS = 4096  # consequence groups (signature, process, rank) kept


class EvidenceStore:
    """The bounded store (see the module docstring). `table` is the signature table (the
    packaged one when None); the causal rules are loaded for it."""

    def __init__(self, table: SignatureTable | None = None) -> None:
        self.table = table or load_table()
        # the causal rules (data/rules.yaml): the rows with a part in the analysis, sets of rows
        # treated alike, the demotion and outrank rules
        self.rules: Rules = load_rules(table)
        self._row = self.rules.rows
        self._set = self.rules.sets
        self.lines = 0
        self._files: list[str] = []
        self._last_t: dict[str, tuple[int, ...]] = {}
        self._last_line: dict[str, str] = {}
        self.pid_rank: dict[int, int] = {}
        self.pid_name: dict[int, str] = {}
        self.pid_last_raw: dict[int, tuple[str, str, int]] = {}
        self.world_size: int | None = None
        self.roots: dict[str, list[Event]] = {}
        self.root_counts: dict[str, int] = {}
        self.precursors: dict[str, list[Event]] = {}
        self.precursor_counts: dict[str, int] = {}
        self.groups: dict[tuple[str, str | None, int | None], Group] = {}
        self._teardown = TeardownRuns()  # open collective teardown runs (analysis/occurrence.py)
        self.clock = Clock()  # the input's year and boot time, for people's times (analysis/clock.py)
        self.milestones: dict[str, Milestone] = {}  # phase -> what was read of it
        self.ready = False
        # Event, or (line, file, lineno) of the raw line (fast path); see _ref_event
        self.last_progress: Any = None
        self.last_stats: Any = None
        self.stall_stats: Any = None  # first zero-throughput stats with work after last progress
        self.facts_hang: Event | None = None
        self.rank_states: Event | None = None  # the supervisor's `rank-states` fact of a hang
        # a bundle's processes: its kernel records of other programs are dropped (cli/diagnose.py)
        self.kernel_owners: KernelOwners | None = None
        # a GPU driver's own fault records (rows with opens_burst): see rootdeath.primary_gpu_fault
        self._burst_openers = frozenset(r.id for r in self.table.rows if r.extra.get("opens_burst"))
        # an input that holds several starts of vLLM (a whole journal pasted: incident, restart,
        # incident): the state of the last failed incarnation before the latest restart
        self._earlier: EvidenceStore | None = None
        # the supervisor's trigger (facts.trigger), when one was read: analysis/supervised.py
        self.trigger: Trigger | None = None
        self._restart_at: tuple[str, int] | None = None
        self.restarts = 0

    def _learn_pid(self, ev: Event) -> None:
        pid, name = ev.pid, ev.process
        if pid is None or ev.source not in ("vllm", "ccl"):
            return
        if name:
            if pid not in self.pid_name:
                self.pid_name[pid] = name
            if name[-1].isdigit() and "_TP" in name:
                m = WORKER_RE.search(name)
                if m:
                    self.pid_rank.setdefault(pid, int(m.group(1)))
        if ev.rank is not None:
            self.pid_rank.setdefault(pid, ev.rank)
        elif pid in self.pid_rank:
            ev.rank = self.pid_rank[pid]

    def _keep_root(self, sid: str, ev: Event) -> None:
        """Count a root candidate and keep it (the first MAX_PER_SIGNATURE of its signature)."""
        self.root_counts[sid] = self.root_counts.get(sid, 0) + 1
        lst = self.roots.setdefault(sid, [])
        if len(lst) < MAX_PER_SIGNATURE:
            lst.append(ev)

    def _add_consequence(self, ev: Event, sig: Signature) -> None:
        """Count consequence line `ev` of row `sig` in its group: a new event, or a further line
        of the group's latest event (analysis/occurrence.py)."""
        rank = ev.rank if ev.rank is not None else (self.pid_rank.get(ev.pid) if ev.pid is not None else None)
        proc = normalize_process(ev.process or (self.pid_name.get(ev.pid) if ev.pid else None), rank)
        burst = sig.extra.get("teardown_burst")
        key = (f"burst:{burst}" if burst else sig.id, proc, rank)
        g = self.groups.get(key)
        if g is None:
            if len(self.groups) >= MAX_GROUPS:
                return
            g = self.groups[key] = Group(sig, proc, rank, ev.pid, ev, burst=burst)
        if burst:
            new = self._teardown.new_event(ev, burst, key)
        else:
            new = g.last is None or not one_event(g.last, ev)
        g.count += new
        g.last = ev
        detail = ev.extra.get("burst_detail")
        if g.detail is None and isinstance(detail, str):
            g.detail = detail

    def _ref_event(self, ref: Any) -> Event | None:
        if ref is None or isinstance(ref, Event):
            return ref
        line, file, lineno = ref
        ev = parse_line(line, file, lineno)
        ev.signature, ev.role = self._row["stats_line"], "progress"
        ev.extra["_order"] = 0
        t = ev.time
        if t is not None:
            ev.extra["_tkey"] = (t.month, t.day, t.hour, t.minute, t.second, t.microsecond)
        return ev

    def note_stats(self, m: re.Match[str], raw: tuple[str, str, int] | None, ev: Event | None) -> None:
        """A periodic stats line: progress when prompt or generation throughput is non-zero;
        a stall when requests are running or waiting and both are zero. Stored as the raw line
        (parsed again only for the verdict) so the fast path stays cheap."""
        self.ready = True
        try:
            p = float(m.group("prompt_tps") or 0)
            g = float(m.group("gen_tps") or 0)
            running = int(m.group("running") or 0) + int(m.group("waiting") or 0)
        except (ValueError, IndexError):
            return
        ref: Any = ev if ev is not None else raw
        self.last_stats = ref
        if p > 0 or g > 0:
            self.last_progress = ref
            self.stall_stats = None
        elif running > 0 and self.stall_stats is None:
            self.stall_stats = ref

    def note_milestone(self, ev: Event, sig: Signature, gd: dict[str, Any]) -> None:
        """A progress row: a stats line (`note_stats`), the ready line, or a start-up phase
        reached (per phase: first and last event, the ranks, or the pids of unknown rank)."""
        phase = sig.phase
        if phase == "serving":  # stats line
            m = sig.pattern.search(ev.text)
            if m:
                self.note_stats(m, None, ev)
            return
        if phase == "ready":
            self.ready = True
        if phase is None:
            return
        rank = ev.rank
        if "rank" in gd and gd["rank"] is not None:
            rank = int(gd["rank"])
            if ev.pid is not None:
                self.pid_rank.setdefault(ev.pid, rank)
        if "world_size" in gd and gd["world_size"]:
            self.world_size = int(gd["world_size"])
        if rank is None and ev.pid is not None:
            rank = self.pid_rank.get(ev.pid)
        ms = self.milestones.get(phase)
        if ms is None:
            ms = self.milestones[phase] = Milestone(ev, ev, sig.per_rank)
        ms.last = ev
        ms.per_rank = ms.per_rank or sig.per_rank
        if rank is not None:
            ms.ranks.add(rank)
        elif ev.pid is not None and len(ms.pids) < 1024:
            ms.pids.add(ev.pid)

    def has_failure(self, file: str) -> bool:
        """True when failure evidence read from `file` is kept: a hang fact, a stall, a root
        candidate, a consequence of a fatal row."""
        for e in (self.facts_hang, self.stall_stats):
            if isinstance(e, Event) and e.file == file:
                return True
        if isinstance(self.stall_stats, tuple) and self.stall_stats[1] == file:
            return True
        if any(e.role == "root" and e.file == file for evs in self.roots.values() for e in evs):
            return True
        return any(g.sig.extra.get("fatal") and g.first.file == file for g in self.groups.values())
