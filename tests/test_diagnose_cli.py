"""`xpu-serve diagnose` as a real subprocess on any input, the human report, the live Analyzer
API (facts and kernel records through the same pipeline), and the causal rules on scenarios
built from real report lines (vLLM, oneCCL, kernel, PyTorch, NVIDIA issue reports)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from xpu_serve import exitcodes, facts
from xpu_serve.diagnosis import Analyzer, Incident, diagnose_files
from xpu_serve.events import parse_kernel_record
from xpu_serve.report import format_ranks, render_text

CASES = Path(__file__).resolve().parent / "fixtures" / "cases"
BUNDLE = Path(__file__).resolve().parent / "fixtures" / "bundles" / "demo-tp4-worker0-segv"


def diagnose(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", *args],
        input=stdin.decode("latin-1") if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=120,
    )


def verdict(tmp_path: Path, text: str, name: str = "input.log") -> dict:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    out = diagnose("--json", str(p))
    got = json.loads(out.stdout)
    assert out.returncode == (exitcodes.NO_VERDICT if got["cause"] == "unknown" else exitcodes.OK), out.stderr
    return got


# ------------------------------------------------------------------------------------- any input
def test_empty_file_is_unknown_exit_no_verdict(tmp_path: Path) -> None:
    p = tmp_path / "empty.log"
    p.write_bytes(b"")
    out = diagnose("--json", str(p))
    assert out.returncode == exitcodes.NO_VERDICT == 6 and out.stderr == ""
    v = json.loads(out.stdout)
    assert v["cause"] == "unknown" and v["root"] is None and v["consequences"] == []


def test_binary_non_utf8_and_truncated_inputs(tmp_path: Path) -> None:
    b = tmp_path / "bin.dat"
    b.write_bytes(os.urandom(200_000) + b"\x00\xff\xfe" * 1000)
    t = tmp_path / "trunc.log"
    t.write_bytes(b"(EngineCore pid=9) ERROR 03-26 04:15:27 [m.py:273] Worker proc VllmWorker-1 died unexpec")
    n = tmp_path / "latin1.log"
    n.write_bytes("(Worker_TP0 pid=5) INFO 03-26 04:15:27 [x.py:1] caf\xe9 \xff\xfe\n".encode("latin-1"))
    for p in (b, t, n):
        out = diagnose("--json", str(p))
        assert out.returncode == exitcodes.NO_VERDICT, out.stderr
        assert "Traceback" not in out.stderr
        assert json.loads(out.stdout)["cause"] == "unknown"
    out = diagnose(str(b))  # human output too
    assert out.returncode == exitcodes.NO_VERDICT and out.stdout.startswith("VERDICT: unknown")


def test_unreadable_paths_exit_2_with_one_line(tmp_path: Path) -> None:
    out = diagnose("--json", str(tmp_path / "missing.log"))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "missing.log" in out.stderr
    out = diagnose(str(tmp_path))
    assert out.returncode == 2 and "is a directory" in out.stderr and out.stderr.count("\n") == 1
    if os.geteuid() != 0:
        p = tmp_path / "noperm.log"
        p.write_text("x")
        p.chmod(0)
        out = diagnose(str(p))
        assert out.returncode == 2 and out.stderr.count("\n") == 1
    out = diagnose()
    assert out.returncode == 2 and out.stderr.count("\n") == 1


def test_dmesg_option_and_stdin(tmp_path: Path) -> None:
    case = CASES / "qwen3-30b-libze-segfault"
    out = diagnose("--json", str(case / "vllm.log"), "--dmesg", str(case / "dmesg.txt"))
    v = json.loads(out.stdout)
    assert v["cause"] == "umd-segfault" and v["library"] == "libze_intel_gpu.so.1.14.37020"
    data = (case / "dmesg.txt").read_bytes() + (case / "vllm.log").read_bytes()
    out = diagnose("--json", "-", stdin=data)
    assert out.returncode == 0, out.stderr
    v = json.loads(out.stdout)
    assert v["cause"] == "umd-segfault" and v["root"]["rank"] == 0 and v["root"]["file"] == "<stdin>"


def _norm(out: subprocess.CompletedProcess[str], path: str) -> dict:
    """The JSON verdict with the input's path replaced, to compare runs on copies of one log."""
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.replace(json.dumps(path)[1:-1], "INPUT"))


def test_fifo_with_a_writer_process_is_read_once(tmp_path: Path) -> None:
    src = CASES / "qwen3-30b-worker0-died" / "vllm.log"
    want = _norm(diagnose("--json", str(src)), str(src))
    assert want["cause"] == "process-crash" and want["root"]["rank"] == 0
    fifo = tmp_path / "vllm.log"
    os.mkfifo(fifo)
    # the writer blocks in open() until diagnose opens the FIFO; a second open would find no writer
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import shutil,sys; shutil.copyfileobj(open(sys.argv[1],'rb'), open(sys.argv[2],'wb'))",
            str(src),
            str(fifo),
        ]
    )
    try:
        out = diagnose("--json", str(fifo))
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
        writer.wait()
    assert _norm(out, str(fifo)) == want


def test_devices_and_sockets_are_not_regular_files(tmp_path: Path) -> None:
    import socket

    for dev in ("/dev/zero", "/dev/null"):
        out = diagnose("--json", dev)  # /dev/zero used to be read forever
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == f"xpu-serve diagnose: {dev}: not a regular file\n"
    sock_path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        out = diagnose(str(sock_path))
    assert out.returncode == 2 and out.stderr == f"xpu-serve diagnose: {sock_path}: not a regular file\n"


