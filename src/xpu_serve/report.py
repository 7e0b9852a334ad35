"""People's one-screen text for an Incident (what `xpu-serve diagnose` prints without --json,
and the bundle's summary.md): verdict, root cause with file:line evidence, consequences grouped
and counted ("oneCCL KVS broken pipe x3 on ranks 1-3"), a short timeline, what to do next, and
what could not be settled. Plain text: it must read the same when piped or in a file.
"""

from __future__ import annotations

from typing import Any

from xpu_serve.diagnosis import Incident

WIDTH = 118


def _cut(s: str, n: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


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


def _where(d: dict[str, Any]) -> str:
    if d.get("file") is None:
        return "(live)"
    return f"{d['file']}:{d['line']}"


def group_consequences(inc: Incident) -> list[str]:
    """One line per consequence signature: "LABEL xN on ranks 1-3 (first at FILE:LINE)"."""
    by_sig: dict[str, dict[str, Any]] = {}
    for g in inc.consequence_groups:
        sig = g["sig"]
        e = by_sig.setdefault(
            sig.id, {"label": sig.label, "count": 0, "ranks": set(), "procs": set(), "first": g}
        )
        e["count"] += g["count"]
        if g["rank"] is not None:
            e["ranks"].add(g["rank"])
        elif g["process"]:
            e["procs"].add(g["process"])
    lines = []
    for e in by_sig.values():
        who = ""
        if e["ranks"]:
            rs = sorted(e["ranks"])
            who = f" on rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)}"
        elif e["procs"]:
            who = " in " + ", ".join(sorted(e["procs"]))
        ev = e["first"]["first"]
        where = f"{ev.file}:{ev.line}" if ev.file else "live"
        lines.append(f"{e['label']} x{e['count']}{who}  [{where}]")
    return lines


def render_text(inc: Incident, width: int = WIDTH) -> str:
    """The one-screen report for people (about 40 lines at most)."""
    out: list[str] = []
    out.append(f"VERDICT: {inc.cause} — {_cut(inc.summary, width - 20)}")
    out.append("")
    r = inc.root
    if r:
        who = ", ".join(
            x
            for x in (
                r.get("process") or None,
                f"rank {r['rank']}" if r.get("rank") is not None else None,
                f"pid {r['pid']}" if r.get("pid") is not None else None,
                f"at {r['time']}" if r.get("time") else None,
            )
            if x
        )
        out.append(f"ROOT CAUSE: {inc.root_label or inc.cause}" + (f" ({who})" if who else ""))
        out.append(f"  {_where(r)}: {_cut(r.get('text') or '', width - 10)}")
        if inc.library:
            out.append(f"  library: {inc.library}")
        if inc.meaning:
            out.append(f"  {_cut(inc.meaning, width - 4)}")
    elif inc.cause == "unknown":
        out.append("ROOT CAUSE: nothing in the input supports a verdict.")
    if inc.hang:
        h = inc.hang
        delay = h.get("delay_s")
        d = ""
        if isinstance(delay, (int, float)):
            m, s = divmod(int(delay), 60)
            d = f"; {m}m{s:02d}s without progress before detection"
        out.append(
            f"HANG: last progress {h.get('last_progress') or 'unknown'}; detected {h.get('detected_at') or '?'}"
            f" by {h.get('detected_by') or '?'}{d}"
        )
    if inc.startup:
        su = inc.startup
        miss = su.get("missing_ranks") or []
        extra = f"; ranks that did not reach {su.get('missing_phase')}: {format_ranks(miss)}" if miss else ""
        out.append(f"START-UP: last milestone reached: {su.get('last_milestone')}{extra}")
    cons = group_consequences(inc)
    if cons:
        out.append("")
        out.append("WHAT FOLLOWED (consequences, not causes):")
        for line in cons[:10]:
            out.append(f"  {_cut(line, width - 4)}")
        if len(cons) > 10:
            out.append(f"  ... and {len(cons) - 10} more kinds (see --json)")
    if inc.timeline:
        out.append("")
        out.append("TIMELINE:")
        for t in inc.timeline[:15]:
            who = t.get("process") or t.get("source") or ""
            if t.get("rank") is not None and not str(who).endswith(str(t["rank"])):
                who = f"{who}/r{t['rank']}"
            mark = ">>" if t.get("role") == "root" else "  "
            out.append(
                f" {mark} {str(t.get('time') or '-'):>19}  {_cut(str(who), 14):<14} {_cut(t.get('text') or '', width - 42)}"
            )
    out.append("")
    out.append(
        "NEXT: "
        + (
            _cut(inc.advice, width - 6)
            if inc.advice
            else "collect the vLLM log from start-up on and the kernel log (dmesg -T) of the same time."
        )
    )
    if inc.notes:
        out.append("NOT SETTLED:")
        for n in inc.notes[:6]:
            out.append(f"  - {_cut(n, width - 6)}")
    return "\n".join(out) + "\n"
