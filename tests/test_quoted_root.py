"""A consequence line that quotes the error causing it (`quotes_root` rows: the ProcessGroup
watchdog's "terminated with exception: ...", EngineDeadError) takes its cause from the quoted error
when that error is a named failure; otherwise it stays a consequence."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from xpu_serve.diagnosis import Analyzer
from xpu_serve.signatures import load_table, parse_table

WATCHDOG = (
    "[rank1]:[E219 12:14:43.351647859 ProcessGroupNCCL.cpp:1595] [PG ID 2 PG GUID 3 Rank 1] "
    "Process group watchdog thread terminated with exception: {quoted}"
)


def _verdict(lines: list[str], table=None):  # type: ignore[no-untyped-def]
    an = Analyzer(table)
    for i, line in enumerate(lines, 1):
        an.feed_line(line, "t.log", i)
    return an.incident()


@pytest.mark.parametrize(
    ("quoted", "cause"),
    [
        ("CUDA error: an illegal memory access was encountered", "process-exception"),
        ("CUDA error: out of memory", "device-oom"),
        ("Native API failed. Native API returns: 20 (UR_RESULT_ERROR_DEVICE_LOST)", "device-lost"),
    ],
)
def test_watchdog_takes_the_quoted_cause(quoted: str, cause: str) -> None:
    inc = _verdict([WATCHDOG.format(quoted=quoted)])
    assert inc.cause == cause
    assert inc.root is not None and inc.root.rank == 1 and inc.root.line == 1


def test_watchdog_without_a_named_error_stays_a_consequence() -> None:
    inc = _verdict([WATCHDOG.format(quoted="Socket Timeout while waiting")])
    assert inc.cause != "process-exception"
    inc = _verdict([WATCHDOG.format(quoted="something odd happened")])
    assert inc.cause == "unknown"


def test_the_quoted_root_does_not_depend_on_table_order() -> None:
    # the consequence row placed before every root row: first-match order alone would leave the
    # line a consequence; the quoted text is classified again
    rows = [r for r in _rows() if r["id"] == "pg-watchdog-terminated"]
    rows += [r for r in _rows() if r["id"] != "pg-watchdog-terminated"]
    inc = _verdict([WATCHDOG.format(quoted="CUDA error: an illegal memory access was encountered")], parse_table(rows))
    assert inc.cause == "process-exception"


def test_engine_dead_error_quoting_a_device_loss() -> None:
    line = (
        "(APIServer pid=2406) ERROR 04-14 23:32:27 [async_llm.py:546] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue: RuntimeError: UR_RESULT_ERROR_DEVICE_LOST"
    )
    assert _verdict([line]).cause == "device-lost"


def _rows() -> list[dict]:  # type: ignore[type-arg]
    return list(yaml.safe_load(resources.files("xpu_serve").joinpath("data/signatures.yaml").read_text()))


def test_table_flags_are_on_consequence_rows_only() -> None:
    for r in load_table().rows:
        if r.extra.get("quotes_root"):
            assert r.role == "consequence", r.id
