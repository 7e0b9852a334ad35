"""The signature table: every row's example matches its own row and no other (except documented
overlaps), and it is the row classification picks; the table is well-formed."""

from __future__ import annotations

import pytest

from xpu_serve.events import Event, parse_line
from xpu_serve.signatures import (
    CAUSES,
    ROLES,
    SUPERVISOR_CAUSES,
    SignatureError,
    derive_keyword,
    load_table,
    parse_table,
)

TABLE = load_table()
FACT_SOURCES = ("process", "health", "supervisor")


def example_event(row) -> Event:  # type: ignore[no-untyped-def]
    if row.sources and row.sources[0] in FACT_SOURCES:
        return Event(source=row.sources[0], text=row.example, raw=row.example)
    return parse_line(row.example, "example", 1)


@pytest.mark.parametrize("row", TABLE.rows, ids=[r.id for r in TABLE.rows])
def test_example_matches_its_row_only(row) -> None:  # type: ignore[no-untyped-def]
    ev = example_event(row)
    got = TABLE.match(ev, in_traceback=row.in_traceback)
    assert got is not None, f"{row.id}: example not matched (parsed as {ev.source}: {ev.text!r})"
    assert got[0].id == row.id
    others = [r.id for r in TABLE.all_matches(ev, in_traceback=row.in_traceback) if r.id != row.id]
    assert set(others) <= set(row.overlaps), f"{row.id}: undocumented overlap with {others}"


def test_overlaps_name_real_rows_and_keywords_are_in_examples() -> None:
    for r in TABLE.rows:
        for o in r.overlaps:
            assert o in TABLE.by_id, f"{r.id}: overlap {o} is not a row"
        if r.keywords:
            text = example_event(r).text
            assert any(k in text for k in r.keywords), f"{r.id}: no keyword in its example"


def test_table_fields() -> None:
    ids = [r.id for r in TABLE.rows]
    assert len(ids) == len(set(ids)) >= 80
    for r in TABLE.rows:
        assert r.role in ROLES
        assert r.cause is None or r.cause in CAUSES
        assert r.meaning
        if r.role == "root":
            assert r.cause and r.advice
    # every cause a verdict can carry (except the fallback) has at least one root row
    root_causes = {r.cause for r in TABLE.rows if r.role == "root"}
    assert set(CAUSES) - {"unknown", *SUPERVISOR_CAUSES} <= root_causes
    # the facts the supervisor builds (xpu_serve.facts) have rows
    for rid in (
        "process-killed-by-signal",
        "process-exited",
        "hang-watchdog",
        "health-failed",
        "startup-stall",
    ):
        assert rid in TABLE.by_id


def test_facts_module_text_shapes_classify() -> None:
    from xpu_serve import facts

    cases = [
        (facts.process_exit("Worker_TP0", 7986, 0, None, "SIGSEGV"), "process-killed-by-signal"),
        (facts.process_exit("EngineCore", 7732, None, 1, None), "process-exited"),
        (facts.process_exit("APIServer", 7700, None, None, None), "process-exited"),
        (facts.hang(92, 1, 0, None), "hang-watchdog"),
        (facts.health_failed(3, "HTTP 503"), "health-failed"),
        (facts.startup_stall(600, "ccl-init", [1, 3]), "startup-stall"),
    ]
    for ev, rid in cases:
        got = TABLE.match(ev)
        assert got is not None and got[0].id == rid, ev.text


def test_derive_keyword() -> None:
    assert derive_keyword(r"Timedout job: seqno=\d+") == "Timedout job: seqno="
    assert derive_keyword(r"(?:a|b) died unexpectedly") == " died unexpectedly"
    assert derive_keyword(r"abc|def") is None
    assert derive_keyword(r"abc\.y?z") == "abc."
    assert derive_keyword(r"x\.y?z") is None  # runs shorter than 3 characters are no filter


@pytest.mark.parametrize(
    "doc, msg",
    [
        ({"nope": 1}, "expected a list"),
        ([{"id": "a", "pattern": "x", "role": "boss", "meaning": "m", "example": "x"}], "role must be"),
        ([{"id": "a", "pattern": "x", "role": "root", "meaning": "m", "example": "x"}], "needs a cause"),
        (
            [
                {
                    "id": "a",
                    "pattern": "(",
                    "role": "context",
                    "meaning": "m",
                    "example": "x",
                    "keywords": ["x"],
                }
            ],
            "bad pattern",
        ),
        ([{"id": "a", "pattern": "a|b", "role": "context", "meaning": "m", "example": "a"}], "cannot derive"),
        (
            [{"id": "a", "pattern": "xyz", "role": "root", "cause": "bogus", "meaning": "m", "example": "x"}],
            "unknown cause",
        ),
    ],
)
def test_bad_tables_are_rejected_with_the_row_named(doc, msg) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SignatureError, match=msg):
        parse_table(doc)


def test_every_packaged_row_compiles() -> None:
    """The packaged table compiles its patterns at first use: compile all of them here, so a bad
    row fails CI rather than the first diagnose that meets its keyword."""
    table = load_table()
    table.compile_all()
    assert all(isinstance(r.pattern.pattern, str) and r.pattern.pattern == r.regex for r in table.rows)


