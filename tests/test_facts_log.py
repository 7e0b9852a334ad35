"""The facts log (RUNTIME/logs/N/facts.log): its lines give back the facts the live analysis got,
at the place in vllm.log where it got them, and a write that fails never stops anything."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import pytest

from xpu_serve import facts
from xpu_serve.diagnosis import Analyzer, diagnose_files
from xpu_serve.events import Event
from xpu_serve.supervision.factlog import FactLog

CASE = Path(__file__).parent / "fixtures" / "cases" / "cpu-tp2-worker0-segv" / "vllm.log"
AT = datetime(2026, 11, 30, 8, 31, 1, 250000).timestamp()


def _fields(ev: Event) -> tuple[object, ...]:
    extra = {k: v for k, v in ev.extra.items() if k != "stacks"}
    return (ev.source, ev.text, ev.time, ev.time_text, ev.process, ev.rank, ev.pid, ev.level, extra)


@pytest.mark.parametrize(
    "ev",
    [
        facts.process_exit("Worker_TP1", 7093, 1, None, "SIGSEGV", AT),
        facts.process_exit("EngineCore", 7032, None, 1, None, AT),
        facts.process_exit("APIServer", 7019, None, None, None, AT),
        facts.hang(92.0, 1, 0, datetime(2026, 11, 30, 8, 29, 0), at=AT),
        facts.rank_states([{"process": "Worker_TP1", "rank": 1, "pid": 7093, "state": "T", "wait": "outside"}], AT),
        facts.health_failed(3, "timed out", AT),
        facts.startup_stall(600.0, "ccl-init", [1, 3], AT),
        facts.trigger("process-exit", "Worker_TP1 (pid 7093) died: killed by SIGSEGV", AT,
                      {"process": "Worker_TP1", "rank": 1, "pid": 7093, "signal": "SIGSEGV", "loop_stall_s": 1.5}),
    ],
    ids=lambda ev: facts.kind_of(ev),
)
def test_a_fact_line_gives_back_the_fact(ev: Event) -> None:
    ev.extra["stacks"] = {7093: "Thread 1 ..."}  # the bundle keeps stacks in stacks/, not here
    line = facts.to_line(ev, 412)
    assert line.startswith(f"2026-11-30T{datetime.fromtimestamp(AT).astimezone().utctimetuple().tm_hour:02d}")
    assert f" xpu-serve fact {facts.kind_of(ev)} {{" in line
    assert "\n" not in line and "Thread 1" not in line
    got = facts.parse_fact_line(line + "\n")
    assert got is not None
    back, after = got
    assert after == 412
    assert _fields(back) == _fields(ev)


@pytest.mark.parametrize(
    "line",
    [
        "",
        "INFO 11-30 08:31:01 [core.py:1] xpu-serve fact process-exit {}",
        "2026-11-30T08:31:01.250000+00:00 xpu-serve fact process-exit [1, 2]",
        '2026-11-30T08:31:01.250000+00:00 xpu-serve fact process-exit {"text": "Worker_TP1 (pid 7',  # cut
        '2026-13-30T08:31:01.250000+00:00 xpu-serve fact process-exit {"text": "x"}',  # no 13th month
        '2026-11-30T08:31:01.250000+00:00 xpu-serve fact process-exit {"text": 5}',
    ],
)
def test_other_lines_are_not_facts(line: str) -> None:
    assert facts.parse_fact_line(line) is None


def test_a_fact_without_a_position_is_read_last() -> None:
    line = facts.to_line(facts.health_failed(3, "HTTP 503", AT), 0).replace('"after": 0', '"after": "x"')
    got = facts.parse_fact_line(line)
    assert got is not None and got[1] == -1


def test_a_failed_write_is_one_warning_and_never_raises(tmp_path: Path) -> None:
    warnings: list[str] = []
    log = FactLog(tmp_path / "logs" / "1" / facts.FACTS_LOG, warnings.append)  # its folder is missing
    for _ in range(3):
        log.write(facts.health_failed(3, "HTTP 503", AT), 0)
    assert log.dropped == 3
    assert len(warnings) == 1 and "cannot write (No such file or directory)" in warnings[0], warnings
    (tmp_path / "logs" / "1").mkdir(parents=True)
    log.write(facts.health_failed(3, "HTTP 503", AT), 7)  # the folder is back: writes again
    assert (tmp_path / "logs" / "1" / facts.FACTS_LOG).read_text().count("\n") == 1
    assert os.stat(log.path).st_mode & 0o777 == 0o600


def test_diagnose_with_the_facts_log_gives_the_live_verdict(tmp_path: Path) -> None:
    """The real cpu-tp2-worker0-segv log fed as `up` feeds it (line by line, the supervisor's
    facts as they arrive) and read back by `diagnose_files` from vllm.log and facts.log."""
    at_dump, at_report = 125, 174  # the worker's crash dump; EngineCore's report of the death
    exit0 = facts.process_exit("Worker_TP0", 7092, 0, None, None, AT)  # status unknown: reaped first
    trig = facts.trigger("process-exit", "Worker_TP0 (pid 7092) died: exit status unknown", AT,
                         {"process": "Worker_TP0", "rank": 0, "pid": 7092})
    exit1 = facts.process_exit("Worker_TP1", 7093, 1, None, "SIGABRT", AT + 0.2)
    at_fact = {at_dump: [exit0, trig], at_report: [exit1]}
    live = Analyzer()
    log = FactLog(tmp_path / facts.FACTS_LOG, lambda msg: pytest.fail(msg))
    for n, line in enumerate(CASE.read_bytes().decode().split("\n"), 1):  # (no newline translation)
        live.feed_line(line, str(CASE), n)
        for ev in at_fact.get(n, []):
            log.write(ev, live.lines_read(str(CASE)))
            live.add_event(ev)
    want = live.incident()
    assert want.trigger_signal == "SIGSEGV"  # from the worker's own dump (analysis/supervised.py)
    assert want.root is not None and (want.root.process, want.root.pid) == ("Worker_TP0", 7092)
    got = diagnose_files([str(CASE), str(log.path)])
    assert got.to_contract() == want.to_contract()
    assert got.trigger_signal == "SIGSEGV"


def test_shutdown_exits_after_the_first_death_are_not_the_root(tmp_path: Path) -> None:
    """Worker_TP0 reaped by EngineCore first (status unknown), then the API server's shutdown of
    the tree: EngineCore killed by SIGTERM and the API server's exit 0, as the supervisor saw them
    on the real engine. The root stays the worker EngineCore reported dead, not the SIGTERM."""
    at_report = 174  # EngineCore's "Worker proc VllmWorker-0 died unexpectedly"
    dump = range(125, at_report)  # the worker's crash dump, left out: a SIGKILLed worker writes none
    shutdown = [
        facts.process_exit("Worker_TP0", 7092, 0, None, None, AT),
        facts.process_exit("EngineCore", 7032, None, None, "SIGTERM", AT + 0.3),
        facts.process_exit("APIServer", 7019, None, 0, None, AT + 0.7),
    ]
    live = Analyzer()
    for n, line in enumerate(CASE.read_bytes().decode().split("\n"), 1):
        if n not in dump:
            live.feed_line(line, str(CASE), n)
        if n == at_report:
            for ev in shutdown:
                live.add_event(ev)
    inc = live.incident()
    assert inc.cause == "process-crash"
    assert inc.root is not None and (inc.root.process, inc.root.rank) == ("Worker_TP0", 0)
    followed = {(c.signature, c.process) for c in inc.consequences}
    assert ("process-killed-by-signal", "EngineCore") in followed  # the SIGTERM is a consequence
