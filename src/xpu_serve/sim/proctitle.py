"""Process titles as vLLM sets them (`VLLM::EngineCore`, `VLLM::Worker_TP0`).

vLLM calls `setproctitle.setproctitle(title)` (vllm/utils/system_utils.py, `set_process_title`).
On Linux that library overwrites the process's argv memory, so `/proc/PID/cmdline` reads
`title` followed by NUL padding, and sets the kernel comm with `prctl(PR_SET_NAME)` (cut to 15
bytes: `VLLM::Worker_TP`). The supervisor tells the ranks apart by cmdline
(`xpu_serve.sources.processes.discover`), and the kernel's segfault records name the comm, so a
simulator needs both.

`set_title` uses setproctitle when it is installed (the `sim` extra; it is what vLLM runs, and
without `SPT_NOENV=1` it also blanks `/proc/PID/environ` as vLLM's processes do). Without it the
simulator must still run (`pip install -e .` alone runs the README's demo), so the fallback
writes the same bytes itself: the title and NUL padding over the argv area through
`/proc/self/mem` (its bounds are fields 48-49 of `/proc/self/stat`, `arg_start`/`arg_end`,
proc(5)), then the comm of the calling thread through `/proc/thread-self/comm` (prctl
PR_SET_NAME names the calling thread too; `/proc/self/comm` would rename the main thread). The fallback never touches the environment
area, i.e. it behaves as setproctitle with `SPT_NOENV=1` (what the supervisor sets).
`tests/test_sim.py` checks that both ways give byte-identical cmdline and comm.
"""

from __future__ import annotations

import sys

COMM_MAX = 15
"""Bytes of a kernel comm (TASK_COMM_LEN 16 with its NUL, include/linux/sched.h)."""


def set_title(title: str) -> None:
    """Set this process's title (cmdline and comm) to `title`, as vLLM's setproctitle call does.

    A title longer than the argv area is cut to fit. When the fallback cannot write (a kernel
    that refuses /proc/self/mem writes), one line on stderr says so and the comm is still set.
    """
    try:
        import setproctitle
    except ImportError:
        pass
    else:
        setproctitle.setproctitle(title)
        return
    try:
        _write_argv_area(title.encode())
    except (OSError, ValueError) as e:
        print(f"xpu_serve.sim: cannot set the process title {title!r} in /proc/self/cmdline ({e}); "
              "install setproctitle (pip install 'xpu-serve[sim]')", file=sys.stderr)
    with open("/proc/thread-self/comm", "wb") as f:
        f.write(title.encode()[:COMM_MAX])


def _write_argv_area(title: bytes) -> None:
    """Overwrite [arg_start, arg_end) of this process with `title` and NUL padding.

    The last byte stays NUL, so the kernel reads cmdline from the argv area alone (fs/proc/base.c,
    get_mm_cmdline). Python copied argv at start-up, so `sys.argv` is unaffected.
    """
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    tail = stat[stat.rfind(b")") + 2 :].split()  # tail[0] is field 3
    arg_start, arg_end = int(tail[45]), int(tail[46])
    size = arg_end - arg_start
    if size < 2:
        raise ValueError(f"argv area of {size} bytes")
    text = title[: size - 1]
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(arg_start)
        mem.write(text + b"\0" * (size - len(text)))
