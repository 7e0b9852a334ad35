"""The supervisor's own output (its event lines on stderr, the engine's echo on stdout) without
ever blocking the caller.

A reader that stops reading (a wedged journald, `up 2>&1 | sleep 1e9`, a full pipe) would block
a plain `write()` once the pipe holds ~64 KiB, and with it the asyncio loop that supervises.
`LineWriter` queues the text in memory (bounded by `cap_bytes`) and a daemon thread writes it
with ordinary blocking `write()`s: the file descriptor's flags are left alone (O_NONBLOCK would
be set on the file description, shared with the terminal or the caller's pipe). When the queue is
full, the text is dropped and counted; a summary line takes its place in the stream (default
``xpu-serve: N lines dropped (stderr not read)``, or what `summary(n)` returns) and is written
once the reader has caught up to that point. Writes are split at line ends into pieces of at most
PIPE_BUF (4096) bytes where possible, so lines from the stdout and stderr writers sharing one
pipe (`2>&1`) do not interleave mid-line.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections import deque
from collections.abc import Callable

PIPE_BUF = 4096  # bytes a pipe write keeps whole (pipe(7))
DEFAULT_CAP_BYTES = 1 << 20


class _Gap:
    """A place in the queue where lines were dropped; `n` grows while it is the queue's tail."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class LineWriter(io.TextIOBase):
    """A text stream on `fd` whose `write()` never blocks (see the module docstring).

    Args:
        fd: the file descriptor (1, 2); not closed, its flags not changed.
        name: what the summary line calls it ("stdout", "stderr").
        cap_bytes: text queued but not yet written (UTF-8 bytes) before writes are dropped.
        summary: `summary(n) -> str`, the line (without LF) written where `n` lines were
            dropped; called on the writer thread. Default: ``xpu-serve: N lines dropped (NAME not read)``.

    `dropped` counts dropped lines (a write without LF counts as one). Thread-safe.
    """

    def __init__(
        self,
        fd: int,
        name: str,
        cap_bytes: int = DEFAULT_CAP_BYTES,
        summary: Callable[[int], str] | None = None,
    ) -> None:
        super().__init__()
        self.fd = fd
        self.name = name
        self.cap_bytes = cap_bytes
        self.summary = summary
        self.dropped = 0
        self._q: deque[bytes | _Gap] = deque()
        self._size = 0
        self._busy = False  # the thread holds items taken from the queue
        self._broken = False  # EPIPE/EBADF...: everything is dropped from here on
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"output-{name}", daemon=True)
        self._thread.start()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        """The descriptor written to (for fstat: e.g. whether it is journald's stream)."""
        return self.fd

    def write(self, text: str) -> int:  # type: ignore[override]
        """Queue `text` (normally whole lines); dropped (counted) when the queue is full."""
        if not text:
            return 0
        data = text.encode("utf-8", "replace")
        with self._cond:
            if self._broken or self._size + len(data) > self.cap_bytes:
                n = max(1, text.count("\n"))
                self.dropped += n
                if not self._broken:
                    tail = self._q[-1] if self._q else None
                    if not isinstance(tail, _Gap):
                        tail = _Gap()
                        self._q.append(tail)
                    tail.n += n
                    self._cond.notify()
                return len(text)
            self._q.append(data)
            self._size += len(data)
            self._cond.notify()
        return len(text)

    def flush(self) -> None:
        """Nothing to do: the thread writes as soon as it can (see `drain`)."""

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for everything queued to be written; True when it was."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._q or self._busy) and not self._broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _take(self) -> list[bytes | _Gap]:
        """Items for one write: whole queued texts up to PIPE_BUF bytes (one larger text alone),
        or one gap."""
        with self._cond:
            while not self._q:
                self._busy = False
                self._cond.notify_all()  # drain()
                self._cond.wait()
            self._busy = True
            first = self._q.popleft()
            if isinstance(first, _Gap):
                return [first]
            items: list[bytes | _Gap] = [first]
            size = len(first)
            self._size -= size
            while self._q and not isinstance(self._q[0], _Gap) and size + len(self._q[0]) <= PIPE_BUF:  # type: ignore[arg-type]
                nxt = self._q.popleft()
                assert isinstance(nxt, bytes)
                size += len(nxt)
                self._size -= len(nxt)
                items.append(nxt)
            return items

    def _line_for(self, gap: _Gap) -> bytes:
        n = gap.n
        text = None
        if self.summary is not None:
            with contextlib.suppress(Exception):  # (a summary that fails must not stop the output)
                text = self.summary(n)
        if text is None:
            text = f"xpu-serve: {n} lines dropped ({self.name} not read)"
        return (text + "\n").encode("utf-8", "replace")

    def _run(self) -> None:
        while True:
            items = self._take()
            if isinstance(items[0], _Gap):  # (out of the queue: later drops make a new gap)
                data = self._line_for(items[0])
            else:
                data = b"".join(x for x in items if isinstance(x, bytes))
            try:
                view = memoryview(data)
                while view:  # (blocking: this thread waits for the reader, nobody else does)
                    view = view[os.write(self.fd, view) :]
            except OSError:
                with self._cond:
                    self._broken = True
                    self.dropped += sum(x.count(b"\n") for x in self._q if isinstance(x, bytes))
                    self._q.clear()
                    self._size = 0
                    self._busy = False
                    self._cond.notify_all()
                return


_writers: dict[int, LineWriter] = {}
_writers_lock = threading.Lock()


def writer(fd: int) -> LineWriter:
    """The process's one LineWriter for `fd` (1: "stdout", 2: "stderr"), made on first use."""
    with _writers_lock:
        w = _writers.get(fd)
        if w is None:
            w = _writers[fd] = LineWriter(fd, {1: "stdout", 2: "stderr"}.get(fd, f"fd {fd}"))
        return w


def drain_all(timeout: float) -> bool:
    """Give every LineWriter up to `timeout` seconds in total to write what it holds (at exit)."""
    deadline = time.monotonic() + timeout
    ok = True
    for w in list(_writers.values()):
        ok = w.drain(max(0.0, deadline - time.monotonic())) and ok
    return ok
