"""Line shapes recognised per line (events.parse_line, events.parse_kernel_record)."""

from __future__ import annotations

import json
import os
import random

import pytest

from xpu_serve.events import parse_kernel_record, parse_line, split_glued_records, split_process_prefix


def test_split_process_prefix_nested() -> None:
    assert split_process_prefix("(APIServer pid=1) (EngineCore_DP0 pid=2) INFO x") == (
        "EngineCore_DP0",
        2,
        "INFO x",
    )
    assert split_process_prefix("no prefix") == (None, None, "no prefix")


@pytest.mark.parametrize(
    "line, source, process, pid, level, time_text, text",
    [
        (
            "(Worker_TP0 pid=7986) INFO 03-26 04:12:20 [xpu.py:57] Setting VLLM_KV_CACHE_LAYOUT",
            "vllm",
            "Worker_TP0",
            7986,
            "INFO",
            "03-26 04:12:20",
            "Setting VLLM_KV_CACHE_LAYOUT",
        ),
        (
            "(APIServer pid=1) (EngineCore_DP0 pid=2) ERROR 05-28 13:20:51 [core.py:936] boom",
            "vllm",
            "EngineCore_DP0",
            2,
            "ERROR",
            "05-28 13:20:51",
            "boom",
        ),
        (
            "INFO 03-26 04:12:03 [model.py:533] Resolved architecture: Qwen3MoeForCausalLM",
            "vllm",
            None,
            None,
            "INFO",
            "03-26 04:12:03",
            "Resolved architecture: Qwen3MoeForCausalLM",
        ),
        (
            "INFO 09-14 10:32:15 metrics.py:406] Avg prompt throughput: 0.0 tokens/s",  # vLLM 0.5 style
            "vllm",
            None,
            None,
            "INFO",
            "09-14 10:32:15",
            "Avg prompt throughput: 0.0 tokens/s",
        ),
        (
            "vllm-service  | (Worker_TP1 pid=192) INFO 09-04 19:19:07 [multiproc_executor.py:872] WorkerProc shutting down.",
            "vllm",
            "Worker_TP1",
            192,
            "INFO",
            "09-04 19:19:07",
            "WorkerProc shutting down.",
        ),
        (
            "2026-03-26T10:12:54.123456789Z (EngineCore pid=9) ERROR 03-26 10:12:54 [core.py:1] x",
            "vllm",
            "EngineCore",
            9,
            "ERROR",
            "03-26 10:12:54",
            "x",
        ),
        (
            "Mar 26 10:12:46 host vllm[99]: INFO 03-26 10:12:54 [core.py:1] hi",
            "vllm",
            None,
            99,
            "INFO",
            "03-26 10:12:54",
            "hi",
        ),
        (
            "(EngineCore pid=9514) ERROR 03-26 10:12:54 [v1/engine/core.py:1101] fatal.\r",
            "vllm",
            "EngineCore",
            9514,
            "ERROR",
            "03-26 10:12:54",
            "fatal.",
        ),
        (
            "(EngineCore pid=9514) ERROR 03-26 10:12:54 [v1/engine/core.py:1101] fatal.^M",
            "vllm",
            "EngineCore",
            9514,
            "ERROR",
            "03-26 10:12:54",
            "fatal.",
        ),
        (
            "Processed prompts: 0%| | 0/4 [00:00<?](EngineCore pid=7732) ERROR 03-26 04:15:27 [m.py:273] died",
            "vllm",
            "EngineCore",
            7732,
            "ERROR",
            "03-26 04:15:27",
            "died",
        ),
        (
            '(APIServer pid=2406) INFO:     10.0.0.2:1385 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
            "vllm",
            "APIServer",
            2406,
            "INFO",
            None,
            '10.0.0.2:1385 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        ),
    ],
)
def test_vllm_shapes(line, source, process, pid, level, time_text, text) -> None:  # type: ignore[no-untyped-def]
    ev = parse_line(line, "f.log", 7)
    assert (ev.source, ev.process, ev.pid, ev.level, ev.time_text, ev.text) == (
        source,
        process,
        pid,
        level,
        time_text,
        text,
    )
    assert (ev.file, ev.line) == ("f.log", 7)


@pytest.mark.parametrize(
    "line, pid, rank, level, time_text, text",
    [
        (
            "2026:03:26-04:15:27: 7987:[1] |CCL_ERROR| internal_kvs_server.hpp:70 put: read/write error: Broken pipe",
            7987,
            1,
            "CCL_ERROR",
            "2026:03:26-04:15:27",
            "internal_kvs_server.hpp:70 put: read/write error: Broken pipe",
        ),
        (
            "2026:09:04-19:19:08:(  192) |CCL_ERROR| internal_kvs.cpp:94 kvs_remove_name_key: client: remove_key",
            192,
            None,
            "CCL_ERROR",
            "2026:09:04-19:19:08",
            "internal_kvs.cpp:94 kvs_remove_name_key: client: remove_key",
        ),
        (
            "2026:03:26-07:02:01:24906 |CCL_WARN| value of CCL_ATL_TRANSPORT changed to be ofi (default:mpi)",
            24906,
            None,
            "CCL_WARN",
            "2026:03:26-07:02:01",
            "value of CCL_ATL_TRANSPORT changed to be ofi (default:mpi)",
        ),
        (
            "2026:03:26-04:12:17: 7989 |CCL_WARN| could not get local_idx/count from environment variables",
            7989,
            None,
            "CCL_WARN",
            "2026:03:26-04:12:17",
            "could not get local_idx/count from environment variables",
        ),
    ],
)
def test_oneccl_shapes(line, pid, rank, level, time_text, text) -> None:  # type: ignore[no-untyped-def]
    ev = parse_line(line)
    assert (ev.source, ev.pid, ev.rank, ev.level, ev.time_text, ev.text) == (
        "ccl",
        pid,
        rank,
        level,
        time_text,
        text,
    )
    assert ev.time is not None and ev.time.year == 2026


SEGV = (
    "VLLM::Worker_TP[8335]: segfault at 58619acc8 ip 0000762f1beff168 sp 00007ffd3b90f940 error 4 in "
    "libze_intel_gpu.so.1.14.37020[6ff168,762f1b800000+9d4000] likely on CPU 65 (core 1, socket 0)"
)


@pytest.mark.parametrize(
    "line, time_text, boot_s, seq, level",
    [
        (f"[  551.424205] {SEGV}", "551.424205", 551.424205, None, None),
        (f"6,1234,551424205,-;{SEGV}", "551.424205", 551.424205, 1234, "INFO"),
        (f"[Thu Mar 26 10:12:46 2026] {SEGV}", "Thu Mar 26 10:12:46 2026", None, None, None),
        (f"2026-03-26T10:12:46,123456+00:00 {SEGV}", "2026-03-26 10:12:46", None, None, None),
        (f"Mar 26 10:12:46 b60host kernel: {SEGV}", "Mar 26 10:12:46", None, None, None),
        (f"<6>{SEGV}", None, None, None, "INFO"),
        (SEGV, None, None, None, None),
    ],
)
def test_kernel_formats(line, time_text, boot_s, seq, level) -> None:  # type: ignore[no-untyped-def]
    for ev in (parse_kernel_record(line), parse_line(line, "dmesg.txt", 3)):
        assert ev is not None
        assert ev.source == "kernel"
        assert ev.text == SEGV
        assert (ev.process, ev.pid) == ("VLLM::Worker_TP", 8335)
        assert ev.time_text == time_text
        assert ev.extra.get("boot_s") == boot_s
        assert ev.seq == seq and ev.level == level


def test_kernel_record_json_and_continuations() -> None:
    js = json.dumps(
        {"__REALTIME_TIMESTAMP": "1774519966000000", "__MONOTONIC_TIMESTAMP": "551424205", "MESSAGE": SEGV}
    )
    ev = parse_kernel_record(js)
    assert ev is not None and ev.text == SEGV and ev.pid == 8335 and ev.extra["boot_s"] == 551.424205
    arr = '{"MESSAGE": [120, 101, 255]}'
    ev2 = parse_kernel_record(arr)
    assert ev2 is not None and ev2.text.startswith("xe")
    assert parse_kernel_record(" SUBSYSTEM=drm") is None
    assert parse_kernel_record("") is None
    xe = parse_kernel_record(
        "[ 552.836368] xe 0000:0e:00.0: [drm] Tile0: GT0: Engine reset: engine_class=bcs"
    )
    assert xe is not None and xe.extra["device"] == "0000:0e:00.0"
    oom = parse_kernel_record("[12034.5] Out of memory: Killed process 7986 (VLLM::Worker_TP) total-vm:1kB")
    assert oom is not None and (oom.pid, oom.process) == (7986, "VLLM::Worker_TP")
    xid = parse_kernel_record(
        "[9812.1] NVRM: Xid (PCI:0000:3b:00): 79, pid=4231, name=python3, GPU has fallen off the bus."
    )
    assert xid is not None and (xid.pid, xid.process, xid.extra["device"]) == (4231, "python3", "0000:3b:00")


def test_iso_kernel_vs_docker_stamp() -> None:
    k = parse_line("  2026-09-13T22:23:00 xe 0000:3d:00.0: [drm] Tile0: GT0: Engine reset: engine_class=ccs")
    assert k.source == "kernel" and k.time_text == "2026-09-13 22:23:00"
    d = parse_line("2026-09-13T22:23:00.000000001Z INFO 09-13 22:23:00 [x.py:1] hello")
    assert d.source == "vllm" and d.text == "hello"


def test_pytorch_and_nccl_lines() -> None:
    ev = parse_line(
        "[rank2]:[E1001 16:06:04.537131842 ProcessGroupNCCL.cpp:607] [Rank 2] Watchdog caught collective"
    )
    assert ev.rank == 2 and ev.text.startswith("[E1001")
    ev = parse_line("[80746] [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog")
    assert ev.rank == 0
    ev = parse_line("cuda0003:2949601:2949642 [0] NCCL WARN Cuda failure 'out of memory'")
    assert (ev.source, ev.pid, ev.level, ev.text) == (
        "ccl",
        2949601,
        "NCCL_WARN",
        "Cuda failure 'out of memory'",
    )


def test_garbage_never_raises() -> None:
    rnd = random.Random(5)
    for _ in range(3000):
        b = bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 120)))
        s = b.decode("utf-8", "replace")
        for prefix in ("", "(", "[", "2026:", "6,", "(Worker_TP0 pid=", "Mar 26 ", "2026-03-26T", "{"):
            ev = parse_line(prefix + s)
            assert isinstance(ev.text, str)
            parse_kernel_record(prefix + s)
    ev = parse_line(os.urandom(64).decode("latin-1"))
    assert isinstance(ev.text, str)


