"""Device-fault, host-memory and no-device vocabulary of other GPU runtimes (ROCr/HSA, HIP/CLR,
Level Zero / UR host-memory codes, torch-xpu / vLLM device detection) classifies as data rows."""

from __future__ import annotations

import pytest

from xpu_serve.events import parse_line
from xpu_serve.signatures import load_table

TABLE = load_table()


@pytest.mark.parametrize(
    ("line", "row", "cause"),
    [
        # ROCr Runtime::VMFaultHandler, both the old (no agent handle) and the current format
        ("Memory access fault by GPU node-1 on address 0x7f00. Reason: Page not present or supervisor privilege.",
         "device-lost-rocr", "device-lost"),
        ("Memory access fault by GPU node-3 (Agent handle: 0x13e852f0) on address 0x77d445e00000. Reason: Unknown.",
         "device-lost-rocr", "device-lost"),
        # ROCr HwExceptionHandler
        ("HW Exception by GPU node-1 (Agent handle: 0x563e71f098b0) reason :GPU Hang", "device-lost-rocr", "device-lost"),
        # HIP/CLR queue callback
        (":0:rocdevice.cpp            :2893: 90021033577 us: [pid:192145 tid:0x76fa7d3ff640] Callback: Queue "
         "0x76f676200000 aborting with error : HSA_STATUS_ERROR_EXCEPTION: An HSAIL operation resulted in a "
         "hardware exception. code: 0x1016", "device-lost-rocr", "device-lost"),
        ("RuntimeError: Native API failed. Native API returns: -6 (UR_RESULT_ERROR_OUT_OF_HOST_MEMORY)",
         "device-out-of-memory", "device-oom"),
        ("RuntimeError: PI_ERROR_OUT_OF_HOST_MEMORY", "device-out-of-memory", "device-oom"),
        ("(APIServer pid=1) RuntimeError: Failed to infer device type", "no-device-found", "config-error"),
        ("/usr/lib/python3/dist-packages/torch/xpu/__init__.py:60: UserWarning: XPU device count is zero! "
         "(Triggered internally at /pytorch/c10/xpu/XPUFunctions.cpp:115.)", "no-device-found", "config-error"),
    ],
)
def test_runtime_vocabulary_rows(line: str, row: str, cause: str) -> None:
    got = TABLE.match(parse_line(line, "t.log", 1))
    assert got is not None, line
    assert (got[0].id, got[0].cause) == (row, cause)


@pytest.mark.parametrize(
    "line",
    [
        # prose about the fault, and a kernel record host OOM owns, are not this row's
        "Out of memory: Killed process 7986 (VLLM::Worker_TP) total-vm:98123456kB, anon-rss:40123456kB",
        "see the HW Exception docs for details",
        "INFO 01-01 00:00:00 [xpu.py:1] Found 4 XPU devices",
    ],
)
def test_runtime_vocabulary_rows_leave_other_lines(line: str) -> None:
    got = TABLE.match(parse_line(line, "t.log", 1))
    assert got is None or got[0].id not in ("device-lost-rocr", "no-device-found", "device-out-of-memory")


def test_host_memory_code_is_not_host_oom() -> None:
    got = TABLE.match(parse_line("ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY", "t.log", 1))
    assert got is not None and got[0].cause == "device-oom"
