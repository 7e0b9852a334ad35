"""The per-rank shared-memory segments of vLLM's CPU communicator
(``/dev/shm/vllm_dist_<hex>-cpushm_<rank>``, 4 MiB each), as csrc/cpu/shm.cpp ``SHMManager``
makes them: each rank creates and maps its own before the dist-init barrier, then maps every
peer's (``SHMManager::join``). Real vLLM leaves them in /dev/shm even after SIGTERM (not
registered with the resource tracker, so nothing removes them)."""

from __future__ import annotations

import mmap
import os

from xpu_serve.sim.common import SimConfig

SEGMENT_BYTES = 4 * 1024 * 1024


class CpuShm:
    """One rank's mappings; they stay for the process's life, so /proc/PID/maps names them (the
    supervisor's proof of ownership). Nothing is made when the run has no dist tag."""

    def __init__(self, cfg: SimConfig, rank: int):
        self.cfg = cfg
        self.rank = rank
        self.path: str | None = None  # this rank's segment, once created
        self.maps: list[mmap.mmap] = []

    def name(self, rank: int) -> str:
        return f"/dev/shm/vllm_dist_{self.cfg.dist_tag}-cpushm_{rank}"

    def _map(self, path: str, create: bool) -> None:
        """Open `path`, size it (when creating), mmap it shared and close the fd, as
        ``SHMManager::init_shm`` does. Raises OSError, ValueError."""
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SEGMENT_BYTES)
            self.maps.append(mmap.mmap(fd, SEGMENT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
        finally:
            os.close(fd)

    def create(self) -> None:
        """Create and map this rank's segment (the SHMManager constructor); errors are ignored."""
        if not self.cfg.dist_tag:
            return
        path = self.name(self.rank)
        try:
            self._map(path, create=True)
            self.path = path
        except (OSError, ValueError):
            pass

    def join(self) -> None:
        """Map every other rank's segment (after the barrier: they exist by then)."""
        if not self.cfg.dist_tag:
            return
        for r in range(self.cfg.tensor_parallel_size):
            if r != self.rank:
                try:
                    self._map(self.name(r), create=False)
                except (OSError, ValueError):
                    pass