def test_bare_journal_kernel_tags() -> None:
    ev = parse_line(
        "22:39:31 kernel: i915 0000:00:02.0: [drm] GPU HANG: ecode 12:1:0020fffe, in xdg-desktop-por [1676]"
    )
    assert (ev.source, ev.time_text, ev.pid, ev.extra["device"]) == (
        "kernel",
        "22:39:31",
        1676,
        "0000:00:02.0",
    )
    ev = parse_line("kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001")
    assert (ev.source, ev.pid, ev.process) == ("kernel", 1818990, "python3")
    rec = parse_kernel_record(
        "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001"
    )
    assert rec is not None and rec.text.startswith("NVRM: Xid")


# --- log shapes from public reports (tests/fixtures/reports) ------------------------------------


def test_ray_ip_and_old_worker_prefixes() -> None:
    # Ray remote-node prefix (", ip=..."), with ANSI colours as Ray prints to a TTY
    ev = parse_line(
        "\x1b[36m(RayWorkerWrapper pid=880, ip=10.0.0.1)\x1b[0m ERROR 04-16 01:01:44 [worker_base.py:620] "
        "Error executing method 'init_device'."
    )
    assert (ev.source, ev.process, ev.pid, ev.level) == ("vllm", "RayWorkerWrapper", 880, "ERROR")
    assert ev.text.startswith("Error executing method")
    # any Ray actor name, with a torch rank tag after it
    ev = parse_line("(model_worker/12 pid=43581, ip=10.0.0.54) [rank12]:[E227 06:13:07.855 x.cpp:1] boom")
    assert (ev.process, ev.pid, ev.rank) == ("model_worker/12", 43581, 12)
    # vLLM 0.8-0.10 spellings name the TP rank: normalised to "..._TP<n>"
    assert split_process_prefix("(VllmWorker TP3 pid=405) INFO x")[:2] == ("VllmWorker_TP3", 405)
    assert split_process_prefix("(VllmWorker rank=7 pid=1030) Process SpawnProcess-1:8:") == (
        "VllmWorker_TP7",
        1030,
        "Process SpawnProcess-1:8:",
    )
    # a progress bar glued before an old-style prefix
    ev = parse_line(
        "Processed prompts:   0%|  | 0/1 [00:00<?, ?it/s](VllmWorker rank=1 pid=2) ERROR 03-26 03:34:57 [a.py:9] x"
    )
    assert (ev.process, ev.pid, ev.text) == ("VllmWorker_TP1", 2, "x")