def test_bad_pattern_in_a_lazy_table_names_the_file_and_row() -> None:
    rows = [
        {"id": "good", "pattern": "fine line", "role": "context", "meaning": "m", "example": "fine line"},
        {
            "id": "broken",
            "pattern": "oops (",
            "role": "context",
            "meaning": "m",
            "example": "x",
            "keywords": ["oops"],
        },
    ]
    table = parse_table(rows, origin="data/signatures.yaml", compile_now=False)  # built: not compiled yet
    assert table.match(Event(source="text", text="a fine line", raw="a fine line"))[0].id == "good"  # type: ignore[index]
    with pytest.raises(SignatureError) as e:
        table.match(Event(source="text", text="oops here", raw="oops here"))
    assert str(e.value).startswith(
        "data/signatures.yaml: broken: bad pattern: missing ), unterminated subpattern"
    )
    assert "\n" not in str(e.value)
    with pytest.raises(SignatureError, match="^data/signatures.yaml: broken: bad pattern"):
        table.compile_all()
    with pytest.raises(SignatureError, match="^t.yaml: broken: bad pattern"):  # eager by default
        parse_table(rows, origin="t.yaml")


def test_cli_reports_a_bad_packaged_row_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A bad row reached by `diagnose`: one line naming the file and row, no traceback."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import xpu_serve

    src = Path(xpu_serve.__file__).resolve().parents[1]
    copy = tmp_path / "src"
    shutil.copytree(src / "xpu_serve", copy / "xpu_serve", ignore=shutil.ignore_patterns("__pycache__"))
    sig = copy / "xpu_serve" / "data" / "signatures.yaml"
    text = sig.read_text(encoding="utf-8")
    row = next(r for r in TABLE.rows if r.role == "root" and "{" not in r.regex and "(" in r.regex)
    start = text.index(f"id: {row.id}\n")
    at = text.index("pattern:", start)
    end = text.index("\n", at)
    sig.write_text(text[:at] + "pattern: '(unclosed " + row.id + "'" + text[end:], encoding="utf-8")
    log = tmp_path / "x.log"
    log.write_text(row.example + "\n", encoding="utf-8")
    r = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", str(log)],
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1, r.stderr  # exitcodes.FAILURE
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"data/signatures.yaml: {row.id}: bad pattern" in lines[0]


# --- rows added from public reports (tests/fixtures/reports) ------------------------------------


@pytest.mark.parametrize(
    "line, row, signal",
    [
        # bash's job report, English and as glibc's strsignal translations print it in other locales
        (
            "./run.sh: line 12: 40211 Segmentation fault      (core dumped) python -m vllm.entrypoints",
            "shell-job-signal",
            "SIGSEGV",
        ),
        ("Segmentation fault (core dumped)", "shell-job-signal", "SIGSEGV"),
        ("Speicherzugriffsfehler (Speicherabzug geschrieben)", "shell-job-signal", "SIGSEGV"),
        ("Erreur de segmentation (core dumped)", "shell-job-signal", "SIGSEGV"),
        ("段错误 (核心已转储)", "shell-job-signal", "SIGSEGV"),
        ("Abgebrochen (Speicherabzug geschrieben)", "shell-job-signal", "SIGABRT"),
        ("[1]+  Killed                  vllm serve /models/x", "shell-job-signal", "SIGKILL"),
        ("Getötet", "shell-job-signal", "SIGKILL"),
        # a launcher's exit status in the shell's 128+N form (docker compose, a container platform)
        ("vllm-1 exited with code 139", "exit-status-signal", "SIGSEGV"),
        ("0s0n9esxgd0u45[error]worker exited with exit code 136", "exit-status-signal", "SIGFPE"),
        ("vllm-server terminated with exit status 134", "exit-status-signal", "SIGABRT"),
        # systemd's unit report (the journal's pid is systemd's own)
        (
            "Nov 30 08:31:02 gpu-host systemd[1]: vllm.service: Main process exited, code=dumped, status=11/SEGV",
            "systemd-exit-signal",
            "SIGSEGV",
        ),
        ("vllm.service: Main process exited, code=killed, status=9/KILL", "systemd-exit-signal", "SIGKILL"),
        # gdb's stop report (mesnico/TERN#5) and its report of a core file (mjiUST/SurfaceNet#5)
        ('Thread 1 "python3" received signal SIGSEGV, Segmentation fault.', "gdb-signal-received", "SIGSEGV"),
        ("Program terminated with signal SIGSEGV, Segmentation fault.", "gdb-signal-received", "SIGSEGV"),
        ("Program received signal SIGABRT, Aborted.", "gdb-signal-received", "SIGABRT"),
        # the same reports nested in a markdown list item, every line indented (ROCm/rocm-systems#8517)
        ("  Program terminated with signal SIGSEGV, Segmentation fault.", "gdb-signal-received", "SIGSEGV"),
        ('    Thread 1 "clinfo" received signal SIGSEGV, Segmentation fault.', "gdb-signal-received", "SIGSEGV"),
        # abseil/glog failure handler (Ray workers) and UCX's error handler
        ("*** SIGSEGV received at time=1722289279 on cpu 61 ***", "failure-signal-handler", "SIGSEGV"),
        (
            "[host:285  :0:285] Caught signal 11 (Segmentation fault: address not mapped to object at address (nil))",
            "ucx-caught-signal",
            "SIGSEGV",
        ),
    ],
)
def test_crash_reports_in_other_shapes(line: str, row: str, signal: str) -> None:
    from xpu_serve.diagnosis import death_signal

    ev = parse_line(line)
    got = TABLE.match(ev, in_traceback=False)
    assert got is not None and got[0].id == row, line
    for k, v in got[1].groupdict().items():
        if v is not None:
            ev.extra[k] = v
    assert death_signal(ev) == signal


