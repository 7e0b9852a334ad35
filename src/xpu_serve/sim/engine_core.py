"""The simulated ``VLLM::EngineCore`` process (vllm/v1/engine/core.py ``EngineCoreProc`` with the
``MultiprocExecutor`` of vllm/v1/executor/multiproc_executor.py).

It spawns the workers, coordinates their start-up, then runs the busy loop: every step sends
``step`` to each worker and waits for every answer (vLLM: shm_broadcast MessageQueue), printing
``No available shared memory broadcast block found in N seconds`` every
VLLM_RINGBUFFER_WARNING_INTERVAL and failing with ``RPC call to execute_model timed out`` after
VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (both scaled). A worker death is seen by a monitor thread on
the process sentinels (``Worker proc VllmWorker-R died unexpectedly``).

Protocol with the API server (one duplex pipe): in ``add``/``abort``/``serving``; out ``ready``,
``out`` (tokens and scheduler stats per step) and ``dead``.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from xpu_serve.sim import core_crash, dist_files, kernel, multinode, proctitle, scheduler, shm_broadcast, vlog
from xpu_serve.sim.common import SimConfig, pci_address
from xpu_serve.sim.core_crash import Fatal
from xpu_serve.sim.worker import worker_main

ENGINE_NAME = "EngineCore_DP0"
"""The EngineCore's name with the default (vLLM 0.14) prefixes; see SimConfig.engine_name."""



def run_engine_core(cfg: SimConfig, api: Connection) -> None:
    """Entry point of the EngineCore process (multiprocessing spawn target)."""
    EngineCore(cfg, api).run()


