"""LineWriter on real pipes: a reader that stops reading never blocks the writer's callers."""

from __future__ import annotations

import fcntl
import os
import threading
import time

from xpu_serve.output import LineWriter


def test_a_stalled_reader_never_blocks_write_and_drops_are_summarised() -> None:
    r, w = os.pipe()
    try:
        summaries: list[int] = []

        def summary(n: int) -> str:
            summaries.append(n)
            return f"SUMMARY {n} lines dropped"

        lw = LineWriter(w, "stderr", cap_bytes=64 * 1024, summary=summary)
        line = "x" * 99 + "\n"
        t0 = time.monotonic()
        for i in range(20000):  # 2 MB into a 64 KiB pipe nobody reads and a 64 KiB queue
            lw.write(f"{i:06d} {line}")
        took = time.monotonic() - t0
        assert took < 5, took  # (a blocking write would wait forever)
        assert fcntl.fcntl(w, fcntl.F_GETFL) & os.O_NONBLOCK == 0  # the fd's flags are left alone
        dropped = lw.dropped
        assert dropped > 10000
        assert not lw.drain(0.2)  # still waiting for the reader
        got = bytearray()

        def read() -> None:
            while chunk := os.read(r, 65536):
                got.extend(chunk)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        assert lw.drain(10)
        lw.write("last\n")
        assert lw.drain(10)
        os.close(w)
        w = -1
        t.join(10)
        lines = got.decode().splitlines()
        assert sum(summaries) == dropped  # one summary per gap (more text fits in between)
        kept = [ln for ln in lines if not ln.startswith("SUMMARY") and ln != "last"]
        assert len(kept) + dropped == 20000
        assert all(len(ln) == 106 for ln in kept)  # whole lines only
        nums = [int(ln[:6]) for ln in kept]
        assert nums == sorted(nums)  # in order
        for n in summaries:  # each summary stands where its lines are missing
            at = lines.index(f"SUMMARY {n} lines dropped")
            nxt = 20000 if lines[at + 1] == "last" else int(lines[at + 1][:6])
            assert nxt - int(lines[at - 1][:6]) == n + 1
        assert lines[-1] == "last"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_closed_reader_drops_everything_without_raising() -> None:
    r, w = os.pipe()
    os.close(r)
    lw = LineWriter(w, "stdout")
    lw.write("a\n")
    time.sleep(0.2)  # (the thread meets EPIPE: Python ignores SIGPIPE)
    lw.write("b\nc\n")
    assert lw.drain(5)
    assert lw.dropped >= 2
    os.close(w)
