"""`Event`: one recognised line or fact, the unit every source feeds into the analysis.

Owned by the diagnose work (issue 5): line parsers for vLLM, oneCCL, kernel records and
crash dumps live here and turn raw text into `Event`s. Live sources (log pump, kernel log,
process watch, health) produce the same `Event`s, so `diagnose` and `up` share one pipeline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class Event:
    """One line or fact.

    Attributes:
        source: where it came from: "vllm", "ccl", "kernel", "process", "health", "supervisor".
        text: the message without wrappers and prefixes (the whole raw line when unparsed).
        raw: the line as read (CR and trailing newline stripped).
        time: wall-clock time when known (naive local time as printed, or aware UTC when the
            source is aware), else None.
        time_text: the time exactly as it appears in the input (e.g. "04-14 23:00:33"), or None.
        process: vLLM process name ("APIServer", "EngineCore", "Worker_TP0"...), or the kernel
            comm ("VLLM::Worker_TP"), or None.
        rank: TP rank when known, else None.
        pid: pid as printed by the source (container pid for vLLM, host pid for the kernel).
        level: "INFO", "WARNING", "ERROR"... or the kernel priority name; None if unknown.
        file, line: where the line is in the input (1-based line), for evidence.
        code_location: vLLM's "[core.py:936]" as "core.py:936", or None.
        seq: kernel record sequence number (/dev/kmsg), or None.
        signature, role, cause: filled in by classification (signatures table).
        group: id of the multi-line block (traceback, crash dump) this line belongs to, or None.
        extra: source-specific fields (e.g. {"library": "libze_intel_gpu.so.1.14.37020"}).
    """

    source: str
    text: str
    raw: str = ""
    time: datetime | None = None
    time_text: str | None = None
    process: str | None = None
    rank: int | None = None
    pid: int | None = None
    level: str | None = None
    file: str | None = None
    line: int | None = None
    code_location: str | None = None
    seq: int | None = None
    signature: str | None = None
    role: str | None = None
    cause: str | None = None
    group: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


# vLLM prefixes its child processes' output with "(Name pid=N) " (vllm/utils: _add_prefix via
# decorate_logs), and re-prefixes what it relays, so lines can carry nested prefixes:
# "(APIServer pid=A) (EngineCore_DP0 pid=B) ERROR ...". Written here (not a library) because it is
# the domain's own log shape.
_PREFIX_RE = re.compile(r"\(([A-Za-z][\w:.-]*) pid=(\d+)\)\s?")


def split_process_prefix(line: str) -> tuple[str | None, int | None, str]:
    """Split vLLM's process prefix(es) off a line.

    Returns (name, pid, rest) for the innermost prefix, e.g.
    "(APIServer pid=1) (EngineCore_DP0 pid=2) INFO x" -> ("EngineCore_DP0", 2, "INFO x");
    (None, None, line) when the line has no prefix at its start.
    """
    name: str | None = None
    pid: int | None = None
    pos = 0
    while True:
        m = _PREFIX_RE.match(line, pos)
        if not m:
            break
        name, pid, pos = m.group(1), int(m.group(2)), m.end()
    return name, pid, line[pos:]
