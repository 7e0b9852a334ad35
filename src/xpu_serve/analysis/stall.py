"""Start-up stall rules: the API server's repeated waits for the engine, a hang or lagging ranks
before ready, an input that ends during start-up; the stall's facts (`Startup`) and subject (the
first rank that did not reach the last per-rank phase)."""

from __future__ import annotations

from functools import cmp_to_key

from xpu_serve.analysis.contract import PHASES
from xpu_serve.analysis.hang import hang_facts
from xpu_serve.analysis.incident import Root, Startup
from xpu_serve.analysis.timeorder import cmp_time
from xpu_serve.analysis.work import Ctx, Work
from xpu_serve.events import Event, parse_line

_ENGINE_UP_PHASES = {"engine-ready", "api"}  # the engine finished start-up; the API server follows


def startup_cause(cx: Ctx, v: Work) -> None:
    """Start-up stalls: repeated waits before any milestone; a hang or lagging ranks before
    ready; an input that ends in start-up without an error before the engine was up."""
    v.startup_info = info = startup_info(cx)
    startup_waits(cx, v)
    if not cx.st.ready and v.cause is None and not cx.st.milestones and v.n_waits >= 2:
        v.cause = "startup-hang"
    if (
        v.root is None
        and v.cause is None
        and not cx.st.ready
        and not cx.st.milestones
        and len(v.hang_precursors) >= 2
    ):
        # only the engine's repeated no-progress warnings were pasted (no start-up line, no
        # ready line): people paste those when a serving engine hangs; a stall during start-up
        # shows its start-up lines (handled above as startup-hang)
        v.cause = "engine-hang"
    if not cx.st.ready and v.cause in (None, "engine-hang") and cx.st.milestones:
        missing = info is not None and info.missing_ranks
        if v.cause == "engine-hang" or missing or v.hang_precursors or v.n_waits >= 2:
            v.cause = "startup-hang"
        elif (
            not cx.st.groups
            and not v.demoted
            and (info is None or info.last_milestone not in _ENGINE_UP_PHASES)
        ):
            # (once the engine reported itself initialised, the rest of start-up is the API
            # server's few seconds: a log ending there was cut short, not evidence of a stall)
            v.cause = "startup-hang"
            v.inc.notes.append(
                "the input ends during start-up without an error and without the ready line; no rank "
                "lags behind the others: a stall is assumed (or the log was cut short)"
            )
    if v.root is not None and v.root.signature == cx.st._row["startup_stall"]:
        v.cause = "startup-hang"


def startup_waits(cx: Ctx, v: Work) -> None:
    """The API server waiting, again and again, for the engine core to come up; waits
    followed by a later start-up milestone were the ordinary wait of a start-up that then
    moved on (the front end polls while the engine loads): not a stall."""
    waits = [
        e
        for sid, evs in cx.st.precursors.items()
        for e in evs
        if cx.st.table.by_id[sid].cause == "startup-hang"
    ]
    waits.sort(key=cmp_to_key(cmp_time))
    n = sum(n for sid, n in cx.st.precursor_counts.items() if cx.st.table.by_id[sid].cause == "startup-hang")
    if waits and cx.st.milestones:
        last_ms = max((ms.last for ms in cx.st.milestones.values()), key=cmp_to_key(cmp_time))
        if cmp_time(waits[-1], last_ms) < 0:
            waits, n = [], 0
    v.startup_waits, v.n_waits = waits, n


def startup_info(cx: Ctx) -> Startup | None:
    """The last start-up phase reached and the ranks that did not reach the last per-rank
    phase (their expected set: 0..world_size-1 and every rank seen in a phase); None without
    milestones."""
    if not cx.st.milestones:
        return None
    order = {p: i for i, p in enumerate(PHASES)}
    reached = sorted(cx.st.milestones, key=lambda p: order.get(p, -1))
    last = reached[-1]
    expected: set[int] = set(range(cx.st.world_size)) if cx.st.world_size else set()
    for ms in cx.st.milestones.values():
        expected |= ms.ranks
    missing: list[int] = []
    phase_for_missing = None
    for p in reversed(reached):
        ms = cx.st.milestones[p]
        if ms.per_rank and expected:
            miss = sorted(expected - ms.ranks)
            if miss:
                missing, phase_for_missing = miss, p
            break
    return Startup(last, cx.st.milestones[last].last, tuple(missing), phase_for_missing, cx.st.world_size)


def startup_verdict(cx: Ctx, v: Work) -> None:
    """A start-up stall's meaning (the lagging ranks) and subject (`startup_root`)."""
    inc, root, info = v.inc, v.root, v.startup_info
    inc.startup = info
    miss = info.missing_ranks if info is not None else ()
    if root is None or root.signature != cx.st._row["startup_stall"]:
        inc.root_label = "start-up stalled"
        if miss:
            inc.meaning = (
                f"Start-up stopped: rank(s) {', '.join(map(str, miss))} never reached "
                f"{info.missing_phase if info is not None else None} while the others did; nothing failed first."
            )
            inc.advice = (
                "Take stacks (py-spy dump) of the ranks that did not reach the phase; for ccl-init "
                "check oneCCL's transport (CCL_ATL_TRANSPORT, CCL_ZE_IPC_EXCHANGE) and the devices "
                "that rank sees (ZE_AFFINITY_MASK)."
            )
        else:
            last = info.last_milestone if info is not None else None
            inc.meaning = f"Start-up stopped after {last} without an error and without reaching ready."
    if inc.root is None or (root is not None and root.cause != "startup-hang"):
        startup_subject(cx, v)


def startup_subject(cx: Ctx, v: Work) -> None:
    """The stall's subject (`startup_root`), else the API server's last wait for the engine."""
    inc, root = v.inc, v.root
    inc.root, sr_ev = startup_root(cx, v.startup_info, root)
    if sr_ev is not None:
        v.tl_root = sr_ev
    if inc.root is None and v.startup_waits:
        w = v.startup_waits[-1]
        p, r4, pd = cx.subj.subject(w, inc.notes, link=False)
        inc.root = cx.parts.root_of(w, p, r4, pd)
        v.tl_root = w
        inc.hang = hang_facts(cx, None, v.startup_waits, inc.notes)
    if root is not None:
        inc.notes.append(
            f"{cx.st.table.by_id[root.signature or ''].label} happened before the server was ready"
        )


def startup_root(cx: Ctx, info: Startup | None, root: Event | None) -> tuple[Root | None, Event | None]:
    """The start-up stall's subject: the first rank that did not reach the last per-rank
    milestone (its last line), else the stall's own root, else the last milestone."""
    missing = info.missing_ranks if info is not None else ()
    if info is not None and missing:
        r = missing[0]
        pid = cx.subj.rank_pid(r)
        raw = cx.st.pid_last_raw.get(pid) if pid is not None else None
        if raw is not None:
            last = parse_line(raw[0], raw[1], raw[2])
            last.extra["_order"] = 0
            if last.time is not None:
                t = last.time
                last.extra["_tkey"] = (t.month, t.day, t.hour, t.minute, t.second, t.microsecond)
            return cx.parts.root_of(last, f"Worker_TP{r}", r, pid), last
        ev = info.last_milestone_event
        return cx.parts.root_of(ev, f"Worker_TP{r}", r, pid), None
    if root is not None:
        p, r2, pd = cx.subj.subject(root, [], link=False)
        return cx.parts.root_of(root, p, r2, pd), root
    if info is None:
        return None, None
    ev = info.last_milestone_event
    p, r3, pd = cx.subj.subject(ev, [], link=False)
    return cx.parts.root_of(ev, p, r3, pd), ev
