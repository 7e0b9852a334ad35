"""Events -> Incident: which failure came first (root cause) and what merely followed.

One analysis serves `xpu-serve diagnose` on files and `xpu-serve up` live: both feed lines
(`Analyzer.feed_line`) and facts/kernel records (`Analyzer.add_event`) into an `Analyzer` and ask
for `Analyzer.incident()`. The causal rules are written here, not taken from a library: they are
the domain itself (what vLLM, oneCCL and the kernel print when a TP worker dies or hangs).

Causal rules (not line order; several processes interleave their output):
- a consequence row (oneCCL finalize errors, EngineDeadError, cancelled reads...) is never the root;
- root candidates are ranked by what they explain: a kernel record of a crash in a GPU library
  (umd-segfault) > a kernel GPU fault > the OOM killer > a process's own specific error
  (config, device memory, device lost, collective) > a generic exception > a death report >
  hang detection > start-up stall; the row's `weight` encodes it;
- a process's own exception outranks vLLM's `died unexpectedly` report of it; EngineCore
  re-raising a worker's error ("Worker failed with error ...") names the worker;
- collective errors, device-lost and generic exceptions that come after a process died are
  consequences of that death; a device-lost report with a kernel GPU fault at hand is the fault;
- kernel pids are linked to logged pids where they match, else by name and order (the kernel's
  comm is cut to 15 bytes, containers show host pids), with a note saying so;
- hangs: the last progress (a stats line with non-zero throughput), the detection (RPC timeout,
  ProcessGroup watchdog, xpu-serve watchdog) and the delay between them;
- start-up stalls: the last milestone reached and the ranks that did not reach it;
- several starts in one vLLM log: the verdict is the last start's; kernel records read from
  another file are placed before or after the restart by their own wall-clock stamps (dmesg -T,
  ISO); seconds since boot cannot be placed against vLLM's clock and stay where they were read.

Memory stays bounded whatever the input size: only classified events are kept, each signature
keeps its first few occurrences and counts.
"""

from __future__ import annotations

import codecs
import dataclasses
import re
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, AnyStr, BinaryIO

from xpu_serve.analysis.blockscan import BlockScan, explain_pids, usable_keys
from xpu_serve.analysis.contract import PHASES, TIMELINE_MAX
from xpu_serve.analysis.deaths import death_signal, normalize_process
from xpu_serve.analysis.incident import Incident
from xpu_serve.analysis.store import MAX_GROUPS, MAX_PER_SIGNATURE
from xpu_serve.analysis.supervised import trigger_of
from xpu_serve.analysis.timeorder import tkey as _tkey
from xpu_serve.analysis.traceback import HEADER, Step, TracebackTracker, is_message_head
from xpu_serve.analysis.verdict import VerdictMixin
from xpu_serve.events import Event, kernel_message_info, parse_line, record_header_after, split_glued_records
from xpu_serve.facts import FACTS_LOG, parse_fact_line
from xpu_serve.signatures import Signature, SignatureTable

__all__ = [
    "MAX_GROUPS",
    "MAX_PER_SIGNATURE",
    "PHASES",
    "TIMELINE_MAX",
    "Analyzer",
    "Incident",
    "death_signal",
    "diagnose_files",
    "gpu_runtime_frame",
    "normalize_process",
]

MAX_LINE = 65536  # longer lines are cut (bytes) when reading files
# the innermost frame of an exception raised by vLLM's command-line parsing or config checks:
# FlexibleArgumentParser.parse_args (vllm/utils), EngineArgs (vllm/engine/arg_utils.py) and the
# config dataclasses' checks (vllm/config.py, vllm/config/*.py: __post_init__, verify_*, _verify_*)
_CONFIG_FRAME_RE = re.compile(
    r'File "[^"]*(?:", line \d+, in parse_args$|/arg_utils\.py", line \d+, in |'
    r'/config(?:\.py|/\w+\.py)", line \d+, in (?:__post_init__|_?verify\w*|__init__)$)'
)
# the stats line's numbers, matched at the position of "Avg prompt throughput: " (the fast path);
# the table's stats-line row is the reference shape (vllm/v1/metrics/loggers.py)
_STATS_AT = re.compile(
    r"Avg prompt throughput: (?P<prompt_tps>[\d.]+) tokens/s, Avg generation throughput: (?P<gen_tps>[\d.]+) "
    r"tokens/s, Running: (?P<running>\d+) reqs,(?: Swapped: \d+ reqs,)? (?:Waiting|Pending): (?P<waiting>\d+) reqs"
)
_KEPT_ROLES = frozenset({"root", "precursor", "consequence"})  # roles kept as evidence
_QUIET_LEVELS = frozenset({"INFO", "WARNING", "WARN", "DEBUG"})
_TB_LEVELS = frozenset({"ERROR", "CRITICAL"})  # levels vLLM logs tracebacks at (logger.exception)
# the most recent Python frame of a crash dump inside a collective library's binding (vLLM's
# pynccl wrapper, oneCCL bindings): the crash is the collective library's
_COLLECTIVE_FRAME_RE = re.compile(
    r'File "[^"]*(?:pynccl|/nccl|oneccl|torch_ccl|/ccl/)[^"]*"|\bin (?:nccl|ccl)[A-Z]\w*\s*$'
)
# crash dumps whose stack is native frames (tvm-ffi, abseil/glog, UCX, Open MPI; faulthandler's
# "Fatal Python error" prints Python frames, read by _crash_frame), and how many lines after the
# dump header its first frame may come (UCX prints a few header lines first; Open MPI's frames
# may be interleaved with the program's own stdout)
_NATIVE_WINDOW = 20
# a native stack frame line of a crash dump: glibc backtrace_symbols / Open MPI
# ("lib.so.0(sym+0x1d)[0x7f..]", opal/util/stacktrace.c), abseil/glog ("@ 0x7f.. sym"), gdb/LLVM
# ("#3 0x7f.. in sym"), tvm-ffi ("  ns::func(...)", vllm-project/vllm#52386)
_NATIVE_FRAME_RE = re.compile(
    r"\.so(?:\.[\d.]+)?\((?:[\w$.@]*(?:\+0x[0-9a-f]+)?)?\)|@\s+0x[0-9a-f]+\s+\S|#\d+\s+0x[0-9a-f]+|^\s*[A-Za-z_][\w:<>~]*::\w+\("
)
# frames that only show the signal being delivered (libc, the dynamic loader, the handler itself)
_SIGNAL_FRAME_RE = re.compile(
    r"libc\.so|libc-|libpthread|ld-linux|__restore_rt|\bkillpg\b|\braise\b|\babort\b|libucs|ucs_handle_error"
    r"|libopen-pal|opal_|libc10\.so\(_ZN3c10\d+Error|FatalSignal|signal_handler|SignalHandler|libc_sigaction"
)
# the crashing frame is in a collective communication library (oneCCL, NCCL/RCCL, MPI, libfabric,
# MSCCL++, HCCL): by name of the shared object or by (mangled) namespace
_COLLECTIVE_NATIVE_RE = re.compile(
    r"lib(?:ccl|nccl|rccl|mpi|fabric|mscclpp|hccl|psm\d)\w*\.so|\bccl_\w+::|\bccl::|\bnccl[A-Z]\w*"
    r"|\bmscclpp::|_ZN\d*(?:mscclpp|ccl)\d|\bhccl[A-Z]\w*"
)

