"""Events for facts the supervisor observes itself (not lines some process printed).

Live sources build these so that the one analysis (`diagnosis.py`) sees process exits, hangs,
health failures and start-up stalls exactly like log lines: the signature table has a row for
each text shape below (source "process", "health" or "supervisor").
"""

from __future__ import annotations

from datetime import datetime

from xpu_serve.events import Event


def _now(at: float | None) -> datetime:
    return datetime.fromtimestamp(at) if at is not None else datetime.now()


def process_exit(
    name: str, pid: int, rank: int | None, exit_code: int | None, signal: str | None, at: float | None = None
) -> Event:
    """A watched vLLM process died. `signal` is a name ("SIGSEGV") when killed by a signal.

    Text shapes: "Worker_TP0 (pid 7986) died: killed by SIGSEGV",
    "EngineCore (pid 7732) died: exit code 1", "APIServer (pid 7700) died: exit status unknown".
    """
    if signal:
        how = f"killed by {signal}"
    elif exit_code is not None:
        how = f"exit code {exit_code}"
    else:
        how = "exit status unknown"
    t = _now(at)
    return Event(
        source="process",
        text=f"{name} (pid {pid}) died: {how}",
        raw=f"{name} (pid {pid}) died: {how}",
        time=t,
        time_text=t.strftime("%m-%d %H:%M:%S"),
        process=name,
        rank=rank,
        pid=pid,
        level="ERROR",
        extra={"exit_code": exit_code, "signal": signal},
    )


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
    extra: {"last_progress": "MM-DD HH:MM:SS" or None, "detected_by": str, "no_progress_s": float}.
    """
    t = _now(at)
    text = f"hang watchdog: no progress for {no_progress_s:.0f}s with {running} running, {waiting} waiting requests"
    return Event(
        source="health",
        text=text,
        raw=text,
        time=t,
        time_text=t.strftime("%m-%d %H:%M:%S"),
        level="ERROR",
        extra={
            "last_progress": last_progress.strftime("%m-%d %H:%M:%S") if last_progress else None,
            "detected_by": detected_by,
            "no_progress_s": no_progress_s,
        },
    )


def health_failed(failures: int, detail: str, at: float | None = None) -> Event:
    """`/health` failed `failures` probes in a row. Text: "/health failed 3 probes in a row: HTTP 503"."""
    t = _now(at)
    text = f"/health failed {failures} probes in a row: {detail}"
    return Event(source="health", text=text, raw=text, time=t, time_text=t.strftime("%m-%d %H:%M:%S"), level="ERROR")


def startup_stall(stalled_s: float, phase: str, missing_ranks: list[int], at: float | None = None) -> Event:
    """Start-up made no progress for `stalled_s` seconds.

    Text shape: "start-up stalled for 600s in phase ccl-init; ranks not reached: 1, 3".
    extra: {"phase": str, "missing_ranks": list[int]}.
    """
    t = _now(at)
    ranks = ", ".join(str(r) for r in missing_ranks) if missing_ranks else "none"
    text = f"start-up stalled for {stalled_s:.0f}s in phase {phase}; ranks not reached: {ranks}"
    return Event(
        source="supervisor",
        text=text,
        raw=text,
        time=t,
        time_text=t.strftime("%m-%d %H:%M:%S"),
        level="ERROR",
        extra={"phase": phase, "missing_ranks": list(missing_ranks)},
    )
