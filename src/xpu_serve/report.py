"""People's one-screen text for an Incident (what `xpu-serve diagnose` prints without --json,
and the bundle's summary.md): verdict, root cause with file:line evidence, consequences grouped
and counted as events ("oneCCL teardown (Broken pipe) on ranks 1-3 (3 events)"), a short timeline, what to do next, and
what could not be settled. Plain text: it must read the same when piped or in a file.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xpu_serve.analysis.incident import Root, RootEvidence
from xpu_serve.diagnosis import Incident

WIDTH = 118

_NO_ADVICE = "Collect the vLLM log from start-up on and the kernel log (dmesg -T) of the same time."

PathMap = Callable[[str], str]
"""How a report names an evidence file: the analysis' path (RUNTIME/logs/1/vllm.log) -> the path
shown (logs/vllm.log, relative to a bundle). Identity when None."""


def bundle_paths(log_dir: str | Path | None, kernel_file: str | Path | None = None) -> PathMap:
    """The PathMap of a bundle (xpu_serve.bundle's layout): a file under the incarnation's
    `log_dir` -> "logs/<its path under log_dir>" (the logs collector copies them whole there), the
    kernel log file the watcher read -> "kernel.log"; any other path unchanged."""
    base = Path(log_dir).resolve() if log_dir else None
    kern = str(Path(kernel_file).resolve()) if kernel_file else None

    def rel(path: str) -> str:
        p = Path(path).resolve()
        if kern is not None and str(p) == kern:
            return "kernel.log"
        if base is not None and p.is_relative_to(base):
            return f"logs/{p.relative_to(base)}"
        return path

    return rel


def _cut(s: str, n: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def _wrap(s: str, width: int, first: str, rest: str, max_lines: int = 6) -> list[str]:
    """`s` as lines of at most `width` characters, the first prefixed with `first`, the others
    with `rest` (sentences wrap, never cut; only text past `max_lines` lines is cut with "…")."""
    lines = textwrap.wrap(
        " ".join(s.split()),
        width=width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=True,
        break_on_hyphens=False,
    ) or [first.rstrip()]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        lines[-1] = (last if len(last) < width - 1 else last[: width - 2]) + " …"
    return lines


def format_ranks(ranks: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def _where(d: Root | RootEvidence, files: PathMap | None = None) -> str:
    if d.file is None:
        return "(live)"
    return f"{files(d.file) if files else d.file}:{d.line}"


def _cut_keeping_where(line: str, n: int) -> str:
    """`line` ("LABEL on ranks 1-3 (N events)  [FILE:LINE]") in at most `n` characters without losing
    the line number: a long FILE keeps its last two path parts ("…/logs/vllm.log:108"), then the
    label is cut."""
    if len(line) <= n or not line.endswith("]") or "  [" not in line:
        return _cut(line, n)
    head, where = line[:-1].rsplit("  [", 1)
    path, sep, lineno = where.rpartition(":")
    if sep and len(head) + len(where) + 3 > n:
        parts = path.split("/")
        if len(parts) > 2:
            where = "…/" + "/".join(parts[-2:]) + sep + lineno
    room = n - len(where) - 3
    if room < 12:
        return _cut(line, n)
    return f"{_cut(head, room)}  [{where}]"


def group_consequences(inc: Incident, files: PathMap | None = None) -> list[str]:
    """One line per kind of consequence (a signature, or a teardown burst whatever its rows):
    "LABEL on ranks 1-3 (N events)  [FILE:LINE]", N the events (analysis/occurrence.py), LABEL
    a burst's with the error it names ("oneCCL teardown (Broken pipe)"), FILE:LINE the first
    line of that kind (FILE through `files`)."""
    by_kind: dict[str, dict[str, Any]] = {}
    for g in inc.consequence_groups:
        e = by_kind.setdefault(
            f"burst:{g.burst}" if g.burst else g.sig.id,
            {"label": g.burst or g.sig.label, "count": 0, "ranks": set(), "procs": set(), "first": g.first},
        )
        e["count"] += g.count
        if g.detail and "detail" not in e:
            e["detail"] = g.detail
        if g.rank is not None:
            e["ranks"].add(g.rank)
        elif g.process:
            e["procs"].add(g.process)
    lines = []
    for e in by_kind.values():
        who = ""
        if e["ranks"]:
            rs = sorted(e["ranks"])
            who = f" on rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)}"
        elif e["procs"]:
            who = " in " + ", ".join(sorted(e["procs"]))
        ev = e["first"]
        where = f"{files(ev.file) if files else ev.file}:{ev.line}" if ev.file else "live"
        label = e["label"] + (f" ({e['detail']})" if e.get("detail") else "")
        n = e["count"]
        lines.append(f"{label}{who} ({n} event{'s' if n != 1 else ''})  [{where}]")
    return lines


def _root_lines(inc: Incident, width: int, files: PathMap | None) -> list[str]:
    """ROOT CAUSE: label (process, rank, pid, time), its FILE:LINE and text, what it means, the
    library, up to four records of the same death elsewhere; one line when nothing was found."""
    r = inc.root
    if not r:
        return ["ROOT CAUSE: nothing in the input supports a verdict."] if inc.cause == "unknown" else []
    who = ", ".join(
        x
        for x in (
            r.process or None,
            f"rank {r.rank}" if r.rank is not None else None,
            f"pid {r.pid}" if r.pid is not None else None,
            f"at {r.time}" if r.time else None,
        )
        if x
    )
    out = [f"ROOT CAUSE: {inc.root_label or inc.cause}" + (f" ({who})" if who else "")]
    out.extend(_wrap(r.text or "", width, f"  {_where(r, files)}: ", "    ", max_lines=3))
    if inc.meaning:
        out.extend(_wrap(inc.meaning, width, "  ", "  "))
    if inc.library:
        out.append(f"  library: {inc.library}")
    for e in inc.root_evidence[:4]:
        # the same death recorded elsewhere (the supervisor's exit fact, EngineCore's report)
        where = _where(e, files).replace("(live)", "live")
        when = f"{e.time} " if e.time else ""
        out.extend(_wrap(f"{when}{e.text or ''}", width, f"  also {where}: ", "    ", max_lines=2))
    return out


def _hang_lines(inc: Incident, width: int) -> list[str]:
    """HANG: last progress, when and by whom detected, minutes without progress."""
    if not inc.hang:
        return []
    h = inc.hang
    d = ""
    if h.delay_s is not None:
        m, s = divmod(int(h.delay_s), 60)
        d = f"; {m}m{s:02d}s without progress before detection"
    det = " ".join(
        x
        for x in (
            f"at {h.detected_at}" if h.detected_at else "",
            f"by {h.detected_by}" if h.detected_by else "",
        )
        if x
    )
    return _wrap(
        f"last progress {h.last_progress or 'unknown'}; detected {det or '(time and detector unknown)'}{d}",
        width,
        "HANG: ",
        "      ",
    )


def _startup_lines(inc: Incident) -> list[str]:
    """START-UP: the last milestone and the ranks that did not reach the next phase."""
    if not inc.startup:
        return []
    su = inc.startup
    miss = list(su.missing_ranks)
    extra = f"; ranks that did not reach {su.missing_phase}: {format_ranks(miss)}" if miss else ""
    return [f"START-UP: last milestone reached: {su.last_milestone}{extra}"]


def _consequence_lines(inc: Incident, width: int, files: PathMap | None) -> list[str]:
    """WHAT FOLLOWED: up to ten kinds of consequence (group_consequences), after a blank line."""
    cons = group_consequences(inc, files)
    if not cons:
        return []
    out = ["", "WHAT FOLLOWED (consequences, not causes):"]
    for line in cons[:10]:
        out.append(f"  {_cut_keeping_where(line, width - 4)}")
    if len(cons) > 10:
        more = len(cons) - 10
        out.append(f"  ... and {more} more kind{'s' if more > 1 else ''} (see --json)")
    return out


def _timeline_lines(inc: Incident, width: int) -> list[str]:
    """TIMELINE: up to 15 rows "MARK TIME WHO TEXT" (">>" the root, " +" its evidence), TIME in
    one format for every source (`TimelineItem.normalized_time`, analysis/clock.py)."""
    if not inc.timeline:
        return []
    out = ["", "TIMELINE:"]
    rows = inc.timeline[:15]
    # one column for the times: "2026-03-26 10:12:46.123" (23), wider for long kernel uptimes
    col = min(max([23, *(len(t.normalized_time or t.time or "-") for t in rows)]), 30)
    for t in rows:
        who = t.process or ""
        if not who and t.rank is not None:
            who = f"rank {t.rank}"
        elif not who:
            who = "(no prefix)" if t.source == "vllm" else str(t.source or "")
        elif t.rank is not None and not who.endswith(str(t.rank)):
            who = f"{who}/r{t.rank}"
        mark = {"root": ">>", "evidence": " +"}.get(str(t.role), "  ")
        when = _cut(t.normalized_time or t.time or "-", col)
        out.append(f" {mark} {when:>{col}}  {_cut(who, 14):<14} {_cut(t.text or '', width - col - 23)}")
    return out


def _notes_lines(inc: Incident, width: int) -> list[str]:
    """NOT SETTLED: up to six open questions."""
    if not inc.notes:
        return []
    out = ["NOT SETTLED:"]
    for n in inc.notes[:6]:
        out.extend(_wrap(n, width, "  - ", "    "))
    if len(inc.notes) > 6:
        out.append(f"  ... and {len(inc.notes) - 6} more (see --json)")
    return out


def render_text(inc: Incident, width: int = WIDTH, files: PathMap | None = None) -> str:
    """The one-screen report for people (about 40 lines at most); evidence files named through
    `files` (`bundle_paths` for a bundle's report.txt)."""
    summary = inc.summary.strip()  # one sentence without its period (the supervisor appends "; bundle")
    if not summary.endswith((".", "!", "?")):
        summary += "."
    out = _wrap(summary, width, f"VERDICT: {inc.cause} — ", "  ")
    out.append("")
    out += _root_lines(inc, width, files)
    out += _hang_lines(inc, width)
    out += _startup_lines(inc)
    out += _consequence_lines(inc, width, files)
    out += _timeline_lines(inc, width)
    out.append("")
    out += _wrap(inc.advice or _NO_ADVICE, width, "NEXT: ", "      ")
    out += _notes_lines(inc, width)
    return "\n".join(out) + "\n"


COMPACT_CONSEQUENCES = 6


def render_compact(inc: Incident, width: int = 100, files: PathMap | None = None) -> list[str]:
    """The report `xpu-serve up` prints when it records an incident: the verdict, the root cause
    with its FILE:LINE, up to COMPACT_CONSEQUENCES kinds of consequence and what to do next; at
    most 18 lines of at most `width` characters (the timeline and the open questions are in the
    bundle's report.txt)."""
    out = _wrap(inc.summary.strip().rstrip(".") + ".", width, f"VERDICT: {inc.cause} — ", "  ", max_lines=3)
    r = inc.root
    if r:
        out.append(_cut(f"ROOT CAUSE: {inc.root_label or inc.cause}", width))
        out.extend(_wrap(r.text or "", width, f"  {_where(r, files)}: ", "    ", max_lines=2))
    cons = group_consequences(inc, files)
    if cons:
        out.append("WHAT FOLLOWED (consequences, not causes):")
        out.extend(f"  {_cut_keeping_where(c, width - 2)}" for c in cons[:COMPACT_CONSEQUENCES])
        if len(cons) > COMPACT_CONSEQUENCES:
            out.append(f"  ... and {len(cons) - COMPACT_CONSEQUENCES} more kinds")
    out.extend(_wrap(inc.advice or _NO_ADVICE, width, "NEXT: ", "      ", max_lines=3))
    return out