@pytest.mark.parametrize(
    "line",
    [
        "Killed process 7986 (python3)",  # a kernel message, not the shell's
        "Segmentation fault from GPU at 0xff00000688c74000, ctx_id: 1 (CCS)",  # the compute runtime's page fault
        "INFO 01-01 00:00:00 [a.py:1] Aborted request chatcmpl-1.",
        "the job was Killed by the user",
    ],
)
def test_shell_job_signal_needs_the_shell_shape(line: str) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert got is None or got[0].id != "shell-job-signal", line


def test_cuda_runtime_oom_wordings_are_device_oom() -> None:
    for line in (
        "torch.AcceleratorError: CUDA error: out of memory",
        "RuntimeError: CUDA error: out of memory",
        "Cuda failure 'out of memory'",
    ):
        got = TABLE.match(parse_line(line), in_traceback=False)
        assert got is not None and got[0].cause == "device-oom", line


@pytest.mark.parametrize(
    "line, row",
    [
        # i915 boot: benign GuC lines ("changed" must not read as "hang")
        (
            "[   18.430827] i915 0000:0d:00.0: [drm] GT0: GUC: ADS capture alloc size changed from 32768 to 36864",
            None,
        ),
        (
            "[   18.431927] i915 0000:0d:00.0: [drm] GT0: GuC firmware i915/dg2_guc_70.bin version 70.20.0",
            None,
        ),
        (
            "[   18.432614] i915 0000:0d:00.0: [drm] GT0: GUC: load failed: status = 0x40000056, time = 0ms",
            "xe-guc-init-failure",
        ),
        # a GuC failure at run time stays the general row
        (
            "xe 0000:03:00.0: [drm] *ERROR* Tile0: GT0: GuC engine reset request failed on 0:0 because 0xffffffff",
            "xe-guc-failure",
        ),
        # xe refuses an old GuC (Lunar Lake, thesofproject/linux#5196)
        (
            "[    5.472025] kernel: xe 0000:00:02.0: [drm] *ERROR* GT0: Unsupported GuC v70.20.0! v70.29.2 or newer is required",
            "xe-guc-init-failure",
        ),
        # xe_gt_pagefault.c print_pagefault, quoted without a stamp (compute-runtime#944)
        ("xe 0000:04:00.0: [drm] Tile0: GT0: Faulted Address: 0x0000d55936bff000", "gpu-page-fault"),
        # kv_cache_utils._check_enough_kv_cache_memory, cut by a terminal wrap before "KV cache is needed"
        (
            "(EngineCore pid=316) ValueError: To serve at least one request with the model's max seq len (100000), (4.26 GiB KV cach",
            "kv-cache-too-small-for-len",
        ),
        # Intel MPI under oneCCL's ATL/MPI (uxlfoundation/oneCCL#106)
        (
            "Abort(2138767) on node 0 (rank 0 in comm 0): Fatal error in PMPI_Init: Unknown error class, error stack:",
            "mpi-init-abort",
        ),
        ("MPIDI_OFI_mpi_init_hook(1584): ", None),  # an empty frame of the MPI error stack is not evidence
    ],
)
def test_guc_pagefault_kv_and_mpi_shapes(line: str, row: str | None) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].id if got else None) == row, line


@pytest.mark.parametrize(
    "line",
    [
        "vllm-1 exited with code 143",  # SIGTERM: a stop (docker compose down), not a crash
        "vllm-1 exited with code 130",  # SIGINT (Ctrl-C)
        "vllm-1 exited with code 1",  # an ordinary error exit: the process's own lines say why
        "worker exited with exit code 0",
        "vllm-1 exited with code 1370",
        "vllm.service: Main process exited, code=killed, status=15/TERM",  # systemctl stop
        "vllm.service: Main process exited, code=exited, status=1/FAILURE",  # an error exit, no signal
    ],
)
def test_exit_status_signal_needs_a_crash_signal(line: str) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert got is None or got[0].id not in ("exit-status-signal", "systemd-exit-signal"), line


@pytest.mark.parametrize(
    ("line", "row"),
    [
        ("      Reason:       OOMKilled", "container-oom-killed"),  # kubectl describe pod
        ("    lastState: {terminated: {exitCode: 137, reason: OOMKilled}}", "container-oom-killed"),
        ('            "OOMKilled": true,', "container-oom-killed"),  # docker inspect
        ('            "OOMKilled": false,', None),
    ],
)
def test_container_oom_kill_reports(line: str, row: str | None) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].id if got else None) == row, line


@pytest.mark.parametrize(
    ("line", "row"),
    [
        # vLLM's weight-loading bars (model_loader/weight_utils.py) are start-up progress
        (
            "Loading safetensors checkpoint shards:  50% Completed | 8/16 [01:27<01:28, 11.02s/it]",
            "ms-load-shards",
        ),
        ("Loading pt checkpoint shards:  25% Completed | 1/4 [00:03<00:09,  3.10s/it]", "ms-load-shards"),
        ("Multi-thread loading shards:   0% Completed | 0/32 [00:00<?, ?it/s]", "ms-load-shards"),
        # torch.compile in the profile run that sizes the KV cache
        (
            "(VllmWorker rank=0 pid=299) INFO 04-18 18:08:20 [monitor.py:33] torch.compile takes 15.67 s in total",
            "ms-compile",
        ),
        (
            "(Worker_TP0 pid=160) INFO 05-20 20:36:19 [backends.py:1148] Dynamo bytecode transform time: 88.00 s",
            "ms-compile",
        ),
        # the API server's start-up handshake failed with or without an exit code
        (
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            "engine-core-proc-failed",
        ),
        ("Failed core proc(s): {'EngineCore_DP0': -9}", "engine-core-proc-failed"),
        # the source of that message (pytest lists it) is not the message
        ('                    f"Failed core proc(s): {finished}"', None),
    ],
)
def test_startup_progress_and_handshake_shapes(line: str, row: str | None) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].id if got else None) == row, line


