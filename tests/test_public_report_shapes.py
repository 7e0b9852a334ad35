"""Verdicts of excerpts of public reports read through the real Analyzer: a Go server's start-up
refusal under journalctl's catalog, vLLM's Ray driver-node check, torch's "NCCL Error N" inside a
traceback, SGLang's scheduler watchdog, and a launcher's report that the server process died."""

from __future__ import annotations

from tests.helpers import incident_of as _feed


def test_go_server_permission_denied_under_catalog_dashes_is_config_error() -> None:
    # ollama/ollama#9335: journalctl -x of a non-UTF-8 locale ("--" catalog), a CJK month stamp
    inc = _feed(
        [
            '2月 25 17:49:00 boco-All-Series ollama[3156758]: 2025/02/25 17:49:00 routes.go:1186: INFO server config env="map[',
            "2月 25 17:49:00 boco-All-Series ollama[3156758]: Error: mkdir /mnt/raid_disk/ollama: permission denied",
            "2月 25 17:49:00 boco-All-Series systemd[1]: ollama.service: Main process exited, code=exited, status=1/FAILURE",
            "-- Subject: Unit process exited",
            "-- Defined-By: systemd",
            "-- Support: http://www.ubuntu.com/support",
            "-- ",
            "-- An ExecStart= process belonging to unit ollama.service has exited.",
            "-- ",
            "-- The process' exit code is 'exited' and its exit status is 1.",
            "2月 25 17:49:00 boco-All-Series systemd[1]: ollama.service: Failed with result 'exit-code'.",
        ]
    )
    assert inc.cause == "config-error"
    assert inc.root is not None and inc.root.line == 2 and inc.root.pid == 3156758


def test_permission_denied_needs_the_error_prefix_and_a_path_operation() -> None:
    # a warning that mentions a denied path is not the server's fatal start-up error
    inc = _feed(["WARNING: could not read /sys/class/drm/card0/device/power: permission denied"])
    assert inc.cause == "unknown"


def test_ray_driver_node_check_in_the_engine_log_is_config_error() -> None:
    # vllm-project/vllm#7815: MQLLMEngine logs the ValueError's message, then its traceback
    inc = _feed(
        [
            "ERROR 02-09 02:31:11 engine.py:389] Ray does not allocate any GPUs on the driver node. Consider adjusting "
            "the Ray placement group or running the driver on a GPU node.",
            "ERROR 02-09 02:31:11 engine.py:389] Traceback (most recent call last):",
            'ERROR 02-09 02:31:11 engine.py:389]   File "/usr/local/lib/python3.12/dist-packages/vllm/engine/'
            'multiprocessing/engine.py", line 380, in run_mp_engine',
            "ERROR 02-09 02:31:11 engine.py:389]     engine = MQLLMEngine.from_engine_args(engine_args=engine_args,",
        ]
    )
    assert inc.cause == "config-error" and inc.root is not None and inc.root.line == 1


def test_torch_nccl_error_code_inside_a_rank_traceback_is_collective_failure() -> None:
    # Tencent-Hunyuan/HunyuanVideo#114: torch.cuda.nccl's "NCCL Error 2" under torchrun's [rank0]:
    inc = _feed(
        [
            "[rank0]:     dist.all_to_all_single(output, input_t, group=group)",
            '[rank0]:   File "/opt/conda/envs/myenv/lib/python3.10/site-packages/torch/distributed/distributed_c10d.py", '
            "line 3770, in all_to_all_single",
            "[rank0]:     work = group.alltoall_base(",
            "[rank0]: RuntimeError: NCCL Error 2: unhandled system error (run with NCCL_DEBUG=INFO for details)",
        ]
    )
    assert inc.cause == "collective-failure" and inc.root is not None and inc.root.line == 4


def test_sglang_scheduler_watchdog_on_two_dp_ranks_is_engine_hang() -> None:
    # sgl-project/sglang#5034: FlashInfer JIT lines, then the watchdog of DP1 and DP0 at once
    inc = _feed(
        [
            "2025-04-03 19:59:12,086 - INFO - flashinfer.jit: Loading JIT ops: cascade",
            "[2025-04-03 20:06:34 DP1 TP0] Watchdog timeout (self.watchdog_timeout=300)",
            "[2025-04-03 20:06:34 DP1 TP0] self.cur_batch.batch_size()=1, self.cur_batch.reqs=[Req(rid=71d70226, "
            "input_ids=[3838, 374, 279], output_ids=[])], self.token_to_kv_pool_allocator.available_size()=2468326, ",
            "[2025-04-03 20:06:34 DP0 TP0] Watchdog timeout (self.watchdog_timeout=300)",
        ]
    )
    assert inc.cause == "engine-hang"
    assert inc.root is not None and inc.root.line == 2 and inc.root.rank == 0


def test_tokenizer_manager_watchdog_is_not_the_scheduler_s() -> None:
    inc = _feed(
        [
            "[2026-01-10 08:00:00] TokenizerManager watchdog timeout (self.watchdog_timeout=300, self.soft=False)"
        ]
    )
    assert inc.cause == "unknown"


def test_error_before_the_sglang_watchdog_stays_the_root() -> None:
    # the watchdog detects the stuck forward; a failure logged before it says why
    inc = _feed(
        [
            "[2025-04-03 20:01:00 TP1] RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
            "[2025-04-03 20:06:34 TP0] Watchdog timeout (self.watchdog_timeout=300)",
        ]
    )
    assert inc.cause == "collective-failure" and inc.root is not None and inc.root.rank == 1


def test_launcher_raising_server_terminated_unexpectedly_is_process_crash() -> None:
    # Upsonic/Upsonic#249: the launcher's server manager raises when its server process ended
    inc = _feed(
        [
            "Traceback (most recent call last):",
            '  File "/usr/local/miniconda3/envs/upsonic/lib/python3.13/site-packages/upsonic/server_manager.py", '
            "line 94, in start",
            '    raise RuntimeError(f"Server process terminated unexpectedly with code {self._process.returncode}")',
            "RuntimeError: Server process terminated unexpectedly with code 1",
        ]
    )
    assert inc.cause == "process-crash" and inc.root is not None and inc.root.line == 4


def test_vllm_error_before_the_launcher_report_is_the_root() -> None:
    inc = _feed(
        [
            "(APIServer pid=4123) ERROR 09-01 10:00:01 [core.py:700] ValueError: Total number of attention heads (28) "
            "must be divisible by tensor parallel size (3).",
            "│ ✗ Server process terminated unexpectedly                                        │",
        ]
    )
    assert inc.cause == "config-error" and inc.root is not None and inc.root.line == 1
