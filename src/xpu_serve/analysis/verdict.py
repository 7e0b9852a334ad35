"""The verdict: which root candidate is the root cause, what kind of incident it is (a failure,
an engine hang, a start-up stall, or unknown), and the root's own evidence.

Steps, in order: candidates (root-role events kept; a generic exception subsumed by a specific
row is demoted), the demotion rules of data/rules.yaml (analysis/demote.py), then CAUSE_RULES:
ranking by the row's weight then time then process, the outrank rules and the GPU fault that
opened the kernel burst (`rank`), the hang rules (analysis/hang.py), the start-up stall rules
(analysis/stall.py); then the root's description, the stall's and the hang's facts, the root's
own death records (analysis/rootdeath.py) and the verdict's parts (analysis/contract.py).
Every rule is a function of (Ctx, Work) (analysis/work.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from functools import cmp_to_key

from xpu_serve.analysis.demote import Candidates, apply_demote, apply_outrank, outrank_notes
from xpu_serve.analysis.hang import hang_cause, hang_verdict
from xpu_serve.analysis.incident import Incident, RootEvidence
from xpu_serve.analysis.rootdeath import primary_gpu_fault, root_evidence
from xpu_serve.analysis.stall import startup_cause, startup_verdict
from xpu_serve.analysis.store import EvidenceStore
from xpu_serve.analysis.stuck import name_stuck_rank
from xpu_serve.analysis.supervised import complete
from xpu_serve.analysis.timeorder import boot, cmp_time
from xpu_serve.analysis.work import Ctx, Work
from xpu_serve.events import Event


def incident(st: EvidenceStore) -> Incident:
    """Analyse everything fed into the store `st` so far; never raises on any input.

    When the input holds several starts of vLLM (a restart after a failure), the verdict is
    about the last incarnation and a note names the earlier incident; when the last
    incarnation shows no failure, the verdict is the earlier incident's (with a note)."""
    cx = Ctx.of(st)
    inc = last_start(cx)
    if st.trigger is not None:
        complete(inc, st.trigger, st.table)
    return inc


def last_start(cx: Ctx) -> Incident:
    """The verdict of the last start of vLLM in the input (see `incident`)."""
    inc = verdict(cx)
    prev = cx.st._earlier
    if prev is None or cx.st._restart_at is None:
        return inc
    pinc = verdict(Ctx.of(prev))
    file, line = cx.st._restart_at
    again = f"vLLM started again at {file} line {line}" + (
        f" ({cx.st.restarts} restarts in the input)" if cx.st.restarts > 1 else ""
    )
    assumed = any("a stall is assumed" in n for n in inc.notes)
    if inc.cause == "unknown" or (assumed and pinc.cause != "unknown"):
        pinc.notes.append(f"{again} after this incident; the later start shows no failure")
        pinc.lines_read, pinc.files = inc.lines_read, inc.files
        return pinc
    inc.notes.append(
        f"an earlier incident in the input ({pinc.cause}: {pinc.summary}) was followed by a restart; "
        f"{again}: this verdict is about the last start"
    )
    return inc


def verdict(cx: Ctx) -> Incident:
    """The verdict of the store's last start (without the trigger's completion): the cause
    rules in order, then the description of the root, the hang and the stall."""
    refresh(cx)
    v = Work(Incident(lines_read=cx.st.lines, files=list(cx.st._files)))
    v.cands, v.demoted = demote(cx, candidates(cx))
    for rule in CAUSE_RULES:
        rule(cx, v)
    if v.cause is None:
        return unknown(cx, v)
    v.inc.cause = v.cause
    describe_root(cx, v)
    if v.cause == "startup-hang":
        startup_verdict(cx, v)
    if v.cause == "engine-hang" or (v.root is not None and v.root.cause in ("engine-hang", "startup-hang")):
        hang_verdict(cx, v)
        name_stuck_rank(v.inc, cx.st.rank_states, cx.parts.root_of)
    finish(cx, v)
    return v.inc


def refresh(cx: Ctx) -> None:
    """Parse the kept raw stats lines; late pid -> rank knowledge for milestone pids."""
    cx.st.last_progress = cx.st._ref_event(cx.st.last_progress)
    cx.st.last_stats = cx.st._ref_event(cx.st.last_stats)
    cx.st.stall_stats = cx.st._ref_event(cx.st.stall_stats)
    for ms in cx.st.milestones.values():
        for pid in list(ms.pids):
            if pid in cx.st.pid_rank:
                ms.ranks.add(cx.st.pid_rank[pid])


def candidates(cx: Ctx) -> tuple[list[Event], list[Event]]:
    """(root candidates, demoted): every kept root-role event; a generic exception subsumed by
    a specific row of its traceback is demoted at once."""
    cands: list[Event] = []
    demoted: list[Event] = []
    for evs in cx.st.roots.values():
        for ev in evs:
            if ev.role != "root":
                continue
            (demoted if ev.extra.get("subsumed") else cands).append(ev)
    return cands, demoted


def demote(cx: Ctx, got: tuple[list[Event], list[Event]]) -> tuple[list[Event], list[Event]]:
    """The demotion rules of data/rules.yaml, in order (analysis/demote.py)."""
    seen = frozenset(cx.st.roots) | {g.sig.id for g in cx.st.groups.values()}
    c = Candidates(got[0], got[1], seen)
    for rule in cx.st.rules.demote:
        apply_demote(rule, c, cx.st.table, cx.st.rules)
    return c.keep, c.demoted