@pytest.mark.parametrize(
    "line,row",
    [
        # torch_npu HCCL_CHECK_ERROR under a V1 worker prefix (vllm-project/vllm-ascend#2712)
        (
            "(VllmWorker rank=1 pid=7226) ERROR 09-03 03:02:37 [multiproc_executor.py:522] RuntimeError: create_config:build/"
            "CMakeFiles/torch_npu.dir/compiler_depend.ts:148 HCCL function error: hcclCommInitRootInfoConfig(numRanks, "
            "&rootInfo, rank, config, &(comm->hcclComm_)), error code is 1",
            "hccl-error",
        ),
        # PSM3's assert (uxlfoundation/oneCCL#109); its CMA warning before it is not evidence
        (
            "machine:rank1: Assertion failure at psm3/ptl_am/ptl.c:196: nbytes == req->req_data.recv_msglen",
            "psm-assertion",
        ),
        (
            "[1705415958.879795729] machine:rank1.cpu_allreduce_test: Reading from remote process' memory failed.",
            None,
        ),
        # MPICH 4's internal_* wrapper in the abort banner (kokkos/kokkos-comm#139)
        (
            "Abort(810170127) on node 1 (rank 1 in comm 0): Fatal error in internal_Recv: Other MPI error, error stack:",
            "mpi-init-abort",
        ),
        # Open MPI (NVIDIA/nccl-tests#295, microsoft/mscclpp#359)
        (
            "[node-b:825452] mtl_ofi_endpoint.h:49: *** The Open MPI OFI MTL is aborting the MPI job (via exit(3)).",
            "openmpi-transport-abort",
        ),
        ("    [host:106967] *** Process received signal ***", "openmpi-signal"),
        # Kunlun XCCL (baidu/vLLM-Kunlun#382)
        ("[XCCL][init.cpp:1227] host <redacted-private-ip> addr_window check failed", "kunlun-xccl-error"),
        # an xe devcoredump's text (intel/media-driver#1889)
        ("**** Xe Device Coredump ****", "xe-devcoredump-text"),
    ],
)
def test_collective_library_and_devcoredump_shapes(line: str, row: str | None) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].id if got else None) == row, line


_TVM_DUMP = "!!!!!!! Segfault encountered !!!!!!!\n"


@pytest.mark.parametrize(
    "frames,cause",
    [
        # the first frame after the dump is oneCCL's: the collective library crashed (vllm-project/vllm#52386)
        ("  ccl_comm::post_coll(...)\n  ccl_comm::allreduce_impl(...)\n", "collective-failure"),
        # libc's signal delivery frames are skipped; the next frame decides (Open MPI backtrace shape)
        (
            "/lib/x86_64-linux-gnu/libc.so.6(+0x43090)[0x7fbffe22e090]\n"
            "/usr/local/mscclpp/lib/libmscclpp.so.0(_ZN7mscclpp12TcpBootstrap14createUniqueIdEv+0xd)[0x7fbffea05fad]\n",
            "collective-failure",
        ),
        # a collective frame only further down (a caller) does not make the crash the library's
        ("  at::native::add_kernel(...)\n  ccl_comm::allreduce_impl(...)\n", "process-crash"),
        # a collective frame 50 lines after the dump belongs to something else
        ("\n" * 50 + "  ccl_comm::post_coll(...)\n", "process-crash"),
    ],
)
def test_native_crash_frames_name_the_crashing_library(tmp_path, frames: str, cause: str) -> None:  # type: ignore[no-untyped-def]
    from xpu_serve.diagnosis import diagnose_files

    p = tmp_path / "input.log"
    p.write_text(_TVM_DUMP + frames)
    assert diagnose_files([p]).cause == cause


