"""One Aho-Corasick pass over a block of log lines: which lines the analysis must read.

A block is "\\n"-joined complete lines of one file (`diagnosis.iter_file_blocks`, 1 MiB). The
pass finds, in one call into the automaton (ahocorasick-rs):

- the trigger keywords (the signature table's keywords and the feeding loop's own triggers):
  lines that can match a row;
- the stats line's keyword ("Avg prompt throughput: ", vllm/v1/metrics/loggers.py);
- " ERROR " (a vLLM ERROR record may be an exception line whose traceback head was lost).

`Scan.quiet`: nothing but stats lines was found. Then `explain_pids` counts the known process
prefixes at line starts ("\\n(Worker_TP1 pid=7987)", C-level str.count): when every " pid=" of the
block lies in one, the analysis sets its per-line state (the last line of each process, stats)
from the scan alone (analysis/quiet.py `QuietBlocks.read`). Otherwise the block takes the per-line
loop, given the trigger lines found here (`Scan.trigger_lines`).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

try:
    import ahocorasick_rs
except ImportError:  # pragma: no cover - a dependency; without it the per-line loop runs
    ahocorasick_rs = None  # type: ignore[assignment]

STATS_KW = "Avg prompt throughput: "
ERROR_KW = " ERROR "
PID_KW = " pid="
MAX_KEYS = 16  # process prefixes counted per block; more (one prefix per line, e.g. a stamp
# before each prefix) leave those lines to the per-line loop


@dataclass
class Scan:
    """What one pass found. Positions are offsets in the block."""

    quiet: bool
    stats: list[int] = field(default_factory=list)  # offsets of the stats keyword, in order
    triggers: list[int] = field(default_factory=list)  # offsets of trigger matches


class BlockScan:
    """The automaton of the triggers and the stats and ERROR markers (bytes for an ASCII block,
    whose offsets are its characters', else text)."""

    def __init__(self, triggers: tuple[str, ...]) -> None:
        fixed = [t for t in dict.fromkeys(triggers) if t not in (STATS_KW, ERROR_KW)]
        self.n_triggers = len(fixed)
        self.stats_in_triggers = STATS_KW in triggers
        self.error_in_triggers = ERROR_KW in triggers
        self._pats = [*fixed, STATS_KW, ERROR_KW]
        self._ac: Any = None
        self._bac: Any = None

    def _find(self, text: str) -> list[tuple[int, int, int]]:
        dfa = ahocorasick_rs.Implementation.DFA
        if text.isascii():
            if self._bac is None:
                self._bac = ahocorasick_rs.BytesAhoCorasick([p.encode() for p in self._pats], implementation=dfa)
            return self._bac.find_matches_as_indexes(text.encode("ascii"), overlapping=True)  # type: ignore[no-any-return]
        if self._ac is None:
            self._ac = ahocorasick_rs.AhoCorasick(self._pats, implementation=dfa)
        return self._ac.find_matches_as_indexes(text, overlapping=True)  # type: ignore[no-any-return]

    def scan(self, text: str) -> Scan:
        """One pass over `text`."""
        nt = self.n_triggers
        stats: list[int] = []
        triggers: list[int] = []
        for p, s, _ in self._find(text):
            if p == nt:
                stats.append(s)
            elif p < nt or self.error_in_triggers:
                triggers.append(s)
            else:
                triggers.append(-1 - s)  # an ERROR marker: a line to read, not a keyword
        return Scan(not triggers, stats, triggers)

    def trigger_lines(self, sc: Scan, lines: list[str]) -> set[int]:
        """Indexes in `lines` (the block split at "\n") of the lines holding a trigger keyword
        (the stats keyword too when it is one)."""
        pos = [t for t in sc.triggers if t >= 0]
        if self.stats_in_triggers:
            pos += sc.stats
        if not pos:
            return set()
        starts = list(accumulate((len(x) + 1 for x in lines), initial=0))
        return {bisect_right(starts, t) - 1 for t in pos}


def usable_keys(seen: dict[str, int | None]) -> list[tuple[str, int | None]]:
    """The most recently learned process prefixes (at most MAX_KEYS) with one " pid=" each."""
    out = []
    for k in reversed(seen):
        if k.count(PID_KW) == 1 and "\n" not in k:
            out.append((k, seen[k]))
            if len(out) >= MAX_KEYS:
                break
    return out


def explain_pids(text: str, keys: list[tuple[str, int | None]]) -> dict[int, int] | None:
    """{key index: start of its last line} for the `keys` present at a line start of `text`, when
    every " pid=" of `text` lies in one of them; else None (a line the loop must read: a prefix
    seen first, a " pid=" later in a line). One C-level count per key."""
    total = text.count(PID_KW)
    found = 0
    last: dict[int, int] = {}
    for i, (k, _) in enumerate(keys):
        c = text.count("\n" + k) + text.startswith(k)
        if c:
            found += c
            j = text.rfind("\n" + k)
            last[i] = j + 1 if j >= 0 else 0
    return last if found == total else None
