"""Line shapes recognised per line (events.parse_line, events.parse_kernel_record)."""

from __future__ import annotations

import json
import os
import random

import pytest

from xpu_serve.events import parse_kernel_record, parse_line, split_process_prefix


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
