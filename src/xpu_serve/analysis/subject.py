"""Whose record is it: the (process, rank, pid) a record is about, linking the pids and names
vLLM's prefixes print ("(Worker_TP1 pid=4242)") with the kernel's pid and comm (cut to 15 bytes;
a container shows host pids) and the reports of a death that name another process.

`Subjects` reads the evidence store's pid maps and kept records (analysis/store.py); each step
below handles one kind of record and returns None when it does not apply.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cmp_to_key

from xpu_serve.analysis.deaths import WORKER_RE, abnormal_death, death_signal, normalize_process
from xpu_serve.analysis.store import EvidenceStore
from xpu_serve.analysis.timeorder import cmp_time
from xpu_serve.events import Event

Subject = tuple["str | None", "int | None", "int | None"]


class Subjects:
    """The subject of a record in the evidence store `st` (see the module docstring)."""

    __slots__ = ("st",)

    def __init__(self, st: EvidenceStore) -> None:
        self.st = st

    def rank_pid(self, rank: int) -> int | None:
        for p, r in self.st.pid_rank.items():
            if r == rank:
                return p
        return None

    def proc_pref(self, ev: Event) -> int:
        """Tie-break among root candidates of one weight and time: a worker's own record first."""
        name = ev.process or (self.st.pid_name.get(ev.pid) if ev.pid else None) or ""
        if "Worker" in name:
            return 0
        if name.startswith("EngineCore"):
            return 1
        if name.startswith("APIServer"):
            return 3
        return 2

    def _died_reports(self) -> list[Event]:
        out = []
        for sid in self.st.rules.death_reports:
            out.extend(self.st.roots.get(sid, []))
        out.sort(key=cmp_to_key(cmp_time))
        return out

    def _first_live_death(self) -> Event | None:
        """The earliest death by a crash signal the supervisor itself saw (pidfd exit time), or
        None (offline input, or only exit codes)."""
        live = [e for e in self.st.roots.get(self.st._row["live_death"], []) if e.source == "process"]
        live = [e for e in live if abnormal_death(e)]
        return min(live, key=cmp_to_key(cmp_time)) if live else None

    def _died_rank(self) -> tuple[int | None, Event | None]:
        for d in self._died_reports():
            w = d.extra.get("worker") or d.extra.get("proc") or ""
            m = WORKER_RE.search(str(w))
            if m:
                return int(m.group(1)), d
            if d.pid is not None and d.pid in self.st.pid_rank and d.signature not in self.st._set["reporter_pid"]:
                return self.st.pid_rank[d.pid], d
        return None, None

    def subject(self, ev: Event, notes: list[str], link: bool = True) -> Subject:
        """(process, rank, pid) the event is about, linking pids and names; `link` allows linking
        by name and order (only for the root: a surviving rank's teardown dump is not the dead one)."""
        steps: tuple[Callable[[Event], Subject | None], ...] = (
            self._subject_named_worker,
            self._subject_unnamed_worker,
            self._subject_pid_in_message,
            self._subject_reported,
        )
        for step in steps:
            got = step(ev)
            if got is not None:
                return got
        if ev.source == "kernel" or ev.signature in self.st._set["kernel_pid"]:
            return self._subject_kernel(ev, notes, link)
        return self._subject_logged(ev, notes, link)

    def _subject_named_worker(self, ev: Event) -> Subject | None:
        """vLLM's report of another process's death names that process."""
        w = ev.extra.get("worker")
        if not isinstance(w, str) or ev.signature not in self.st._set["worker_death_reports"]:
            return None
        m = WORKER_RE.search(w)
        if m:
            r = int(m.group(1))
            return f"Worker_TP{r}", r, self.rank_pid(r)
        pid = int(str(ev.extra["pid"])) if ev.extra.get("pid") else None
        r2 = self.st.pid_rank.get(pid) if pid is not None else None
        return normalize_process("Worker", r2), r2, pid

    def _subject_unnamed_worker(self, ev: Event) -> Subject | None:
        """EngineCore's report that a worker failed in start-up names none: the worker, when the
        input shows one worker process (its name as its prefix printed it), else any worker."""
        if ev.signature not in self.st._set["bare_failure_reports"]:
            return None
        workers = [(p, n) for p, n in self.st.pid_name.items() if "Worker" in n]
        if len(workers) != 1:
            return "Worker", None, None
        pid, name = workers[0]
        return normalize_process(name), self.st.pid_rank.get(pid), pid

    def _subject_pid_in_message(self, ev: Event) -> Subject | None:
        """The dead process's pid inside the message (bash's job report "run.sh: line 12: 40211
        Segmentation fault (core dumped) python ...", the raylet's report of a dead worker)."""
        pim = self.st.rules.pid_in_message
        sid = ev.signature or ""
        if sid not in pim or not ev.extra.get("pid"):
            return None
        pid = int(str(ev.extra["pid"]))
        r3 = self.st.pid_rank.get(pid)
        return normalize_process(self.st.pid_name.get(pid, pim[sid]), r3), r3, pid

    def _subject_reported(self, ev: Event) -> Subject | None:
        """The API server's report of EngineCore's death; a launcher's report of its child (its
        prefix pid, "systemd[1]:", is the launcher's); a supervisor fact names its process."""
        if ev.signature in self.st._set["engine_core_reports"]:
            pid = next((p for p, n in self.st.pid_name.items() if n.startswith("EngineCore")), None)
            return "EngineCore", None, pid
        if ev.signature in self.st._set["launcher_reports"]:
            return None, None, None
        if ev.source == "process" and ev.process:
            return normalize_process(ev.process, ev.rank), ev.rank, ev.pid
        return None

    def _subject_kernel(self, ev: Event, notes: list[str], link: bool) -> Subject:
        """A kernel record (or a core dump report): its pid and comm, linked to a logged pid, or
        (`link`) by name and order to the worker vLLM reported dead."""
        pid = ev.pid
        if pid is None and ev.extra.get("pid"):
            pid = int(str(ev.extra["pid"]))
        comm = ev.process or str(ev.extra.get("comm") or "")
        if pid is not None and (pid in self.st.pid_rank or pid in self.st.pid_name):
            rk = self.st.pid_rank.get(pid)
            kname = normalize_process(self.st.pid_name.get(pid, comm), rk)
            notes.append(f"kernel pid {pid} ({comm}) matches the logged pid of {kname}")
            return kname, rk, pid
        if link and not comm.startswith(("VLLM::EngineCor", "vllm")):
            # any comm: worker threads carry other names ("pt_main_thread", "python3")
            r, _ = self._died_rank()
            if r is not None:
                notes.append(
                    f"kernel pid {pid} ({comm or 'unknown comm'}) matches no pid in the vLLM log (another pid "
                    f"namespace, e.g. a container); linked to Worker_TP{r} by name and order: it is the worker "
                    f"vLLM reported dead"
                )
                return f"Worker_TP{r}", r, pid
            if pid is not None:
                notes.append(f"kernel pid {pid} ({comm}) could not be linked to a vLLM process")
            return normalize_process(comm, None) if comm.startswith("VLLM::") else comm or None, None, pid
        if comm.startswith("VLLM::EngineCor"):
            return "EngineCore", None, pid
        return comm or None, None, pid

    def _subject_logged(self, ev: Event, notes: list[str], link: bool) -> Subject:
        """A logged line: its prefix's process and rank; EngineCore relaying a worker's error names
        the worker; a crash dump without a prefix is linked to the first death."""
        pid = ev.pid
        rank = ev.rank if ev.rank is not None else (self.st.pid_rank.get(pid) if pid is not None else None)
        name = ev.process or (self.st.pid_name.get(pid) if pid is not None else None)
        if ev.source == "ccl" and name is None and pid is not None and rank is not None:
            name = f"Worker_TP{rank}"
        if link and self.st.rules.relay.search(ev.text) and (name or "").startswith("EngineCore"):
            r, _ = self._died_rank()
            if r is not None:
                notes.append(
                    f"EngineCore re-raised a worker's error; linked to Worker_TP{r}, the worker vLLM reported dead"
                )
                return f"Worker_TP{r}", r, self.rank_pid(r)
            notes.append("EngineCore re-raised a worker's error; the worker's rank is not in the input")
            return "Worker", None, None
        if link and name is None and ev.signature in self.st._set["unprefixed_linkable"]:
            return self._subject_unprefixed(ev, notes)
        return normalize_process(name, rank), rank, pid

    def _subject_unprefixed(self, ev: Event, notes: list[str]) -> Subject:
        """A crash dump without a process prefix: the first process the supervisor saw die by the
        same signal, else the worker vLLM reported dead right after."""
        live = self._first_live_death()
        if live is not None and live.process and death_signal(live) == death_signal(ev):
            notes.append(
                f"the crash dump carries no process prefix; linked to {live.process}: the first "
                f"process the supervisor saw die, by the same signal"
            )
            return live.process, live.rank, live.pid
        r, _ = self._died_rank()
        if r is not None:
            notes.append(
                f"the crash dump carries no process prefix; linked to Worker_TP{r} by order: "
                f"vLLM reported that worker dead right after"
            )
            return f"Worker_TP{r}", r, self.rank_pid(r)
        notes.append("the crash dump carries no process prefix; the process could not be named")
        return None, None, ev.pid
