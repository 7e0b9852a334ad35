"""LogPump with real subprocesses and real pipes: demux, rotation, drops, burst, disk errors, EOF."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from xpu_serve.sources.log_pump import LogPump, PumpStats

from .conftest import FIXTURES

QWEN = FIXTURES / "cases" / "qwen3-30b-worker0-died" / "vllm.log"
CPU_TP2 = FIXTURES / "cases" / "cpu-tp2-worker0-segv" / "vllm.log"


@contextlib.contextmanager
def child(argv: list[str], **kw: object) -> Iterator[subprocess.Popen[bytes]]:
    """A child with stdout and stderr on pipes; killed and reaped whatever happens."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # type: ignore[call-overload]
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)


class Collect:
    """on_line callback keeping (lineno, line)."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []

    def __call__(self, line: str, lineno: int) -> None:
        self.lines.append((lineno, line))


class SlowCollect(Collect):
    """A slow supervisor side on purpose: sleeps 2 ms every 100 lines (the forwarding drops)."""

    def __call__(self, line: str, lineno: int) -> None:
        if lineno % 100 == 0:
            time.sleep(0.002)
        self.lines.append((lineno, line))


@pytest.fixture(params=[True, False], ids=["relay", "threads"])
def relay(request: pytest.FixtureRequest) -> bool:
    """Both ways of reading the pipes: the relay process (default) and in-process threads."""
    return bool(request.param)


def pump_cmd(tmp: Path, argv: list[str], **kw: object) -> tuple[PumpStats, Collect, Path]:
    got = Collect()
    logs = LogPump.dir_for(tmp, 3)
    pump = LogPump(logs, 3, on_line=got, **kw)  # type: ignore[arg-type]
    try:
        with child(argv) as p:
            pump.start(p.stdout, p.stderr)
            assert pump.wait_eof(30)
            assert p.wait(30) == 0
    finally:
        stats = pump.close()
    return stats, got, logs


def lines_of(path: Path) -> list[str]:
    return path.read_bytes().decode("utf-8", "replace").splitlines()


def test_demux_real_fixture_through_cat(tmp_path: Path, relay: bool) -> None:
    stats, got, logs = pump_cmd(tmp_path, ["cat", str(QWEN)], relay=relay)
    assert logs == tmp_path / "logs" / "3"
    src = QWEN.read_bytes()
    # vllm.log is the stream itself, byte for byte (this fixture has no CR).
    assert (logs / "vllm.log").read_bytes() == src
    src_lines = src.decode().splitlines()
    assert stats.lines == len(src_lines) == 241
    assert stats.bytes == len(src)
    assert (stats.dropped_lines, stats.write_errors, stats.truncated_lines) == (0, 0, 0)
    # The callback saw every line, in order, numbered like the file.
    assert got.lines == list(enumerate(src_lines, start=1))

    files = sorted(p.name for p in logs.iterdir())
    assert files == [
        "EngineCore.log",
        "Worker_TP0.log",
        "Worker_TP1.log",
        "Worker_TP2.log",
        "Worker_TP3.log",
        "unprefixed.log",
        "vllm.log",
    ]
    engine = lines_of(logs / "EngineCore.log")
    assert len(engine) == 90 and all(ln.startswith("(EngineCore pid=7732) ") for ln in engine)
    # Worker_TP0 (pid 7986): early "(Worker pid=7986)" lines first, its oneCCL lines, then Worker_TP0 lines.
    w0 = lines_of(logs / "Worker_TP0.log")
    assert w0[0].startswith(
        "(Worker pid=7986) INFO 03-26 04:12:16 [parallel_state.py:1395] world_size=4 rank=0"
    )
    assert (
        "2026:03:26-04:12:17: 7986 |CCL_WARN| value of CCL_ATL_TRANSPORT changed to be ofi (default:mpi)"
        in w0
    )
    assert any(ln.startswith("2026:03:26-04:12:18: 7986:[0] |CCL_WARN| topology recognition") for ln in w0)
    assert any(ln.startswith("(Worker_TP0 pid=7986) ") for ln in w0)
    for ln in w0:
        assert ln.startswith(("(Worker pid=7986)", "(Worker_TP0 pid=7986)", "2026:03:26-")) and (
            "7986" in ln[:40]
        )
    # Rank 3's oneCCL teardown errors ("7989:[3] |CCL_ERROR|") are in Worker_TP3.log.
    w3 = lines_of(logs / "Worker_TP3.log")
    assert sum("7989:[3] |CCL_ERROR|" in ln for ln in w3) == 4
    unpref = lines_of(logs / "unprefixed.log")
    assert "~pmi_resizable_simple_internal: failed" in unpref
    assert not any(ln.startswith("(") for ln in unpref)
    # Every line is in exactly one per-process file.
    per_process = sum(len(lines_of(p)) for p in logs.iterdir() if p.name != "vllm.log")
    assert per_process == len(src_lines)
    # Within a per-process file, lines keep their order from the stream.
    assert engine == [ln for ln in src_lines if ln.startswith("(EngineCore pid=7732) ")]


def test_demux_real_cpu_log_crlf_and_nested(tmp_path: Path) -> None:
    # A real `vllm serve` log (CPU, TP=2) with CRLF line ends; plus a relayed, nested prefix.
    extra = tmp_path / "extra.log"
    extra.write_bytes(b"(APIServer pid=7019) (EngineCore_DP0 pid=7100) ERROR relayed line\n")
    stats, got, logs = pump_cmd(tmp_path, ["cat", str(CPU_TP2), str(extra)])
    src = CPU_TP2.read_bytes().replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    src += extra.read_bytes()
    assert (logs / "vllm.log").read_bytes() == src
    assert b"\r" not in (logs / "vllm.log").read_bytes()
    n = len(src.decode().split("\n")) - 1
    assert stats.lines == n == len(got.lines)
    names = {p.name for p in logs.iterdir()}
    assert {"APIServer.log", "EngineCore.log", "Worker_TP0.log", "Worker_TP1.log", "unprefixed.log"} <= names
    assert "EngineCore_DP0.log" not in names
    assert lines_of(logs / "EngineCore.log")[-1].endswith("ERROR relayed line")
    api = lines_of(logs / "APIServer.log")
    assert api and all(ln.startswith("(APIServer pid=") for ln in api)
    assert not any("EngineCore_DP0" in ln for ln in api)
    # The early "(Worker pid=N)" lines went to the Worker_TPn file of their pid.
    assert "Worker.log" not in names
    for f in ("Worker_TP0.log", "Worker_TP1.log"):
        pids = {
            m.group(1) for ln in lines_of(logs / f) if (m := re.match(r"\(Worker(?:_TP\d)? pid=(\d+)\)", ln))
        }
        assert len(pids) == 1


def test_worker_name_that_never_resolves_goes_to_worker_log(tmp_path: Path) -> None:
    # TP=1: vLLM never renames "Worker"; the held lines go to Worker.log after pending_timeout_s,
    # while the child is still running (not only at EOF).
    r, w = os.pipe()
    logs = tmp_path / "logs"
    pump = LogPump(logs, 1, pending_timeout_s=0.2)
    pump.start(r)
    try:
        os.write(w, b"(Worker pid=4242) INFO early\n2026:03:26-04:12:17: 4242 |CCL_WARN| x\n")
        deadline = time.monotonic() + 10
        while not (logs / "Worker.log").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines_of(logs / "Worker.log") == [
            "(Worker pid=4242) INFO early",
            "2026:03:26-04:12:17: 4242 |CCL_WARN| x",
        ]
        os.write(w, b"(Worker pid=4242) INFO later\n")
        # An unknown pid's oneCCL line ends in unprefixed.log at EOF.
        os.write(w, b"2026:03:26-04:12:17:(  999) |CCL_ERROR| orphan\n")
    finally:
        os.close(w)
        assert pump.wait_eof(10)
        pump.close()
    assert lines_of(logs / "Worker.log")[-1] == "(Worker pid=4242) INFO later"
    assert lines_of(logs / "unprefixed.log") == ["2026:03:26-04:12:17:(  999) |CCL_ERROR| orphan"]


def test_rotation_keeps_every_line_within_backups(tmp_path: Path) -> None:
    # 3000 lines of 50 bytes = 150 kB; files of at most 20 kB, 10 backups -> all kept.
    script = "import sys\nfor i in range(3000): sys.stdout.write(f'(EngineCore pid=1) line {i:08d} ' + 'x' * 23 + '\\n')"
    got = Collect()
    logs = tmp_path / "logs"
    pump = LogPump(logs, 1, on_line=got, max_bytes=20_000, backups=10)
    with child([sys.executable, "-c", script]) as p:
        pump.start(p.stdout, p.stderr)
        assert pump.wait_eof(30)
    # locate(): the logical line number -> the rotated file and line that hold it now.
    for lineno, line in got.lines[::97] + got.lines[-1:]:
        where = pump.locate(lineno)
        assert where is not None
        assert lines_of(where[0])[where[1] - 1] == line
    assert pump.locate(3001) is None and pump.locate(0) is None
    stats = pump.close()
    parts = [logs / "vllm.log"] + [logs / f"vllm.log.{i}" for i in range(1, 11)]
    present = [p for p in parts if p.exists()]
    assert len(present) >= 8  # 150 kB / 20 kB
    for p in present:
        data = p.read_bytes()
        assert 0 < len(data) <= 20_000
        assert data.endswith(b"\n")  # rotated at line boundaries
    # Oldest first, the parts are the whole stream.
    joined = b"".join(p.read_bytes() for p in reversed(present))
    want = [f"(EngineCore pid=1) line {i:08d} " + "x" * 23 for i in range(3000)]
    assert joined.decode().splitlines() == want
    assert [ln for _, ln in got.lines] == want
    assert stats.lines == 3000
    # Per-process files rotate too.
    assert (logs / "EngineCore.log.1").exists()


def test_rotation_drops_oldest_beyond_backups(tmp_path: Path) -> None:
    script = "import sys\nfor i in range(3000): sys.stdout.write(f'line {i:08d} ' + 'y' * 35 + '\\n')"
    stats, _, logs = pump_cmd(tmp_path, [sys.executable, "-c", script], max_bytes=10_000, backups=2)
    assert sorted(p.name for p in logs.glob("vllm.log*")) == ["vllm.log", "vllm.log.1", "vllm.log.2"]
    assert not (logs / "vllm.log.3").exists()
    tail = (
        (logs / "vllm.log.2").read_bytes()
        + (logs / "vllm.log.1").read_bytes()
        + (logs / "vllm.log").read_bytes()
    )
    lines = tail.decode().splitlines()
    assert lines[-1].startswith("line 00002999 ")
    nums = [int(ln.split()[1]) for ln in lines]
    assert nums == list(range(nums[0], 3000))  # a contiguous tail, no hole
    assert stats.lines == 3000


WRITER = r"""
import os, sys
n = int(sys.argv[1])
buf = []
for i in range(n):
    buf.append(f"(Worker_TP0 pid=7) INFO line {i:09d} " + "z" * 60 + "\n")
    if len(buf) == 1000:
        os.write(1, "".join(buf).encode()); buf = []