def test_github_markdown_wrappers() -> None:
    # quote marks ("> ", nested) around a pasted line
    ev = parse_line('> > (EngineCore_DP0 pid=2390)   File "x.py", line 3, in f')
    assert (ev.process, ev.pid, ev.text) == ("EngineCore_DP0", 2390, '  File "x.py", line 3, in f')
    ev = parse_line(
        "> RuntimeError: oneCCL: ze_call.cpp:28 do_call: EXCEPTION: ze error at zeMemOpenIpcHandle"
    )
    assert ev.text.startswith("RuntimeError: oneCCL")
    # a Python prompt is part of the log, not a quote
    assert parse_line(">>> import torch").text == ">>> import torch"
    # a fence glued to the first and the last line, and a fence line with its language tag
    ev = parse_line(
        "```[Sun Mar 30 08:24:00 2025] Out of memory: Killed process 7899 (python) total-vm:1kB```"
    )
    assert (ev.source, ev.pid, ev.time_text) == ("kernel", 7899, "Sun Mar 30 08:24:00 2025")
    assert ev.text.endswith("total-vm:1kB")
    assert parse_line("```text").text == ""


def test_oneccl_lines_without_stamp() -> None:
    for line, level, text in (
        (
            "CCL_ERROR| ze_handle_manager.cpp:42 mem_to_ipc_handle:",
            "CCL_ERROR",
            "ze_handle_manager.cpp:42 mem_to_ipc_handle:",
        ),
        (
            "|CCL_WARN| value of CCL_ATL_TRANSPORT changed to be ofi",
            "CCL_WARN",
            "value of CCL_ATL_TRANSPORT changed to be ofi",
        ),
        (
            "CCL_WARN comm_dev_uuids is not sub-vector of node_dev_uuids",
            "CCL_WARN",
            "comm_dev_uuids is not sub-vector of node_dev_uuids",
        ),
    ):
        ev = parse_line(line)
        assert (ev.source, ev.level, ev.text) == ("ccl", level, text)
    # an environment dump is not a oneCCL log line
    assert parse_line("CCL_WORKER_COUNT=2").source == "text"