# the crashing frame is inside a GPU user-mode driver or runtime: by the shared object's name, or by
# the driver/runtime API symbol when the dump prints no path (CUDA driver/runtime cu*/cuda*, Level
# Zero ze*/zex*, Unified Runtime ur*, HIP hip*, ROCr hsa_*/hsaKmt*). The symbol must be the frame's
# function: after gdb's " in ", glibc/Open MPI's "lib.so(", abseil's "@ 0x.. ", tvm-ffi's "line N, in "
# or at the start of tvm-ffi's bare frame
_GPU_RUNTIME_LIB_RE = re.compile(
    r"(?P<library>(?:libze_|libigc|libigdrcl|libigdfcl|libur_|libsycl|libpi_|libOpenCL|libcuda|libnvidia-"
    r"|libcudart|libnvrtc|libamdhip|libhsa-runtime|libamd_comgr|libumf|libigdgmm)[\w.+-]*?\.so[\d.]*)"
)
_GPU_RUNTIME_SYMBOL_RE = re.compile(
    r"(?:\bin |\.so[\d.]*\(|@\s+0x[0-9a-f]+\s+|^\s*)"
    r"(?P<symbol>(?:cuda|cu|zex|ze|ur|hip)[A-Z]\w*|hsa_\w+|hsaKmt[A-Z]\w*)\b"
)
# tvm-ffi's native frame: 'File "<unknown>", line 0, in cuMemCreate' or a C/C++ source file; a
# Python frame (a .py file, `<frozen ...>`, `<string>`) is not native
_FILE_NATIVE_FRAME_RE = re.compile(r'^\s*File "(?:<unknown>|[^"]*\.(?:c|cc|cpp|cxx|cu|h|hpp|S))", line \d+, in ')


def gpu_runtime_frame(text: str) -> tuple[str, str | None] | None:
    """(what, library) when a native frame line is inside a GPU driver/runtime: `what` is the library
    file or the API symbol that names it, `library` the file when the frame prints one; else None."""
    m = _GPU_RUNTIME_LIB_RE.search(text)
    if m is not None:
        return m.group("library"), m.group("library")
    s = _GPU_RUNTIME_SYMBOL_RE.search(text)
    if s is not None:
        return s.group("symbol"), None
    return None


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


# first characters of a line that may continue a kernel record: indentation, or a digit (a
# `docker logs -t` stamp before the indentation)
_INDENT_FIRST = frozenset(" \t0123456789")


def _http_ok(text: str) -> bool:
    """A line of `text` holds " HTTP/" and '" 200' (an answered request: the server is up)."""
    i = text.find(" HTTP/")
    while i >= 0:
        ls = text.rfind("\n", 0, i) + 1
        le = text.find("\n", i)
        line = (text[ls:] if le < 0 else text[ls:le])[:MAX_LINE]
        if " HTTP/" in line and '" 200' in line:
            return True
        if le < 0:
            return False
        i = text.find(" HTTP/", le)
    return False


def _indented(line: str) -> bool:
    """An indented line, also behind a `docker logs -t` stamp (a kernel record's continuation)."""
    return line[:1] in (" ", "\t") or (line[:1].isdigit() and "Z  " in line[:40])


_DRM_DEV_RE = re.compile(r"(?:xe|i915|amdgpu) ([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.\d)")


