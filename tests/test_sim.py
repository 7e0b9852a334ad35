"""The simulator (xpu_serve.sim): fault-spec parsing, kernel record formats, and one healthy run
as a real process tree (titles, environment, HTTP, metrics, token flow, SIGTERM, leftovers)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from xpu_serve import cleanup
from xpu_serve.sim.faults import FaultSpecError, active, parse_faults
from xpu_serve.sim.harness import PREFIX_RE, SimRun
from xpu_serve.sim.kernel import (
    engine_reset_record,
    job_timeout_records,
    oom_records,
    segfault_records,
    write_records,
)

VLLM_LINE = re.compile(
    r"^\((?P<name>[\w.-]+) pid=\d+\) (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+\.py:\d+\] "
)


# -- fault specs -------------------------------------------------------------------------------
def test_parse_faults_fills_defaults_and_keeps_order() -> None:
    faults = parse_faults(
        " worker-segv rank=2 after=30 kernel=/tmp/k.log ; worker-hang rank=1 incarnation=3;"
        "startup-hang phase=ccl-init rank=1; device-oom; slow-start seconds=5; orphans; engine-crash signal=kill",
        4,
    )
    assert [f.kind for f in faults] == [
        "worker-segv",
        "worker-hang",
        "startup-hang",
        "device-oom",
        "slow-start",
        "orphans",
        "engine-crash",
    ]
    segv, hang, stall, oom, slow, orphans, crash = faults
    assert (segv.rank, segv.after, segv.kernel, segv.incarnation) == (2, 30.0, "/tmp/k.log", None)
    assert (hang.rank, hang.after, hang.incarnation) == (1, 0.0, 3)
    assert (stall.phase, stall.rank, stall.after) == ("ccl-init", 1, None)
    assert (oom.rank, oom.phase) == (0, "kv-cache")
    assert slow.seconds == 5.0
    assert crash.signal == "KILL"
    assert parse_faults("  ;  ", 4) == []


def test_parse_new_faults_ccl_init_fail_and_device_lost() -> None:
    ccl, lost, lost2 = parse_faults(
        "ccl-init-fail; device-lost rank=3 after=12.5 kernel=/tmp/k.log incarnation=1; device-lost", 4
    )
    assert (ccl.kind, ccl.rank, ccl.phase, ccl.after) == ("ccl-init-fail", 0, "ccl-init", None)
    assert (lost.rank, lost.after, lost.kernel, lost.incarnation, lost.phase) == (
        3,
        12.5,
        "/tmp/k.log",
        1,
        None,
    )
    assert (lost2.rank, lost2.after, lost2.kernel) == (0, 0.0, None)


def test_active_filters_by_incarnation() -> None:
    faults = parse_faults("worker-exit rank=0 incarnation=1; worker-exit rank=1 incarnation=2; orphans", 2)
    assert [f.rank for f in active(faults, "2") if f.kind == "worker-exit"] == [1]
    assert [f.kind for f in active(faults, None)] == ["orphans"]
    assert len(active(faults, "1")) == 2


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("bogus rank=1", "unknown fault kind 'bogus'"),
        ("worker-segv rank=4", "rank: 4 is out of range for tensor parallel size 4"),
        ("worker-segv rank=x", "rank: expected an integer, got 'x'"),
        ("worker-hang after=-1", "after: must be a finite number >= 0"),
        ("worker-hang phase=load", "worker-hang does not take phase="),
        ("startup-hang rank=1", "startup-hang needs phase="),
        ("startup-hang phase=boot", "phase: unknown phase 'boot'"),
        ("worker-exit code=300", "code: must be 0..255"),
        ("slow-start", "slow-start needs seconds="),
        ("worker-segv rank", "expected key=value, got 'rank'"),
        ("worker-segv kernel=/no/such/dir/k.log", "kernel: directory /no/such/dir does not exist"),
        ("api-crash signal=HUP", "signal: one of"),
        ("worker-segv after=1 phase=load", "give after= or phase=, not both"),
        ("worker-segv rank=1 rank=2", "rank= given twice"),
        ("worker-segv rank=\uff11", "rank: expected an integer, got '\uff11' (ASCII digits)"),
        ("worker-hang after=\uff11", "after: expected seconds, got '\uff11'"),
        ("worker-exit code=1_0", "code: expected an integer, got '1_0'"),
        ("orphans incarnation=-1", "incarnation: must be >= 1"),
        ("orphans incarnation=0", "incarnation: must be >= 1"),
        ("ccl-init-fail phase=load", "ccl-init-fail does not take phase="),
        ("ccl-init-fail after=3", "ccl-init-fail does not take after="),
        ("ccl-init-fail rank=4", "rank: 4 is out of range for tensor parallel size 4"),
        ("device-lost phase=load", "device-lost does not take phase="),
        ("device-lost after=x", "after: expected seconds, got 'x'"),
    ],
)
def test_bad_fault_specs_name_entry_and_key(spec: str, needle: str) -> None:
    with pytest.raises(FaultSpecError) as e:
        parse_faults(f"orphans; {spec}", 4)
    assert needle in str(e.value)
    assert repr(spec) in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "env, needle",
    [
        (
            {"XPU_SERVE_SIM_FAULTS": "worker-segv rank=9"},
            "XPU_SERVE_SIM_FAULTS: 'worker-segv rank=9': rank: 9",
        ),
        ({"XPU_SERVE_SIM_TIME_SCALE": "fast"}, "XPU_SERVE_SIM_TIME_SCALE: expected a number > 0"),
        (
            {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "0"},
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: expected seconds > 0",
        ),
        # the workers derive a port from the tag's hex: caught at start, not as a worker traceback
        ({"XPU_SERVE_SIM_DIST_TAG": "beek"}, "XPU_SERVE_SIM_DIST_TAG: hex digits only (1-64), got 'beek'"),
        ({"XPU_SERVE_SIM_PREFIX": "0.20"}, "XPU_SERVE_SIM_PREFIX: expected one of 0.14, 0.32, got '0.20'"),
        (
            {"XPU_SERVE_SIM_SHM_PREFIX": "psm/x"},
            "XPU_SERVE_SIM_SHM_PREFIX: letters, digits, '_', '.', '-' only (1-64), got 'psm/x'",
        ),
        (
            {"XPU_SERVE_SIM_FAULTS": "host-oom rank=1 rank=1"},
            "XPU_SERVE_SIM_FAULTS: 'host-oom rank=1 rank=1': rank= given twice",
        ),
    ],
)
def test_bad_spec_exits_2_with_one_line(env: dict[str, str], needle: str, tmp_path) -> None:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("XPU_SERVE_SIM_", "VLLM_"))}
    full.update(env)
    r = subprocess.run(
        [sys.executable, "-m", "xpu_serve.sim", "serve", "m", "-tp", "4", "--port", "1"],
        env=full,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("xpu_serve.sim: ") and needle in lines[0]


# -- kernel records ----------------------------------------------------------------------------
def test_kernel_path_is_opened_at_parse_and_write_errors_are_reported(tmp_path, capfd) -> None:
    new = tmp_path / "k.log"
    assert parse_faults(f"worker-segv kernel={new}", 2)[0].kernel == str(new)
    assert not new.exists()  # opened to check, not left behind
    old = tmp_path / "old.log"
    old.write_text("kept\n")
    parse_faults(f"host-oom kernel={old}", 2)
    assert old.read_text() == "kept\n"  # appended to, never truncated
    dangling = tmp_path / "link.log"
    dangling.symlink_to("/no/such/dir/k.log")  # fails to open for root too
    with pytest.raises(FaultSpecError, match=f"kernel: cannot open {dangling} for append: No such file"):
        parse_faults(f"worker-segv kernel={dangling}", 2)
    if os.geteuid() != 0:
        old.chmod(0o444)
        with pytest.raises(FaultSpecError, match="cannot open .* for append: Permission denied"):
            parse_faults(f"host-oom kernel={old}", 2)
    if os.path.exists("/dev/full"):
        # opens for append, but every write fails (ENOSPC): one line on stderr when the fault fires
        assert parse_faults("worker-segv kernel=/dev/full", 2)[0].kernel == "/dev/full"
        capfd.readouterr()
        write_records("/dev/full", oom_records("VLLM::Worker_TP", os.getpid()))
        err = capfd.readouterr().err
        assert err == "xpu-serve sim: kernel=/dev/full: cannot write kernel record: No space left on device\n"


def test_kernel_records_dmesg_format(tmp_path) -> None:
    path = tmp_path / "dmesg.txt"
    up = time.clock_gettime(time.CLOCK_BOOTTIME)
    write_records(
        str(path), segfault_records("VLLM::Worker_TP", 8335, 65) + [engine_reset_record("0000:0e:00.0", 54)]
    )
    write_records(str(path), oom_records("VLLM::Worker_TP", os.getpid()))
    lines = path.read_text().splitlines()
    assert len(lines) == 6
    stamps = [float(re.match(r"^\[\s*(\d+\.\d{6})\] ", ln).group(1)) for ln in lines]  # type: ignore[union-attr]
    assert stamps == sorted(stamps) and abs(stamps[0] - up) < 5
    assert re.fullmatch(
        r"\[\s*\d+\.\d{6}\] VLLM::Worker_TP\[8335\]: segfault at [0-9a-f]+ ip [0-9a-f]{16} sp [0-9a-f]{16} error 4 "
        r"in libze_intel_gpu\.so\.1\.14\.37020\[[0-9a-f]+,[0-9a-f]+\+9d4000\] likely on CPU 65 \(core \d+, socket 0\)",
        lines[0],
    )
    assert lines[1].split("] ", 1)[1].startswith("Code: ")
    assert lines[2].endswith(
        "xe 0000:0e:00.0: [drm] Tile0: GT0: Engine reset: engine_class=bcs, logical_mask: 0x1, guc_id=54"
    )
    assert f"Out of memory: Killed process {os.getpid()} (VLLM::Worker_TP) total-vm:" in lines[5]
    assert re.search(r"anon-rss:[1-9]\d*kB", lines[5])  # real sizes of this process


def test_job_timeout_records_match_the_real_xe_shape(tmp_path) -> None:
    """The device-lost fault's xe records against tests/fixtures/cases/xe-ccs-tdr-device-lost
    (pasted with wrapped lines and ISO times: joined and stripped here)."""
    path = tmp_path / "dmesg.txt"
    write_records(str(path), job_timeout_records("0000:86:00.0", "VLLM::Worker_TP", 4242, 1523))
    ours = [ln.split("] ", 1)[1] for ln in path.read_text().splitlines()]
    case = os.path.join(os.path.dirname(__file__), "fixtures", "cases", "xe-ccs-tdr-device-lost", "input.log")
    with open(case) as f:
        text = re.sub(r"\n  (?!\d{4}-)", " ", f.read())  # re-join the wrapped record lines
    real = [
        re.sub(r"^\s*\S+ ", "", ln)
        for ln in text.splitlines()
        if "engine_class=ccs" in ln or "Timedout" in ln
    ]
    assert ours == [
        real[0].replace("0000:3d:00.0", "0000:86:00.0"),
        real[1]
        .replace("0000:3d:00.0", "0000:86:00.0")
        .replace("in python [2693]", "in VLLM::Worker_TP [4242]"),
    ]


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


# -- one healthy run ---------------------------------------------------------------------------
def test_healthy_tree_logs_http_metrics_and_sigterm(tmp_path) -> None:
    with SimRun(
        tmp_path,
        tp=4,
        env={
            "XPU_SERVE_INCARNATION": "7",
            "XPU_SERVE_SIM_TOKEN_RATE": "200",
            "XPU_SERVE_SIM_FAULTS": "worker-segv rank=0 incarnation=6",
        },
    ) as sim:
        took = sim.wait_ready(30)
        assert took < 15  # ~1-2 s at scale 0.01 on an idle 2-core VM

        # Process tree: API server -> resource tracker, VLLM::EngineCore -> VLLM::Worker_TP0..3
        api = psutil.Process(sim.proc.pid)  # type: ignore[union-attr]
        kids = api.children()
        engine = [p for p in kids if _comm(p.pid) == "VLLM::EngineCor"]
        assert len(engine) == 1 and engine[0].cmdline()[0] == "VLLM::EngineCore"
        tracker = [p for p in kids if "resource_tracker" in " ".join(p.cmdline())]
        assert len(tracker) == 1
        workers = engine[0].children()
        assert sorted(w.cmdline()[0] for w in workers) == [f"VLLM::Worker_TP{r}" for r in range(4)]
        assert {_comm(w.pid) for w in workers} == {"VLLM::Worker_TP"}  # comm cut to 15 bytes
        for p in [api, engine[0], *workers, *tracker]:
            assert p.environ()["XPU_SERVE_INCARNATION"] == "7"
            assert os.getpgid(p.pid) == api.pid  # one process group, as vLLM

        # Log prefixes and start-up milestones in vLLM's formats.
        names = sim.pids_by_name()
        assert names["APIServer"] == api.pid and names["EngineCore_DP0"] == engine[0].pid
        for w in workers:
            r = int(w.cmdline()[0][-1])
            assert names[f"Worker_TP{r}"] == w.pid
        log = sim.log()
        for r in range(4):
            assert re.search(
                rf"^\(Worker pid=\d+\) INFO .* \[parallel_state\.py:\d+\] world_size=4 rank={r} "
                rf"local_rank={r} distributed_init_method=tcp://127\.0\.0\.1:\d+ backend=xccl$",
                log,
                re.M,
            )
            assert re.search(
                rf"^\d{{4}}:\d\d:\d\d-\d\d:\d\d:\d\d: \d+:\[{r}\] \|CCL_WARN\| topology recognition",
                log,
                re.M,
            )
        assert re.search(
            r"^\d{4}:\d\d:\d\d-\d\d:\d\d:\d\d: \d+ \|CCL_WARN\| value of CCL_ATL_TRANSPORT changed to be ofi "
            r"\(default:mpi\)$",
            log,
            re.M,
        )
        assert re.search(r"^Loading safetensors checkpoint shards: 100% Completed \| 16/16 ", log, re.M)
        assert re.search(r"\[kv_cache_utils\.py:\d+\] GPU KV cache size: 220,160 tokens$", log, re.M)
        assert f"(APIServer pid={api.pid}) INFO:     Application startup complete." in log
        assert "Fatal Python error" not in log  # the incarnation=6 fault is not for incarnation 7
        for line in sim.lines():
            m = PREFIX_RE.match(line)
            if m and " INFO:     " not in line and line != m.group(0):
                assert VLLM_LINE.match(line), line

        # HTTP
        assert sim.get("/health") == (200, b"")
        status, body = sim.get("/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "sim"
        assert json.loads(sim.get("/version")[1])["version"].startswith("0.")
        status, body = sim.post("/v1/completions", {"model": "sim", "prompt": "hello world", "max_tokens": 7})
        out = json.loads(body)
        assert (
            status == 200
            and out["usage"]["completion_tokens"] == 7
            and out["choices"][0]["finish_reason"] == "length"
        )
        status, body = sim.post(
            "/v1/chat/completions",
            {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert status == 200 and json.loads(body)["choices"][0]["message"]["role"] == "assistant"
        events = sim.stream(
            "/v1/chat/completions",
            {"model": "sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5},
        )
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["delta"].get("content") for c in chunks[1:]].count(None) == 0
        assert len(chunks) == 6 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        events = sim.stream("/v1/completions", {"model": "sim", "prompt": "x", "max_tokens": 3})
        assert len(events) == 4 and events[-1] == "[DONE]"
        assert sim.post("/v1/completions", {"model": "nope", "prompt": "x"})[0] == 404
        assert sim.post("/v1/completions", {"model": "sim", "prompt": "x", "max_tokens": 10**6})[0] == 400

        # Metrics: vLLM's names and labels; the token counters count what was generated.
        text = sim.get("/metrics")[1].decode()
        lbl = '{engine="0",model_name="sim"}'
        for fam in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert f"{fam}{lbl} 0.0" in text
        gen = float(
            re.search(
                r'^vllm:generation_tokens_total\{engine="0",model_name="sim"\} (\S+)$', text, re.M
            ).group(1)
        )  # type: ignore[union-attr]
        assert gen == 7 + 4 + 5 + 3
        assert re.search(r'^vllm:prompt_tokens_total\{engine="0",model_name="sim"\} [1-9]', text, re.M)
        assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim"} 4.0' in text

        # Periodic stats line and uvicorn access lines.
        sim.wait_for_line(
            r"\[loggers\.py:\d+\] Engine 000: Avg prompt throughput: \d+\.\d tokens/s, Avg generation "
            r"throughput: \d+\.\d tokens/s, Running: \d+ reqs, Waiting: 0 reqs, GPU KV cache usage: "
            r"\d+\.\d%, Prefix cache hit rate: 0\.0%$"
        )
        assert re.search(
            rf'^\(APIServer pid={api.pid}\) INFO:     127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" '
            r"200 OK$",
            sim.log(),
            re.M,
        )

        # SIGTERM: the tree shuts down like vLLM, exit 0, leaving its /dev/shm and /tmp files.
        sim.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert sim.wait_exit(15) == 0
        assert sim.wait_gone(10) == []
        log = sim.log()
        assert "INFO:     Shutting down" in log and f"INFO:     Finished server process [{api.pid}]" in log
        assert log.count("WorkerProc shutting down.") == 4
        left = sim.leftovers()
        assert f"/tmp/vllm_dist_{sim.run_id}" in left
        assert [p for p in left if p.startswith("/dev/shm/")] == [
            f"/dev/shm/vllm_dist_{sim.run_id}-cpushm_{r}" for r in range(4)
        ]
    assert SimRun.__exit__ and not sim.leftovers()


def test_sigkilled_run_leaves_no_segment_behind(tmp_path) -> None:
    """A SIGKILL to the session kills multiprocessing's resource tracker with the tree, so nothing
    unlinks the EngineCore's MessageQueue buffer: `SimRun`'s exit removes it and the cpushm
    segments, proven by the processes' own mappings."""
    sim = SimRun(tmp_path, tp=2)
    mapped: set[str] = set()
    try:
        with sim:
            sim.wait_ready(60)
            engine = sim.pids_by_name()["EngineCore_DP0"]
            mapped = {p for p in cleanup.segments_of([p.pid for p in sim.processes()]) if "/dev/shm/" in p}
            buffers = [p for p in cleanup.segments_of([engine]) if "/dev/shm/" in p and "cpushm" not in p]
            # named by the run (XPU_SERVE_SIM_SHM_PREFIX): <session's base><run id>_<8 hex>
            assert len(buffers) == 1 and re.fullmatch(
                re.escape(f"/dev/shm/{os.environ['XPU_SERVE_SIM_SHM_PREFIX']}{sim.run_id}_") + "[0-9a-f]{8}",
                buffers[0],
            ), buffers
            assert set(buffers) | {f"/dev/shm/vllm_dist_{sim.run_id}-cpushm_{r}" for r in range(2)} <= mapped
        assert not sim.processes()
        assert [p for p in mapped if os.path.exists(p)] == []
        assert sim.leftovers() == []
    finally:
        for path in mapped:  # this run's own (mapped by its processes), should the test fail
            with contextlib.suppress(OSError):
                os.unlink(path)