def rank_key(cx: Ctx, a: Event, b: Event) -> int:
    """Root candidates by the row's weight (higher first), then time, then process (a
    worker's own record beats EngineCore's re-raise of it at the same time)."""
    wa = cx.st.table.by_id[a.signature or ""].weight
    wb = cx.st.table.by_id[b.signature or ""].weight
    if wa != wb:
        return -1 if wa > wb else 1
    c = cmp_time(a, b)
    if c:
        return c
    return (cx.subj.proc_pref(a) > cx.subj.proc_pref(b)) - (cx.subj.proc_pref(a) < cx.subj.proc_pref(b))


def rank(cx: Ctx, v: Work) -> None:
    """The first-ranked candidate, the outrank rules, and the GPU fault that opened its burst."""
    kernel_gpu = [e for e in v.cands if e.cause == "gpu-fault" and e.source == "kernel"]
    v.cands.sort(key=cmp_to_key(functools.partial(rank_key, cx)))
    root = v.cands[0] if v.cands else None
    for rule in cx.st.rules.outrank:
        if root is not None:
            root = apply_outrank(rule, root, v.cands, cx.st.table, cx.st.rules)
    v.subject_ev = root
    if root is not None and root.source == "kernel" and root.cause == "gpu-fault":
        first = primary_gpu_fault(cx, root, kernel_gpu)
        if first is not None:
            # the fault that started the burst is the root; the record naming the process (the
            # timed-out job) still tells whose context it was
            if first.pid is not None or first.extra.get("pid") or first.process:
                v.subject_ev = first
            root = first
    if root is not None:
        v.inc.notes.extend(outrank_notes(root, v.cands, cx.st.table, cx.st.rules))
    v.root = v.tl_root = root
    v.cause = root.cause if root is not None else None


def unknown(cx: Ctx, v: Work) -> Incident:
    """No verdict: say why (start-up failed without its error, ended early, empty input)."""
    inc, notes = v.inc, v.inc.notes
    inc.cause = "unknown"
    if cx.st.milestones and not cx.st.ready:
        if cx.st.groups or v.demoted:
            notes.append(
                "start-up failed (consequences are in the input) but the error that caused it is not"
            )
        else:
            last = v.startup_info.last_milestone if v.startup_info is not None else None
            notes.append(
                f"the input ends during start-up (after {last}) without an error and without a stall"
            )
    if cx.st.lines == 0 and not cx.st.roots:
        notes.append("the input is empty")
    inc.consequence_groups = cx.parts.consequence_groups(None, v.demoted)
    inc.consequences = [g.consequence() for g in inc.consequence_groups]
    inc.timeline = cx.parts.timeline(None, v.demoted)
    return inc


def describe_root(cx: Ctx, v: Work) -> None:
    """The root's subject, label, meaning and advice (a row's), or those of a hang."""
    inc, root = v.inc, v.root
    if root is not None:
        sig = cx.st.table.by_id[root.signature or ""]
        inc.root_label = sig.label
        inc.meaning, inc.advice = sig.meaning, sig.advice
        proc, rank, pid = cx.subj.subject(v.subject_ev or root, inc.notes)
        inc.root = cx.parts.root_of(root, proc, rank, pid)
        lib = root.extra.get("library")
        if isinstance(lib, str) and v.cause in ("umd-segfault", "collective-failure", "process-crash"):
            inc.library = lib
    elif v.cause == "startup-hang":
        sig = cx.st.table.by_id[cx.st._row["startup_stall"]]
        inc.meaning, inc.advice, inc.root_label = sig.meaning, sig.advice, sig.label
    else:
        inc.meaning = "The engine stopped making progress with requests in flight; no process died first."
        inc.advice = "Take stacks of every worker (py-spy dump) before restarting; check the kernel log for GPU job timeouts."
        inc.root_label = "no progress with requests in flight"
    if root is not None and boot(root) is not None and cx.st._last_t:
        inc.notes.append(
            "kernel times are seconds since boot and the input gives no boot time: the kernel "
            "records could not be placed on the vLLM log's clock (order by meaning only)"
        )


def finish(cx: Ctx, v: Work) -> None:
    """The root's evidence, the consequence groups, the timeline and the summary."""
    inc, root = v.inc, v.root
    evidence: list[Event] = []
    if root is not None and inc.root is not None and v.cause not in ("engine-hang", "startup-hang"):
        evidence = root_evidence(cx, root, inc.root, v.cands + v.demoted)
        found = tuple(
            RootEvidence(
                e.signature,
                cx.st.table.by_id[e.signature or ""].label,
                e.time_text,
                e.file,
                e.line,
                e.text.strip()[:500],
            )
            for e in evidence
        )
        inc.root = dataclasses.replace(inc.root, evidence=found)
    ev_ids = {id(e) for e in evidence}
    inc.consequence_groups = cx.parts.consequence_groups(root, v.demoted, ev_ids)
    inc.consequences = [g.consequence() for g in inc.consequence_groups]
    inc.timeline = cx.parts.timeline(v.tl_root, v.demoted, evidence)
    inc.summary = cx.parts.summary(inc, root, evidence)


# the rules that find the root and the cause, in order: each reads and refines `Work.cause`
CAUSE_RULES: tuple[Callable[[Ctx, Work], None], ...] = (rank, hang_cause, startup_cause)
