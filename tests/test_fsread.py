"""xpu_serve.fsread on real files, FIFOs and symlinks."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from xpu_serve.fsread import read_fd, read_regular


def test_read_regular_caps_and_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10_000)
    assert read_regular(f, 100) == b"x" * 100
    assert read_regular(f, 1 << 20) == b"x" * 10_000
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_regular(fifo, 100) is None  # opened without blocking, refused
    link = tmp_path / "link"
    link.symlink_to(f)
    assert read_regular(link, 100) == b"x" * 100
    assert read_regular(link, 100, follow=False) is None
    assert read_regular(tmp_path / "missing", 100, follow=False) is None
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 100)


def test_read_fd_deadline_on_a_pipe_without_data() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError) as ei:
            read_fd(r, 100, time.monotonic() + 0.2, "nothing came")
        assert ei.value.errno == errno.ETIMEDOUT and ei.value.strerror == "nothing came"
        assert time.monotonic() - t0 < 5
        os.write(w, b"abc")
        os.close(w)
        w = -1
        assert read_fd(r, 100, time.monotonic() + 5) == b"abc"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
