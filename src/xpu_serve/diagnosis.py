"""Events -> Incident: which failure came first (root cause) and what merely followed.

One analysis serves `xpu-serve diagnose` on files and `xpu-serve up` live: both feed lines
(`Analyzer.feed_line`) and facts/kernel records (`Analyzer.add_event`) into an `Analyzer` and ask
for `Analyzer.incident()`. The causal rules are the domain itself (what vLLM, oneCCL and the kernel
print when a TP worker dies or hangs), not a library's: data/rules.yaml and the modules of
`xpu_serve.analysis` (the Analyzer here is the line feeder over the evidence store; classification
is analysis/classify.py, the verdict analysis/verdict.py).

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
import re
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, AnyStr, BinaryIO

from xpu_serve.analysis import verdict
from xpu_serve.analysis.blockscan import BlockScan
from xpu_serve.analysis.classify import Classifier
from xpu_serve.analysis.contract import PHASES, TIMELINE_MAX
from xpu_serve.analysis.crashdump import gpu_runtime_frame
from xpu_serve.analysis.deaths import death_signal, normalize_process
from xpu_serve.analysis.incident import Incident
from xpu_serve.analysis.quiet import MAX_LINE, STATS_AT, QuietBlocks
from xpu_serve.analysis.store import MAX_GROUPS, MAX_PER_SIGNATURE, EvidenceStore
from xpu_serve.analysis.supervised import trigger_of
from xpu_serve.analysis.timeorder import tkey as _tkey
from xpu_serve.events import Event, parse_line, record_header_after, split_glued_records
from xpu_serve.facts import FACTS_LOG, parse_fact_line
from xpu_serve.signatures import SignatureTable

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

# first characters of a line that may continue a kernel record: indentation, or a digit (a
# `docker logs -t` stamp before the indentation)
_INDENT_FIRST = frozenset(" \t0123456789")


def _indented(line: str) -> bool:
    """An indented line, also behind a `docker logs -t` stamp (a kernel record's continuation)."""
    return line[:1] in (" ", "\t") or (line[:1].isdigit() and "Z  " in line[:40])


class Analyzer(EvidenceStore):
    """Streaming analysis of lines and facts; memory bounded by the number of signatures.

    Use: `feed_line(line, file, lineno)` for every line (vLLM output, oneCCL, kernel records in
    any format, crash dumps), `add_event(event)` for facts (xpu_serve.facts) and kernel records
    already parsed (`events.parse_kernel_record`), then `incident()` (may be called repeatedly).
    Set `dedup = True` before feeding several files of one incident (see `diagnose_files`).
    Not thread-safe: feed from one thread or task.

    It is the evidence store (analysis/store.py) and owns the feeding: the per-line fast path,
    `feed_block` with quiet blocks read from the scan (analysis/quiet.py), the split of an input
    holding several starts of vLLM; each line that may be evidence goes to its `Classifier`
    (analysis/classify.py), `incident()` to analysis/verdict.py.
    """

    def __init__(self, table: SignatureTable | None = None) -> None:
        super().__init__(table)
        self._lineno: dict[str, int] = {}
        # the classifier of parsed lines (analysis/classify.py) and the parts of its state the
        # feeding loops read on every line: open tracebacks, the last kernel record per file, the
        # crash dumps' native-frame windows
        self._cls = Classifier(self)
        self._tb = self._cls.tracker.streams
        self._last_kernel = self._cls.last_kernel
        self._frame_until = self._cls.dumps.frame_until
        # fast path: a line is parsed only when it contains a keyword of the table (or a trigger
        # below), belongs to an open traceback, or continues a kernel record
        triggers = (
            # "^^^": Python 3.11+ position marks under a frame's source; a paste that starts at them
            # (its header and frame line cut off) opens a traceback there (see Classifier.ingest)
            # "ray::": Ray's task-error header, which opens a traceback like CPython's (analysis/traceback.py)
            ("Traceback (most recent call last)", "what():", "|CCL_", 'File "', " NCCL WARN ", "^^^", "ray::")
            # a context row the classifier acts on: a GPU driver's record naming a fault's process
            + self.table.by_id[self._row["kernel_task_info"]].keywords
        )
        self._ac: Any = self.table.trigger_automaton(triggers, skip_roles=("context",))
        self._triggers = tuple(self.table.trigger_keywords(triggers, skip_roles=("context",)))
        # the block scan (feed_block), the process prefixes of the last quiet block, and the
        # blocks left before the next try after blocks whose " pid=" lines were not all known
        self._blockscan = BlockScan(self._triggers) if self._ac is not None else None
        self._quiet = QuietBlocks(self)
        self._stats_sig = self.table.by_id.get(self._row["stats_line"])
        self._prefix_seen: dict[str, int | None] = {}
        # on when several files of one incident are fed (diagnose_files with 2+ paths); a single
        # stream (the live log) has no copies and skips the bookkeeping (about 10% of the time)
        self.dedup = False

    @property
    def duplicates(self) -> int:
        """Copies of lines read from several files and counted once (analysis/dedup.py)."""
        return self._cls.dups.duplicates

    def incident(self) -> Incident:
        """The verdict over everything fed so far (analysis/verdict.py); never raises, may be
        called repeatedly."""
        self._cls.heads.flush()
        return verdict.incident(self)

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
            m = STATS_AT.match(line, sp)
            if m:
                self.note_stats(m, (line, file, lineno), None)
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
            # exception line of a traceback whose head the paste lost (see Classifier.ingest)
            or (pid is not None and line.find(" ERROR ", 0, 200) >= 0)
            # the native frames under a crash dump (analysis/crashdump.py)
            or (self._frame_until and self._cls.dumps.frame_window(file, lineno))
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
        r = self._cls.ingest(ev, file, lineno)
        self._last_line[file] = line
        if ev.pid is not None and ev.source in ("vllm", "ccl"):
            self.pid_last_raw[ev.pid] = (line, file, lineno)
        return r

    def feed_block(self, text: str, file: str, first_lineno: int = 1) -> int:
        """Feed a block of complete lines ("\n"-separated, no trailing newline) of one file;
        returns the number of lines. Same result as `feed_line` per line, much faster: one pass of
        the block scan (analysis/blockscan.py) finds the lines that can match a row; a block with
        none but stats lines is read from the scan alone (analysis/quiet.py), any other takes the
        per-line loop with those lines marked."""
        if self._ac is None:
            lines = text.split("\n")
            self.feed_lines(lines, file, first_lineno)
            return len(lines)
        bs = self._blockscan
        assert bs is not None
        sc = bs.scan(text)
        if sc.quiet:
            n = self._quiet.read(text, file, first_lineno, sc.stats)
            if n is not None:
                return n
        lines = text.split("\n")
        self.feed_lines(lines, file, first_lineno, bs.trigger_lines(sc, lines))
        return len(lines)

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
                m = STATS_AT.match(line, sp)
                if m and not record_header_after(line, m.end()):
                    self.note_stats(m, (line, file, lineno), None)
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
                or (frame_until and self._cls.dumps.frame_window(file, lineno))  # a crash dump's frames
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

    def add_event(self, event: Event) -> None:
        """Add a fact (process exit, hang, health, start-up stall: `xpu_serve.facts`) or an
        already-parsed kernel record. Classified with the same table as lines. The trigger fact
        (`facts.trigger`) is not classified: it completes the verdict (analysis/supervised.py)."""
        if event.extra.get("fact") == "trigger":
            self.trigger = trigger_of(event.extra.get("trigger")) or self.trigger
            return
        if event.extra.get("fact") == "rank-states":  # evidence of the hang verdict (analysis/stuck.py)
            self.rank_states = event
            return
        file = event.file or f"<{event.source}>"
        lineno = event.line if event.line is not None else self._lineno.get(file, 0) + 1
        self._lineno[file] = lineno
        self._cls.ingest(event, file, lineno, fact=True)

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
        }
    )

    def split_incarnation(
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
        self._cls.reset(at)
        self._quiet.reset()
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
        self.rank_states = None
        self.world_size = None


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
