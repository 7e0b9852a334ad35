"""The log pump's intake: the engine's pipes -> the writer's queue, through the relay or threads.

`RelayLink.start` runs `xpu_serve.sources.log_relay` (``python -I -S <its path>``, its own
session, the supervisor's environment; secrets on its stdin) on the pipes and holds its frame,
control, acknowledgement and state descriptors; `Intake.relay_reader` parses its frames into the
queue. If the relay cannot start, or dies, `Intake.reader` threads (one per pipe) read the pipes
in this process: there a writer that lags past `cap_bytes` makes them drop whole lines from every
output (a DROP item; ``vllm.log`` too). Queue items are `log_writer.Item`; `cond` guards every
field of `Intake`.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import select
import subprocess
import sys
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from xpu_serve.sources import log_relay
from xpu_serve.sources.log_writer import DATA, DROP, EOF, FALLBACK, UDATA, UDROP, Item

_READ_SIZE = 1 << 20  # bytes per read()
# F_SETPIPE_SZ targets, largest first: above /proc/sys/fs/pipe-max-size (1 MiB by default) only
# with CAP_SYS_RESOURCE. More kernel slack = more time the child can write while a reader
# thread waits for the GIL.
_PIPE_SIZES = (16 << 20, 4 << 20, 1 << 20)
_QUEUE_CAP = 4 << 20  # relay mode: bytes queued in the supervisor before it stops reading the relay
_RELAY_PATH = Path(log_relay.__file__)
_RELAY_NAME = "xpu-serve-log-relay"  # argv[1]: what `ps` shows the relay as
_FRAME = log_relay.FRAME


def enlarge_pipe(fd: int) -> None:
    """F_SETPIPE_SZ as large as allowed (not a pipe, e.g. a file or a pty: left alone)."""
    for size in _PIPE_SIZES:
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
            return
        except OSError:
            continue


def bytes_in_pipe(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD), 0 if unknown."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return 0
    return buf[0]


class RelayLink:
    """The supervisor's side of a running relay: its process and descriptors."""

    def __init__(self, proc: subprocess.Popen[bytes], out: int, ctl: int, ack: int, state: int) -> None:
        self.proc = proc
        self.out = out  # read end of the frame pipe
        self.ctl = ctl  # write end of the control pipe (-1 once the relay is known gone)
        self.ack = ack  # read end of the flush acknowledgements (8-byte sequences)
        self.state = state  # memfd: the relay's state byte (1: the input is a burst)
        self._ack_buf = b""
        self._log_acked = 0  # highest flush sequence the relay has in vllm.log

    @classmethod
    def start(cls, fds: list[int], args: list[str], secrets: list[bytes]) -> RelayLink | None:
        """Start the relay on the pipes `fds`; `args`: CAP_BYTES, LOG_PATH, MAX_BYTES, BACKUPS,
        RETRY_S, HOLD_BYTES (see log_relay). None (use threads) if it cannot start."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        ack_r, ack_w = os.pipe2(os.O_CLOEXEC)
        try:
            state = os.memfd_create("xpu-serve-relay-state", os.MFD_CLOEXEC)
            os.pwrite(state, b"\0", 0)
        except (OSError, AttributeError):  # no memfd: reads as "calm" (b""), no duty sleep
            state = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        enlarge_pipe(out_r)
        cap, rest = args[0], args[1:]
        argv = [sys.executable, "-I", "-S", str(_RELAY_PATH), _RELAY_NAME, cap, str(out_w), str(ctl_r), str(ack_w)]
        argv += [*rest, str(state), *(str(fd) for fd in fds)]
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
                relay.stdin.write(b"".join(s.hex().encode() + b"\n" for s in secrets))
        except OSError:
            if relay is not None:  # started but already gone (its stdin broke)
                relay.kill()
                relay.wait(5)
            for fd in (out_r, out_w, ctl_r, ctl_w, ack_r, ack_w, state):
                os.close(fd)
            return None
        os.close(out_w)
        os.close(ctl_r)
        os.close(ack_w)
        return cls(relay, out_r, ctl_w, ack_r, state)

    def bursting(self) -> bool:
        """The relay's state byte: the engine is writing a burst (not calm)."""
        try:
            return os.pread(self.state, 1, 0) == b"\1"
        except OSError:
            return False

    def wait_ack(self, seq: int, deadline: float) -> bool | None:
        """Read the ack pipe until `seq` is acknowledged: True; timeout (monotonic `deadline`):
        False; the relay is gone: None. One caller at a time."""
        poller = select.poll()
        poller.register(self.ack, select.POLLIN)
        while self._log_acked < seq:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return False
            try:
                data = os.read(self.ack, 4096)
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

    def quit(self) -> None:
        """Q then EOF on the control pipe: the relay reads what is left, sends EOF frames, exits
        (EOF alone means the supervisor died: it would keep going)."""
        if self.ctl >= 0:
            with contextlib.suppress(OSError):
                os.write(self.ctl, b"Q" + bytes(8))
            with contextlib.suppress(OSError):
                os.close(self.ctl)
            self.ctl = -1

    def close(self) -> None:
        for fd in (self.out, self.ack, self.state):
            with contextlib.suppress(OSError):
                os.close(fd)


