"""Log pump throughput: a child writing log lines as fast as it can, through the pump vs. to a file.

    .venv/bin/python bench/bench_pump.py [--mb 200] [--runs 3] [--mode block|line|both]

The child (a separate Python process) writes `--mb` MB of vLLM-like lines (APIServer, EngineCore,
Worker_TPn, oneCCL and unprefixed lines) to its stdout, and reports its own write throughput.
Mode "block": one `write()` per 400 lines (48,640 bytes; the worst case for the pump). Mode "line": one `write()` per
line, as vLLM's `logging.StreamHandler` does (it flushes every record). Baseline: stdout is a regular file in a temporary directory. Pump: stdout and
stderr are pipes read by `LogPump` (files in a temporary directory, echo off, callback on). Both run
in this same process run, alternated, `--runs` times, with a third run, the floor: the same child
writing into a pipe that this process splices into a file with nothing else (`run_floor`); medians are printed with their ratio
(target >= 0.8), and the pump's line and drop counts. The relay writes vllm.log itself: each run
checks that it holds every byte the child wrote ("vllm.log complete"); only the forwarding to
the per-process files and the callback drops (counted, marked; meanwhile the relay splices the
pipes into vllm.log). The child's RESULT line is read from the end of vllm.log (the callback
may not see it). CPU time per run (less sensitive to other load than the rates): the child's
(wait4), the relay's (its rusage once reaped by close()), the supervisor's until the child exits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import with_loadavg  # noqa: E402

from xpu_serve.sources.log_pump import LogPump  # noqa: E402

CHILD = r"""
import os, sys, time
total = int(sys.argv[1]) * 1000 * 1000
lines = []
for i in range(400):
    k = i % 8
    if k < 4:
        lines.append(f"(Worker_TP{k} pid={7986 + k}) INFO 03-26 04:12:20 [gpu_model_runner.py:4481] step {i} done, "
                     f"tokens 123456 kv usage 12.5% running 4 waiting 0\n")
    elif k == 4:
        lines.append(f"(EngineCore pid=7732) INFO 03-26 04:12:10 [loggers.py:257] Engine 000: Avg prompt throughput: "
                     f"1.0 tokens/s, Avg generation throughput: 42.0 tokens/s, Running: 1 reqs {i}\n")
    elif k == 5:
        lines.append(f"(APIServer pid=7700) INFO:     127.0.0.1:51234 - \"POST /v1/chat/completions HTTP/1.1\" 200 OK {i}\n")
    elif k == 6:
        lines.append(f"2026:03:26-04:12:18: 7986:[0] |CCL_WARN| topology recognition shows PCIe connection {i}\n")
    else:
        lines.append(f"Loading safetensors checkpoint shards: 6% Completed | 1/16 [00:10<02:38, 10.56s/it] {i}\n")