def test_non_english_journal_months() -> None:
    # journalctl prints strftime's %b in the host's locale
    for stamp in ("Mär 26 04:12:20", "févr. 26 04:12:20", "mars  6 04:12:20", "ene 26 04:12:20"):
        ev = parse_line(f"{stamp} host kernel: Out of memory: Killed process 7986 (VLLM::Worker_TP)")
        assert (ev.source, ev.pid, ev.time_text) == ("kernel", 7986, stamp), stamp
        rec = parse_kernel_record(
            f"{stamp} host kernel: Out of memory: Killed process 7986 (VLLM::Worker_TP)"
        )
        assert rec is not None and rec.pid == 7986
    # dmesg -T in a German locale
    ev = parse_line(
        "[Do Mär 26 10:12:46 2026] VLLM::Worker_TP[8335]: segfault at 5 ip 0000762f1beff168 sp 00007ffd3b90f940 "
        "error 4 in libze_intel_gpu.so.1[6ff168,762f1b800000+9d4000]"
    )
    assert (ev.source, ev.pid) == ("kernel", 8335)
    # a vLLM line is not mistaken for a syslog stamp
    assert parse_line("INFO 03-15 17:24:17 [pynccl.py:69] vLLM is using nccl==2.25.1").source == "vllm"


def test_journal_lines_whose_host_the_poster_cut_out() -> None:
    # a journalctl excerpt posted without the host column (a user's ollama log, quoted in a public
    # ChatGPT-export note: "Aug 09 17:25:55 ollama[2540]: decode: ...")
    ev = parse_line("Aug 09 17:25:55 ollama[2540]: decode: cannot decode batches with this context (use llama_encode() instead)")
    assert (ev.pid, ev.time_text) == (2540, "Aug 09 17:25:55")
    assert ev.text == "decode: cannot decode batches with this context (use llama_encode() instead)"
    # with the host the same; without a "[pid]" tag a word after the stamp is not taken as one
    ev = parse_line("Aug 13 16:58:56 host1 ollama[3010374]: ROCm error: out of memory")
    assert (ev.pid, ev.text) == (3010374, "ROCm error: out of memory")
    assert parse_line("Jun 18 22:16:41 note: hello").text == "Jun 18 22:16:41 note: hello"
    assert parse_line("Jun 18 22:16:41 kernel: amdgpu 0000:03:00.0: x").source == "kernel"


def test_short_iso_journal_and_compose_timestamps() -> None:
    # journalctl -o short-iso: ISO stamp, host, "kernel:"
    for stamp in ("2026-03-26T04:12:20.123456+01:00", "2026-03-26T04:12:20+0100"):
        ev = parse_line(f"{stamp} host kernel: Out of memory: Killed process 7986 (VLLM::Worker_TP)")
        assert (ev.source, ev.pid, ev.text[:13]) == ("kernel", 7986, "Out of memory"), stamp
    # docker compose logs -t: the stamp comes after the service prefix
    ev = parse_line("vllm-1  | 2026-04-16T12:49:28.263781156Z (EngineCore_DP0 pid=568) RuntimeError: boom")
    assert (ev.process, ev.pid, ev.time_text, ev.text) == (
        "EngineCore_DP0",
        568,
        "2026-04-16 12:49:28",
        "RuntimeError: boom",
    )