def test_endless_line_without_newline_is_cut(tmp_path: Path) -> None:
    from xpu_serve.diagnosis import MAX_LINE, iter_file_lines

    p = tmp_path / "long.log"
    p.write_bytes(b"a" * (5 * MAX_LINE + 17) + b"\nnext line\n" + b"b" * (MAX_LINE + 1))
    got = list(iter_file_lines(p, block=4096))  # the long lines span many reads
    assert [len(x) for x in got] == [MAX_LINE, 9, MAX_LINE] and got[1] == "next line"
    # 48 MiB of one line through stdin, then a real log: the verdict is the log's, memory bounded
    src = CASES / "qwen3-30b-worker0-died" / "vllm.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "xpu_serve", "diagnose", "--json", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdin is not None
        for _ in range(48):
            proc.stdin.write(b"x" * (1 << 20))
        proc.stdin.write(b"\n" + src.read_bytes())
        proc.stdin.close()
        assert proc.stdout is not None and proc.stderr is not None
        stdout, stderr = proc.stdout.read(), proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, stderr
    v = json.loads(stdout)
    assert v["cause"] == "process-crash" and v["root"]["file"] == "<stdin>" and v["root"]["line"] == 108


def test_utf16_and_utf32_logs_with_bom_give_the_same_verdict(tmp_path: Path) -> None:
    src = CASES / "qwen3-30b-worker0-died" / "vllm.log"
    text = src.read_text(encoding="utf-8")
    want = _norm(diagnose("--json", str(src)), str(src))
    for enc, crlf in (("utf-16", True), ("utf-16-be", False), ("utf-32", False), ("utf-8-sig", True)):
        p = tmp_path / enc / "vllm.log"
        p.parent.mkdir()
        body = text.replace("\n", "\r\n") if crlf else text
        data = body.encode(enc)
        if enc == "utf-16-be":
            data = b"\xfe\xff" + data  # the BE codec writes no BOM itself
        p.write_bytes(data)
        assert _norm(diagnose("--json", str(p)), str(p)) == want, enc
    # through stdin too (PowerShell `Get-Content x | ...` style input)
    raw = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", "--json", "-"],
        input=text.encode("utf-16"),
        capture_output=True,
        timeout=120,
    )
    assert raw.returncode == 0, raw.stderr
    v = json.loads(raw.stdout)
    assert v["cause"] == want["cause"] and v["root"]["line"] == want["root"]["line"]


# ------------------------------------------------------------------------------------- report
def test_human_report_one_screen() -> None:
    case = CASES / "qwen3-30b-worker0-died"
    out = diagnose(str(case / "vllm.log"))
    assert out.returncode == 0
    text = out.stdout
    lines = text.splitlines()
    assert lines[0].startswith("VERDICT: process-crash")
    assert f"{case / 'vllm.log'}:107" in text  # root evidence as file:line
    # one event per rank's oneCCL teardown burst (its KVS, finalize and PMI lines), not per line
    ccl = [ln for ln in lines if ln.startswith("  oneCCL teardown (Broken pipe) on ranks 1-3 (3 events) ")]
    assert len(ccl) == 1 and ccl[0].endswith("vllm.log:115]"), text
    assert "C++ terminate (3 events)" in text and "shared-memory reads cancelled in EngineCore (1 event)" in text
    assert "TIMELINE:" in text and "NEXT:" in text
    assert len(lines) <= 50
    assert "\x1b[" not in text  # plain when piped


def test_report_for_hang_and_stall() -> None:
    inc = diagnose_files([CASES / "glm47-flash-engine-hang" / "vllm.log"])
    text = render_text(inc)
    assert (
        "HANG: last progress 04-14 23:00:33; detected at 04-14 23:32:27 by vLLM execute-model RPC timeout"
        in text
    )
    assert "31m54s" in text
    inc = diagnose_files([CASES / "qwen3-30b-startup-stall" / "vllm.log"])
    assert inc.startup is not None and inc.startup.missing_ranks == (1,)
    assert "ranks that did not reach ccl-init: 1" in render_text(inc)
    assert inc.root is not None and inc.root.rank == 1 and inc.root.pid == 24905


def test_format_ranks() -> None:
    assert format_ranks([3, 1, 2, 5, 7, 8]) == "1-3, 5, 7-8"
    assert format_ranks([0]) == "0"


