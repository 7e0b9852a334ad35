"""A launcher's or shell's report of a SIGKILL/SIGTERM (`launcher_report` rows) read after a vLLM
process's own death record is the end of vLLM's shutdown: a consequence; the earlier death is root."""

from __future__ import annotations

import pytest

from xpu_serve.diagnosis import Analyzer

HEAD = [
    "(EngineCore_DP0 pid=7732) INFO 03-26 04:10:00 [core.py:100] started",
    "(APIServer pid=7700) INFO:     Application startup complete.",
]
DIED = "(EngineCore_DP0 pid=7732) ERROR 03-26 04:15:27 [multiproc_executor.py:273] Worker proc VllmWorker-0 died unexpectedly, shutting down executor."
DEAD = ("(APIServer pid=7700) ERROR 03-26 04:15:28 [async_llm.py:546] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.")


def _incident(lines: list[str]):  # type: ignore[no-untyped-def]
    an = Analyzer()
    for i, line in enumerate(lines, 1):
        an.feed_line(line, "run.log", i)
    return an.incident()


@pytest.mark.parametrize(
    "kill",
    [
        "./run.sh: line 12: 7700 Killed                  vllm serve /models/x --tensor-parallel-size 2",
        "vllm-1 exited with code 137",
        "Nov 30 08:31:02 gpu-host systemd[1]: vllm.service: Main process exited, code=killed, status=9/KILL",
    ],
)
def test_kill_after_a_worker_death_is_a_consequence(kill: str) -> None:
    inc = _incident([*HEAD, DIED, DEAD, kill])
    assert inc.cause == "process-crash"
    assert inc.root is not None and (inc.root.process, inc.root.line) == ("Worker_TP0", 3)
    assert any(c.line == 5 for c in inc.consequences)


def test_kill_with_no_earlier_death_stays_the_root() -> None:
    inc = _incident([*HEAD, "./run.sh: line 12: 7700 Killed                  vllm serve /models/x"])
    assert inc.cause == "process-crash" and inc.root is not None and inc.root.line == 3


def test_a_crash_signal_report_is_not_dropped() -> None:
    # a segfault the launcher reports is a crash of its own, not vLLM's shutdown kill
    inc = _incident([*HEAD, DIED, "./run.sh: line 12: 7700 Segmentation fault      (core dumped) vllm serve /models/x"])
    assert inc.root is not None and inc.root.line == 4
