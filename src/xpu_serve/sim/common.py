"""Settings shared by every process of the simulated tree (pickled to the spawned children)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from xpu_serve.sim import VLLM_VERSION
from xpu_serve.sim.faults import Fault

PCI_ADDRESSES = ("0000:0e:00.0", "0000:47:00.0", "0000:86:00.0", "0000:c2:00.0")
"""PCI addresses of the four Arc Pro B60 cards in the Qwen3-30B-A3B case's kernel log."""


def pci_address(device: int) -> str:
    """PCI address of simulated XPU `device` (0-based); beyond four cards, made-up buses."""
    if device < len(PCI_ADDRESSES):
        return PCI_ADDRESSES[device]
    return f"0000:{0xD0 + device:02x}:00.0"


@dataclass
class SimConfig:
    """What `vllm serve` was asked for, plus the simulator's own knobs.

    Times are unscaled seconds as vLLM would read them; :meth:`scaled` applies the time scale.
    """

    model: str
    served_model_name: str
    tensor_parallel_size: int = 1
    host: str = "0.0.0.0"
    port: int = 8000
    max_model_len: int = 4096
    dtype: str = "float16"
    block_size: int = 64
    api_key: str | None = None
    disable_log_stats: bool = False
    non_default_args: dict[str, Any] = field(default_factory=dict)
    time_scale: float = 1.0
    token_rate: float = 50.0  # decode steps per second (each running request gets one token per step)
    stats_interval: float = 10.0  # VLLM_LOG_STATS_INTERVAL
    ring_warning_interval: float = 60.0  # VLLM_RINGBUFFER_WARNING_INTERVAL
    execute_model_timeout: float = 300.0  # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
    faults: list[Fault] = field(default_factory=list)  # active for this incarnation
    dist_tag: str = ""  # hex shared by /tmp/vllm_dist_<hex> and /dev/shm/vllm_dist_<hex>-cpushm_<rank>
    shm_prefix: str = ""  # XPU_SERVE_SIM_SHM_PREFIX: the MessageQueue segment's name prefix ("": psm_)
    kv_cache_tokens: int = 220160
    prefix_style: str = "0.14"  # XPU_SERVE_SIM_PREFIX: "0.14" or "0.32" (see faults.prefix_style)
    nnodes: int = 1  # --nnodes: hosts of the group (sim.multinode)
    node_rank: int = 0  # --node-rank
    master_addr: str = "127.0.0.1"  # --master-addr (vLLM's default)
    master_port: int = 29501  # --master-port (vLLM's default)
    headless: bool = False  # --headless: a follower, only its local workers

    @property
    def local_ranks(self) -> list[int]:
        """The TP ranks whose workers run on this node: node_rank*local .. +local-1."""
        local = self.tensor_parallel_size // self.nnodes
        return list(range(self.node_rank * local, (self.node_rank + 1) * local))

    def scaled(self, seconds: float, floor: float = 0.0) -> float:
        """`seconds` times the time scale, at least `floor` (real seconds)."""
        return max(seconds * self.time_scale, floor)

    def faults_of(self, kind: str, rank: int | None = None) -> list[Fault]:
        """Active faults of `kind` (and, when given, targeting `rank`)."""
        return [f for f in self.faults if f.kind == kind and (rank is None or f.rank == rank)]

    @property
    def orphans(self) -> bool:
        """True when the `orphans` fault is active: children ignore their parent's death."""
        return bool(self.faults_of("orphans"))

    @property
    def engine_name(self) -> str:
        """The EngineCore's process name and log prefix name: ``EngineCore_DP0`` (vLLM 0.14) or
        ``EngineCore`` (vLLM 0.32, tests/fixtures/cases/cpu-tp2-worker0-segv)."""
        return "EngineCore" if self.prefix_style == "0.32" else "EngineCore_DP0"

    @property
    def vllm_version(self) -> str:
        """The vLLM version the banner and the engine config line name."""
        return "0.32.0" if self.prefix_style == "0.32" else VLLM_VERSION

    @property
    def worker_name_suffix(self) -> bool:
        """vLLM names workers ``Worker_TP<r>`` only when tensor parallel size > 1."""
        return self.tensor_parallel_size > 1

    def worker_title(self, rank: int) -> str:
        """Process title of a worker: ``VLLM::Worker_TP0`` (``VLLM::Worker`` with TP=1)."""
        return f"VLLM::{self.worker_log_name(rank)}"

    def worker_log_name(self, rank: int) -> str:
        """Log prefix name of a worker after init: ``Worker_TP0`` (``Worker`` with TP=1)."""
        return f"Worker_TP{rank}" if self.worker_name_suffix else "Worker"


def read_comm() -> str:
    """This process's kernel comm (/proc/self/comm), as the kernel prints it."""
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return "python3"


def current_cpu() -> int:
    """The CPU this process last ran on (/proc/self/stat field 39), 0 if unknown."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return 0


def getenv_incarnation() -> str | None:
    """XPU_SERVE_INCARNATION as set by the supervisor, or None."""
    return os.environ.get("XPU_SERVE_INCARNATION")