@pytest.mark.parametrize(
    ("line", "row"),
    [
        # glibc assert/assert.c __assert_fail_base: "prog: file:line: function: Assertion `expr' failed."
        (
            "python3: ../src/graph.cpp:120: void build(int): Assertion `n > 0' failed.",
            "c-assertion-failed",
        ),
        # SYCL device assert (llama.cpp SYCL backend test log): the work-item ids before "Assertion"
        (
            "norm.cpp:11: void norm_f32(const float *, float *, const int, const float, const sycl::nd_item<3> &, "
            "sycl::float2 *, int): global id: [0,0,0], local id: [0,0,0] Assertion `nwarps % WARP_SIZE == 0` failed.",
            "c-assertion-failed",
        ),
        # a grep -n line number before a CUDA device assert (the line starts with "14633:/pytorch/...")
        (
            "14633:/pytorch/aten/src/ATen/native/cuda/IndexKernelUtils.cu:16: vectorized_gather_kernel: block: "
            '[27,0,0], thread: [185,0,0] Assertion `ind >=0 && ind < ind_dim_size && "index out of bounds"` failed.',
            "c-assertion-failed",
        ),
        ("AssertionError: Assertion `x' failed.", None),  # no file:line: head, not the C format
        # bash prints the pid of a non-interactive job right-aligned in 5 columns ("%5ld")
        (
            "start-vllm-service.sh: line 18:  1669 Illegal instruction     (core dumped) python -m vllm",
            "shell-job-signal",
        ),
        ("./run.sh: line 3:   912 Killed                  python3 serve.py", "shell-job-signal"),
        # PyTorch's CUDA error tail: the error name decides (out of memory is device-oom)
        (
            "Search for `cudaErrorMemoryAllocation' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
            "group__CUDART__TYPES.html for more information.",
            "torch-out-of-memory",
        ),
        (
            "(Worker_TP1 pid=15193) ERROR 05-08 19:06:38 [multiproc_executor.py:962] Search for "
            "`cudaErrorStreamCaptureUnsupported' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
            "group__CUDART__TYPES.html for more information.",
            "gpu-runtime-error-tail",
        ),
        # the heartbeat monitor's exit message of other ProcessGroup backends (XCCL for XPU)
        (
            "[rank0]:[E ProcessGroupXCCL.cpp:700] ProcessGroupXCCL's watchdog got stuck for 480 seconds without "
            "making progress in monitoring enqueued collectives.",
            "pg-heartbeat-monitor-timeout",
        ),
        # amdgpu's whole-GPU reset record (nv.c nv_asic_reset) and the amdgpu_device_mode1_reset record
        ("[  308.545396] amdgpu 0000:30:00.0: amdgpu: MODE2 reset", "amdgpu-asic-reset"),
        (
            "dec 11 01:44:14 host kernel: amdgpu 0000:0a:00.0: amdgpu: GPU smu mode1 reset",
            "amdgpu-asic-reset",
        ),
        # the watchdog on a group's first collective (start-up) and on a later one
        (
            "[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600059 milliseconds",
            "pg-watchdog-timeout-first-collective",
        ),
        (
            "[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600059 milliseconds",
            "pg-watchdog-timeout",
        ),
        # gloo's own timeout (unbound_buffer.cc) and the pair closure it signals to the other operations
        (
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete",
            "gloo-timeout",
        ),
        # a graph-capture bar without vLLM's prefix, and prose that names the capture without a bar
        (
            "Capturing CUDA graph shapes: 100%|██████████| 35/35 [00:12<00:00,  2.81it/s]",
            "ms-graph-capture-bar",
        ),
        ("Capturing CUDA graphs takes a while on this GPU", None),
        # a start-up frame on a traceback's stack; the serving loop's frame is not one
        (
            '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 83, in __init__',
            "ms-engine-init-frame",
        ),
        (
            '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 700, in run_busy_loop',
            None,
        ),
        # i915's fence timeout on a kernel context (timeline = the device, no comm[pid])
        (
            "[284083.655827] Fence expiration time out i915-0000:00:02.0:0000:00:02.0:554!",
            "i915-fence-expiration",
        ),
    ],
)
def test_native_assert_gpu_reset_and_error_tail_shapes(line: str, row: str | None) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].id if got else None) == row, line


def test_fence_expiration_names_the_process_of_the_request() -> None:
    ev = parse_line("kernel: Fence expiration time out i915-0000:03:00.0:server[5816]:14c!")
    got = TABLE.match(ev, in_traceback=False)
    assert got is not None and got[0].id == "i915-fence-expiration"
    assert got[1].group("comm", "pid", "device") == ("server", "5816", "0000:03:00.0")


@pytest.mark.parametrize(
    ("line", "row", "cause"),
    [
        # the Go runtime's fatal-signal report (runtime/signal_unix.go): ollama/ollama#11951 (macOS, a
        # cgo call into llama.cpp's grammar code), yalue/onnxruntime_go#95; a Go panic's signal line
        # (runtime/panic.go dopanic_m): fiatjaf/njump#65
        ("SIGSEGV: segmentation violation", "go-runtime-fatal-signal", "process-crash"),
        ("PC=0x10320b98c m=11 sigcode=2 addr=0xfffffffffffffff8", "go-runtime-fatal-signal", "process-crash"),
        ("PC=0x1a1090d0e m=0 sigcode=1 addr=0x20", "go-runtime-fatal-signal", "process-crash"),
        (
            "[signal SIGSEGV: segmentation violation code=0x1 addr=0x98 pc=0xe1d30f]",
            "go-runtime-fatal-signal",
            "process-crash",
        ),
        # a requested goroutine dump, and prose naming a signal, are not crashes
        ("SIGQUIT: quit", None, None),
        ("SIGSEGV: segmentation violation when I load the second model", None, None),
        # ggml's CUDA backend error report, HIP build (ggml-cuda.cu ggml_cuda_error): ggml-org/llama.cpp#22013
        ("ROCm error: invalid device function", "gpu-runtime-error", "process-exception"),
        ("ROCm error: out of memory", "torch-out-of-memory", "device-oom"),
        ("MUSA error: out of memory", "torch-out-of-memory", "device-oom"),
        # i915's guilty-context record (gt/intel_reset.c mark_guilty), from a dmesg posted to LKML
        # ("5.13 i915/PAT regression on Brasswell", Hans de Goede, 2021-05-12)
        (
            "[   58.341267] i915 0000:00:02.0: [drm] gnome-shell[632] context reset due to GPU hang",
            "i915-context-reset",
            "gpu-fault",
        ),
        # a Level Zero IPC-handle call and its error without oneCCL's prefix: the prose of
        # SergiioB/intel-arc-pro-b70-inference-cookbook#8 and the title of intel/llm-scaler#486; code
        # calling it is not an error
        (
            "All three vLLM variants crash identically (same `zeMemOpenIpcHandle: INVALID_ARGUMENT`, same call site)",
            "ze-ipc-handle-error",
            "collective-failure",
        ),
        (
            "Dual Arc Pro B70 TP=2 fails at oneCCL zeMemOpenIpcHandle (ZE_RESULT_ERROR_INVALID_ARGUMENT)",
            "ze-ipc-handle-error",
            "collective-failure",
        ),
        ("  return zeMemCloseIpcHandle(", None, None),
        # vLLM's start-up free-memory check (v1/worker/utils.py request_memory): vllm-project/vllm#20305
        # (no device in the message, 0.9.x), noonghunna/club-3090#4 (with the device)
        (
            "ValueError: Free memory on device (31.44/47.38 GiB) on startup is less than desired GPU memory "
            "utilization (0.95, 45.01 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
            "free-memory-below-utilization",
            "config-error",
        ),
    ],
)
def test_go_runtime_ggml_i915_and_startup_memory_shapes(
    line: str, row: str | None, cause: str | None
) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].id if got else None) == row, line
    assert (got[0].cause if got else None) == cause