def test_ray_data_nested_actor_name_and_spaced_stamp() -> None:
    line = (
        "2026-03-09 01:31:29.489217213 (MapWorker(MapBatches(vLLMEngineActor)) pid=1202, ip=10.0.0.118) "
        "(EngineCore_DP0 pid=32080) Traceback (most recent call last):"
    )
    ev = parse_line(line)
    assert (ev.process, ev.pid, ev.time_text, ev.text) == (
        "EngineCore_DP0",
        32080,
        "2026-03-09 01:31:29",
        "Traceback (most recent call last):",
    )
    assert split_process_prefix("(MapWorker(MapBatches(vLLMEngineActor)) pid=1202, ip=10.0.0.118) x") == (
        "MapWorker(MapBatches(vLLMEngineActor))",
        1202,
        "x",
    )
    # Python logging's own "YYYY-MM-DD HH:MM:SS,mmm - LEVEL -" lines are not a wrapper (nor a kernel record)
    ev = parse_line("2024-09-02 16:44:34,970 - INFO - Converting the current model to sym_int4 format......")
    assert ev.source == "text" and ev.text.startswith("2024-09-02 16:44:34,970")


def test_non_english_dmesg_T_and_cjk_months_give_times() -> None:
    # dmesg -T and journalctl in ja_JP / zh_CN / fr_FR / de_DE: the record is found and its time kept
    for line, when in (
        ("[木  3月 26 10:12:46 2026] Out of memory: Killed process 7986 (python3)", (2026, 3, 26)),
        ("[四 3月 26 10:12:46 2026] Out of memory: Killed process 7986 (python3)", (2026, 3, 26)),
        ("[jeu. mars 26 10:12:46 2026] Out of memory: Killed process 7986 (python3)", (2026, 3, 26)),
        ("[Do Mär 26 10:12:46 2026] Out of memory: Killed process 7986 (python3)", (2026, 3, 26)),
        ("12月 26 04:12:20 host kernel: Out of memory: Killed process 7986 (python3)", (1900, 12, 26)),
        ("févr. 26 04:12:20 host kernel: Out of memory: Killed process 7986 (python3)", (1900, 2, 26)),
    ):
        ev = parse_line(line)
        assert (ev.source, ev.pid) == ("kernel", 7986), line
        assert ev.time is not None and (ev.time.year, ev.time.month, ev.time.day) == when, line


def test_indented_kernel_records_and_i915_error_state() -> None:
    # a hand-written report quotes xe records indented and without stamps (compute-runtime#944)
    ev = parse_line("  xe 0000:04:00.0: [drm] Tile0: GT0: Engine memory CAT error [18]: class=bcs, guc_id=6")
    assert ev.source == "kernel"
    assert ev.text.startswith("xe 0000:04:00.0: [drm]")
    # the continuation of a multi-line record stays text
    assert (
        parse_line("                           FaultType: 0, AccessType: 1, FaultLevel: 2").source == "text"
    )
    # an indented vLLM-ish or prose line is not a kernel record
    assert parse_line("  cycle 2, another 4GB                 UR_RESULT_ERROR_DEVICE_LOST").source == "text"
    # the i915 GPU error state (/sys/class/drm/card*/error) pasted on its own
    ev = parse_line("GPU HANG: ecode 12:1:85def5fb, in llama-bench [1538400]")
    assert ev.source == "kernel" and ev.pid == 1538400 and ev.process == "llama-bench"


def test_log_viewer_gutter_is_stripped() -> None:
    # vllm#6042: every line pasted from a log viewer carries "  | " before it
    ev = parse_line(
        "  | ERROR 07-01 13:54:43 multiproc_worker_utils.py:120] Worker VllmWorkerProcess pid 1159 died, exit code: -6"
    )
    assert (ev.source, ev.level, ev.time_text) == ("vllm", "ERROR", "07-01 13:54:43")
    assert ev.text.startswith("Worker VllmWorkerProcess pid 1159 died")
    ev = parse_line(
        "  | [rank0]:[E ProcessGroupNCCL.cpp:577] [Rank 0] Some NCCL operations have failed or timed out."
    )
    assert (ev.source, ev.rank) == ("vllm", 0)
    # a docker compose service prefix is still the compose shape, a markdown table row stays text
    assert parse_line("vllm-1  | (APIServer pid=1) INFO 01-01 00:00:00 [a.py:1] x").process == "APIServer"
    assert parse_line("| case | cause |").source == "text"


def test_tui_pane_border_is_stripped() -> None:
    # k9s's log view: "│ " before the line, padding to the pane width and "│" after it
    ev = parse_line("\u2502 Fatal Python error: Aborted" + " " * 40 + "\u2502")
    assert (ev.source, ev.text) == ("text", "Fatal Python error: Aborted")
    ev = parse_line("\u2502 (EngineCore_DP0 pid=25) ERROR 12-14 20:43:07 [core.py:1] RuntimeError: x   \u2502")
    assert (ev.process, ev.pid, ev.level, ev.text) == ("EngineCore_DP0", 25, "ERROR", "RuntimeError: x")
    # a box-drawing character inside a line is text
    assert parse_line("tree: a \u2502 b").text == "tree: a \u2502 b"


