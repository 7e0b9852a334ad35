"""The verdict: which root candidate is the root cause, what kind of incident it is (a failure,
an engine hang, a start-up stall, or unknown), and the root's own evidence.

Steps, in order: candidates (root-role events kept; a generic exception subsumed by a specific
row is demoted), the demotion rules of data/rules.yaml (analysis/demote.py), ranking by the row's
weight then time then process, the outrank rules, the GPU fault that opened the kernel burst,
then the hang and start-up rules below, the subject and the evidence of the root, and the
contract's parts (analysis/contract.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cmp_to_key
from typing import Any

from xpu_serve.analysis.contract import PHASES, ContractMixin
from xpu_serve.analysis.deaths import death_signal
from xpu_serve.analysis.demote import Candidates, apply_demote, apply_outrank, outrank_notes
from xpu_serve.analysis.incident import Incident
from xpu_serve.analysis.stuck import name_stuck_rank
from xpu_serve.analysis.supervised import complete
from xpu_serve.analysis.timeorder import boot, cmp_time, same_burst
from xpu_serve.events import Event, parse_line

_ENGINE_UP_PHASES = {"engine-ready", "api"}  # the engine finished start-up; the API server follows
_DRM_DEV_RE = re.compile(r"(?:xe|i915|amdgpu) ([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.\d)")


@dataclass
class _Work:
    """A verdict being made: the incident so far and what the steps found."""

    inc: Incident
    cands: list[Event] = field(default_factory=list)
    demoted: list[Event] = field(default_factory=list)
    root: Event | None = None
    subject_ev: Event | None = None  # the record that names the root's process
    tl_root: Event | None = None  # the timeline's root
    cause: str | None = None
    hang_precursors: list[Event] = field(default_factory=list)
    startup_waits: list[Event] = field(default_factory=list)
    n_waits: int = 0
    startup_info: dict[str, Any] = field(default_factory=dict)


class VerdictMixin(ContractMixin):
    """The verdict over the evidence store (see the module docstring)."""

    def incident(self) -> Incident:
        """Analyse everything fed so far; never raises on any input.

        When the input holds several starts of vLLM (a restart after a failure), the verdict is
        about the last incarnation and a note names the earlier incident; when the last
        incarnation shows no failure, the verdict is the earlier incident's (with a note)."""
        inc = self._last_start()
        if self.trigger is not None:
            complete(inc, self.trigger, self.table)
        return inc

    def _last_start(self) -> Incident:
        """The verdict of the last start of vLLM in the input (see `incident`)."""
        inc = self._incident()
        prev = self._earlier
        if prev is None or self._restart_at is None:
            return inc
        pinc = prev._incident()
        file, line = self._restart_at
        again = f"vLLM started again at {file} line {line}" + (
            f" ({self.restarts} restarts in the input)" if self.restarts > 1 else ""
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

    def _waits_after_startup_progress(self, waits: list[Event]) -> list[Event]:
        """The engine's no-progress warnings (shm_broadcast's "No available shared memory broadcast
        block found in 60 seconds"...) not followed by a later start-up milestone: a wait that start-up
        then moved on from was long start-up work (graph capture, KV-cache profiling, torch.compile,
        weight loading), not a stall. [] stays []; without milestones the list is returned as is."""
        if not waits or not self.milestones:
            return waits
        last_ms = max((ms["last"] for ms in self.milestones.values()), key=cmp_to_key(cmp_time))
        return [e for e in waits if cmp_time(e, last_ms) >= 0]

    def _candidates(self) -> tuple[list[Event], list[Event]]:
        """(root candidates, demoted): every kept root-role event; a generic exception subsumed by
        a specific row of its traceback is demoted at once."""
        cands: list[Event] = []
        demoted: list[Event] = []
        for evs in self.roots.values():
            for ev in evs:
                if ev.role != "root":
                    continue
                (demoted if ev.extra.get("subsumed") else cands).append(ev)
        return cands, demoted

    def _demote(self, got: tuple[list[Event], list[Event]]) -> tuple[list[Event], list[Event]]:
        """The demotion rules of data/rules.yaml, in order (analysis/demote.py)."""
        seen = frozenset(self.roots) | {g.sig.id for g in self.groups.values()}
        c = Candidates(got[0], got[1], seen)
        for rule in self.rules.demote:
            apply_demote(rule, c, self.table, self.rules)
        return c.keep, c.demoted

    def _incident(self) -> Incident:
        self._refresh()
        v = _Work(Incident(lines_read=self.lines, files=list(self._files)))
        v.cands, v.demoted = self._demote(self._candidates())
        self._rank(v)
        self._hang_cause(v)
        self._startup_cause(v)
        if v.cause is None:
            return self._unknown(v)
        v.inc.cause = v.cause
        self._describe_root(v)
        if v.cause == "startup-hang":
            self._startup_verdict(v)
        if v.cause == "engine-hang" or (
            v.root is not None and v.root.cause in ("engine-hang", "startup-hang")
        ):
            self._hang_verdict(v)
        self._finish(v)
        return v.inc

    def _refresh(self) -> None:
        """Parse the kept raw stats lines; late pid -> rank knowledge for milestone pids."""
        self.last_progress = self._ref_event(self.last_progress)
        self.last_stats = self._ref_event(self.last_stats)
        self.stall_stats = self._ref_event(self.stall_stats)
        for ms in self.milestones.values():
            for pid in list(ms["pids"]):
                if pid in self.pid_rank:
                    ms["ranks"].add(self.pid_rank[pid])

    def _rank_key(self, a: Event, b: Event) -> int:
        """Root candidates by the row's weight (higher first), then time, then process (a
        worker's own record beats EngineCore's re-raise of it at the same time)."""
        wa = self.table.by_id[a.signature or ""].weight
        wb = self.table.by_id[b.signature or ""].weight
        if wa != wb:
            return -1 if wa > wb else 1
        c = cmp_time(a, b)
        if c:
            return c
        return (self._proc_pref(a) > self._proc_pref(b)) - (self._proc_pref(a) < self._proc_pref(b))

    def _rank(self, v: _Work) -> None:
        """The first-ranked candidate, the outrank rules, and the GPU fault that opened its burst."""
        kernel_gpu = [e for e in v.cands if e.cause == "gpu-fault" and e.source == "kernel"]
        v.cands.sort(key=cmp_to_key(self._rank_key))
        root = v.cands[0] if v.cands else None
        for rule in self.rules.outrank:
            if root is not None:
                root = apply_outrank(rule, root, v.cands, self.table, self.rules)
        v.subject_ev = root
        if root is not None and root.source == "kernel" and root.cause == "gpu-fault":
            first = self._primary_gpu_fault(root, kernel_gpu)
            if first is not None:
                # the fault that started the burst is the root; the record naming the process (the
                # timed-out job) still tells whose context it was
                if first.pid is not None or first.extra.get("pid") or first.process:
                    v.subject_ev = first
                root = first
        if root is not None:
            v.inc.notes.extend(outrank_notes(root, v.cands, self.table, self.rules))
        v.root = v.tl_root = root
        v.cause = root.cause if root is not None else None

    def _hang_cause(self, v: _Work) -> None:
        """The engine's hang detections and waits; a serving engine without a root whose stats
        show no progress with work, or that waited after its last progress, hangs."""
        waits = [
            e
            for sid, evs in self.precursors.items()
            for e in evs
            if self.table.by_id[sid].cause == "engine-hang" and sid not in self._set["not_hang_detection"]
        ]
        waits = self._waits_after_startup_progress(waits)
        if v.root is None and self.ready:
            lp = self.last_progress
            late_waits = [e for e in waits if lp is None or cmp_time(lp, e) < 0]
            if self.stall_stats is not None or late_waits:
                v.cause = "engine-hang"
            waits = late_waits or waits
        v.hang_precursors = waits

    def _startup_waits(self, v: _Work) -> None:
        """The API server waiting, again and again, for the engine core to come up; waits
        followed by a later start-up milestone were the ordinary wait of a start-up that then
        moved on (the front end polls while the engine loads): not a stall."""
        waits = [
            e
            for sid, evs in self.precursors.items()
            for e in evs
            if self.table.by_id[sid].cause == "startup-hang"
        ]
        waits.sort(key=cmp_to_key(cmp_time))
        n = sum(
            n for sid, n in self.precursor_counts.items() if self.table.by_id[sid].cause == "startup-hang"
        )
        if waits and self.milestones:
            last_ms = max((ms["last"] for ms in self.milestones.values()), key=cmp_to_key(cmp_time))
            if cmp_time(waits[-1], last_ms) < 0:
                waits, n = [], 0
        v.startup_waits, v.n_waits = waits, n

    def _startup_cause(self, v: _Work) -> None:
        """Start-up stalls: repeated waits before any milestone; a hang or lagging ranks before
        ready; an input that ends in start-up without an error before the engine was up."""
        v.startup_info = info = self._startup_info()
        self._startup_waits(v)
        if not self.ready and v.cause is None and not self.milestones and v.n_waits >= 2:
            v.cause = "startup-hang"
        if (
            v.root is None
            and v.cause is None
            and not self.ready
            and not self.milestones
            and len(v.hang_precursors) >= 2
        ):
            # only the engine's repeated no-progress warnings were pasted (no start-up line, no
            # ready line): people paste those when a serving engine hangs; a stall during start-up
            # shows its start-up lines (handled above as startup-hang)
            v.cause = "engine-hang"
        if not self.ready and v.cause in (None, "engine-hang") and self.milestones:
            if v.cause == "engine-hang" or info.get("missing_ranks") or v.hang_precursors or v.n_waits >= 2:
                v.cause = "startup-hang"
            elif not self.groups and not v.demoted and info.get("last_milestone") not in _ENGINE_UP_PHASES:
                # (once the engine reported itself initialised, the rest of start-up is the API
                # server's few seconds: a log ending there was cut short, not evidence of a stall)
                v.cause = "startup-hang"
                v.inc.notes.append(
                    "the input ends during start-up without an error and without the ready line; no rank "
                    "lags behind the others: a stall is assumed (or the log was cut short)"
                )
        if v.root is not None and v.root.signature == self._row["startup_stall"]:
            v.cause = "startup-hang"

    def _unknown(self, v: _Work) -> Incident:
        """No verdict: say why (start-up failed without its error, ended early, empty input)."""
        inc, notes = v.inc, v.inc.notes
        inc.cause = "unknown"
        if self.milestones and not self.ready:
            if self.groups or v.demoted:
                notes.append(
                    "start-up failed (consequences are in the input) but the error that caused it is not"
                )
            else:
                notes.append(
                    f"the input ends during start-up (after {v.startup_info.get('last_milestone')}) without "
                    "an error and without a stall"
                )
        if self.lines == 0 and not self.roots:
            notes.append("the input is empty")
        inc.consequence_groups = self._consequence_groups(None, v.demoted)
        inc.consequences = [g.to_contract() for g in inc.consequence_groups]
        inc.timeline = self._timeline(None, v.demoted)
        return inc

    def _describe_root(self, v: _Work) -> None:
        """The root's subject, label, meaning and advice (a row's), or those of a hang."""
        inc, root = v.inc, v.root
        if root is not None:
            sig = self.table.by_id[root.signature or ""]
            inc.root_label = sig.label
            inc.meaning, inc.advice = sig.meaning, sig.advice
            proc, rank, pid = self._subject(v.subject_ev or root, inc.notes)
            inc.root = self._contract_event(root, proc, rank, pid)
            lib = root.extra.get("library")
            if isinstance(lib, str) and v.cause in ("umd-segfault", "collective-failure", "process-crash"):
                inc.library = lib
        elif v.cause == "startup-hang":
            sig = self.table.by_id[self._row["startup_stall"]]
            inc.meaning, inc.advice, inc.root_label = sig.meaning, sig.advice, sig.label
        else:
            inc.meaning = "The engine stopped making progress with requests in flight; no process died first."
            inc.advice = "Take stacks of every worker (py-spy dump) before restarting; check the kernel log for GPU job timeouts."
            inc.root_label = "no progress with requests in flight"
        if root is not None and boot(root) is not None and self._last_t:
            inc.notes.append(
                "kernel times are seconds since boot and the input gives no boot time: the kernel "
                "records could not be placed on the vLLM log's clock (order by meaning only)"
            )

    def _startup_verdict(self, v: _Work) -> None:
        """A start-up stall's meaning (the lagging ranks) and subject (analysis of _startup_root)."""
        inc, root, info = v.inc, v.root, v.startup_info
        inc.startup = info
        miss = info.get("missing_ranks") or []
        if root is None or root.signature != self._row["startup_stall"]:
            inc.root_label = "start-up stalled"
            if miss:
                inc.meaning = (
                    f"Start-up stopped: rank(s) {', '.join(map(str, miss))} never reached "
                    f"{info.get('missing_phase')} while the others did; nothing failed first."
                )
                inc.advice = (
                    "Take stacks (py-spy dump) of the ranks that did not reach the phase; for ccl-init "
                    "check oneCCL's transport (CCL_ATL_TRANSPORT, CCL_ZE_IPC_EXCHANGE) and the devices "
                    "that rank sees (ZE_AFFINITY_MASK)."
                )
            else:
                inc.meaning = f"Start-up stopped after {info.get('last_milestone')} without an error and without reaching ready."
        if inc.root is None or (root is not None and root.cause != "startup-hang"):
            self._startup_subject(v)

    def _startup_subject(self, v: _Work) -> None:
        inc, root = v.inc, v.root
        inc.root, sr_ev = self._startup_root(v.startup_info, root)
        if sr_ev is not None:
            v.tl_root = sr_ev
        if inc.root is None and v.startup_waits:
            w = v.startup_waits[-1]
            p, r4, pd = self._subject(w, inc.notes, link=False)
            inc.root = self._contract_event(w, p, r4, pd)
            v.tl_root = w
            inc.hang = self._hang(None, v.startup_waits, inc.notes)
        if root is not None:
            inc.notes.append(
                f"{self.table.by_id[root.signature or ''].label} happened before the server was ready"
            )

    def _hang_verdict(self, v: _Work) -> None:
        """Hang facts (last progress, detection, delay); without a root the detection is the subject."""
        inc = v.inc
        inc.hang = self._hang(v.root, v.hang_precursors, inc.notes)
        if inc.root is None and v.cause == "engine-hang":
            det = v.hang_precursors[-1] if v.hang_precursors else self.stall_stats
            if det is not None:
                p, r, pd = self._subject(det, inc.notes)
                inc.root = self._contract_event(det, p, r, pd)
        name_stuck_rank(inc, self.rank_states, self._contract_event)

    def _finish(self, v: _Work) -> None:
        """The root's evidence, the consequence groups, the timeline and the summary."""
        inc, root = v.inc, v.root
        evidence: list[Event] = []
        if root is not None and inc.root is not None and v.cause not in ("engine-hang", "startup-hang"):
            evidence = self._root_evidence(root, inc.root, v.cands + v.demoted)
            inc.root_evidence = [
                {
                    "signature": e.signature,
                    "label": self.table.by_id[e.signature or ""].label,
                    "time": e.time_text,
                    "file": e.file,
                    "line": e.line,
                    "text": e.text.strip()[:500],
                }
                for e in evidence
            ]
            inc.root["evidence"] = inc.root_evidence
        ev_ids = {id(e) for e in evidence}
        inc.consequence_groups = self._consequence_groups(root, v.demoted, ev_ids)
        inc.consequences = [g.to_contract() for g in inc.consequence_groups]
        inc.timeline = self._timeline(v.tl_root, v.demoted, evidence)
        inc.summary = self._summary(inc, root, evidence)

    def _root_evidence(self, root: Event, subj: dict[str, Any], pool: list[Event]) -> list[Event]:
        """Death records of the root's own process (its crash dump, the supervisor's exit fact,
        EngineCore's report of its death), in time order: evidence of the root, not consequences.
        A dump without a process prefix is linked by order (as for the root) and only one is taken,
        so the teardown dumps of the surviving ranks stay consequences."""
        proc, rank, pid = subj.get("process"), subj.get("rank"), subj.get("pid")
        anonymous = proc is None and pid is None
        root_sig = death_signal(root)
        out: list[Event] = []
        seen: set[int] = {id(root)}
        unprefixed = 0
        for ev in sorted(pool, key=cmp_to_key(cmp_time)):
            if id(ev) in seen or ev.signature not in self._set["death_evidence"]:
                continue
            seen.add(id(ev))
            if (
                ev.signature == root.signature
                and ev.file is not None
                and ev.file == root.file
                and ev.line is not None
                and root.line is not None
                and 0 < ev.line - root.line <= 64
                and ev.pid is None
                and ev.process is None
            ):
                out.append(ev)  # the next frames of the root's own crash stack
                continue
            if anonymous:
                continue
            bare = ev.signature in self._set["unprefixed_dumps"] and ev.pid is None and ev.process is None
            p, r, d = self._subject(ev, [], link=bare)
            if d is not None and pid is not None and (ev.source == "kernel") == (root.source == "kernel"):
                same = d == pid  # pids of one namespace (the kernel's, or the log's and the supervisor's)
            else:
                same = p is not None and p == proc and r == rank and (r is not None or p != "Worker")
            if not same:
                continue
            if bare:
                s2 = death_signal(ev)
                if unprefixed or (root_sig and s2 and s2 != root_sig):
                    continue
                unprefixed += 1
            out.append(ev)
        return out

    def _primary_gpu_fault(self, root: Event, kernel_gpu: list[Event]) -> Event | None:
        """The device's own fault record (page fault, CAT error, GuC load/init failure) that opened
        the kernel burst `root` belongs to, when it comes before `root`; else None.

        The xe driver reports a bad access first (xe_gt_pagefault.c "Fault response", "Engine memory
        CAT error"), then bans the context and times the job out (xe_guc_submit.c "Timedout job"),
        resets the engine or the GT and, when that fails, declares the device wedged; i915 reports
        a GuC load failure before "declaring it wedged"; amdgpu reports the ring timeout
        (amdgpu_job.c amdgpu_job_timedout) before its reset and "device wedged". The later records rank higher as root
        candidates because they name the process; causally the first fault is the root."""
        dev = _DRM_DEV_RE.match(root.text)
        best: Event | None = None
        for ev in kernel_gpu:
            if ev is root or ev.signature not in self._burst_openers:
                continue
            d = _DRM_DEV_RE.match(ev.text)
            if dev is not None and d is not None and d.group(1) != dev.group(1):
                continue
            if not same_burst(ev, root) or cmp_time(ev, root) > 0:
                continue
            if cmp_time(ev, root) == 0 and (ev.file != root.file or (ev.line or 0) >= (root.line or 0)):
                continue
            if (
                best is None
                or cmp_time(ev, best) < 0
                or (cmp_time(ev, best) == 0 and ev.file == best.file and (ev.line or 0) < (best.line or 0))
            ):
                best = ev
        return best

    def _startup_info(self) -> dict[str, Any]:
        if not self.milestones:
            return {}
        order = {p: i for i, p in enumerate(PHASES)}
        reached = sorted(self.milestones, key=lambda p: order.get(p, -1))
        last = reached[-1]
        expected: set[int] = set(range(self.world_size)) if self.world_size else set()
        for ms in self.milestones.values():
            expected |= ms["ranks"]
        missing: list[int] = []
        phase_for_missing = None
        for p in reversed(reached):
            ms = self.milestones[p]
            if ms["per_rank"] and expected:
                miss = sorted(expected - ms["ranks"])
                if miss:
                    missing, phase_for_missing = miss, p
                break
        return {
            "last_milestone": last,
            "last_milestone_event": self.milestones[last]["last"],
            "missing_ranks": missing,
            "missing_phase": phase_for_missing,
            "world_size": self.world_size,
        }

    def _startup_root(
        self, info: dict[str, Any], root: Event | None
    ) -> tuple[dict[str, Any] | None, Event | None]:
        """The start-up stall's subject: the first rank that did not reach the last per-rank
        milestone (its last line), else the stall's own root, else the last milestone."""
        missing = info.get("missing_ranks") or []
        if missing:
            r = missing[0]
            pid = self._rank_pid(r)
            raw = self.pid_last_raw.get(pid) if pid is not None else None
            if raw is not None:
                last = parse_line(raw[0], raw[1], raw[2])
                last.extra["_order"] = 0
                if last.time is not None:
                    t = last.time
                    last.extra["_tkey"] = (t.month, t.day, t.hour, t.minute, t.second, t.microsecond)
                return self._contract_event(last, f"Worker_TP{r}", r, pid), last
            ev = info.get("last_milestone_event")
            return (self._contract_event(ev, f"Worker_TP{r}", r, pid) if ev else None), None
        if root is not None:
            p, r2, pd = self._subject(root, [], link=False)
            return self._contract_event(root, p, r2, pd), root
        ev = info.get("last_milestone_event")
        if ev is None:
            return None, None
        p, r3, pd = self._subject(ev, [], link=False)
        return self._contract_event(ev, p, r3, pd), ev

    def _hang(self, root: Event | None, precursors: list[Event], notes: list[str]) -> dict[str, Any]:
        last = self.last_progress
        lp = None
        if self.facts_hang is not None and self.facts_hang.extra.get("last_progress"):
            lp = str(self.facts_hang.extra["last_progress"])
        if lp is None and last is not None:
            lp = last.time_text
        det = root if root is not None and root.cause in ("engine-hang", "startup-hang") else None
        if det is None and precursors:
            det = precursors[-1]
        detected_by = None
        if det is not None:
            sig = self.table.by_id[det.signature or ""]
            detected_by = (
                (det.extra.get("detected_by") if det.source == "health" else None)
                or sig.detected_by
                or sig.label
            )
        out: dict[str, Any] = {
            "last_progress": lp,
            "detected_at": det.time_text if det is not None else None,
            "detected_by": detected_by,
        }
        if last is not None and det is not None and last.time and det.time and det.source == last.source:
            delay = (det.time - last.time).total_seconds()
            if delay >= 0:
                out["delay_s"] = delay
        elif lp is None:
            notes.append(
                "no progress line (stats with non-zero throughput) in the input: last progress unknown"
            )
        if self.stall_stats is not None:
            out["no_progress_since"] = self.stall_stats.time_text
        first_wait = self.precursors.get(self._row["first_wait"])
        if first_wait:
            out["first_wait_warning"] = first_wait[0].time_text
        return out
