"""The ACL runtime result vocabulary (data/acl_runtime.yaml) and the readings of a process that left
no exception line of its own: a cut traceback of a process that exited with code 1, a worker silent
before EngineCore's `WorkerProc initialization failed`, a module-qualified exception line alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpu_serve.diagnosis import diagnose_files
from xpu_serve.events import parse_line
from xpu_serve.signatures import code_table, load_table

TABLE = load_table()


def _verdict_of(tmp_path: Path, text: str) -> dict[str, Any]:
    p = tmp_path / "input.log"
    p.write_text(text)
    return diagnose_files([p]).to_contract()


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        (
            "        wait for compute device to finish failed, runtime result = 507010.[FUNC:ReportCallError]",
            "device-lost",
        ),
        ("RuntimeError: NPU function error: aclrtSynchronizeStream, error code is 207004", "device-lost"),
        ("  NPU function error: aclrtMallocHostWithCfg, error code is 207001", "device-oom"),
        ("RuntimeError: ACL stream synchronize failed, error code:507035", "process-exception"),
        ("synchronize stream failed, runtime result - 507011(FUNC:ReportCallError]", "process-exception"),
        # an argument check's result is not in the vocabulary: the line alone decides nothing
        ("NPU function error: aclrtPointerGetAttributes, error code is 107000", None),
        ("HCCL function error: hcclCommInitRootInfoConfig(...), error code is 507010x", "collective-failure"),
    ],
)
def test_acl_result_classes(line: str, cause: str | None) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].cause if got else None) == cause


def test_acl_table_classes_are_the_rows_classes() -> None:
    classes = {v["class"] for v in code_table("acl_runtime").values()}
    assert classes == {"device-lost", "device-oom", "task"}


_CUT_TB = (
    '(EngineCore pid=165) ERROR 07-02 07:48:27 [core.py:1202]   File "/x/aiter/ops/sampling.py", line 70, in top_k\n'
    "(EngineCore pid=165) ERROR 07-02 07:48:27 [core.py:1202]     return top_k_core(\n"
)


@pytest.mark.parametrize(
    ("code", "cause", "line"), [("1", "process-exception", 1), ("-9", "process-crash", 3)]
)
def test_cut_traceback_of_a_process_that_exited_with_code_1(
    tmp_path: Path, code: str, cause: str, line: int
) -> None:
    report = (
        "(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. "
        f"Failed core proc(s): {{'EngineCore': {code}}}\n"
    )
    got = _verdict_of(tmp_path, _CUT_TB + report)
    assert (got["cause"], got["root"]["line"], got["root"]["pid"]) == (cause, line, 165)


_WORKER = (
    "(Worker pid=601) INFO 03-23 22:46:29 [parallel_state.py:1400] world_size=1 rank=0 local_rank=0 "
    "distributed_init_method=tcp://127.0.0.1:36821 backend=nccl\n"
)
_INIT_FAILED = (
    "(EngineCore pid=500) Exception: WorkerProc initialization failed due to an exception in a background "
    "process. See stack trace for root cause.\n"
)


def test_worker_silent_before_init_failed_is_the_crash(tmp_path: Path) -> None:
    got = _verdict_of(tmp_path, _WORKER + _INIT_FAILED)
    assert (got["cause"], got["root"]["process"], got["root"]["pid"]) == ("process-crash", "Worker", 601)
    # the worker's own error, when in the input, is the root
    own = (
        "(Worker pid=601) ERROR 03-23 22:46:29 [multiproc_executor.py:597] WorkerProc failed to start.\n"
        "(Worker pid=601) ERROR 03-23 22:46:29 [multiproc_executor.py:597] Traceback (most recent call last):\n"
        '(Worker pid=601) ERROR 03-23 22:46:29 [multiproc_executor.py:597]   File "/x/worker.py", line 3, in f\n'
        "(Worker pid=601) ERROR 03-23 22:46:29 [multiproc_executor.py:597]     raise KeyError(name)\n"
        "(Worker pid=601) ERROR 03-23 22:46:29 [multiproc_executor.py:597] KeyError: 'model.layers.0.weight'\n"
    )
    got = _verdict_of(tmp_path, _WORKER + own + _INIT_FAILED)
    assert (got["cause"], got["root"]["pid"], got["root"]["line"]) == ("process-exception", 601, 6)


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        (
            "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 1, Hardware limit: 0.\n",
            "process-exception",
        ),
        ("torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n", "process-exception"),
        ("asyncio.exceptions.CancelledError: cancelled\n", "unknown"),
        ("RuntimeError: a builtin's line needs its traceback\n", "unknown"),
    ],
)
def test_module_qualified_exception_line_alone(tmp_path: Path, text: str, cause: str) -> None:
    assert _verdict_of(tmp_path, text)["cause"] == cause


def test_platform_config_check_is_a_config_error(tmp_path: Path) -> None:
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/v/vllm/platforms/cpu.py", line 102, in get_attn_backend_cls\n'
        '    raise ValueError("CPU backend only supports V1.")\n'
        "ValueError: CPU backend only supports V1.\n"
    )
    assert _verdict_of(tmp_path, tb)["cause"] == "config-error"
    assert (
        _verdict_of(tmp_path, tb.replace("get_attn_backend_cls", "forward"))["cause"] == "process-exception"
    )
