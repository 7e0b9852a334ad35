"""Consequences are counted as events, not lines (analysis/occurrence.py): one traceback, one
rank's oneCCL teardown burst, one process's burst of lines of one kind. Real cases through a real
`xpu-serve diagnose` subprocess, the JSON counts and the one-screen report's text."""

from __future__ import annotations

from pathlib import Path

from tests.test_cases import diagnose_text, run_case

CASES = Path(__file__).resolve().parent / "fixtures" / "cases"


def counts(got: dict) -> dict[tuple[str, str | None, int | None], tuple[int, int]]:
    """(signature, process, rank) -> (count, first line) of a `--json` verdict's consequences."""
    return {(c["signature"], c["process"], c["rank"]): (c["count"], c["line"]) for c in got["consequences"]}


def report(*files: Path) -> str:
    return diagnose_text(*files)


def test_three_ranks_ccl_teardown_are_three_events() -> None:
    """qwen3-30b-worker0-died: ranks 1-3 each print oneCCL's KVS write error, broken pipe,
    remove_key, finalize and PMI destructor lines (19 lines): one event per rank, kept at the
    rank's first line; the unprefixed lines between them make no event of their own."""
    got = run_case(CASES / "qwen3-30b-worker0-died")
    c = counts(got)
    assert c[("ccl-kvs-broken-pipe", "Worker_TP1", 1)] == (1, 115)
    assert c[("ccl-kvs-broken-pipe", "Worker_TP3", 3)] == (1, 123)
    assert c[("ccl-kvs-broken-pipe", "Worker_TP2", 2)] == (1, 129)
    teardown = {"ccl-kvs-write-error", "ccl-kvs-remove-key", "ccl-pmrt-finalize", "ccl-pmi-destructor"}
    assert not teardown & {k[0] for k in c}
    # three unprefixed `terminate called` lines: no process says they are one, three events
    assert c[("cxx-terminate", None, None)] == (3, 120)
    # each worker's "Parent process exited" and "WorkerProc shutting down" (same second): one event
    assert [c[("worker-parent-exited", f"Worker_TP{r}", r)][0] for r in (1, 2, 3)] == [1, 1, 1]
    # EngineCore's traceback ending in RuntimeError: cancelled and its second copy: one event
    assert c[("shm-cancelled", "EngineCore", None)] == (1, 174)
    assert sum(n for n, _ in c.values()) == 15
    assert got["summary"].endswith("; 15 events followed as consequences")


def test_repeated_lines_of_one_process_are_one_event() -> None:
    """qwen3-30b-libze-segfault: EngineCore's six "Canceling waiting reads on SHM Buffer" lines and
    its RuntimeError: cancelled, all in one second: one event (the line count was 7)."""
    got = run_case(CASES / "qwen3-30b-libze-segfault")
    c = counts(got)
    assert c[("shm-cancelled", "EngineCore", None)] == (1, 7)
    assert c[("ccl-kvs-broken-pipe", None, 3)] == (1, 3)
    # four kernel engine-reset records of no process: four events
    assert c[("xe-engine-reset-copy", None, None)] == (4, 7)


def test_report_names_the_teardown_once_per_kind() -> None:
    case = CASES / "qwen3-30b-worker0-died"
    lines = report(case / "vllm.log").splitlines()
    followed = lines[lines.index("WHAT FOLLOWED (consequences, not causes):") + 1 :]
    followed = followed[: followed.index("")]
    assert [ln.split(" (")[0].strip() for ln in followed] == [
        "worker shut down after its parent on ranks 1-3",
        "oneCCL teardown",
        "C++ terminate",
        "EngineCore fatal error in EngineCore",
        "EngineCore failed waiting for workers in EngineCore",
        "shared-memory reads cancelled in EngineCore",
        "EngineDeadError on requests",
        "leaked semaphores/shared memory at exit",
    ]
    assert followed[1].startswith("  oneCCL teardown (Broken pipe) on ranks 1-3 (3 events) ")
    assert followed[1].endswith("vllm.log:115]")
    assert followed[0].startswith("  worker shut down after its parent on ranks 1-3 (3 events) ")
    assert " x" not in "\n".join(followed)


def test_b70_teardown_of_one_rank(tmp_path: Path) -> None:
    """b70-worker0-died-ccl: rank 1's teardown burst is one event at its first ranked line; the
    same burst pasted twice, far apart, is two events."""
    case = CASES / "b70-worker0-died-ccl"
    c = counts(run_case(case))
    assert c[("ccl-kvs-broken-pipe", "Worker_TP1", 1)] == (1, 4)
    assert ("ccl-kvs-write-error", None, None) not in c and ("ccl-pmi-destructor", None, None) not in c
    lines = (case / "input.log").read_text().splitlines()
    burst = lines[2:10]  # write: error .. what(): the burst and its terminate
    (tmp_path / "twice").mkdir()
    (tmp_path / "twice" / "input.log").write_text("\n".join(lines + [""] * 20 + burst) + "\n")
    c2 = counts(run_case(tmp_path / "twice"))
    assert c2[("ccl-kvs-broken-pipe", "Worker_TP1", 1)] == (2, 4)


def test_unranked_teardown_is_one_event_per_run(tmp_path: Path) -> None:
    """A teardown burst whose lines name no rank (the process prefix cut by the paste): one event
    per run, not one per line; two runs 30 lines apart are two."""
    run = [
        "write: error: buf 0x6e26c630, size 394, shift 0",
        "~pmi_resizable_simple_internal: failed",
        "~pmi_resizable_simple_internal: failed",
    ]
    head = "(EngineCore pid=113) ERROR 09-04 19:19:06 [multiproc_executor.py:283] Worker proc VllmWorker-0 died unexpectedly"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "input.log").write_text("\n".join([head, *run, *[""] * 30, *run]) + "\n")
    c = counts(run_case(tmp_path / "c"))
    assert c[("ccl-kvs-write-error", None, None)] == (2, 2)
    assert ("ccl-pmi-destructor", None, None) not in c
