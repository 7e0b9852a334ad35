"""The causal rules of `data/rules.yaml` applied to root candidates: each demotion rule kind turns
the candidates it selects into consequences of an anchor record; outrank rules replace the
first-ranked root by the record that explains it. Kinds and selectors: analysis/rules.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from xpu_serve.analysis.deaths import abnormal_death, death_signal, same_proc, signals_in_fields
from xpu_serve.analysis.rules import DemoteRule, OutrankRule, Rules, Select
from xpu_serve.analysis.timeorder import before, earliest, order_of, same_second, tkey
from xpu_serve.events import Event
from xpu_serve.signatures import SignatureTable


@dataclass
class Candidates:
    """Root candidates being ranked: `keep` (still candidates) and `demoted` (now consequences);
    `seen` is every signature id read as a root candidate or a consequence."""

    keep: list[Event]
    demoted: list[Event]
    seen: frozenset[str]


def matches(sel: Select, ev: Event, table: SignatureTable, rules: Rules) -> bool:
    """True when the event satisfies every field the selector gives."""
    sid = ev.signature or ""
    if (sel.signatures and sid not in sel.signatures) or sid in sel.except_:
        return False
    if (sel.causes and ev.cause not in sel.causes) or ev.cause in sel.not_causes:
        return False
    if (sel.sources and ev.source not in sel.sources) or ev.source in sel.not_sources:
        return False
    if sel.launcher_report is not None:
        row = table.by_id.get(sid)
        if bool(row is not None and row.extra.get("launcher_report")) != sel.launcher_report:
            return False
    if sel.abnormal is not None and abnormal_death(ev) != sel.abnormal:
        return False
    if sel.relay is not None and bool(rules.relay.search(ev.text)) != sel.relay:
        return False
    if sel.remote is not None and (ev.extra.get("node_rank") is not None) != sel.remote:
        return False
    if sel.signals:
        got = signals_in_fields(ev, sel.signal_fields) if sel.signal_fields else {death_signal(ev)}
        return bool(got & sel.signals)
    return True


Test = Callable[[Event], bool]


def _read_after(rule: DemoteRule, a: Event, ev: Event) -> bool:
    return order_of(ev) > order_of(a) and (rule.kind != "read-after-in-file" or ev.file == a.file)


def _stamped_after(rule: DemoteRule, a: Event, ev: Event, same: Test) -> bool:
    if before(a, ev):
        return True
    if rule.kind == "at-or-after":
        return same_second(a, ev)
    # `after`: the anchor's second too for the `same_second` selector, unless read before a
    # shell's or launcher's report of the death in the same file (printed after the process ended)
    return (
        rule.same_second is not None
        and same(ev)
        and same_second(a, ev)
        and not (a.source == "text" and ev.file == a.file and order_of(ev) < order_of(a))
    )


def _follows(rule: DemoteRule, a: Event, ev: Event, same: Test) -> bool:
    """`ev` follows the anchor `a` as the rule's kind reads it."""
    if rule.kind in ("read-after", "read-after-in-file"):
        return _read_after(rule, a, ev)
    if not _stamped_after(rule, a, ev, same):
        return False
    return not (rule.other_process and same_proc(a, ev))


def _anchor(rule: DemoteRule, c: Candidates, anchor: Test) -> Event | None:
    hits = [e for e in c.keep if anchor(e)]
    if not hits:
        return None
    if rule.kind in ("read-after", "read-after-in-file"):
        return min(hits, key=order_of)  # the first read
    return earliest(hits)


def apply_demote(rule: DemoteRule, c: Candidates, table: SignatureTable, rules: Rules) -> None:
    """Apply one demotion rule to `c` in place (see the kinds in analysis/rules.py)."""

    def sel(s: Select | None) -> Test:
        return (lambda e: matches(s, e, table, rules)) if s is not None else (lambda e: False)

    target, same = sel(rule.demote), sel(rule.same_second)
    if rule.same_peer:
        _demote_same_peer(rule, c, sel)
        return
    a: Event | None = None
    if rule.kind == "whenever-seen":
        if not rule.seen & c.seen:
            return
    else:
        a = _anchor(rule, c, sel(rule.anchor))
        if a is None:
            return
    keep: list[Event] = []
    for e in c.keep:
        hit = target(e) and (a is None or _follows(rule, a, e, same))
        (c.demoted if hit else keep).append(e)
    c.keep = keep


def peer_address(value: object) -> str | None:
    """An IP as one spelling: without brackets, an IPv4-mapped IPv6 address as its IPv4
    ("[::ffff:10.0.0.2]" -> "10.0.0.2"), lower case; None when `value` is not a non-empty str."""
    if not isinstance(value, str) or not value.strip("[] "):
        return None
    v = value.strip("[] ").lower()
    return v[7:] if v.startswith("::ffff:") and "." in v else v


def _demote_same_peer(rule: DemoteRule, c: Candidates, sel: Callable[[Select | None], Test]) -> None:
    """`same_peer` rules: a candidate naming a peer (`peer_addr`) follows the earliest anchor
    whose node is at that address (`node_address`), or precedes it by at most `window_s`; then
    the `after_link` candidates stamped at or after the first linked one. Others are kept."""
    anchor, target, same = sel(rule.anchor), sel(rule.demote), sel(rule.same_second)
    by_addr: dict[str, list[Event]] = {}
    for e in c.keep:
        addr = peer_address(e.extra.get("node_address"))
        if addr is not None and anchor(e):
            by_addr.setdefault(addr, []).append(e)
    if not by_addr:
        return
    keep: list[Event] = []
    linked: list[Event] = []
    for e in c.keep:
        a = earliest(by_addr.get(peer_address(e.extra.get("peer_addr")) or "", []))
        hit = a is not None and target(e) and (_follows(rule, a, e, same) or _within(a, e, rule.window_s))
        (linked if hit else keep).append(e)
    first, then = earliest(linked), sel(rule.after_link)
    if first is not None:
        after = [e for e in keep if then(e) and (before(first, e) or same_second(first, e))]
        keep = [e for e in keep if e not in after]
        linked.extend(after)
    c.demoted.extend(linked)
    c.keep = keep


def _within(a: Event, e: Event, window_s: float) -> bool:
    """`e` stamped at most `window_s` seconds before `a`, from the start of `e`'s second (vLLM's
    stamp is truncated to it and has no year: the time keys are compared, `timeorder.tkey`)."""
    ka, ke = tkey(a), tkey(e)
    if not window_s or ka is None or ke is None:
        return False
    try:
        ta, te = datetime(2000, *ka), datetime(2000, *ke[:5])  # (a leap year: any Feb 29 stamp)
    except ValueError:
        return False
    return 0.0 <= (ta - te).total_seconds() <= window_s


def apply_outrank(
    rule: OutrankRule, root: Event, cands: list[Event], table: SignatureTable, rules: Rules
) -> Event:
    """The earliest candidate matching `rule.by` when `root` matches `rule.root`, else `root`."""
    if not matches(rule.root, root, table, rules):
        return root
    by = earliest([e for e in cands if matches(rule.by, e, table, rules)])
    return by if by is not None else root


def outrank_notes(root: Event, cands: list[Event], table: SignatureTable, rules: Rules) -> list[str]:
    """The notes of the outrank rules whose `by` causes the final root has while a candidate
    matches their `root` (user space reported what the kernel's record explains)."""
    return [
        r.note
        for r in rules.outrank
        if r.note and root.cause in r.by.causes and any(matches(r.root, e, table, rules) for e in cands)
    ]
