"""Kernel records parsed per second by the live kernel source (`xpu_serve.sources.kernel`).

Measures, on one core, in one process:
  - baseline: framing only (`parse_kmsg_frame`: header, sequence, boot time -> wall time);
  - full: framing + `to_event` (the diagnose parser `events.parse_kernel_record`, the signature
    table, the PCI device) = what the KernelWatcher does per record;
  - live read: `KmsgSource.read_available()` over the real /dev/kmsg ring buffer (read-only),
    when readable (syscall per record included).
Input: the records in this machine's /dev/kmsg (read once) plus the kernel lines of the real
cases (tests/fixtures/cases/*/dmesg.txt, input.log) as kmsg frames, replayed to N records.

    .venv/bin/python bench/bench_kmsg.py [N]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from xpu_serve.sources import kernel as k

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def corpus() -> list[bytes]:
    frames: list[bytes] = []
    try:
        src = k.KmsgSource(since_wall=0.0)
        try:
            for r in src.read_available():
                frames.append(f"{r.prio},{r.seq},{int((r.boot_s or 0) * 1e6)},-;{r.message}\n".encode())
        finally:
            src.close()
    except OSError:
        pass
    seq = 10**6
    for f in sorted((ROOT / "tests" / "fixtures" / "cases").glob("*/*")):
        if f.suffix not in (".txt", ".log"):
            continue
        for line in f.read_text(errors="replace").splitlines():
            rec = k.frame_text_line(line, "file", 0.0)
            if rec.boot_s is None and " xe " not in f" {line}":
                continue
            seq += 1
            frames.append(
                f"4,{seq},{int((rec.boot_s or 1.0) * 1e6)},-;{rec.message}\n SUBSYSTEM=pci\n".encode()
            )
    return frames


def bench(n: int, frames: list[bytes]) -> tuple[float, float]:
    data = (frames * (n // len(frames) + 1))[:n]
    off = k.boot_offset()
    t0 = time.perf_counter()
    for d in data:
        k.parse_kmsg_frame(d, off)
    base = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for d in data:
        rec = k.parse_kmsg_frame(d, off)
        if rec is not None:
            k.to_event(rec)
    full = n / (time.perf_counter() - t0)
    return base, full


def live_read() -> float | None:
    try:
        src = k.KmsgSource(since_wall=0.0)
    except OSError:
        return None
    try:
        t0 = time.perf_counter()
        recs = src.read_available()
        dt = time.perf_counter() - t0
    finally:
        src.close()
    return len(recs) / dt if recs else None


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    frames = corpus()
    k.to_event(k.parse_kmsg_frame(frames[0], 0.0))  # type: ignore[arg-type]  # load the signature table once
    runs = [bench(n, frames) for _ in range(5)]
    base = statistics.median(r[0] for r in runs)
    full = statistics.median(r[1] for r in runs)
    lives = [x for x in (live_read() for _ in range(5)) if x is not None]
    print(
        f"corpus: {len(frames)} distinct records ({sum(1 for f in frames if b'segfault' in f)} segfault), replayed to {n}"
    )
    print(f"framing only (baseline): {base:,.0f} records/s")
    print(
        f"framing + parse + classify (KernelWatcher path): {full:,.0f} records/s  (ratio to baseline {full / base:.3f})"
    )
    if lives:
        print(
            f"live read of /dev/kmsg ring buffer (read() per record + framing): {statistics.median(lives):,.0f} records/s"
        )
    else:
        print("live read: /dev/kmsg not readable here")
    print(f"cpu: {os.cpu_count()} cores, python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(with_loadavg(main))
