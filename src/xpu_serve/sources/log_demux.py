"""Demultiplexing of vLLM's combined output by process: which per-process file a line goes to.

Lines carry vLLM's prefix ``(Name pid=N) `` (vllm/utils `decorate_logs`/`_add_prefix`; parsed
with `xpu_serve.events.split_process_prefix`, innermost prefix wins) and go to ``<Name>.log``
(``APIServer``, ``EngineCore`` for ``EngineCore_DP0`` too, ``Worker_TP0``...). Early
``(Worker pid=N)`` lines (vllm/v1/executor/multiproc_executor.py names the process "Worker"
until `setup_proc_title_and_log_prefix` adds ``_TPn``; vLLM 0.32 first uses multiprocessing's
``VllmWorker-<rank>``) are held per pid and go to that pid's ``Worker_TPn`` once a prefixed line
reveals it; if none does within the timeout (TP=1: the name stays "Worker") or past 1 MiB held,
they go to ``Worker``. oneCCL lines (``YYYY:MM:DD-HH:MM:SS: PID |CCL_WARN| ...``,
``...: PID:[rank] |CCL_...``, ``...:PID |CCL_...``, ``...:(  PID) |CCL_...``, shapes seen in real
logs) go to the process with that pid, held like the above, then ``unprefixed`` if the pid stays
unknown. Everything else (native crash dumps, uvicorn, Python warnings, launcher tracebacks) goes
to ``unprefixed``. Names are process names; the writer makes them file names.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from xpu_serve.events import split_process_prefix

_PENDING_CAP_BYTES = 1 << 20  # per pid, held Worker/oneCCL lines before forced resolution

# oneCCL's log line prefix, as seen in the real logs of tests/fixtures/cases
# (qwen3-30b-worker0-died, b70-worker0-died-ccl, b60-out-of-resources): "YYYY:MM:DD-HH:MM:SS:"
# then the pid as " PID", "PID", " PID:[rank]" or "(  PID)" (width-padded), then " |CCL_LEVEL|".
_CCL_RE = re.compile(r"\d{4}:\d\d:\d\d-\d\d:\d\d:\d\d:\s*(?:\(\s*(\d+)\)|(\d+))(?::\[\d+\])?\s*\|CCL_")
_EARLY_WORKER_RE = re.compile(r"VllmWorker-\d+$")  # a worker's first prefix (vLLM 0.32)


class Batch:
    """Outputs collected while the writer processes one round of queued items."""

    __slots__ = ("vllm", "vllm_lines", "text", "dest", "echo", "routes", "ccl_routes")

    def __init__(self) -> None:
        self.vllm: list[bytes] = []
        self.vllm_lines = 0
        self.text: list[tuple[int, list[str], int]] = []  # (first lineno, lines, 1; 0: all numbered first)
        self.dest: dict[str, list[str]] = {}  # process name (or "unprefixed") -> lines
        self.echo: list[str] = []
        self.routes: dict[str, list[str]] = {}  # prefix text "(Name pid=N" -> a list in dest
        self.ccl_routes: dict[str, list[str]] = {}  # oneCCL pid text " 7986:[0] " -> a list in dest

    def list_for(self, name: str) -> list[str]:
        lst = self.dest.get(name)
        if lst is None:
            lst = self.dest[name] = []
        return lst


@dataclass
class _Pending:
    since: float
    size: int
    lines: list[str]
    worker: bool  # at least one "(Worker pid=N)" line (else oneCCL lines only)


class Demux:
    """Sorts lines into `Batch.dest` by process; held lines are written through `write_dest`
    (a batch of their own) when their pid is resolved. Writer thread only."""

    def __init__(self, pending_timeout_s: float, write_dest: Callable[[Batch], None]) -> None:
        self.pending_timeout_s = pending_timeout_s
        self._write_dest = write_dest
        self._pid_name: dict[int, str] = {}
        self._pending: dict[int, _Pending] = {}

    def demux(self, out: Batch, tlines: list[str]) -> None:
        """Sort lines into per-process lists (`out.dest`) or hold them (`_pend`).

        Hot loop: a line "(Name pid=N) ..." is routed by its prefix text through
        `out.routes` (prefix -> list), so `split_process_prefix` runs once per distinct
        prefix and batch, not once per line. Nested prefixes always take the slow path.
        """
        routes = out.routes
        ccl_routes = out.ccl_routes
        unpref = out.list_for("unprefixed")
        for line in tlines:
            c = line[:1]
            if c == "(":
                j = line.find(") ")
                if j > 0 and not line.startswith("(", j + 2):
                    lst = routes.get(line[:j])
                    if lst is not None:
                        lst.append(line)
                        continue
                    lst = self._route(out, line)
                    if lst is not None:
                        routes[line[:j]] = lst
                        lst.append(line)
                else:
                    lst = self._route(out, line)
                    if lst is not None:
                        lst.append(line)
            elif c.isdigit() and "|CCL_" in line:
                # Route by the text between the 20-character timestamp and "|CCL_" (" 7986:[0] ").
                key = line[20 : line.find("|CCL_")]
                lst = ccl_routes.get(key)
                if lst is not None:
                    lst.append(line)
                    continue
                m = _CCL_RE.match(line)
                if m is None:
                    unpref.append(line)
                    continue
                pid = int(m.group(1) or m.group(2))
                known = self._pid_name.get(pid)
                if known is None:
                    self._pend(pid, line, worker=False)
                else:
                    lst = ccl_routes[key] = out.list_for(known)
                    lst.append(line)
            else:
                unpref.append(line)

    def _route(self, out: Batch, line: str) -> list[str] | None:
        """Destination list of a prefixed line, or None when the line is held for its pid."""
        name, pid, _ = split_process_prefix(line)
        if name is None or pid is None:
            return out.list_for("unprefixed")
        pid_name = self._pid_name
        if name == "Worker" or _EARLY_WORKER_RE.match(name):
            # vLLM 0.32 names a worker "VllmWorker-<rank>" (multiprocessing's process name) and
            # then "Worker" until setup_proc_title_and_log_prefix adds "_TPn": one file per pid
            known = pid_name.get(pid)  # "Worker" itself once held lines timed out (TP=1)
            if known is None:
                self._pend(pid, line, worker=True)
                return None
            return out.list_for(known)
        if name == "EngineCore_DP0":
            name = "EngineCore"
        if pid_name.get(pid) != name:
            pid_name[pid] = name
            out.routes.clear()  # a pid changed name: cached routes may be stale
            out.ccl_routes.clear()
            held = self._pending.pop(pid, None)
            if held is not None:
                out.list_for(name).extend(held.lines)
        return out.list_for(name)

    def _pend(self, pid: int, line: str, worker: bool) -> None:
        p = self._pending.get(pid)
        if p is None:
            p = self._pending[pid] = _Pending(time.monotonic(), 0, [], worker)
        p.lines.append(line)
        p.size += len(line) + 1
        p.worker = p.worker or worker
        if p.size > _PENDING_CAP_BYTES:
            self._resolve(pid)

    def _resolve(self, pid: int) -> None:
        p = self._pending.pop(pid)
        name = "Worker" if p.worker else "unprefixed"
        if p.worker:
            self._pid_name[pid] = "Worker"  # provisional: a later Worker_TPn prefix overrides
        out = Batch()
        out.dest[name] = p.lines
        self._write_dest(out)

    def expire(self, now: float) -> None:
        """Write out the lines held longer than `pending_timeout_s` (monotonic `now`)."""
        for pid in [pid for pid, p in self._pending.items() if now - p.since >= self.pending_timeout_s]:
            self._resolve(pid)

    def finish(self) -> None:
        """All streams at EOF: write out every held line."""
        for pid in list(self._pending):
            self._resolve(pid)
