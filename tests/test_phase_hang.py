"""A no-progress warning that start-up moved on from (a later start-up milestone) was long start-up
work, not a stall; a warning after the last milestone still is one."""

from __future__ import annotations

from xpu_serve.diagnosis import Analyzer

LOADED = "(EngineCore_DP0 pid=2674) INFO 04-14 23:00:01 [gpu_model_runner.py:2000] Model loading took 10.5 GiB and 30.1 seconds"
WAIT = ("(EngineCore_DP0 pid=2674) INFO 04-14 23:01:33 [shm_broadcast.py:542] No available shared memory broadcast "
        "block found in 60 seconds. This typically happens when some processes are hanging or doing some "
        "time-consuming work (e.g. compilation, weight/kv cache quantization).")
KV = "(EngineCore_DP0 pid=2674) INFO 04-14 23:01:50 [gpu_worker.py:255] Available KV cache memory: 18.83 GiB"
READY = "(APIServer pid=2600) INFO:     Application startup complete."


def _incident(lines: list[str]):  # type: ignore[no-untyped-def]
    an = Analyzer()
    for i, line in enumerate(lines, 1):
        an.feed_line(line, "vllm.log", i)
    return an.incident()


def test_one_wait_followed_by_startup_progress_and_ready_is_no_hang() -> None:
    inc = _incident([LOADED, WAIT, KV, READY])
    assert inc.cause == "unknown" and inc.hang is None


def test_wait_after_the_last_milestone_during_startup_is_a_startup_hang() -> None:
    inc = _incident([LOADED, KV, WAIT.replace("23:01:33", "23:02:55"), WAIT.replace("23:01:33", "23:03:55")])
    assert inc.cause == "startup-hang"


def test_rpc_timeout_during_startup_is_the_detector_of_a_startup_hang() -> None:
    rpc = "(EngineCore_DP0 pid=2674) ERROR 04-14 23:05:01 [core.py:938] TimeoutError: RPC call to determine_available_memory timed out."
    inc = _incident([LOADED, WAIT, rpc])
    assert inc.cause == "startup-hang"
    assert inc.hang is not None and (inc.hang.detected_by or "").startswith("vLLM execute-model RPC timeout")
