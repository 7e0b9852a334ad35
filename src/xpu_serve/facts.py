"""Events for facts the supervisor observes itself (not lines some process printed).

Live sources build these so that the one analysis (`diagnosis.py`) sees process exits, hangs,
health failures and start-up stalls exactly like log lines: the signature table has a row for
each text shape below (source "process", "health" or "supervisor"). The trigger (why the
supervisor declared the incarnation failed) is a fact too (`trigger`): the analysis reads it to
complete the verdict (`analysis/supervised.py`), it is not a record to classify.

Every fact the supervisor feeds the analysis is also written to the incarnation's facts log
(RUNTIME/logs/N/facts.log, copied into the bundle's logs/), one line per fact (`to_line`,
`parse_fact_line`), so `xpu-serve diagnose BUNDLE` reads what the live analysis read:

    2026-12-02T02:31:07.123456+00:00 xpu-serve fact process-exit {"source": "process", ...}

the time of the fact (ISO 8601, UTC, microseconds), the tag `xpu-serve fact`, the kind
(`process-exit`, `hang`, `rank-states`, `health-failed`, `startup-stall`, `trigger`, or the event's source for
a fact of another watcher), then one JSON object: source, text, process, rank, pid, level,
extra (without the py-spy stacks, which are the bundle's stacks/) and `after`: the number of
lines of the incarnation's vllm.log (rotations concatenated, oldest first) the live analysis had
read when the fact arrived, so an offline reading puts it at the same place.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any

from xpu_serve.events import Event

FACT_SOURCES = frozenset({"process", "health", "supervisor"})  # sources of the supervisor's own facts
FACT_TAG = "xpu-serve fact"
FACTS_LOG = "facts.log"  # its name in RUNTIME/logs/N/ and in a bundle's logs/
_LINE_RE = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00) xpu-serve fact ([\w-]+) (\{.*\})\s*$")
_UNLOGGED_EXTRA = frozenset({"stacks"})  # kept elsewhere in the bundle (stacks/<pid>-<name>.txt)


def _fact(source: str, text: str, at: float | None, level: str | None = "ERROR", **kw: Any) -> Event:
    """A fact Event: `text` (also raw), the time `at` (epoch s; now when None) as naive local
    time and vLLM's "MM-DD HH:MM:SS", and the other Event fields in `kw`."""
    t = datetime.fromtimestamp(at) if at is not None else datetime.now()
    return Event(
        source=source, text=text, raw=text, time=t, time_text=t.strftime("%m-%d %H:%M:%S"), level=level, **kw
    )


def process_exit(
    name: str, pid: int, rank: int | None, exit_code: int | None, signal: str | None, at: float | None = None
) -> Event:
    """A watched vLLM process died. `signal` is a name ("SIGSEGV") when killed by a signal.

    Text shapes: "Worker_TP0 (pid 7986) died: killed by SIGSEGV",
    "EngineCore (pid 7732) died: exit code 1", "APIServer (pid 7700) died: exit status unknown".
    extra: {"fact": "process-exit", "exit_code": int | None, "signal": str | None}.
    """
    if signal:
        how = f"killed by {signal}"
    elif exit_code is not None:
        how = f"exit code {exit_code}"
    else:
        how = "exit status unknown"
    extra: dict[str, object] = {"fact": "process-exit", "exit_code": exit_code, "signal": signal}
    return _fact("process", f"{name} (pid {pid}) died: {how}", at, process=name, rank=rank, pid=pid, extra=extra)


def hang(
    no_progress_s: float,
    running: int,
    waiting: int,
    last_progress: datetime | None,
    detected_by: str = "xpu-serve hang watchdog",
    at: float | None = None,
) -> Event:
    """The engine made no progress for `no_progress_s` seconds with requests in flight.

    Text shape: "hang watchdog: no progress for 92s with 1 running, 0 waiting requests".
    extra: {"fact": "hang", "last_progress": "MM-DD HH:MM:SS" or None, "detected_by": str,
    "no_progress_s": float}.
    """
    text = f"hang watchdog: no progress for {no_progress_s:.0f}s with {running} running, {waiting} waiting requests"
    extra: dict[str, object] = {
        "fact": "hang",
        "last_progress": last_progress.strftime("%m-%d %H:%M:%S") if last_progress else None,
        "detected_by": detected_by,
        "no_progress_s": no_progress_s,
    }
    return _fact("health", text, at, extra=extra)


def health_failed(failures: int, detail: str, at: float | None = None) -> Event:
    """`/health` failed `failures` probes in a row. Text: "/health failed 3 probes in a row: HTTP 503".
    extra: {"fact": "health-failed"}."""
    return _fact("health", f"/health failed {failures} probes in a row: {detail}", at, extra={"fact": "health-failed"})


