"""The files a simulated EngineCore leaves behind as real vLLM does: ``/tmp/vllm_dist_<hex>``
(the distributed init file) and the MessageQueue buffer in /dev/shm, registered with
multiprocessing's resource tracker.

The init file's descriptor stays open for the process's life. Real vLLM's c10d FileStore opens
it only for moments, and there the supervisor proves it ours by the
``distributed_init_method=file://...`` log line or by the id in the mapped cpushm names. The
simulator logs a tcp:// init method (XPU), so this open descriptor is what lets the supervisor
prove the file ours before any worker has mapped its segment.

The buffer is ``psm_<8 hex>`` (Python's default name, as vLLM's ShmRingBuffer:
vllm/distributed/device_communicators/shm_broadcast.py), or ``<shm_prefix><8 hex>`` when
XPU_SERVE_SIM_SHM_PREFIX is set, so that a test can tell its own leftovers from others'.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from xpu_serve.sim.common import SimConfig


def make_dist_files(cfg: SimConfig) -> tuple[int | None, Any]:
    """Open (create) the init file and create the 1 MiB buffer. Returns (the init file's fd,
    the ``SharedMemory``); None for either that could not be made (never raises)."""
    try:
        dist_fd: int | None = os.open(f"/tmp/vllm_dist_{cfg.dist_tag}", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        dist_fd = None
    try:
        from multiprocessing import shared_memory

        name = cfg.shm_prefix + secrets.token_hex(4) if cfg.shm_prefix else None
        shm: Any = shared_memory.SharedMemory(name=name, create=True, size=1 << 20)
    except (OSError, ValueError):
        shm = None
    return dist_fd, shm
