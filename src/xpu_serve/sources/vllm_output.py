"""Log pump: the engine's stdout/stderr to disk, per-process files, the echo and a line callback.

The pipes must never block the engine: a supervisor that reads slowly makes vLLM look hung
(vLLM logs from every process into the same inherited pipes; a full pipe stalls the writing
process inside `write()`, in the middle of a forward pass if it is a worker). So:

- a relay process (``python -I -S``, stdlib only, single thread, its own session so the
  engine's tree kill does not touch it; see `xpu_serve.sources.log_relay`) `read()`s the pipes and itself
  appends what it read to ``vllm.log`` (rotated, in the relay), at the speed of `read()` and
  `write()`: per read only CR -> LF, holding each stream's partial last line (so lines of stdout
  and stderr never mix) and the rotation cut, no per-line Python work. ``vllm.log`` is the
  evidence: it is never dropped from, whatever the supervisor does. The relay then forwards
  the same whole lines as frames on one pipe to this process for the per-line work. It shares
  no GIL with the supervisor (the writer thread, the asyncio loop analysing lines). When the
  supervisor falls behind and the relay's forwarding queue reaches `buffer_cap_bytes`, only
  the *forwarding* stops (whole lines, until the queue is down to half): those lines are in
  ``vllm.log`` but not in the per-process files, the echo or the callback; they are counted
  (`PumpStats.dropped_lines`; the relay counts their newlines from ``vllm.log`` when it has
  little to read and the input is calm, under ~100 MB/s, never on the hot path, and forwards
  again once they are counted, so the forwarding resumes after a burst) and a marker line goes
  into every per-process file and the echo: ``[xpu-serve] dropped N lines (B bytes) here: the
  supervisor could not keep up; vllm.log has them (lines A-Z)``.
  Splice path: while the forwarding drops (or the supervisor is gone) the relay moves the pipes
  into ``vllm.log`` with `splice()` (`os.splice`, Python >= 3.10; read()/write() where it is
  missing or the file system refuses it): no copy through the relay, which then costs about
  what the engine's own write to a file would. Spliced bytes are not looked at, so:
  *CR is kept* in them (a CRLF stays CRLF, a tqdm progress line ``\r 5%|...`` stays on one line
  with its CRs; only during such a burst, where per-line work is what must be avoided); line
  numbers (`lineno`, `locate`, drop markers) count LFs. *Lines stay whole*: a splice that stops
  mid-line (the relay reads back the last byte from the page cache) makes that stream own the
  file until its line ends; the other stream's data waits in its pipe, at most 20 ms
  (`OWN_WAIT`), after which the unfinished line is ended with LF (split, like an overlong held
  line, nothing lost) and the other stream goes on; the owner ends its line through a small
  read as soon as its data comes. *Rotation stays at line ends*: a splice stops 64 KiB
  (`MARGIN`) short of `max_bytes` and the read path finishes the file (a line left unfinished
  there and longer than that is split across the two files).
  The relay exits when the pipes reach EOF or when `close()` tells it to; when this process dies
  (kill -9: control EOF without `close()`'s quit command) it stops forwarding but keeps draining
  the engine's pipes into ``vllm.log`` until they reach EOF, so the engine, which lives on in its
  own session until the next `up` stops it, neither blocks, dies of SIGPIPE nor loses its output;
  signals from a terminal or systemd are ignored.
  Known secrets (`secrets`): the relay replaces each value by ``***`` in every line before it
  writes or forwards it (values get it in the source on its stdin, not its argv) and does not
  splice; the writer does the same in the thread fallback. Files are created 0600.
  Fallback (`relay=False`, the relay cannot start, or it dies: a notice is echoed): one
  reader thread per pipe in this process, and the writer thread writes ``vllm.log``; here a
  lagging writer makes the readers drop whole lines from *every* output, ``vllm.log`` included
  (counted, `log_missed_lines` too, and marked in ``vllm.log`` and the echo:
  ``[xpu-serve] dropped N lines (B bytes): log writer could not keep up``). For those threads,
  `start()` lowers the switch interval (`sys.setswitchinterval`, process-wide) to 1 ms, so a
  reader gets the GIL back within ~1 ms of data arriving (at the default 5 ms a 1 MiB pipe
  fills first and the engine waits in `write()`). The pipes are enlarged with
  F_SETPIPE_SZ (16 MiB with CAP_SYS_RESOURCE, else the usual 1 MiB limit);
- one writer thread splits lines and writes the per-process files (and ``vllm.log`` in the
  fallback), the echo queue and the callback; while it is backlogged in relay mode during a
  burst (the relay's state byte) it sleeps 9 times the CPU time it worked on 2 CPUs, as long on
  more (`_DUTY`), leaving CPU to the engine and the relay on small machines;
- one echo thread writes to the supervisor's own stdout (journald, `docker logs`) from a
  bounded queue; a slow or blocked stdout drops echo lines (counted, then a marker
  ``[xpu-serve] echo dropped N lines: output could not keep up``), never the pump. uvicorn
  access lines of `echo_quiet_paths` (the supervisor's own probes) answered below 400 are not
  echoed (they are in every file and reach the callback).

Files, in `log_dir` (the supervisor passes ``RUNTIME/logs/<incarnation>``, see `LogPump.dir_for`):

- ``vllm.log``: every line, in arrival order, raw bytes (CR and CRLF become LF, except in
  bytes spliced during a burst, see above; invalid UTF-8 kept as is; long lines kept whole: a
  partial line longer than max(1 MiB, `max_line_bytes`) is written out split, no byte lost).
  Size-rotated: ``vllm.log`` -> ``vllm.log.1`` ... ``vllm.log.<backups>``, at line
  boundaries, once a file would pass `max_bytes`. The relay is its only writer and appends at
  the end it tracks (no O_APPEND: `splice()` refuses it): do not truncate it from outside.
- one file per vLLM process, demuxed by vLLM's prefix ``(Name pid=N) `` (vllm/utils
  `decorate_logs`/`_add_prefix`; parsed with `xpu_serve.events.split_process_prefix`,
  innermost prefix wins): ``APIServer.log``, ``EngineCore.log`` (``EngineCore_DP0`` too),
  ``Worker_TP0.log``...; decoded as UTF-8 with errors="replace", same rotation.
  Early ``(Worker pid=N)`` lines (vllm/v1/executor/multiproc_executor.py names the process
  "Worker" until `setup_proc_title_and_log_prefix` adds ``_TPn``) are held in memory per pid
  and go to that pid's ``Worker_TPn.log`` once a prefixed line reveals it; if none does within
  `pending_timeout_s` (TP=1: the name stays "Worker"), they go to ``Worker.log``.
  oneCCL lines (``YYYY:MM:DD-HH:MM:SS: PID |CCL_WARN| ...``, ``...: PID:[rank] |CCL_...``,
  ``...:PID |CCL_...`` and ``...:(  PID) |CCL_...``, shapes seen in real logs) go to the file of
  the process with that pid, learned from vLLM's prefixes (held like the above, then
  ``unprefixed.log`` if the pid stays unknown).
  Everything else (native crash dumps, uvicorn, Python warnings, tracebacks of the API
  server's own launcher) goes to ``unprefixed.log``.
- lines longer than `max_line_bytes` are cut there and end with
  `` [xpu-serve] line truncated: N bytes dropped`` (per-process files, echo, callback; in
  ``vllm.log`` only in the thread fallback).

Disk errors (ENOSPC, EROFS, EIO...) degrade: the file is closed, `write_errors` counted, one
notice is echoed, the echo and the callback go on, and the file is retried every
`retry_interval_s`; when it works again, a marker line says how many lines it missed
(``[xpu-serve] N lines not written to this file: [Errno 28] No space left on device``). For
``vllm.log`` the relay does this itself: it keeps reading (the engine is never blocked) and
forwarding; missed lines are in `log_missed_lines`. They take no line numbers (the numbering
stays that of the file: callbacks get the number of the next line written there), and a drop of
their forwarding is marked ``[xpu-serve] dropped N lines (B bytes) here: the supervisor could not
keep up; vllm.log could not take them either (write error)``. A file deleted while open (an
operator freeing a full disk with ``rm``; its blocks would stay in use and what follows would be
lost) is noticed within a second and started again, its directory made again if it went too.

API (the supervisor calls)::

    pump = LogPump(LogPump.dir_for(runtime_dir, n), incarnation=n, echo=sys.stdout, on_line=cb,
                   echo_quiet_paths=("/health", "/metrics", "/v1/models"))  # the probes' paths
    proc = subprocess.Popen(argv, stdout=PIPE, stderr=PIPE, start_new_session=True, ...)
    pump.start(proc.stdout, proc.stderr)     # takes ownership of both pipes (file objects or fds)
    ...
    pump.flush(timeout=2.0)    # before the bundle: all the engine wrote so far is in vllm.log
    where = pump.locate(lineno)  # (rotated file, line in it) of a callback's lineno
    # stop the tree, then:
    pump.wait_eof(timeout=5.0)  # True once both pipes hit EOF and everything is written
    stats = pump.close()        # PumpStats; ends the relay, closes pipes and files, joins threads

The supervisor must not read or close the pipes itself after `start()`. With
`asyncio.create_subprocess_exec`, pass ``stdout=w`` of an `os.pipe()` and give the pump the
read end instead. The relay is a process of the supervisor, outside the engine's session:
sweeps of the engine's session or of processes with the incarnation's environment marker do
not find it (it has the supervisor's environment), and it ends on its own (see above).

`on_line(line: str, lineno: int)` is called from the writer thread, once per line, in the
order of ``vllm.log``, after the line has been written to the files (so a callback that
triggers a bundle finds it on disk). `line` has no newline; `lineno` is 1-based in the
incarnation's logical ``vllm.log`` (rotated parts concatenated oldest first; the pump's marker
lines take numbers too but are not passed to the callback; lines whose forwarding was dropped
keep their numbers, so ``vllm.log`` line `lineno` is `line`; lines that ``vllm.log`` could not
take, a disk error, take none: they get the number of the next line written there, the marker
saying how many it missed). It must be quick and must not
block: while it runs, lines pile up in the buffer, and past `buffer_cap_bytes` their
forwarding is dropped (counted), never the engine stalled. Exceptions it raises are counted
(`callback_errors`), reported once on the echo, and ignored. Dropped lines never reach it.
In relay mode `locate` follows the rotations the writer has seen (it lags the relay by the
frames not yet processed) and is exact while ``vllm.log`` had no write errors and the relay
did not die (lines it had written but not forwarded then shift the numbers).

Written here rather than with `logging.handlers.RotatingFileHandler`: that handler formats and
writes one record at a time under a lock (too slow for a 100 MB burst) and cannot rotate raw
byte batches at line boundaries; the rest is the domain's own log shape.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import re
import select
import subprocess
import sys
import termios
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from xpu_serve.events import split_process_prefix
from xpu_serve.sources import log_relay

_READ_SIZE = 1 << 20  # bytes per read()
# F_SETPIPE_SZ targets, largest first: above /proc/sys/fs/pipe-max-size (1 MiB by default) only
# with CAP_SYS_RESOURCE. More kernel slack = more time the child can write while a reader
# thread waits for the GIL.
_PIPE_SIZES = (16 << 20, 4 << 20, 1 << 20)
_BATCH_BYTES = 512 << 10  # writer takes at most this much per round (keeps GIL holds short)
# The reader threads need the GIL back after every read(); CPython hands it over after the
# switch interval (default 5 ms), during which a busy writer thread keeps it and the pipe fills.
_SWITCH_INTERVAL_S = 0.001
_MAX_PROCESS_FILES = 64  # distinct per-process files before falling back to unprefixed.log
_PENDING_CAP_BYTES = 1 << 20  # per pid, held Worker/oneCCL lines before forced resolution

# oneCCL's log line prefix, as seen in the real logs of tests/fixtures/cases
# (qwen3-30b-worker0-died, b70-worker0-died-ccl, b60-out-of-resources): "YYYY:MM:DD-HH:MM:SS:"
# then the pid as " PID", "PID", " PID:[rank]" or "(  PID)" (width-padded), then " |CCL_LEVEL|".
_CCL_RE = re.compile(r"\d{4}:\d\d:\d\d-\d\d:\d\d:\d\d:\s*(?:\(\s*(\d+)\)|(\d+))(?::\[\d+\])?\s*\|CCL_")
_SAFE_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]")
_EARLY_WORKER_RE = re.compile(r"VllmWorker-\d+$")  # a worker's first prefix (vLLM 0.32)
# uvicorn's access line (uvicorn/logging.py `AccessFormatter`: '%(client_addr)s - "%(request_line)s"
# %(status_code)s', request_line "METHOD full_path HTTP/version", status "200 OK"), as vLLM's API
# server prints it: '(APIServer pid=N) INFO:     127.0.0.1:51234 - "GET /health HTTP/1.1" 200 OK'.
# Groups: path without the query string, status code.
_ACCESS_RE = re.compile(r' - "[A-Z]+ ([^ "?]*)(?:\?[^ "]*)? HTTP/[0-9.]+" (\d{3})\b')

OnLine = Callable[[str, int], None]

# Queue items: (kind, stream, data, a, b); also the relay's frame kinds (see `xpu_serve.sources.log_relay`).
# _FALLBACK (queue only): the relay died, the writer writes vllm.log from here on.
_DATA, _DROP, _EOF, _ACK, _ROT, _MARK = log_relay.DATA, log_relay.DROP, log_relay.EOF, log_relay.ACK, log_relay.ROT, log_relay.MARK
_ERR, _LOGOK, _LOGMISS, _UDATA, _UDROP = log_relay.ERR, log_relay.LOGOK, log_relay.LOGMISS, log_relay.UDATA, log_relay.UDROP
_FALLBACK = 11
_Item = tuple[int, int, bytes | memoryview, int, int]  # (data: memoryview for a cut frame)
_FRAME = log_relay.FRAME  # relay frame header: kind, stream, a, b
_HOLD_MIN = 1 << 20  # relay: a partial line longer than max(this, max_line_bytes) is written out split
# Relay mode, supervisor backlogged *and* the relay says the input is a burst (its state byte):
# the writer thread sleeps (1 / _DUTY - 1) times the CPU time it worked, leaving the CPU to the
# engine and the relay on small machines (the relay drops forwarding meanwhile, counted; vllm.log
# is not affected); once the burst is over it catches up at full speed (and a flush() after the
# engine died is not slowed). bench/bench_pump.py block mode, 2 CPUs, load ~1.7, 7 runs each:
# the supervisor's CPU until the child's exit 64 ms at 0.2, 40 ms at 0.1, 41 ms at 0.05 (child
# x0.57, x0.68, x0.57 of its rate to a file: noisy). With more CPUs the engine and the relay
# have cores of their own: 0.5 (not measured here).
_DUTY = 0.1 if len(os.sched_getaffinity(0)) <= 2 else 0.5
_DUTY_MAX_SLEEP_S = 0.1  # per batch (a batch is ~5 ms of work)
_QUEUE_CAP = 4 << 20  # relay mode: bytes queued in the supervisor before it stops reading the relay

# The relay (`xpu_serve.sources.log_relay`): a standalone stdlib-only program started by path in
# its own interpreter (`python -I -S`); see its docstring for the arguments, frames and control pipe.
_RELAY_PATH = Path(log_relay.__file__)
_RELAY_NAME = "xpu-serve-log-relay"  # argv[1]: what `ps` shows the relay as


@dataclass(frozen=True)
class PumpStats:
    """Counters of one pump (one incarnation).

    Attributes:
        lines: lines of the engine written out (to files when the disk works) and passed to the
            callback; the pump's own marker lines are not counted.
        bytes: bytes read from the pipes, dropped ones included (after CR -> LF in relay mode).
        dropped_lines, dropped_bytes: not passed to the per-process files, the echo and the
            callback because the supervisor side could not keep up (each loss marked there).
            In relay mode they are in vllm.log all the same; in the thread fallback they are
            lost from vllm.log too (and marked there).
        write_errors: failed file writes/opens/rotations (disk full, read-only...).
        echo_dropped: lines not echoed because the supervisor's stdout was slow or broken.
        truncated_lines: lines cut at `max_line_bytes`.
        callback_errors: exceptions raised by `on_line`.
        log_missed_lines: lines missing from ``vllm.log`` (and not marked there until it is
            writable again): failed writes; in the thread fallback also `dropped_lines`.
    """

    lines: int = 0
    bytes: int = 0
    dropped_lines: int = 0
    dropped_bytes: int = 0
    write_errors: int = 0
    echo_dropped: int = 0
    truncated_lines: int = 0
    callback_errors: int = 0
    log_missed_lines: int = 0


def _enlarge_pipe(fd: int) -> None:
    for size in _PIPE_SIZES:  # not a pipe (a file, a pty): all fail, harmless
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
            return
        except OSError:
            continue


def _bytes_in_pipe(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD), 0 if unknown."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return 0
    return buf[0]


class _RotatingFile:
    """Append-only file rotated at line boundaries: path -> path.1 -> ... -> path.<backups>.

    `write()` raises OSError on disk errors; the caller decides what to do (see `_Sink`).
    """

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._fd: int | None = None
        self._size = 0
        self.lines = 0  # lines written by this object, all parts together
        # 0-based index (in `lines`) of the first line of path, path.1, path.2...
        self.starts: list[int] = [0]
        self._link_t = 0.0  # monotonic: next check that the open file was not deleted

    def _open(self) -> int:
        if self._fd is not None and time.monotonic() >= self._link_t:
            # deleted while open (an operator freeing a full disk: its blocks stay in use while
            # it is open, what is written to it is lost): start a new file, as after a rotation
            self._link_t = time.monotonic() + 1.0
            try:
                gone = os.fstat(self._fd).st_nlink == 0
            except OSError:
                gone = False
            if gone:
                self.close()
                self.starts.insert(0, self.lines)
                del self.starts[self.backups + 1 :]
        if self._fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            try:
                fd = os.open(self.path, flags, 0o600)
            except FileNotFoundError:  # its directory was removed too: make it again
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, flags, 0o600)
            try:
                self._size = os.fstat(fd).st_size
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
        return self._fd

    def write(self, data: bytes) -> None:
        """Append `data` (whole lines, ending with LF), rotating before a file passes max_bytes.

        A single line longer than max_bytes gets a file of its own.
        """
        pos, end = 0, len(data)
        while pos < end:
            fd = self._open()
            room = self.max_bytes - self._size
            if end - pos <= room:
                stop = end
            else:
                cut = data.rfind(b"\n", pos, pos + max(room, 0))
                if cut >= 0:
                    stop = cut + 1
                elif self._size > 0:
                    self._rotate()
                    continue
                else:
                    nl = data.find(b"\n", pos)
                    stop = end if nl < 0 else nl + 1
            view = memoryview(data)[pos:stop]
            while view:
                n = os.write(fd, view)
                self._size += n
                view = view[n:]
            self.lines += data.count(b"\n", pos, stop)
            pos = stop
            if pos < end:
                self._rotate()

    def _rotate(self) -> None:
        self.close()
        self.starts.insert(0, self.lines)
        del self.starts[self.backups + 1 :]
        log_relay.shift_backups(str(self.path), self.backups)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


class _Sink:
    """A `_RotatingFile` that degrades on disk errors instead of raising (writer thread only)."""

    def __init__(self, pump: LogPump, name: str, file: _RotatingFile | None = None) -> None:
        self.pump = pump
        self.file = file or _RotatingFile(pump.log_dir / name, pump.max_bytes, pump.backups)
        self.is_vlog = name == "vllm.log"
        self.broken_until = 0.0  # monotonic; 0 = healthy
        self.missed_lines = 0
        self.error: str | None = None

    def write(self, data: bytes, nlines: int) -> None:
        if self.broken_until:
            if time.monotonic() < self.broken_until:
                self.missed(nlines)
                return
            marker = (
                f"[xpu-serve] {self.missed_lines} lines not written to this file: {self.error}\n"
            ).encode()
            if not self._try(marker + data):
                self.missed(nlines)
                return
            self.pump._echo_notice(
                f"log file {self.file.path} writable again ({self.missed_lines} lines missed)"
            )
            self.broken_until = 0.0
            self.missed_lines = 0
            return
        if not self._try(data):
            self.missed(nlines)
            self.pump._echo_notice(
                f"log write to {self.file.path} failed: {self.error}; going on without it "
                f"(echo and analysis continue)"
            )

    def missed(self, nlines: int) -> None:
        self.missed_lines += nlines
        if self.is_vlog:
            self.pump._log_missed += nlines

    def _try(self, data: bytes) -> bool:
        try:
            self.file.write(data)
            return True
        except OSError as e:
            self.pump._write_errors += 1
            self.error = f"[Errno {e.errno}] {os.strerror(e.errno) if e.errno else e}"
            self.file.close()
            self.broken_until = time.monotonic() + self.pump.retry_interval_s
            return False

    def close(self) -> None:
        self.file.close()


@dataclass
class _Pending:
    since: float
    size: int
    lines: list[str]
    worker: bool  # at least one "(Worker pid=N)" line (else oneCCL lines only)


class LogPump:
    """Pumps one incarnation's stdout/stderr pipes (see the module docstring for the contract).

    Args:
        log_dir: directory for the files, created if missing (``RUNTIME/logs/<incarnation>``).
        incarnation: number used in the echo tag ``[i<incarnation>] ``.
        echo: text stream for the echo (the supervisor's stdout), or None for no echo.
        on_line: ``on_line(line: str, lineno: int)``, writer thread, in order; see module docstring.
        max_bytes: rotate a file before it passes this size (bytes).
        backups: rotated files kept per file (``vllm.log.1`` ... ``vllm.log.<backups>``).
        buffer_cap_bytes: bytes read but not yet handled by the writer before the forwarding
            drops whole lines (relay: from the per-process files, echo and callback only;
            thread fallback: from every output).
        max_line_bytes: longer lines are cut here (and marked).
        echo_cap_bytes: echo text queued but not yet written before echo lines are dropped.
        pending_timeout_s: how long early ``(Worker pid=N)``/oneCCL lines wait for their pid's
            final process name before going to ``Worker.log``/``unprefixed.log``.
        retry_interval_s: after a disk error, retry the file after this many seconds.
        relay: read the pipes in a relay process (default; see the module docstring) rather
            than in reader threads of this process (the fallback if the relay cannot start or dies).
        echo_quiet_paths: request paths (exact, e.g. ``("/health", "/metrics", "/v1/models")``)
            whose uvicorn access lines with a status below 400 are not echoed (any method; the
            query string is ignored): the supervisor's own probes would flood journald /
            ``docker logs``. They stay in ``vllm.log``, the per-process files and the callback;
            access lines with status >= 400 are echoed.
        secrets: known secret values (the engine's API key...) replaced by ``***`` in every
            output (``vllm.log``, the per-process files, the echo, the callback), line by line so
            that line numbers stay (values holding CR or LF are left out); the caller decides
            which values count (the supervisor: `xpu_serve.redact.Redactor.secrets`). With any,
            the relay does not splice (it must see every byte).
    """

    def __init__(
        self,
        log_dir: Path,
        incarnation: int,
        echo: TextIO | None = None,
        on_line: OnLine | None = None,
        max_bytes: int = 64 * 1024**2,
        backups: int = 5,
        buffer_cap_bytes: int = 16 * 1024**2,
        max_line_bytes: int = 64 * 1024,
        echo_cap_bytes: int = 1024**2,
        pending_timeout_s: float = 60.0,
        retry_interval_s: float = 1.0,
        relay: bool = True,
        echo_quiet_paths: tuple[str, ...] = (),
        secrets: Iterable[str] = (),
    ) -> None:
        if max_bytes <= 0 or buffer_cap_bytes <= 0 or max_line_bytes <= 0 or backups < 0:
            raise ValueError("LogPump: max_bytes, buffer_cap_bytes, max_line_bytes must be > 0, backups >= 0")
        self.log_dir = Path(log_dir)
        self.incarnation = incarnation
        self.echo = echo
        self.on_line = on_line
        self.max_bytes = max_bytes
        self.backups = backups
        self.buffer_cap_bytes = buffer_cap_bytes
        self.max_line_bytes = max_line_bytes
        self.echo_cap_bytes = echo_cap_bytes
        self.pending_timeout_s = pending_timeout_s
        self.retry_interval_s = retry_interval_s
        self.relay = relay
        self.echo_quiet_paths = tuple(echo_quiet_paths)
        self._quiet = frozenset(echo_quiet_paths)
        self._tag = f"[i{incarnation}] "
        forms = {x.encode("utf-8", "surrogateescape") for x in secrets if x}
        # longest first: a value containing another is replaced whole
        self._secrets = sorted((f for f in forms if b"\n" not in f and b"\r" not in f), key=len, reverse=True)
        self._relay: subprocess.Popen[bytes] | None = None
        self._relay_out = -1  # read end of the relay's frame pipe
        self._relay_ctl = -1  # write end of the relay's control pipe
        self._relay_ack = -1  # read end of the relay's flush acknowledgements (8-byte sequences)
        self._relay_state = -1  # memfd: the relay's state byte (1: the input is a burst)
        self._ack_buf = b""
        self._log_acked = 0  # highest flush sequence the relay has in vllm.log
        self._flush_lock = threading.Lock()  # one flush() reads the ack pipe at a time
        self._flush_seq = 0
        self._acked = 0  # highest flush sequence processed by the writer

        # Shared between readers and the writer (under _cond).
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._buffered = 0
        self._enqueued = 0  # items ever queued (flush barrier)
        self._processed = 0  # items ever processed by the writer
        self._bytes_read = 0
        self._open_streams = 0
        self._stop = False
        self._stop_deadline = 0.0
        self._writer_done = False
        self._eof_done = False

        # Writer-thread state.
        self._carry: dict[int, bytes] = {}
        self._cut: dict[int, int] = {}  # stream -> bytes dropped from a line being truncated
        self._sinks: dict[str, _Sink] = {}
        self._pid_name: dict[int, str] = {}
        self._pending: dict[int, _Pending] = {}
        self._lineno = 0
        self._unlogged = False  # _process: the lines being fed are not in vllm.log (_UDATA)
        self._lines = 0
        self._dropped_lines = 0
        self._dropped_bytes = 0
        self._write_errors = 0
        self._truncated = 0
        self._callback_errors = 0
        self._callback_reported = False
        self._log_missed = 0
        # vllm.log's line bookkeeping (`locate`): written through in thread mode; in relay mode
        # the relay writes the file and the writer only keeps `lines` and `starts` from frames.
        self._vlog = _RotatingFile(self.log_dir / "vllm.log", max_bytes, backups)
        self._relay_log = False  # the relay writes vllm.log (writer thread's view, in queue order)
        self._dest_names: set[str] = set()  # per-process outputs seen so far (drop markers)

        # Echo thread state (under _echo_cond).
        self._echo_cond = threading.Condition()
        self._echo_q: deque[str] = deque()
        self._echo_size = 0
        self._echo_dropped = 0
        self._echo_dropped_pending = 0  # dropped since the last marker
        self._echo_stop = False

        self._threads: list[threading.Thread] = []
        self._fds: list[int] = []
        self._read_by: list[int] = []  # bytes read per stream (under _cond)
        self._eof: list[bool] = []  # per stream (under _cond)
        self._owned: list[BinaryIO | int] = []  # what start() was given, closed by close()
        self._wake_r = self._wake_w = -1
        self._started = False
        self._closed = False

    # --- public API ---------------------------------------------------------------------------

    @staticmethod
    def dir_for(runtime_dir: Path, incarnation: int) -> Path:
        """``RUNTIME/logs/<incarnation>``: where an incarnation's logs go."""
        return Path(runtime_dir) / "logs" / str(incarnation)

    @property
    def log_path(self) -> Path:
        """Path of the current (newest) combined log, ``<log_dir>/vllm.log``."""
        return self.log_dir / "vllm.log"

    def locate(self, lineno: int) -> tuple[Path, int] | None:
        """Where line `lineno` of the logical ``vllm.log`` is now: (file, 1-based line in it).

        ``vllm.log`` itself or a rotated ``vllm.log.K``; None when the line was rotated away
        (beyond `backups`) or is not written yet. Exact while the disk had no write errors
        (lines that failed to be written shift the numbers). Any thread.
        """
        f = self._vlog
        if lineno < 1:
            return None
        starts = list(f.starts)
        if lineno > f.lines:
            return None
        for k, first in enumerate(starts):
            if lineno - 1 >= first:
                return (f.path if k == 0 else f.path.with_name(f"{f.path.name}.{k}")), lineno - first
        return None

    def start(self, stdout: BinaryIO | int | None, stderr: BinaryIO | int | None = None) -> None:
        """Start pumping the read ends of the child's pipes (file objects or fds; None = absent).

        The pump takes ownership: it closes them in `close()`. Both may be the same pipe's
        single end only once (pass stderr=None when the child's stderr goes to stdout).
        Raises RuntimeError if called twice; OSError if `log_dir` cannot be created is NOT
        raised (disk errors degrade, see the module docstring).
        """
        if self._started:
            raise RuntimeError("LogPump.start() called twice")
        self._started = True
        if sys.getswitchinterval() > _SWITCH_INTERVAL_S:
            sys.setswitchinterval(_SWITCH_INTERVAL_S)  # process-wide, see the module docstring
        with contextlib.suppress(OSError):
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        fds = []
        for s in (stdout, stderr):
            if s is None:
                continue
            fd = s if isinstance(s, int) else s.fileno()
            self._owned.append(s)
            fds.append(fd)
        self._fds = fds
        self._read_by = [0] * len(fds)
        self._eof = [False] * len(fds)
        self._open_streams = len(fds)
        for fd in fds:
            _enlarge_pipe(fd)
            os.set_blocking(fd, False)
        if fds and self.relay and self._start_relay(fds):
            self._relay_log = True
            self._threads.append(threading.Thread(target=self._relay_reader, name="pump-relay", daemon=True))
        else:
            for i, fd in enumerate(fds):
                self._threads.append(
                    threading.Thread(target=self._reader, args=(i, fd), name=f"pump-read-{i}", daemon=True)
                )
        self._threads.append(threading.Thread(target=self._writer, name="pump-write", daemon=True))
        if self.echo is not None:
            self._threads.append(threading.Thread(target=self._echoer, name="pump-echo", daemon=True))
        if not fds:
            self._eof_done = True  # nothing to pump
        for t in self._threads:
            t.start()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything the child has written so far is in ``vllm.log``, and (within
        `timeout`) in the per-process files and through the callback.

        "So far" is what the pipes hold at the call plus what was already read. Relay mode: the
        relay reads the pipes dry into ``vllm.log`` and acknowledges on a pipe of its own (so a
        slow supervisor side does not delay it); then this waits for the writer to reach the same
        point, at most until the timeout (a blocked callback does not make it False). Thread
        mode: FIONREAD, then the writer. Partial lines (no newline yet) and held early
        Worker/oneCCL lines stay held. Returns False when ``vllm.log`` is not known to have it
        all within `timeout` (seconds).
        """
        deadline = time.monotonic() + timeout
        if self._relay is not None and self._relay_ctl >= 0 and not self._eof_done:
            with self._flush_lock:
                with self._cond:
                    self._flush_seq += 1
                    seq = self._flush_seq
                try:
                    os.write(self._relay_ctl, b"F" + seq.to_bytes(8, "big"))
                    logged = self._wait_log_ack(seq, deadline)
                except OSError:
                    logged = None
            if logged is None:
                # The relay is gone. Status 0: it read every pipe to EOF into vllm.log and ended;
                # else it died (the fallback threads and the FIONREAD wait below settle it).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._relay.wait(max(0.0, deadline - time.monotonic()))
                logged = True if self._relay.returncode == 0 else None
            if logged is not None:
                if not logged:
                    return False
                with self._cond:  # vllm.log has it: give the writer what is left of the timeout
                    while self._acked < seq and not self._eof_done and not self._writer_done:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                return True
        with self._cond:
            targets = [
                (i, self._read_by[i] + _bytes_in_pipe(fd))
                for i, fd in enumerate(self._fds)
                if not self._eof[i]
            ]
            while any(self._read_by[i] < t and not self._eof[i] for i, t in targets):
                left = deadline - time.monotonic()
                if left <= 0 or self._writer_done:
                    return False
                self._cond.wait(left)
            target = self._enqueued
            self._cond.notify_all()
            while self._processed < target and not self._writer_done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _wait_log_ack(self, seq: int, deadline: float) -> bool | None:
        """Read the relay's ack pipe until `seq` is acknowledged: True; timeout: False; the
        relay is gone: None (caller holds `_flush_lock`)."""
        poller = select.poll()
        poller.register(self._relay_ack, select.POLLIN)
        while self._log_acked < seq:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return False
            try:
                data = os.read(self._relay_ack, 4096)
            except BlockingIOError:
                continue
            if not data:
                return None
            buf = self._ack_buf + data
            while len(buf) >= 8:
                self._log_acked = max(self._log_acked, int.from_bytes(buf[:8], "big"))
                buf = buf[8:]
            self._ack_buf = buf
        return True

    def wait_eof(self, timeout: float | None = None) -> bool:
        """Wait until both pipes reached EOF and every line is written (partial last lines and
        held Worker/oneCCL lines included). Returns False on timeout (seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._eof_done and not self._writer_done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stats(self) -> PumpStats:
        """A snapshot of the counters (any thread; values may lag the writer by one batch)."""
        return PumpStats(
            lines=self._lines,
            bytes=self._bytes_read,
            dropped_lines=self._dropped_lines,
            dropped_bytes=self._dropped_bytes,
            write_errors=self._write_errors,
            echo_dropped=self._echo_dropped,
            truncated_lines=self._truncated,
            callback_errors=self._callback_errors,
            log_missed_lines=self._log_missed,
        )

    def close(self, timeout: float = 5.0) -> PumpStats:
        """Stop: read what the pipes still hold, write everything, close pipes and files.

        Call after the child tree is gone (or after `wait_eof`); a still-running child that
        writes later gets EPIPE. The echo gets up to `timeout` seconds to drain; what it
        cannot write is counted in `echo_dropped`. Idempotent; returns the final stats.
        """
        if self._closed:
            return self.stats()
        self._closed = True
        if not self._started:
            return self.stats()
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stop_deadline = deadline - timeout / 2
            self._stop = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._relay_ctl >= 0:
            with contextlib.suppress(OSError):
                os.write(self._relay_ctl, b"Q" + bytes(8))  # (EOF alone: we died, it keeps going)
            with contextlib.suppress(OSError):
                os.close(self._relay_ctl)  # the relay reads what is left, sends EOF frames, exits
            self._relay_ctl = -1
        relay = self._relay
        if relay is not None:
            try:
                relay.wait(max(0.1, deadline - time.monotonic() - 0.2))
            except subprocess.TimeoutExpired:  # a child still writing, or the relay stuck
                relay.kill()
                relay.wait(5)
        for t in self._threads:
            if t.name != "pump-echo":
                t.join(max(0.0, deadline - time.monotonic()))
        with self._echo_cond:
            self._echo_stop = True
            self._echo_cond.notify_all()
        for t in self._threads:
            if t.name == "pump-echo":
                t.join(max(0.1, deadline - time.monotonic()))
                if t.is_alive():  # blocked on a stuck stdout: count what it will not write
                    with self._echo_cond:
                        self._echo_dropped += sum(s.count("\n") for s in self._echo_q)
                        self._echo_q.clear()
        for obj in self._owned:
            with contextlib.suppress(OSError, ValueError):
                if isinstance(obj, int):
                    os.close(obj)
                else:
                    obj.close()
        for fd in (self._wake_r, self._wake_w, self._relay_out, self._relay_ack, self._relay_state):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return self.stats()

    # --- relay --------------------------------------------------------------------------------

    def _start_relay(self, fds: list[int]) -> bool:
        """Start the relay process on the engine's pipes; False (threads instead) if it cannot."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        ack_r, ack_w = os.pipe2(os.O_CLOEXEC)
        try:
            state = os.memfd_create("xpu-serve-relay-state", os.MFD_CLOEXEC)
            os.pwrite(state, b"\0", 0)
        except (OSError, AttributeError):  # no memfd: reads as "calm" (b""), no duty sleep
            state = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        _enlarge_pipe(out_r)
        argv = [sys.executable, "-I", "-S", str(_RELAY_PATH), _RELAY_NAME, str(self.buffer_cap_bytes)]
        argv += [str(out_w), str(ctl_r), str(ack_w), str(self.log_path), str(self.max_bytes), str(self.backups)]
        argv += [repr(self.retry_interval_s), str(max(_HOLD_MIN, self.max_line_bytes)), str(state)]
        argv += [str(fd) for fd in fds]
        relay = None
        try:
            relay = subprocess.Popen(
                argv,
                pass_fds=(out_w, ctl_r, ack_w, state, *fds),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # not in the engine's process group: outlives its kill
            )
            assert relay.stdin is not None
            with relay.stdin:
                # a few bytes: fit in the pipe, no deadlock; the secrets travel in it, not on argv
                relay.stdin.write(b"".join(s.hex().encode() + b"\n" for s in self._secrets))
        except OSError:
            if relay is not None:  # started but already gone (its stdin broke)
                relay.kill()
                relay.wait(5)
            for fd in (out_r, out_w, ctl_r, ctl_w, ack_r, ack_w, state):
                os.close(fd)
            return False
        self._relay = relay
        os.close(out_w)
        os.close(ctl_r)
        os.close(ack_w)
        self._relay_ack = ack_r
        self._relay_state = state
        self._relay_out, self._relay_ctl = out_r, ctl_w
        return True

    def _relay_bursting(self) -> bool:
        """The relay's state byte: the engine is writing a burst (not calm), see `xpu_serve.sources.log_relay`."""
        try:
            return os.pread(self._relay_state, 1, 0) == b"\1"
        except OSError:
            return False

    def _relay_reader(self) -> None:
        """Parse the relay's frames into the writer's queue (blocks when the queue is full,
        which makes the relay buffer, then drop forwarding, instead of the engine blocking)."""
        fd = self._relay_out
        buf = bytearray()
        hsize = _FRAME.size
        cond = self._cond
        while True:
            try:
                data = os.read(fd, _READ_SIZE)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            pos = 0
            items: list[_Item] = []
            nbytes = 0
            while len(buf) - pos >= hsize:
                kind, stream, a, b = _FRAME.unpack_from(buf, pos)
                if kind == _DATA or kind == _UDATA:
                    if len(buf) - pos - hsize < a:
                        break
                    items.append((kind, stream, bytes(buf[pos + hsize : pos + hsize + a]), 0, 0))
                    nbytes += a
                    pos += hsize + a
                else:
                    items.append((kind, stream, b"", a, b))
                    pos += hsize
            del buf[:pos]
            if not items:
                continue
            with cond:
                while self._buffered > _QUEUE_CAP and not self._stop:
                    cond.wait(0.5)
                for item in items:
                    kind, stream = item[0], item[1]
                    if kind == _DROP or kind == _UDROP:
                        self._bytes_read += item[4]
                    elif kind == _EOF:
                        self._eof[stream] = True
                    self._queue.append(item)
                self._bytes_read += nbytes
                self._buffered += nbytes
                self._enqueued += len(items)
                cond.notify_all()
        # The relay exited. Normal: every stream got its EOF frame. Otherwise it died: say so and
        # read the remaining pipes here (the engine must not get EPIPE for our trouble).
        relay = self._relay
        left = [i for i, done in enumerate(self._eof) if not done]
        if not left:
            return
        code = relay.poll() if relay is not None else None
        if not self._stop:  # (close() may kill a relay stuck on a child that keeps writing)
            self._echo_notice(
                f"log relay process ended unexpectedly (status {code}); reading the pipes in-process "
                "from here (lines it had not forwarded are in vllm.log only; a partial line it held is lost)"
            )
        with cond:
            self._relay_ctl, ctl = -1, self._relay_ctl  # flush() falls back to FIONREAD
            self._queue.append((_FALLBACK, 0, b"", 0, 0))  # the writer writes vllm.log from here
            self._enqueued += 1
            cond.notify_all()
        if ctl >= 0:
            with contextlib.suppress(OSError):
                os.close(ctl)
        readers = [
            threading.Thread(target=self._reader, args=(i, self._fds[i]), name=f"pump-read-{i}", daemon=True)
            for i in left
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join()

    # --- reader threads -----------------------------------------------------------------------

    def _reader(self, stream: int, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        poller.register(self._wake_r, select.POLLIN)
        dropping = False
        drop_lines = drop_bytes = 0
        drop_tail = False  # dropped bytes after the last dropped newline (a partial line)
        cap = self.buffer_cap_bytes
        resume = cap // 2
        cond = self._cond
        queue = self._queue
        while True:
            try:
                chunk = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                if self._stop:
                    break  # close(): the pipe is drained and the child is expected gone
                poller.poll()
                continue
            except OSError:
                chunk = b""
            if not chunk:
                break
            if self._stop and time.monotonic() > self._stop_deadline:
                break  # close() on a child that keeps writing: stop draining at the deadline
            n = len(chunk)
            with cond:
                self._bytes_read += n
                self._read_by[stream] += n
                if dropping:
                    if self._buffered > resume:
                        drop_lines += chunk.count(b"\n")
                        drop_bytes += n
                        drop_tail = not chunk.endswith(b"\n")
                        cond.notify_all()
                        continue
                    nl = chunk.find(b"\n")
                    if nl < 0:
                        drop_bytes += n
                        drop_tail = True
                        cond.notify_all()
                        continue
                    drop_lines += 1
                    drop_bytes += nl + 1
                    queue.append((_DROP, stream, b"", drop_lines, drop_bytes))
                    self._enqueued += 1
                    dropping, drop_tail = False, False
                    chunk = chunk[nl + 1 :]
                    if not chunk:
                        cond.notify_all()
                        continue
                    n = len(chunk)
                if self._buffered + n > cap:
                    dropping = True
                    drop_lines = chunk.count(b"\n")
                    drop_bytes = n
                    drop_tail = not chunk.endswith(b"\n")
                    cond.notify_all()  # a flush() may wait for these bytes to be read
                    continue
                queue.append((_DATA, stream, chunk, 0, 0))
                self._buffered += n
                self._enqueued += 1
                cond.notify_all()  # the writer, and any flush() waiting for the bytes read
        with cond:
            if dropping:
                queue.append((_DROP, stream, b"", drop_lines + (1 if drop_tail else 0), drop_bytes))
                self._enqueued += 1
            queue.append((_EOF, stream, b"", 0, 0))
            self._enqueued += 1
            self._eof[stream] = True
            cond.notify_all()

    # --- writer thread ------------------------------------------------------------------------

    def _writer(self) -> None:
        try:
            self._writer_loop()
        finally:
            for sink in self._sinks.values():
                sink.close()
            with self._cond:
                self._writer_done = True
                self._cond.notify_all()
            with self._echo_cond:
                self._echo_cond.notify_all()

    def _writer_loop(self) -> None:
        cond = self._cond
        eofs = 0
        nstreams = self._open_streams
        tick = min(1.0, self.pending_timeout_s, self.retry_interval_s)
        while True:
            items: list[_Item] = []
            with cond:
                if not self._queue:
                    if self._stop and eofs >= nstreams:
                        return
                    cond.wait(tick)
                size = 0
                while self._queue and size < _BATCH_BYTES:
                    item = self._queue.popleft()
                    data = item[2]
                    if len(data) > _BATCH_BYTES and item[0] == _DATA:
                        # The relay's frames reach 4 MiB: take a batch's worth (no copy; `_feed`
                        # carries the cut line), so the duty sleep below comes every ~5 ms of work.
                        view = memoryview(data)
                        self._queue.appendleft((_DATA, item[1], view[_BATCH_BYTES:], 0, 0))
                        item = (_DATA, item[1], view[:_BATCH_BYTES], 0, 0)
                    items.append(item)
                    size += len(item[2])
                self._buffered -= size
            if items:
                eofs += sum(1 for it in items if it[0] == _EOF)
                t0 = time.thread_time()
                try:
                    self._process(items)
                except Exception as e:  # a bug here must not stop the pump: the buffer would fill
                    self._echo_notice(f"log pump error {type(e).__name__}: {e}")
                if _DUTY < 1.0 and self._relay_log and size >= _BATCH_BYTES and self._relay_bursting():
                    # CPU time, not wall time: a callback that blocked is no work to pay back.
                    time.sleep(min(_DUTY_MAX_SLEEP_S, (time.thread_time() - t0) * (1.0 / _DUTY - 1.0)))
            self._expire_pending(time.monotonic())
            with cond:
                self._processed += len(items)
                if eofs >= nstreams and not self._queue and not self._eof_done:
                    self._finish()
                    self._eof_done = True
                if items or self._eof_done:
                    cond.notify_all()

    def _process(self, items: list[_Item]) -> None:
        """Turn queued chunks and tokens into lines and write them."""
        out = _Batch()
        i = 0
        while i < len(items):
            kind, s, data, nlines, nbytes = items[i]
            i += 1
            if kind == _EOF:
                rest = self._carry.pop(s, b"")
                cut = self._cut.pop(s, 0)
                if rest.endswith(b"\r"):
                    rest = rest[:-1]
                if rest or cut:
                    self._emit(out, self._finish_line(rest, cut))
            elif kind == _ACK:
                self._write_batch(out)  # everything before the ACK is on disk before flush() returns
                out = _Batch()
                self._acked = max(self._acked, nlines)
            elif kind == _DROP and self._relay_log:
                # Whole lines the relay wrote to vllm.log but did not forward: they take their
                # numbers; the per-process files and the echo say where to find them.
                first = self._lineno + 1
                self._lineno += nlines
                self._not_forwarded(out, nlines, nbytes, f"vllm.log has them (lines {first}-{self._lineno})")
            elif kind == _UDROP:
                # Neither forwarded nor in vllm.log (a disk error): no line numbers.
                self._not_forwarded(out, nlines, nbytes, "vllm.log could not take them either (write error)")
            elif kind == _DROP:
                # The stream's held partial line was cut by the drop: it goes too (its newline,
                # in the dropped bytes, is already in nlines).
                nbytes += len(self._carry.pop(s, b"")) + self._cut.pop(s, 0)
                self._dropped_lines += nlines
                self._dropped_bytes += nbytes
                self._log_missed += nlines
                self._marker(
                    out, f"[xpu-serve] dropped {nlines} lines ({nbytes} bytes): log writer could not keep up"
                )
            elif kind == _ROT:
                f = self._vlog
                f.starts.insert(0, self._lineno)
                del f.starts[self.backups + 1 :]
            elif kind == _MARK:
                self._lineno += nlines
            elif kind == _ERR:
                if nlines:
                    self._write_errors += 1
                if nbytes:  # first failure of a period
                    err = f"[Errno {nlines}] {os.strerror(nlines)}"
                    self._echo_notice(
                        f"log write to {self.log_path} failed: {err}; going on without it "
                        "(per-process files, echo and analysis continue)"
                    )
            elif kind == _LOGOK:
                self._log_missed += nlines
                self._echo_notice(f"log file {self.log_path} writable again ({nlines} lines missed)")
            elif kind == _LOGMISS:
                self._log_missed += nlines
            elif kind == _FALLBACK:
                self._write_batch(out)
                out = _Batch()
                self._relay_log = False
                self._vlog.lines = self._lineno
            else:
                # Coalesce consecutive chunks of the same stream (and kind: _UDATA, lines that
                # vllm.log could not take, take no numbers of their own).
                parts = [data]
                while i < len(items) and items[i][0] == kind and items[i][1] == s:
                    parts.append(items[i][2])
                    i += 1
                self._unlogged = kind == _UDATA
                self._feed(out, s, b"".join(parts) if len(parts) > 1 else data)
                self._unlogged = False
        self._write_batch(out)

    def _feed(self, out: _Batch, s: int, chunk: bytes | memoryview) -> None:
        data = self._carry.pop(s, b"") + chunk
        cut = self._cut.pop(s, 0)
        if b"\r" in data:
            hold = b""
            if data.endswith(b"\r"):
                data, hold = data[:-1], b"\r"  # may be the CR of a CRLF split across reads
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + hold
        nl = data.rfind(b"\n")
        if nl < 0:
            self._hold(s, data, cut)
            return
        body, rest = data[:nl], data[nl + 1 :]
        if cut or len(body) > self.max_line_bytes:
            lines = body.split(b"\n")
            if cut:
                lines[0] = self._finish_line(lines[0], cut)
            if max(map(len, lines)) > self.max_line_bytes:
                lines = [self._finish_line(ln, 0) if len(ln) > self.max_line_bytes else ln for ln in lines]
            body = b"\n".join(lines)
        self._emit(out, body)
        self._hold(s, rest, 0)

    def _hold(self, s: int, data: bytes, cut: int) -> None:
        """Keep a partial line; beyond max_line_bytes keep only its head and count the rest."""
        if len(data) > self.max_line_bytes:
            cut += len(data) - self.max_line_bytes
            data = data[: self.max_line_bytes]
        if data:
            self._carry[s] = data
        if cut:
            self._cut[s] = cut

    def _finish_line(self, line: bytes, cut: int) -> bytes:
        if len(line) > self.max_line_bytes:
            cut += len(line) - self.max_line_bytes
            line = line[: self.max_line_bytes]
        if cut:
            self._truncated += 1
            line += f" [xpu-serve] line truncated: {cut} bytes dropped".encode()
        return line

    def _emit(self, out: _Batch, body: bytes) -> None:
        """Queue engine lines (`body`: lines joined by LF, no final LF) for every output."""
        for sec in self._secrets:  # (relay mode: already replaced there; this covers the fallback)
            if sec in body:
                body = bytes(body).replace(sec, b"***")
        tlines = body.decode("utf-8", "replace").split("\n")
        if not self._relay_log:  # (else the relay wrote them to vllm.log already)
            out.vllm.append(body)
            out.vllm.append(b"\n")
            out.vllm_lines += len(tlines)
        if self._unlogged:  # (not in vllm.log: the number of the next line written there)
            out.text.append((self._lineno + 1, tlines, 0))
        else:
            out.text.append((self._lineno + 1, tlines, 1))
        if self.echo is not None:
            tag = self._tag
            elines = tlines
            if self._quiet:  # (the substring test is the hot path: most lines are not access lines)
                elines = [ln for ln in tlines if " HTTP/" not in ln or not self._is_quiet(ln)]
            if elines:
                out.echo.append(tag + ("\n" + tag).join(elines) + "\n")
        if not self._unlogged:
            self._lineno += len(tlines)
        self._lines += len(tlines)
        self._demux(out, tlines)

    def _is_quiet(self, line: str) -> bool:
        """A uvicorn access line for one of `echo_quiet_paths` with a status below 400."""
        m = _ACCESS_RE.search(line)
        return m is not None and m.group(1) in self._quiet and int(m.group(2)) < 400

    def _not_forwarded(self, out: _Batch, nlines: int, nbytes: int, where: str) -> None:
        """Count lines the relay did not forward and mark the spot in every per-process file
        and the echo ("... dropped N lines (B bytes) here: ...; `where`")."""
        self._dropped_lines += nlines
        self._dropped_bytes += nbytes
        msg = (
            f"[xpu-serve] dropped {nlines} lines ({nbytes} bytes) here: the supervisor could not "
            f"keep up; {where}"
        )
        for name in self._dest_names | set(out.dest) or {"unprefixed"}:
            out.list_for(name).append(msg)
        out.echo.append(self._tag + msg + "\n")

    def _marker(self, out: _Batch, msg: str) -> None:
        out.vllm.append(msg.encode() + b"\n")
        out.vllm_lines += 1
        self._lineno += 1
        out.echo.append(self._tag + msg + "\n")

    def _demux(self, out: _Batch, tlines: list[str]) -> None:
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

    def _route(self, out: _Batch, line: str) -> list[str] | None:
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
            self._resolve_pending(pid)

    def _resolve_pending(self, pid: int) -> None:
        p = self._pending.pop(pid)
        name = "Worker" if p.worker else "unprefixed"
        if p.worker:
            self._pid_name[pid] = "Worker"  # provisional: a later Worker_TPn prefix overrides
        out = _Batch()
        out.dest[name] = p.lines
        self._write_dest(out)

    def _expire_pending(self, now: float) -> None:
        for pid in [pid for pid, p in self._pending.items() if now - p.since >= self.pending_timeout_s]:
            self._resolve_pending(pid)

    def _finish(self) -> None:
        """All streams at EOF: resolve every held line."""
        for pid in list(self._pending):
            self._resolve_pending(pid)

    def _sink(self, name: str) -> _Sink:
        sink = self._sinks.get(name)
        if sink is None:
            if len(self._sinks) >= _MAX_PROCESS_FILES + 1 and name not in ("vllm.log", "unprefixed.log"):
                return self._sink("unprefixed.log")
            sink = self._sinks[name] = _Sink(self, name, self._vlog if name == "vllm.log" else None)
        return sink

    def _write_batch(self, out: _Batch) -> None:
        if self._relay_log:
            self._vlog.lines = self._lineno  # all of them are in vllm.log (locate)
        if out.vllm:
            self._sink("vllm.log").write(b"".join(out.vllm), out.vllm_lines)
        self._write_dest(out)
        # Echo (engine lines and markers, tagged, in order), then the callback.
        self._echo_put(out.echo)
        if self.on_line is not None:
            for first, tlines, step in out.text:
                self._call_back(tlines, first, step)

    def _call_back(self, tlines: list[str], first: int, step: int = 1) -> None:
        cb = self.on_line
        assert cb is not None
        k = 0
        while k < len(tlines):
            try:
                for line in tlines[k:] if k else tlines:
                    cb(line, first + k * step)
                    k += 1
            except Exception as e:  # the callback is the supervisor's; never stop the pump
                k += 1
                self._callback_errors += 1
                if not self._callback_reported:
                    self._callback_reported = True
                    self._echo_notice(f"on_line callback raised {type(e).__name__}: {e}")

    def _write_dest(self, out: _Batch) -> None:
        for name, lines in out.dest.items():
            if not lines:
                continue
            self._dest_names.add(name)
            fname = name + ".log" if name != "unprefixed" else "unprefixed.log"
            fname = _SAFE_NAME_RE.sub("_", fname)
            data = ("\n".join(lines) + "\n").encode("utf-8", "replace")
            self._sink(fname).write(data, len(lines))

    # --- echo thread --------------------------------------------------------------------------

    def _echo_notice(self, msg: str) -> None:
        self._echo_put([f"{self._tag}[xpu-serve] {msg}\n"])

    def _echo_put(self, pieces: list[str]) -> None:
        if self.echo is None or not pieces:
            return
        with self._echo_cond:
            for piece in pieces:
                room = self.echo_cap_bytes - self._echo_size
                dropped = 0
                if len(piece) > room:
                    # Keep the whole lines that fit, drop (and count) the rest of the piece.
                    cut = piece.rfind("\n", 0, max(room - 200, 0)) + 1  # 200: room for the marker
                    dropped = piece.count("\n", cut)
                    piece = piece[:cut]
                if piece:
                    if self._echo_dropped_pending:
                        marker = (
                            f"{self._tag}[xpu-serve] echo dropped {self._echo_dropped_pending} lines: "
                            "output could not keep up\n"
                        )
                        self._echo_q.append(marker)
                        self._echo_size += len(marker)
                        self._echo_dropped_pending = 0
                    self._echo_q.append(piece)
                    self._echo_size += len(piece)
                self._echo_dropped += dropped
                self._echo_dropped_pending += dropped
            self._echo_cond.notify()

    def _echoer(self) -> None:
        echo = self.echo
        assert echo is not None
        # Write bytes to the binary layer when there is one: its lock makes each write atomic
        # against the supervisor's own writes to the same stdout (TextIOWrapper has no lock),
        # and UTF-8 with "replace" cannot fail on a stdout whose text encoding is ASCII.
        binary = getattr(echo, "buffer", None)
        broken = False
        while True:
            with self._echo_cond:
                while not self._echo_q:  # close() sets _echo_stop only after the writer ended
                    if self._echo_stop:
                        return
                    self._echo_cond.wait(0.5)
                pieces = list(self._echo_q)
                self._echo_q.clear()
                self._echo_size = 0
            text = "".join(pieces)
            if broken:
                self._count_echo_lost(text)
                continue
            try:
                if binary is not None:
                    binary.write(text.encode("utf-8", "replace"))
                    binary.flush()
                else:
                    echo.write(text)
                    echo.flush()
            except Exception as e:  # EPIPE, closed stream...: count; stop echoing if it is gone for good
                broken = (isinstance(e, OSError) and e.errno in (errno.EPIPE, errno.EBADF)) or (
                    isinstance(e, ValueError) and "closed" in str(e)
                )
                self._count_echo_lost(text)

    def _count_echo_lost(self, text: str) -> None:
        with self._echo_cond:
            self._echo_dropped += text.count("\n")


class _Batch:
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