def test_go_runtime_and_i915_rows_name_the_signal_and_the_process() -> None:
    from xpu_serve.diagnosis import death_signal

    for line, signal in (
        ("SIGBUS: bus error", "SIGBUS"),
        ("[signal SIGSEGV: segmentation violation code=0x1 addr=0x0 pc=0x75c397]", "SIGSEGV"),
    ):
        ev = parse_line(line)
        got = TABLE.match(ev, in_traceback=False)
        assert got is not None
        ev.extra.update({k: v for k, v in got[1].groupdict().items() if v is not None})
        assert death_signal(ev) == signal
    got = TABLE.match(
        parse_line("i915 0000:00:02.0: [drm] WorldOfTanks.ex[6444] context reset due to GPU hang")
    )
    assert got is not None and got[1].group("comm", "pid") == ("WorldOfTanks.ex", "6444")


@pytest.mark.parametrize(
    "line, row, cause",
    [
        # ggml's CUDA allocator (ggml-cuda.cu ggml_backend_cuda_buffer_type_alloc_buffer):
        # ggml-org/llama.cpp#20431 (model load), ikawrakow/ik_llama.cpp#749, #16725 (HIP build)
        (
            "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 144817.04 MiB on device 0: cudaMalloc failed: out of memory",
            "torch-out-of-memory",
            "device-oom",
        ),
        # vLLM's cumem allocator (csrc/cumem_allocator.cpp): vllm-project/vllm#12981, verl-project/verl#302
        ("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:56", "torch-out-of-memory", "device-oom"),
        ("CUDA Error: invalid argument at /workspace/csrc/cumem_allocator.cpp:57", None, None),
        # Ray's memory monitor: ray-project/ray#34695 (raylet.out), hiyouga/EasyR1#185, ray-project/ray#32730
        (
            "[2023-04-19 16:22:19,798 E 329 329] (raylet) node_manager.cc:3069: 13 Workers (tasks / actors) killed due "
            "to memory pressure (OOM), 0 Workers crashed due to other reasons at node (ID: 2875, IP: 10.0.10.135)",
            "ray-memory-monitor-kill",
            "host-oom",
        ),
        (
            "Memory on the node (IP: 172.31.237.1, ID: 2c0c) where the task (task ID: 76b2, name=pi4_sample, "
            "pid=664672, memory used=0.05GB) was running was 219.41GB / 230.40GB (0.952289), which exceeds the memory "
            "usage threshold of 0.95. Ray killed this worker (ID: ba84) because it was the most recently scheduled task",
            "ray-memory-monitor-kill",
            "host-oom",
        ),
        # Go os/exec's report of a child's signal: ollama/ollama#5629, #1019 (old log.Printf shape)
        (
            "Error: llama runner process has terminated: signal: segmentation fault (core dumped) ",
            "go-exec-child-signaled",
            "process-crash",
        ),
        ("2023/11/16 15:44:45 llama.go:430: signal: segmentation fault", "go-exec-child-signaled", "process-crash"),
        ('msg="llama runner terminated" error="signal: terminated"', None, None),
        ("the user reported signal: killed in the forum", None, None),
        # TGI's launcher: huggingface/text-generation-inference#2293 (signal 11), #2238 (signal 4)
        (
            "2024-07-24T08:20:07.046012Z ERROR shard-manager: text_generation_launcher: Shard process was signaled "
            "to shutdown with signal 11 rank=2",
            "tgi-shard-signaled",
            "process-crash",
        ),
        ("Shard process was signaled to shutdown with signal 15 rank=0", None, None),
        # TGI's shard waits: huggingface/text-generation-inference#2139, #757, #81 (pre-0.9 wording)
        (
            "2024-06-28T11:28:48.207074Z  INFO shard-manager: text_generation_launcher: Waiting for shard to be ready... rank=1",
            "tgi-shard-wait",
            "startup-hang",
        ),
        (
            "2023-02-20T16:45:24.091665Z  INFO text_generation_launcher: Waiting for shard 0 to be ready...",
            "tgi-shard-wait",
            "startup-hang",
        ),
    ],
)
def test_other_runtimes_oom_kill_signal_and_wait_shapes(line: str, row: str | None, cause: str | None) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].id if got else None) == row, line
    assert (got[0].cause if got else None) == cause


