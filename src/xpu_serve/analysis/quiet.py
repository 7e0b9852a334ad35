"""Blocks with nothing to classify (the block scan found no keyword but stats lines: most of a
healthy busy server's log) read without the per-line loop: the loop's state (stats, the last line
of the file and of each process, `ready`, counts) is set from the scan (analysis/blockscan.py)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from xpu_serve.analysis.blockscan import explain_pids, usable_keys
from xpu_serve.events import record_header_after

if TYPE_CHECKING:
    from xpu_serve.diagnosis import Analyzer

MAX_LINE = 65536  # longer lines are cut (bytes) when reading files
# the stats line's numbers, matched at the position of "Avg prompt throughput: " (the fast path);
# the table's stats-line row is the reference shape (vllm/v1/metrics/loggers.py)
STATS_AT = re.compile(
    r"Avg prompt throughput: (?P<prompt_tps>[\d.]+) tokens/s, Avg generation throughput: (?P<gen_tps>[\d.]+) "
    r"tokens/s, Running: (?P<running>\d+) reqs,(?: Swapped: \d+ reqs,)? (?:Waiting|Pending): (?P<waiting>\d+) reqs"
)


def _http_ok(text: str) -> bool:
    """A line of `text` holds " HTTP/" and '" 200' (an answered request: the server is up)."""
    i = text.find(" HTTP/")
    while i >= 0:
        ls = text.rfind("\n", 0, i) + 1
        le = text.find("\n", i)
        line = (text[ls:] if le < 0 else text[ls:le])[:MAX_LINE]
        if " HTTP/" in line and '" 200' in line:
            return True
        if le < 0:
            return False
        i = text.find(" HTTP/", le)
    return False


class QuietBlocks:
    """Reads quiet blocks into the Analyzer `an`; keeps the process prefixes of the last quiet
    block and, after blocks whose " pid=" lines were not all known, how many blocks to skip
    before the next try."""

    def __init__(self, an: Analyzer) -> None:
        self.an = an
        self._active: list[tuple[str, int | None]] = []
        self._scan_backoff = self._scan_misses = 0

    def reset(self) -> None:
        """A restart of vLLM in the input: the prefixes are learned again."""
        self._active.clear()

    def _known_pids(self, text: str) -> tuple[list[tuple[str, int | None]], dict[int, int]] | None:
        """The process prefixes of `text` and the start of each one's last line, when every
        " pid=" of it lies in a prefix already learned (see blockscan.explain_pids)."""
        seen = self.an._prefix_seen
        keys = self._active
        if keys and all(seen.get(k, -1) == p for k, p in keys):
            last = explain_pids(text, keys)
            if last is not None:
                return keys, last
        if self._scan_backoff > 0:
            self._scan_backoff -= 1
            return None
        keys = usable_keys(seen)
        last = explain_pids(text, keys)
        if last is None:
            # the loop learns the new prefixes; when blocks keep bringing new ones (a stamp before
            # each prefix), stop counting for a while
            self._scan_misses += 1
            if self._scan_misses >= 3:
                self._scan_misses, self._scan_backoff = 0, 16
            return None
        self._scan_misses = 0
        self._active = [keys[i] for i in sorted(last)]
        return self._active, {j: last[i] for j, i in enumerate(sorted(last))}

    def read(self, text: str, file: str, first: int, stats_at: list[int]) -> int | None:
        """Feed a block whose scan found nothing to classify: the per-line loop's state (stats,
        the last line of the file and of each process, `ready`, counts) is set from the scan.
        None (nothing changed) when a line of it still needs the loop: an open traceback or
        crash dump of this file, a kernel record that may continue, a stats line that is not one."""
        if self.an._stats_sig is None or file in self.an._frame_until:
            return None
        lk = self.an._last_kernel.get(file)
        if lk is not None and lk[0] == first - 1:
            return None
        known = self._known_pids(text)
        if known is None:
            return None
        keys, last = known
        pids = {keys[k][1] for k in last}
        if any(f == file and (p is None or p in pids) for f, p in self.an._tb):
            return None
        stats = self._quiet_stats(text, stats_at)
        if stats is None:
            return None
        cur, at = first, 0
        for ls, line, m in stats:
            cur += text.count("\n", at, ls)
            at = ls
            self.an.note_stats(m, (line, file, cur), None)
        last_lineno = cur + text.count("\n", at)
        nl = last_lineno - first
        starts = {ls for ls, _, _ in stats}
        self._quiet_pids(text, file, last_lineno, keys, last, starts)
        self.an._last_line[file] = text[text.rfind("\n") + 1 :][:MAX_LINE]
        if not self.an.ready and _http_ok(text):
            self.an.ready = True
        self.an.lines += nl + 1
        self.an._lineno[file] = last_lineno
        return nl + 1

    @staticmethod
    def _quiet_stats(text: str, hits: list[int]) -> list[tuple[int, str, re.Match[str]]] | None:
        """(line start, line, numbers) of each stats line of the block, in order; None when a
        line holding the stats keyword is not a clean stats line (the per-line loop reads it)."""
        out: list[tuple[int, str, re.Match[str]]] = []
        prev = -1
        for sp in hits:
            ls = text.rfind("\n", 0, sp) + 1
            if ls == prev:
                continue  # the keyword twice in a line: the loop reads the first
            prev = ls
            le = text.find("\n", sp)
            if le < 0:
                le = len(text)
            m = STATS_AT.match(text, sp)
            if le - ls > MAX_LINE or m is None or m.end() > le:
                return None
            line = text[ls:le]
            if record_header_after(line, m.end() - ls):
                return None
            out.append((ls, line, m))
        return out

    def _quiet_pids(
        self,
        text: str,
        file: str,
        last_lineno: int,
        keys: list[tuple[str, int | None]],
        last: dict[int, int],
        stats: set[int],
    ) -> None:
        """The last line of each process in the block (the per-line loop's `pid_last_raw`; a
        stats line does not count, as in the loop)."""
        best: dict[int, int] = {}
        for k, ls in last.items():
            key, pid = keys[k]
            if pid is None:
                continue
            while ls in stats:  # the loop keeps the process's line before its stats line
                j = text.rfind("\n" + key, 0, ls - 1 if ls else 0)
                ls = j + 1 if j >= 0 else (0 if ls and text.startswith(key) else -1)
                if ls < 0:
                    break
            if ls >= 0 and ls >= best.get(pid, -1):
                best[pid] = ls
        for pid, ls in best.items():
            le = text.find("\n", ls)
            line = text[ls:] if le < 0 else text[ls:le]
            self.an.pid_last_raw[pid] = (line[:MAX_LINE], file, last_lineno - text.count("\n", ls))
