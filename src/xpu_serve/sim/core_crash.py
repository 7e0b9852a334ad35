"""What the simulated EngineCore prints when it fails: the start-up and busy-loop tracebacks of
vllm/v1/engine/core.py (``EngineCore failed to start.``, ``EngineCore encountered a fatal
error.``), the dump_input.py lines before a fatal error in a step, and multiprocessing's
``Process EngineCore_DP0:`` traceback.

Frames are (path, line, function, source line) as :func:`vlog.traceback_text` takes them, line
numbers from vLLM 0.14.1. A traceback is chosen by its kind:

- start-up: ``startup-rpc`` (a worker's exception answered to the profile-run RPC) or
  ``startup-died`` (a worker died or failed before it was ready);
- busy loop: ``timeout`` (no answer within VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS), ``worker-error``
  (a worker answered the step with an exception), ``cancelled`` (a worker died during a step),
  ``executor-failed`` (a worker died while the engine was idle).
"""

from __future__ import annotations

import sys
from typing import Any

from xpu_serve.sim import vlog

Frame = tuple[str, int, str, str]


class Fatal(Exception):
    """The EngineCore fails: `kind` names the traceback (see the module docstring); `in_step`
    True when a step was running (the dump_input lines come first)."""

    def __init__(self, kind: str, in_step: bool):
        super().__init__(kind)
        self.kind = kind
        self.in_step = in_step


# run_engine_core -> EngineCoreProc.__init__ (vllm/v1/engine/core.py): every start-up failure.
_CORE_INIT_FRAMES: list[Frame] = [
    ("vllm/v1/engine/core.py", 927, "run_engine_core", "engine_core = EngineCoreProc(*args, **kwargs)"),
    ("vllm/v1/engine/core.py", 692, "__init__", "super().__init__("),
]

# EngineCore._initialize_kv_caches -> MultiprocExecutor.collective_rpc -> get_response.
_STARTUP_RPC_FRAMES: list[Frame] = [
    *_CORE_INIT_FRAMES,
    (
        "vllm/v1/engine/core.py",
        113,
        "__init__",
        "num_gpu_blocks, num_cpu_blocks, kv_cache_config = self._initialize_kv_caches(",
    ),
    (
        "vllm/v1/engine/core.py",
        229,
        "_initialize_kv_caches",
        "available_gpu_memory = self.model_executor.determine_available_memory()",
    ),
    (
        "vllm/v1/executor/abstract.py",
        126,
        "determine_available_memory",
        'return self.collective_rpc("determine_available_memory")',
    ),
    ("vllm/v1/executor/multiproc_executor.py", 358, "collective_rpc", "return aggregate(get_response())"),
    ("vllm/v1/executor/multiproc_executor.py", 342, "get_response", "raise RuntimeError("),
]

# EngineCore.__init__ -> MultiprocExecutor._init_executor -> WorkerProc.wait_for_ready.
_STARTUP_DIED_FRAMES: list[Frame] = [
    *_CORE_INIT_FRAMES,
    ("vllm/v1/engine/core.py", 105, "__init__", "self.model_executor = executor_class(vllm_config)"),
    ("vllm/v1/executor/abstract.py", 101, "__init__", "self._init_executor()"),
    (
        "vllm/v1/executor/multiproc_executor.py",
        174,
        "_init_executor",
        "self.workers = WorkerProc.wait_for_ready(unready_workers)",
    ),
    ("vllm/v1/executor/multiproc_executor.py", 660, "wait_for_ready", "raise e from None"),
]

