"""The block scan (feed_block) gives the per-line loop's result: every fixture case embedded in a
healthy server's log, fed in blocks, against the same lines through the per-line loop alone
(feed_lines: each line's keywords looked up on its own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpu_serve.diagnosis import Analyzer

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(
    p for d in ("cases", "reports") for p in (FIXTURES / d).glob("*/*") if p.suffix in (".log", ".txt")
)
HEALTHY = [
    '(APIServer pid=2406) INFO:     10.0.0.2:1385 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
    "(Worker_TP1 pid=7987) INFO 03-26 04:15:12 [utils.py:59] _KV_CACHE_LAYOUT_OVERRIDE variable detected.",
    "(EngineCore_DP0 pid=2674) DEBUG 04-14 22:34:44 [core.py:812] EngineCore waiting for work.",
    "[  364.213117] xe 0000:86:00.0: Using 46-bit DMA addresses",
    'INFO:     127.0.0.1:57856 - "GET /health HTTP/1.1" 200 OK',
    "(APIServer pid=2406) INFO 04-14 22:34:43 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
    "Avg generation throughput: 47.0 tokens/s, Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: 14.3%",
    "(Worker_TP1 pid=7987) INFO 03-26 04:15:13 [utils.py:60] a line of the worker",
    "(APIServer pid=2406) INFO 04-14 22:34:45 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
    "Avg generation throughput: 0.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 14.3%",
]


def _log(case: Path) -> list[str]:
    filler = HEALTHY * 40
    return [*filler, *case.read_text(encoding="utf-8", errors="replace").split("\n"), *filler, *filler]


def _count_quiet(an: Analyzer) -> list[int]:
    """[number of blocks read from the scan alone], kept up to date while `an` is fed."""
    n = [0]
    real = an._quiet.read

    def spy(*a: Any) -> int | None:
        got = real(*a)
        n[0] += got is not None
        return got

    an._quiet.read = spy  # type: ignore[method-assign]
    return n


def _state(an: Analyzer) -> dict[str, Any]:
    return {
        "contract": an.incident().to_contract(),
        "pid_last_raw": dict(an.pid_last_raw),
        "last_line": dict(an._last_line),
        "stats": (an.last_stats, an.last_progress, an.stall_stats),
        "ready": an.ready,
        "lines": an.lines,
        "lineno": dict(an._lineno),
        "restarts": an.restarts,
    }


@pytest.mark.parametrize("case", CASES, ids=[f"{p.parent.name}/{p.name}" for p in CASES])
@pytest.mark.parametrize("block", [7, 64, 100000])
def test_blocks_read_as_lines(case: Path, block: int) -> None:
    lines = _log(case)
    one = Analyzer()
    one.feed_lines(lines, "vllm.log")
    blk = Analyzer()
    quiet = _count_quiet(blk)
    at = 0
    while at < len(lines):
        at += blk.feed_block("\n".join(lines[at : at + block]), "vllm.log", at + 1)
    assert _state(blk) == _state(one)
    if block == 64 and len(lines) < 1000:
        assert quiet[0] >= 2  # the healthy stretches were read from the scan alone


def test_block_starting_inside_a_traceback_takes_the_loop() -> None:
    head = [*HEALTHY * 3, "(Worker_TP1 pid=7987) ERROR 03-26 04:15:12 [x.py:1] Traceback (most recent call last):"]
    tail = [
        '(Worker_TP1 pid=7987) ERROR 03-26 04:15:12 [x.py:1]   File "/v/worker.py", line 3, in run',
        "(Worker_TP1 pid=7987) ERROR 03-26 04:15:12 [x.py:1]     raise RuntimeError('x')",
        "(Worker_TP1 pid=7987) ERROR 03-26 04:15:12 [x.py:1] RuntimeError: UR error",
        *HEALTHY * 3,
    ]
    one, blk = Analyzer(), Analyzer()
    one.feed_lines(head + tail, "f")
    n = blk.feed_block("\n".join(head), "f", 1)
    blk.feed_block("\n".join(tail), "f", n + 1)
    assert _state(blk) == _state(one)


def test_quiet_block_sees_the_first_answered_request() -> None:
    api = "(APIServer pid=2406) INFO 04-14 22:34:45 [chat_utils.py:560] Detected the chat template content format."
    worker = [HEALTHY[1], HEALTHY[2], HEALTHY[6], api]
    head, tail = worker * 5, [*worker * 5, '(APIServer pid=2406) INFO:     10.0.0.2:1 - "GET /v1/models HTTP/1.1" 200 OK']
    one, blk = Analyzer(), Analyzer()
    one.feed_lines(head + tail, "f")
    n = blk.feed_block("\n".join(head), "f", 1)
    assert not blk.ready
    assert blk._quiet.read("\n".join(tail), "f", n + 1, []) == len(tail)
    assert blk.ready and one.ready


def test_quiet_block_of_text_beyond_ascii() -> None:
    # a non-ASCII block is scanned as text (offsets in characters), an ASCII one as bytes
    named = "(Worker_TP1 pid=7987) INFO 03-26 04:15:14 [utils.py:61] modèle chargé: Qwen3 量化"
    lines = [*HEALTHY * 8, named, *HEALTHY * 8, named, HEALTHY[5]]
    one, blk = Analyzer(), Analyzer()
    one.feed_lines(lines * 3, "f")
    quiet = _count_quiet(blk)
    at = 0
    for _ in range(3):
        at += blk.feed_block("\n".join(lines), "f", at + 1)
    assert _state(blk) == _state(one)
    assert blk.pid_last_raw[7987][0] == named
    assert quiet == [2]  # the blocks after the first (which learns the prefixes)
