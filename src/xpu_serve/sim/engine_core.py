"""The simulated ``VLLM::EngineCore`` process (vllm/v1/engine/core.py ``EngineCoreProc`` with the
``MultiprocExecutor`` of vllm/v1/executor/multiproc_executor.py).

Its executor (sim.executor) spawns the workers and coordinates their start-up; then the busy
loop reads the API server's requests and runs one step at a time while any is running: every step
goes to each worker and waits for every answer (sim.shm_broadcast), one token per running request
(sim.scheduler). Failures print vLLM's tracebacks (sim.core_crash) and end the process (exit 1).

Protocol with the API server (one duplex pipe): in ``add``/``abort``/``serving``; out ``ready``,
``out`` (tokens and scheduler stats per step) and ``dead``.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from xpu_serve.sim import core_crash, dist_files, proctitle, scheduler, vlog
from xpu_serve.sim.common import SimConfig
from xpu_serve.sim.core_crash import Fatal
from xpu_serve.sim.executor import MultiprocExecutor

ENGINE_NAME = "EngineCore_DP0"
"""The EngineCore's name with the default (vLLM 0.14) prefixes; see SimConfig.engine_name."""


def run_engine_core(cfg: SimConfig, api: Connection) -> None:
    """Entry point of the EngineCore process (multiprocessing spawn target)."""
    EngineCore(cfg, api).run()


class EngineCore:
    """EngineCoreProc. See the module docstring."""

    def __init__(self, cfg: SimConfig, api: Connection):
        self.cfg = cfg
        self.api = api
        self.api_lock = threading.Lock()
        self.inputs: queue.Queue[tuple] = queue.Queue()
        self.executor = MultiprocExecutor(cfg)
        self.requests: dict[str, list[Any]] = {}  # rid -> [prompt_tokens, max_tokens, generated]
        self.step_no = 0
        self.shm: Any = None
        self.dist_fd: int | None = None

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
        self.executor.start_workers()
        threading.Thread(target=self._read_api, name="EngineCoreInput", daemon=True).start()
        try:
            self.executor.wait_for_ready(self._on_phase)
        except Fatal as e:
            self._startup_failed(e.kind)
        vlog.info(
            "core.py:281",
            f"init engine (profile, create kv cache, warmup model) took {time.monotonic() - t0:.2f} seconds",
        )
        threading.Thread(
            target=self.executor.monitor,
            args=(lambda: self.inputs.put(("executor-failed",)),),
            name="MultiprocWorkerMonitor",
            daemon=True,
        ).start()
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

    def _on_phase(self, phase: str) -> None:
        """Every rank reached `phase`: after the profile run, the KV cache lines."""
        if phase == "kv-cache":
            self._kv_cache_lines()

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
        ex = self.executor
        frames, exc = core_crash.startup_traceback(kind, ex.fail_text)
        if kind != "startup-rpc" and ex.dead_rank is not None and ex.procs[ex.dead_rank].exitcode is not None:
            vlog.error(
                "multiproc_executor.py:231",
                f"Worker proc VllmWorker-{ex.dead_rank} died unexpectedly, shutting down executor.",
            )
        vlog.error("core.py:936", "EngineCore failed to start.\n" + vlog.traceback_text(frames, exc))
        self.shutdown(clean=False)
        core_crash.process_traceback(self.cfg.engine_name, frames[:1], exc)
        sys.stdout.flush()
        os._exit(1)

    def shutdown(self, clean: bool) -> None:
        """Stop the workers (MultiprocExecutor.shutdown); `clean` (SIGTERM): also remove the
        MessageQueue buffer, which a failure leaves to the resource tracker."""
        self.executor.shutdown()
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
                    self.executor.broadcast(("serving",))
                    for f in self.cfg.faults_of("engine-crash"):
                        threading.Timer(
                            self.cfg.scaled(f.after or 0.0), self._crash, (f.signal or "SEGV",)
                        ).start()
                else:
                    self.inputs.put(msg)
        except (EOFError, OSError):
            pass
        # The API server is gone (vLLM: the engine's parent-death check).
        if self.cfg.orphans or self.executor.shutting_down:
            return
        self.executor.close_death_pipes()  # the workers see their parent go first
        self.executor.join(self.cfg.scaled(1.0, floor=0.3))
        self.shutdown(clean=False)
        os._exit(0)

    def _crash(self, sig: str) -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))

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
        self.executor.execute_model(n, len(self.requests))
        outs, stats = scheduler.advance(self.requests, self.cfg.kv_cache_tokens)
        self._send_api(("out", outs, stats))

    def _fatal(self, kind: str, in_step: bool) -> None:
        """``EngineCore encountered a fatal error.`` (core.py run_engine_core), ``dead`` to the
        API server, the executor shut down, the process traceback, exit 1."""
        if in_step:
            core_crash.dump_input(self._config_text(), self.requests, self.cfg.kv_cache_tokens)
        ex = self.executor
        frames, exc, tb = core_crash.fatal_traceback(kind, ex.fail_text)
        vlog.error("core.py:938", "EngineCore encountered a fatal error.\n" + tb)
        self._send_api(("dead",))
        if not ex.shutting_down:
            # Executor shutdown after a hang: the workers' death pipes close.
            ex.shutting_down = True
            ex.close_death_pipes()
        ex.join(self.cfg.scaled(5.0, floor=0.5))
        self.shutdown(clean=False)
        if ex.reset_thread is not None:
            ex.reset_thread.join(self.cfg.scaled(10.0, floor=1.0))
        core_crash.process_traceback(self.cfg.engine_name, frames, exc)
        sys.stdout.flush()
        os._exit(1)