if buf:
    os.write(1, "".join(buf).encode())
"""
LINE_RE = re.compile(r"\(Worker_TP0 pid=7\) INFO line (\d{9}) z{60}")


def test_slow_writer_drops_whole_lines_counted_and_marked(tmp_path: Path, relay: bool) -> None:
    # The writer is made slow on purpose: the callback blocks until the child has exited.
    # The child must still finish (never blocked), and every line is either handled or counted.
    # Relay: vllm.log is complete all the same, byte for byte; only the forwarding to the
    # per-process files, the echo and the callback dropped (counted and marked there, with the
    # vllm.log line numbers of what is missing). Threads (fallback): drops are marked in vllm.log.
    release = threading.Event()
    seen: list[tuple[int, str]] = []

    def blocking(line: str, lineno: int) -> None:
        release.wait(60)
        seen.append((lineno, line))

    n = 100_000  # ~10 MB against a 256 kB buffer
    logs = tmp_path / "logs"
    out = io.StringIO()
    pump = LogPump(logs, 5, echo=out, on_line=blocking, buffer_cap_bytes=256 * 1024, relay=relay)
    with child([sys.executable, "-c", WRITER, str(n)]) as p:
        pump.start(p.stdout, p.stderr)
        assert p.wait(60) == 0  # finished while the writer was stuck
        if relay:
            # vllm.log has everything the child wrote, the callback still blocked (flush() then
            # gives the blocked writer the rest of its timeout, and is True all the same)
            assert pump.flush(3)
            assert (logs / "vllm.log").read_bytes() == writer_bytes(n)
        release.set()
        assert pump.wait_eof(60)
    stats = pump.close()
    assert stats.dropped_lines > 0
    assert stats.lines + stats.dropped_lines == n
    assert stats.bytes == n * len("(Worker_TP0 pid=7) INFO line 000000000 " + "z" * 60 + "\n")
    assert stats.dropped_bytes == stats.bytes - stats.lines * 100
    text = lines_of(logs / ("Worker_TP0.log" if relay else "vllm.log"))
    markers = [ln for ln in text if ln.startswith("[xpu-serve] dropped ")]
    assert markers
    total = 0
    gaps: set[int] = set()
    for m in markers:
        if relay:
            mm = re.fullmatch(
                r"\[xpu-serve\] dropped (\d+) lines \((\d+) bytes\) here: the supervisor could not keep up; "
                r"vllm.log has them \(lines (\d+)-(\d+)\)",
                m,
            )
            assert mm, m
            gaps.update(range(int(mm.group(3)), int(mm.group(4)) + 1))
        else:
            mm = re.fullmatch(
                r"\[xpu-serve\] dropped (\d+) lines \((\d+) bytes\): log writer could not keep up", m
            )
            assert mm, m
        total += int(mm.group(1))
    assert total == stats.dropped_lines
    kept = [ln for ln in text if not ln.startswith("[xpu-serve]")]
    assert len(kept) == stats.lines == len(seen)
    assert [ln for _, ln in seen] == kept
    nums = []
    for ln in kept:  # whole lines only, in order
        mm = LINE_RE.fullmatch(ln)
        assert mm, ln
        nums.append(int(mm.group(1)))
    assert nums == sorted(nums) and len(set(nums)) == len(nums)
    if relay:
        assert stats.log_missed_lines == 0
        assert (logs / "vllm.log").read_bytes() == writer_bytes(n)
        # Callback numbers are vllm.log's; the markers' ranges are exactly the lines not forwarded.
        assert all(lineno == num + 1 for (lineno, _), num in zip(seen, nums, strict=True))
        assert gaps == set(range(1, n + 1)) - {num + 1 for num in nums}
        assert sum(ln.startswith("[i5] [xpu-serve] dropped ") for ln in out.getvalue().splitlines()) == len(
            markers
        )
    else:
        assert stats.log_missed_lines == stats.dropped_lines
        assert lines_of(logs / "Worker_TP0.log") == kept


def writer_bytes(n: int) -> bytes:
    """What WRITER writes for `n` lines."""
    return "".join(f"(Worker_TP0 pid=7) INFO line {i:09d} " + "z" * 60 + "\n" for i in range(n)).encode()


def test_blocked_echo_never_blocks_pump(tmp_path: Path) -> None:
    # The echo goes to a pipe nobody reads: the echo thread blocks, drops and counts; the pump,
    # the files and the callback go on in full.
    er, ew = os.pipe()
    echo = io.TextIOWrapper(io.FileIO(ew, "w", closefd=True), encoding="utf-8")
    got = Collect()
    n = 50_000
    logs = tmp_path / "logs"
    pump = LogPump(logs, 7, echo=echo, on_line=got, echo_cap_bytes=64 * 1024)
    try:
        with child([sys.executable, "-c", WRITER, str(n)]) as p:
            pump.start(p.stdout, p.stderr)
            assert p.wait(60) == 0
            assert pump.wait_eof(60)
        t0 = time.monotonic()
        stats = pump.close(timeout=1.0)
        assert time.monotonic() - t0 < 10
        assert stats.lines == n and stats.dropped_lines == 0
        assert stats.echo_dropped > 0
        assert len(got.lines) == n
        assert len(lines_of(logs / "vllm.log")) == n
    finally:
        # Unblock the echo thread (read the pipe dry), then look at what it wrote.
        os.set_blocking(er, False)
        chunks = []
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 0.5:
            try:
                chunks.append(os.read(er, 1 << 16))
                idle_since = time.monotonic()
            except BlockingIOError:
                time.sleep(0.02)
        with contextlib.suppress(Exception):
            echo.close()
        os.close(er)
    echoed = b"".join(chunks).decode().splitlines()
    assert echoed and all(ln.startswith("[i7] ") for ln in echoed if ln)
    assert echoed[0] == "[i7] (Worker_TP0 pid=7) INFO line 000000000 " + "z" * 60
    assert len(echoed) < n
    # Whole lines only; drops are announced in the echo itself once it can write again.
    for ln in echoed:
        assert LINE_RE.fullmatch(ln[5:]) or re.fullmatch(
            r"\[i7\] \[xpu-serve\] echo dropped \d+ lines: output could not keep up", ln
        ), ln


def test_echo_tagged_with_incarnation(tmp_path: Path) -> None:
    r, w = os.pipe()
    out = io.StringIO()
    pump = LogPump(tmp_path, 12, echo=out)
    pump.start(r)
    os.write(w, b"(APIServer pid=1) INFO hello\nplain\n")
    os.close(w)
    assert pump.wait_eof(10)
    pump.close()
    assert out.getvalue() == "[i12] (APIServer pid=1) INFO hello\n[i12] plain\n"


BURST = r"""
import os, sys, time
total = int(sys.argv[1])
line = b"(Worker_TP1 pid=9) INFO 03-26 04:12:20 [gpu_model_runner.py:4481] a line of a log burst, 100 bytes.\n"
block = line * (65536 // len(line))
reps = total // len(block)
t0 = time.perf_counter()
for _ in range(reps):
    v = memoryview(block)
    while v:
        v = v[os.write(1, v):]
sys.stderr.write(f"{time.perf_counter() - t0:.6f} {reps * len(block) // len(line)}\n")
"""


def test_100mb_burst_does_not_slow_child(tmp_path: Path) -> None:
    mb = 100 * 1000 * 1000
    # Baseline: the same child straight into a file.
    with open(tmp_path / "direct.log", "wb") as f:
        base = subprocess.run(
            [sys.executable, "-c", BURST, str(mb)], stdout=f, stderr=subprocess.PIPE, check=True, timeout=120
        )
    (tmp_path / "direct.log").unlink()
    t_file = float(base.stderr.split()[0])
    logs = tmp_path / "logs"
    pump = LogPump(logs, 1, on_line=lambda ln, _: None)
    try:
        with child([sys.executable, "-c", BURST, str(mb)]) as p:
            pump.start(p.stdout, p.stderr)
            assert p.wait(120) == 0
            assert pump.wait_eof(120)
    finally:
        stats = pump.close()
    # vllm.log (rotated at 64 MiB: vllm.log.1 then vllm.log) has every byte; the child's timing
    # line is its last line (the callback may not have seen it: forwarding may drop).
    parts = [logs / "vllm.log.1", logs / "vllm.log"]
    last = lines_of(parts[-1])[-1]
    t_pump_s, nlines_s = last.split()
    t_pump, nlines = float(t_pump_s), int(nlines_s)
    assert sum(p.stat().st_size for p in parts) == nlines * 100 + len(last) + 1
    assert not (logs / "vllm.log.2").exists()
    # Generous bound (CI noise): the child through the pump takes at most 3x (+1 s) its time to a file.
    assert t_pump <= 3 * t_file + 1.0, (t_pump, t_file)
    # Nothing lost silently: every line is handled or counted as dropped (+1: the timing line).
    assert stats.lines + stats.dropped_lines == nlines + 1
    assert stats.log_missed_lines == 0
    assert stats.bytes >= nlines * 100


def _mount_tiny_tmpfs(path: Path, size: str = "64k") -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


def test_disk_full_degrades_and_recovers(tmp_path: Path) -> None:
    # A real full disk: a 64 kB tmpfs (root), else vllm.log pointing at /dev/full (ENOSPC on write).
    mnt = tmp_path / "tiny"
    mounted = _mount_tiny_tmpfs(mnt)
    if not mounted:
        mnt.mkdir(exist_ok=True)
        (mnt / "vllm.log").symlink_to("/dev/full")
    try:
        r, w = os.pipe()
        got = Collect()
        out = io.StringIO()
        pump = LogPump(mnt, 2, echo=out, on_line=got, retry_interval_s=0.05)
        pump.start(r)
        line = b"(EngineCore pid=3) INFO " + b"d" * 75 + b"\n"  # 100 bytes
        os.write(w, line * 2000)  # 200 kB > 64 kB
        assert pump.flush(10)
        assert pump.stats().write_errors > 0
        assert len(got.lines) == 2000  # the analysis still sees every line
        if mounted:
            # Free the space: the files work again and say what they missed.
            for p in mnt.iterdir():
                p.unlink()
            time.sleep(0.1)
        os.write(w, b"(EngineCore pid=3) INFO after\n")
        os.close(w)
        assert pump.wait_eof(10)
        stats = pump.close(timeout=2.0)
        assert stats.lines == 2001 and len(got.lines) == 2001
        assert stats.write_errors > 0 and stats.dropped_lines == 0
        echoed = out.getvalue().splitlines()
        assert sum(ln.startswith("[i2] (EngineCore pid=3) INFO ") for ln in echoed) == 2001
        assert any("log write to" in ln and "No space left on device" in ln for ln in echoed)
        if mounted:
            vlog = lines_of(mnt / "vllm.log")
            assert re.fullmatch(r"\[xpu-serve\] \d+ lines not written to this file: \[Errno 28\] .*", vlog[0])
            assert vlog[-1] == "(EngineCore pid=3) INFO after"
            assert lines_of(mnt / "EngineCore.log")[-1] == "(EngineCore pid=3) INFO after"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_partial_last_line_cr_and_bad_utf8(tmp_path: Path, relay: bool) -> None:
    data = b"one\r\ntwo\rthree\n\xff\xfe bad \xc3\n\nlast without newline"
    stats, got, logs = pump_cmd(
        tmp_path, [sys.executable, "-c", f"import os; os.write(1, {data!r})"], relay=relay
    )
    assert [ln for _, ln in got.lines] == [
        "one",
        "two",
        "three",
        "\ufffd\ufffd bad \ufffd",
        "",
        "last without newline",
    ]
    assert [n for n, _ in got.lines] == [1, 2, 3, 4, 5, 6]
    # vllm.log keeps the raw bytes (CR normalised, final newline added).
    assert (logs / "vllm.log").read_bytes() == b"one\ntwo\nthree\n\xff\xfe bad \xc3\n\nlast without newline\n"
    assert stats.lines == 6


def test_crlf_split_across_reads_is_one_break(tmp_path: Path, relay: bool) -> None:
    r, w = os.pipe()
    got = Collect()
    pump = LogPump(tmp_path, 1, on_line=got, relay=relay)
    pump.start(r)
    os.write(w, b"a\r")
    assert pump.flush(5)
    time.sleep(0.05)
    os.write(w, b"\nb\n")
    os.close(w)
    assert pump.wait_eof(5)
    pump.close()
    assert [ln for _, ln in got.lines] == ["a", "b"]


def test_very_long_line_is_cut_and_marked(tmp_path: Path) -> None:
    script = "import os; os.write(1, b'(EngineCore pid=1) ' + b'L' * 300000 + b'\\nnext\\n' + b'M' * 5000)"
    stats, got, logs = pump_cmd(tmp_path, [sys.executable, "-c", script], max_line_bytes=1000)
    lines = [ln for _, ln in got.lines]
    assert (
        lines[0]
        == "(EngineCore pid=1) " + "L" * 981 + f" [xpu-serve] line truncated: {300019 - 1000} bytes dropped"
    )
    assert lines[1] == "next"
    assert lines[2] == "M" * 1000 + " [xpu-serve] line truncated: 4000 bytes dropped"
    assert stats.truncated_lines == 2
    assert lines_of(logs / "EngineCore.log") == [lines[0]]


def test_callback_errors_are_counted_not_fatal(tmp_path: Path) -> None:
    seen: list[int] = []

    def bad(line: str, lineno: int) -> None:
        seen.append(lineno)
        if lineno % 2:
            raise ValueError("boom")

    r, w = os.pipe()
    out = io.StringIO()
    pump = LogPump(tmp_path, 1, echo=out, on_line=bad)
    pump.start(r)
    os.write(w, b"".join(b"l%d\n" % i for i in range(10)))
    os.close(w)
    assert pump.wait_eof(5)
    stats = pump.close()
    assert seen == list(range(1, 11))
    assert stats.callback_errors == 5 and stats.lines == 10
    assert "[i1] [xpu-serve] on_line callback raised ValueError: boom" in out.getvalue()
    assert len(lines_of(tmp_path / "vllm.log")) == 10


def test_flush_before_eof_and_close_while_child_alive(tmp_path: Path, relay: bool) -> None:
    # The supervisor flushes before the bundle, while the engine still runs; then close() with the
    # child still holding the pipe returns promptly.
    script = "import sys, time\nprint('(APIServer pid=1) INFO up', flush=True)\ntime.sleep(60)"
    pump = LogPump(tmp_path, 1, relay=relay)
    with child([sys.executable, "-c", script]) as p:
        pump.start(p.stdout, p.stderr)
        deadline = time.monotonic() + 10
        while pump.stats().lines < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pump.flush(5)
        assert lines_of(tmp_path / "vllm.log") == ["(APIServer pid=1) INFO up"]
        assert not pump.wait_eof(0.1)
        t0 = time.monotonic()
        stats = pump.close(timeout=2.0)
        assert time.monotonic() - t0 < 5
        assert stats.lines == 1
    assert p.stdout is not None and p.stdout.closed


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        LogPump(Path("/nonexistent"), 1, max_bytes=0)


def test_flush_is_exact_for_what_the_child_wrote(tmp_path: Path, relay: bool) -> None:
    # flush() right after a write() must find the line on disk: nothing in flight is missed.
    r, w = os.pipe()
    pump = LogPump(tmp_path, 1, relay=relay)
    pump.start(r)
    try:
        for i in range(20):
            os.write(w, b"(EngineCore pid=2) INFO line %d\n" % i)
            assert pump.flush(5)
            assert lines_of(tmp_path / "EngineCore.log")[-1] == f"(EngineCore pid=2) INFO line {i}"
    finally:
        os.close(w)
        pump.close()


def test_relay_death_falls_back_to_threads(tmp_path: Path) -> None:
    r, w = os.pipe()
    got = Collect()
    out = io.StringIO()
    pump = LogPump(tmp_path, 4, echo=out, on_line=got)
    pump.start(r)
    try:
        relay_proc = pump._relay
        assert relay_proc is not None and relay_proc.poll() is None
        assert os.getsid(relay_proc.pid) != os.getsid(0)  # its own session: not in a tree kill
        os.write(w, b"before\n")
        assert pump.flush(5)
        relay_proc.kill()
        relay_proc.wait(5)
        time.sleep(0.2)
        for i in range(100):
            os.write(w, b"after %d\n" % i)
    finally:
        os.close(w)
    assert pump.wait_eof(10)
    stats = pump.close()
    lines = [ln for _, ln in got.lines]
    assert lines[0] == "before" and lines[-1] == "after 99"
    assert lines[1:] == [f"after {i}" for i in range(100)]  # nothing written after the death is lost
    assert stats.lines == 101
    assert "log relay process ended unexpectedly" in out.getvalue()


def test_close_ends_the_relay(tmp_path: Path) -> None:
    pump = LogPump(tmp_path, 1)
    with child([sys.executable, "-c", "import time; time.sleep(60)"]) as p:
        pump.start(p.stdout, p.stderr)
        relay_proc = pump._relay
        assert relay_proc is not None
        pump.close(timeout=2.0)
        assert relay_proc.poll() is not None  # ended and reaped


INTERLEAVE = r"""
import os, random
rnd = random.Random(7)
bufs = {1: b"", 2: b""}
for i in range(20000):
    fd = rnd.choice((1, 2))
    end = rnd.choice((b"\n", b"\n", b"\r\n", b"\r"))
    bufs[fd] += b"(Worker_TP%d pid=%d) line %06d" % (fd - 1, 100 + fd, i) + end
    if len(bufs[fd]) > rnd.randint(1, 5000):
        cut = rnd.randint(1, len(bufs[fd]))  # cut anywhere: lines split across writes
        os.write(fd, bufs[fd][:cut])
        bufs[fd] = bufs[fd][cut:]
for fd, b in bufs.items():
    os.write(fd, b)
"""


def test_two_streams_split_anywhere_keep_every_line(tmp_path: Path, relay: bool) -> None:
    # stdout and stderr interleaved, writes cut at random places (inside lines, between CR and
    # LF): every line arrives whole, once, in its stream's order.
    stats, got, logs = pump_cmd(tmp_path, [sys.executable, "-c", INTERLEAVE], relay=relay)
    lines = [ln for _, ln in got.lines]
    assert stats.lines == len(lines) == 20000 and stats.dropped_lines == 0
    ids = sorted(int(ln.rsplit(" ", 1)[1]) for ln in lines)
    assert ids == list(range(20000))
    for rank in (0, 1):
        mine = lines_of(logs / f"Worker_TP{rank}.log")
        nums = [int(ln.rsplit(" ", 1)[1]) for ln in mine]
        assert nums == sorted(nums)
        assert all(ln.startswith(f"(Worker_TP{rank} pid={101 + rank}) line ") for ln in mine)
    assert len(lines_of(logs / "Worker_TP0.log")) + len(lines_of(logs / "Worker_TP1.log")) == 20000


MIXED = r"""
import os, sys
n = int(sys.argv[1])
out = []
for i in range(n):
    # stdout: vLLM-like lines of varying length, CRLF now and then; 64 KiB block writes
    out.append(b"(Worker_TP%d pid=%d) INFO step %08d " % (i % 4, 100 + i % 4, i) + b"q" * (i % 97) + (b"\r\n" if i % 13 == 0 else b"\n"))
    if len(out) == 600:
        blk = memoryview(b"".join(out)); out = []
        while blk:
            blk = blk[os.write(1, blk[:65536]):]
blk = memoryview(b"".join(out))
while blk:
    blk = blk[os.write(1, blk):]
"""


def mixed_bytes(n: int) -> bytes:
    """What MIXED writes for `n` lines, CRLF normalised to LF (as vllm.log has it)."""
    return b"".join(
        b"(Worker_TP%d pid=%d) INFO step %08d " % (i % 4, 100 + i % 4, i) + b"q" * (i % 97) + b"\n"
        for i in range(n)
    )


def test_relay_vllm_log_complete_and_rotated_while_supervisor_is_slow(tmp_path: Path) -> None:
    # A burst (~16 MB in 64 KiB writes) while the supervisor side is slow on purpose (the
    # callback sleeps): the relay writes vllm.log itself, rotating at 1 MB, byte for byte
    # complete; only the forwarding drops (counted). Callback numbers are vllm.log's, and
    # locate() finds each seen line in the rotated part that holds it.
    n = 200_000
    slow = SlowCollect()
    seen = slow.lines

    logs = tmp_path / "logs"
    pump = LogPump(logs, 2, on_line=slow, max_bytes=1_000_000, backups=30, buffer_cap_bytes=512 * 1024)
    try:
        with child([sys.executable, "-c", MIXED, str(n)]) as p:
            pump.start(p.stdout, p.stderr)
            assert p.wait(60) == 0  # never blocked by the slow side
            assert pump.flush(10)
            want = mixed_bytes(n)
            parts = sorted(
                logs.glob("vllm.log*"), key=lambda q: -int(q.suffix[1:]) if q.suffix[1:].isdigit() else 0
            )
            # Complete before the writer caught up; bytes spliced during the burst keep their CRLF
            # (module docstring: only the copied path turns CR into LF).
            joined = b"".join(q.read_bytes() for q in parts)
            assert joined.replace(b"\r\n", b"\n") == want
            if hasattr(os, "splice"):
                assert b"\r\n" in joined  # the splice path ran (and rotated: checked below)
            assert len(parts) >= 16
            for q in parts:
                data = q.read_bytes()
                assert 0 < len(data) <= 1_000_000 and data.endswith(b"\n")
            assert pump.wait_eof(60)
            stats = pump.close()
    finally:
        pump.close()
    assert stats.dropped_lines > 0 and stats.lines + stats.dropped_lines == n
    assert stats.log_missed_lines == 0 and stats.write_errors == 0
    want_lines = want.decode().split("\n")
    assert all(want_lines[lineno - 1] == line for lineno, line in seen)
    for lineno, line in seen[:: max(1, len(seen) // 200)] + seen[-1:]:
        where = pump.locate(lineno)
        assert where is not None, lineno
        assert lines_of(where[0])[where[1] - 1] == line
    assert pump.locate(n + 1) is None


def test_relay_rotation_keeps_newest_backups(tmp_path: Path) -> None:
    # Rotation in the relay: 3000 lines of 50 bytes into 10 kB files, 2 backups: the newest
    # three files, whole lines, a contiguous tail ending with the last line; locate() knows
    # which lines were rotated away.
    script = "import sys\nfor i in range(3000): sys.stdout.write(f'line {i:08d} ' + 'y' * 35 + '\\n')"
    got = Collect()
    logs = tmp_path / "logs"
    pump = LogPump(logs, 1, on_line=got, max_bytes=10_000, backups=2)
    with child([sys.executable, "-c", script]) as p:
        pump.start(p.stdout, p.stderr)
        assert pump._relay is not None  # the relay writes vllm.log
        assert pump.wait_eof(30)
    assert sorted(q.name for q in logs.glob("vllm.log*")) == ["vllm.log", "vllm.log.1", "vllm.log.2"]
    sizes = [(logs / f).stat().st_size for f in ("vllm.log.2", "vllm.log.1")]
    assert sizes == [10_000, 10_000]  # 200 lines of 50 bytes: full files, cut at line boundaries
    tail = b"".join((logs / f).read_bytes() for f in ("vllm.log.2", "vllm.log.1", "vllm.log"))
    nums = [int(ln.split()[1]) for ln in tail.decode().splitlines()]
    assert nums == list(range(3000 - len(nums), 3000))
    assert len(nums) == 600  # vllm.log is full too (rotation happens before a write would pass)
    assert pump.locate(1) is None  # rotated away
    assert pump.locate(2400) is None
    assert pump.locate(3000) == (logs / "vllm.log", 200)
    assert pump.locate(2401) == (logs / "vllm.log.2", 1)
    assert pump.locate(2601) == (logs / "vllm.log.1", 1)
    stats = pump.close()
    assert stats.lines == 3000 and len(got.lines) == 3000


def test_relay_disk_full_degrades_counts_and_marks(tmp_path: Path) -> None:
    # ENOSPC on a real tiny tmpfs (root only): the relay keeps reading (the child is never
    # blocked) and forwarding (the callback sees every line), counts the lines vllm.log missed,
    # and when there is room again writes one marker line saying how many, then goes on.
    mnt = tmp_path / "tiny"
    if not _mount_tiny_tmpfs(mnt, "512k"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        filler = mnt / "filler"
        filler.write_bytes(b"f" * 256 * 1024)
        logs = mnt / "logs"
        out = io.StringIO()
        got = Collect()
        pump = LogPump(logs, 6, echo=out, on_line=got, retry_interval_s=0.05)
        n = 6000  # 600 kB of lines > the room left
        line = "(EngineCore pid=3) INFO line {:06d} " + "e" * 67
        r, w = os.pipe()
        pump.start(r)
        try:
            t0 = time.monotonic()
            for i in range(0, n, 500):
                os.write(w, "".join(line.format(j) + "\n" for j in range(i, i + 500)).encode())
            assert time.monotonic() - t0 < 20  # the writer never blocked for long
            assert pump.flush(10)
            assert pump.stats().write_errors > 0
            filler.unlink()  # room again
            time.sleep(0.1)
            os.write(w, b"(EngineCore pid=3) INFO after\n")
            assert pump.flush(10)
        finally:
            os.close(w)
            stats = pump.close()
        assert len(got.lines) == n + 1 and stats.lines == n + 1 and stats.dropped_lines == 0
        assert [ln for _, ln in got.lines][:n] == [line.format(i) for i in range(n)]
        echoed = out.getvalue()
        assert f"log write to {logs / 'vllm.log'} failed: [Errno 28] No space left on device" in echoed
        text = (logs / "vllm.log").read_bytes().decode()
        k = 0
        while text.startswith(line.format(k) + "\n"):
            text = text[len(line.format(k)) + 1 :]
            k += 1
        assert 0 < k < n  # a complete prefix was written before the disk filled
        # then maybe the head of a half-written line, ended by the marker, then the new line
        # then maybe the head of a half-written line, ended by the marker, then the new line
        mm = re.search(
            r"(?:^|\n)\[xpu-serve\] (\d+) lines not written to this file: \[Errno 28\] No space left on device\n",
            text,
        )
        assert mm, text[:300]
        head, after = text[: mm.start()], text[mm.end() :]
        assert int(mm.group(1)) == n - k == stats.log_missed_lines  # (a half-written line is missed)
        assert after == "(EngineCore pid=3) INFO after\n"
        assert line.format(k).startswith(head)
        assert f"log file {logs / 'vllm.log'} writable again ({n - k} lines missed)" in echoed
        assert stats.write_errors >= 1
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_rotation_with_a_huge_backups_count_costs_only_the_files_that_exist(tmp_path: Path) -> None:
    # backups=100000 and 30 rotations, in the relay and in the per-process files: a rotation
    # used to try a rename of every name up to `backups` (~1 s each here at 100000), now only
    # of the backups that exist. Every line is kept, newest last, in contiguous backups.
    script = "import sys\nfor i in range(3000): sys.stdout.write(f'(EngineCore pid=3) line {i:08d} ' + 'y' * 20 + '\\n')"
    logs = tmp_path / "logs"
    pump = LogPump(logs, 1, max_bytes=5_000, backups=100_000)
    t0 = time.monotonic()
    try:
        with child([sys.executable, "-c", script]) as p:
            pump.start(p.stdout, p.stderr)
            assert pump._relay is not None
            assert pump.wait_eof(60)
    finally:
        stats = pump.close()
    took = time.monotonic() - t0
    for name in ("vllm.log", "EngineCore.log"):
        parts = sorted(logs.glob(name + ".*"), key=lambda q: -int(q.suffix[1:]))
        assert [int(q.suffix[1:]) for q in parts] == list(range(len(parts), 0, -1)) and len(parts) >= 30
        text = b"".join(q.read_bytes() for q in [*parts, logs / name]).decode()
        assert [int(ln.split()[3]) for ln in text.splitlines()] == list(range(3000)), name
    assert stats.lines == 3000
    assert took < 10, took  # (was > 60 s: 2 x 30 rotations x 100000 renames tried)


def test_relay_keeps_writing_and_rotating_in_its_directory_after_it_was_moved(tmp_path: Path) -> None:
    # The next supervisor run moves logs/N aside (logs/N.prev) while an old relay may still drain
    # an orphan's pipes: that relay writes and rotates in the moved directory; the new run's
    # logs/N (here a vllm.log of its own) is never renamed or written to.
    logs = tmp_path / "logs"
    pump = LogPump(logs, 1, max_bytes=10_000, backups=50)
    r, w = os.pipe()
    pump.start(r)
    try:
        assert pump._relay is not None
        os.write(w, b"".join(b"old %06d %s\n" % (i, b"o" * 40) for i in range(100)))
        assert pump.flush(10)
        logs.rename(tmp_path / "logs.prev")
        logs.mkdir()
        (logs / "vllm.log").write_bytes(b"NEW RUN\n")
        for k in range(100, 2000, 100):  # ~100 kB more: rotations in the moved directory
            os.write(w, b"".join(b"old %06d %s\n" % (i, b"o" * 40) for i in range(k, k + 100)))
        assert pump.flush(10)
    finally:
        os.close(w)
        pump.close()
    # (the per-process files are this process's: a dead supervisor writes none)
    assert sorted(q.name for q in logs.glob("vllm.log*")) == ["vllm.log"]
    assert (logs / "vllm.log").read_bytes() == b"NEW RUN\n"
    prev = tmp_path / "logs.prev"
    parts = sorted(prev.glob("vllm.log.*"), key=lambda q: -int(q.suffix[1:])) + [prev / "vllm.log"]
    assert len(parts) > 5
    nums = [int(ln.split()[1]) for q in parts for ln in q.read_text().splitlines()]
    assert nums == list(range(2000))


def _deleted_fds(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.endswith(" (deleted)") and "/logs/" in target:
                out.append(target)
    return out


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "threads"])
def test_deleted_log_files_are_started_again_not_kept_open(tmp_path: Path, relay: bool) -> None:
    # An operator frees a full disk with `rm -rf RUNTIME/logs/N` while the engine runs: the pump
    # used to keep writing into the deleted files (their blocks never freed, every later line
    # lost); within a second it starts new ones (the directory made again) and lets the old go.
    logs = tmp_path / "logs"
    pump = LogPump(logs, 1, relay=relay)
    r, w = os.pipe()
    pump.start(r)
    try:
        assert (pump._relay is not None) == relay
        os.write(w, b"(EngineCore pid=3) INFO before\n")
        assert pump.flush(10)
        import shutil

        shutil.rmtree(logs)
        time.sleep(1.1)
        for i in range(5):
            os.write(w, b"(EngineCore pid=3) INFO after %d\n" % i)
            assert pump.flush(10)
            time.sleep(0.3)
        pids = [os.getpid()] + ([pump._relay.pid] if pump._relay is not None else [])
        assert not [d for p in pids for d in _deleted_fds(p)]
    finally:
        os.close(w)
        pump.close()
    for name in ("vllm.log", "EngineCore.log"):
        assert lines_of(logs / name) == [f"(EngineCore pid=3) INFO after {i}" for i in range(5)], name


BOTH_LINES = r"""
# Line i goes to stdout (2 in 3) or stderr; a stdout line has only [a-z-], a stderr line only
# [A-Z_] (its number spelled in letters), so a line mixing both would show.
bufs = {1: [], 2: []}
for i in range(n):
    fd = 2 if i % 3 == 0 else 1
    base = 65 if fd == 2 else 97
    k, name = i, ""
    for _ in range(5):
        name += chr(base + k % 26)
        k //= 26
    bufs[fd].append((name + ("_" if fd == 2 else "-") + chr(base + 16) * (i % 150)).encode())
"""

BOTH = (
    r"""
import os, sys
n = int(sys.argv[1])
"""
    + BOTH_LINES
    + r"""
data = {fd: b"".join(ln + b"\n" for ln in v) for fd, v in bufs.items()}
pos = {1: 0, 2: 0}
while pos[1] < len(data[1]) or pos[2] < len(data[2]):
    for fd in (1, 2):
        blk = memoryview(data[fd])[pos[fd] : pos[fd] + 65536]  # 64 KiB writes, cut inside lines
        while blk:
            k = os.write(fd, blk)
            pos[fd] += k
            blk = blk[k:]
"""
)


def both_lines(n: int) -> dict[int, list[bytes]]:
    """What BOTH writes for `n` lines, per fd, without the newlines (the same generator)."""
    ns: dict[str, object] = {"n": n}
    exec(BOTH_LINES, ns)
    return ns["bufs"]  # type: ignore[return-value]


def test_burst_on_both_streams_keeps_lines_whole_while_spliced(tmp_path: Path) -> None:
    # stdout and stderr both burst 64 KiB blocks cut inside lines while the supervisor side is
    # slow: the relay splices into vllm.log (rotating at 1 MB) and a stream whose splice stopped
    # mid-line owns the file until its line ends. vllm.log has every byte of both streams, each
    # stream in order, and no line holds bytes of both (a line split after the owner waited
    # OWN_WAIT is allowed: its parts are lines of the same stream).
    n = 150_000
    slow = SlowCollect()
    seen = slow.lines

    logs = tmp_path / "logs"
    pump = LogPump(logs, 2, on_line=slow, max_bytes=1_000_000, backups=50, buffer_cap_bytes=256 * 1024)
    try:
        with child([sys.executable, "-c", BOTH, str(n)]) as p:
            pump.start(p.stdout, p.stderr)
            assert pump._relay is not None
            assert p.wait(60) == 0  # never blocked by the slow side
            assert pump.wait_eof(60)
    finally:
        stats = pump.close()
    parts = sorted(logs.glob("vllm.log*"), key=lambda q: -int(q.suffix[1:]) if q.suffix[1:].isdigit() else 0)
    assert not (logs / "vllm.log.50").exists()  # nothing rotated away: the whole log is here
    for q in parts:
        data = q.read_bytes()
        assert 0 < len(data) <= 1_000_000 and data.endswith(b"\n")
    lines = b"".join(q.read_bytes() for q in parts).split(b"\n")
    assert lines.pop() == b""
    want = both_lines(n)
    mine: dict[int, list[bytes]] = {1: [], 2: []}
    for ln in lines:
        if re.fullmatch(rb"[a-z-]+", ln):
            mine[1].append(ln)
        else:
            assert re.fullmatch(rb"[A-Z_]+", ln), ln[:100]  # one stream's bytes only
            mine[2].append(ln)
    for fd in (1, 2):
        assert b"".join(mine[fd]) == b"".join(want[fd])  # every byte, in its stream's order
    splits = len(lines) - n
    assert 0 <= splits <= n // 20, splits  # (splits need the owner to stall 20 ms mid-line)
    assert stats.dropped_lines > 0 and stats.lines + stats.dropped_lines == len(lines)
    assert stats.log_missed_lines == 0 and stats.write_errors == 0
    text = [ln.decode() for ln in lines]
    assert seen and all(text[lineno - 1] == line for lineno, line in seen)


STALL = r"""
import os, sys, time
# Twice 8 MB of whole lines: the callback blocks, so the supervisor's queue and then its end of
# the relay's frame pipe fill and stay full (the relay drops, and splices, from then on). Then a
# line left unfinished on stdout while stderr writes whole lines.
line = b"(Worker_TP0 pid=5) INFO filler line of a burst, padded to 100 bytes ....................\n"
blk = line * 80_000
for _ in range(2):
    v = memoryview(blk)
    while v:
        v = v[os.write(1, v[:65536]):]
    time.sleep(0.4)
os.write(1, b"PARTIAL-HEAD")
time.sleep(0.3)
os.write(2, b"".join(b"ERRLINE %d\n" % i for i in range(10)))
time.sleep(0.3)
os.write(1, b"TAIL\n")
"""


def test_unfinished_spliced_line_is_split_not_mixed_when_other_stream_waits(tmp_path: Path) -> None:
    # The relay splices (forwarding dropped: the callback blocks) a stdout line that stops
    # mid-line, then stdout stalls while stderr has whole lines: stderr waits OWN_WAIT, then the
    # unfinished line is ended with LF (split, nothing lost) and stderr's lines follow it; never
    # "PARTIAL-HEADERRLINE 0". Without splice() (Python < 3.10) the head is held in memory
    # instead and the line stays whole after stderr's lines.
    go = threading.Event()
    seen: list[tuple[int, str]] = []

    def blocked(line: str, lineno: int) -> None:
        go.wait(30)
        seen.append((lineno, line))

    logs = tmp_path / "logs"
    pump = LogPump(logs, 4, on_line=blocked, buffer_cap_bytes=64 * 1024)
    try:
        with child([sys.executable, "-c", STALL]) as p:
            pump.start(p.stdout, p.stderr)
            assert p.wait(60) == 0
            assert pump.flush(1)  # (True once vllm.log has it: the blocked writer gets 1 s)
            data = (logs / "vllm.log").read_bytes()
            go.set()
            assert pump.wait_eof(60)
    finally:
        go.set()
        stats = pump.close()
    errs = b"".join(b"ERRLINE %d\n" % i for i in range(10))
    # spliced (the relay was dropping when the head came): split after the head; read (it had
    # caught up again, which timing decides): the head held in memory, the line whole after
    spliced, held = b"PARTIAL-HEAD\n" + errs + b"TAIL\n", errs + b"PARTIAL-HEADTAIL\n"
    assert data.endswith(spliced) or data.endswith(held), data[-300:]
    tail = spliced if data.endswith(spliced) else held
    assert b"PARTIAL-HEADERR" not in data
    assert data.count(b"\n") == 160_000 + tail.count(b"\n")
    assert stats.dropped_lines > 0 and stats.lines + stats.dropped_lines == data.count(b"\n")
    text = data.decode().split("\n")
    assert all(text[lineno - 1] == line for lineno, line in seen)


QUIET = r"""
import sys
for ln in [
    '(APIServer pid=7) INFO:     127.0.0.1:51234 - "GET /health HTTP/1.1" 200 OK',
    '(APIServer pid=7) INFO:     127.0.0.1:51236 - "GET /metrics HTTP/1.1" 200 OK',
    '(APIServer pid=7) INFO:     127.0.0.1:51238 - "HEAD /v1/models?probe=1 HTTP/1.1" 307 Temporary Redirect',
    '(APIServer pid=7) INFO:     127.0.0.1:51240 - "GET /health HTTP/1.1" 503 Service Unavailable',
    '(APIServer pid=7) INFO:     127.0.0.1:51242 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
    '(APIServer pid=7) INFO:     127.0.0.1:51244 - "GET /healthz HTTP/1.1" 200 OK',
    '(APIServer pid=7) INFO 03-26 04:12:10 [launcher.py:46] Route: /health, Methods: GET',
    'INFO:     127.0.0.1:51246 - "GET /metrics HTTP/1.1" 200 OK',
]:
    print(ln, flush=True)
"""


def test_echo_quiet_paths_hide_probe_access_lines_from_echo_only(tmp_path: Path) -> None:
    # The supervisor's probes (/health, /metrics, /v1/models) answered below 400 are not echoed;
    # a failed probe, other paths and non-access lines are; every line stays in vllm.log, the
    # per-process file and the callback.
    out = io.StringIO()
    got = Collect()
    logs = tmp_path / "logs"
    pump = LogPump(logs, 5, echo=out, on_line=got, echo_quiet_paths=("/health", "/metrics", "/v1/models"))
    try:
        with child([sys.executable, "-c", QUIET]) as p:
            pump.start(p.stdout, p.stderr)
            assert pump.wait_eof(30)
    finally:
        stats = pump.close()
    printed = subprocess.run(
        [sys.executable, "-c", QUIET], capture_output=True, text=True
    ).stdout.splitlines()
    assert stats.lines == 8 and [ln for _, ln in got.lines] == printed
    assert lines_of(logs / "vllm.log") == printed
    assert lines_of(logs / "APIServer.log") == printed[:7]
    assert out.getvalue().splitlines() == ["[i5] " + printed[k] for k in (3, 4, 5, 6)]


def test_disk_full_while_splicing_degrades_counts_and_marks(tmp_path: Path) -> None:
    # ENOSPC on a real tmpfs (root only) in the middle of a burst the relay splices (the
    # callback blocks, so the forwarding drops): the child is never blocked, vllm.log keeps a
    # complete prefix, then one marker with the exact number of lines it missed, then goes on.
    mnt = tmp_path / "tiny"
    if not _mount_tiny_tmpfs(mnt, "16m"):
        pytest.skip("needs root to mount a tmpfs")
    go = threading.Event()
    try:
        filler = mnt / "filler"
        filler.write_bytes(b"f" * 8 * 1024 * 1024)  # ~8 MB of room left: the drop starts before it is full
        logs = mnt / "logs"
        out = io.StringIO()
        pump = LogPump(
            logs,
            7,
            echo=out,
            on_line=lambda ln, k: go.wait(30),
            buffer_cap_bytes=64 * 1024,
            retry_interval_s=0.05,
        )
        n = 120_000  # 12 MB
        line = "(EngineCore pid=3) INFO line {:06d} " + "e" * 64
        r, w = os.pipe()
        pump.start(r)
        try:
            blk = "".join(line.format(j) + "\n" for j in range(n)).encode()
            view = memoryview(blk)
            while view:
                view = view[os.write(w, view[:65536]) :]
            assert pump.flush(1)  # (True: in vllm.log as far as the disk allowed; the writer is blocked)
            filler.unlink()  # room again
            time.sleep(0.1)
            os.write(w, b"(EngineCore pid=3) INFO after\n")
            assert pump.flush(1)
            go.set()
        finally:
            go.set()
            os.close(w)
            stats = pump.close()
        text = (logs / "vllm.log").read_bytes().decode()
        k = 0
        pos = 0
        while text.startswith(line.format(k) + "\n", pos):
            pos += len(line.format(k)) + 1
            k += 1
        mm = re.compile(
            r"(?:^|\n)\[xpu-serve\] (\d+) lines not written to this file: \[Errno 28\] No space left on device\n"
        ).search(text, pos)
        assert mm, text[pos : pos + 300]
        assert line.format(k).startswith(text[pos : mm.start()])  # at most the head of a half-written line
        assert text[mm.end() :] == "(EngineCore pid=3) INFO after\n"
        assert 0 < k < n and int(mm.group(1)) == n - k == stats.log_missed_lines
        assert stats.write_errors >= 1 and stats.dropped_lines > 0
        assert stats.lines + stats.dropped_lines == n + 1
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_vllm_032_worker_names_of_one_pid_go_to_one_file(tmp_path: Path) -> None:
    """vLLM 0.32 (seen in the real-vLLM suite's logs) prefixes a worker's first lines
    "(VllmWorker-0 pid=N)", then "(Worker pid=N)", then "(Worker_TP0 pid=N)": one pid, one file."""
    src = tmp_path / "w.log"
    src.write_text(
        "(VllmWorker-0 pid=32746) WARNING 11-30 11:47:29 [vllm.py:725] Model Runner V2 requires Triton; "
        "using the V1 model runner instead.\n"
        "(VllmWorker-1 pid=32747) WARNING 11-30 11:47:29 [vllm.py:725] Model Runner V2 requires Triton; "
        "using the V1 model runner instead.\n"
        "(Worker pid=32746) INFO 11-30 11:47:29 [parallel_state.py:1906] world_size=2 rank=0 local_rank=0\n"
        "(Worker_TP1 pid=32747) INFO 11-30 11:47:30 [default_loader.py:384] Loading weights took 0.1 seconds\n"
        "(Worker_TP0 pid=32746) INFO 11-30 11:47:30 [default_loader.py:384] Loading weights took 0.1 seconds\n"
    )
    stats, got, logs = pump_cmd(tmp_path, ["cat", str(src)])
    names = sorted(p.name for p in logs.iterdir())
    assert names == ["Worker_TP0.log", "Worker_TP1.log", "vllm.log"], names
    w0 = lines_of(logs / "Worker_TP0.log")
    assert [ln.split(")")[0] for ln in w0] == ["(VllmWorker-0 pid=32746", "(Worker pid=32746", "(Worker_TP0 pid=32746"]
    assert len(lines_of(logs / "Worker_TP1.log")) == 2
    assert stats.lines == 5 == len(got.lines)


def test_relay_keeps_vllm_log_going_after_the_supervisor_is_killed(tmp_path: Path) -> None:
    """kill -9 of the process that owns the pump: the relay stops forwarding but drains the
    engine's pipes into vllm.log until the engine ends; the engine (here `head`, which dies of
    SIGPIPE on a closed pipe) writes everything and exits 0."""
    logs = tmp_path / "logs"
    owner_code = (
        "import os, subprocess, sys, time\n"
        "from xpu_serve.sources.log_pump import LogPump\n"
        "eng = subprocess.Popen(['sh', '-c', 'sleep 1; yes abcdefghij | head -c 40000000; echo END; sleep 1'],\n"
        "                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)\n"
        f"pump = LogPump({str(logs)!r}, 1, echo=None)\n"
        "pump.start(eng.stdout, eng.stderr)\n"
        "print(eng.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    eng = int(owner.stdout.readline())
    owner.kill()  # before the engine writes its first byte
    owner.wait(10)
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{eng}") and time.monotonic() < deadline:
        with open(f"/proc/{eng}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    want = 40_000_000 + 4
    while time.monotonic() < deadline:
        if (logs / "vllm.log").exists() and (logs / "vllm.log").stat().st_size >= want:
            break
        time.sleep(0.05)
    data = (logs / "vllm.log").read_bytes()
    assert len(data) == want, len(data)
    assert data.endswith(b"\nabcdefgEND\n")  # (head cut the last line: 40,000,000 = 11 x 3,636,363 + 7)
    assert data[:11] == b"abcdefghij\n"


def test_line_numbers_and_drop_marker_range_stay_exact_after_a_disk_error(tmp_path: Path) -> None:
    # A full disk (real tmpfs, root only), then room again, then a burst whose forwarding drops:
    # lines vllm.log could not take must not take line numbers there, so every callback lineno
    # and the drop marker's "vllm.log has them (lines A-Z)" still point at the right lines of the
    # file (they used to be off by the number of lines missed during the disk error).
    mnt = tmp_path / "tiny"
    if not _mount_tiny_tmpfs(mnt, "40m"):
        pytest.skip("needs root to mount a tmpfs")
    go = threading.Event()
    go.set()
    try:
        filler = mnt / "filler"
        filler.write_bytes(b"f" * (40 * 1024 * 1024 - 384 * 1024))
        logs = mnt / "logs"
        got = Collect()

        def cb(line: str, k: int) -> None:
            got(line, k)
            go.wait(30)

        pump = LogPump(logs, 8, echo=io.StringIO(), on_line=cb, retry_interval_s=0.05, buffer_cap_bytes=64 * 1024)
        one = "(EngineCore pid=3) INFO one {:06d} " + "e" * 64
        two = "(EngineCore pid=3) INFO two {:06d} " + "t" * 64
        r, w = os.pipe()
        pump.start(r)
        try:
            for i in range(0, 6000, 500):  # 600 kB > the room left
                os.write(w, "".join(one.format(j) + "\n" for j in range(i, i + 500)).encode())
            assert pump.flush(10)
            assert pump.stats().write_errors > 0
            filler.unlink()
            time.sleep(0.1)
            os.write(w, b"(EngineCore pid=3) INFO after\n")
            assert pump.flush(10)
            go.clear()  # the supervisor side stalls: the forwarding of the next burst drops
            blk = "".join(two.format(j) + "\n" for j in range(240_000)).encode()  # 24 MB: more than the queues and the pipe hold
            view = memoryview(blk)
            while view:
                view = view[os.write(w, view[:65536]) :]
            assert pump.flush(1)  # (in vllm.log; the callback is still blocked)
            go.set()
        finally:
            go.set()
            os.close(w)
            stats = pump.close()
        text = (logs / "vllm.log").read_bytes().decode().split("\n")
        assert stats.dropped_lines > 0 and stats.log_missed_lines > 0
        in_file = [(k, ln) for k, ln in got.lines if ln == "(EngineCore pid=3) INFO after" or "two" in ln]
        assert in_file and all(text[k - 1] == ln for k, ln in in_file), [
            (k, ln[:40], text[k - 1][:40]) for k, ln in in_file if text[k - 1] != ln
        ][:3]
        ranges = [
            (int(m.group(1)), int(m.group(2)))
            for m in re.finditer(r"vllm\.log has them \(lines (\d+)-(\d+)\)", (logs / "EngineCore.log").read_text())
        ]
        assert ranges, [ln for ln in (logs / "EngineCore.log").read_text().splitlines() if "xpu-serve" in ln]
        seen = {ln for _, ln in got.lines}
        for a, b in ranges:
            span = text[a - 1 : b]
            assert span and all(ln.startswith("(EngineCore pid=3) INFO two ") and ln not in seen for ln in span)
            assert text[a - 2] in seen and (b >= len(text) - 1 or text[b] in seen)  # exactly the dropped lines
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


SECRET_WRITER = r"""
import os, sys, time
key = sys.argv[1].encode()
out = bytearray()
for i in range(30000):
    if i % 7 == 0:
        out += b"(APIServer pid=1) INFO non-default args: {'api_key': '" + key + b"', 'n': %d}\n" % i
    else:
        out += b"(Worker_TP0 pid=2) INFO step %d a little text around a, k, e and y\n" % i
os.write(1, bytes(out))
# the key split across two writes (two reads): still one line, still replaced
os.write(1, b"(APIServer pid=1) Bearer " + key[:5])
time.sleep(0.2)
os.write(1, key[5:] + b" end\n")
os.write(2, key + b" on stderr\n")
"""


def test_known_secrets_are_replaced_in_every_output_line_by_line(tmp_path: Path, relay: bool) -> None:
    key = "Zq8fT2uVw9XyLm3Nc7Ra5Bd1Ke6Hg4Pj"
    got = Collect()
    echo = io.StringIO()
    logs = LogPump.dir_for(tmp_path, 1)
    pump = LogPump(logs, 1, echo=echo, on_line=got, relay=relay, secrets=[key, "multi\nline"])
    try:
        with child([sys.executable, "-c", SECRET_WRITER, key]) as p:
            pump.start(p.stdout, p.stderr)
            if relay:  # the relay got the values, not on its command line (/proc shows it to all)
                assert pump._relay is not None
                assert key.encode() not in Path(f"/proc/{pump._relay.pid}/cmdline").read_bytes()
            assert pump.wait_eof(30)
            assert p.wait(30) == 0
    finally:
        stats = pump.close()
    assert stats.dropped_lines == 0
    expected = []
    for i in range(30000):
        if i % 7 == 0:
            expected.append(f"(APIServer pid=1) INFO non-default args: {{'api_key': '***', 'n': {i}}}")
        else:
            expected.append(f"(Worker_TP0 pid=2) INFO step {i} a little text around a, k, e and y")
    expected.append("(APIServer pid=1) Bearer *** end")
    vlog = (logs / "vllm.log").read_bytes().decode().split("\n")
    assert vlog[-1] == ""
    assert sorted(vlog[:-1]) == sorted([*expected, "*** on stderr"])  # (stderr may come first)
    assert [ln for ln in vlog[:-1] if ln != "*** on stderr"] == expected  # byte-identical but for ***
    assert [line for _, line in got.lines] == vlog[:-1]  # the callback, numbered as vllm.log
    assert [n for n, _ in got.lines] == list(range(1, len(vlog)))
    for f in logs.iterdir():
        assert key.encode() not in f.read_bytes(), f
        assert (f.stat().st_mode & 0o777) == 0o600, f
    shown = echo.getvalue()  # (the echo may drop lines when it falls behind: only what it shows)
    assert key not in shown and "[i1] (APIServer pid=1) Bearer *** end\n" in shown