# run_busy_loop -> step -> the executor's future -> get_response (vllm/v1/engine/core.py,
# vllm/v1/executor/multiproc_executor.py): every failure inside a step.
_BUSY_FRAMES: list[Frame] = [
    ("vllm/v1/engine/core.py", 929, "run_engine_core", "engine_core.run_busy_loop()"),
    ("vllm/v1/engine/core.py", 956, "run_busy_loop", "self._process_engine_step()"),
    ("vllm/v1/engine/core.py", 989, "_process_engine_step", "outputs, model_executed = self.step_fn()"),
    ("vllm/v1/engine/core.py", 388, "step", "model_output = future.result()"),
    ("vllm/v1/executor/multiproc_executor.py", 80, "result", "return super().result()"),
    ("py:concurrent/futures/_base.py", 449, "result", "return self.__get_result()"),
    ("py:concurrent/futures/_base.py", 401, "__get_result", "raise self._exception"),
    (
        "vllm/v1/executor/multiproc_executor.py",
        84,
        "wait_for_response",
        "response = self.aggregate(get_response())",
    ),
]

# MessageQueue.dequeue -> acquire_read (vllm/distributed/device_communicators/shm_broadcast.py).
_DEQUEUE_FRAMES: list[Frame] = [
    (
        "vllm/distributed/device_communicators/shm_broadcast.py",
        616,
        "dequeue",
        "with self.acquire_read(timeout, cancel, indefinite) as buf:",
    ),
    ("py:contextlib.py", 137, "__enter__", "return next(self.gen)"),
]

_TIMEOUT_INNER_FRAMES: list[Frame] = [
    ("vllm/v1/executor/multiproc_executor.py", 336, "get_response", "status, result = mq.dequeue("),
    *_DEQUEUE_FRAMES,
    ("vllm/distributed/device_communicators/shm_broadcast.py", 536, "acquire_read", "raise TimeoutError"),
]

_TIMEOUT_FRAMES: list[Frame] = [
    *_BUSY_FRAMES,
    (
        "vllm/v1/executor/multiproc_executor.py",
        340,
        "get_response",
        'raise TimeoutError(f"RPC call to {method} timed out.") from e',
    ),
]

_WORKER_ERROR_FRAMES: list[Frame] = [
    *_BUSY_FRAMES,
    ("vllm/v1/executor/multiproc_executor.py", 342, "get_response", "raise RuntimeError("),
]

_CANCELLED_FRAMES: list[Frame] = [
    *_BUSY_FRAMES,
    (
        "vllm/v1/executor/multiproc_executor.py",
        336,
        "get_response",
        "status, result = mq.dequeue(timeout=dequeue_timeout)",
    ),
    *_DEQUEUE_FRAMES,
    (
        "vllm/distributed/device_communicators/shm_broadcast.py",
        530,
        "acquire_read",
        'raise RuntimeError("cancelled")',
    ),
]

# run_busy_loop -> _process_input_queue -> _handle_client_request: the executor failed while idle.
_EXECUTOR_FAILED_FRAMES: list[Frame] = [
    ("vllm/v1/engine/core.py", 929, "run_engine_core", "engine_core.run_busy_loop()"),
    ("vllm/v1/engine/core.py", 954, "run_busy_loop", "self._process_input_queue()"),
    ("vllm/v1/engine/core.py", 981, "_process_input_queue", "self._handle_client_request(*req)"),
    ("vllm/v1/engine/core.py", 1014, "_handle_client_request", 'raise RuntimeError("Executor failed.")'),
]

_WORKER_FAILED = (
    "RuntimeError: Worker failed with error '{}', please check the stack trace above for the root cause"
)
_INIT_FAILED = (
    "Exception: WorkerProc initialization failed due to an exception in a background process. "
    "See stack trace for root cause."
)


def startup_traceback(kind: str, fail_text: str) -> tuple[list[Frame], str]:
    """(frames, exception line) of ``EngineCore failed to start.``; `kind` ``startup-rpc`` or
    ``startup-died``; `fail_text` the worker's error (used by ``startup-rpc``)."""
    if kind == "startup-rpc":
        return _STARTUP_RPC_FRAMES, _WORKER_FAILED.format(fail_text)
    return _STARTUP_DIED_FRAMES, _INIT_FAILED


