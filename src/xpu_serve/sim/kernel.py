"""Kernel-log records the simulator appends for `kernel=PATH` faults.

Formats (sources):
- file PATH: ``dmesg`` without ``-T``: ``[%5lu.%06lu] message`` with seconds since boot
  (kernel/printk/printk.c ``print_time``), taken from the real CLOCK_BOOTTIME so live
  correlation with the wall clock works as on a real host.
- ``/dev/kmsg``: one ``write()`` per record of ``<PRIO>message``; the kernel stamps it and
  stores it with facility user (Documentation/ABI/testing/dev-kmsg). Only used when the
  operator names /dev/kmsg and it is writable (checked when the spec is parsed).

Record texts:
- user-space segfault: arch/x86/mm/fault.c ``show_signal_msg``:
  ``COMM[PID]: segfault at ADDR ip IP sp SP error 4 in LIB[OFF,BASE+SIZE] likely on CPU N (core C,
  socket S)`` followed by a ``Code:`` line (``show_opcodes``).
- xe engine reset: drivers/gpu/drm/xe/xe_guc_submit.c (``xe_gt_notice``):
  ``xe PCI: [drm] Tile0: GT0: Engine reset: engine_class=bcs, logical_mask: 0x1, guc_id=N``.
- OOM killer: mm/oom_kill.c ``dump_header``/``__oom_kill_process``.
- xe job timeout (device lost): drivers/gpu/drm/xe/xe_guc_submit.c: the compute engine's reset
  notice (``Engine reset: engine_class=ccs, ..., state=0x29``) and ``guc_exec_queue_timedout_job``'s
  ``Timedout job: seqno=N, lrc_seqno=N, guc_id=N, flags=0x20 in COMM [PID]``, in the order and
  shape of tests/fixtures/cases/xe-ccs-tdr-device-lost.
"""

from __future__ import annotations

import os
import sys
import time

LIBZE = "libze_intel_gpu.so.1.14.37020"
"""The Level Zero GPU driver build that segfaulted under TP=4 in the Qwen3-30B-A3B case."""

_CODE = (
    "Code: 5f 5d c3 0f 1f 80 00 00 00 00 49 8b 40 08 49 3b 40 10 0f 84 d2 00 00 00 48 89 18 48 83 c0 08 "
    "49 89 40 08 eb cd 0f 1f 44 00 00 <80> b9 95 01 00 00 00 0f 84 7f ff ff ff 8b 15 8d 4f 7d 02 83 fa ff"
)


def boottime() -> float:
    """Seconds since boot (CLOCK_BOOTTIME), the clock of dmesg's ``[ sec.usec]``."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def write_records(path: str, records: list[tuple[int, str]]) -> None:
    """Append `records` ((priority 0-7, message)) to `path` in dmesg format, or inject them into
    /dev/kmsg when `path` is "/dev/kmsg". An error (e.g. ENOSPC on /dev/full) is reported as one
    line on stderr and otherwise ignored: a lost kernel record must not change what the simulated
    vLLM does."""
    try:
        if path == "/dev/kmsg":
            fd = os.open(path, os.O_WRONLY)
            try:
                for prio, msg in records:
                    os.write(fd, f"<{prio}>{msg}\n".encode())
            finally:
                os.close(fd)
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for _prio, msg in records:
                t = boottime()
                os.write(fd, f"[{int(t):5d}.{int((t % 1) * 1e6):06d}] {msg}\n".encode())
        finally:
            os.close(fd)
    except OSError as e:
        try:
            sys.stderr.write(f"xpu-serve sim: kernel={path}: cannot write kernel record: {e.strerror or e}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def segfault_records(comm: str, pid: int, cpu: int, library: str = LIBZE) -> list[tuple[int, str]]:
    """The two records the kernel prints when `pid` (`comm`, 15 bytes) segfaults in `library`."""
    base = 0x762F1B800000 + (pid % 4096) * 0x1000000
    off = 0x6FF168
    return [
        (
            6,
            f"{comm}[{pid}]: segfault at 58619acc8 ip {base + off:016x} sp 00007ffd3b90f940 error 4 in "
            f"{library}[{off:x},{base:x}+9d4000] likely on CPU {cpu} (core {cpu % 32}, socket 0)",
        ),
        (6, _CODE),
    ]


def engine_reset_record(pci: str, guc_id: int) -> tuple[int, str]:
    """The xe driver's BCS engine reset notice for the card at `pci`."""
    return (
        5,
        f"xe {pci}: [drm] Tile0: GT0: Engine reset: engine_class=bcs, logical_mask: 0x1, guc_id={guc_id}",
    )


def job_timeout_records(pci: str, comm: str, pid: int, seqno: int) -> list[tuple[int, str]]:
    """The xe driver's records when a job of `pid` (`comm`) on the card at `pci` hangs on the
    compute engine (CCS) and is timed out: engine reset, then the timed-out job naming the process.
    `seqno` is the job's sequence number (any positive integer)."""
    guc_id = 9
    n = max(1, seqno)
    return [
        (
            5,
            f"xe {pci}: [drm] Tile0: GT0: Engine reset: engine_class=ccs, logical_mask: 0x1, "
            f"guc_id={guc_id}, state=0x29",
        ),
        (
            5,
            f"xe {pci}: [drm] Tile0: GT0: Timedout job: seqno={n}, lrc_seqno={n}, guc_id={guc_id}, "
            f"flags=0x20 in {comm} [{pid}]",
        ),
    ]


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def oom_records(comm: str, pid: int) -> list[tuple[int, str]]:
    """The OOM killer's records for killing `pid` (this process: sizes from /proc/self/status)."""
    return [
        (
            4,
            f"{comm} invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0",
        ),
        (
            6,
            "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,"
            f"task_memcg=/,task={comm},pid={pid},uid={os.getuid()}",
        ),
        (
            3,
            f"Out of memory: Killed process {pid} ({comm}) total-vm:{_status_kb('VmSize')}kB, "
            f"anon-rss:{_status_kb('RssAnon')}kB, file-rss:{_status_kb('RssFile')}kB, "
            f"shmem-rss:{_status_kb('RssShmem')}kB, UID:{os.getuid()} pgtables:{_status_kb('VmPTE')}kB oom_score_adj:0",
        ),
    ]