# ------------------------------------------------------------------------------------- live API
def test_live_analyzer_with_facts_and_kernel_records() -> None:
    an = Analyzer()
    an.feed_line(
        "(Worker_TP0 pid=4242) INFO 11-30 08:30:44 [cpu_model_runner.py:68] Starting to load model x"
    )
    an.feed_line(
        "(Worker_TP1 pid=4243) INFO 11-30 08:30:44 [cpu_model_runner.py:68] Starting to load model x"
    )
    an.feed_line("(APIServer pid=4200) INFO:     Application startup complete.")
    an.add_event(facts.process_exit("Worker_TP0", 4242, 0, None, "SIGSEGV"))
    inc = an.incident()
    assert inc.cause == "process-crash" and inc.root is not None
    assert (inc.root.process, inc.root.rank, inc.root.pid, inc.root.source) == (
        "Worker_TP0",
        0,
        4242,
        "process",
    )
    rec = parse_kernel_record(
        "6,99,551424205,-;VLLM::Worker_TP[4242]: segfault at 0 ip 00007f ip 1 sp 2 error 4 in "
        "libze_intel_gpu.so.1.3.29735[7f0000+9d4000]"
    )
    assert rec is not None
    rec2 = parse_kernel_record(
        "6,99,551424205,-;VLLM::Worker_TP[4242]: segfault at 58619acc8 ip 0000762f1beff168 sp 00007ffd3b90f940 "
        "error 4 in libze_intel_gpu.so.1.3.29735[6ff168,762f1b800000+9d4000]"
    )
    assert rec2 is not None
    an.add_event(rec2)
    inc = an.incident()
    assert inc.cause == "umd-segfault" and inc.library == "libze_intel_gpu.so.1.3.29735"
    assert inc.root is not None and inc.root.rank == 0 and inc.root.pid == 4242
    assert any("matches the logged pid" in n for n in inc.notes)
    contract = inc.to_contract()
    json.dumps(contract)
    # the supervisor's exit fact of the crashing worker is evidence of the root, not a consequence
    assert "process-killed-by-signal" not in {c["signature"] for c in contract["consequences"]}
    assert [e["signature"] for e in contract["root"]["evidence"]] == ["process-killed-by-signal"]
    assert inc.summary.startswith(
        "Worker_TP0 (rank 0, pid 4242) was killed by SIGSEGV inside the GPU driver library"
    )
    assert not inc.summary.endswith(".")


def test_live_hang_and_startup_stall_facts() -> None:
    an = Analyzer()
    an.feed_line(
        "(APIServer pid=1) INFO 11-30 08:31:00 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 "
        "tokens/s, Avg generation throughput: 12.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs"
    )
    an.add_event(facts.hang(92, 1, 0, None, at=1_800_000_000.0))
    inc = an.incident()
    assert inc.cause == "engine-hang"
    assert inc.hang is not None and inc.hang.last_progress == "11-30 08:31:00"
    assert inc.hang.detected_by == "xpu-serve hang watchdog"
    an2 = Analyzer()
    an2.feed_line(
        "(Worker pid=11) INFO 03-26 07:01:59 [parallel_state.py:1395] world_size=2 rank=0 local_rank=0 "
        "distributed_init_method=tcp://127.0.0.1:1 backend=xccl"
    )
    an2.add_event(facts.startup_stall(600, "dist-init", [1]))
    inc2 = an2.incident()
    assert inc2.cause == "startup-hang"
    assert inc2.startup is not None and inc2.startup.missing_ranks == (1,)


def test_memory_stays_bounded() -> None:
    an = Analyzer()
    lines = [
        "2026:03:26-04:15:27: 7987:[1] |CCL_ERROR| internal_kvs_server.hpp:70 put: read/write error: Broken pipe",
        "(EngineCore pid=9) ERROR 03-26 04:15:27 [m.py:273] Worker proc VllmWorker-0 died unexpectedly",
        "(APIServer pid=2) INFO 04-14 22:34:43 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
        "Avg generation throughput: 47.0 tokens/s, Running: 2 reqs, Waiting: 0 reqs",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "ValueError: bad",
        "[ 1.0] xe 0000:0e:00.0: [drm] Tile0: GT0: Engine reset: engine_class=bcs, logical_mask: 0x1, guc_id=54",
    ]
    for i in range(60_000):
        an.feed_line(lines[i % len(lines)].replace("pid=9", f"pid={9 + i % 50}"), "big.log", i + 1)
    assert max(len(v) for v in an.roots.values()) <= 16
    assert len(an.groups) < 200
    inc = an.incident()
    assert inc.cause == "process-crash"
    # one rank's teardown line every 7 lines is one burst, one event; the kernel's engine resets
    # (no process) are an event each, counted exactly past every bound
    assert sum(c.count for c in inc.consequences if c.signature == "ccl-kvs-broken-pipe") == 1
    assert sum(c.count for c in inc.consequences if c.signature == "xe-engine-reset-copy") == sum(
        1 for i in range(60_000) if i % len(lines) == len(lines) - 1
    )


# ------------------------------------------------------------------------------------- causal rules
def test_oom_killer_outranks_the_death_report(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "(Worker_TP0 pid=7986) INFO 03-26 04:12:20 [gpu_model_runner.py:4481] Starting to load model /m...",
                "(Worker_TP1 pid=7987) INFO 03-26 04:12:20 [xpu.py:79] Using Flash Attention backend.",
                "(EngineCore pid=7732) ERROR 03-26 04:15:27 [multiproc_executor.py:273] Worker proc VllmWorker-0 died "
                "unexpectedly (exit code: -9), shutting down executor.",
                "[12034.550001] VLLM::Worker_TP invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0",
                "[12034.551120] Out of memory: Killed process 7986 (VLLM::Worker_TP) total-vm:98123456kB, anon-rss:40123456kB",
                "2026:03:26-04:15:27: 7987:[1] |CCL_ERROR| internal_kvs_server.hpp:70 put: read/write error: Broken pipe",
            ]
        ),
    )
    assert v["cause"] == "host-oom"
    assert (v["root"]["process"], v["root"]["rank"], v["root"]["pid"], v["root"]["source"]) == (
        "Worker_TP0",
        0,
        7986,
        "kernel",
    )
    assert 1 in {c["rank"] for c in v["consequences"]}