def test_launcher_signal_rows_name_the_signal_and_rank() -> None:
    from xpu_serve.diagnosis import death_signal

    for line, signal, rank in (
        ('error="llama runner process has terminated: signal: killed"', "SIGKILL", None),
        ("Shard process was signaled to shutdown with signal 4 rank=0", "SIGILL", "0"),
    ):
        ev = parse_line(line)
        got = TABLE.match(ev, in_traceback=False)
        assert got is not None
        gd = {k: v for k, v in got[1].groupdict().items() if v is not None}
        ev.extra.update(gd)
        assert death_signal(ev) == signal
        assert gd.get("rank") == rank


@pytest.mark.parametrize(
    "line, row, cause",
    [
        # ptxas under Triton: NixOS/nixpkgs#406675 (vLLM 0.9.1 EngineCore), ray-project/ray#53825,
        # triton-lang/triton#5017 (indented, in PTXASError's message)
        ("ERROR 07-01 14:28:21 [core.py:515] ptxas fatal   : Ptx assembly aborted due to errors", "ptxas-error", "process-exception"),
        (
            "(MapWorker(MapBatches(vLLMEngineStageUDF)) pid=12390, ip=10.0.118.90) ptxas /tmp/tmpbc993top.ptx, "
            "line 113; fatal   : Parsing error near '.': syntax error [repeated 8x across cluster]",
            "ptxas-error",
            "process-exception",
        ),
        (
            "  ptxas fatal   : (C7600) Register allocation failed with register count of '255'. Compile the program "
            "with a higher register target",
            "ptxas-error",
            "process-exception",
        ),
        ("RuntimeError: Internal Triton PTX codegen error: ", "ptxas-error", "process-exception"),
        (
            "  ptxas info    : (C7516) Potential Performance Loss: wgmma.mma_async instructions are serialized",
            None,
            None,
        ),
        # vLLM's model/platform check: vllm-project/vllm#11002 (Neuron), the registry's wording
        (
            "ValueError: Model architectures ['Qwen2VLForConditionalGeneration'] are not supported on Neuron for "
            "now. Supported architectures: ['LlamaForCausalLM', 'MistralForCausalLM'].",
            "model-arch-unsupported",
            "config-error",
        ),
        (
            "ValueError: Model architectures ['MllamaForConditionalGeneration'] are not supported for now. "
            "Supported architectures: dict_keys(['AquilaModel', 'AquilaForCausalLM'])",
            "model-arch-unsupported",
            "config-error",
        ),
        # vLLM 0.3.x's Neuron check (vllm-project/vllm#2569, model_executor/models/__init__.py)
        (
            "ValueError: Model architecture OPTForCausalLM is not supported by Neuron for now.",
            "model-arch-unsupported",
            "config-error",
        ),
        ("Model architectures ['Qwen2ForCausalLM'] failed to be inspected. Please check the logs.", None, None),
    ],
)
def test_ptxas_and_unsupported_architecture_shapes(line: str, row: str | None, cause: str | None) -> None:
    got = TABLE.match(parse_line(line), in_traceback=True)
    assert (got[0].id if got else None) == row, line
    assert (got[0].cause if got else None) == cause


@pytest.mark.parametrize(
    "line",
    [
        # vllm-project/vllm#5468 (a second user's paste), scikit-learn/scikit-learn#30525 (joblib's tracker)
        "KeyError: '/psm_2ec8dce9'",
        "KeyError: '/dev/shm/joblib_memmapping_folder_25931_690ca364e0034db595ab6b39bbdbf2dc_d3bdf56c88414474a818c379eb612c96'",
    ],
)
def test_resource_tracker_unregister_errors_are_context(line: str) -> None:
    got = TABLE.match(parse_line(line), in_traceback=True)
    assert got is not None and got[0].id == "resource-tracker-unregister-keyerror" and got[0].role == "context"
    other = TABLE.match(parse_line("KeyError: 'model.layers.0.weight'"), in_traceback=True)
    assert other is not None and other[0].id == "python-exception"


def test_v0_engine_loop_death_is_a_crash_of_the_engine() -> None:
    # MQLLMEngine._heartbeat's RuntimeError as the client logs it: vllm-project/vllm#9175 (CPU backend)
    for line in (
        "ERROR 10-09 02:13:55 client.py:250] RuntimeError('Engine loop has died')",
        "ERROR 10-09 02:13:55 client.py:250] RuntimeError: Engine loop has died",
    ):
        got = TABLE.match(parse_line(line), in_traceback=True)
        assert got is not None and (got[0].id, got[0].cause) == ("engine-loop-died-v0", "process-crash"), line