def test_a_relay_s_level_and_source_tags_before_the_vllm_prefix_are_stripped() -> None:
    # Lemonade server relays its child's stderr as "<stamp> [Error] (Process) <line>"
    ev = parse_line(
        "2026-05-08 11:47:02.257 [Error] (Process) (EngineCore pid=2651) torch.OutOfMemoryError: HIP out of memory."
    )
    assert (ev.source, ev.process, ev.pid) == ("vllm", "EngineCore", 2651)
    assert ev.text.startswith("torch.OutOfMemoryError")
    # a process prefix named inside prose is not a record's prefix
    assert parse_line("see (EngineCore pid=1) for details").source == "text"
    assert parse_line("the [note] says (EngineCore pid=1) died").source == "text"


def test_glued_records_are_split_and_wrappers_are_not() -> None:
    # IPEX#810: two oneCCL records on one pasted line
    a = "2025:05:23-19:14:38:(172397) |CCL_WARN| could not get local_idx/count, trying to get them from ATL"
    b = "2025:05:23-19:14:38:(172401) |CCL_ERROR| atl_ofi.cpp:243 init: can't find suitable provider"
    assert split_glued_records(a + b) == [a, b]
    c = "(EngineCore pid=1) INFO 01-01 00:00:00 [a.py:1] loading"
    d = "(Worker_TP1 pid=3) ERROR 01-01 00:00:01 [b.py:2] RuntimeError: XPU out of memory"
    assert split_glued_records(c + d) == [c, d]
    for one in (
        "(APIServer pid=1) (EngineCore_DP0 pid=2) ERROR 05-28 13:20:51 [core.py:936] boom",
        "(RayWorkerVllm pid=7746) 2024:08:21-10:24:26:( 7746) |CCL_WARN| fallback",
        "vllm-1  | (APIServer pid=1) INFO 01-01 00:00:00 [a.py:1] x",
        "\x1b[36m(RayWorkerVllm pid=5085)\x1b[0m INFO 01-01 00:00:00 [a.py:1] x",
        "2026-04-16T12:49:28.262466172Z (EngineCore_DP0 pid=568) ERROR 04-16 12:49:28 [core.py:936] x",
        "",
    ):
        assert split_glued_records(one) == [one]


def test_nccl_warn_with_source_location_and_timestamp() -> None:
    # NCCL 2.2x WARN lines carry "file.cc:line" before "NCCL", NCCL_DEBUG_TIMESTAMP_FORMAT a stamp
    ev = parse_line("[2025-08-11 10:45:36] server:2699411:2699411 [0] init.cc:416 NCCL WARN Cuda failure 'x'")
    assert (ev.source, ev.level, ev.pid, ev.text) == ("ccl", "NCCL_WARN", 2699411, "Cuda failure 'x'")
    assert ev.time_text == "2025-08-11 10:45:36" and ev.time is not None and ev.time.minute == 45
    ev = parse_line("server:2699411:2699411 [0] NCCL INFO init.cc:1397 -> 1")
    assert (ev.source, ev.level, ev.extra["device_index"]) == ("ccl", "NCCL_INFO", 0)



def test_nccl_line_under_a_process_prefix_keeps_its_level_and_pid() -> None:
    # Ray prints an actor's stdout as "(Actor pid=N) ..." and vLLM's multiproc executor its
    # workers' as "(VllmWorker rank=R pid=N) ..."; NCCL's record stays NCCL's under either
    ev = parse_line(
        "(WorkerDict pid=30332) [2025-09-18 23:23:41] host1:30332:30423 [0] misc/shmutils.cc:129 NCCL WARN "
        "Error while attaching to shared memory segment /dev/shm/nccl-x (size 0), error: No such file or directory (2)"
    )
    assert (ev.source, ev.level, ev.pid, ev.process) == ("ccl", "NCCL_WARN", 30332, "WorkerDict")
    assert ev.text.startswith("Error while attaching") and ev.time is not None and ev.time.minute == 23
    ev = parse_line("(VllmWorker rank=1 pid=4242) a100-8:4242:4242 [1] NCCL INFO transport/shm.cc:634 -> 2")
    assert (ev.source, ev.level, ev.pid, ev.extra["device_index"]) == ("ccl", "NCCL_INFO", 4242, 1)