def test_nvidia_xid_outranks_cuda_errors(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "(VllmWorker rank=0 pid=3011) ERROR 10-02 11:00:01 [multiproc_executor.py:527] Traceback (most recent call last):",
                '(VllmWorker rank=0 pid=3011) ERROR 10-02 11:00:01 [multiproc_executor.py:527]   File "/v/worker.py", line 1, in x',
                "(VllmWorker rank=0 pid=3011) ERROR 10-02 11:00:01 [multiproc_executor.py:527] RuntimeError: CUDA error: an "
                "illegal memory access was encountered",
                "[ 9812.123456] NVRM: Xid (PCI:0000:3b:00): 79, pid=3011, name=python3, GPU has fallen off the bus.",
            ]
        ),
    )
    assert v["cause"] == "gpu-fault" and v["root"]["source"] == "kernel" and v["root"]["pid"] == 3011


def test_watchdog_abort_is_a_consequence_of_the_collective_timeout(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "INFO 07-01 13:44:40 metrics.py:341] Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 30.1 "
                "tokens/s, Running: 3 reqs, Swapped: 0 reqs, Pending: 0 reqs, GPU KV cache usage: 2.0%, CPU KV cache usage: 0.0%.",
                "ERROR 07-01 13:54:43 multiproc_worker_utils.py:120] Worker VllmWorkerProcess pid 1159 died, exit code: -6",
                "INFO 07-01 13:54:43 multiproc_worker_utils.py:123] Killing local vLLM worker processes",
                "[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, "
                "OpType=ALLREDUCE, NumelIn=134217728, NumelOut=134217728, Timeout(ms)=600000) ran for 600059 milliseconds before "
                "timing out.",
                "[rank0]:[E ProcessGroupNCCL.cpp:583] [Rank 0] To avoid data inconsistency, we are taking the entire process down.",
            ]
        ),
    )
    assert v["cause"] == "engine-hang"
    assert v["hang"]["last_progress"] == "07-01 13:44:40"
    assert v["hang"]["detected_by"].startswith("PyTorch ProcessGroup watchdog")


def test_coredump_stack_names_library_and_pid(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "(Worker_TP2 pid=8337) INFO 03-26 10:12:40 [xpu.py:79] Using Flash Attention backend.",
                "(EngineCore pid=9514) ERROR 03-26 10:12:46 [multiproc_executor.py:273] Worker proc VllmWorker-2 died "
                "unexpectedly, shutting down executor.",
                "Mar 26 10:12:47 b60host systemd-coredump[9911]: Process 8337 (VLLM::Worker_TP) of user 0 dumped core.",
                "                ",
                "                Stack trace of thread 8337:",
                "                #0  0x0000762f1beff168 n/a (/usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1.3.29735 + 0x6ff168)",
                "                #1  0x0000762f1bf01234 n/a (/usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1.3.29735 + 0x701234)",
            ]
        ),
    )
    assert v["cause"] == "umd-segfault" and v["library"] == "libze_intel_gpu.so.1.3.29735"
    assert (v["root"]["rank"], v["root"]["pid"]) == (2, 8337)


def test_own_exception_outranks_died_report_and_reraise_names_worker(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "(Worker_TP1 pid=501) ERROR 05-01 10:00:00 [multiproc_executor.py:671] WorkerProc hit an exception.",
                "(Worker_TP1 pid=501) ERROR 05-01 10:00:00 [multiproc_executor.py:671] Traceback (most recent call last):",
                '(Worker_TP1 pid=501) ERROR 05-01 10:00:00 [multiproc_executor.py:671]   File "/v/m.py", line 9, in f',
                "(Worker_TP1 pid=501) ERROR 05-01 10:00:00 [multiproc_executor.py:671]     assert x.shape == y.shape",
                "(Worker_TP1 pid=501) ERROR 05-01 10:00:00 [multiproc_executor.py:671] AssertionError: shape mismatch 4096 != 2048",
                "(EngineCore_DP0 pid=400) ERROR 05-01 10:00:02 [multiproc_executor.py:273] Worker proc VllmWorker-1 died "
                "unexpectedly, shutting down executor.",
                "(EngineCore_DP0 pid=400) ERROR 05-01 10:00:03 [core.py:710] EngineCore encountered a fatal error.",
                "(APIServer pid=300) ERROR 05-01 10:00:03 [async_llm.py:546] vllm.v1.engine.exceptions.EngineDeadError: "
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
            ]
        ),
    )
    assert v["cause"] == "process-exception"
    assert (v["root"]["process"], v["root"]["rank"], v["root"]["pid"]) == ("Worker_TP1", 1, 501)
    assert "AssertionError" in v["root"]["text"]


def test_config_error_address_in_use_with_docker_wrappers(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "2026-05-02T09:00:00.000000001Z (APIServer pid=1) INFO 05-02 09:00:00 [api_server.py:1] vLLM API server "
                "version 0.14.0",
                "2026-05-02T09:00:05.000000001Z (APIServer pid=1) ERROR:    [Errno 98] error while attempting to bind on "
                "address ('0.0.0.0', 8000): address already in use",
            ]
        ),
    )
    assert v["cause"] == "config-error" and v["root"]["process"] == "APIServer"


def test_device_lost_with_kernel_fault_is_gpu_fault(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "(EngineCore_DP0 pid=2390) ERROR 11-06 19:52:03 [core.py:718] RuntimeError: Native API failed. Native API "
                "returns: 20 (UR_RESULT_ERROR_DEVICE_LOST)",
                "[Thu Nov  6 19:52:01 2026] xe 0000:3d:00.0: [drm] Tile0: GT0: Timedout job: seqno=1523, lrc_seqno=1523, "
                "guc_id=9, flags=0x20 in python [2390]",
            ]
        ),
    )
    assert v["cause"] == "gpu-fault" and v["root"]["source"] == "kernel"
    assert any("device lost" in n for n in v["notes"])