class Analyzer(VerdictMixin):
    """Streaming analysis of lines and facts; memory bounded by the number of signatures.

    Use: `feed_line(line, file, lineno)` for every line (vLLM output, oneCCL, kernel records in
    any format, crash dumps), `add_event(event)` for facts (xpu_serve.facts) and kernel records
    already parsed (`events.parse_kernel_record`), then `incident()` (may be called repeatedly).
    Set `dedup = True` before feeding several files of one incident (see `diagnose_files`).
    Not thread-safe: feed from one thread or task.
    """

    def __init__(self, table: SignatureTable | None = None) -> None:
        super().__init__(table)
        self._order = 0
        self._lineno: dict[str, int] = {}
        self.tracker = TracebackTracker()
        self._tb = self.tracker.streams  # stream -> open traceback (read by the feeding loops)
        self._group_specific: dict[int, None] = {}  # recent traceback groups with a specific row
        self._pyexc_by_group: dict[int, list[Event]] = {}
        # traceback group -> the logged exception's message before it, until its exception line
        self._tb_heads: dict[int, Event] = {}
        self._tb_last_frame = self.tracker.last_frame  # traceback group -> its latest frame line
        self._last_kernel: dict[str, tuple[int, Event]] = {}
        self._last_terminate: dict[str, tuple[int, Event]] = {}
        self._last_coredump: dict[str, tuple[int, Event]] = {}
        # (file, pid) -> (line, crash-dump roots) waiting for the dump's first Python frame
        self._crash_wait: dict[tuple[str, int | None], tuple[int, list[Event]]] = {}
        # file -> last line number that may still hold a native frame of an open crash dump: those
        # lines take the slow path (see _native_frame); empty in a log without a crash dump
        self._frame_until: dict[str, int] = {}
        self._native_seen: set[tuple[tuple[str, int | None], int]] = set()  # dumps whose first frame was read
        # fast path: a line is parsed only when it contains a keyword of the table (or a trigger
        # below), belongs to an open traceback, or continues a kernel record
        triggers = (
            # "^^^": Python 3.11+ position marks under a frame's source; a paste that starts at them
            # (its header and frame line cut off) opens a traceback there (see _ingest)
            ("Traceback (most recent call last)", "what():", "|CCL_", 'File "', " NCCL WARN ", "^^^")
        )
        self._ac: Any = self.table.trigger_automaton(triggers, skip_roles=("context",))
        self._triggers = tuple(self.table.trigger_keywords(triggers, skip_roles=("context",)))
        # the block scan (feed_block), the process prefixes of the last quiet block, and the
        # blocks left before the next try after blocks whose " pid=" lines were not all known
        self._blockscan = BlockScan(self._triggers) if self._ac is not None else None
        self._active: list[tuple[str, int | None]] = []
        self._scan_backoff = self._scan_misses = 0
        self._stats_sig = self.table.by_id.get(self._row["stats_line"])
        self._prefix_seen: dict[str, int | None] = {}
        # (text, pid, time) of classified lines -> {file: times seen}: the same line read from two
        # files of one incident (a bundle's vllm.log and its per-process copies) counts once
        self._seen: dict[tuple[str, int | None, str | None], dict[str, int]] = {}
        self._seen_untimed: dict[tuple[str, int | None, str | None], Event] = {}
        self.duplicates = 0
        # on when several files of one incident are fed (diagnose_files with 2+ paths); a single
        # stream (the live log) has no copies and skips the bookkeeping (about 10% of the time)
        self.dedup = False
        # the restart line's own time (month, day, h, m, s, us) when it has one: kernel records
        # read from another file (dmesg -T, ISO stamps) are placed before or after it by theirs
        self._restart_key: tuple[int, int, int, int, int, int] | None = None

    def lines_read(self, file: str) -> int:
        """How many lines of `file` were fed so far (the last line number)."""
        return self._lineno.get(file, 0)

    def is_fatal(self, event: Event) -> bool:
        """True when vLLM is dead or exiting after this classified line (rows with `fatal: true`:
        EngineCore fatal error, EngineDeadError, failed start, a death report)."""
        sig = self.table.by_id.get(event.signature or "")
        return bool(sig is not None and sig.extra.get("fatal"))

    # ------------------------------------------------------------------ feeding
    def feed_line(self, line: str, file: str = "<live>", lineno: int | None = None) -> Event | None:
        """Parse and classify one line; returns the Event when a signature matched, else None.

        `lineno` is 1-based; when None it counts lines per `file`. Never raises on any text.
        """
        if file not in self._lineno and len(self._files) < 1000:
            self._files.append(file)
        if lineno is None:
            lineno = self._lineno.get(file, 0) + 1
        self._lineno[file] = lineno
        return self._feed_fast(line, file, lineno)

    def _feed_fast(self, line: str, file: str, lineno: int) -> Event | None:
        self.lines += 1
        pid = self._prefix_pid(line, file, lineno)
        tb = self._tb
        sp = (
            line.find("Avg prompt throughput: ")
            if self._stats_sig is not None and not (tb and (file, pid) in tb)
            else -1
        )
        if sp >= 0:
            m = _STATS_AT.match(line, sp)
            if m:
                self._stats(m, (line, file, lineno), None)
                self._last_line[file] = line
                return None
        if not self.ready and " HTTP/" in line and '" 200' in line:
            self.ready = True
        if (
            (tb and (file, pid) in tb)
            or (
                line[:1] in _INDENT_FIRST
                and self._last_kernel.get(file, (0,))[0] == lineno - 1
                and _indented(line)
            )
            or self._ac is None
            or self._ac.find_matches_as_indexes(line)
            # an ERROR record of a vLLM process (rare in a healthy log): its message may be the
            # exception line of a traceback whose head the paste lost (see _ingest)
            or (pid is not None and line.find(" ERROR ", 0, 200) >= 0)
            # the native frames under a crash dump (see _native_frame)
            or (self._frame_until and self._frame_window(file, lineno))
        ):
            return self._slow(line, file, lineno)
        self._last_line[file] = line
        if pid is not None:
            self.pid_last_raw[pid] = (line, file, lineno)
        return None

    def _prefix_pid(self, line: str, file: str, lineno: int) -> int | None:
        """pid of a vLLM process prefix in the line (learning pid -> name/rank on first sight)."""
        j = line.find(" pid=", 0, 160)
        if j < 0:
            return None
        k = line.find(")", j)
        if k < 0:
            return None
        key = line[: k + 1]
        got = self._prefix_seen.get(key, -1)
        if got == -1:
            got = None
            if len(self._prefix_seen) < 20000:
                pev = parse_line(line, file, lineno)
                self._learn_pid(pev)
                got = pev.pid
                self._prefix_seen[key] = got
        return got

    def _slow(self, line: str, file: str, lineno: int) -> Event | None:
        if len(parts := split_glued_records(line)) > 1:
            # several records pasted on one line: each is read on its own (same line number)
            r = None
            for part in parts:
                r = self._slow(part, file, lineno) or r
            return r
        ev = parse_line(line, file, lineno)
        r = self._ingest(ev, file, lineno)
        self._last_line[file] = line
        if ev.pid is not None and ev.source in ("vllm", "ccl"):
            self.pid_last_raw[ev.pid] = (line, file, lineno)
        return r

    def feed_block(self, text: str, file: str, first_lineno: int = 1) -> int:
        """Feed a block of complete lines ("\n"-separated, no trailing newline) of one file;
        returns the number of lines. Same result as `feed_line` per line, much faster: one pass of
        the block scan (analysis/blockscan.py) finds the lines that can match a row; a block with
        none but stats lines is read from the scan alone (`_quiet_block`), any other takes the
        per-line loop with those lines marked."""
        if self._ac is None:
            lines = text.split("\n")
            self.feed_lines(lines, file, first_lineno)
            return len(lines)
        bs = self._blockscan
        assert bs is not None
        sc = bs.scan(text)
        if sc.quiet:
            n = self._quiet_block(text, file, first_lineno, sc.stats)
            if n is not None:
                return n
        lines = text.split("\n")
        self.feed_lines(lines, file, first_lineno, bs.trigger_lines(sc, lines))
        return len(lines)

    def _known_pids(self, text: str) -> tuple[list[tuple[str, int | None]], dict[int, int]] | None:
        """The process prefixes of `text` and the start of each one's last line, when every
        " pid=" of it lies in a prefix already learned (see blockscan.explain_pids)."""
        seen = self._prefix_seen
        keys = self._active
        if keys and all(seen.get(k, -1) == p for k, p in keys):
            last = explain_pids(text, keys)
            if last is not None:
                return keys, last
        if self._scan_backoff > 0:
            self._scan_backoff -= 1
            return None
        keys = usable_keys(seen)
        last = explain_pids(text, keys)
        if last is None:
            # the loop learns the new prefixes; when blocks keep bringing new ones (a stamp before
            # each prefix), stop counting for a while
            self._scan_misses += 1
            if self._scan_misses >= 3:
                self._scan_misses, self._scan_backoff = 0, 16
            return None
        self._scan_misses = 0
        self._active = [keys[i] for i in sorted(last)]
        return self._active, {j: last[i] for j, i in enumerate(sorted(last))}

    def _quiet_block(self, text: str, file: str, first: int, stats_at: list[int]) -> int | None:
        """Feed a block whose scan found nothing to classify: the per-line loop's state (stats,
        the last line of the file and of each process, `ready`, counts) is set from the scan.
        None (nothing changed) when a line of it still needs the loop: an open traceback or
        crash dump of this file, a kernel record that may continue, a stats line that is not one."""
        if self._stats_sig is None or file in self._frame_until:
            return None
        lk = self._last_kernel.get(file)
        if lk is not None and lk[0] == first - 1:
            return None
        known = self._known_pids(text)
        if known is None:
            return None
        keys, last = known
        pids = {keys[k][1] for k in last}
        if any(f == file and (p is None or p in pids) for f, p in self._tb):
            return None
        stats = self._quiet_stats(text, stats_at)
        if stats is None:
            return None
        cur, at = first, 0
        for ls, line, m in stats:
            cur += text.count("\n", at, ls)
            at = ls
            self._stats(m, (line, file, cur), None)
        last_lineno = cur + text.count("\n", at)
        nl = last_lineno - first
        starts = {ls for ls, _, _ in stats}
        self._quiet_pids(text, file, last_lineno, keys, last, starts)
        self._last_line[file] = text[text.rfind("\n") + 1 :][:MAX_LINE]
        if not self.ready and _http_ok(text):
            self.ready = True
        self.lines += nl + 1
        self._lineno[file] = last_lineno
        return nl + 1

    @staticmethod
    def _quiet_stats(text: str, hits: list[int]) -> list[tuple[int, str, re.Match[str]]] | None:
        """(line start, line, numbers) of each stats line of the block, in order; None when a
        line holding the stats keyword is not a clean stats line (the per-line loop reads it)."""
        out: list[tuple[int, str, re.Match[str]]] = []
        prev = -1
        for sp in hits:
            ls = text.rfind("\n", 0, sp) + 1
            if ls == prev:
                continue  # the keyword twice in a line: the loop reads the first
            prev = ls
            le = text.find("\n", sp)
            if le < 0:
                le = len(text)
            m = _STATS_AT.match(text, sp)
            if le - ls > MAX_LINE or m is None or m.end() > le:
                return None
            line = text[ls:le]
            if record_header_after(line, m.end() - ls):
                return None
            out.append((ls, line, m))
        return out

    def _quiet_pids(
        self,
        text: str,
        file: str,
        last_lineno: int,
        keys: list[tuple[str, int | None]],
        last: dict[int, int],
        stats: set[int],
    ) -> None:
        """The last line of each process in the block (the per-line loop's `pid_last_raw`; a
        stats line does not count, as in the loop)."""
        best: dict[int, int] = {}
        for k, ls in last.items():
            key, pid = keys[k]
            if pid is None:
                continue
            while ls in stats:  # the loop keeps the process's line before its stats line
                j = text.rfind("\n" + key, 0, ls - 1 if ls else 0)
                ls = j + 1 if j >= 0 else (0 if ls and text.startswith(key) else -1)
                if ls < 0:
                    break
            if ls >= 0 and ls >= best.get(pid, -1):
                best[pid] = ls
        for pid, ls in best.items():
            le = text.find("\n", ls)
            line = text[ls:] if le < 0 else text[ls:le]
            self.pid_last_raw[pid] = (line[:MAX_LINE], file, last_lineno - text.count("\n", ls))

    def feed_lines(
        self, lines: Iterable[str], file: str, first_lineno: int = 1, hits: set[int] | None = None
    ) -> None:
        """Feed many lines of one file (the same as `feed_line` for each, faster: the common
        case, a line that no signature can match, is handled inline). `hits`: indexes (0-based,
        in `lines`) of the lines that contain a keyword, when the caller already knows them."""
        ac_find = self._ac.find_matches_as_indexes if self._ac is not None and hits is None else None
        use_hits = hits is not None
        hitset = hits or set()
        stats_search = self._stats_sig.pattern.search if self._stats_sig is not None else None
        last_line = self._last_line
        pid_last_raw = self.pid_last_raw
        prefix_seen = self._prefix_seen
        last_kernel = self._last_kernel
        tb = self._tb
        frame_until = self._frame_until
        n = 0
        lineno = first_lineno - 1
        for idx, line in enumerate(lines):
            lineno += 1
            n += 1
            if len(line) > MAX_LINE:
                line = line[:MAX_LINE]
            pid: int | None = None
            j = line.find(" pid=", 0, 160)
            if j >= 0:
                k = line.find(")", j)
                if k > 0:
                    got = prefix_seen.get(line[: k + 1], -1)
                    pid = self._prefix_pid(line, file, lineno) if got == -1 else got
            in_tb = bool(tb) and (file, pid) in tb
            sp = line.find("Avg prompt throughput: ") if stats_search is not None and not in_tb else -1
            if sp >= 0:
                m = _STATS_AT.match(line, sp)
                if m and not record_header_after(line, m.end()):
                    self._stats(m, (line, file, lineno), None)
                    last_line[file] = line
                    continue
            if not self.ready and " HTTP/" in line and '" 200' in line:
                self.ready = True
            if (
                in_tb
                or (
                    (line[:1] in _INDENT_FIRST)
                    and last_kernel.get(file, (0,))[0] == lineno - 1
                    and _indented(line)
                )
                or (idx in hitset if use_hits else (ac_find is None or bool(ac_find(line))))
                or (pid is not None and line.find(" ERROR ", 0, 200) >= 0)  # see _feed_fast
                or (frame_until and self._frame_window(file, lineno))  # a crash dump's frames
            ):
                self.lines += n
                n = 0
                self._slow(line, file, lineno)
                continue
            last_line[file] = line
            if pid is not None:
                pid_last_raw[pid] = (line, file, lineno)
        self.lines += n
        self._lineno[file] = lineno

    def _stats(self, m: re.Match[str], raw: tuple[str, str, int] | None, ev: Event | None) -> None:
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

    def add_event(self, event: Event) -> None:
        """Add a fact (process exit, hang, health, start-up stall: `xpu_serve.facts`) or an
        already-parsed kernel record. Classified with the same table as lines. The trigger fact
        (`facts.trigger`) is not classified: it completes the verdict (analysis/supervised.py)."""
        if event.extra.get("fact") == "trigger":
            self.trigger = trigger_of(event.extra.get("trigger")) or self.trigger
            return
        file = event.file or f"<{event.source}>"
        lineno = event.line if event.line is not None else self._lineno.get(file, 0) + 1
        self._lineno[file] = lineno
        self._ingest(event, file, lineno, fact=True)

    def _ingest(self, ev: Event, file: str, lineno: int, fact: bool = False) -> Event | None:
        self._order += 1
        ev.extra["_order"] = self._order
        if self._crash_wait:
            self._dump_frame(ev, file, lineno)
        self._carry_time(ev, file)
        if self._kernel_continuation(ev, file, lineno):
            return None
        if ev.source == "kernel":
            self._last_kernel[file] = (lineno, ev)
        self._learn_pid(ev)
        self.tracker.expire(self._order)
        in_tb = False
        if ev.source in ("vllm", "text"):
            pid = ev.pid
            head = self._message_head(ev, file, lineno) if ev.text.startswith(HEADER) else None
            got = self.tracker.read(
                ev,
                (file, pid),
                self._order,
                lambda: self._after_carets(pid, file) or (ev.source == "vllm" and ev.level in _TB_LEVELS),
            )
            if got.step is Step.SKIP:
                return None
            if got.step is Step.WAIT_FRAME:
                return ev if self._classify(ev, False, file, lineno) is not None else None
            in_tb = got.in_tb
            if got.group is not None:
                ev.group = got.group
                if head is not None:
                    self._tb_heads[got.group] = head
                    if len(self._tb_heads) > 4096:
                        del self._tb_heads[next(iter(self._tb_heads))]
                elif in_tb:
                    self._tb_heads.pop(got.group, None)  # the exception line itself names the error
        res = self._classify(ev, in_tb, file, lineno)
        if res is None:
            return None
        return ev

    def _message_head(self, header: Event, file: str, lineno: int) -> Event | None:
        """The logged exception's message record right before the traceback `header` opens
        (analysis/traceback.py is_message_head), when no row classified it, during start-up; else
        None. Once the engine serves, a logged error with a traceback may be one request's, or the
        detection of a hang (V0's "Engine background task failed" after an iteration timeout):
        its message alone does not name a failure."""
        if self.ready or (file, header.pid) in self._tb:
            return None
        prev = self.pid_last_raw.get(header.pid) if header.pid is not None else None
        raw: str | None = self._last_line.get(file)
        at = lineno - 1
        if prev is not None and prev[1] == file:
            raw, at = prev[0], prev[2]
        if raw is None:
            return None
        pev = parse_line(raw, file, at)
        if not is_message_head(pev, header) or _REQUEST_HANDLER_LOC_RE.match(pev.code_location or ""):
            return None  # (a request handler's exception is one rejected request, see _match)
        return pev if self.table.match(pev, False) is None else None

    def incident(self) -> Incident:
        """The verdict (analysis/verdict.py); first, when nothing else names a failure or detects a
        hang, the message of each logged exception whose traceback was cut before its exception
        line stands for that exception."""
        sig = self.table.by_id[self._row["generic_exception"]]
        hang = ("engine-hang", "startup-hang")
        if self.roots or any(self.table.by_id[sid].cause in hang for sid in self.precursors) or any(
            g.sig.cause in hang for g in self.groups.values()
        ):
            self._tb_heads.clear()
        for group, ev in self._tb_heads.items():
            ev.signature, ev.role, ev.cause, ev.group = sig.id, sig.role, sig.cause, group
            ev.extra["_order"] = group
            frame = self._tb_last_frame.get(group)
            if frame is not None and _CONFIG_FRAME_RE.search(frame):
                ev.cause = "config-error"
            self._root(ev, sig, ev.file or "", ev.line or 0)
        self._tb_heads.clear()
        return super().incident()

    def _dump_frame(self, ev: Event, file: str, lineno: int) -> None:
        """A frame line while a crash dump waits for its first frame (Python or native)."""
        text = ev.text
        if text.lstrip().startswith('File "'):
            if file in self._frame_until and _FILE_NATIVE_FRAME_RE.match(text):
                self._native_frame(ev, file, lineno)
            else:
                self._crash_frame(ev, file, lineno, self._last_line.get(file))
        elif file in self._frame_until and _NATIVE_FRAME_RE.search(text):
            self._native_frame(ev, file, lineno)

    def _carry_time(self, ev: Event, file: str) -> None:
        """Time carried forward per file for lines without their own stamp (ordering only)."""
        t = ev.time
        if t is not None:
            if not (ev.source == "kernel" and "boot_s" in ev.extra):
                self._last_t[file] = (t.month, t.day, t.hour, t.minute, t.second, t.microsecond)
            return
        prev = self._last_line.pop(file, None)
        if prev is not None:
            pe = parse_line(prev)
            pt = pe.time
            if pt is not None and not (pe.source == "kernel" and "boot_s" in pe.extra):
                self._last_t[file] = (pt.month, pt.day, pt.hour, pt.minute, pt.second, pt.microsecond)
        if file in self._last_t:
            ev.extra["_tkey"] = self._last_t[file]

    def _kernel_continuation(self, ev: Event, file: str, lineno: int) -> bool:
        """True when the line continues the kernel record of the previous line (a wrapped paste,
        a multi-line record): appended to it, which is classified again when still unknown."""
        text = ev.text
        if not (ev.source == "text" and text[:1] in (" ", "\t") and file in self._last_kernel):
            return False
        kl, kev = self._last_kernel[file]
        if kl != lineno - 1 or "Traceback" in text:
            return False
        self._last_kernel[file] = (lineno, kev)
        kev.text = kev.text.rstrip() + " " + text.strip()
        kernel_message_info(kev)
        if kev.signature is None:
            self._classify(kev, False, file, lineno)
        return True

    def _quoted_root(
        self, ev: Event, start: int, in_tb: bool
    ) -> tuple[Signature, re.Match[str]] | None:
        """The root row matching the text after offset `start` of a consequence line that quotes its
        cause (a `quotes_root` row: "watchdog thread terminated with exception: CUDA error: an illegal
        memory access"), or None. Only a named failure counts: a quoted hang, crash or generic
        exception says no more than the consequence itself."""
        rest = ev.text[start:]
        if len(rest) < 8:
            return None
        m = self.table.match(dataclasses.replace(ev, text=rest), in_tb)
        if m is None or m[0].role != "root" or m[0].cause in self.rules.unquotable_causes or m[0].id == self._row["generic_exception"]:
            return None
        return m

    def _classify(self, ev: Event, in_tb: bool, file: str, lineno: int) -> Signature | None:
        """Match the line against the table and keep it by its row's role; None when no row
        matched or the match is not evidence (a client's text, code, a request's rejection)."""
        m = self._match(ev, in_tb, file, lineno)
        if m is None:
            return None
        sig, gd = m
        role = sig.role
        if ev.group is not None and sig.id != self._row["generic_exception"] and role in _KEPT_ROLES:
            self._subsume_generic(ev.group)
        if role == "progress":
            if sig.phase in ("args", "api") and self._is_restart(ev, sig, file):
                self._split_incarnation(file, lineno, _tkey(ev))
            self._progress(ev, sig, gd)
            return sig
        if role == "context":
            if sig.phase == "serving":
                self.ready = True
            return sig
        if ev.text.lstrip().startswith("what():"):
            self._what_line(ev, file, lineno, sig)
        if role == "root":
            self._root(ev, sig, file, lineno)
        elif role == "precursor":
            self.precursor_counts[sig.id] = self.precursor_counts.get(sig.id, 0) + 1
            lst = self.precursors.setdefault(sig.id, [])
            if len(lst) < MAX_PER_SIGNATURE:
                lst.append(ev)
            elif sig.id in self._set["keep_latest"] or sig.cause == "startup-hang":
                lst[-1] = ev  # the last wait tells whether start-up moved on after the waits
        else:
            self._add_consequence(ev, sig)
        return sig

    def _match(self, ev: Event, in_tb: bool, file: str, lineno: int) -> tuple[Signature, dict[str, Any]] | None:
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
        if self.dedup and sig.role in _KEPT_ROLES and self._duplicate(ev, file):
            return None
        ev.signature, ev.role, ev.cause = sig.id, sig.role, sig.cause
        if generic and ev.group is not None:
            frame = self._tb_last_frame.get(ev.group)
            if frame is not None and _CONFIG_FRAME_RE.search(frame):
                # raised while vLLM parsed its command line or checked its configuration
                ev.cause = "config-error"
                ev.extra["config_frame"] = frame
        gd = mt.groupdict()
        for k, v in gd.items():
            if v is not None:
                ev.extra[k] = v
        if ev.rank is None and gd.get("rank"):
            ev.rank = int(gd["rank"])
        return sig, gd

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
        if sig.id == self._row["hang_fact"]:
            self.facts_hang = ev
        elif sig.id in self._set["signal_dumps"]:
            cw = self._crash_wait.get((file, ev.pid))
            if cw is None or lineno - cw[0] > 60:
                cw = self._crash_wait[(file, ev.pid)] = (lineno, [])
            cw[1].append(ev)
            if sig.id in self._set["native_dumps"]:
                self._frame_until[file] = lineno + _NATIVE_WINDOW
        if self._before_restart(ev, file):
            # a kernel record from another file, stamped before the last restart: it belongs
            # to the earlier incarnation (a kernel log read after the vLLM log)
            assert self._earlier is not None
            self._earlier._keep_root(sig.id, ev)
            return
        self._keep_root(sig.id, ev)
        if sig.id == self._row["generic_exception"] and ev.group is not None:
            if ev.group in self._group_specific:
                ev.extra["subsumed"] = True
            self._pyexc_by_group.setdefault(ev.group, []).append(ev)

    def _before_restart(self, ev: Event, file: str) -> bool:
        """True for a kernel record read from another file than the one vLLM restarted in whose
        own time stamp is before the restart line's (both wall clocks; seconds since boot cannot
        be placed against vLLM's clock and stay where they were read)."""
        if self._restart_key is None or self._earlier is None or ev.source != "kernel":
            return False
        if self._restart_at is None or file == self._restart_at[0]:
            return False
        k = _tkey(ev)
        return k is not None and k < self._restart_key

    def _duplicate(self, ev: Event, file: str) -> bool:
        """True when this line (same text after wrappers, same pid, same own time stamp) was
        already read from another file as often as it has now been seen in this one: the
        occurrences of a line count as the most any single file holds (repeats within one file
        are real repeats; copies in other files are not)."""
        key = (ev.text.strip(), ev.pid, ev.time_text)
        per_file = self._seen.get(key)
        if per_file is None:
            if len(self._seen) < 200_000:
                self._seen[key] = {file: 1}
                if ev.time_text is None and len(self._seen_untimed) < 4096:
                    self._seen_untimed[key] = ev
            return False
        n = per_file.get(file, 0) + 1
        per_file[file] = n
        if n <= max((c for f, c in per_file.items() if f != file), default=0):
            self.duplicates += 1
            # an unstamped line (a crash dump) is placed in time by the lines around it: keep the
            # placement of the copy that has one (the full log) when the first copy had none
            first = self._seen_untimed.get(key)
            if first is not None and "_tkey" not in first.extra and "_tkey" in ev.extra:
                first.extra["_tkey"] = ev.extra["_tkey"]
            return True
        return False

    def _is_restart(self, ev: Event, sig: Signature, file: str) -> bool:
        """True when this start-up line begins a new incarnation of vLLM after a failure already
        read from the same file: vLLM's first lines (`vLLM API server version`, `non-default
        args:`) after failure evidence, or a second `Starting vLLM API server` (its first lines
        cut off). Evidence from other files (a dmesg.txt read before the vLLM log) never splits."""
        if sig.phase == "api" and (
            "Starting vLLM API server" not in ev.text or not ({"api", "ready"} & self.milestones.keys())
        ):
            return False
        return self._has_failure(file)

    def _has_failure(self, file: str) -> bool:
        for e in (self.facts_hang, self.stall_stats):
            if isinstance(e, Event) and e.file == file:
                return True
        if isinstance(self.stall_stats, tuple) and self.stall_stats[1] == file:
            return True
        if any(e.role == "root" and e.file == file for evs in self.roots.values() for e in evs):
            return True
        return any(g.sig.extra.get("fatal") and g.first.file == file for g in self.groups.values())

    # state shared by every incarnation of one input (file bookkeeping, the table)
    _SHARED_STATE = frozenset(
        {
            "table",
            "rules",
            "_row",
            "_set",
            "_ac",
            "_stats_sig",
            "_lineno",
            "_files",
            "_last_t",
            "_last_line",
            "dedup",
            "lines",
            "_order",
        }
    )

    def _split_incarnation(
        self, file: str, lineno: int, at: tuple[int, int, int, int, int, int] | None = None
    ) -> None:
        """Move the analysis so far into `_earlier` and start afresh: the verdict is about the
        last incarnation. Containers are emptied in place (the feeding loops hold references).
        `at` is the restart line's time key: kernel records already read from another file (a
        dmesg.txt read before the vLLM log) whose own stamp is after it stay with the new start."""
        prev = Analyzer.__new__(Analyzer)
        d: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if k not in self._SHARED_STATE and isinstance(v, (dict, list, set)):
                d[k] = v.copy()
                v.clear()
            else:
                d[k] = v
        d["_earlier"] = None
        prev.__dict__.update(d)
        self._earlier = prev
        self._restart_at = (file, lineno)
        self._restart_key = at
        self.restarts += 1
        if at is not None:
            for sid, evs in list(prev.roots.items()):
                later = [e for e in evs if e.source == "kernel" and e.file != file and (_tkey(e) or at) > at]
                if later:
                    keep = [e for e in evs if not any(e is x for x in later)]
                    if keep:
                        prev.roots[sid] = keep
                    else:
                        del prev.roots[sid]
                    prev.root_counts[sid] = max(0, prev.root_counts.get(sid, 0) - len(later))
                    for e in later:
                        self._keep_root(sid, e)
        self.ready = False
        self.last_progress = self.last_stats = self.stall_stats = None
        self.facts_hang = None
        self.world_size = None
        self.tracker.check = 0

    def _crash_frame(self, ev: Event, file: str, lineno: int, prev: str | None) -> None:
        """The first Python frame of the crashing thread in a crash dump (faulthandler prints
        "Current thread 0x... (most recent call first):" or "Stack (most recent call first):",
        then the most recent call first; faulthandler.c): when it is in a collective library's
        binding, the crash is that library's. Other threads' blocks ("Thread 0x...") are skipped."""
        if prev is None or "(most recent call first)" not in prev:
            return
        if "Thread 0x" in prev and "Current thread" not in prev:
            return
        cw = self._crash_wait.pop((file, ev.pid), None)
        if cw is None or lineno - cw[0] > 200:
            return
        if _COLLECTIVE_FRAME_RE.search(ev.text):
            for cev in cw[1]:
                cev.cause = "collective-failure"
                cev.extra["crash_frame"] = ev.text.strip()

    def _frame_window(self, file: str, lineno: int) -> bool:
        """True while `lineno` may hold the first native frame of a crash dump in `file`; the window
        is dropped once past (so a log without open dumps pays one dict truth test per line)."""
        until = self._frame_until.get(file)
        if until is None:
            return False
        if lineno > until:
            del self._frame_until[file]
            return False
        return True

    def _native_frame(self, ev: Event, file: str, lineno: int) -> None:
        """A native frame line within _NATIVE_WINDOW lines after a signal dump (tvm-ffi's "!!!!!!! Segfault
        encountered !!!!!!!", Open MPI's "*** Process received signal ***", abseil, UCX): the first
        frame that is not the signal's own delivery (libc, handler) is the crashing code; when it is
        a collective library's, the crash is that library's. Later frames are callers: not read."""
        key = (file, ev.pid)
        cw = self._crash_wait.get(key)
        if cw is None and ev.pid is not None:
            key = (file, None)
            cw = self._crash_wait.get(key)
        if cw is None or lineno - cw[0] > _NATIVE_WINDOW or _SIGNAL_FRAME_RE.search(ev.text):
            return
        done = (key, cw[0])
        if done in self._native_seen:
            return
        if len(self._native_seen) > 4096:  # a live log of many crashes: keep the memory bounded
            self._native_seen.clear()
        self._native_seen.add(done)  # the wait stays open for the dump's Python frames (_crash_frame)
        self._frame_until.pop(file, None)
        if _COLLECTIVE_NATIVE_RE.search(ev.text):
            self._attribute_crash(cw[1], "collective-failure", ev.text, None)
            return
        gpu = gpu_runtime_frame(ev.text)
        if gpu is not None:
            self._attribute_crash(cw[1], "umd-segfault", ev.text, gpu[1])

    @staticmethod
    def _attribute_crash(dumps: list[Event], cause: str, frame: str, library: str | None) -> None:
        """The crash dumps waiting on their first frame take `cause` (only a bare process-crash)."""
        for cev in dumps:
            if cev.cause == "process-crash":
                cev.cause = cause
                cev.extra["crash_frame"] = frame.strip()
                if library is not None:
                    cev.extra.setdefault("library", library)

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
            # follows from it (see _incident)
            if sig is None:
                tev.cause = "process-exception"
            elif sig.role == "root" and sig.cause is not None:
                tev.cause = sig.cause
        if sig is not None and sig.role == "consequence" and tev.role == "root":
            tev.role = "consequence"
            tev.extra["teardown"] = True
            self._add_consequence(tev, self.table.by_id[self._row["uncaught_cxx"]])

    def _progress(self, ev: Event, sig: Signature, gd: dict[str, Any]) -> None:
        phase = sig.phase
        if phase == "serving":  # stats line
            m = sig.pattern.search(ev.text)
            if m:
                self._stats(m, None, ev)
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
            ms = self.milestones[phase] = {
                "ranks": set(),
                "first": ev,
                "last": ev,
                "per_rank": sig.per_rank,
                "sig": sig,
                "pids": set(),
            }
        ms["last"] = ev
        if sig.per_rank:
            ms["per_rank"] = True
        if rank is not None:
            ms["ranks"].add(rank)
        elif ev.pid is not None and len(ms["pids"]) < 1024:
            ms["pids"].add(ev.pid)

    # ------------------------------------------------------------------ analysis
    # ------------------------------------------------------------------ helpers
    def _after_carets(self, pid: int | None, file: str) -> bool:
        """The previous line of this stream (same pid, else same file) ends in Python's caret marks
        ("    ^^^^^^^^", "~~~~^^^^"), i.e. it was the last frame's source pointer of a traceback."""
        prev = self.pid_last_raw.get(pid) if pid is not None else None
        line = prev[0] if prev is not None and prev[1] == file else self._last_line.get(file, "")
        tail = line.rstrip()
        if not tail.endswith("^"):
            return False
        body = tail.rstrip("^~")
        return body == "" or body[-1] in " \t]"