def test_freebsd_drm_kmod_records_are_kernel() -> None:
    ev = parse_line("[drm ERROR :amdgpu_job_timedout] ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=3")
    assert ev.source == "kernel" and "ring gfx_0.0.0 timeout" in ev.text
    assert parse_line("drmn0: GPU reset begin!").source == "kernel"
    # quoted inside a vLLM record it stays the record's text
    ev = parse_line("(APIServer pid=1) INFO 04-16 12:49:28 [x.py:1] see [drm ERROR :amdgpu_job_timedout]")
    assert ev.source == "vllm" and ev.pid == 1


def test_docker_stamp_over_kernel_record_with_its_own_stamp_and_indentation() -> None:
    stamp = "2026-04-16T12:49:28.263781156Z "
    ev = parse_line(
        stamp
        + "  2026-09-13T22:23:00 xe 0000:3d:00.0: [drm] Tile0: GT0: Timedout job: seqno=1 in python [2693]"
    )
    assert ev.source == "kernel" and ev.time_text is not None and ev.time_text.startswith("2026-09-13")
    assert "Timedout job" in ev.text
    # the record's wrapped continuation keeps its indentation behind the docker stamp
    cont = parse_line(stamp + "  python [2693]")
    assert cont.source == "text" and cont.text.startswith("  ") and cont.time_text == "2026-04-16 12:49:28"
    # one space after the stamp is the wrapper's own: nothing is kept
    assert parse_line(stamp + "(APIServer pid=1) INFO 04-16 12:49:28 [x.py:1] ok").text == "ok"


def test_records_whose_line_ends_became_spaces_are_split() -> None:
    # vllm#21661: a paste that turned line ends into spaces (vLLM records without a process prefix)
    line = (
        ' ERROR 11-04 18:02:56 [v1/executor/multiproc_executor.py:597] raise RuntimeError(f"NCCL error") '
        "ERROR 11-04 18:02:56 [v1/executor/multiproc_executor.py:597] RuntimeError: NCCL error: unhandled cuda error"
    )
    parts = split_glued_records(line)
    assert [parse_line(p).text for p in parts] == [
        'raise RuntimeError(f"NCCL error")',
        "RuntimeError: NCCL error: unhandled cuda error",
    ]
    # one record (behind a wrapper) is never split
    for one in (
        "2026-04-16T12:49:28.263781156Z ERROR 11-04 18:02:56 [x.py:1] a message",
        "(APIServer pid=1) INFO 04-16 12:49:28 [x.py:1] ok 10 11",
    ):
        assert split_glued_records(one) == [one]


def test_traceback_records_glued_after_text_are_split_on_the_prefix_alone() -> None:
    # vast-ai/base-image#128: an API server traceback pasted with its line ends lost
    line = (
        '(APIServer pid=2960)     hf_raise_for_status(response)(APIServer pid=2960)   File "/x/_http.py", '
        "line 453, in hf_raise_for_status(APIServer pid=2960) huggingface_hub.errors.RepositoryNotFoundError: 401"
    )
    evs = [parse_line(p) for p in split_glued_records(line)]
    assert [e.pid for e in evs] == [2960, 2960, 2960]
    assert evs[2].text == "huggingface_hub.errors.RepositoryNotFoundError: 401"
    # a prefix after a space (a nested prefix, text that mentions one) is not a new record
    one = "(APIServer pid=1) (EngineCore_DP0 pid=2) ERROR 11-04 18:02:56 [core.py:1] x"
    assert split_glued_records(one) == [one]
    assert split_glued_records("started the engine (worker pid=5) ok") == [
        "started the engine (worker pid=5) ok"
    ]


def test_json_log_field_lines_carry_their_record() -> None:
    # Google Cloud Logging / journalctl -o json-pretty / docker json-file entries pasted one field per line
    ev = parse_line(
        '    "textPayload": "[195998.443208] node invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL)\\\\r\\\\n",'
    )
    assert ev.source == "kernel" and ev.text.startswith("node invoked oom-killer:")
    assert ev.extra.get("boot_s") == 195998.443208
    ev = parse_line('  "log": "(APIServer pid=7) ERROR 05-16 13:12:16 [core.py:1] boom\\n",')
    assert (ev.source, ev.pid, ev.text) == ("vllm", 7, "boom")
    # other fields and JSON that is not a log record stay text
    assert parse_line('    "severity": "INFO",').source == "text"
    assert parse_line('  "message": 42,').source == "text"


def test_oom_kill_records_of_older_kernels_name_the_victim() -> None:
    ev = parse_line(
        "Mar  2 17:35:10 server1 kernel: [2858609.598568] Killed process 11726, UID 498, (mysqld) total-vm:7823732kB"
    )
    assert (ev.source, ev.pid, ev.process) == ("kernel", 11726, "mysqld")
    ev = parse_line(
        "vllm-1  | > Nov 30 10:17:20 node01 kernel: Killed process 808340 (node), UID 1000, total-vm:621760kB"
    )
    assert (ev.source, ev.pid, ev.process) == ("kernel", 808340, "node")


