"""The signature table: known failure, progress and context lines, as data.

`data/signatures.yaml` holds one row per known line shape. Each row:

- id: stable identifier (used in verdicts: `consequences[].signature`, `timeline[].signature`);
- source: event sources it applies to ("vllm", "ccl", "kernel", "process", "health",
  "supervisor", "text"), a list, or "any";
- pattern: a Python regular expression searched in `Event.text` (the message without wrappers
  and prefixes). Named groups are copied to the event's `extra` (library, pid, worker, phase...);
- role: root (a candidate for the first real failure), consequence (what follows a failure),
  precursor (a warning sign before a failure: stalls, waits), progress (start-up milestones and
  throughput), context (worth showing, never a verdict);
- cause: a cause id from the verdict contract (`/work/shared/cases/README.md`), or null;
- meaning, advice: for people; label: a short name for grouped counts ("oneCCL KVS broken pipe");
- example: a real line (from a public report or one of the cases) that the row must match;
- optional: keywords (literal substrings, one of which must be in the text: a fast pre-filter;
  derived from the pattern when absent), level (e.g. "CCL_ERROR"), weight (rank among root
  candidates; default by cause), phase and per_rank (start-up milestones), in_traceback (only
  inside a Python traceback), overlaps (ids of rows whose examples this row also matches, on
  purpose: the more specific row comes first in the table and wins), detected_by (for hang
  detectors: what detected it), fatal (vLLM is dead or exiting after this line: the supervisor
  fails the incarnation on it even when the row is a consequence);
  opens_burst (a GPU driver's own fault record that opens a burst of kernel records: the page
  fault before the job timeout, reset and wedge that follow it; see analysis/rootdeath.py primary_gpu_fault);
  codes ({table, class}: the pattern's `{codes}` is replaced by an alternation of the keys of
  `data/<table>.yaml` whose entry has that `class`, e.g. the NVIDIA Xids of one class in
  `data/nvidia_xid.yaml`: knowledge keyed by a number stays one table, not one row per number);
  teardown_burst (a label, "oneCCL teardown": the row is a line of a collective library's teardown
  burst; the lines of one rank's burst, whatever their rows, count as one consequence event, see
  analysis/occurrence.py; a `burst_detail` named group gives the error the burst names, "Broken pipe");
  quotes_root (a consequence line that may quote the error that caused it, "... terminated with exception: CUDA error: ...": the text
  after the row's match is classified again and a root row found there gives the line its cause),
  launcher_report (a shell's or launcher's report of its child's death: a SIGKILL/SIGTERM it reports
  after vLLM's own report of an earlier death is the end of vLLM's shutdown, a consequence).

Classification is first match in table order among the rows whose keywords occur in the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

try:  # Aho-Corasick automaton (Rust): one pass over a text for all keywords; a regex alternation of
    # ~150 literals is ~50x slower and pyahocorasick ~4x slower per line (measured, bench/README.md)
    import ahocorasick_rs
except ImportError:  # pragma: no cover - ahocorasick-rs is a dependency; keep working without it
    ahocorasick_rs = None  # type: ignore[assignment]

from xpu_serve.events import Event
from xpu_serve.yamldata import DataError, load_data, load_packaged

ROLES = ("root", "consequence", "precursor", "progress", "context")
CAUSES = (
    "umd-segfault",
    "gpu-fault",
    "device-lost",
    "device-oom",
    "host-oom",
    "collective-failure",
    "process-exception",
    "process-crash",
    "engine-hang",
    "startup-hang",
    "config-error",
    "node-unreachable",
    "unknown",
)
SUPERVISOR_CAUSES = ("node-unreachable",)
"""Causes only a supervisor observes, with no log line of their own (a group's node not heard
from: group/watcher.py); no signature row is their root."""
SOURCES = ("vllm", "ccl", "kernel", "process", "health", "supervisor", "text")
# Default rank of a root candidate by cause (higher wins); a row may override with `weight`.
CAUSE_WEIGHT = {
    "umd-segfault": 100,
    "gpu-fault": 90,
    "host-oom": 85,
    "config-error": 75,
    "device-oom": 72,
    "device-lost": 70,
    "collective-failure": 65,
    "node-unreachable": 60,
    "process-exception": 50,
    "process-crash": 40,
    "engine-hang": 20,
    "startup-hang": 10,
    "unknown": 0,
}
_META = set(".^$*+?{}[]()|\\")


class SignatureError(ValueError):
    """The signature table is malformed (message names the row and the field)."""


@dataclass(frozen=True)
class Signature:
    """One row of the table (see the module docstring for the fields). `regex` is the row's
    pattern as text ({codes} expanded); `pattern` its compiled form, compiled at first use
    (SignatureError naming `origin` and the row when it does not compile)."""

    id: str
    sources: tuple[str, ...]
    regex: str
    role: str
    cause: str | None
    meaning: str
    advice: str
    example: str
    label: str
    keywords: tuple[str, ...]
    level: str | None = None
    weight: int = 0
    phase: str | None = None
    per_rank: bool = False
    in_traceback: bool = False
    overlaps: tuple[str, ...] = ()
    detected_by: str | None = None
    index: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    origin: str = "signatures.yaml"

    @cached_property
    def pattern(self) -> re.Pattern[str]:
        """The compiled `regex` (cached on the row). Raises SignatureError for a bad pattern."""
        try:
            return re.compile(self.regex)
        except re.error as e:
            raise SignatureError(f"{self.origin}: {self.id}: bad pattern: {e}") from e


def derive_keyword(pattern: str) -> str | None:
    """The longest literal run (>= 3 characters) at nesting depth 0 of a regex without a
    top-level alternation, or None when there is none (then the row must list `keywords`)."""
    depth = 0
    runs: list[str] = []
    cur: list[str] = []
    i = 0
    n = len(pattern)
    top_alt = False
    while i < n:
        ch = pattern[i]
        lit: str | None = None
        if ch == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            if nxt in _META or nxt in "/-:'\" ":
                lit = nxt
            i += 2
        elif ch in "([":
            if ch == "[":
                j = pattern.find("]", i + 2)
                i = (j + 1) if j > 0 else n
            else:
                depth += 1
                i += 1
            lit = None
        elif ch == ")":
            depth -= 1
            i += 1
        elif ch == "|":
            if depth == 0:
                top_alt = True
            i += 1
        elif ch in "^$.":
            i += 1
        elif ch in "*+?{":
            # the previous literal character is optional or repeated: drop it from the run
            if cur and ch in "*?{":
                cur.pop()
            if ch == "{":
                j = pattern.find("}", i)
                i = (j + 1) if j > 0 else n
            else:
                i += 1
            runs.append("".join(cur))
            cur = []
            continue
        else:
            lit = ch
            i += 1
        if lit is not None and depth == 0:
            cur.append(lit)
        else:
            runs.append("".join(cur))
            cur = []
    runs.append("".join(cur))
    if top_alt:
        return None
    best = max(runs, key=len, default="")
    return best if len(best) >= 3 else None


class SignatureTable:
    """The compiled table with a keyword pre-filter.

    `match(event, in_traceback)` -> (Signature, re.Match) or None: the first row in table order
    that applies to the event's source (and level) and whose pattern is found in `event.text`.
    """

    def __init__(self, rows: list[Signature]) -> None:
        self.rows = rows
        self.by_id = {r.id: r for r in rows}
        self._kw_rows: dict[str, list[Signature]] = {}
        self._always: list[Signature] = []
        self._tb_rows: list[Signature] = []
        for r in rows:
            if r.in_traceback:
                self._tb_rows.append(r)
            elif not r.keywords:
                self._always.append(r)
            for k in r.keywords:
                self._kw_rows.setdefault(k, []).append(r)
        kws = sorted(self._kw_rows, key=len, reverse=True)
        self._ac: Any = None
        self._kw_re: re.Pattern[str] | None = None
        if ahocorasick_rs is not None and kws:
            self._ac = ahocorasick_rs.AhoCorasick(kws)
        elif kws:  # the fallback alternation costs ~25 ms to compile: only without the automaton
            self._kw_re = re.compile("|".join(re.escape(k) for k in kws))
        self._always_sources = {s for r in self._always for s in r.sources} | (
            set(SOURCES) if any(not r.sources for r in self._always) else set()
        )

    def compile_all(self) -> None:
        """Compile every row's pattern now. Raises SignatureError naming the file and the first
        row whose pattern does not compile."""
        for r in self.rows:
            r.pattern  # noqa: B018 - compiles and caches

    def get(self, sig_id: str) -> Signature | None:
        """The row with this id, or None."""
        return self.by_id.get(sig_id)

    def trigger_automaton(self, extra: tuple[str, ...] = (), skip_roles: tuple[str, ...] = ()) -> Any:
        """An Aho-Corasick automaton (ahocorasick_rs.AhoCorasick) of every keyword (of rows whose
        role is not in `skip_roles`) plus `extra`; None without ahocorasick-rs. A line that contains
        none of them cannot match a keyword row."""
        if ahocorasick_rs is None:
            return None
        return ahocorasick_rs.AhoCorasick(self.trigger_keywords(extra, skip_roles))

    def trigger_keywords(self, extra: tuple[str, ...] = (), skip_roles: tuple[str, ...] = ()) -> list[str]:
        """The patterns of `trigger_automaton`: every keyword of rows whose role is not in
        `skip_roles`, then `extra`."""
        kws = [k for k, rows in self._kw_rows.items() if any(r.role not in skip_roles for r in rows)]
        return kws + list(extra)

    def candidates(self, ev: Event, in_traceback: bool = False) -> list[Signature]:
        """Rows whose pre-filter passes for this event, in table order."""
        text = ev.text
        found: list[Signature] = []
        if self._ac is not None:
            hits = self._ac.find_matches_as_strings(text, overlapping=True)
        elif self._kw_re is not None:
            hits = self._kw_re.findall(text)
        else:
            hits = []
        if True:
            if hits:
                if len(hits) == 1:
                    found = list(self._kw_rows[hits[0]])
                else:
                    seen: dict[int, Signature] = {}
                    for h in hits:
                        for r in self._kw_rows[h]:
                            seen[r.index] = r
                    found = list(seen.values())
        if ev.source in self._always_sources:
            found.extend(self._always)
        if in_traceback:
            found.extend(self._tb_rows)
        if len(found) > 1:
            found.sort(key=lambda r: r.index)
        return found

    def match(self, ev: Event, in_traceback: bool = False) -> tuple[Signature, re.Match[str]] | None:
        """First matching row and its regex match, or None."""
        cands = self.candidates(ev, in_traceback)
        if not cands:
            return None
        src = ev.source
        for r in cands:
            if r.sources and src not in r.sources:
                continue
            if r.level is not None and ev.level != r.level:
                continue
            m = r.pattern.search(ev.text)
            if m:
                return r, m
        return None

    def all_matches(self, ev: Event, in_traceback: bool = True) -> list[Signature]:
        """Every row that matches the event (for the table's own tests: overlaps)."""
        out = []
        for r in self.rows:
            if r.sources and ev.source not in r.sources:
                continue
            if r.level is not None and ev.level != r.level:
                continue
            if r.in_traceback and not in_traceback:
                continue
            if r.pattern.search(ev.text):
                out.append(r)
        return out


def _as_tuple(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(str(x) for x in v)


def parse_table(data: Any, origin: str = "signatures.yaml", compile_now: bool = True) -> SignatureTable:
    """Build a table from the YAML document (a list of row mappings, or {"signatures": [...]}).

    Raises SignatureError naming the row id and field for a bad row. With `compile_now` False
    the patterns are compiled at each row's first use (`Signature.pattern`): compiling the packaged
    table's ~150 rows costs ~30 ms, a fifth of a `diagnose` of a small file, and most rows never see
    a candidate line; tests/test_signatures.py compiles every packaged row.
    """
    if isinstance(data, dict):
        data = data.get("signatures")
    if not isinstance(data, list):
        raise SignatureError(f"{origin}: expected a list of signature rows")
    rows: list[Signature] = []
    seen: set[str] = set()
    for i, row in enumerate(data):
        if not isinstance(row, dict) or "id" not in row:
            raise SignatureError(f"{origin}: row {i + 1}: not a mapping with an id")
        rid = str(row["id"])
        if rid in seen:
            raise SignatureError(f"{origin}: {rid}: duplicate id")
        seen.add(rid)
        rows.append(_parse_row(row, i, f"{origin}: {rid}", origin))
    table = SignatureTable(rows)
    if compile_now:
        table.compile_all()
    return table


def _row_sources(row: dict[str, Any], where: str) -> tuple[str, ...]:
    """The row's required fields, role and cause checked; its sources (() for "any"). Raises
    SignatureError prefixed with `where` ("FILE: ID")."""
    for key in ("pattern", "role", "meaning", "example"):
        if not row.get(key):
            raise SignatureError(f"{where}: missing {key}")
    role = row["role"]
    if role not in ROLES:
        raise SignatureError(f"{where}: role must be one of {', '.join(ROLES)}")
    cause = row.get("cause")
    if cause is not None and cause not in CAUSES:
        raise SignatureError(f"{where}: unknown cause {cause!r}")
    if role == "root" and cause is None:
        raise SignatureError(f"{where}: a root row needs a cause")
    src = row.get("source", "any")
    sources = () if src == "any" else _as_tuple(src)
    for s in sources:
        if s not in SOURCES:
            raise SignatureError(f"{where}: unknown source {s!r}")
    return sources


def _row_pattern(row: dict[str, Any], where: str) -> tuple[str, tuple[str, ...]]:
    """(pattern text with ``{codes}`` expanded, compiled later by `Signature.pattern`; prefilter
    keywords: listed, or derived from the pattern unless the row is matched only in tracebacks or
    by level)."""
    pattern = str(row["pattern"])
    if row.get("codes") is not None:
        pattern = pattern.replace("{codes}", _codes_alternation(row["codes"], where))
    kws = _as_tuple(row.get("keywords"))
    if "keywords" not in row and not row.get("in_traceback", False) and not row.get("level"):
        k = derive_keyword(pattern)
        if k is None:
            raise SignatureError(f"{where}: cannot derive a keyword from the pattern; list `keywords`")
        kws = (k,)
    return pattern, kws


def _parse_row(row: dict[str, Any], index: int, where: str, origin: str) -> Signature:
    """Row `index` (0-based) of the table from file `origin` as a Signature; raises SignatureError."""
    sources = _row_sources(row, where)
    regex, kws = _row_pattern(row, where)
    cause = row.get("cause")
    rid = str(row["id"])
    return Signature(
        id=rid,
        sources=sources,
        regex=regex,
        role=row["role"],
        cause=cause,
        meaning=str(row["meaning"]).strip(),
        advice=str(row.get("advice") or "").strip(),
        example=str(row["example"]),
        label=str(row.get("label") or rid),
        keywords=kws,
        level=row.get("level"),
        weight=int(row.get("weight", CAUSE_WEIGHT.get(cause or "unknown", 0))),
        phase=row.get("phase"),
        per_rank=bool(row.get("per_rank", False)),
        in_traceback=bool(row.get("in_traceback", False)),
        overlaps=_as_tuple(row.get("overlaps")),
        detected_by=row.get("detected_by"),
        index=index,
        extra={
            "fatal": bool(row.get("fatal", False)),
            "quotes_root": bool(row.get("quotes_root", False)),
            "launcher_report": bool(row.get("launcher_report", False)),
            "opens_burst": bool(row.get("opens_burst", False)),
            "teardown_burst": str(row["teardown_burst"]) if row.get("teardown_burst") else None,
        },
        origin=origin,
    )


@lru_cache(maxsize=8)
def code_table(name: str) -> dict[int, dict[str, Any]]:
    """The packaged `data/<name>.yaml` table keyed by number ({code: {class, name, ...}}; the file
    holds one top-level mapping). Raises SignatureError when it is missing or malformed."""
    try:
        doc = load_packaged(name)
    except DataError as e:
        raise SignatureError(str(e)) from e
    except OSError as e:
        raise SignatureError(f"data/{name}.yaml: {e}") from e
    entries = next(iter(doc.values()), None) if isinstance(doc, dict) and len(doc) == 1 else None
    if not isinstance(entries, dict) or not all(isinstance(k, int) and isinstance(v, dict) for k, v in entries.items()):
        raise SignatureError(f"data/{name}.yaml: expected one mapping of number -> entry")
    return entries


def _codes_alternation(spec: Any, where: str) -> str:
    if not isinstance(spec, dict) or not spec.get("table") or not spec.get("class"):
        raise SignatureError(f"{where}: codes needs a table and a class")
    codes = sorted(k for k, v in code_table(str(spec["table"])).items() if v.get("class") == spec["class"])
    if not codes:
        raise SignatureError(f"{where}: no code of class {spec['class']!r} in {spec['table']}")
    return "(?:" + "|".join(str(c) for c in sorted(codes, key=lambda c: -len(str(c)))) + ")"


def load_table(path: str | Path | None = None) -> SignatureTable:
    """Load a table from `path`, or the packaged `xpu_serve/data/signatures.yaml` (cached).

    Raises OSError when the file cannot be read, SignatureError when it is malformed.
    """
    if path is None:
        return _default_table()
    p = Path(path)
    return parse_table(load_data(p.read_text(encoding="utf-8")), origin=str(p))


@lru_cache(maxsize=1)
def _default_table() -> SignatureTable:
    return parse_table(load_packaged("signatures"), origin="data/signatures.yaml", compile_now=False)
