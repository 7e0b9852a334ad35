"""Log pump: the engine's stdout/stderr to disk, per-process files, the echo and a line callback.

The pipes must never block the engine: a supervisor that reads slowly makes vLLM look hung
(every vLLM process logs into the same inherited pipes; a full pipe stalls the writer inside
`write()`, in the middle of a forward pass if it is a worker). The jobs, one module each:

- `log_relay`: a relay process (``python -I -S``, stdlib only, its own session, so the engine's
  tree kill does not touch it; it ignores terminal and systemd signals) drains the pipes and
  itself appends them to ``vllm.log``, the evidence, never dropped from, then forwards the same
  whole lines as frames. When the supervisor falls behind and `buffer_cap_bytes` are queued,
  only the *forwarding* stops (whole lines, counted in `PumpStats.dropped_lines`, marked
  ``[xpu-serve] dropped N lines (B bytes) here: the supervisor could not keep up; vllm.log has
  them (lines A-Z)`` in every per-process file and the echo) and the relay splices the pipes
  into ``vllm.log`` (CRs kept there, lines kept whole). When this process dies (kill -9) the
  relay keeps draining the pipes into ``vllm.log`` until they reach EOF.
- `log_intake`: the relay's frames (or, with `relay=False`, when the relay cannot start or dies:
  one reader thread per pipe, and a notice is echoed) -> the writer's queue. In the thread
  fallback a lagging writer drops whole lines from *every* output, ``vllm.log`` included
  (counted, in `log_missed_lines` too, marked ``[xpu-serve] dropped N lines (B bytes): log
  writer could not keep up``); `start()` lowers the switch interval (process-wide) to 1 ms so a
  reader gets the GIL back within ~1 ms of data arriving; pipes are enlarged with F_SETPIPE_SZ.
- `log_writer` (the writer thread): lines, numbers, redaction, truncation; `log_demux` sorts
  them by process, `log_files` writes the rotating files, `log_echo` echoes them (own thread).
  While backlogged during a burst (the relay's state byte) the writer sleeps 9 times the CPU
  time it worked on 2 CPUs, as long on more (`_DUTY`), leaving CPU to the engine and the relay.

Files, in `log_dir` (the supervisor passes ``RUNTIME/logs/<incarnation>``, see `LogPump.dir_for`),
0600, size-rotated at line ends (``name`` -> ``name.1`` ... ``name.<backups>``):

- ``vllm.log``: every line, in arrival order, raw bytes (CR and CRLF become LF except in bytes
  spliced during a burst; invalid UTF-8 kept; a partial line longer than max(1 MiB,
  `max_line_bytes`) is written out split). The relay is its only writer and appends at the end
  it tracks: do not truncate it from outside.
- one file per vLLM process (``APIServer.log``, ``EngineCore.log``, ``Worker_TP0.log``...,
  ``unprefixed.log``; see `log_demux`), UTF-8 with errors="replace"; lines longer than
  `max_line_bytes` are cut and end with `` [xpu-serve] line truncated: N bytes dropped`` (there,
  in the echo and the callback; in ``vllm.log`` only in the thread fallback).

Disk errors (ENOSPC, EROFS, EIO...) degrade: the file is closed, `write_errors` counted, one
notice echoed, the echo and the callback go on, the file is retried every `retry_interval_s`
and a marker line then says how many lines it missed. Known `secrets` are replaced by ``***``
in every output (in the relay, which then does not splice, or in the writer).

API (the supervisor calls)::

    pump = LogPump(LogPump.dir_for(runtime_dir, n), incarnation=n, echo=sys.stdout, on_line=cb,
                   echo_quiet_paths=("/health", "/metrics", "/v1/models"))  # the probes' paths
    proc = subprocess.Popen(argv, stdout=PIPE, stderr=PIPE, start_new_session=True, ...)
    pump.start(proc.stdout, proc.stderr)     # takes ownership of both pipes (file objects or fds)
    pump.flush(timeout=2.0)    # before the bundle: all the engine wrote so far is in vllm.log
    where = pump.locate(lineno)  # (rotated file, line in it) of a callback's lineno
    # stop the tree, then:
    pump.wait_eof(timeout=5.0)  # True once both pipes hit EOF and everything is written
    stats = pump.close()        # PumpStats; ends the relay, closes pipes and files, joins threads

The supervisor must not read or close the pipes after `start()` (with
`asyncio.create_subprocess_exec`, pass the write end of an `os.pipe()` and give the pump the read
end). The relay is outside the engine's session and has the supervisor's environment: sweeps of
the engine's session or marker do not find it; it ends on its own.

`on_line(line: str, lineno: int)` is called from the writer thread, once per line, in the order
of ``vllm.log``, after the line is in the files (a callback that triggers a bundle finds it on
disk). `line` has no newline; `lineno` is 1-based in the incarnation's logical ``vllm.log``
(rotated parts concatenated oldest first; the pump's marker lines take numbers but are not
passed; lines whose forwarding was dropped keep theirs, so ``vllm.log`` line `lineno` is `line`;
lines ``vllm.log`` could not take, a disk error, take none: they get the number of the next line
written there). It must be quick: while it runs lines pile up, and past `buffer_cap_bytes` their
forwarding is dropped, never the engine stalled. Its exceptions are counted (`callback_errors`),
reported once on the echo, and ignored. In relay mode `locate` follows the rotations the writer
has seen and is exact while ``vllm.log`` had no write errors and the relay did not die.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from xpu_serve.sources.log_echo import Echo
from xpu_serve.sources.log_intake import Intake, RelayLink, bytes_in_pipe, enlarge_pipe
from xpu_serve.sources.log_writer import DATA, EOF, Item, OnLine, PumpWriter

# The reader threads need the GIL back after every read(); CPython hands it over after the
# switch interval (default 5 ms), during which a busy writer thread keeps it and the pipe fills.
_SWITCH_INTERVAL_S = 0.001
_BATCH_BYTES = 512 << 10  # writer takes at most this much per round (keeps GIL holds short)
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

    Raises:
        ValueError: max_bytes, buffer_cap_bytes or max_line_bytes <= 0, or backups < 0.
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
        forms = {x.encode("utf-8", "surrogateescape") for x in secrets if x}
        # longest first: a value containing another is replaced whole
        self._secrets = sorted((f for f in forms if b"\n" not in f and b"\r" not in f), key=len, reverse=True)
        self._echo = Echo(echo, f"[i{incarnation}] ", echo_cap_bytes, self.echo_quiet_paths)
        self._w = PumpWriter(
            self.log_dir,
            max_bytes,
            backups,
            retry_interval_s,
            max_line_bytes,
            on_line,
            self._secrets,
            self._echo,
            pending_timeout_s,
        )
        self._in = Intake([], buffer_cap_bytes, -1)
        self._link: RelayLink | None = None
        self._flush_lock = threading.Lock()  # one flush() reads the ack pipe at a time
        self._flush_seq = 0
        self._threads: list[threading.Thread] = []
        self._owned: list[BinaryIO | int] = []  # what start() was given, closed by close()
        self._wake_w = -1
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

    @property
    def _relay(self) -> subprocess.Popen[bytes] | None:
        """The relay process (None: thread mode, or not started)."""
        return self._link.proc if self._link is not None else None

    def locate(self, lineno: int) -> tuple[Path, int] | None:
        """Where line `lineno` of the logical ``vllm.log`` is now: (file, 1-based line in it).

        ``vllm.log`` itself or a rotated ``vllm.log.K``; None when the line was rotated away
        (beyond `backups`) or is not written yet. Exact while the disk had no write errors
        (lines that failed to be written shift the numbers). Any thread.
        """
        return self._w.vlog.locate(lineno)

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
        wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        fds = []
        for s in (stdout, stderr):
            if s is None:
                continue
            self._owned.append(s)
            fds.append(s if isinstance(s, int) else s.fileno())
        self._in = Intake(fds, self.buffer_cap_bytes, wake_r)
        for fd in fds:
            enlarge_pipe(fd)
            os.set_blocking(fd, False)
        if fds and self.relay:
            args = [str(self.buffer_cap_bytes), str(self.log_path), str(self.max_bytes), str(self.backups)]
            args += [repr(self.retry_interval_s), str(max(_HOLD_MIN, self.max_line_bytes))]
            self._link = RelayLink.start(fds, args, self._secrets)
        if self._link is not None:
            self._w.relay_log = True
            self._thread(self._in.relay_reader, "pump-relay", self._link, self._echo.notice)
        else:
            for i in range(len(fds)):
                self._thread(self._in.reader, f"pump-read-{i}", i)
        self._thread(self._writer, "pump-write")
        if self.echo is not None:
            self._thread(self._echo.run, "pump-echo")
        if not fds:
            self._in.eof_done = True  # nothing to pump
        for t in self._threads:
            t.start()

    def _thread(self, target: Callable[..., None], name: str, *args: object) -> None:
        self._threads.append(threading.Thread(target=target, args=args, name=name, daemon=True))

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
        link, q = self._link, self._in
        if link is not None and link.ctl >= 0 and not q.eof_done:
            logged = self._flush_relay(link, deadline)
            if logged is not None:
                return logged
        with q.cond:
            targets = [(i, q.read_by[i] + bytes_in_pipe(fd)) for i, fd in enumerate(q.fds) if not q.eof[i]]
            while any(q.read_by[i] < t and not q.eof[i] for i, t in targets):
                left = deadline - time.monotonic()
                if left <= 0 or q.writer_done:
                    return False
                q.cond.wait(left)
            target = q.enqueued
            q.cond.notify_all()
            while q.processed < target and not q.writer_done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                q.cond.wait(left)
        return True

    def _flush_relay(self, link: RelayLink, deadline: float) -> bool | None:
        """flush() in relay mode; None: the relay died (the FIONREAD path settles it)."""
        q = self._in
        with self._flush_lock:
            with q.cond:
                self._flush_seq += 1
                seq = self._flush_seq
            try:
                os.write(link.ctl, b"F" + seq.to_bytes(8, "big"))
                logged = link.wait_ack(seq, deadline)
            except OSError:
                logged = None
        if logged is None:
            # The relay is gone. Status 0: it read every pipe to EOF into vllm.log and ended;
            # else it died (the fallback threads and the FIONREAD wait settle it).
            with contextlib.suppress(subprocess.TimeoutExpired):
                link.proc.wait(max(0.0, deadline - time.monotonic()))
            if link.proc.returncode != 0:
                return None
            logged = True
        if not logged:
            return False
        with q.cond:  # vllm.log has it: give the writer what is left of the timeout
            while self._w.acked < seq and not q.eof_done and not q.writer_done:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                q.cond.wait(left)
        return True

    def wait_eof(self, timeout: float | None = None) -> bool:
        """Wait until both pipes reached EOF and every line is written (partial last lines and
        held Worker/oneCCL lines included). Returns False on timeout (seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        q = self._in
        with q.cond:
            while not q.eof_done and not q.writer_done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                q.cond.wait(left)
        return True

    def stats(self) -> PumpStats:
        """A snapshot of the counters (any thread; values may lag the writer by one batch)."""
        w = self._w
        return PumpStats(
            lines=w.lines,
            bytes=self._in.bytes_read,
            dropped_lines=w.dropped_lines,
            dropped_bytes=w.dropped_bytes,
            write_errors=w.write_errors,
            echo_dropped=self._echo.dropped,
            truncated_lines=w.truncated,
            callback_errors=w.callback_errors,
            log_missed_lines=w.log_missed,
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
        q = self._in
        with q.cond:
            q.stop_deadline = deadline - timeout / 2
            q.stop = True
            q.cond.notify_all()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        link = self._link
        if link is not None:
            link.quit()
            try:
                link.proc.wait(max(0.1, deadline - time.monotonic() - 0.2))
            except subprocess.TimeoutExpired:  # a child still writing, or the relay stuck
                link.proc.kill()
                link.proc.wait(5)
        echo_thread = None
        for t in self._threads:
            if t.name == "pump-echo":
                echo_thread = t
            else:
                t.join(max(0.0, deadline - time.monotonic()))
        self._echo.stop(echo_thread, max(0.1, deadline - time.monotonic()))
        for obj in self._owned:
            with contextlib.suppress(OSError, ValueError):
                if isinstance(obj, int):
                    os.close(obj)
                else:
                    obj.close()
        for fd in (q.wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if link is not None:
            link.close()
        return self.stats()

    # --- writer thread ------------------------------------------------------------------------

    def _writer(self) -> None:
        try:
            self._writer_loop()
        finally:
            self._w.close()
            with self._in.cond:
                self._in.writer_done = True
                self._in.cond.notify_all()
            self._echo.wake()

    def _take_batch(self) -> tuple[list[Item], int]:
        """Up to _BATCH_BYTES of queued items (caller holds the queue's cond)."""
        q = self._in
        items: list[Item] = []
        size = 0
        while q.queue and size < _BATCH_BYTES:
            item = q.queue.popleft()
            data = item[2]
            if len(data) > _BATCH_BYTES and item[0] == DATA:
                # The relay's frames reach 4 MiB: take a batch's worth (no copy; the writer
                # carries the cut line), so the duty sleep comes every ~5 ms of work.
                view = memoryview(data)
                q.queue.appendleft((DATA, item[1], view[_BATCH_BYTES:], 0, 0))
                item = (DATA, item[1], view[:_BATCH_BYTES], 0, 0)
            items.append(item)
            size += len(item[2])
        q.buffered -= size
        return items, size

    def _writer_loop(self) -> None:
        q, w = self._in, self._w
        cond = q.cond
        eofs = 0
        nstreams = len(q.fds)
        tick = min(1.0, self.pending_timeout_s, self.retry_interval_s)
        while True:
            with cond:
                if not q.queue:
                    if q.stop and eofs >= nstreams:
                        return
                    cond.wait(tick)
                items, size = self._take_batch()
            if items:
                eofs += sum(1 for it in items if it[0] == EOF)
                t0 = time.thread_time()
                try:
                    w.process(items)
                except Exception as e:  # a bug here must not stop the pump: the buffer would fill
                    self._echo.notice(f"log pump error {type(e).__name__}: {e}")
                link = self._link
                if _DUTY < 1.0 and w.relay_log and size >= _BATCH_BYTES and link is not None and link.bursting():
                    # CPU time, not wall time: a callback that blocked is no work to pay back.
                    time.sleep(min(_DUTY_MAX_SLEEP_S, (time.thread_time() - t0) * (1.0 / _DUTY - 1.0)))
            w.demux.expire(time.monotonic())
            with cond:
                q.processed += len(items)
                if eofs >= nstreams and not q.queue and not q.eof_done:
                    w.demux.finish()
                    q.eof_done = True
                if items or q.eof_done:
                    cond.notify_all()
