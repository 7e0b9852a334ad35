"""The log relay on its own: a real `python -I -S log_relay.py` process on real pipes.

Each test feeds bytes into the relay's input pipes, reads its frames the way `LogPump` does and
checks ``vllm.log`` (and its rotations) byte for byte, the forwarded lines, redaction, flush
acknowledgements and how it ends (input EOF, quit, the supervisor's end gone).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from xpu_serve.sources import log_relay
from xpu_serve.sources.log_relay import ACK, DATA, DROP, EOF, FRAME, ROT

RELAY = Path(log_relay.__file__)


@dataclass
class Frames:
    """Frames read from the relay: (kind, stream, a, b) and the DATA payloads in order."""

    heads: list[tuple[int, int, int, int]] = field(default_factory=list)
    data: list[tuple[int, bytes]] = field(default_factory=list)

    def kinds(self, kind: int) -> list[tuple[int, int, int, int]]:
        return [h for h in self.heads if h[0] == kind]

    def text(self, stream: int | None = None) -> bytes:
        return b"".join(d for s, d in self.data if stream is None or s == stream)


class Relay:
    """A relay process with `n` input pipes, logging into `log` (see log_relay's docstring)."""

    def __init__(
        self,
        log: Path,
        n: int = 2,
        cap: int = 16 << 20,
        max_bytes: int = 64 << 20,
        backups: int = 5,
        hold: int = 1 << 20,
        secrets: tuple[bytes, ...] = (),
    ) -> None:
        self.ins = [os.pipe() for _ in range(n)]
        self.out_r, out_w = os.pipe()
        ctl_r, self.ctl_w = os.pipe()
        self.ack_r, ack_w = os.pipe()
        self.state = os.memfd_create("relay-test-state")
        os.pwrite(self.state, b"\0", 0)
        args = [str(cap), str(out_w), str(ctl_r), str(ack_w), str(log), str(max_bytes), str(backups)]
        args += ["0.05", str(hold), str(self.state)] + [str(r) for r, _ in self.ins]
        passed = (out_w, ctl_r, ack_w, self.state, *(r for r, _ in self.ins))
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(RELAY), "xpu-serve-log-relay", *args],
            pass_fds=passed,
            stdin=subprocess.PIPE,
        )
        assert self.proc.stdin is not None
        with self.proc.stdin:
            self.proc.stdin.write(b"".join(s.hex().encode() + b"\n" for s in secrets))
        for fd in passed:
            if fd != self.state:
                os.close(fd)
        self.frames = Frames()
        self._buf = b""
        self._mine = {self.out_r, self.ctl_w, self.ack_r, self.state, *(w for _, w in self.ins)}

    def close(self, fd: int) -> None:
        """Close one of the test's ends (once: a number closed twice may be someone else's)."""
        if fd in self._mine:
            self._mine.discard(fd)
            os.close(fd)

    def write(self, stream: int, data: bytes) -> None:
        os.write(self.ins[stream][1], data)

    def close_input(self, stream: int) -> None:
        self.close(self.ins[stream][1])

    def read_frames(self, timeout: float = 20.0, until: Callable[[Frames], bool] | None = None) -> Frames:
        """Read frames until the relay closes its end, or until `until(frames)` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if until is not None and until(self.frames):
                return self.frames
            ready, _, _ = select.select([self.out_r], [], [], 0.2)
            if not ready:
                continue
            chunk = os.read(self.out_r, 1 << 20)
            if not chunk:
                assert until is None, "the relay closed its frame pipe first"
                return self.frames
            self._buf += chunk
            self._parse()
        raise AssertionError("the relay's frames did not come in time")

    def _parse(self) -> None:
        buf, pos = self._buf, 0
        while len(buf) - pos >= FRAME.size:
            kind, stream, a, b = FRAME.unpack_from(buf, pos)
            size = a if kind in (DATA, log_relay.UDATA) else 0
            if len(buf) - pos - FRAME.size < size:
                break
            self.frames.heads.append((kind, stream, a, b))
            if size:
                self.frames.data.append((stream, buf[pos + FRAME.size : pos + FRAME.size + size]))
            pos += FRAME.size + size
        self._buf = buf[pos:]

    def finish(self, timeout: float = 20.0) -> int:
        """Wait for the relay to exit; close what the test still holds."""
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
            for fd in list(self._mine):
                self.close(fd)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "logs" / "vllm.log"


def test_lines_of_both_streams_are_logged_whole_forwarded_and_end_at_eof(log: Path) -> None:
    log.parent.mkdir()
    r = Relay(log)
    try:
        r.write(0, b"(APIServer pid=1) INFO one\r\n(APIServer pid=1) INFO tw")
        r.write(1, b"(EngineCore pid=2) ERROR boom\rprogress\n")
        time.sleep(0.1)
        r.write(0, b"o\n(APIServer pid=1) partial at EOF")
        r.close_input(0)
        r.close_input(1)
        frames = r.read_frames()
    finally:
        code = r.finish()
    assert code == 0
    text = log.read_bytes()
    # CR and CRLF become LF; each stream's lines stay whole; a last line without LF is ended
    assert sorted(text.splitlines()) == sorted(
        [
            b"(APIServer pid=1) INFO one",
            b"(APIServer pid=1) INFO two",
            b"(APIServer pid=1) partial at EOF",
            b"(EngineCore pid=2) ERROR boom",
            b"progress",
        ]
    )
    assert text.endswith(b"\n") and b"\r" not in text
    assert frames.text() == text  # forwarded: the same lines in vllm.log's order
    assert frames.text(0) == b"(APIServer pid=1) INFO one\n(APIServer pid=1) INFO two\n(APIServer pid=1) partial at EOF\n"
    assert sorted(h[1] for h in frames.kinds(EOF)) == [0, 1]
    assert log.stat().st_mode & 0o777 == 0o600


def test_rotation_at_line_ends_keeps_the_newest_backups(log: Path) -> None:
    log.parent.mkdir()
    r = Relay(log, n=1, max_bytes=1000, backups=2)
    lines = [b"line %04d " % i + b"x" * 89 + b"\n" for i in range(50)]  # 100 bytes each
    try:
        for i in range(0, 50, 5):
            r.write(0, b"".join(lines[i : i + 5]))
        r.close_input(0)
        frames = r.read_frames()
    finally:
        assert r.finish() == 0
    parts = [log.with_name("vllm.log.2"), log.with_name("vllm.log.1"), log]
    assert not log.with_name("vllm.log.3").exists()
    assert [p.stat().st_size for p in parts] == [1000, 1000, 1000]  # 10 whole lines per file
    assert b"".join(p.read_bytes() for p in parts) == b"".join(lines[20:])
    assert len(frames.kinds(ROT)) == 4  # 5 files' worth, 2 backups kept
    assert frames.text() == b"".join(lines)


def test_an_overlong_partial_line_is_written_split_nothing_lost(log: Path) -> None:
    log.parent.mkdir()
    r = Relay(log, n=1, hold=1000)
    try:
        r.write(0, b"y" * 3000)  # no LF: held up to 1000 bytes, then written out
        time.sleep(0.2)
        r.write(0, b"z\n")
        r.close_input(0)
        r.read_frames()
    finally:
        assert r.finish() == 0
    text = log.read_bytes()
    assert text.replace(b"\n", b"") == b"y" * 3000 + b"z"
    assert text.count(b"\n") >= 2 and text.endswith(b"z\n")


def test_known_secrets_are_replaced_in_vllm_log_and_frames_never_on_argv(log: Path) -> None:
    log.parent.mkdir()
    key = b"sk-test-0123456789abcdef"
    r = Relay(log, n=1, secrets=(b"sk-test", key))
    try:
        cmdline = Path(f"/proc/{r.proc.pid}/cmdline").read_bytes()
        r.write(0, b"(APIServer pid=1) INFO key=" + key + b" and " + key[:7] + b"\n")
        r.write(0, b"tail " + key)  # a last line without LF is scrubbed too
        r.close_input(0)
        frames = r.read_frames()
    finally:
        assert r.finish() == 0
    assert key not in cmdline and key.hex().encode() not in cmdline
    assert log.read_bytes() == b"(APIServer pid=1) INFO key=*** and ***\ntail ***\n"
    assert frames.text() == log.read_bytes()


def test_flush_is_acknowledged_after_the_pipes_are_in_vllm_log(log: Path) -> None:
    log.parent.mkdir()
    r = Relay(log, n=1)
    try:
        r.write(0, b"before flush\n")
        os.write(r.ctl_w, b"F" + (7).to_bytes(8, "big"))
        ready, _, _ = select.select([r.ack_r], [], [], 10)
        assert ready
        assert os.read(r.ack_r, 8) == (7).to_bytes(8, "big")
        assert log.read_bytes() == b"before flush\n"  # on disk when the ack comes
        frames = r.read_frames(timeout=10, until=lambda f: (ACK, 0, 7, 0) in f.heads)
        assert frames.text() == b"before flush\n"  # (the ACK comes after the lines before it)
        # quit: Q then EOF on the control pipe; the relay drains and exits with the input still open
        r.write(0, b"last\n")
        os.write(r.ctl_w, b"Q" + bytes(8))
        r.close(r.ctl_w)
        frames = r.read_frames()
    finally:
        assert r.finish() == 0
    assert log.read_bytes() == b"before flush\nlast\n"
    assert frames.text() == b"before flush\nlast\n" and frames.kinds(EOF) == [(EOF, 0, 0, 0)]


def test_when_the_supervisor_is_gone_vllm_log_goes_on_until_the_engine_eof(log: Path) -> None:
    log.parent.mkdir()
    r = Relay(log, n=1)
    try:
        r.write(0, b"one\n")
        r.read_frames(timeout=10, until=lambda f: f.text() == b"one\n")
        r.close(r.ctl_w)  # control EOF without Q: the supervisor died (kill -9)
        r.close(r.out_r)
        time.sleep(0.2)
        assert r.proc.poll() is None  # still draining the engine's pipe
        r.write(0, b"two\n" * 100_000)  # 400 kB: more than a pipe holds, the writer is not blocked
        r.close_input(0)
        code = r.proc.wait(20)
    finally:
        r.finish()
    assert code == 0
    assert log.read_bytes() == b"one\n" + b"two\n" * 100_000


def test_a_supervisor_that_does_not_read_gets_drop_frames_and_vllm_log_gets_every_line(log: Path) -> None:
    log.parent.mkdir()
    r = Relay(log, n=1, cap=64 << 10)
    lines = [b"(Worker_TP0 pid=9) INFO step %06d " % i + b"w" * 60 + b"\n" for i in range(40_000)]
    try:
        for i in range(0, len(lines), 400):  # ~4 MB while nobody reads the frame pipe
            r.write(0, b"".join(lines[i : i + 400]))
        r.close_input(0)
        frames = r.read_frames(timeout=60)
    finally:
        assert r.finish() == 0
    assert log.read_bytes() == b"".join(lines)  # vllm.log is never dropped from
    drops = frames.kinds(DROP)
    dropped = sum(h[2] for h in drops)
    forwarded = frames.text()
    assert drops and dropped > 0
    assert forwarded.count(b"\n") + dropped == len(lines)  # every line forwarded or counted
    assert sum(h[3] for h in drops) + len(forwarded) == len(b"".join(lines))
    assert set(forwarded.splitlines(keepends=True)) <= set(lines)  # forwarded lines are whole