# ------------------------------------------------------------------------------ files
# Byte-order marks recognised at the start of an input (longest first: the UTF-32-LE mark starts
# with the UTF-16-LE one). Logs saved by Windows tools (Notepad, PowerShell `>`) are UTF-16-LE with
# a BOM; without a mark an input is read as UTF-8.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)

_Src = str | Path | tuple[str, BinaryIO]
"""An input: a path, or (display name, binary file object already open, e.g. sys.stdin.buffer)."""


def _cut_lines(pieces: Iterable[AnyStr], nl: AnyStr, cap: int) -> Iterator[AnyStr]:
    """Regroup `pieces` (bytes or str) into blocks of complete lines (no trailing newline), then the
    last unterminated line if any. A line longer than `cap` (bytes or characters) that spans
    pieces is cut at `cap` and the rest of it, up to its newline, is dropped, so memory stays
    bounded by piece size + cap even for an endless input without a newline."""
    carry: AnyStr | None = None
    skip = False
    for piece in pieces:
        if not piece:
            continue
        if skip:  # the rest of a line already cut: drop it up to its newline
            at = piece.find(nl)
            if at < 0:
                continue
            piece = piece[at:]
            skip = False
        data = carry + piece if carry else piece
        cut = data.rfind(nl)
        if cut < 0:
            carry = data
        else:
            carry = data[cut + 1 :]
            yield data[:cut]
        if len(carry) > cap:
            carry = carry[:cap]
            skip = True
    if carry:
        yield carry


