"""What a simulated worker prints and does when a scripted fault hits it (vLLM's
vllm/v1/executor/multiproc_executor.py ``WorkerProc``/``worker_main`` and the XPU worker).

Each handler prints vLLM's lines for its fault and answers the EngineCore on `conn` as a real
worker would: ``("failed", text, phase)`` at start-up, ``("err", step, rank, text)`` for a step.
Frames are (path, line, function, source line) for :func:`vlog.traceback_text`, line numbers
from vLLM 0.14.1; torch frames under a PyTorch wheel's path. The process-ending faults
(``worker-segv``, ``worker-exit``, ``host-oom``) are in :data:`KILLS`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from xpu_serve.sim import kernel, vlog
from xpu_serve.sim.common import SimConfig, current_cpu, pci_address, read_comm
from xpu_serve.sim.faults import Fault

_TORCH = "/usr/local/lib/python3.12/dist-packages/torch"

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

# WorkerProc.__init__ -> load_model -> torch's Module.to: out of device memory while loading.
_OOM_LOAD_FRAMES = [
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
    (f"{_TORCH}/nn/modules/module.py", 1369, "to", "return self._apply(convert)"),
]

# worker_busy_loop -> determine_available_memory -> profile_run: out of memory in the profile run.
_OOM_PROFILE_FRAMES = [
    (
        "vllm/v1/executor/multiproc_executor.py",
        806,
        "worker_busy_loop",
        "output = func(*args, **kwargs)",
    ),
    (f"{_TORCH}/utils/_contextlib.py", 120, "decorate_context", "return func(*args, **kwargs)"),
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

# WorkerProc.__init__ -> XPUWorker.init_device's warm-up all_reduce (torch.distributed).
_CCL_INIT_FRAMES = [
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
    (f"{_TORCH}/distributed/c10d_logger.py", 81, "wrapper", "return func(*args, **kwargs)"),
    (
        f"{_TORCH}/distributed/distributed_c10d.py",
        2955,
        "all_reduce",
        "work = group.allreduce([tensor], opts)",
    ),
]

# worker_busy_loop -> execute_model -> the model's forward pass.
_FORWARD_FRAMES = [
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
    (f"{_TORCH}/utils/_contextlib.py", 120, "decorate_context", "return func(*args, **kwargs)"),
    (
        "vllm/v1/worker/gpu_worker.py",
        624,
        "execute_model",
        "output = self.model_runner.execute_model(scheduler_output, intermediate_tensors)",
    ),
    (f"{_TORCH}/utils/_contextlib.py", 120, "decorate_context", "return func(*args, **kwargs)"),
    (
        "vllm/v1/worker/gpu_model_runner.py",
        3071,
        "execute_model",
        "model_output = self._model_forward(",
    ),
    (
        f"{_TORCH}/nn/modules/module.py",
        1775,
        "_wrapped_call_impl",
        "return self._call_impl(*args, **kwargs)",
    ),
]

# worker_busy_loop -> a tensor-parallel all_reduce (vllm/distributed/parallel_state.py).
_ALL_REDUCE_FRAMES = [
    ("vllm/v1/executor/multiproc_executor.py", 806, "worker_busy_loop", "output = func(*args, **kwargs)"),
    ("vllm/distributed/parallel_state.py", 493, "all_reduce", "return self._all_reduce_out_place(input_)"),
    (
        "vllm/distributed/device_communicators/base_device_communicator.py",
        128,
        "all_reduce",
        "dist.all_reduce(input_, group=self.device_group)",
    ),
]


def device_oom(cfg: SimConfig, conn: Any, phase: str) -> None:
    """UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY at start-up: while loading (``WorkerProc failed to
    start.``, exit 1 after 0.2 s scaled) or in the EngineCore's profile-run RPC (``WorkerProc
    hit an exception.``, then blocks until the executor's shutdown SIGTERM). Never returns."""
    if phase == "load":
        frames, msg = _OOM_LOAD_FRAMES, "WorkerProc failed to start."
    else:
        frames, msg = _OOM_PROFILE_FRAMES, "WorkerProc hit an exception."
    vlog.error(
        "multiproc_executor.py:817", msg + "\n" + vlog.traceback_text(frames, f"RuntimeError: {_UR_OOM}")
    )
    conn.send(("failed", _UR_OOM, phase))
    if phase == "load":
        time.sleep(cfg.scaled(0.2))
        os._exit(1)
    threading.Event().wait()  # stays up until the executor shuts it down (SIGTERM)


