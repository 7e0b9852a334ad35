"""The log pump's rotating files: raw byte batches appended at line ends, degraded on disk errors.

`RotatingFile` appends whole lines (bytes ending with LF) and rotates ``path`` -> ``path.1`` ...
``path.<backups>`` before a file would pass `max_bytes` (a single longer line gets a file of its
own); it counts the lines it wrote (`lines`) and where each part starts (`starts`, for
`LogPump.locate`). A file deleted while open (an operator freeing a full disk: its blocks stay in
use while it is open) is noticed within a second and started again, its directory made again.
Files are created 0600. `write()` raises OSError; `Sink` turns that into degradation: the file
is closed, the error reported once, the lines missed counted, and the file retried every
`retry_interval_s`; once it works again a marker line says how many lines it missed
(``[xpu-serve] N lines not written to this file: [Errno 28] No space left on device``).

Written here rather than with `logging.handlers.RotatingFileHandler`: that handler formats and
writes one record at a time under a lock (too slow for a 100 MB burst) and cannot rotate raw byte
batches at line boundaries. The cut and the backup shifting are the relay's (`log_relay`).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Protocol

from xpu_serve.sources.log_relay import cut_at, shift_backups


class RotatingFile:
    """Append-only file rotated at line boundaries: path -> path.1 -> ... -> path.<backups>.

    `write()` raises OSError on disk errors; the caller decides what to do (see `Sink`).
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
                self.rotated(self.lines)
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
            stop = cut_at(data, pos, end, self.max_bytes - self._size, self._size)
            if stop < 0:
                self._rotate()
                continue
            view = memoryview(data)[pos:stop]
            while view:
                n = os.write(fd, view)
                self._size += n
                view = view[n:]
            self.lines += data.count(b"\n", pos, stop)
            pos = stop
            if pos < end:
                self._rotate()

    def rotated(self, first: int) -> None:
        """A new part starts at line index `first` (the older parts shift by one)."""
        self.starts.insert(0, first)
        del self.starts[self.backups + 1 :]

    def locate(self, lineno: int) -> tuple[Path, int] | None:
        """(part, 1-based line in it) of 1-based line `lineno` of all parts together; None when
        rotated away or not written yet."""
        if lineno < 1:
            return None
        starts = list(self.starts)  # (the writer thread may rotate meanwhile)
        if lineno > self.lines:
            return None
        for k, first in enumerate(starts):
            if lineno - 1 >= first:
                return (self.path if k == 0 else self.path.with_name(f"{self.path.name}.{k}")), lineno - first
        return None

    def _rotate(self) -> None:
        self.close()
        self.rotated(self.lines)
        shift_backups(str(self.path), self.backups)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


class SinkReport(Protocol):
    """Where a `Sink` reports: one-line notices (the echo) and its counters."""

    def notice(self, msg: str) -> None: ...

    def write_error(self) -> None: ...

    def missed(self, nlines: int, vllm_log: bool) -> None: ...


class Sink:
    """A `RotatingFile` that degrades on disk errors instead of raising (writer thread only)."""

    def __init__(self, file: RotatingFile, retry_interval_s: float, report: SinkReport) -> None:
        self.file = file
        self.report = report
        self.retry_interval_s = retry_interval_s
        self.is_vlog = file.path.name == "vllm.log"
        self.broken_until = 0.0  # monotonic; 0 = healthy
        self.missed_lines = 0
        self.error: str | None = None

    def write(self, data: bytes, nlines: int) -> None:
        """Append `data` (`nlines` whole lines); on failure count them and retry later."""
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
            self.report.notice(f"log file {self.file.path} writable again ({self.missed_lines} lines missed)")
            self.broken_until = 0.0
            self.missed_lines = 0
            return
        if not self._try(data):
            self.missed(nlines)
            self.report.notice(
                f"log write to {self.file.path} failed: {self.error}; going on without it "
                f"(echo and analysis continue)"
            )

    def missed(self, nlines: int) -> None:
        self.missed_lines += nlines
        self.report.missed(nlines, self.is_vlog)

    def _try(self, data: bytes) -> bool:
        try:
            self.file.write(data)
            return True
        except OSError as e:
            self.report.write_error()
            self.error = f"[Errno {e.errno}] {os.strerror(e.errno) if e.errno else e}"
            self.file.close()
            self.broken_until = time.monotonic() + self.retry_interval_s
            return False

    def close(self) -> None:
        self.file.close()