def test_hang_without_detection_from_stats_and_waits(tmp_path: Path) -> None:
    stats = (
        "(APIServer pid=7) INFO 04-14 23:{m}:{s} [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
        "Avg generation throughput: {g} tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.8%"
    )
    v = verdict(
        tmp_path,
        "\n".join(
            [
                stats.format(m="00", s="23", g="26.6"),
                stats.format(m="00", s="33", g="19.7"),
                stats.format(m="00", s="44", g="0.0"),
                "(EngineCore_DP0 pid=8) INFO 04-14 23:01:33 [shm_broadcast.py:542] No available shared memory broadcast block "
                "found in 60 seconds. This typically happens when some processes are hanging.",
            ]
        ),
    )
    assert v["cause"] == "engine-hang"
    assert v["hang"]["last_progress"] == "04-14 23:00:33"


def test_end_during_startup(tmp_path: Path) -> None:
    start = [
        "(EngineCore pid=7732) INFO 03-26 04:12:10 [core.py:103] Initializing a V1 LLM engine (v0.1) with config: x",
        "(Worker_TP0 pid=7986) INFO 03-26 04:12:20 [gpu_model_runner.py:4481] Starting to load model /m...",
    ]
    v = verdict(tmp_path, "\n".join(start))
    assert v["cause"] == "startup-hang" and v["notes"]  # no ready line and no error: a stall, said so
    v = verdict(
        tmp_path,
        "\n".join(
            start + ["(EngineCore pid=7732) ERROR 03-26 04:15:30 [core.py:1141] EngineCore failed to start."]
        ),
        "b.log",
    )
    assert v["cause"] == "unknown" and v["notes"]  # it failed, but the reason is not in the input
    v = verdict(tmp_path, "just some text\nnothing to see\n", "c.log")
    assert v["cause"] == "unknown" and v["root"] is None


def test_big_case_files_are_streamed(tmp_path: Path) -> None:
    src = CASES / "qwen3-30b-worker0-died" / "vllm.log"
    big = tmp_path / "big.log"
    with open(big, "wb") as f:
        filler = b'(APIServer pid=1) INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK\n' * 20000
        f.write(filler)
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f)
        f.write(b"x" * 300_000)  # a huge unterminated last line
    v = json.loads(diagnose("--json", str(big)).stdout)
    assert v["cause"] == "process-crash" and v["root"]["line"] == 20000 + 107


def test_oneccl_ipc_exception_reraised_by_enginecore(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "(Worker_TP0 pid=700) INFO 08-04 10:00:00 [parallel_state.py:1395] world_size=2 rank=0 local_rank=0 "
                "distributed_init_method=tcp://127.0.0.1:1 backend=xccl",
                "(Worker_TP1 pid=701) INFO 08-04 10:00:00 [parallel_state.py:1395] world_size=2 rank=1 local_rank=1 "
                "distributed_init_method=tcp://127.0.0.1:1 backend=xccl",
                "(EngineCore_DP0 pid=600) ERROR 08-04 10:01:00 [core.py:936] RuntimeError: Worker failed with error 'oneCCL: "
                "ze_call.cpp:28 do_call: EXCEPTION: ze error at zeMemOpenIpcHandle, code: ZE_RESULT_ERROR_INVALID_ARGUMENT', "
                "please check the stack trace above for the root cause",
                "(EngineCore_DP0 pid=600) ERROR 08-04 10:01:02 [multiproc_executor.py:231] Worker proc VllmWorker-1 died "
                "unexpectedly, shutting down executor.",
            ]
        ),
    )
    assert v["cause"] == "collective-failure"
    assert (v["root"]["process"], v["root"]["rank"], v["root"]["pid"]) == ("Worker_TP1", 1, 701)


def test_traceback_without_header_and_is_fatal() -> None:
    an = Analyzer()
    for line in [
        '(Worker_TP1 pid=501) ERROR 05-01 10:00:00 [multiproc_executor.py:671]   File "/v/m.py", line 9, in f',
        "(Worker_TP1 pid=501) ERROR 05-01 10:00:00 [multiproc_executor.py:671]     x = y[3]",
        "(Worker_TP1 pid=501) ERROR 05-01 10:00:00 [multiproc_executor.py:671] KeyError: 3",
    ]:
        an.feed_line(line, "w.log")
    inc = an.incident()
    assert inc.cause == "process-exception" and inc.root is not None and inc.root.line == 3
    ev = an.feed_line(
        "(APIServer pid=2) ERROR 05-01 10:00:03 [async_llm.py:546] vllm.v1.engine.exceptions."
        "EngineDeadError: EngineCore encountered an issue.",
        "w.log",
    )
    assert ev is not None and an.is_fatal(ev)
    ev2 = an.feed_line(
        "(APIServer pid=2) INFO 05-01 10:00:03 [api_server.py:1] Starting vLLM API server 0", "w.log"
    )
    assert ev2 is not None and not an.is_fatal(ev2)


