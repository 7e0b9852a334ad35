"""The verdict contract at the edge: kept events turned into the `--json` contract's parts
(root, consequence groups, timeline, summary; /work/shared/cases/README.md). Everything before
this works on `Event`s and `Group`s."""

from __future__ import annotations

from functools import cmp_to_key
from typing import Any

from xpu_serve.analysis.deaths import death_signal
from xpu_serve.analysis.incident import Group, Incident
from xpu_serve.analysis.subject import SubjectMixin
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


class ContractMixin(SubjectMixin):
    """Contract output of the analysis (see the module docstring)."""

    def _contract_event(
        self, ev: Event, proc: str | None, rank: int | None, pid: int | None
    ) -> dict[str, Any]:
        return {
            "source": ev.source
            if ev.source in ("vllm", "ccl", "kernel", "process", "health")
            else ("health" if ev.source == "supervisor" else "vllm"),
            "process": proc,
            "rank": rank,
            "pid": pid,
            "time": ev.time_text,
            "file": ev.file,
            "line": ev.line,
            "text": ev.text.strip()[:2000],
        }

    def _consequence_groups(
        self, root: Event | None, demoted: list[Event], skip: set[int] | frozenset[int] = frozenset()
    ) -> list[Group]:
        """What followed the root, counted per (signature, process, rank) in time order: the
        store's consequence groups, the root candidates that lost and the demoted ones (not the
        root, not `skip`: the root's own evidence)."""
        groups: dict[tuple[str, str | None, int | None], Group] = {
            k: Group(g.sig, g.process, g.rank, g.pid, g.first, g.count) for k, g in self.groups.items()
        }
        # root candidates that lost are consequences of the root
        seen_ids = set()
        for sid, evs in self.roots.items():
            for ev in evs:
                if ev is root or ev.role != "root" or id(ev) in skip:
                    continue
                seen_ids.add(id(ev))
                self._add_to(groups, ev, sid)
            extra = self.root_counts.get(sid, 0) - len(evs)
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
        proc, rank, pid = self._subject(ev, [], link=False)
        key = (sid, proc, rank)
        g = groups.get(key)
        if g is None:
            groups[key] = Group(self.table.by_id[sid], proc, rank, pid, ev, 1)
        else:
            g.count += 1

    def _timeline(
        self, root: Event | None, demoted: list[Event], evidence_events: list[Event] | None = None
    ) -> list[dict[str, Any]]:
        """At most TIMELINE_MAX contract items in causal order: warning signs and progress, the
        root, then its evidence and what followed (each part in time order where clocks compare,
        else input order)."""
        evidence = {id(e) for e in evidence_events or []}
        items = self._timeline_events(root, evidence_events or [])
        items.sort(key=cmp_to_key(cmp_time))
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
        for sid, evs in self.precursors.items():
            if sid in self._set["not_hang_detection"]:
                continue
            add(evs[0])
            if len(evs) > 1:
                add(evs[-1])
        add(self.last_progress)
        add(self.stall_stats)
        first_by_sig: dict[str, Event] = {}
        for g in self.groups.values():
            cur = first_by_sig.get(g.sig.id)
            if cur is None or cmp_time(g.first, cur) < 0:
                first_by_sig[g.sig.id] = g.first
        for ev in first_by_sig.values():
            add(ev)
        for evs in self.roots.values():
            for ev in evs[:2]:
                add(ev)
        if not self.ready and self.milestones:
            order = {p: i for i, p in enumerate(PHASES)}
            for ph in sorted(self.milestones, key=lambda p: order.get(p, -1))[-4:]:
                add(self.milestones[ph]["first"])
                add(self.milestones[ph]["last"])
        return items

    def _timeline_item(self, ev: Event, root: Event | None, evidence: set[int]) -> dict[str, Any]:
        proc, rank, pid = self._subject(ev, [], link=ev is root)
        d = self._contract_event(ev, proc, rank, pid)
        role: str | None
        if ev is root:
            role = "root"
        elif id(ev) in evidence:
            role = "evidence"
        else:
            role = ev.role if ev.role != "root" else "consequence"
        return {
            "time": d["time"],
            "source": d["source"],
            "process": proc,
            "rank": rank,
            "pid": pid,
            "role": role,
            "signature": ev.signature,
            "file": ev.file,
            "line": ev.line,
            "text": d["text"][:300],
        }

    def _summary(self, inc: Incident, root: Event | None = None, evidence: list[Event] | None = None) -> str:
        """One plain sentence without a final period (callers append "; bundle ..."): who (process,
        rank, pid), what happened (the signal it was killed by, from the root or its evidence),
        when, and how many lines followed as consequences."""
        r = inc.root or {}
        recs = [e for e in [root, *(evidence or [])] if e is not None]
        parts = [
            f"rank {r['rank']}" if r.get("rank") is not None else None,
            f"pid {r['pid']}" if r.get("pid") is not None else None,
        ]
        ids = ", ".join(x for x in parts if x)
        who = str(r.get("process") or "A process") + (f" ({ids})" if ids else "")
        t_ev = next((e for e in recs if e.time_text), None)
        where = ""
        if t_ev is not None:
            where = f" at {t_ev.time_text}" + (" s after boot" if boot(t_ev) is not None else "")
        n = sum(c["count"] for c in inc.consequences)
        follow = (
            (f"; {n} lines followed as consequences" if n > 1 else "; 1 line followed as a consequence")
            if n
            else ""
        )
        c = inc.cause
        label = inc.root_label or c
        signal = next((s for s in (death_signal(e) for e in recs) if s), None)
        if c == "umd-segfault":
            if not signal and root is not None and root.source == "kernel":
                signal = "SIGSEGV"  # the kernel's "segfault at ... in LIB" record
            how = f"was killed by {signal}" if signal else "crashed"
            return f"{who} {how} inside the GPU driver library {inc.library or '?'}{where}{follow}"
        if c == "gpu-fault":
            on = f" in {who}" if r.get("process") or r.get("pid") is not None else ""
            return f"The GPU driver reported a device fault ({label}){on}{where}{follow}"
        if c == "engine-hang":
            return _hang_summary(inc) + follow
        if c == "startup-hang":
            return _startup_summary(inc) + follow
        if c == "process-crash":
            return who + self._crash_how(root, recs, signal, label) + where + follow
        if c == "host-oom":
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
        if root is not None and root.signature in self._set["worker_death_reports"]:
            return " died unexpectedly (reported by EngineCore)"
        return f" died ({label})"


def _hang_summary(inc: Incident) -> str:
    h = inc.hang or {}
    after = f" after {h['last_progress']}" if h.get("last_progress") else ""
    by = f"; {h['detected_by']} detected it" if h.get("detected_by") else ""
    at = f" at {h['detected_at']}" if h.get("detected_at") else ""
    stuck = h.get("stuck_rank")
    head = f"{stuck['text']}; the engine" if isinstance(stuck, dict) and stuck.get("text") else "The engine"
    return f"{head} stopped making progress{after}{by or ('; detected' if at else '')}{at}"


def _startup_summary(inc: Incident) -> str:
    s = inc.startup or {}
    miss = s.get("missing_ranks") or []
    ranks = (
        f"; rank{'s' if len(miss) > 1 else ''} {', '.join(map(str, miss))} did not reach {s.get('missing_phase')}"
        if miss
        else ""
    )
    if not s.get("last_milestone") and inc.hang and inc.hang.get("detected_by"):
        h = inc.hang
        return f"Start-up stalled: {h['detected_by']} (last at {h.get('detected_at') or '?'})"
    return f"Start-up stalled after phase {s.get('last_milestone') or '?'}{ranks}"
