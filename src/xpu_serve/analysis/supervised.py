"""The supervisor's trigger as evidence: completing a verdict with what the supervisor saw itself.

The trigger (`facts.trigger`: why `xpu-serve up` declared the incarnation failed) is read live
through `Analyzer.add_event` and offline from the facts log (`facts.parse_fact_line`); both end
here, so `up` and `diagnose BUNDLE` give the same verdict:

- the signal a process of unknown exit status died by, when the verdict's root is that process's
  own crash dump naming it (`signal_from_root`; `Incident.trigger_signal` and a note);
- a note when the supervisor saw a process exit late (its event loop stalled) saying how well
  the time of death is known;
- the trigger's cause and detail when nothing in the logs supports a verdict (`fallback_cause`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from xpu_serve.analysis.contract import startup_summary
from xpu_serve.analysis.deaths import death_signal
from xpu_serve.analysis.incident import Incident, Root
from xpu_serve.events import Event
from xpu_serve.incarnation import Trigger
from xpu_serve.signatures import SignatureTable


def trigger_of(d: Any) -> Trigger | None:
    """The trigger (`incarnation.Trigger`, without its event) of a trigger fact's
    extra["trigger"] dict (`facts.trigger`); None when it is not one. Fields of the wrong type
    are left at their defaults."""
    if not isinstance(d, dict) or not isinstance(d.get("kind"), str):
        return None

    def num(k: str) -> float | None:
        v = d.get(k)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def typed(k: str, t: type) -> Any:
        v = d.get(k)
        return v if isinstance(v, t) and not isinstance(v, bool) else None

    return Trigger(
        kind=d["kind"],
        detail=str(d.get("detail") or ""),
        at=num("at") or 0.0,
        process=typed("process", str),
        rank=typed("rank", int),
        pid=typed("pid", int),
        exit_code=typed("exit_code", int),
        signal=typed("signal", str),
        detected_at=num("detected_at"),
        at_source=typed("at_source", str),
        loop_stall_s=num("loop_stall_s"),
    )


LOST_NODE_TRIGGERS = ("node-unreachable", "head-lost")
"""Triggers of a group's node not heard from (group/watcher.py): no heartbeat, no death report."""


def complete(inc: Incident, trig: Trigger, table: SignatureTable) -> None:
    """Finish `inc` (in place) with the trigger (module docstring)."""
    sig = signal_from_root(inc.root, trig, table)
    if sig is not None:
        # the exit status was lost (the worker's parent reaped it first, no proc connector
        # here) but the root is the process's own crash dump naming the signal
        inc.trigger_signal = sig
        inc.notes.append(
            f"{trig.process} (pid {trig.pid}): exit status not seen by the supervisor; "
            f"signal {sig} taken from its crash dump"
        )
    timing = death_time_note(trig)
    if timing:
        inc.notes.append(timing)
    if trig.kind == "rendezvous-stall":
        inc.notes.append(trig.detail)  # the node whose ranks the stall waits for
        if inc.cause == "startup-hang":  # the verdict names the node too, not only its ranks
            inc.summary = startup_summary(inc, trig.detail)
    if trig.kind in LOST_NODE_TRIGGERS and inc.cause in (None, "", "unknown", "startup-hang", "engine-hang"):
        # a group's node lost with no death seen is its own cause (a follower's log never shows
        # the API server's ready lines: a stall read from it would be the head's silence)
        inc.cause, inc.summary = "node-unreachable", trig.detail
    if trig.kind == "group-restart" and inc.cause in ("startup-hang", "engine-hang"):
        # a follower stopped for the head's new epoch (the group's verdict is the head's): its log
        # never shows the API server's ready lines, so a stall or hang read from it names a rank
        # that may not even run on this node (measured: "rank 0 did not reach dist-init" on node 1)
        inc.notes.append(f"not this node's verdict: {inc.summary} (read from a follower's log)")
        inc.cause, inc.root, inc.summary = "unknown", None, trig.detail
    if inc.cause in (None, "", "unknown"):
        # nothing in the logs supports a verdict: say what the supervisor itself saw
        fb = fallback_cause(trig.kind, trig.detail)
        inc.cause = fb
        if fb != "unknown" or not inc.summary:
            inc.summary = trig.detail


def fallback_cause(kind: str, detail: str) -> str:
    """The cause a trigger of this kind and detail alone supports, when the logs support no verdict."""
    return {
        "process-exit": "process-crash",
        # /health timing out while every process lives is a hung server; failing (503, refused)
        # follows a death the process watch may not have reported
        "health": "engine-hang" if detail.endswith(": timed out") else "process-crash",
        "startup-stall": "startup-hang",
        "startup-timeout": "startup-hang",
        "hang": "engine-hang",
        "config": "config-error",
        # a multi-node group (group/watcher.py): a follower's death, a lost node, a node that
        # never joined the rendezvous
        "node-death": "process-crash",
        "node-unreachable": "node-unreachable",
        "head-lost": "node-unreachable",
        "rendezvous-stall": "startup-hang",
    }.get(kind, "unknown")


def death_time_note(trig: Trigger) -> str | None:
    """A note when the supervisor saw a process exit late (its loop stalled), saying how well
    the time of death is known; None otherwise."""
    if trig.kind != "process-exit" or not trig.loop_stall_s or trig.detected_at is None:
        return None
    seen = _iso(trig.detected_at)
    who = f"{trig.process} (pid {trig.pid})"
    stall = f"the supervisor had not run for {trig.loop_stall_s:.1f} s (stopped or starved)"
    if trig.at_source == "kernel":
        return f"{who}: died at {_iso(trig.at)} (the kernel's exit event), seen at {seen}: {stall}"
    return (
        f"{who}: seen dead at {seen} after {stall}; it died no later than that, and the real time "
        "of death is unknown (no kernel exit event: the proc connector is not available)"
    )


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def signal_from_root(root: Root | None, trig: Trigger, table: SignatureTable) -> str | None:
    """The signal ("SIGSEGV"...) a process-exit trigger of unknown status died by, as its own
    crash dump says, or None.

    Only when the trigger is a process exit with neither code nor signal known, and the verdict's
    root is that same process (by pid, or by name when the root has no pid, as for an unprefixed
    dump the analysis attributed to it), and the root's text or one of its evidence lines is a
    crash dump the signature table reads a signal name from (`signame`: "Fatal Python error:
    Segmentation fault", "!!!!!!! Segfault encountered !!!!!!!"; `deaths.death_signal` maps it)."""
    if trig.kind != "process-exit" or trig.signal is not None or trig.exit_code is not None or root is None:
        return None
    same = root.pid == trig.pid if root.pid is not None else root.process == trig.process
    if not same:
        return None
    for text in [root.text, *(e.text for e in root.evidence or ())]:
        ev = Event(source="vllm", text=text, raw=text)
        m = table.match(ev)
        if m is None or "signame" not in m[1].groupdict():
            continue
        ev.extra["signame"] = m[1].group("signame")
        got = death_signal(ev)
        if got:
            return got
    return None