def test_busy_port_fails_like_vllm(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        sim = SimRun(tmp_path, tp=2)
        sim.port = s.getsockname()[1]
        sim.argv[sim.argv.index("--port") + 1] = str(sim.port)
        with sim:
            assert sim.wait_exit(30) == 1
            assert sim.log().rstrip().endswith("OSError: [Errno 98] Address already in use")
            assert sim.wait_gone(5) == []


@pytest.mark.kmsg
def test_kernel_records_into_dev_kmsg() -> None:
    if os.environ.get("XPU_SERVE_TEST_KMSG") != "1" or not os.access("/dev/kmsg", os.W_OK):
        pytest.skip("writes to the real kernel log: set XPU_SERVE_TEST_KMSG=1 (root)")
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    os.lseek(fd, 0, os.SEEK_END)
    pci = f"0000:{os.getpid() % 256:02x}:00.7"  # unique enough to find our own record
    write_records("/dev/kmsg", [engine_reset_record(pci, 99)])
    found = []
    try:
        while True:
            try:
                rec = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            if pci in rec:
                found.append(rec)
    finally:
        os.close(fd)
    assert found and re.match(
        r"^\d+,\d+,\d+,[-c];xe " + re.escape(pci) + r": \[drm\] Tile0: GT0: Engine reset", found[0]
    )


# -- process titles with and without the setproctitle library ---------------------------------
_TITLE_CHILD = """
import json, sys, time
if sys.argv[1] == "own":
    sys.modules["setproctitle"] = None  # as on an install without the sim extra
from xpu_serve.sim.proctitle import set_title
set_title(sys.argv[2])
print(json.dumps(sys.argv[1:]), flush=True)
time.sleep(30)
"""


def _titled(way: str, title: str) -> tuple[bytes, str, dict[str, str], list[str]]:
    """(raw /proc/PID/cmdline, comm, environ, what the child still sees as sys.argv) of a child
    that set `title` the `way` ("lib": setproctitle; "own": the fallback)."""
    env = {**os.environ, "SPT_NOENV": "1", "XPU_T_MARK": "m"}  # SPT_NOENV: as the supervisor sets
    p = subprocess.Popen([sys.executable, "-c", _TITLE_CHILD, way, title], stdout=subprocess.PIPE,
                         env=env, text=True)
    try:
        argv = json.loads(p.stdout.readline())  # type: ignore[union-attr]
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            raw = f.read()
        return raw, _comm(p.pid), psutil.Process(p.pid).environ(), argv
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("title", ["VLLM::Worker_TP0", "VLLM::EngineCore", "VLLM::Worker"])
def test_fallback_title_is_byte_identical_to_setproctitle(title: str) -> None:
    pytest.importorskip("setproctitle")  # in the dev extra
    lib, own = _titled("lib", title), _titled("own", title)
    assert own[0] == lib[0]  # /proc/PID/cmdline, byte for byte
    assert own[0].startswith(title.encode() + b"\0") and set(own[0][len(title):]) == {0}
    assert own[1] == lib[1] == title[:15]  # comm
    assert own[2]["XPU_T_MARK"] == lib[2]["XPU_T_MARK"] == "m"
    assert own[3] == ["own", title]  # the interpreter's own copy of argv is untouched


def test_tree_titles_and_discovery_without_setproctitle(tmp_path) -> None:
    # every process of the tree imports sitecustomize from PYTHONPATH: setproctitle is hidden
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['setproctitle'] = None\n")
    from xpu_serve.sources.processes import discover

    with SimRun(tmp_path, tp=2, env={"PYTHONPATH": str(site)}) as sim:
        sim.wait_ready(30)
        assert sim.proc is not None
        found = {p.name: p.rank for p in discover(sim.proc.pid).values()}
        assert found == {"APIServer": None, "EngineCore": None, "Worker_TP0": 0, "Worker_TP1": 1}
        kids = psutil.Process(sim.proc.pid).children(recursive=True)
        assert sorted(_comm(k.pid) for k in kids if _comm(k.pid).startswith("VLLM::")) == [
            "VLLM::EngineCor", "VLLM::Worker_TP", "VLLM::Worker_TP",
        ]
    assert "cannot set the process title" not in sim.log()


_THREAD_TITLE_CHILD = """
import sys, threading
if sys.argv[1] == "own":
    sys.modules["setproctitle"] = None
from xpu_serve.sim.proctitle import set_title
def title():
    set_title("VLLM::Thread")
    print(open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip())
t = threading.Thread(target=title)
t.start()
t.join()
print(open("/proc/self/comm").read().strip())
"""


def test_fallback_from_a_thread_names_that_thread_as_setproctitle_does() -> None:
    pytest.importorskip("setproctitle")
    got = {}
    for way in ("lib", "own"):
        r = subprocess.run([sys.executable, "-c", _THREAD_TITLE_CHILD, way], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        got[way] = r.stdout.split()  # [the calling thread's comm, the main thread's comm]
    assert got["own"] == got["lib"], got
    assert got["own"][0] == "VLLM::Thread" and got["own"][1] != "VLLM::Thread", got


_FORKING_WORKER = """
import os, subprocess, sys, time
if sys.argv[1] == "root":
    subprocess.Popen([sys.executable, "-c", sys.argv[2], "worker", sys.argv[2]])
    time.sleep(60)
from setproctitle import setproctitle
setproctitle("VLLM::Worker_TP1")
if os.fork() == 0:  # a helper forked by the worker: it carries the worker's title until it execs
    time.sleep(60)
    os._exit(0)
print("forked", flush=True)
time.sleep(60)
"""


def test_a_fork_of_a_worker_carrying_its_title_is_not_that_rank() -> None:
    """Measured with the real engine (tests/realvllm/test_group_real.py): a short-lived child of
    node 1's Worker_TP1 with the worker's title, seen by the process watch as Worker_TP1; its
    exit failed the group as "Worker_TP1 died"."""
    pytest.importorskip("setproctitle")
    from xpu_serve.sources.processes import discover

    root = subprocess.Popen([sys.executable, "-c", _FORKING_WORKER, "root", _FORKING_WORKER])
    try:
        deadline = time.monotonic() + 30
        titled: list[psutil.Process] = []
        while time.monotonic() < deadline and len(titled) < 2:
            kids = psutil.Process(root.pid).children(recursive=True)
            titled = [k for k in kids if _comm(k.pid).startswith("VLLM::Worker_TP")]
            time.sleep(0.1)
        assert len(titled) == 2, "the worker and its fork, both titled"
        found = {p.pid: p.name for p in discover(root.pid).values()}
        worker = min(titled, key=lambda k: k.create_time())
        assert found == {root.pid: "APIServer", worker.pid: "Worker_TP1"}, found
    finally:
        for k in psutil.Process(root.pid).children(recursive=True):
            k.kill()
        root.kill()
        root.wait(10)
