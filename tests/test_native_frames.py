"""Native crash frames attributed to a GPU driver/runtime by library path or by API symbol
(`gpu_runtime_frame`), and through a real crash dump read by the Analyzer."""

from __future__ import annotations

import pytest

from xpu_serve.diagnosis import Analyzer, gpu_runtime_frame


@pytest.mark.parametrize(
    ("frame", "what", "library"),
    [
        ('  File "<unknown>", line 0, in cuMemcpyBatchAsync', "cuMemcpyBatchAsync", None),
        ("#3  0x00007f11a2b3c4d5 in zeCommandListAppendLaunchKernel () from /usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1",
         "libze_intel_gpu.so.1", "libze_intel_gpu.so.1"),
        ("#0  0x00007f11a2b3c4d5 in zeCommandListAppendMemoryCopy ()", "zeCommandListAppendMemoryCopy", None),
        ("[host:01234] [ 2] /opt/rocm/lib/libhsa-runtime64.so.1(+0x6b1c2)[0x7f00aa10b2c3]",
         "libhsa-runtime64.so.1", "libhsa-runtime64.so.1"),
        ("    @     0x7f3c5f628350  hipModuleLaunchKernel", "hipModuleLaunchKernel", None),
        ("libfoo.so(urEnqueueKernelLaunch+0x1d)[0x7f00]", "urEnqueueKernelLaunch", None),
        ('  File "<unknown>", line 0, in hsa_signal_wait_scacquire', "hsa_signal_wait_scacquire", None),
    ],
)
def test_gpu_runtime_frames(frame: str, what: str, library: str | None) -> None:
    assert gpu_runtime_frame(frame) == (what, library)


@pytest.mark.parametrize(
    "frame",
    [
        # a callee's symbol as an argument, a Python file named after CUDA, a torch op
        '  File "<unknown>", line 0, in swap_blocks_batch(at::Tensor const&, bool)',
        '  File "/x/vllm/compilation/cuda_graph.py", line 239 in __call__',
        "#1  0x000000000046e830 in llama_new_context_with_model ()",
        "libtorch_cuda.so(_ZN2at6native5sort+0x1d)[0x7f00]",
    ],
)
def test_other_frames_are_not_gpu_runtime(frame: str) -> None:
    assert gpu_runtime_frame(frame) is None


def _feed(lines: list[str]):  # type: ignore[no-untyped-def]
    an = Analyzer()
    for i, line in enumerate(lines, 1):
        an.feed_line(line, "t.log", i)
    return an.incident()


DUMP = "!!!!!!! Segfault encountered !!!!!!!"
SIGFRAME = '  File "./signal/../sysdeps/unix/sysv/linux/x86_64/libc_sigaction.c", line 0, in 0x000070e67704532f'


def test_dump_whose_first_frame_is_a_driver_symbol_is_umd_segfault() -> None:
    inc = _feed([DUMP, SIGFRAME, '  File "<unknown>", line 0, in cuMemCreate', '  File "misc/cudawrap.cc", line 92, in ncclCuMemHostEnable()'])
    assert inc.cause == "umd-segfault" and inc.root is not None and inc.root.line == 1


def test_dump_named_by_library_path_sets_library() -> None:
    inc = _feed([DUMP, "#0  0x00007f11a2b3c4d5 in ?? () from /usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1"])
    assert (inc.cause, inc.library) == ("umd-segfault", "libze_intel_gpu.so.1")


def test_caller_frames_do_not_attribute() -> None:
    # the crashing frame is vLLM's own op; a driver call further down is a caller's, not the crash
    inc = _feed([DUMP, '  File "<unknown>", line 0, in swap_blocks_batch(at::Tensor const&)',
                 '  File "<unknown>", line 0, in cuMemcpyBatchAsync'])
    assert inc.cause == "process-crash"


def test_python_traceback_naming_cuda_calls_is_not_a_crash_frame() -> None:
    inc = _feed([
        "Traceback (most recent call last):",
        '  File "/x/vllm/compilation/cuda_graph.py", line 239, in __call__',
        "    entry.cudagraph.replay()  # cudaGraphLaunch",
        "RuntimeError: CUDA error: operation not permitted when stream is capturing",
    ])
    assert inc.cause != "umd-segfault"
