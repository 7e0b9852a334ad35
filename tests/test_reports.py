"""Real public failure reports in tests/fixtures/reports/ give their expected verdict through a real
`xpu-serve diagnose --json` subprocess (all files of a case passed together, as the cases README says).

Each case folder holds the log lines as posted (personal paths/hosts replaced), `expected.json` (same
keys as tests/fixtures/cases) and `SOURCE.md` (thread URL and why the expected cause is right per the
cause table). Cases the analysis does not yet get right are marked xfail(strict=True) with the reason,
so the suite stays green and a fix is noticed (the xfail then fails and must be removed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_cases import CASE_DIRS, assert_verdict, run_case
from xpu_serve.diagnosis import diagnose_files

REPORTS = Path(__file__).resolve().parent / "fixtures" / "reports"
REPORT_DIRS = sorted(p for p in REPORTS.iterdir() if (p / "expected.json").is_file())

# case name -> why the current analysis gets it wrong (the line that should decide it)
_CUT_OR_STALL = (
    "the input ends during start-up right after progress that followed every wait line (the waits interleave with "
    "{what}); the analysis assumes a stall when a start-up capture ends without the ready line, as "
    "startup-stall-core-engine-wait-debug-rank (same shape, expected startup-hang on the reporter's word) requires: "
    "telling a capture cut short from a stall needs the time after the last line, which the input does not hold"
)
KNOWN_GAPS: dict[str, str] = {
    "unknown-shm-waits-during-torch-compile-tp2": _CUT_OR_STALL.format(what="torch.compile progress"),
    "unknown-mqllmengine-waits-while-loading-shards": _CUT_OR_STALL.format(what="the shard-loading bar"),
    # batch 10b (NVIDIA, CPU, other)
    "unknown-shard-loading-bars-only-96-shards": (
        "bare tqdm lines `Loading safetensors checkpoint shards: 61% Completed | 59/96 [04:27<...]` advancing steadily "
        "(one shard every ~4.8 s by the bar's own clock) are read as a load-model stall because the capture ends "
        "without the ready line; nothing in the input shows a stall"
    ),
    # batch 11b (NVIDIA, CPU, other)
    "quoted-ray-nccl-watchdog-init-allreduce-gptq-3090-tp4": (
        "the watchdog timeouts `WorkNCCL(SeqNum=49, OpType=ALLREDUCE, NumelIn=268435456, ...)` (rank 1 at SeqNum=48) "
        "carry no start-up marker and no ready or serving line, so they are read as an engine hang; the expected "
        'startup-hang rests on the thread ("Hanging on Initializing") and telling an early start-up collective (a '
        "profile run) from a serving one needs more than the input holds (nccl-watchdog-v0-pipe-prefix, SeqNum=2, "
        "is engine-hang)"
    ),
    # batch 14 (first run, before its fixes): the expected verdict and what the analysis said
    "enginecore-exited-unexpectedly-mpclient-shutdown-sequence-worker-parent-exited-310p": "batch 14a first run: expected process-crash, got unknown (not yet read generally)",
    "grep-filename-prefix-nccl-warn-net-ib-port-error-then-workerproc-exception-head": "batch 14a first run: expected collective-failure, got unknown (not yet read generally)",
    "helm-stack-traceback-tail-no-supported-config-format-qwen-valueerror": "batch 14a first run: expected config-error, got process-exception (not yet read generally)",
    "ipex-llm-xpu-tp-startup-hang-keyboardinterrupt-traceback-shell-prompt-leaked-semaphore": "batch 14a first run: expected startup-hang, got unknown (not yet read generally)",
    # batch 16 (first run, before any fix): expected, what the analysis said, and the line that should decide it
    "ollama-journal-pager-truncated-lines-llama-runner-exited-signal-illegal-instruction": "batch 16: expected process-crash, got unknown (`llama.go:323: llama runner exited with error: signal: illegal ins>`)",
    "sglang-two-node-deepseek-r1-watchdog-seqnum2-allreduce-numel1-startup-one-line": "batch 16: expected startup-hang, got engine-hang (`Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, ...)`)",
}


# case name -> why the `docker logs -t` shapes below (one fixed stamp, 2026-04-16T12:49:28, put before every
# line) cannot keep its verdict: the shape's stamp disagrees with the case's own clock, which a real capture's
# would not
DOCKER_T_GAPS: dict[str, str] = {
    "oneccl-atl-ofi-psm3-mlx5-cannot-open-network-providers-then-ucx-caught-signal-11-multi-rank-pvc": (
        "oneCCL's own stamps (`2025:05:23-19:04:20`) order its errors, the UCX `Caught signal 11` line has none and "
        "takes the shape's 04-16 stamp; time keys carry no year (vLLM's stamps have none), so the signal reads as "
        "a month before the errors and becomes the root; a real `docker logs -t` stamp is the errors' own day"
    ),
}


def _params() -> list[Any]:
    out = []
    for case in REPORT_DIRS:
        marks = []
        if case.name in KNOWN_GAPS:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[case.name]))
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


@pytest.mark.parametrize("case", _params())
def test_report_verdict(case: Path) -> None:
    expected = json.loads((case / "expected.json").read_text())
    assert_verdict(run_case(case), expected)


def test_every_report_is_documented() -> None:
    assert len(REPORT_DIRS) >= 40
    for case in REPORT_DIRS:
        assert (case / "SOURCE.md").read_text().count("https://") >= 1, case.name
        assert any(p.suffix in (".log", ".txt") for p in case.iterdir()), case.name
    assert set(KNOWN_GAPS) | set(DOCKER_T_GAPS) <= {p.name for p in REPORT_DIRS}


# How the same log reaches us in other hands: each transform rewrites every file of a case the way a
# paste, a terminal or a log shipper does. The verdict must not change.
_PREFIX_AT_START = re.compile(r"^(\([^)]*pid=\d+[^)]*\))")


def _lines(f: Callable[[str], str]) -> Callable[[str], str]:
    return lambda t: "\n".join(f(x) if x else x for x in t.split("\n"))


SHAPES: dict[str, Callable[[str], str]] = {
    # Windows line ends (a log copied through a Windows editor or a CRLF terminal capture)
    "crlf": lambda t: t.replace("\n", "\r\n"),
    # GitHub quote marks around every line (a log quoted in a reply)
    "quoted": lambda t: "\n".join("> " + x if x else ">" for x in t.split("\n")),
    # a markdown fence with a language tag around the whole log
    "fenced": lambda t: "```text\n" + t.rstrip("\n") + "\n```\n",
    # ANSI colours around vLLM's process prefix (Ray and docker compose on a TTY)
    "ansi": _lines(lambda x: _PREFIX_AT_START.sub("\x1b[1;36m\\1\x1b[0m", x)),
    # the capture ends in the middle of a line
    "truncated-tail": lambda t: t.rstrip("\n") + "\n(APIServer pid=1) INFO 01-0",
    # `docker logs -t` stamps / `docker compose logs` service prefixes (only on logs without a wrapper)
    "docker-t": _lines(lambda x: "2026-04-16T12:49:28.263781156Z " + x),
    "compose": _lines(lambda x: "vllm-1  | " + x),
}
_WRAPPED = re.compile(r"^(?:\s*\d{4}-\d\d-\d\dT|[\w.-]+\s+\| )", re.M)


def _shape_params() -> list[Any]:
    out = []
    for case in [*CASE_DIRS, *REPORT_DIRS]:
        if case.name in KNOWN_GAPS:
            continue
        for shape in SHAPES:
            if shape == "docker-t" and case.name in DOCKER_T_GAPS:
                continue
            out.append(pytest.param(case, shape, id=f"{case.parent.name}/{case.name}-{shape}"))
    return out


@pytest.mark.parametrize(("case", "shape"), _shape_params())
def test_verdict_survives_log_shape(case: Path, shape: str, tmp_path: Path) -> None:
    files = sorted(p for p in case.iterdir() if p.suffix in (".log", ".txt"))
    texts = [p.read_bytes().decode("utf-8", "replace") for p in files]
    if shape in ("docker-t", "compose") and any(_WRAPPED.search(t) for t in texts):
        pytest.skip("the log already carries a docker/compose/ISO wrapper")
    paths = []
    for p, t in zip(files, texts, strict=True):
        q = tmp_path / p.name
        q.write_bytes(SHAPES[shape](t).encode())
        paths.append(q)
    got = diagnose_files(paths).to_contract()
    assert_verdict(got, json.loads((case / "expected.json").read_text()))


def _verdict_of(tmp_path: Path, text: str) -> dict[str, Any]:
    p = tmp_path / "input.log"
    p.write_text(text)
    return diagnose_files([p]).to_contract()


def test_engine_start_waits_are_a_stall_only_without_ready(tmp_path: Path) -> None:
    waits = "".join(
        f"(APIServer pid=1) INFO 05-16 13:12:{s:02d} [utils.py:741] Waiting for 1 local, 0 remote core engine proc(s) "
        "to start.\n"
        for s in (10, 20, 30)
    )
    got = _verdict_of(tmp_path, waits)
    assert got["cause"] == "startup-hang"
    assert got["root"]["line"] == 3 and got["hang"]["detected_at"] == "05-16 13:12:30"
    # the same waits in a start that then became ready: nothing failed
    ready = waits + '(APIServer pid=1) INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 200 OK\n'
    assert _verdict_of(tmp_path, ready)["cause"] == "unknown"
    # one wait line alone is an ordinary start-up
    assert _verdict_of(tmp_path, waits.split("\n")[0] + "\n")["cause"] == "unknown"


def test_exception_from_argument_or_config_checks_is_config_error(tmp_path: Path) -> None:
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/usr/local/bin/vllm", line 8, in <module>\n'
        "    sys.exit(main())\n"
        '  File "/usr/lib/python3.12/site-packages/vllm/engine/arg_utils.py", line 1020, in create_engine_config\n'
        "    raise ValueError(msg)\n"
        "ValueError: Chunked prefill and prefix caching cannot be combined here\n"
    )
    got = _verdict_of(tmp_path, tb)
    assert (got["cause"], got["root"]["line"]) == ("config-error", 6)
    # the same exception raised from model code is an ordinary exception
    model = tb.replace("vllm/engine/arg_utils.py", "vllm/model_executor/models/llama.py").replace(
        "create_engine_config", "forward"
    )
    assert _verdict_of(tmp_path, model)["cause"] == "process-exception"


def test_headless_exception_line_counts_only_at_error_level(tmp_path: Path) -> None:
    # vLLM logs a traceback line by line at ERROR (logger.exception); a paste that kept only the
    # exception line still names the failure and its process
    line = "(EngineCore_DP0 pid=77) ERROR 05-11 06:53:08 [core.py:938] RuntimeError: kernel launch check failed\n"
    got = _verdict_of(tmp_path, line)
    assert (got["cause"], got["root"]["process"], got["root"]["pid"]) == ("process-exception", "EngineCore", 77)
    # the same words in an INFO/WARNING message are not an exception
    for level in ("INFO", "WARNING"):
        assert _verdict_of(tmp_path, line.replace(" ERROR ", f" {level} "))["cause"] == "unknown"


def test_uncaught_cxx_exception_is_the_root_of_the_abort(tmp_path: Path) -> None:
    # std::terminate after an exception that names no more specific failure: the exception is the
    # root, the shell's report of the SIGABRT (bash or zsh wording) follows from it
    head = "terminate called after throwing an instance of 'std::runtime_error'\n  what():  bad state in solver\n"
    for tail in ("Aborted (core dumped)\n", "zsh: abort (core dumped)  ./solver\n", "[1]    9149 IOT instruction  ./solver\n"):
        got = _verdict_of(tmp_path, head + tail)
        assert got["cause"] == "process-exception", tail
        assert got["root"]["line"] == 1
        assert [c["signature"] for c in got["consequences"]] in (["shell-job-signal"], ["zsh-job-signal"]), tail
    # the shell's report alone stays a crash by signal
    assert _verdict_of(tmp_path, "zsh: segmentation fault (core dumped)  python x.py\n")["cause"] == "process-crash"


# ---- several incidents in one input: an operator pastes a whole journal (incident, restart, incident)
CASES = Path(__file__).resolve().parent / "fixtures" / "cases"


def _case_text(case: Path) -> str:
    """Every log file of a case, joined as one paste (each ending with a newline)."""
    out = []
    for p in sorted(q for q in case.iterdir() if q.suffix in (".log", ".txt")):
        t = p.read_bytes().decode("utf-8", "replace")
        out.append(t if t.endswith("\n") else t + "\n")
    return "".join(out)


@pytest.mark.parametrize(
    ("first", "last"),
    [
        # engine hang, vLLM restarted (`non-default args:`), then worker 0 died
        (CASES / "glm47-flash-engine-hang", CASES / "qwen3-30b-worker0-died"),
        # device OOM, then a fresh start (banner) in which worker 0 is killed by SIGSEGV
        (CASES / "b60-out-of-resources", CASES / "cpu-tp2-worker0-segv"),
        # xe job timeout / engine resets on the kernel side, then a new start where worker 0 died
        (CASES / "xe-ccs-tdr-device-lost", CASES / "qwen3-30b-worker0-died"),
    ],
    ids=["hang-then-death", "oom-then-segv", "gpu-fault-then-death"],
)
def test_two_incidents_verdict_is_about_the_last(tmp_path: Path, first: Path, last: Path) -> None:
    t1, t2 = _case_text(first), _case_text(last)
    first_cause = json.loads((first / "expected.json").read_text())["cause"]
    got = _verdict_of(tmp_path, t1 + t2)
    assert_verdict(got, json.loads((last / "expected.json").read_text()))
    assert got["root"]["line"] > t1.count("\n")  # the root is in the second incident
    assert any(f"earlier incident in the input ({first_cause}" in n for n in got["notes"]), got["notes"]


def test_two_incidents_survive_log_shapes(tmp_path: Path) -> None:
    t1, t2 = _case_text(CASES / "glm47-flash-engine-hang"), _case_text(CASES / "qwen3-30b-worker0-died")
    expected = json.loads((CASES / "qwen3-30b-worker0-died" / "expected.json").read_text())
    for shape, f in SHAPES.items():
        got = _verdict_of(tmp_path, f(t1 + t2))
        assert_verdict(got, expected)
        assert any("engine-hang" in n for n in got["notes"]), shape


def test_restart_without_a_later_failure_keeps_the_earlier_verdict(tmp_path: Path) -> None:
    t1 = _case_text(CASES / "qwen3-30b-worker0-died")
    # the next start of a real vLLM (banner .. ready), cut before its worker was killed
    start = _case_text(CASES / "cpu-tp2-worker0-segv").split("\n")
    ready = next(i for i, x in enumerate(start) if "Application startup complete" in x)
    t2 = "\n".join(start[: ready + 1]) + "\n"
    assert _verdict_of(tmp_path, t2)["cause"] == "unknown"  # the later start alone shows nothing
    got = _verdict_of(tmp_path, t1 + t2)
    assert_verdict(got, json.loads((CASES / "qwen3-30b-worker0-died" / "expected.json").read_text()))
    assert got["root"]["line"] <= t1.count("\n")
    assert any("started again" in n for n in got["notes"]), got["notes"]
    # a real paste of that shape: the port error, then "Starting vLLM..." and a new banner
    port = _verdict_of(tmp_path, _case_text(REPORTS / "api-server-port-in-use"))
    assert port["cause"] == "config-error" and any("started again" in n for n in port["notes"])


def test_log_line_quoting_a_crash_is_not_a_crash(tmp_path: Path) -> None:
    case = CASES / "glm47-flash-engine-hang"
    lines = _case_text(case).split("\n")
    quoting = [
        "(APIServer pid=1) WARNING 04-14 22:59:00 [launcher.py:88] previous engine died: Fatal Python error: "
        "Segmentation fault",
        "(APIServer pid=1) INFO 04-14 22:59:00 [launcher.py:90] Fatal Python error: Segmentation fault",
        "WARNING:root:restarted after Fatal Python error: Segmentation fault",
        "2026-04-14 22:59:01,120 - WARNING - worker log says: Fatal Python error: Aborted",
    ]
    got = _verdict_of(tmp_path, "\n".join(lines[:5] + quoting + lines[5:]))
    assert_verdict(got, json.loads((case / "expected.json").read_text()))
    # the faulthandler dump itself (the line alone, as CPython writes it) still is the root
    dump = "Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f (most recent call first):\n"
    got = _verdict_of(tmp_path, "\n".join(quoting) + "\n" + dump)
    assert (got["cause"], got["root"]["line"]) == ("process-crash", len(quoting) + 1)


def _merged_case_params() -> list[Any]:
    return [
        pytest.param(c, id=f"{c.parent.name}/{c.name}")
        for c in [*CASE_DIRS, *REPORT_DIRS]
        if c.name not in KNOWN_GAPS and c.name not in DOCKER_T_GAPS and not _WRAPPED.search(_case_text(c))
    ]


@pytest.mark.parametrize("case", _merged_case_params())
def test_docker_t_over_one_file_of_kernel_and_vllm_lines(case: Path, tmp_path: Path) -> None:
    # all files of a case in one capture (kernel records, some with their own ISO stamps and
    # wrapped continuation lines, between vLLM lines) read back through `docker logs -t`
    got = _verdict_of(tmp_path, SHAPES["docker-t"](_case_text(case)))
    assert_verdict(got, json.loads((case / "expected.json").read_text()))


def test_start_banner_after_a_kernel_log_file_is_not_a_restart(tmp_path: Path) -> None:
    # a bundle: dmesg.txt (read first) holds the fault; vllm.log starts with vLLM's banner. Failure
    # evidence from another file must not make the banner a restart (the verdict would lose it).
    case = CASES / "qwen3-30b-libze-segfault"
    dmesg = tmp_path / "dmesg.txt"
    dmesg.write_bytes((case / "dmesg.txt").read_bytes())
    log = tmp_path / "vllm.log"
    banner = (
        "(APIServer pid=9400) INFO 03-26 10:02:01 [api_server.py:1885] vLLM API server version 0.11.1\n"
        "(APIServer pid=9400) INFO 03-26 10:02:01 [utils.py:233] non-default args: {'tensor_parallel_size': 4}\n"
    )
    log.write_text(banner + (case / "vllm.log").read_text())
    got = diagnose_files([dmesg, log]).to_contract()
    assert_verdict(got, json.loads((case / "expected.json").read_text()))
    assert not any("started again" in n or "earlier incident" in n for n in got["notes"])


def test_crash_dump_in_a_collective_binding_is_a_collective_failure(tmp_path: Path) -> None:
    # faulthandler prints every thread; only the crashing ("Current thread") block's most recent
    # frame says where the crash was
    other = (
        '  File "/usr/lib/python3/site-packages/vllm/model_executor/layers/linear.py", line 12 in forward\n'
    )
    nccl = (
        '  File "/usr/lib/python3/site-packages/vllm/distributed/device_communicators/pynccl_wrapper.py", '
        "line 257 in ncclAllReduce\n"
    )
    head = "Fatal Python error: Segmentation fault\n\n"
    dump = head + "Thread 0x00007f74511ef700 (most recent call first):\n" + nccl
    dump += "\nCurrent thread 0x00007f7586283630 (most recent call first):\n" + other
    assert _verdict_of(tmp_path, dump)["cause"] == "process-crash"
    dump = head + "Current thread 0x00007f7586283630 (most recent call first):\n" + nccl + other
    got = _verdict_of(tmp_path, dump)
    assert (got["cause"], got["root"]["line"]) == ("collective-failure", 1)
    # the frame must be the block's first: a collective frame deeper in the stack is not the crash site
    dump = head + "Current thread 0x00007f7586283630 (most recent call first):\n" + other + nccl
    assert _verdict_of(tmp_path, dump)["cause"] == "process-crash"


def test_only_no_progress_warnings_pasted_is_an_engine_hang(tmp_path: Path) -> None:
    shm = "No available shared memory broadcast block found in 60 seconds. This typically happens ..."
    lines = [f"(EngineCore_DP0 pid=1454) INFO 05-28 14:{m}:27 [shm_broadcast.py:681] {shm}" for m in (45, 46)]
    assert _verdict_of(tmp_path, "\n".join(lines) + "\n")["cause"] == "engine-hang"
    # one warning alone is a slow step, not a verdict
    assert _verdict_of(tmp_path, lines[0] + "\n")["cause"] == "unknown"


@pytest.mark.parametrize("shape", ["docker-t", "compose", "quoted", "crlf"])
def test_kernel_lines_interleaved_with_vllm_lines_keep_the_verdict(tmp_path: Path, shape: str) -> None:
    # one capture where the kernel records (dmesg, seconds since boot) sit between vLLM lines
    case = CASES / "qwen3-30b-libze-segfault"
    kernel = (case / "dmesg.txt").read_text().splitlines()
    vllm = (case / "vllm.log").read_text().splitlines()
    mixed: list[str] = []
    rest = iter(kernel)
    for i, line in enumerate(vllm):
        mixed.append(line)
        if i % 5 == 4:
            mixed.extend(next(rest, "") for _ in range(3))
    mixed.extend(rest)
    got = _verdict_of(tmp_path, SHAPES[shape]("\n".join(x for x in mixed if x) + "\n"))
    assert_verdict(got, json.loads((case / "expected.json").read_text()))


@pytest.mark.parametrize("kernel_first", [True, False], ids=["dmesg-read-first", "dmesg-read-last"])
@pytest.mark.parametrize(
    "stamp", ["Mon Nov 30 08:31:00 2026", "Thu May 28 13:20:30 2026"], ids=["after", "before"]
)
def test_kernel_log_in_its_own_file_is_placed_by_its_stamps(
    tmp_path: Path, kernel_first: bool, stamp: str
) -> None:
    # vllm.log: a device OOM (05-28), then vLLM started again (banner, 11-30 08:30:32) and worker 0
    # was killed by SIGSEGV. dmesg.txt (dmesg -T): an xe job timeout, stamped after or before that restart.
    log = tmp_path / "vllm.log"
    log.write_text(_case_text(CASES / "b60-out-of-resources") + _case_text(CASES / "cpu-tp2-worker0-segv"))
    kernel = (REPORTS / "xe-b70-timedout-job-dmesg-T" / "dmesg.txt").read_text()
    dmesg = tmp_path / "dmesg.txt"
    dmesg.write_text(kernel.replace("Tue Aug  4 20:51:21 2026", stamp))
    got = diagnose_files([dmesg, log] if kernel_first else [log, dmesg]).to_contract()
    assert any("earlier incident in the input" in n for n in got["notes"]), got["notes"]
    if stamp.startswith("Mon Nov 30"):
        # the GPU fault happened during the last start: it is that start's root
        assert got["cause"] == "gpu-fault" and got["root"]["file"] == str(dmesg)
    else:
        # the fault belongs to the earlier incident; the last start's verdict is its own
        assert_verdict(got, json.loads((CASES / "cpu-tp2-worker0-segv" / "expected.json").read_text()))
        assert got["root"]["file"] == str(log)


def test_waits_followed_by_engine_start_are_not_a_stall(tmp_path: Path) -> None:
    waits = "".join(
        f"DEBUG 05-31 01:39:{s:02d} client.py:191] Waiting for output from MQLLMEngine.\n"
        for s in (17, 27, 37)
    )
    assert _verdict_of(tmp_path, waits)["cause"] == "startup-hang"
    # the engine loop started after the waits: start-up moved on, nothing failed
    moved_on = waits + "DEBUG 05-31 01:39:40 engine.py:157] Starting Engine Loop.\n"
    got = _verdict_of(tmp_path, moved_on)
    assert got["cause"] == "unknown" and any("without a stall" in n for n in got["notes"]), got["notes"]


def test_exception_logged_by_a_request_handler_is_not_a_failure(tmp_path: Path) -> None:
    tb = (
        "(APIServer pid=1) ERROR 10-14 16:59:26 [serving_chat.py:251] Error in preprocessing prompt inputs\n"
        "(APIServer pid=1) ERROR 10-14 16:59:26 [serving_chat.py:251] Traceback (most recent call last):\n"
        '(APIServer pid=1) ERROR 10-14 16:59:26 [serving_chat.py:251]   File "/x/serving_engine.py", line 675, in f\n'
        "(APIServer pid=1) ERROR 10-14 16:59:26 [serving_chat.py:251]     raise ValueError(\n"
        "(APIServer pid=1) ERROR 10-14 16:59:26 [serving_chat.py:251] ValueError: This model's maximum context "
        "length is 40000 tokens.\n"
    )
    assert _verdict_of(tmp_path, tb)["cause"] == "unknown"
    # the same exception logged by the engine core is a failure
    core = tb.replace("APIServer pid=1", "EngineCore_DP0 pid=2").replace("serving_chat.py:251", "core.py:938")
    assert _verdict_of(tmp_path, core)["cause"] == "process-exception"


def test_failed_core_procs_without_codes_yields_to_the_error_above(tmp_path: Path) -> None:
    # `Failed core proc(s): {}` alone: the engine core failed during start-up, nothing more known
    api = (
        "(APIServer pid=7) RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}\n"
    )
    got = _verdict_of(tmp_path, api)
    assert (got["cause"], got["root"]["process"]) == ("process-crash", "EngineCore")
    # with the engine core's own error above it, that error is the root
    oom = (
        "(EngineCore_DP0 pid=9) ERROR 10-27 10:00:01 [core.py:708] torch.OutOfMemoryError: XPU out of memory. "
        "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.86 GiB of which 1.02 GiB is free.\n"
    )
    got = _verdict_of(tmp_path, oom + api)
    assert (got["cause"], got["root"]["line"]) == ("device-oom", 1)


def test_launcher_exit_status_is_a_crash_only_for_crash_signals(tmp_path: Path) -> None:
    got = _verdict_of(tmp_path, "vllm-1 exited with code 139\n")
    assert got["cause"] == "process-crash" and "SIGSEGV" in got["summary"]
    assert _verdict_of(tmp_path, "vllm-1 exited with code 143\n")["cause"] == "unknown"
    # a kernel OOM kill explains the SIGKILL (137) that the launcher reports after it
    kill = (
        "[Thu Aug 27 00:39:44 2026] Out of memory: Killed process 3742074 (python3) total-vm:81306880kB, "
        "anon-rss:1058560kB, file-rss:21412kB, shmem-rss:428kB, UID:0 pgtables:28484kB oom_score_adj:0\n"
    )
    got = _verdict_of(tmp_path, kill + "vllm-1 exited with code 137\n")
    assert (got["cause"], got["root"]["line"]) == ("host-oom", 1)


@pytest.mark.parametrize(
    "line",
    [
        # i915 intel_uncore.c fw_domain_wait_ack_set; xe xe_force_wake.c domain_wake_wait
        "[    2.95] i915 0000:00:10.0: [drm] *ERROR* gt: timed out waiting for forcewake ack request.",
        "[  812.33] xe 0000:03:00.0: [drm] *ERROR* Tile0: GT0: Force wake domain 0 failed to ack wake (-ETIMEDOUT) "
        "reg[0xd88] = 0x0",
        # i915 intel_guc_ct.c, upstream wording (GuC tag) and the backport's (category tag)
        "[ 9001.10] i915 0000:4d:00.0: [drm] *ERROR* GT0: GUC: CT: No response for request 0x5503 (fence 168)",
        "[ 9001.12] i915 0000:30:00.0: [drm] tlb invalidation response timed out for seqno 3",
    ],
)
def test_gt_not_responding_records_are_gpu_faults(tmp_path: Path, line: str) -> None:
    assert _verdict_of(tmp_path, line + "\n")["cause"] == "gpu-fault"


# the first lines of the MQLLMEngine's logged exception in tenstorrent/tt-inference-server#808 (V0
# engine.py run_mp_engine: logger.exception(e) writes str(e), then the traceback, same prefix)
_LOGGED_EXC = (
    "Process SpawnProcess-2:\n"
    "ERROR 10-07 02:08:24 [engine.py:506] name 'test' is not defined\n"
    "ERROR 10-07 02:08:24 [engine.py:506] Traceback (most recent call last):\n"
    'ERROR 10-07 02:08:24 [engine.py:506]   File "/home/container_app_user/vllm/vllm/engine/multiprocessing/engine.py", line 493, in run_mp_engine\n'
    "ERROR 10-07 02:08:24 [engine.py:506]     engine = MQLLMEngine.from_vllm_config(\n"
)


def test_logged_exception_cut_inside_its_traceback_is_named_by_its_message(tmp_path: Path) -> None:
    got = _verdict_of(tmp_path, _LOGGED_EXC)
    assert (got["cause"], got["root"]["line"]) == ("process-exception", 2), got["summary"]
    assert got["root"]["text"] == "name 'test' is not defined"
    # with its exception line the traceback names the error itself, and the message is not evidence
    whole = _LOGGED_EXC + "ERROR 10-07 02:08:24 [engine.py:506] NameError: name 'test' is not defined\n"
    got = _verdict_of(tmp_path, whole)
    assert (got["cause"], got["root"]["line"]) == ("process-exception", 6)
    assert [t["line"] for t in got["timeline"] if t["role"] == "root"] == [6]
    # a line at another level or from another code location is not the traceback's head
    for other in ("INFO 10-07 02:08:24 [engine.py:506] name", "ERROR 10-07 02:08:24 [engine.py:300] name"):
        text = _LOGGED_EXC.replace("ERROR 10-07 02:08:24 [engine.py:506] name", other, 1)
        assert _verdict_of(tmp_path, text)["cause"] == "unknown", other


def test_request_handler_logged_exception_cut_in_its_traceback_is_not_a_failure(tmp_path: Path) -> None:
    # LMCache/LMCache#411: an OpenAI request handler logs the rejected request's exception
    # (serving_chat.py), the engine goes on: its message is never the root of an incident
    text = (
        "ERROR 03-17 08:02:04 serving_chat.py:596] Error in chat completion stream generator.\n"
        "ERROR 03-17 08:02:04 serving_chat.py:596] Traceback (most recent call last):\n"
        'ERROR 03-17 08:02:04 serving_chat.py:596]   File "/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/openai/serving_chat.py", line 320, in chat_completion_stream_generator\n'
        "ERROR 03-17 08:02:04 serving_chat.py:596]     async for res in result_generator:\n"
    )
    assert _verdict_of(tmp_path, text)["cause"] == "unknown"


def test_ray_task_error_header_names_the_raising_pid(tmp_path: Path) -> None:
    # Ray's RayTaskError body as the driver re-raises it (Agent-RL/ReCall#62): the header's pid is
    # the process whose traceback follows, unprefixed
    text = (
        "ray.exceptions.RayTaskError(RuntimeError): ray::main_task() (pid=10066, ip=10.0.0.1)\n"
        '  File "/workdir/src/verl/trainer/main_ppo.py", line 135, in main_task\n'
        "    trainer.fit()\n"
        '  File "/opt/conda/lib/python3.10/site-packages/torch/cuda/memory.py", line 170, in empty_cache\n'
        "    torch._C._cuda_emptyCache()\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    )
    got = _verdict_of(tmp_path, text)
    assert (got["cause"], got["root"]["pid"], got["root"]["line"]) == ("process-exception", 10066, 6)
    # without the header the same traceback names no pid
    assert _verdict_of(tmp_path, text.split("\n", 1)[1])["root"]["pid"] is None


def test_ggml_abort_is_the_root_of_the_driver_crash_while_aborting(tmp_path: Path) -> None:
    # ggml's fatal error and the shell's "Aborted" (ggml-org/llama.cpp#13329), a kernel record of a
    # libcuda segfault of the aborting process (ikawrakow/ik_llama.cpp#381): in either file order
    log = (
        "llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:2073: GGML_ASSERT(!ggml_cuda_should_use_mmq(src0->type, cc, "
        "ne11) || ne00 % MATRIX_ROW_PADDING == 0) failed\n"
        "Aborted\n"
    )
    kmsg = (
        "[Sun May  4 22:19:21 2025] llama-server[2015]: segfault at 204803fe0 ip 00007efcfc1189d7 sp 00007ffe21474280 "
        "error 4 in libcuda.so.575.51.03[7efcfbdc5000+e97000] likely on CPU 21 (core 5, socket 1)\n"
    )
    (tmp_path / "input.log").write_text(log)
    (tmp_path / "dmesg.txt").write_text(kmsg)
    for order in (["input.log", "dmesg.txt"], ["dmesg.txt", "input.log"]):
        got = diagnose_files([tmp_path / n for n in order]).to_contract()
        assert (got["cause"], got["root"]["line"]) == ("process-exception", 1), order
        assert "kernel-segfault-umd" in [c["signature"] for c in got["consequences"]]
    # the kernel record alone is a crash in the driver library
    assert diagnose_files([tmp_path / "dmesg.txt"]).to_contract()["cause"] == "umd-segfault"


def test_tgi_shard_waits_are_a_stall_only_while_a_shard_stays_down(tmp_path: Path) -> None:
    # TGI's launcher (huggingface/text-generation-inference#2657 waits, then every shard ready)
    waits = "".join(
        f"2024-10-16T10:4{m}:{s}1.376536Z  INFO shard-manager: text_generation_launcher: Waiting for shard to be "
        f"ready... rank={r}\n"
        for m, s in (("8", "5"), ("9", "0"))
        for r in (0, 3)
    )
    ready = "".join(
        f"2024-10-16T10:49:0{5 + r}.101010Z  INFO shard-manager: text_generation_launcher: Shard ready in 40.1s "
        f"rank={r}\n"
        for r in (0, 3)
    )
    assert _verdict_of(tmp_path, waits)["cause"] == "startup-hang"
    assert _verdict_of(tmp_path, waits + ready)["cause"] == "unknown"