def fatal_traceback(kind: str, fail_text: str) -> tuple[list[Frame], str, str]:
    """(frames, exception line, full traceback text) of ``EngineCore encountered a fatal
    error.`` for a busy-loop `kind` (see the module docstring); `fail_text` the worker's error
    (used by ``worker-error``). ``timeout`` chains shm_broadcast's bare TimeoutError as the
    direct cause, as CPython prints ``raise ... from e``."""
    if kind == "timeout":
        exc = "TimeoutError: RPC call to execute_model timed out."
        inner = vlog.traceback_text(_TIMEOUT_INNER_FRAMES, "TimeoutError")
        tb = (
            inner
            + "\n\nThe above exception was the direct cause of the following exception:\n\n"
            + vlog.traceback_text(_TIMEOUT_FRAMES, exc, caret=True)
        )
        return _TIMEOUT_FRAMES, exc, tb
    if kind == "worker-error":
        exc = _WORKER_FAILED.format(fail_text)
        return _WORKER_ERROR_FRAMES, exc, vlog.traceback_text(_WORKER_ERROR_FRAMES, exc)
    if kind == "cancelled":
        exc = "RuntimeError: cancelled"
        return _CANCELLED_FRAMES, exc, vlog.traceback_text(_CANCELLED_FRAMES, exc, caret=True)
    exc = "RuntimeError: Executor failed."
    return _EXECUTOR_FAILED_FRAMES, exc, vlog.traceback_text(_EXECUTOR_FAILED_FRAMES, exc)


def dump_input(config_text: str, requests: dict[str, list[Any]], kv_cache_tokens: int) -> None:
    """The three ERROR lines of vllm/v1/engine/dump_input.py ``dump_engine_exception`` before a
    fatal error inside a step. `requests`: rid -> [prompt_tokens, max_tokens, generated]."""
    vlog.error("dump_input.py:72", "Dumping input data for " + config_text)
    ids = list(requests)
    vlog.error(
        "dump_input.py:79",
        "Dumping scheduler output for model execution: SchedulerOutput(scheduled_new_reqs=[], "
        f"scheduled_cached_reqs=CachedRequestData(req_ids={ids!r},resumed_req_ids=set(),new_token_ids_lens=[],"
        f"all_token_ids_lens={{}},new_block_ids={[None] * len(ids)!r},"
        f"num_computed_tokens={[r[0] + r[2] for r in requests.values()]!r},"
        f"num_output_tokens={[r[2] for r in requests.values()]!r}), "
        f"total_num_scheduled_tokens={len(ids)}, scheduled_spec_decode_tokens={{}}, finished_req_ids=[])",
    )
    in_kv = sum(r[0] + r[2] for r in requests.values())
    vlog.error(
        "dump_input.py:81",
        f"Dumping scheduler stats: SchedulerStats(num_running_reqs={len(ids)}, num_waiting_reqs=0, "
        f"step_counter=0, current_wave=0, kv_cache_usage={in_kv / max(1, kv_cache_tokens)}, "
        "prefix_cache_stats=PrefixCacheStats(reset=False, requests=0, queries=0, hits=0, "
        "preempted_requests=0, preempted_queries=0, preempted_hits=0), spec_decoding_stats=None, "
        "kv_connector_stats=None, cudagraph_stats=None, perf_stats=None)",
    )


def process_traceback(engine_name: str, frames: list[Frame], exc: str) -> None:
    """What multiprocessing prints on stderr when the process target raises
    (BaseProcess._bootstrap): ``Process <engine_name>:`` and the traceback through
    run_engine_core's ``raise e``."""
    head: list[Frame] = [
        ("py:multiprocessing/process.py", 314, "_bootstrap", "self.run()"),
        ("py:multiprocessing/process.py", 108, "run", "self._target(*self._args, **self._kwargs)"),
        ("vllm/v1/engine/core.py", 940, "run_engine_core", "raise e"),
    ]
    sys.stderr.write(f"Process {engine_name}:\n" + vlog.traceback_text(head + frames, exc) + "\n")
    sys.stderr.flush()