class EngineCore:
    """EngineCoreProc + MultiprocExecutor. See the module docstring."""

    def __init__(self, cfg: SimConfig, api: Connection):
        self.cfg = cfg
        self.api = api
        self.api_lock = threading.Lock()
        self.inputs: queue.Queue[tuple] = queue.Queue()
        self.procs: list[BaseProcess] = []
        self.conns: list[Any] = []  # by TP rank: a Connection (local) or multinode.JsonConn (remote)
        self.remote: dict[int, multinode.JsonConn] = {}  # TP rank -> its follower worker's link
        self.deaths: list[Connection] = []
        self.shutting_down = False
        self.failed = threading.Event()
        self.dead_rank: int | None = None
        self.requests: dict[str, list[Any]] = {}  # rid -> [prompt_tokens, max_tokens, generated]
        self.step_no = 0
        self.shm: Any = None
        self.dist_fd: int | None = None
        self.fail_text = ""
        self.reset_thread: threading.Thread | None = None

    # -- helpers -----------------------------------------------------------------------------
    def _send_api(self, msg: tuple) -> None:
        with self.api_lock:
            try:
                self.api.send(msg)
            except (OSError, EOFError, ValueError):
                pass

    def _config_text(self) -> str:
        c = self.cfg
        return (
            f"V1 LLM engine (v{c.vllm_version}) with config: model='{c.model}', speculative_config=None, "
            f"tokenizer='{c.model}', skip_tokenizer_init=False, tokenizer_mode=auto, revision=None, "
            f"tokenizer_revision=None, trust_remote_code=True, dtype=torch.{c.dtype}, max_seq_len={c.max_model_len}, "
            f"download_dir=None, load_format=auto, tensor_parallel_size={c.tensor_parallel_size}, "
            "pipeline_parallel_size=1, data_parallel_size=1, disable_custom_all_reduce=True, quantization=None, "
            f"enforce_eager=True, kv_cache_dtype=auto, device_config=xpu, served_model_name={c.served_model_name}, "
            "enable_prefix_caching=True, enable_chunked_prefill=True"
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> None:
        proctitle.set_title("VLLM::EngineCore")
        vlog.set_style(self.cfg.prefix_style)
        vlog.set_name(self.cfg.engine_name)
        vlog.install_streams()
        if os.environ.get("PYTHONFAULTHANDLER") or self.cfg.faults_of("engine-crash"):
            faulthandler.enable(all_threads=True)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        vlog.info("core.py:103", "Initializing a " + self._config_text())
        if not os.environ.get("OMP_NUM_THREADS"):
            vlog.warning(
                "multiproc_executor.py:997",
                f"Reducing Torch parallelism from {os.cpu_count() or 1} threads to 1 to avoid unnecessary CPU "
                "contention. Set OMP_NUM_THREADS in the external environment to tune this value as needed.",
            )
        self._make_dist_files()
        t0 = time.monotonic()
        self._start_workers()
        threading.Thread(target=self._read_api, name="EngineCoreInput", daemon=True).start()
        try:
            self._startup()
        except Fatal as e:
            self._startup_failed(e.kind)
        vlog.info(
            "core.py:281",
            f"init engine (profile, create kv cache, warmup model) took {time.monotonic() - t0:.2f} seconds",
        )
        threading.Thread(target=self._monitor_workers, name="MultiprocWorkerMonitor", daemon=True).start()
        self._send_api(("ready", {"kv_cache_tokens": self.cfg.kv_cache_tokens}))
        try:
            self.run_busy_loop()
        except Fatal as e:
            self._fatal(e.kind, e.in_step)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.shutdown(clean=True)
        os._exit(0)

    def _make_dist_files(self) -> None:
        """The leftovers of a real run (sim.dist_files): the init file and the MessageQueue buffer."""
        self.dist_fd, self.shm = dist_files.make_dist_files(self.cfg)

    def _start_workers(self) -> None:
        """Spawn the local workers; with `--nnodes`, listen on the master port first and wait for
        every follower worker to connect (the rendezvous: blocks while a node is missing)."""
        ctx = multiprocessing.get_context("spawn")
        listener = None
        if self.cfg.nnodes > 1:
            listener = multinode.listen(self.cfg.master_addr, self.cfg.master_port)
        for r in self.cfg.local_ranks:
            mine, theirs = ctx.Pipe(duplex=True)
            death_r, death_w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=worker_main, args=(self.cfg, r, theirs, death_r), name=f"VllmWorker-{r}", daemon=True
            )
            p.start()
            theirs.close()
            death_r.close()
            self.procs.append(p)
            self.conns.append(mine)
            self.deaths.append(death_w)
        if listener is not None:
            remote = [r for r in range(self.cfg.tensor_parallel_size) if r not in self.cfg.local_ranks]
            self.remote = multinode.accept_ranks(listener, remote)
            listener.close()
            self.conns += [self.remote[r] for r in remote]

    def _startup(self) -> None:
        tp = self.cfg.tensor_parallel_size
        reached: dict[str, set[int]] = {}
        ready: set[int] = set()
        conn_rank = {id(c): r for r, c in enumerate(self.conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self.procs)}
        live: list[Any] = list(self.conns) + list(sentinel_rank)
        while len(ready) < tp:
            for obj in wait(live):
                if isinstance(obj, int):
                    r = sentinel_rank[obj]
                    self.dead_rank = r
                    raise Fatal("startup-died", False)
                r = conn_rank[id(obj)]
                try:
                    msg: Any = obj.recv()  # type: ignore[union-attr,call-arg]
                except (EOFError, OSError):
                    live.remove(obj)
                    continue
                if msg[0] == "reached":
                    got = reached.setdefault(msg[1], set())
                    got.add(r)
                    if len(got) == tp:
                        if msg[1] == "kv-cache":
                            self._kv_cache_lines()
                        for c in self.conns:
                            c.send(("go", msg[1]))
                elif msg[0] == "ready":
                    ready.add(r)
                elif msg[0] == "failed":
                    self.dead_rank = r
                    self.fail_text = msg[1]
                    raise Fatal("startup-rpc" if msg[2] == "kv-cache" else "startup-died", False)

    def _kv_cache_lines(self) -> None:
        c = self.cfg
        vlog.info("kv_cache_utils.py:1316", f"GPU KV cache size: {c.kv_cache_tokens:,} tokens")
        vlog.info(
            "kv_cache_utils.py:1321",
            f"Maximum concurrency for {c.max_model_len:,} tokens per request: {c.kv_cache_tokens / c.max_model_len:.2f}x",
        )

    def _startup_failed(self, kind: str) -> None:
        """``EngineCore failed to start.`` (core.py run_engine_core), the workers stopped, the
        process traceback, exit 1."""
        frames, exc = core_crash.startup_traceback(kind, self.fail_text)
        if kind != "startup-rpc" and self.dead_rank is not None and self.procs[self.dead_rank].exitcode is not None:
            vlog.error(
                "multiproc_executor.py:231",
                f"Worker proc VllmWorker-{self.dead_rank} died unexpectedly, shutting down executor.",
            )
        vlog.error("core.py:936", "EngineCore failed to start.\n" + vlog.traceback_text(frames, exc))
        self.shutdown(clean=False)
        core_crash.process_traceback(self.cfg.engine_name, frames[:1], exc)
        sys.stdout.flush()
        os._exit(1)

    def shutdown(self, clean: bool) -> None:
        """Stop the workers: close their death pipes, SIGTERM, then SIGKILL after a grace period
        (vLLM MultiprocExecutor.shutdown / _ensure_worker_termination)."""
        self.shutting_down = True
        for p in self.procs:
            if p.is_alive() and p.pid:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.monotonic() + self.cfg.scaled(4.0, floor=0.5)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for d in self.deaths:
            try:
                d.close()
            except OSError:
                pass
        for p in self.procs:
            if p.is_alive() and p.pid:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.join(1.0)
        for link in self.remote.values():
            link.close()
        if clean and self.shm is not None:
            try:
                self.shm.close()
                self.shm.unlink()
            except OSError:
                pass

    # -- running -----------------------------------------------------------------------------
    def _read_api(self) -> None:
        try:
            while True:
                msg = self.api.recv()
                if msg[0] == "serving":
                    for c in self.conns:
                        try:
                            c.send(("serving",))
                        except OSError:
                            pass
                    for f in self.cfg.faults_of("engine-crash"):
                        threading.Timer(
                            self.cfg.scaled(f.after or 0.0), self._crash, (f.signal or "SEGV",)
                        ).start()
                else:
                    self.inputs.put(msg)
        except (EOFError, OSError):
            pass
        # The API server is gone (vLLM: the engine's parent-death check).
        if self.cfg.orphans or self.shutting_down:
            return
        for d in self.deaths:  # the workers see their parent go first
            try:
                d.close()
            except OSError:
                pass
        deadline = time.monotonic() + self.cfg.scaled(1.0, floor=0.3)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.shutdown(clean=False)
        os._exit(0)

    def _crash(self, sig: str) -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))

    def _monitor_workers(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        ready = wait(list(sentinels))
        if self.shutting_down:
            return
        r = sentinels[ready[0]]  # type: ignore[index]
        self.dead_rank = r
        vlog.error(
            "multiproc_executor.py:231",
            f"Worker proc VllmWorker-{r} died unexpectedly, shutting down executor.",
        )
        for f in self.cfg.faults_of("worker-segv", r):
            if f.kernel:
                self.reset_thread = threading.Thread(
                    target=self._engine_resets, args=(f.kernel,), daemon=True
                )
                self.reset_thread.start()
        # Executor shutdown: tell the surviving ranks a peer died, then close their death pipes.
        self.shutting_down = True
        for i, d in enumerate(self.deaths):
            try:
                if i != r:
                    d.send(("peer-died", r))
                d.close()
            except OSError:
                pass
        self.failed.set()
        self.inputs.put(("executor-failed",))

    def _engine_resets(self, path: str) -> None:
        """After the user-mode driver died, the xe driver resets each card's copy engine (BCS)."""
        for dev in range(self.cfg.tensor_parallel_size):
            time.sleep(self.cfg.scaled(1.2))
            kernel.write_records(path, [kernel.engine_reset_record(pci_address(dev), 54 - 7 * dev)])

    def run_busy_loop(self) -> None:
        while True:
            block = not self.requests
            try:
                msg = self.inputs.get(timeout=0.5) if block else self.inputs.get_nowait()
            except queue.Empty:
                msg = None
            while msg is not None:
                self._handle_client_request(msg)
                try:
                    msg = self.inputs.get_nowait()
                except queue.Empty:
                    msg = None
            if self.requests:
                self.step()

    def _handle_client_request(self, msg: tuple) -> None:
        if msg[0] == "add":
            self.requests[msg[1]] = [int(msg[2]), int(msg[3]), 0]
        elif msg[0] == "abort":
            self.requests.pop(msg[1], None)
        elif msg[0] == "executor-failed":
            # With requests in flight the step waiting on the dead worker is cancelled (the shape of
            # every real log with traffic); idle, the input queue reports the executor failure.
            raise Fatal("cancelled", True) if self.requests else Fatal("executor-failed", False)

    def step(self) -> None:
        """One engine step: every worker runs the forward pass; one token per running request."""
        self.step_no += 1
        n = self.step_no
        for r, peer in self.remote.items():
            if peer.closed_by_peer():  # the follower went away while the engine was idle
                self._peer_failed(n, r, reset=False)
        for c in self.conns:
            try:
                c.send(("step", n, len(self.requests)))
            except OSError:
                pass
        failure = shm_broadcast.wait_answers(self.conns, n, self.cfg, self.failed, self.remote)
        if failure is not None:
            what, rank, text = failure
            if what == "peer-gone":
                self._peer_failed(n, rank, reset=True)
            # a worker raised in the forward pass (vLLM: get_response raises "Worker failed with error")
            self.dead_rank = rank
            self.fail_text = text
            raise Fatal("worker-error", True)
        outs, stats = scheduler.advance(self.requests, self.cfg.kv_cache_tokens)
        self._send_api(("out", outs, stats))

    def _peer_failed(self, step: int, rank: int, reset: bool) -> None:
        """A remote rank's link is gone: TP rank 0's collective with it fails (gloo), rank 0
        answers the step with the error, and the engine fails like on any worker error. Raises
        Fatal("worker-error")."""
        text = multinode.gloo_error(self.remote[rank].peer, reset)
        self.fail_text = text
        self.dead_rank = 0
        try:
            self.conns[0].send(("peer-lost", step, text))
            deadline = time.monotonic() + self.cfg.scaled(5.0, floor=1.0)
            while self.conns[0].poll(max(0.0, deadline - time.monotonic())):
                msg = self.conns[0].recv()
                if msg[0] == "err" and msg[1] == step:
                    break
        except (EOFError, OSError):
            pass
        raise Fatal("worker-error", True)

    def _fatal(self, kind: str, in_step: bool) -> None:
        """``EngineCore encountered a fatal error.`` (core.py run_engine_core), ``dead`` to the
        API server, the executor shut down, the process traceback, exit 1."""
        if in_step:
            core_crash.dump_input(self._config_text(), self.requests, self.cfg.kv_cache_tokens)
        frames, exc, tb = core_crash.fatal_traceback(kind, self.fail_text)
        vlog.error("core.py:938", "EngineCore encountered a fatal error.\n" + tb)
        self._send_api(("dead",))
        if not self.shutting_down:
            # Executor shutdown after a hang: the workers' death pipes close.
            self.shutting_down = True
            for d in self.deaths:
                try:
                    d.close()
                except OSError:
                    pass
        deadline = time.monotonic() + self.cfg.scaled(5.0, floor=0.5)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.shutdown(clean=False)
        if self.reset_thread is not None:
            self.reset_thread.join(self.cfg.scaled(10.0, floor=1.0))
        core_crash.process_traceback(self.cfg.engine_name, frames, exc)
        sys.stdout.flush()
        os._exit(1)