class Intake:
    """The queue between the readers and the writer thread, and the readers themselves.

    Args:
        fds: the engine's pipes (stream i = fds[i]), non-blocking.
        cap_bytes: thread mode: bytes queued before the readers drop whole lines.
        wake_r: read end of a pipe written once by `close()` (wakes blocked reader threads).
    """

    def __init__(self, fds: list[int], cap_bytes: int, wake_r: int) -> None:
        self.fds = fds
        self.cap_bytes = cap_bytes
        self.wake_r = wake_r
        self.cond = threading.Condition()
        self.queue: deque[Item] = deque()
        self.buffered = 0  # bytes of data items queued
        self.enqueued = 0  # items ever queued (flush barrier)
        self.processed = 0  # items ever processed by the writer
        self.bytes_read = 0
        self.read_by = [0] * len(fds)  # bytes read per stream
        self.eof = [False] * len(fds)  # per stream
        self.stop = False  # close() called
        self.stop_deadline = 0.0  # monotonic: reader threads stop draining a child still writing
        self.writer_done = False
        self.eof_done = False  # every stream at EOF and every item written

    def put(self, item: Item) -> None:
        """Queue a control item (caller holds `cond`)."""
        self.queue.append(item)
        self.enqueued += 1
        self.cond.notify_all()

    def relay_reader(self, link: RelayLink, notice: Callable[[str], None]) -> None:
        """Parse the relay's frames into the queue (blocks when the queue is full, which makes
        the relay buffer, then drop forwarding, instead of the engine blocking). When the relay
        dies, `notice` says so and reader threads take over the pipes still open."""
        buf = bytearray()
        while True:
            try:
                data = os.read(link.out, _READ_SIZE)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            items, nbytes, pos = self._parse_frames(buf)
            del buf[:pos]
            if items:
                self._put_frames(items, nbytes)
        # The relay exited. Normal: every stream got its EOF frame. Otherwise it died: say so and
        # read the remaining pipes here (the engine must not get EPIPE for our trouble).
        left = [i for i, done in enumerate(self.eof) if not done]
        if not left:
            return
        if not self.stop:  # (close() may kill a relay stuck on a child that keeps writing)
            notice(
                f"log relay process ended unexpectedly (status {link.proc.poll()}); reading the pipes "
                "in-process from here (lines it had not forwarded are in vllm.log only; a partial "
                "line it held is lost)"
            )
        with self.cond:
            link.ctl, ctl = -1, link.ctl  # flush() falls back to FIONREAD
            self.put((FALLBACK, 0, b"", 0, 0))  # the writer writes vllm.log from here
        if ctl >= 0:
            with contextlib.suppress(OSError):
                os.close(ctl)
        readers = [threading.Thread(target=self.reader, args=(i,), name=f"pump-read-{i}", daemon=True) for i in left]
        for t in readers:
            t.start()
        for t in readers:
            t.join()

    @staticmethod
    def _parse_frames(buf: bytearray) -> tuple[list[Item], int, int]:
        """Whole frames at the head of buf: (items, payload bytes, bytes consumed)."""
        hsize = _FRAME.size
        pos = nbytes = 0
        items: list[Item] = []
        while len(buf) - pos >= hsize:
            kind, stream, a, b = _FRAME.unpack_from(buf, pos)
            if kind == DATA or kind == UDATA:
                if len(buf) - pos - hsize < a:
                    break
                items.append((kind, stream, bytes(buf[pos + hsize : pos + hsize + a]), 0, 0))
                nbytes += a
                pos += hsize + a
            else:
                items.append((kind, stream, b"", a, b))
                pos += hsize
        return items, nbytes, pos

    def _put_frames(self, items: list[Item], nbytes: int) -> None:
        with self.cond:
            while self.buffered > _QUEUE_CAP and not self.stop:
                self.cond.wait(0.5)
            for item in items:
                kind, stream = item[0], item[1]
                if kind == DROP or kind == UDROP:
                    self.bytes_read += item[4]
                elif kind == EOF:
                    self.eof[stream] = True
                self.queue.append(item)
            self.bytes_read += nbytes
            self.buffered += nbytes
            self.enqueued += len(items)
            self.cond.notify_all()

    def reader(self, stream: int) -> None:
        """Thread mode: read pipe `stream` into the queue, dropping whole lines past the cap
        (resumed below half of it, at a line start) until EOF or `close()`."""
        fd = self.fds[stream]
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        poller.register(self.wake_r, select.POLLIN)
        drop = _Drop(self.cap_bytes)
        cond = self.cond
        while True:
            try:
                chunk = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                if self.stop:
                    break  # close(): the pipe is drained and the child is expected gone
                poller.poll()
                continue
            except OSError:
                chunk = b""
            if not chunk:
                break
            if self.stop and time.monotonic() > self.stop_deadline:
                break  # close() on a child that keeps writing: stop draining at the deadline
            with cond:
                self.bytes_read += len(chunk)
                self.read_by[stream] += len(chunk)
                rest = drop.take(chunk, self.buffered)
                if drop.ended is not None:
                    self.queue.append((DROP, stream, b"", drop.ended[0], drop.ended[1]))
                    self.enqueued += 1
                    drop.ended = None
                if rest:
                    self.queue.append((DATA, stream, rest, 0, 0))
                    self.buffered += len(rest)
                    self.enqueued += 1
                cond.notify_all()  # the writer, and any flush() waiting for the bytes read
        with cond:
            if drop.active:
                self.queue.append((DROP, stream, b"", drop.lines + (1 if drop.tail else 0), drop.bytes))
                self.enqueued += 1
            self.queue.append((EOF, stream, b"", 0, 0))
            self.enqueued += 1
            self.eof[stream] = True
            cond.notify_all()


class _Drop:
    """A thread reader's drop period: whole lines dropped while the queue is over the cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.active = False
        self.lines = self.bytes = 0
        self.tail = False  # dropped bytes after the last dropped newline (a partial line)
        self.ended: tuple[int, int] | None = None  # (lines, bytes) of a period just ended

    def take(self, chunk: bytes, buffered: int) -> bytes:
        """What of `chunk` to queue (b"": all dropped), given `buffered` bytes queued."""
        n = len(chunk)
        if self.active:
            if buffered > self.cap // 2:
                self._add(chunk)
                return b""
            nl = chunk.find(b"\n")
            if nl < 0:
                self.bytes += n
                self.tail = True
                return b""
            self.ended = (self.lines + 1, self.bytes + nl + 1)
            self.active, self.tail = False, False
            chunk = chunk[nl + 1 :]
            if not chunk:
                return b""
            n = len(chunk)
        if buffered + n > self.cap:
            self.active = True
            self.lines = self.bytes = 0
            self._add(chunk)
            return b""
        return chunk

    def _add(self, chunk: bytes) -> None:
        self.lines += chunk.count(b"\n")
        self.bytes += len(chunk)
        self.tail = not chunk.endswith(b"\n")
