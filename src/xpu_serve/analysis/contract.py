"""The verdict's parts made from kept events (root, consequence groups, timeline, summary), and
the edge: `incident_json`, the only place the typed `Incident` becomes the `--json` verdict
contract (/work/shared/cases/README.md "The verdict contract")."""

from __future__ import annotations

from dataclasses import fields
from functools import cmp_to_key
from typing import Any

from xpu_serve.analysis.deaths import death_signal
from xpu_serve.analysis.incident import (
    Consequence,
    Group,
    Hang,
    Incident,
    Root,
    RootEvidence,
    TimelineItem,
)
from xpu_serve.analysis.occurrence import named_bursts, one_event, unnamed_of_named
from xpu_serve.analysis.store import EvidenceStore
from xpu_serve.analysis.subject import Subjects
from xpu_serve.analysis.timeorder import boot, cmp_time
from xpu_serve.events import Event

TIMELINE_MAX = 15
# start-up phases in the order vLLM reaches them (the milestone rows' `phase`)
PHASES = (
    "args",
    "engine-init",
    "dist-init",
    "ccl-init",
    "load-model",
    "kv-cache",
    "engine-ready",
    "api",
    "ready",
)


class Parts:
    """The verdict's parts made from the events kept in the evidence store `st`, each attributed
    by `subj` (see the module docstring)."""

    __slots__ = ("st", "subj")

    def __init__(self, st: EvidenceStore, subj: Subjects) -> None:
        self.st, self.subj = st, subj

    def root_of(self, ev: Event, proc: str | None, rank: int | None, pid: int | None) -> Root:
        return Root(contract_source(ev), proc, rank, pid, ev.time_text, ev.file, ev.line, ev.text.strip()[:2000])

    def consequence_groups(
        self, root: Event | None, demoted: list[Event], skip: set[int] | frozenset[int] = frozenset()
    ) -> list[Group]:
        """What followed the root, counted as events (analysis/occurrence.py) per (signature,
        process, rank) in time order: the store's consequence groups, the root candidates that
        lost and the demoted ones (not the root, not `skip`: the root's own evidence; not a teardown
        burst's unprefixed lines when its ranks are named: `occurrence.unnamed_of_named`). A root row's
        lines beyond the first MAX_PER_SIGNATURE kept count one event each."""
        named = named_bursts(self.st.groups.values())
        groups: dict[tuple[str, str | None, int | None], Group] = {
            k: g.copy() for k, g in self.st.groups.items() if not unnamed_of_named(g, named)
        }
        # root candidates that lost are consequences of the root
        seen_ids = set()
        for sid, evs in self.st.roots.items():
            for ev in evs:
                if ev is root or ev.role != "root" or id(ev) in skip:
                    continue
                seen_ids.add(id(ev))
                self._add_to(groups, ev, sid)
            extra = self.st.root_counts.get(sid, 0) - len(evs)
            if extra > 0 and evs:
                k = next((k for k in groups if k[0] == sid), None)
                if k is not None:
                    groups[k].count += extra
        for ev in demoted:
            if id(ev) not in seen_ids and ev is not root and id(ev) not in skip:
                self._add_to(groups, ev, ev.signature or "")
        out = list(groups.values())
        out.sort(key=cmp_to_key(lambda a, b: cmp_time(a.first, b.first)))
        return out

    def _add_to(self, groups: dict[tuple[str, str | None, int | None], Group], ev: Event, sid: str) -> None:
        proc, rank, pid = self.subj.subject(ev, [], link=False)
        key = (sid, proc, rank)
        g = groups.get(key)
        if g is None:
            groups[key] = Group(self.st.table.by_id[sid], proc, rank, pid, ev, 1, ev)
            return
        if g.last is None or not one_event(g.last, ev):
            g.count += 1
        g.last = ev

    def timeline(
        self, root: Event | None, demoted: list[Event], evidence_events: list[Event] | None = None
    ) -> list[TimelineItem]:
        """At most TIMELINE_MAX contract items in causal order: warning signs and progress, the
        root, then its evidence and what followed (each part in time order where clocks compare,
        else input order)."""
        evidence = {id(e) for e in evidence_events or []}
        items = self._timeline_events(root, evidence_events or [])
        items.sort(key=cmp_to_key(self._cmp_shown))
        # warning signs and progress logged after the root (a stats line printed after a worker
        # died) are shown after it, in time order
        before = [
            e
            for e in items
            if e is not root
            and e.role in ("precursor", "progress")
            and (root is None or cmp_time(e, root) <= 0)
        ]
        bid = {id(e) for e in before}
        after = [e for e in items if e is not root and id(e) not in bid]
        room = TIMELINE_MAX - (1 if root is not None else 0)
        if len(before) + len(after) > room:
            before = before[-max(room // 3, room - len(after)) :] if before else before
            after = after[: room - len(before)]
        items = before + ([root] if root is not None else []) + after
        return [self._timeline_item(ev, root, evidence) for ev in items]

    def _cmp_shown(self, a: Event, b: Event) -> int:
        """`cmp_time`, except that a kernel record stamped only in seconds since boot compares
        with a local wall-clock stamp by its converted time when a record anchors the kernel's
        clock (analysis/clock.py), as the timeline shows it."""
        aware = any(e.time is not None and e.time.tzinfo is not None for e in (a, b))  # UTC facts
        if aware or (boot(a) is None) == (boot(b) is None):
            return cmp_time(a, b)
        wa, wb = self.st.clock.wall(a), self.st.clock.wall(b)
        if wa is None or wb is None or wa == wb:
            return cmp_time(a, b)
        return -1 if wa < wb else 1

    def _timeline_events(self, root: Event | None, evidence_events: list[Event]) -> list[Event]:
        """The candidates of the timeline, each once: the root, its evidence, the first and last
        of each precursor, progress and stall, the first consequence of each signature, the first
        two of each root candidate, and before ready the last four start-up phases."""
        items: list[Event] = []
        seen: set[int] = set()

        def add(ev: Event | None) -> None:
            if ev is not None and id(ev) not in seen:
                seen.add(id(ev))
                items.append(ev)

        add(root)
        for e in evidence_events:
            add(e)
        for sid, evs in self.st.precursors.items():
            if sid in self.st._set["not_hang_detection"]:
                continue
            add(evs[0])
            if len(evs) > 1:
                add(evs[-1])
        add(self.st.last_progress)
        add(self.st.stall_stats)
        first_by_sig: dict[str, Event] = {}
        for g in self.st.groups.values():
            cur = first_by_sig.get(g.sig.id)
            if cur is None or cmp_time(g.first, cur) < 0:
                first_by_sig[g.sig.id] = g.first
        for ev in first_by_sig.values():
            add(ev)
        for evs in self.st.roots.values():
            for ev in evs[:2]:
                add(ev)
        if not self.st.ready and self.st.milestones:
            order = {p: i for i, p in enumerate(PHASES)}
            for ph in sorted(self.st.milestones, key=lambda p: order.get(p, -1))[-4:]:
                add(self.st.milestones[ph].first)
                add(self.st.milestones[ph].last)
        return items

    def _timeline_item(self, ev: Event, root: Event | None, evidence: set[int]) -> TimelineItem:
        proc, rank, pid = self.subj.subject(ev, [], link=ev is root)
        role: str | None
        if ev is root:
            role = "root"
        elif id(ev) in evidence:
            role = "evidence"
        else:
            role = ev.role if ev.role != "root" else "consequence"
        return TimelineItem(
            ev.time_text,
            contract_source(ev),
            proc,
            rank,
            pid,
            role,
            ev.signature,
            ev.file,
            ev.line,
            ev.text.strip()[:300],
            self.st.clock.show(ev),
        )

    def summary(self, inc: Incident, root: Event | None = None, evidence: list[Event] | None = None) -> str:
        """One plain sentence without a final period (callers append "; bundle ..."): who (process,
        rank, pid), what happened (the signal it was killed by, from the root or its evidence),
        when, and how many consequence events followed (analysis/occurrence.py)."""
        r = inc.root
        recs = [e for e in [root, *(evidence or [])] if e is not None]
        parts = [
            f"rank {r.rank}" if r is not None and r.rank is not None else None,
            f"pid {r.pid}" if r is not None and r.pid is not None else None,
        ]
        ids = ", ".join(x for x in parts if x)
        who = str((r.process if r is not None else None) or "A process") + (f" ({ids})" if ids else "")
        # a multi-node group: the head records a follower's death with its node (group/watcher.py)
        node = next((e.extra["node_rank"] for e in recs if isinstance(e.extra.get("node_rank"), int)), None)
        if node is not None:
            who += f" on node {node}"
        t_ev = next((e for e in recs if e.time_text), None)
        where = ""
        if t_ev is not None:
            where = f" at {t_ev.time_text}" + (" s after boot" if boot(t_ev) is not None else "")
        follow = follow_clause(inc)
        c = inc.cause
        label = inc.root_label or c
        signal = next((s for s in (death_signal(e) for e in recs) if s), None)
        if c == "umd-segfault":
            if not signal and root is not None and root.source == "kernel":
                signal = "SIGSEGV"  # the kernel's "segfault at ... in LIB" record
            how = f"was killed by {signal}" if signal else "crashed"
            return f"{who} {how} inside the GPU driver library {inc.library or '?'}{where}{follow}"
        if c == "gpu-fault":
            on = f" in {who}" if r is not None and (r.process or r.pid is not None) else ""
            return f"The GPU driver reported a device fault ({label}){on}{where}{follow}"
        if c == "engine-hang":
            return _hang_summary(inc) + follow
        if c == "startup-hang":
            return _startup_summary(inc) + follow
        if c == "process-crash":
            return who + self._crash_how(root, recs, signal, label) + where + follow
        if c == "host-oom":
            if root is not None and root.source != "kernel" and label:
                return f"{who} was killed for lack of host memory ({label}){where}{follow}"
            return f"{who} was killed by the kernel's OOM killer{where}{follow}"
        return f"{who} failed first: {label}{where}{follow}"

    def _crash_how(self, root: Event | None, recs: list[Event], signal: str | None, label: str | None) -> str:
        """How a process died: the signal, the exit code, or vLLM's report of it."""
        if signal:
            return f" was killed by {signal}"
        code = next(
            (e.extra.get("exit_code") for e in recs if e.extra.get("exit_code") not in (None, "None")),
            None,
        )
        if code is not None:
            return f" exited with code {code}"
        if root is not None and root.signature in self.st._set["worker_death_reports"]:
            return " died unexpectedly (reported by EngineCore)"
        return f" died ({label})"


def _hang_summary(inc: Incident) -> str:
    h = inc.hang or Hang(None, None, None)
    after = f" after {h.last_progress}" if h.last_progress else ""
    by = f"; {h.detected_by} detected it" if h.detected_by else ""
    at = f" at {h.detected_at}" if h.detected_at else ""
    head = f"{h.stuck_rank.sentence()}; the engine" if h.stuck_rank is not None else "The engine"
    return f"{head} stopped making progress{after}{by or ('; detected' if at else '')}{at}"


def follow_clause(inc: Incident) -> str:
    """ "; N events followed as consequences" (or "; 1 event ..."), "" when none did (the
    consequences' counts are events: `analysis/occurrence.py`)."""
    n = sum(c.count for c in inc.consequences)
    if not n:
        return ""
    return f"; {n} events followed as consequences" if n > 1 else "; 1 event followed as a consequence"


def startup_summary(inc: Incident, why: str = "") -> str:
    """The start-up stall's sentence (the last phase, the ranks that did not reach the next) with
    `why` after the phase ("...after phase dist-init: node 1 (10.0.0.2) never joined epoch 1;
    rank 1 did not reach ..."), and the consequences' count."""
    head, sep, ranks = _startup_summary(inc).partition("; ")
    return (f"{head}: {why}" if why else head) + sep + ranks + follow_clause(inc)


def _startup_summary(inc: Incident) -> str:
    s = inc.startup
    miss = s.missing_ranks if s is not None else ()
    ranks = (
        f"; rank{'s' if len(miss) > 1 else ''} {', '.join(map(str, miss))} did not reach {s.missing_phase}"
        if s is not None and miss
        else ""
    )
    if s is None and inc.hang is not None and inc.hang.detected_by:
        h = inc.hang
        return f"Start-up stalled: {h.detected_by} (last at {h.detected_at or '?'})"
    return f"Start-up stalled after phase {(s.last_milestone if s is not None else None) or '?'}{ranks}"


_SOURCES = frozenset(("vllm", "ccl", "kernel", "process", "health"))


def contract_source(ev: Event) -> str:
    """The contract's `source` of an event: vllm, ccl, kernel, process or health (the
    supervisor's own facts are health; anything else read from a log is vllm)."""
    if ev.source in _SOURCES:
        return ev.source
    return "health" if ev.source == "supervisor" else "vllm"


def _flat(part: Root | RootEvidence | Consequence | TimelineItem | Hang) -> dict[str, Any]:
    """A part's fields in the contract's order (the dataclass's), nested parts left out."""
    return {f.name: getattr(part, f.name) for f in fields(part) if f.name != "evidence"}


def root_json(r: Root) -> dict[str, Any]:
    """{source, process, rank, pid, time, file, line, text}, and `evidence` (each {signature,
    label, time, file, line, text}) once looked for."""
    out = _flat(r)
    if r.evidence is not None:
        out["evidence"] = [_flat(e) for e in r.evidence]
    return out


def hang_json(h: Hang) -> dict[str, Any]:
    """{last_progress, detected_at, detected_by}, and delay_s, no_progress_since,
    first_wait_warning where known."""
    out = {k: v for k, v in _flat(h).items() if v is not None or k in _HANG_ALWAYS}
    if h.stuck_rank is not None:
        out["stuck_rank"] = {**h.stuck_rank.to_contract(), "text": h.stuck_rank.sentence()}
    return out


_HANG_ALWAYS = ("last_progress", "detected_at", "detected_by")


def incident_json(inc: Incident) -> dict[str, Any]:
    """The JSON verdict: {cause, summary, root, consequences, timeline, hang, library, notes}."""
    return {
        "cause": inc.cause,
        "summary": inc.summary,
        "root": root_json(inc.root) if inc.root is not None else None,
        "consequences": [_flat(c) for c in inc.consequences],
        "timeline": [_flat(t) for t in inc.timeline],
        "hang": hang_json(inc.hang) if inc.hang is not None else None,
        "library": inc.library,
        "notes": list(inc.notes),
    }