def startup_stall(stalled_s: float, phase: str, missing_ranks: list[int], at: float | None = None) -> Event:
    """Start-up made no progress for `stalled_s` seconds.

    Text shape: "start-up stalled for 600s in phase ccl-init; ranks not reached: 1, 3".
    extra: {"fact": "startup-stall", "phase": str, "missing_ranks": list[int]}.
    """
    ranks = ", ".join(str(r) for r in missing_ranks) if missing_ranks else "none"
    text = f"start-up stalled for {stalled_s:.0f}s in phase {phase}; ranks not reached: {ranks}"
    extra: dict[str, object] = {"fact": "startup-stall", "phase": phase, "missing_ranks": list(missing_ranks)}
    return _fact("supervisor", text, at, extra=extra)


def rank_states(ranks: list[dict[str, Any]], at: float | None = None) -> Event:
    """What each TP rank was doing when a hang was detected: `ranks` is one dict per worker,
    {"process": "Worker_TP1", "rank": 1, "pid": 7986, "state": "T" (proc(5) field 3, held in
    every sample; None when it varied or the process is gone), "wait": the collective its stack
    waits in, "outside" or "unknown" (analysis/stacks.py collective_wait)}.

    Text shape: "TP ranks at the hang: Worker_TP0 (rank 0) state S, in all_reduce; Worker_TP1
    (rank 1) state T, outside a collective". extra: {"fact": "rank-states", "ranks": ranks}.
    """
    parts = []
    for r in ranks:
        wait = r.get("wait")
        where = {"outside": "outside a collective", "unknown": "stack unknown"}.get(str(wait), f"in {wait}")
        parts.append(f"{r.get('process')} (rank {r.get('rank')}) state {r.get('state') or '?'}, {where}")
    text = "TP ranks at the hang: " + "; ".join(parts)
    extra: dict[str, object] = {"fact": "rank-states", "ranks": [dict(r) for r in ranks]}
    return _fact("supervisor", text, at, level=None, extra=extra)


def trigger(kind: str, detail: str, at: float, fields: dict[str, Any]) -> Event:
    """Why the supervisor failed the incarnation (`incarnation.Trigger`): `kind`, `detail`, `at`
    (epoch s) and `fields` (process, rank, pid, exit_code, signal, detected_at, at_source,
    loop_stall_s). Text: "trigger process-exit: Worker_TP0 (pid 7986) died: killed by SIGSEGV".
    extra: {"fact": "trigger", "trigger": {kind, detail, at, **fields}}."""
    extra: dict[str, object] = {"fact": "trigger", "trigger": {"kind": kind, "detail": detail, "at": at, **fields}}
    return _fact("supervisor", f"trigger {kind}: {detail}", at, level=None, extra=extra)


def kind_of(ev: Event) -> str:
    """The fact's kind for the facts log: extra["fact"] when set, else the event's source."""
    k = ev.extra.get("fact")
    return k if isinstance(k, str) and k else ev.source


def to_line(ev: Event, after: int) -> str:
    """One facts-log line (module docstring) of a fact event read after `after` vllm.log lines."""
    t = ev.time or datetime.now()
    stamp = t.astimezone(timezone.utc).isoformat(timespec="microseconds")
    extra = {k: v for k, v in ev.extra.items() if not k.startswith("_") and k not in _UNLOGGED_EXTRA}
    doc = {
        "source": ev.source,
        "text": ev.text,
        "process": ev.process,
        "rank": ev.rank,
        "pid": ev.pid,
        "level": ev.level,
        "extra": extra,
        "after": after,
    }
    return f"{stamp} {FACT_TAG} {kind_of(ev)} {json.dumps(doc, default=str, ensure_ascii=False)}"


def parse_fact_line(line: str) -> tuple[Event, int] | None:
    """(the fact's Event, as the live analysis got it; its `after` line count) of a facts-log
    line, or None when the line is not one (any other text, a cut or malformed line). Never raises."""
    m = _LINE_RE.match(line.rstrip("\r\n"))
    if m is None:
        return None
    try:
        doc = json.loads(m.group(3))
        t = datetime.fromisoformat(m.group(1)).astimezone().replace(tzinfo=None)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
        return None
    extra = doc.get("extra")
    if not isinstance(extra, dict):
        extra = {}
    ev = Event(
        source=_str(doc.get("source")) or "supervisor",
        text=doc["text"],
        raw=doc["text"],
        time=t,
        time_text=t.strftime("%m-%d %H:%M:%S"),
        process=_str(doc.get("process")),
        rank=_int(doc.get("rank")),
        pid=_int(doc.get("pid")),
        level=_str(doc.get("level")),
        extra=dict(extra),
    )
    after = _int(doc.get("after"))
    return ev, (after if after is not None and after >= 0 else -1)


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
