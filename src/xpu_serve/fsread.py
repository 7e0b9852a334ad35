"""Bounded reads of files that hostile or broken setups may replace: a FIFO nobody writes to, a
symlink to /etc/shadow or /dev/zero, a 300 MB file where a few KiB are expected."""

from __future__ import annotations

import errno
import os
import select
import stat
import time
from pathlib import Path


def read_regular(path: str | Path, cap: int, follow: bool = True) -> bytes | None:
    """At most `cap` bytes of `path` when it is a regular file, else None.

    Opened without blocking (a FIFO or device put there never hangs the reader) and, with
    follow=False, never through a symlink (O_NOFOLLOW: None). Raises OSError for a path that
    cannot be opened (FileNotFoundError...) when follow=True; with follow=False every open error
    gives None."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        if follow:
            raise
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return read_fd(fd, cap)
    except OSError:
        if follow:
            raise
        return None
    finally:
        os.close(fd)


def read_fd(fd: int, cap: int, deadline: float | None = None, what: str = "") -> bytes:
    """Read `fd` to EOF, at most `cap` bytes. With `deadline` (time.monotonic() seconds) the fd is
    non-blocking and polled: OSError(ETIMEDOUT, "<what> ...") when no data comes in time."""
    chunks: list[bytes] = []
    got = 0
    poller = None
    if deadline is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
    while got < cap:
        if poller is not None and deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise OSError(errno.ETIMEDOUT, what or "no data in time")
        try:
            b = os.read(fd, min(1 << 20, cap - got))
        except BlockingIOError:
            continue
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)