block = "".join(lines).encode()
reps = max(1, total // len(block))
if sys.argv[2] == "line":
    blines = [ln.encode() for ln in lines]
    t0 = time.perf_counter()
    for _ in range(reps):
        for b in blines:
            os.write(1, b)  # lines are far below PIPE_BUF: written whole
    dt = time.perf_counter() - t0
else:
    t0 = time.perf_counter()
    for _ in range(reps):
        view = memoryview(block)
        while view:
            view = view[os.write(1, view):]
    dt = time.perf_counter() - t0
os.write(2, f"RESULT {reps * len(block)} {dt}\n".encode())
"""


def run_baseline(mb: int, tmp: Path, mode: str) -> float:
    out = tmp / "baseline.log"
    with open(out, "wb") as f:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, str(mb), mode], stdout=f, stderr=subprocess.PIPE, check=True
        )
    out.unlink()
    nbytes, dt = p.stderr.decode().split()[1:3]
    return int(nbytes) / float(dt) / 1e6


def run_floor(mb: int, tmp: Path, mode: str) -> float:
    """The least any pipe-based pump must do: the child writes into a pipe (1 MiB, as the pump
    asks with F_SETPIPE_SZ) and this process moves it to a file with a blocking `splice()` loop,
    no line handling at all. The child's rate here is the ceiling of a pump that never lets the
    child write to the disk itself (a slow or full disk must not stall vLLM)."""
    import fcntl

    r, w = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(mb), mode], stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    out = tmp / "floor.log"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while os.splice(r, fd, 1 << 24):
            pass
    finally:
        os.close(fd)
        os.close(r)
    assert p.stderr is not None
    err = p.stderr.read()
    p.wait()
    out.unlink()
    nbytes, dt = err.decode().split()[1:3]
    return int(nbytes) / float(dt) / 1e6


def _cpu_ms(r: resource.struct_rusage) -> float:
    return 1000 * (r.ru_utime + r.ru_stime)


def run_pump(
    mb: int, tmp: Path, i: int, mode: str
) -> tuple[float, float, object, bool, tuple[float, float, float]]:
    # The child reports on stderr, which the pump reads too; forwarding to the callback may drop
    # it, vllm.log may not: take the RESULT line from the end of vllm.log.
    logs = tmp / f"logs{i}{mode}"
    pump = LogPump(
        logs, incarnation=1, echo=None, on_line=lambda line, lineno: None, max_bytes=256 * 1024**2, backups=1
    )
    t0 = time.perf_counter()
    self0 = _cpu_ms(resource.getrusage(resource.RUSAGE_SELF))
    kids0 = _cpu_ms(resource.getrusage(resource.RUSAGE_CHILDREN))
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(mb), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    pump.start(p.stdout, p.stderr)
    _, status, child_ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    sup_cpu = _cpu_ms(resource.getrusage(resource.RUSAGE_SELF)) - self0
    pump.wait_eof(300)
    t_all = time.perf_counter() - t0
    stats = pump.close()  # (reaps the relay)
    child_cpu = _cpu_ms(child_ru)
    relay_cpu = _cpu_ms(resource.getrusage(resource.RUSAGE_CHILDREN)) - kids0 - child_cpu
    log = logs / "vllm.log"
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - 200))
        last = f.read().splitlines()[-1].decode()
    nbytes, dt = last.split()[1:3]
    complete = log.stat().st_size == int(nbytes) + len(last) + 1  # every byte the child wrote
    shutil.rmtree(logs)
    return (
        int(nbytes) / float(dt) / 1e6,
        int(nbytes) / t_all / 1e6,
        stats,
        complete,
        (child_cpu, relay_cpu, sup_cpu),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mode", choices=["block", "line", "both"], default="both")
    a = ap.parse_args()
    modes = ["block", "line"] if a.mode == "both" else [a.mode]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for mode in modes:
            print(f"[{mode}] load average before: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
            base: list[float] = []
            floor: list[float] = []
            pumped: list[float] = []
            drained: list[float] = []
            drops: list[float] = []
            cpus: list[tuple[float, float, float]] = []
            for i in range(a.runs):
                base.append(run_baseline(a.mb, tmp, mode))
                floor.append(run_floor(a.mb, tmp, mode))
                child, total, stats, complete, cpu = run_pump(a.mb, tmp, i, mode)
                cpus.append(cpu)
                pumped.append(child)
                drained.append(total)
                drops.append(stats.dropped_lines / max(1, stats.lines + stats.dropped_lines))  # type: ignore[attr-defined]
                print(
                    f"[{mode}] run {i}: file {base[-1]:.0f} MB/s, splice-only floor {floor[-1]:.0f} MB/s, pump {child:.0f} MB/s "
                    f"(end-to-end {total:.0f} MB/s), vllm.log complete: {complete}; {stats}"
                )
            b, p = statistics.median(base), statistics.median(pumped)
            print(f"[{mode}] child -> file:  median {b:.0f} MB/s")
            print(
                f"[{mode}] child -> pump:  median {p:.0f} MB/s (until all handled: {statistics.median(drained):.0f} MB/s; "
                f"lines not forwarded to per-process files/callback, counted and marked: median "
                f"{100 * statistics.median(drops):.0f} %; vllm.log has them all)"
            )
            c, r, s = (statistics.median(x[k] for x in cpus) for k in range(3))
            print(
                f"[{mode}] CPU time, medians: child {c:.0f} ms, relay {r:.0f} ms (whole run, counting included), "
                f"supervisor until the child's exit {s:.0f} ms"
            )
            fl = statistics.median(floor)
            print(f"[{mode}] child -> pipe -> splice loop (floor):  median {fl:.0f} MB/s")
            print(f"[{mode}] ratio pump/file: {p / b:.2f} (target >= 0.8)")
            print(f"[{mode}] ratio floor/file: {fl / b:.2f} (the most any pipe-based pump can reach here)")
            print(f"[{mode}] ratio pump/floor: {p / fl:.2f}")
            print(f"[{mode}] load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(with_loadavg(main))