def _read_all(f: BinaryIO, first: bytes, block: int) -> Iterator[bytes]:
    yield first
    while True:
        chunk = f.read(block)
        if not chunk:
            return
        yield chunk


def _blocks_of(f: BinaryIO, block: int) -> Iterator[str]:
    """Blocks of complete lines of an open binary file, decoded by its BOM (UTF-8 without one)."""
    first = f.read(block)
    while 0 < len(first) < 4:  # a pipe may give a few bytes at a time: enough for the longest BOM
        more = f.read(block)
        if not more:
            break
        first += more
    enc = "utf-8"
    for bom, name in _BOMS:
        if first.startswith(bom):
            enc, first = name, first[len(bom) :]
            break
    raw = _read_all(f, first, block)
    if enc == "utf-8":
        for b in _cut_lines(raw, b"\n", MAX_LINE):
            yield b.decode("utf-8", "replace")
        return
    dec = codecs.getincrementaldecoder(enc)("replace")

    def texts() -> Iterator[str]:
        for chunk in raw:
            yield dec.decode(chunk)
        yield dec.decode(b"", True)

    yield from _cut_lines(texts(), "\n", MAX_LINE)


def iter_file_blocks(src: _Src, block: int = 1 << 20) -> Iterable[str]:
    """Yield blocks of complete lines ("\\n"-joined, no trailing newline) of one input, streamed
    in `block`-byte reads; the input is opened once (FIFOs work; never seeks).

    `src`: a path, or (name, open binary file) which is read but not closed. Decoding: a UTF-8,
    UTF-16 or UTF-32 byte-order mark at the start selects that encoding (the mark is dropped),
    else UTF-8; invalid bytes are replaced, NULs kept. A line longer than MAX_LINE (bytes for
    UTF-8, characters otherwise) that spans two reads is cut at MAX_LINE, the rest dropped; within
    one read a line is bounded by `block`. An input that never ends (a FIFO whose writer never
    closes) is read until EOF, like `grep`. Raises OSError when it cannot be opened or read.
    """
    if isinstance(src, tuple):
        yield from _blocks_of(src[1], block)
        return
    with open(src, "rb") as f:
        yield from _blocks_of(f, block)


