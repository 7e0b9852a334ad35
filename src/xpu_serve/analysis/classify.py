"""Classification of one parsed line into the evidence store: the table match (or the root a
consequence quotes), the traceback it belongs to (analysis/traceback.py), and what a kept record
completes or is completed by: a terminate's `what():`, a core dump's frames, a crash dump's first
frame (analysis/crashdump.py), a kernel record's continuation lines, start-up milestones, a
restart of vLLM in the input (`Analyzer.split_incarnation`), copies of a line in several files
(analysis/dedup.py).

The rules here are the domain's (what vLLM, oneCCL and the kernel print), written in code where
they are about the order of lines rather than their shape; the shapes are data/signatures.yaml.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

from xpu_serve.analysis.crashdump import CrashDumps
from xpu_serve.analysis.dedup import Dedup
from xpu_serve.analysis.msghead import MessageHeads
from xpu_serve.analysis.store import MAX_PER_SIGNATURE, EvidenceStore
from xpu_serve.analysis.timeorder import tkey as _tkey
from xpu_serve.analysis.traceback import HEADER, Step, TracebackTracker, ray_task_pid
from xpu_serve.events import Event, kernel_message_info, parse_line
from xpu_serve.signatures import Signature

if TYPE_CHECKING:
    from xpu_serve.diagnosis import Analyzer

# the innermost frame of an exception raised by vLLM's command-line parsing or config checks:
# FlexibleArgumentParser.parse_args (vllm/utils), EngineArgs (vllm/engine/arg_utils.py), the
# config dataclasses' checks (vllm/config.py, vllm/config/*.py: __post_init__, verify_*, _verify_*)
# and the model registry's check of the checkpoint's architectures
# (vllm/model_executor/models/registry.py _ModelRegistry._raise_for_unsupported: ValueError
# "Model architectures [...] are not supported for now" / "failed to be inspected"), and the
# platform's checks of the configuration (vllm/platforms/<platform>.py Platform.check_and_update_config,
# verify_*, get_attn_backend_cls: e.g. cpu.py's ValueError "CPU backend only supports V1.")
_CONFIG_FRAME_RE = re.compile(
    r'File "[^"]*(?:", line \d+, in parse_args$|/arg_utils\.py", line \d+, in |'
    r'/config(?:\.py|/\w+\.py)", line \d+, in (?:__post_init__|_?verify\w*|__init__)$|'
    r'/models/registry\.py", line \d+, in _raise_for_unsupported$|'
    r'/vllm/platforms/\w+\.py", line \d+, in (?:check_and_update_config|verify_\w+|get_attn_backend_cls)$)'
)
# how far (lines of the same file) a GPU driver's task-info record may follow its fault record
_TASK_INFO_LINES = 8
# the innermost frame of an exception raised while a GPU kernel was built or JIT-compiled for the
# device: AITER (aiter/jit/core.py build_module, aiter/jit/utils/chip_info.py,
# aiter_meta/csrc/cpp_itfs/utils.py compile_template_op -> validate_and_update_archs), PyTorch's
# torch/utils/cpp_extension.py (load, _get_rocm_arch_flags / _get_cuda_arch_flags), Triton's
# triton/compiler/ and triton/backends/, FlashInfer's flashinfer/jit/. Such an error ("GPU arch
# gfx1201 is not supported") is the kernel library's build failing on this device, not an option
# vLLM rejected: a process exception, as an "invalid device function" / "no kernel image" is.
_BUILD_FRAME_RE = re.compile(
    r'File "[^"]*/(?:aiter/jit/|aiter_meta/csrc/cpp_itfs/|torch/utils/cpp_extension\.py"|'
    r"triton/(?:compiler|backends)/|flashinfer/jit/)"
)
_KEPT_ROLES = frozenset({"root", "precursor", "consequence"})  # roles kept as evidence
_QUIET_LEVELS = frozenset({"INFO", "WARNING", "WARN", "DEBUG"})
_TB_LEVELS = frozenset({"ERROR", "CRITICAL"})  # levels vLLM logs tracebacks at (logger.exception)

# Lines whose text a client controls: uvicorn's access log ('127.0.0.1:51234 - "GET /path?query
# HTTP/1.1" 200 OK', uvicorn/logging.py AccessFormatter; IPv6 as '[::1]:51234 - "...') and vLLM's
# request logger ('Received request ID: prompt: ...', 'Generated response ID: output: ...',
# vllm/entrypoints/logger.py RequestLogger).
# vllm/entrypoints/openai/protocol.py (OpenAIBaseModel.__log_extra_fields__) logs the names of a
# request's unknown fields, which the client chooses: "The following fields were present in the
# request but ignored: {'EngineDeadError'}".
_USER_TEXT_RE = re.compile(
    r'(?:\[?[0-9A-Fa-f:.]+\]?:\d+ - "|Received request |Generated response '
    r"|The following fields were present in the request but ignored)"
)
# the code location of vLLM's OpenAI request handlers (entrypoints/openai/serving_*.py): an
# exception they log is one request's failure (a 400), not the server's
_REQUEST_HANDLER_LOC_RE = re.compile(r"serving(?:_\w+)?\.py:")


def _device(ev: Event) -> str | None:
    """The PCI device a kernel record names (events.kernel_message_info), or None."""
    d = ev.extra.get("device")
    return str(d) if d else None


class Classifier:
    """Classifies the parsed lines and facts of one Analyzer (`st`, its evidence store) and keeps
    what they are evidence of; owns the traceback, crash-dump and copy bookkeeping."""

    def __init__(self, st: Analyzer) -> None:
        self.st = st
        self.table, self.rules, self._row, self._set = st.table, st.rules, st._row, st._set
        self._order = 0
        self.tracker = TracebackTracker(wait_frame_re(st))
        self._tb_last_frame = self.tracker.last_frame  # traceback group -> its latest frame line
        self._group_specific: dict[int, None] = {}  # recent traceback groups with a specific row
        self._pyexc_by_group: dict[int, list[Event]] = {}
        self._group_pid: dict[int, int] = {}  # traceback group -> the pid its Ray task header names
        self.last_kernel: dict[str, tuple[int, Event]] = {}
        self._last_terminate: dict[str, tuple[int, Event]] = {}
        self._last_coredump: dict[str, tuple[int, Event]] = {}
        # the latest kernel root of each (file, device): a task-info record after it names its process
        self._last_gpu_root: dict[tuple[str, str | None], tuple[int, Event]] = {}
        self.dumps = CrashDumps()
        self.dups = Dedup()
        self.heads = MessageHeads(self, _REQUEST_HANDLER_LOC_RE, _CONFIG_FRAME_RE)
        # the restart line's own time (month, day, h, m, s, us) when it has one: kernel records
        # read from another file (dmesg -T, ISO stamps) are placed before or after it by theirs
        self.restart_key: tuple[int, int, int, int, int, int] | None = None

    def reset(self, restart_key: tuple[int, int, int, int, int, int] | None) -> None:
        """A restart of vLLM in the input: forget open tracebacks, dumps and pending records
        (containers emptied in place: the feeding loops hold references)."""
        for d in (
            self._group_specific,
            self._pyexc_by_group,
            self._group_pid,
            self.last_kernel,
            self._last_terminate,
            self._last_coredump,
            self._last_gpu_root,
            self.tracker.streams,
            self.tracker.last_frame,
            self.heads.heads,
        ):
            d.clear()
        self.tracker.check = 0
        self.dumps.reset()
        self.dups.reset()
        self.restart_key = restart_key

    def ingest(self, ev: Event, file: str, lineno: int, fact: bool = False) -> Event | None:
        """Classify the parsed line or fact `ev` (line `lineno` of `file`) and keep it by its
        row's role; returns `ev` when a row matched and it is evidence, else None."""
        self._order += 1
        ev.extra["_order"] = self._order
        if self.dumps.wait:
            self.dumps.frame_line(ev, file, lineno, self.st._last_line.get(file))
        self._carry_time(ev, file)
        if self._kernel_continuation(ev, file, lineno):
            return None
        if ev.source == "kernel":
            self.last_kernel[file] = (lineno, ev)
        self.st._learn_pid(ev)
        self.tracker.expire(self._order)
        in_tb = False
        if ev.source in ("vllm", "text"):
            pid = ev.pid
            head = self.heads.before(ev, file, lineno) if ev.text.startswith(HEADER) else None
            got = self.tracker.read(
                ev,
                (file, pid),
                self._order,
                lambda: after_carets(self.st, pid, file) or (ev.source == "vllm" and ev.level in _TB_LEVELS),
            )
            if got.step is Step.SKIP:
                return None
            if got.step is Step.WAIT_FRAME:
                return ev if self._classify(ev, False, file, lineno) is not None else None
            in_tb = got.in_tb
            if got.group is not None:
                ev.group = got.group
                self.heads.read(got.group, head, in_tb)
                self._task_pid(ev, got.group)
                if not in_tb and ev.text.lstrip().startswith('File "'):
                    self.heads.frame(got.group, ev)
        res = self._classify(ev, in_tb, file, lineno)
        if res is None:
            return None
        return ev

    def _task_pid(self, ev: Event, group: int) -> None:
        """A Ray task-error header names the process that raised (`ray_task_pid`): the unprefixed
        lines of its traceback group are that pid's (at most 4096 groups remembered)."""
        pid = ray_task_pid(ev.text)
        if pid is not None:
            if len(self._group_pid) >= 4096:
                del self._group_pid[next(iter(self._group_pid))]
            self._group_pid[group] = pid
        elif ev.pid is None and group in self._group_pid:
            ev.pid = self._group_pid[group]

    def _carry_time(self, ev: Event, file: str) -> None:
        """Time carried forward per file for lines without their own stamp (ordering only)."""
        t = ev.time
        if t is not None:
            self.st.clock.see(ev)
            if not (ev.source == "kernel" and "boot_s" in ev.extra):
                self.st._last_t[file] = (t.month, t.day, t.hour, t.minute, t.second, t.microsecond)
            return
        prev = self.st._last_line.pop(file, None)
        if prev is not None:
            pe = parse_line(prev)
            pt = pe.time
            if pt is not None and not (pe.source == "kernel" and "boot_s" in pe.extra):
                self.st._last_t[file] = (pt.month, pt.day, pt.hour, pt.minute, pt.second, pt.microsecond)
        if file in self.st._last_t:
            ev.extra["_tkey"] = self.st._last_t[file]

    def _kernel_continuation(self, ev: Event, file: str, lineno: int) -> bool:
        """True when the line continues the kernel record of the previous line (a wrapped paste,
        a multi-line record): appended to it, which is classified again when still unknown."""
        text = ev.text
        if not (ev.source == "text" and text[:1] in (" ", "\t") and file in self.last_kernel):
            return False
        kl, kev = self.last_kernel[file]
        if kl != lineno - 1 or "Traceback" in text:
            return False
        self.last_kernel[file] = (lineno, kev)
        kev.text = kev.text.rstrip() + " " + text.strip()
        kernel_message_info(kev)
        if kev.signature is None:
            self._classify(kev, False, file, lineno)
        return True

    def _quoted_root(self, ev: Event, start: int, in_tb: bool) -> tuple[Signature, re.Match[str]] | None:
        """The root row matching the text after offset `start` of a consequence line that quotes its
        cause (a `quotes_root` row: "watchdog thread terminated with exception: CUDA error: an illegal
        memory access"), or None. Only a named failure counts: a quoted hang, crash or generic
        exception says no more than the consequence itself."""
        rest = ev.text[start:]
        if len(rest) < 8:
            return None
        m = self.table.match(dataclasses.replace(ev, text=rest), in_tb)
        if (
            m is None
            or m[0].role != "root"
            or m[0].cause in self.rules.unquotable_causes
            or m[0].id == self._row["generic_exception"]
        ):
            return None
        return m

    def _classify(self, ev: Event, in_tb: bool, file: str, lineno: int) -> Signature | None:
        """Match the line against the table and keep it by its row's role; None when no row
        matched or the match is not evidence (a client's text, code, a request's rejection)."""
        m = self._match(ev, in_tb, file, lineno)
        if m is None:
            return None
        sig, gd = m
        owners = self.st.kernel_owners
        if ev.source == "kernel" and owners is not None and owners.foreign(ev, sig.cause):
            return None  # another program's record (analysis/kernel_owner.py): never evidence
        role = sig.role
        if ev.group is not None and sig.id != self._row["generic_exception"] and role in _KEPT_ROLES:
            self._subsume_generic(ev.group)
        if role == "progress":
            if sig.phase in ("args", "api") and self._is_restart(ev, sig, file):
                self.st.split_incarnation(file, lineno, _tkey(ev))
            self.st.note_milestone(ev, sig, gd)
            return sig
        if role == "context":
            if sig.id == self._row["kernel_task_info"]:
                self._task_info(ev, file, lineno)
            if sig.phase == "serving":
                self.st.ready = True
            return sig
        if ev.text.lstrip().startswith("what():"):
            self._what_line(ev, file, lineno, sig)
        if role == "root":
            self._root(ev, sig, file, lineno)
        elif role == "precursor":
            self.st.precursor_counts[sig.id] = self.st.precursor_counts.get(sig.id, 0) + 1
            lst = self.st.precursors.setdefault(sig.id, [])
            if len(lst) < MAX_PER_SIGNATURE:
                lst.append(ev)
            elif sig.id in self._set["keep_latest"] or sig.cause == "startup-hang":
                lst[-1] = ev  # the last wait tells whether start-up moved on after the waits
        else:
            self.st._add_consequence(ev, sig)
        return sig

    def _match(
        self, ev: Event, in_tb: bool, file: str, lineno: int
    ) -> tuple[Signature, dict[str, Any]] | None:
        """The row matching the line (or the root it quotes), its groups copied to the event."""
        if _USER_TEXT_RE.match(ev.text):
            # a request's own text (uvicorn's access line with the path and query, vLLM's request
            # log with the prompt): anyone who reaches the port writes it, so it is never evidence
            # (a GET /x?EngineDeadError must not fail a healthy server)
            return None
        if ev.text.lstrip().startswith("raise ") and "(" in ev.text:
            # a traceback's source line (`raise RuntimeError(f"NCCL error: ...")`) read outside
            # the traceback state (glued records, a paste that lost the frame line): code, not an error
            return None
        m = self.table.match(ev, in_tb)
        if m is None:
            if ev.text.lstrip().startswith("what():"):
                self._what_line(ev, file, lineno, None)
            return None
        sig, mt = m
        if sig.extra.get("quotes_root"):
            quoted = self._quoted_root(ev, mt.end(), in_tb)
            if quoted is not None:
                ev.extra["quoted_by"] = sig.id
                sig, mt = quoted
        if sig.id in self._set["signal_dumps"] and ev.level in _QUIET_LEVELS:
            return None
        generic = sig.id == self._row["generic_exception"]
        if generic and _REQUEST_HANDLER_LOC_RE.match(ev.code_location or ""):
            # logged by an OpenAI request handler (vllm/entrypoints/openai/serving_*.py: "Error in
            # preprocessing prompt inputs" ...): one request was rejected with an HTTP error and
            # the server went on; not a failure of any process
            return None
        if self.st.dedup and sig.role in _KEPT_ROLES and self.dups.duplicate(ev, file):
            return None
        ev.signature, ev.role, ev.cause = sig.id, sig.role, sig.cause
        if ev.group is not None:
            sig = self._by_innermost_frame(ev, sig, generic)
        gd = mt.groupdict()
        for k, v in gd.items():
            if v is not None:
                ev.extra[k] = v
        if ev.rank is None and gd.get("rank"):
            ev.rank = int(gd["rank"])
        return sig, gd

    def _by_innermost_frame(self, ev: Event, sig: Signature, generic: bool) -> Signature:
        """The row (and `ev`'s cause) of an exception line as its traceback's innermost frame
        decides: a generic exception raised by vLLM's argument parsing or config checks is a
        config error (_CONFIG_FRAME_RE); a config error raised inside a GPU kernel build is that
        build's failure, a generic exception (_BUILD_FRAME_RE)."""
        frame = self._tb_last_frame.get(ev.group) if ev.group is not None else None
        if frame is None:
            return sig
        if generic and _CONFIG_FRAME_RE.search(frame):
            # raised while vLLM parsed its command line or checked its configuration
            ev.cause = "config-error"
            ev.extra["config_frame"] = frame
        elif ev.cause == "config-error" and _BUILD_FRAME_RE.search(frame):
            # a kernel build's check of the device failed: the exception, not a rejected option
            sig = self.table.by_id[self._row["generic_exception"]]
            ev.signature, ev.role, ev.cause = sig.id, sig.role, sig.cause
            ev.extra["build_frame"] = frame
        return sig

    def _subsume_generic(self, group: int) -> None:
        """A specific row matched in traceback `group`: its generic exception line is subsumed."""
        gs = self._group_specific
        gs[group] = None
        if len(gs) > 4096:
            del gs[next(iter(gs))]
        for pe in self._pyexc_by_group.get(group, ()):
            pe.extra["subsumed"] = True

    def _root(self, ev: Event, sig: Signature, file: str, lineno: int) -> None:
        """Keep a root candidate; remember what later lines complete (a terminate's what(), a
        core dump's frames, a crash dump's first frame)."""
        if sig.id == self._row["uncaught_cxx"]:
            self._last_terminate[file] = (lineno, ev)
        elif sig.id == self._row["coredump"]:
            self._last_coredump[file] = (lineno, ev)
        elif sig.id == self._row["coredump_frame"]:
            cd = self._last_coredump.get(file)
            if cd is not None and lineno - cd[0] < 400 and ev.pid is None:
                ev.pid = int(str(cd[1].extra.get("pid")))
                ev.process = str(cd[1].extra.get("comm") or "") or None
        if ev.source == "kernel" and sig.cause == "gpu-fault":
            self._last_gpu_root[(file, _device(ev))] = (lineno, ev)
        if sig.id == self._row["hang_fact"]:
            self.st.facts_hang = ev
        elif sig.id in self._set["signal_dumps"]:
            self.dumps.open_dump(ev, file, lineno, sig.id in self._set["native_dumps"])
        if self._before_restart(ev, file):
            # a kernel record from another file, stamped before the last restart: it belongs
            # to the earlier incarnation (a kernel log read after the vLLM log)
            assert self.st._earlier is not None
            self.st._earlier._keep_root(sig.id, ev)
            return
        self.st._keep_root(sig.id, ev)
        if sig.id == self._row["generic_exception"] and ev.group is not None:
            if ev.group in self._group_specific:
                ev.extra["subsumed"] = True
            self._pyexc_by_group.setdefault(ev.group, []).append(ev)

    def _task_info(self, ev: Event, file: str, lineno: int) -> None:
        """A GPU driver's record naming the process (`comm`, `pid` groups) of its fault record
        before it: that record of the same device (and file), at most _TASK_INFO_LINES lines
        back (other programs' lines interleave in a journal), gets the pid and comm when it has
        none. Source of the layouts: the amdgpu-task-info row of data/signatures.yaml."""
        got = self._last_gpu_root.get((file, _device(ev)))
        pid = ev.extra.get("pid")
        if got is None or not pid or lineno - got[0] > _TASK_INFO_LINES:
            return
        root = got[1]
        if root.pid is None and not root.extra.get("pid"):
            root.pid = int(str(pid))
            root.process = str(ev.extra.get("comm") or "") or None

    def _before_restart(self, ev: Event, file: str) -> bool:
        """True for a kernel record read from another file than the one vLLM restarted in whose
        own time stamp is before the restart line's (both wall clocks; seconds since boot cannot
        be placed against vLLM's clock and stay where they were read)."""
        if self.restart_key is None or self.st._earlier is None or ev.source != "kernel":
            return False
        if self.st._restart_at is None or file == self.st._restart_at[0]:
            return False
        k = _tkey(ev)
        return k is not None and k < self.restart_key

    def _is_restart(self, ev: Event, sig: Signature, file: str) -> bool:
        """True when this start-up line begins a new incarnation of vLLM after a failure already
        read from the same file: vLLM's first lines (`vLLM API server version`, `non-default
        args:`) after failure evidence, or a second `Starting vLLM API server` (its first lines
        cut off). Evidence from other files (a dmesg.txt read before the vLLM log) never splits."""
        if sig.phase == "api" and (
            "Starting vLLM API server" not in ev.text or not ({"api", "ready"} & self.st.milestones.keys())
        ):
            return False
        return self.st.has_failure(file)

    def _what_line(self, ev: Event, file: str, lineno: int, sig: Signature | None) -> None:
        """A C++ `what():` line completes the `terminate called ...` two lines above it: if it is
        a known teardown error, the terminate is a consequence too."""
        t = self._last_terminate.get(file)
        if not t or lineno - t[0] > 3:
            return
        tev = t[1]
        tev.extra["what"] = ev.text.strip()[7:].strip()
        if tev.role == "root" and tev.cause == "process-crash" and tev.extra["what"]:
            # the escaped exception says what failed: the process died of that exception (its
            # cause when a row knows it, else an exception), and std::terminate's SIGABRT
            # follows from it (the demotion rules of data/rules.yaml)
            if sig is None:
                tev.cause = "process-exception"
            elif sig.role == "root" and sig.cause is not None:
                tev.cause = sig.cause
        if sig is not None and sig.role == "consequence" and tev.role == "root":
            tev.role = "consequence"
            tev.extra["teardown"] = True
            self.st._add_consequence(tev, self.table.by_id[self._row["uncaught_cxx"]])


def wait_frame_re(st: EvidenceStore) -> re.Pattern[str] | None:
    """One pattern for the rows of rules.yaml `sets.wait_frames` (traceback source lines of the
    EngineCore waiting on its workers), or None when the set is empty."""
    rows = sorted(st._set["wait_frames"])
    if not rows:
        return None
    return re.compile("|".join(f"(?:{st.table.by_id[r].regex})" for r in rows))


def after_carets(st: EvidenceStore, pid: int | None, file: str) -> bool:
    """The previous line of this stream (same pid, else same file) ends in Python's caret marks
    ("    ^^^^^^^^", "~~~~^^^^"), i.e. it was the last frame's source pointer of a traceback."""
    prev = st.pid_last_raw.get(pid) if pid is not None else None
    line = prev[0] if prev is not None and prev[1] == file else st._last_line.get(file, "")
    tail = line.rstrip()
    if not tail.endswith("^"):
        return False
    body = tail.rstrip("^~")
    return body == "" or body[-1] in " \t]"