def test_old_vllm_headers_glued_with_spaces_are_split() -> None:
    line = (
        "INFO 06-19 11:23:59 metrics.py:341] Avg prompt throughput: 1.0 tokens/s, Running: 8 reqs. "
        "ERROR 06-19 11:25:01 async_llm_engine.py:535] Engine iteration timed out. This should never happen! "
        "ERROR 06-19 11:25:01 async_llm_engine.py:52] Engine background task failed"
    )
    parts = split_glued_records(line)
    assert [parse_line(p).text for p in parts[1:]] == [
        "Engine iteration timed out. This should never happen!",
        "Engine background task failed",
    ]


@pytest.mark.parametrize(
    "line",
    [
        "░░ Subject: Unit process exited",
        "░░",
        "░░ The process' exit code is 'exited' and its exit status is 1.",
        # the "--" prefix of a non-UTF-8 locale or an older journalctl (ollama/ollama#9335)
        "-- Subject: Unit failed",
        "-- Defined-By: systemd",
        "-- ",
    ],
)
def test_journal_catalog_lines_are_empty(line: str) -> None:
    assert parse_line(line).text == ""


@pytest.mark.parametrize("line", ["-- engine rcs0 --", "-- The unit ollama.service has entered the 'failed' state"])
def test_dash_lines_that_are_not_catalog_fields_are_kept(line: str) -> None:
    assert parse_line(line).text == line


@pytest.mark.parametrize(
    "line, rank, text",
    [
        ("[2025-04-03 20:06:34 DP1 TP0] Watchdog timeout (self.watchdog_timeout=300)", 0,
         "Watchdog timeout (self.watchdog_timeout=300)"),
        ("[2025-08-02 19:24:30 TP3] self.cur_batch.batch_size()=109", 3, "self.cur_batch.batch_size()=109"),
        ("[2025-04-03 20:06:34 DP0 PP1 EP2] Load weight end.", None, "Load weight end."),
    ],
)
def test_sglang_rank_prefix_gives_time_and_tp_rank(line: str, rank: int | None, text: str) -> None:
    ev = parse_line(line)
    assert (ev.rank, ev.text) == (rank, text)
    assert ev.time is not None and ev.time.strftime("%Y-%m-%d %H:%M:%S") == line[1:20]


def test_sglang_prefix_without_ranks_stays_text() -> None:
    line = "[2025-06-22 16:14:00] Received sigquit from a child process. It usually means the child failed."
    assert parse_line(line).text == line


def test_sglang_prefix_over_a_torch_rank_record() -> None:
    ev = parse_line("[2025-04-03 20:06:34 TP1] [rank1]: RuntimeError: NCCL Error 2: unhandled system error")
    assert (ev.source, ev.rank, ev.text) == ("vllm", 1, "RuntimeError: NCCL Error 2: unhandled system error")


def test_kernel_message_quoted_whole_by_a_scanning_tool_is_kernel() -> None:
    # gpud's dmesg scan prints each hit as '[XID found] (<age>) "<kernel message>"'
    ev = parse_line(
        '[XID found] (54 minutes ago) "NVRM: Xid (PCI:0000:9b:00): 119, pid=4071838, name=python, '
        'Timeout after 45s of waiting for RPC response from GPU4 GSP! Expected function 76 (GSP_RM_CONTROL)."'
    )
    assert (ev.source, ev.pid) == ("kernel", 4071838) and ev.text.startswith("NVRM: Xid (PCI:0000:9b:00): 119")
    # quoted text that is not a kernel message, or two quotes, stay the line's own text
    assert parse_line('[check] (1 minute ago) "model loaded in 4.2s"').source == "text"
    assert parse_line('[scan] "NVRM: Xid (PCI:0000:9b:00): 13" and "x"').source == "text"


def test_ray_cpp_log_prefix_gives_pid_level_stamp_and_location() -> None:
    # Ray's C++ logger (raylet, core worker, a driver's stderr): "[stamp,ms L pid tid] file.cc:N: msg"
    ev = parse_line(
        "[2024-08-16 10:13:39,938 E 191503 196608] logging.cc:440: *** SIGABRT received at time=1723774419 on cpu 41 ***"
    )
    assert (ev.pid, ev.level, ev.code_location) == (191503, "ERROR", "logging.cc:440")
    assert ev.text.startswith("*** SIGABRT received") and ev.time is not None and ev.time.second == 39
    ev = parse_line("[2024-02-27 18:08:15,439 I 73667 73670] core_worker.cc:215: Constructing CoreWorker")
    assert (ev.pid, ev.level, ev.text) == (73667, "INFO", "Constructing CoreWorker")
