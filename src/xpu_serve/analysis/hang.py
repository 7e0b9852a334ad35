"""Hang rules: which of the engine's waits and detections (shm_broadcast's 60 s warning, RPC
timeouts, the ProcessGroup watchdog, the supervisor's hang fact) make a serving engine's hang, and
the hang's facts (last progress, detection, delay)."""

from __future__ import annotations

from functools import cmp_to_key

from xpu_serve.analysis.incident import Hang
from xpu_serve.analysis.timeorder import cmp_time
from xpu_serve.analysis.work import Ctx, Work
from xpu_serve.events import Event


def waits_after_startup_progress(cx: Ctx, waits: list[Event]) -> list[Event]:
    """The engine's no-progress warnings (shm_broadcast's "No available shared memory broadcast
    block found in 60 seconds"...) not followed by a later start-up milestone: a wait that start-up
    then moved on from was long start-up work (graph capture, KV-cache profiling, torch.compile,
    weight loading), not a stall. [] stays []; without milestones the list is returned as is."""
    if not waits or not cx.st.milestones:
        return waits
    last_ms = max((ms.last for ms in cx.st.milestones.values()), key=cmp_to_key(cmp_time))
    return [e for e in waits if cmp_time(e, last_ms) >= 0]


def hang_cause(cx: Ctx, v: Work) -> None:
    """The engine's hang detections and waits; a serving engine without a root whose stats
    show no progress with work, or that waited after its last progress, hangs."""
    waits = [
        e
        for sid, evs in cx.st.precursors.items()
        for e in evs
        if cx.st.table.by_id[sid].cause == "engine-hang" and sid not in cx.st._set["not_hang_detection"]
    ]
    waits = waits_after_startup_progress(cx, waits)
    if v.root is None and cx.st.ready:
        lp = cx.st.last_progress
        late_waits = [e for e in waits if lp is None or cmp_time(lp, e) < 0]
        if cx.st.stall_stats is not None or late_waits:
            v.cause = "engine-hang"
        waits = late_waits or waits
    v.hang_precursors = waits


def hang_verdict(cx: Ctx, v: Work) -> None:
    """Hang facts (last progress, detection, delay); without a root the detection is the subject."""
    inc = v.inc
    inc.hang = hang_facts(cx, v.root, v.hang_precursors, inc.notes)
    if inc.root is None and v.cause == "engine-hang":
        det = v.hang_precursors[-1] if v.hang_precursors else cx.st.stall_stats
        if det is not None:
            p, r, pd = cx.subj.subject(det, inc.notes)
            inc.root = cx.parts.root_of(det, p, r, pd)


def hang_facts(cx: Ctx, root: Event | None, precursors: list[Event], notes: list[str]) -> Hang:
    """The hang's facts: the last progress (the supervisor's hang fact, else the last progress
    line), the detection (the root when it is a hang row, else the last wait or detection) and
    the delay between them on one clock; a note when no progress line was read."""
    last = cx.st.last_progress
    lp = None
    if cx.st.facts_hang is not None and cx.st.facts_hang.extra.get("last_progress"):
        lp = str(cx.st.facts_hang.extra["last_progress"])
    if lp is None and last is not None:
        lp = last.time_text
    det = root if root is not None and root.cause in ("engine-hang", "startup-hang") else None
    if det is None and precursors:
        det = precursors[-1]
    detected_by = None
    if det is not None:
        sig = cx.st.table.by_id[det.signature or ""]
        told = det.extra.get("detected_by") if det.source == "health" else None
        detected_by = (str(told) if told else None) or sig.detected_by or sig.label
    delay_s = None
    if last is not None and det is not None and last.time and det.time and det.source == last.source:
        delay = (det.time - last.time).total_seconds()
        if delay >= 0:
            delay_s = delay
    elif lp is None:
        notes.append("no progress line (stats with non-zero throughput) in the input: last progress unknown")
    first_wait = cx.st.precursors.get(cx.st._row["first_wait"])
    return Hang(
        lp,
        det.time_text if det is not None else None,
        detected_by,
        delay_s,
        cx.st.stall_stats.time_text if cx.st.stall_stats is not None else None,
        first_wait[0].time_text if first_wait else None,
    )