@pytest.mark.parametrize(
    "line, row, cause",
    [
        # ggml's abort: abetlen/llama-cpp-python#1694 (Windows path), ggml-org/llama.cpp#13461,
        # ggml-org/llama.cpp#3305 and rustformers/llm#417 (the pre-2024 GGML_ASSERT wording)
        (
            "D:\\a\\llama-cpp-python\\llama-cpp-python\\vendor\\llama.cpp\\ggml\\src\\ggml.c:6399: "
            "GGML_ASSERT(c->ne[0] >= n_dims / 2) failed",
            "ggml-abort",
            "process-exception",
        ),
        ("/app/src/llama-sampling.cpp:204: GGML_ASSERT(cur_p->size > 0) failed", "ggml-abort", "process-exception"),
        (
            "GGML_ASSERT: /opt/projects/llama.cpp/ggml.c:4796: view_src == NULL || data_size + view_offs <= "
            "ggml_nbytes(view_src)",
            "ggml-abort",
            "process-exception",
        ),
        ("GGML_ASSERT: llama-cpp/ggml.c:6270: ggml_nelements(a) == ne0*ne1*ne2", "ggml-abort", "process-exception"),
        ("gcc: fatal error: no input files", None, None),
        # V0's shared-memory broadcast wording: vllm-project/vllm#10661, #6614
        (
            "(VllmWorkerProcess pid=1634044) WARNING 11-26 13:07:36 shm_broadcast.py:391] No available block found "
            "in 60 second. ",
            "shm-broadcast-wait",
            "engine-hang",
        ),
        # the ProcessGroup watchdog's work reports: existing reports ray-nccl-watchdog-gather-mid-serving-no-esc
        # (torch 2.3) and nccl-watchdog-broadcast-pg-guid-multinode-v1 (torch 2.6 wording)
        (
            "(RayWorkerWrapper pid=4009) [rank1]:[E ProcessGroupNCCL.cpp:1537] [PG 1 Rank 1] Timeout at NCCL work: "
            "158046, last enqueued NCCL work: 158046, last completed NCCL work: 158045.",
            "pg-watchdog-work-report",
            None,
        ),
        (
            "[rank3]:[E822 16:31:16.137270546 ProcessGroupNCCL.cpp:2271] [PG ID 4 PG GUID 67 Rank 3]  failure "
            "detected by watchdog at work sequence id: 5729 PG status: last enqueued work: 6464, last completed work: 5728",
            "pg-watchdog-work-report",
            None,
        ),
    ],
)
def test_ggml_abort_v0_shm_wait_and_watchdog_report_shapes(line: str, row: str | None, cause: str | None) -> None:
    ev = parse_line(line)
    got = TABLE.match(ev, in_traceback=False)
    assert (got[0].id if got else None) == row, line
    assert (got[0].cause if got else None) == cause
    if row == "pg-watchdog-work-report":
        assert got is not None and (ev.rank is not None or got[1].group("rank") is not None)


@pytest.mark.parametrize(
    "line, row, group",
    [
        # NCCL's CUDACHECK with the error code (src/include/checks.h; NCCL's ncclCuMemAlloc in
        # include/alloc.h), as a public run log quotes it: the CUDA failure NCCL carries is the root
        (
            "include/alloc.h:320 (ncclCuMemAlloc) NCCL WARN Cuda failure 2 'out of memory'",
            "torch-out-of-memory",
            None,
        ),
        # Ray's memory monitor names the killed task's worker pid (ray-project/ray#30312)
        (
            "Memory on the node (IP: 172.17.0.2, ID: 8c5a1410013588601db2a6344fa1e07476f4378155083682818ebb94) "
            "where the task (task ID: 41617bc740ae9ca27726b37f8578c02f4cf1698d01000000, name=allocate_memory, "
            "pid=548, memory used=12.18GB) was running was 21.91GB / 33.28GB (0.658192), which exceeds the "
            "memory usage threshold of 0.65. Ray killed this worker (ID: 0f7695fad1848c8703eb36240efa3a80cb82ea43206919f4",
            "ray-memory-monitor-kill",
            ("pid", "548"),
        ),
        # PyTorch's dispatcher error inside vLLM's wrappers (vllm-project/vllm#13075, #15044 as a repr)
        (
            "NotImplementedError: Error in model execution (input dumped to /tmp/err_execute_model_input_20250211-"
            "140137.pkl): Could not run '_C::rms_norm' with arguments from the 'CUDA' backend. This could be because "
            "the operator doesn't exist for this backend, or was omitted during the selective/custom build process "
            "(if using custom build).",
            "torch-op-missing-for-backend",
            ("op", "_C::rms_norm"),
        ),
        (
            "ERROR 03-18 22:29:46 [engine.py:158] NotImplementedError(\"Could not run "
            "'vllm::apply_w8a8_block_fp8_linear' with arguments from the 'CPU' backend. This could be because the "
            "operator doesn't exist for this backend",
            "torch-op-missing-for-backend",
            ("backend", "CPU"),
        ),
        # Ray compiled graph's channel timeout (ray/exceptions.py RayChannelTimeoutError), as raised
        (
            "ray.exceptions.RayChannelTimeoutError: System error: If the execution is expected to take a long time, "
            "increase RAY_CGRAPH_get_timeout which is currently 10 seconds. Otherwise, this may indicate that the "
            "execution is hanging.",
            "ray-cgraph-channel-timeout",
            None,
        ),
        # ... but prose naming it is not the exception line (vllm-project/vllm#15102's first line)
        (
            "Then I got the RayChannelTimeoutError in Ray module within the call `execute_model` to run ray dag.",
            None,
            None,
        ),
    ],
)
def test_quoted_cuda_oom_ray_kill_dispatcher_and_cgraph_timeout_shapes(
    line: str, row: str | None, group: tuple[str, str] | None
) -> None:
    got = TABLE.match(parse_line(line), in_traceback=False)
    assert (got[0].id if got else None) == row, line
    if group is not None:
        assert got is not None and got[1].group(group[0]) == group[1]