def iter_file_lines(src: _Src, block: int = 1 << 20) -> Iterable[str]:
    """Yield the lines of one input as text (no newline), decoded and cut as `iter_file_blocks`
    does. Raises OSError when it cannot be opened or read."""
    for text in iter_file_blocks(src, block):
        yield from text.split("\n")


def diagnose_files(paths: Iterable[_Src], analyzer: Analyzer | None = None) -> Incident:
    """Feed every input (vLLM, kernel, or both mixed) into one Analyzer and return the Incident.

    `paths`: file paths (regular files or FIFOs, each opened once, in order) or (name, open binary
    file) pairs such as ("<stdin>", sys.stdin.buffer). Decoding as `iter_file_blocks`.

    With two or more files, a classified line found in several of them (same text after wrappers,
    same pid, same own time stamp) counts as often as the one file holding it most often does:
    a bundle's vllm.log and its per-process logs give the counts of vllm.log alone.

    Raises OSError (with the path) for an unreadable file; any content is accepted.
    """
    an = analyzer or Analyzer()
    paths = list(paths)
    if len(paths) > 1 or an._files:
        an.dedup = True  # the same line in two files of one incident (vllm.log and its per-process copies)
    facts_in = [p for p in paths if _base(p) == FACTS_LOG]
    pending = _read_facts(facts_in)
    logical = 0  # lines of vllm.log (its rotations, oldest first) fed so far: the facts' `after`
    for p in paths:
        if _base(p) == FACTS_LOG:
            continue
        name = p[0] if isinstance(p, tuple) else str(p)
        if name not in an._files:
            an._files.append(name)
        an._last_line.pop(name, None)
        vlog = _VLLM_LOG_RE.match(_base(p)) is not None
        lineno = 1
        for text in iter_file_blocks(p):
            if vlog and pending:
                lineno += _feed_between(an, text, name, lineno, logical, pending)
            else:
                lineno += an.feed_block(text, name, lineno)
        if vlog:
            logical += lineno - 1
    for _, ev in pending:  # after the end of the copy (a cut log) or placed at the end
        an.add_event(ev)
    return an.incident()