def test_unmatched_shell_glob_is_ignored(tmp_path: Path) -> None:
    case = CASES / "qwen3-30b-worker0-died"
    out = diagnose("--json", str(case / "*.log"), str(case / "*.txt"))  # as `DIR/*.log DIR/*.txt` in sh
    assert out.returncode == 0, out.stderr
    v = json.loads(out.stdout)
    assert v["cause"] == "process-crash" and any("*.txt" in n for n in v["notes"])
    out = diagnose(str(tmp_path / "*.nothing"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1


# ------------------------------------------------------------------------- bundles, many files
def test_bundle_directory_reads_vllm_log_and_kernel_log(tmp_path: Path) -> None:
    b = tmp_path / "20261130T100111Z-i1-process-crash"
    shutil.copytree(BUNDLE, b)
    whole = diagnose("--json", str(b))
    assert whole.returncode == 0 and whole.stderr == "", whole.stderr
    got = json.loads(whole.stdout)
    files = diagnose("--json", str(b / "logs" / "vllm.log"), str(b / "kernel.log"))
    ref = json.loads(files.stdout)
    live = [n for n in got["notes"] if "the supervisor also saw these exits" in n]
    got["notes"] = [n for n in got["notes"] if n not in live]
    assert got == ref  # the per-process copies are not read (only the live exits are noted)
    assert got["cause"] == "process-crash"
    assert (got["root"]["process"], got["root"]["rank"], got["root"]["pid"]) == ("Worker_TP0", 0, 9135)
    assert got["summary"] == (
        "Worker_TP0 (rank 0, pid 9135) was killed by SIGSEGV at 11-30 10:01:10; 17 events followed as consequences"
    )
    text = diagnose(str(b))
    assert text.returncode == 0 and text.stdout.startswith(
        "VERDICT: process-crash — Worker_TP0 (rank 0, pid 9135)"
    )
    # the bundle's kernel.log (dmesg --time-format iso) is read too
    (b / "kernel.log").write_text(
        "2026-11-30T10:01:10,120000+00:00 VLLM::Worker_TP[9135]: segfault at 58619acc8 ip 0000762f1beff168 "
        "sp 00007ffd3b90f940 error 4 in libze_intel_gpu.so.1.14.37020[6ff168,762f1b800000+9d4000]\n"
    )
    k = json.loads(diagnose("--json", str(b)).stdout)
    assert k["cause"] == "umd-segfault" and k["library"] == "libze_intel_gpu.so.1.14.37020"
    assert (k["root"]["process"], k["root"]["pid"]) == ("Worker_TP0", 9135)
    assert "fatal-python-error" in {e["signature"] for e in k["root"]["evidence"]}
    # any other directory: one line, exit 2
    other = tmp_path / "plain"
    (other / "logs").mkdir(parents=True)
    out = diagnose(str(other))
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1
    assert "is a directory" in out.stderr and "plain" in out.stderr


def test_bundle_inputs_rotations_oldest_first(tmp_path: Path) -> None:
    from xpu_serve.cli.diagnose import bundle_inputs

    b = tmp_path / "b"
    (b / "logs" / "2").mkdir(parents=True)
    (b / "logs" / "10").mkdir(parents=True)
    for rel in (
        "logs/2/vllm.log",
        "logs/2/vllm.log.1",
        "logs/2/vllm.log.2",
        "logs/2/Worker_TP0.log",
        "logs/10/vllm.log",
        "kernel.log",
        "incident.json",
    ):
        (b / rel).write_text("x\n")
    assert bundle_inputs(b) == [
        str(b / p)
        for p in (
            "logs/2/vllm.log.2",
            "logs/2/vllm.log.1",
            "logs/2/vllm.log",
            "logs/10/vllm.log",
            "kernel.log",
        )
    ]
    assert bundle_inputs(tmp_path) is None  # no incident.json/bundle.json and logs/
    # a bundle without vllm.log: its per-process logs (their repeats are counted once)
    c = tmp_path / "c"
    (c / "logs").mkdir(parents=True)
    (c / "bundle.json").write_text("{}")
    (c / "logs" / "Worker_TP0.log").write_text("x\n")
    assert bundle_inputs(c) == [str(c / "logs" / "Worker_TP0.log")]


def test_lines_repeated_across_files_count_once() -> None:
    """A bundle's logs/* (vllm.log plus per-process copies of its lines): same verdict and the
    same consequence counts as vllm.log alone; the worker's own faulthandler dump is not listed."""
    alone = diagnose_files([BUNDLE / "logs" / "vllm.log"])
    every = diagnose_files(sorted((BUNDLE / "logs").iterdir()))
    assert every.cause == alone.cause == "process-crash"
    assert every.root is not None and alone.root is not None
    assert (every.root.process, every.root.pid) == (alone.root.process, alone.root.pid)

    def counts(inc: Incident) -> dict[tuple[str, int | None], int]:
        out: dict[tuple[str, int | None], int] = {}
        for c in inc.consequences:
            k = (c.signature, c.rank)
            out[k] = out.get(k, 0) + c.count
        return out

    assert counts(every) == counts(alone)
    assert sum(counts(alone).values()) == 17  # events (the 36 lines of 17 consequence events)
    assert "fatal-python-error" not in {c.signature for c in every.consequences}
    # repeats inside one file are real repeats: two copies of a file with 3 teardown bursts (far
    # apart) count 3, not 6 or 1
    an = Analyzer()
    an.dedup = True
    line = "2026:11:30-10:01:10: 9136:[1] |CCL_ERROR| internal_kvs_server.hpp:70 put: read/write error: Broken pipe"
    for f in ("a.log", "b.log"):
        for i in range(3):
            an.feed_line(line, f, 100 * i + 1)
    inc = an.incident()
    assert sum(c.count for c in inc.consequences) == 3 and an.duplicates == 3


def test_live_summary_names_the_signal_and_keeps_the_dump_with_the_root() -> None:
    """The demo's live analysis (vllm.log as the supervisor reads it plus its process facts):
    one plain sentence without a final period, naming process, rank, pid and the signal."""
    sup = json.loads((BUNDLE / "incident.json").read_text())["supervisor"]
    procs = {p["name"]: p for p in sup["processes"]}
    at = float(sup["trigger"]["at"])
    an = Analyzer()
    lines = (BUNDLE / "logs" / "vllm.log").read_text().split("\n")
    for i, line in enumerate(lines, 1):
        an.feed_line(line, "vllm.log", i)
        if "died unexpectedly" in line:
            p = procs["Worker_TP0"]
            an.add_event(
                facts.process_exit(p["name"], p["pid"], p["rank"], p["exit_code"], p["signal"], at=at)
            )
    for k, p in enumerate(p for p in procs.values() if p["name"] != "Worker_TP0"):
        an.add_event(
            facts.process_exit(
                p["name"], p["pid"], p["rank"], p["exit_code"], p["signal"], at=at + 1 + k / 10
            )
        )
    inc = an.incident()
    assert inc.cause == "process-crash"
    assert re.fullmatch(
        r"Worker_TP0 \(rank 0, pid 9135\) was killed by SIGSEGV at \d\d-\d\d \d\d:\d\d:\d\d; 22 events followed as consequences",
        inc.summary,
    ), inc.summary
    sigs = {c.signature for c in inc.consequences}
    assert "fatal-python-error" not in sigs and ("process-killed-by-signal", 0) not in {
        (c.signature, c.rank) for c in inc.consequences
    }
    assert ("process-killed-by-signal", 1) in {(c.signature, c.rank) for c in inc.consequences}
    ev = {e.signature for e in inc.root_evidence}
    assert {"process-killed-by-signal", "worker-died-unexpectedly"} <= ev
    assert ".;" not in f"{inc.summary}; bundle /x"  # the supervisor appends "; bundle PATH"
    text = render_text(inc)
    assert "killed by SIGSEGV" in text and "\n  also vllm.log:" in text
    assert any(t.role == "evidence" for t in inc.timeline)


def test_report_wraps_long_text_instead_of_cutting() -> None:
    from xpu_serve.report import WIDTH

    note = "kernel pid 8335 (VLLM::Worker_TP) matches no pid in the vLLM log (another pid namespace, " * 3
    inc = Incident(
        cause="process-crash", summary="Worker_TP0 (rank 0) was killed by SIGSEGV " * 4, notes=[note]
    )
    text = render_text(inc)
    assert all(len(line) <= WIDTH for line in text.splitlines())
    body = text.split("NOT SETTLED:")[1]
    assert "…" not in body
    assert " ".join(body.split()).startswith("- " + " ".join(note.split()))
    assert " ".join(text.split("\n\n")[0].split()).endswith("was killed by SIGSEGV.")


def test_paste_starting_at_caret_marks_keeps_the_exception(tmp_path: Path) -> None:
    # the excerpt begins under a frame's source line (vllm#23814): the caret marks open the traceback,
    # so the exception line that follows is rank 0's own failure, not noise
    p = "(VllmWorker rank={r} pid={p}) ERROR 08-29 01:18:42 [multiproc_executor.py:546] {t}"
    v = verdict(
        tmp_path,
        "\n".join(
            [
                p.format(r=0, p=222, t="                              ^^^^^^^^^^^^^^^^^^^^^^^^^^"),
                p.format(r=0, p=222, t="RuntimeError: CUDA error: an illegal memory access was encountered"),
                p.format(r=0, p=222, t="For debugging consider passing CUDA_LAUNCH_BLOCKING=1"),
                p.format(r=3, p=225, t="WorkerProc hit an exception."),
                p.format(r=3, p=225, t="Traceback (most recent call last):"),
            ]
        ),
    )
    assert v["cause"] == "process-exception"
    assert (v["root"]["rank"], v["root"]["pid"], v["root"]["line"]) == (0, 222, 2)
    assert [c["rank"] for c in v["consequences"]] == [3]
    # caret-like lines outside a traceback paste are not an exception by themselves
    v = verdict(tmp_path, "^^^^^^^^\nall good here\n")
    assert v["cause"] == "unknown"


def test_indented_kernel_fault_outranks_user_space_device_lost(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "\n".join(
            [
                "  cycle 2, another 4GB                 UR_RESULT_ERROR_DEVICE_LOST",
                "",
                "  xe 0000:04:00.0: [drm] Tile0: GT0: Fault response: Unsuccessful -EINVAL",
                "  xe 0000:04:00.0: [drm] Tile0: GT0: Engine memory CAT error [18]: class=bcs, logical_mask: 0x1, guc_id=6",
            ]
        ),
    )
    assert v["cause"] == "gpu-fault" and v["root"]["source"] == "kernel"
    assert "device-lost" in [c["signature"] for c in v["consequences"]]


def test_kernel_fault_burst_root_is_the_first_fault_named_by_the_timed_out_job(tmp_path: Path) -> None:
    # xe reports the bad access first, then times the job out (naming the process): the fault is
    # the root, the timeout and the CAT error follow; the subject comes from the timeout record
    k = "[ 7{:03d}.000000] xe 0000:04:00.0: [drm] Tile0: GT0: {}"
    v = verdict(
        tmp_path,
        "\n".join(
            [
                k.format(100, "Fault response: Unsuccessful -EINVAL"),
                k.format(100, "Engine memory CAT error [18]: class=bcs, logical_mask: 0x1, guc_id=6"),
                k.format(101, "Timedout job: seqno=42, lrc_seqno=42, guc_id=6, flags=0x20 in python3 [4242]"),
                k.format(101, "Engine reset: engine_class=bcs, logical_mask: 0x1, guc_id=6"),
                # a later, unrelated burst on another card does not move the root
                "[ 9000.000000] xe 0000:05:00.0: [drm] Tile0: GT0: Fault response: Unsuccessful -EINVAL",
            ]
        ),
        name="dmesg.txt",
    )
    assert v["cause"] == "gpu-fault"
    assert (v["root"]["line"], v["root"]["pid"]) == (1, 4242)
    sigs = [c["signature"] for c in v["consequences"]]
    assert "xe-job-timeout" in sigs and "xe-cat-error" in sigs
    # without a fault record the timed-out job stays the root
    v = verdict(
        tmp_path,
        "\n".join(
            [
                k.format(101, "Timedout job: seqno=42, lrc_seqno=42, guc_id=6, flags=0x20 in python3 [4242]"),
                k.format(101, "Engine reset: engine_class=bcs, logical_mask: 0x1, guc_id=6"),
            ]
        ),
        name="dmesg.txt",
    )
    assert (v["root"]["line"], v["root"]["pid"]) == (1, 4242)


def test_guc_load_failure_outranks_the_wedged_device(tmp_path: Path) -> None:
    t = "[Tue Aug 26 16:02:58 2025] i915 0000:00:02.0: [drm] "
    v = verdict(
        tmp_path,
        "\n".join(
            [
                t + "GT0: GUC: ADS capture alloc size changed from 32768 to 36864",
                t
                + "GT0: GUC: load failed: status: Reset = 0, BootROM = 0x76, UKernel = 0x07, MIA = 0x00, Auth = 0x02",
                t + "*ERROR* GT0: GuC initialization failed -ENXIO",
                t + "*ERROR* GT0: Failed to initialize GPU, declaring it wedged!",
            ]
        ),
        name="dmesg.txt",
    )
    assert v["cause"] == "gpu-fault" and v["root"]["line"] == 2
    assert "gpu-wedged" in [c["signature"] for c in v["consequences"]]


def test_records_glued_on_one_line_are_each_read(tmp_path: Path) -> None:
    v = verdict(
        tmp_path,
        "2025:05:23-19:14:38:(172397) |CCL_WARN| could not get local_idx/count from environment variables, "
        "trying to get them from ATL2025:05:23-19:14:38:(172401) |CCL_ERROR| atl_ofi.cpp:243 init: can't find "
        "suitable provider\n",
    )
    assert v["cause"] == "collective-failure" and v["root"]["pid"] == 172401
    v = verdict(
        tmp_path,
        "(EngineCore pid=1) INFO 01-01 00:00:00 [a.py:1] loading(Worker_TP1 pid=3) ERROR 01-01 00:00:01 "
        "[b.py:2] RuntimeError: XPU out of memory. Tried to allocate 2.00 GiB\n",
    )
    assert v["cause"] == "device-oom" and (v["root"]["process"], v["root"]["pid"]) == ("Worker_TP1", 3)


def test_consequence_lines_keep_their_line_number_under_a_long_path(tmp_path: Path) -> None:
    """A bundle's long path (runtime/…/bundles/ID/logs/vllm.log) is shortened from the left in
    WHAT FOLLOWED, never cut before the line number that is the point of the reference."""
    deep = tmp_path / ("runtime-" + "x" * 40) / "bundles" / ("20261130T143443Z-i1-" + "y" * 30) / "logs"
    deep.mkdir(parents=True)
    shutil.copy(CASES / "qwen3-30b-worker0-died" / "vllm.log", deep / "vllm.log")
    out = diagnose(str(deep / "vllm.log"))
    assert out.returncode == 0, out.stderr
    block = out.stdout.split("WHAT FOLLOWED")[1].split("\n\n")[0].splitlines()[1:]
    refs = [ln for ln in block if not ln.strip().startswith("...")]
    assert len(refs) >= 5, out.stdout
    for ln in refs:
        assert len(ln) <= 118, ln
        assert re.search(r"\[…/logs/vllm\.log:\d+\]$", ln), ln


def test_bundle_diagnosis_names_the_exits_the_supervisor_saw_live() -> None:
    """Live, the supervisor's own process-exit facts were part of the verdict; a bundle's logs do
    not hold them, so `diagnose BUNDLE` says which they were (from incident.json) instead of
    silently counting fewer consequences."""
    out = diagnose("--json", str(BUNDLE))
    assert out.returncode == 0, out.stderr
    notes = json.loads(out.stdout)["notes"]
    live = [n for n in notes if "the supervisor also saw these exits" in n]
    assert len(live) == 1, notes
    assert "Worker_TP0 (pid 9135) killed by SIGSEGV" in live[0] and "EngineCore (pid 9128) exit code 1" in live[0]
    plain = diagnose("--json", str(BUNDLE / "logs" / "vllm.log"))
    assert not [n for n in json.loads(plain.stdout)["notes"] if "supervisor also saw" in n]