def ccl_init_fail(cfg: SimConfig, conn: Any, rank: int) -> None:
    """oneCCL fails in XPUWorker.init_device's warm-up all_reduce (the IPC handle exchange
    cannot open a device fd): CCL_ERROR lines natively, then vLLM's ``WorkerProc failed to
    start.`` traceback; the worker reports the failure and exits 1 (vLLM worker_main)."""
    vlog.ccl("ERROR", _CCL_FD_COND, rank, more=_CCL_FD_MSG + "\n")
    vlog.error(
        "multiproc_executor.py:793",
        "WorkerProc failed to start.\n"
        + vlog.traceback_text(_CCL_INIT_FRAMES, f"RuntimeError: {_CCL_FD_EXC}"),
    )
    # no WorkerProc was built, so a SIGTERM from the executor's shutdown logs nothing
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    conn.send(("failed", _CCL_FD_EXC, "ccl-init"))
    time.sleep(cfg.scaled(0.2))
    sys.stdout.flush()
    os._exit(1)


def device_lost(conn: Any, rank: int, step: int, f: Fault) -> None:
    """UR_RESULT_ERROR_DEVICE_LOST in this step's forward pass: with ``kernel=``, first the xe
    driver's records (the job on this card's compute engine timed out, the engine was reset);
    then vLLM's ``WorkerProc hit an exception.`` traceback, and the failure goes back to the
    EngineCore as the step's answer (vLLM worker_busy_loop); the worker keeps running."""
    if f.kernel:
        kernel.write_records(
            f.kernel,
            kernel.job_timeout_records(pci_address(rank), read_comm(), os.getpid(), step),
        )
    vlog.error(
        "multiproc_executor.py:817",
        "WorkerProc hit an exception.\n"
        + vlog.traceback_text(_FORWARD_FRAMES, f"RuntimeError: {_UR_DEVICE_LOST}"),
    )
    conn.send(("err", step, rank, _UR_DEVICE_LOST))


def collective_failed(conn: Any, rank: int, step: int, text: str) -> None:
    """This step's collective with a rank on another node failed (its link is gone: see
    sim.multinode): vLLM's ``WorkerProc hit an exception.`` with the gloo error `text`,
    answered to the EngineCore as the step's failure."""
    vlog.error(
        "multiproc_executor.py:817",
        "WorkerProc hit an exception.\n" + vlog.traceback_text(_ALL_REDUCE_FRAMES, f"RuntimeError: {text}"),
    )
    conn.send(("err", step, rank, text))


def ccl_finalize_broken_pipe(rank: int) -> None:
    """oneCCL's PMI finalize after the rank holding the KVS server died: Broken pipe, then the
    exception escapes a destructor and the C++ runtime aborts (SIGABRT). Python's
    faulthandler is already gone at that point of interpreter exit, so no Python dump."""
    vlog.native(f"write: error: buf 0x{0x58538DE47400 + os.getpid() * 0x1000:x}, size 394, shift 0\n")
    vlog.ccl("ERROR", "internal_kvs_server.hpp:70 put: read/write error: Broken pipe", rank)
    vlog.ccl("ERROR", "internal_kvs.cpp:94 kvs_remove_name_key: client: remove_key", rank)
    vlog.ccl("ERROR", "pmi_resizable_simple_internal.cpp:197 pmrt_finalize: failed to remove info", rank)
    vlog.ccl(
        "ERROR",
        "pmi_resizable_simple_internal.cpp:363 ~pmi_resizable_simple_internal: condition "
        "pmrt_finalize() == ATL_STATUS_SUCCESS failed",
        rank,
    )
    vlog.native(
        "~pmi_resizable_simple_internal: failed\n"
        "terminate called after throwing an instance of 'ccl::v1::exception'\n"
        "  what():  oneCCL: pmi_resizable_simple_internal.cpp:363 ~pmi_resizable_simple_internal: "
        "EXCEPTION: ~pmi_resizable_simple_internal: failed\n"
    )
    faulthandler.disable()
    os.abort()


def _segv(f: Fault) -> None:
    """A real SIGSEGV (faulthandler dumps); with ``kernel=``, the UMD segfault records first."""
    if f.kernel:
        kernel.write_records(f.kernel, kernel.segfault_records(read_comm(), os.getpid(), current_cpu()))
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)


def _exit(f: Fault) -> None:
    os._exit(f.code if f.code is not None else 1)


def _host_oom(f: Fault) -> None:
    """The kernel's OOM killer: SIGKILL; with ``kernel=``, its records with this process's sizes."""
    if f.kernel:
        kernel.write_records(f.kernel, kernel.oom_records(read_comm(), os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


KILLS: dict[str, Callable[[Fault], None]] = {
    "worker-segv": _segv,
    "worker-exit": _exit,
    "host-oom": _host_oom,
}
"""Fault kind -> the handler that ends this worker process (stdout flushed by the caller)."""