_VLLM_LOG_RE = re.compile(r"vllm\.log(?:\.\d+)?$")


def _base(p: _Src) -> str:
    return Path(p[0] if isinstance(p, tuple) else str(p)).name


def _read_facts(paths: list[_Src]) -> list[tuple[int, Event]]:
    """(after, event) of every fact line of the facts logs (`facts.parse_fact_line`), in `after`
    order (a fact without a position goes last); other lines are ignored."""
    got: list[tuple[int, Event]] = []
    for p in paths:
        for line in iter_file_lines(p):
            r = parse_fact_line(line)
            if r is not None:
                ev, after = r
                got.append((after if after >= 0 else 1 << 62, ev))
    got.sort(key=lambda x: x[0])
    return got


def _feed_between(
    an: Analyzer, text: str, name: str, lineno: int, logical: int, pending: list[tuple[int, Event]]
) -> int:
    """Feed a block of vllm.log with the facts whose `after` falls in it added where the live
    analysis got them (after that many lines); consumed facts leave `pending`. Returns the
    block's number of lines."""
    lines = text.split("\n")
    start = logical + lineno - 1  # logical lines before this block
    done = 0
    while pending and pending[0][0] <= start + len(lines):
        cut = max(0, pending[0][0] - start)
        if cut > done:
            an.feed_block("\n".join(lines[done:cut]), name, lineno + done)
            done = cut
        an.add_event(pending.pop(0)[1])
    if done < len(lines):
        an.feed_block("\n".join(lines[done:]), name, lineno + done)
    return len(lines)


_ = datetime  # re-exported type in annotations of facts
