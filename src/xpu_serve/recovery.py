"""The bundle of an incident whose capture was cut short (kill -9 or the OOM killer hit the
supervisor while it was `capturing`), written by the next `up` from the logs kept on disk.

While it captures, the supervisor keeps a marker in the incarnation's log folder,
`RUNTIME/logs/<N>/incident-pending.json` (`mark_pending`), and removes it once the bundle exists
(`clear_pending`). A marker left behind means an incident without a bundle: the next `up` calls
`recover_pending` before it moves or prunes any log folder; log retention and the move of an
earlier run's logs (`logdirs.set_aside_old_logs`) never remove a folder that holds one.

Marker (JSON object): run_id, supervisor_pid, incarnation, restarts, started_at, ready_at
(epoch s or null), trigger {kind, detail, at, process, rank, pid, exit_code, signal},
processes [{name, pid, rank, started_at, exit_code, signal, exited_at}] as of the capture start,
and bundle (the folder the capture began, once it exists). The recovery finishes that folder
rather than writing a second bundle of the incident: what the cut capture wrote there (its live
facts, stacks) is kept in its `cut-capture/`; a folder already complete (bundle.json) is left as
it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xpu_serve.fsread import read_regular
from xpu_serve.incarnation import ProcessInfo, Trigger

PENDING_FILE = "incident-pending.json"
_MAX_MARKER_BYTES = 4 << 20
_TRIGGER_KEYS = (
    "kind", "detail", "at", "process", "rank", "pid", "exit_code", "signal", "detected_at", "at_source", "loop_stall_s",
)


def mark_pending(log_dir: Path, data: dict[str, Any]) -> None:
    """Write `log_dir/incident-pending.json` atomically (temp file, rename). Never raises: a
    marker that cannot be written costs only the recovery after a kill -9."""
    tmp = log_dir / f".{PENDING_FILE}.tmp"
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(data, default=str) + "\n")
        os.replace(tmp, log_dir / PENDING_FILE)


def clear_pending(log_dir: Path) -> None:
    """Remove the marker: the incident has its bundle."""
    with contextlib.suppress(OSError):
        (log_dir / PENDING_FILE).unlink()


def is_pending(log_dir: Path) -> bool:
    """True when `log_dir` holds an incident without a bundle (a marker, whatever its content)."""
    return os.path.lexists(log_dir / PENDING_FILE)


def read_pending(log_dir: Path) -> dict[str, Any] | None:
    """The marker of `log_dir` as a dict; None when absent, unreadable or not a JSON object."""
    try:
        raw = read_regular(log_dir / PENDING_FILE, _MAX_MARKER_BYTES)
        data = json.loads(raw or b"")
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class RecoveredContext:
    """The `IncarnationContext` view of a dead incarnation for the bundle writer."""

    incarnation: int
    config: Any
    runtime_dir: Path
    log_dir: Path
    started_at: float
    ready_at: float | None
    restarts: int | None
    processes: dict[int, ProcessInfo] = field(default_factory=dict)

    def fail(self, trigger: Trigger) -> None:
        """(nothing to fail: the incarnation is dead)"""

    def record(self, event: Any) -> None:
        """(no live analysis to feed)"""


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _trigger(d: Any, fallback_at: float) -> Trigger:
    d = d if isinstance(d, dict) else {}
    return Trigger(
        kind=_str(d.get("kind")) or "unknown",
        detail=_str(d.get("detail")) or "the trigger was not recorded",
        at=_num(d.get("at")) or fallback_at,
        process=_str(d.get("process")),
        rank=_int(d.get("rank")),
        pid=_int(d.get("pid")),
        exit_code=_int(d.get("exit_code")),
        signal=_str(d.get("signal")),
        detected_at=_num(d.get("detected_at")),
        at_source=_str(d.get("at_source")),
        loop_stall_s=_num(d.get("loop_stall_s")),
    )


def _processes(raw: Any) -> tuple[dict[int, ProcessInfo], dict[int, float]]:
    """pid -> ProcessInfo and pid -> exit time (epoch s) from the marker's `processes`."""
    procs: dict[int, ProcessInfo] = {}
    exited: dict[int, float] = {}
    for p in raw if isinstance(raw, list) else []:
        if not isinstance(p, dict) or _int(p.get("pid")) is None:
            continue
        pid = int(p["pid"])
        procs[pid] = ProcessInfo(
            name=_str(p.get("name")) or "process",
            pid=pid,
            rank=_int(p.get("rank")),
            started_at=_num(p.get("started_at")),
            exit_code=_int(p.get("exit_code")),
            signal=_str(p.get("signal")),
        )
        at = _num(p.get("exited_at"))
        if at is not None:
            exited[pid] = at
    return procs, exited


def _log_files(log_dir: Path) -> list[str]:
    """vllm.log rotations oldest first (vllm.log.K, highest K first), then vllm.log."""
    rot: list[tuple[int, str]] = []
    with contextlib.suppress(OSError):
        for p in log_dir.iterdir():
            n = p.name
            if n == "vllm.log" or (n.startswith("vllm.log.") and n[9:].isdigit()):
                if p.is_file() and not p.is_symlink():
                    rot.append((int(n[9:]) if n != "vllm.log" else 0, str(p)))
    return [p for _, p in sorted(rot, reverse=True)]


def analyse(log_dir: Path, trig: Trigger, procs: dict[int, ProcessInfo], exited: dict[int, float]) -> dict[str, Any]:
    """The verdict contract of the kept logs and facts, as the live capture makes it: vllm.log
    with the facts log the dead supervisor wrote (`facts`), else the exits its marker lists,
    and the trigger as a fact (analysis/supervised.py). Never raises."""
    from xpu_serve import facts
    from xpu_serve.supervision.capture import take_signal, trigger_fact, without_verdict

    contract: dict[str, Any] = {}
    try:
        from xpu_serve.diagnosis import Analyzer, diagnose_files

        an = Analyzer()
        kept = log_dir / facts.FACTS_LOG
        inputs: list[str] = _log_files(log_dir)
        if kept.is_file() and not kept.is_symlink():
            inputs.append(str(kept))
        else:
            for pid, at in exited.items():
                p = procs[pid]
                an.add_event(facts.process_exit(p.name, pid, p.rank, p.exit_code, p.signal, at))
        an.add_event(trigger_fact(trig))
        inc = diagnose_files(inputs, analyzer=an)
        contract = dict(inc.to_contract())
        take_signal(inc, trig, procs)
    except Exception as ex:  # (an unreadable log: the trigger still gives a verdict below)
        contract["notes"] = [f"analysis of the kept logs failed: {type(ex).__name__}: {ex}"]
    without_verdict(contract, trig)
    return contract


def recover_one(
    log_dir: Path, runtime_dir: Path, config: Any, by_pid: int, note: str | None = None, again: bool = False
) -> tuple[str | None, dict[str, Any]]:
    """Write the bundle of the incident pending in `log_dir`; returns (bundle path or None,
    contract). `note`: the bundle's first note (default: the capture was cut by a kill -9 of the
    supervisor); `again`: write the marker's folder afresh even when it has its bundle.json (a
    bundle a full disk left without files: `supervision.rewrite`). The marker is removed once a bundle folder exists. Blocking (the bundle writer:
    up to 2 x bundles.collector_timeout_s + 5 s)."""
    from xpu_serve.bundle import write_incident_bundle
    from xpu_serve.supervision.capture import report_text

    m = read_pending(log_dir) or {}
    cut = _begun_bundle(runtime_dir, m.get("bundle"))
    if cut is not None and (cut / "bundle.json").is_file() and not again:  # cut after its last file: complete
        clear_pending(log_dir)
        return str(cut), _contract_of(cut)
    trig = _trigger(m.get("trigger"), fallback_at=_mtime(log_dir / PENDING_FILE))
    procs, exited = _processes(m.get("processes"))
    n = _int(m.get("incarnation")) or _incarnation_of(log_dir)
    contract = analyse(log_dir, trig, procs, exited)
    contract["recovered"] = True
    note = note or (
        f"recovered: the capture of this incident was cut short (kill -9 of the supervisor, pid "
        f"{m.get('supervisor_pid')}, while capturing); this bundle was written by the next `up` "
        f"(pid {by_pid}) from the logs kept in {log_dir}: no stacks, no live /proc facts, host "
        "facts and kernel log as of the recovery"
    )
    notes = contract.setdefault("notes", [])
    if isinstance(notes, list):
        notes.insert(0, note)
    contract["supervisor"] = {
        "trigger": {k: getattr(trig, k) for k in _TRIGGER_KEYS},
        "incarnation": n,
        "run_id": m.get("run_id"),
        "restarts": _int(m.get("restarts")),
        "started_at": _num(m.get("started_at")),
        "ready_at": _num(m.get("ready_at")),
        "failed_at": trig.at,
        "processes": [dict(vars(p), exited_at=exited.get(p.pid)) for p in procs.values()],
        "recovered": True,
    }
    ctx = RecoveredContext(
        incarnation=n,
        config=config,
        runtime_dir=runtime_dir,
        log_dir=log_dir,
        started_at=_num(m.get("started_at")) or trig.at,
        ready_at=_num(m.get("ready_at")),
        restarts=_int(m.get("restarts")),
        processes=_not_foreign(procs, _str(m.get("run_id"))),
    )
    if cut is not None:
        _set_aside(cut)
    res = write_incident_bundle(ctx, trig, contract, report_text(None, contract, ctx), stacks={}, into=cut)
    if res.path is not None:
        clear_pending(log_dir)
    return (str(res.path) if res.path else None), contract


def _begun_bundle(runtime_dir: Path, named: Any) -> Path | None:
    """The bundle folder a marker names when it is a real folder right under RUNTIME/bundles
    (never a symlink, never a path elsewhere), else None."""
    if not isinstance(named, str) or not named:
        return None
    p = Path(named)
    try:
        if p.is_symlink() or not p.is_dir() or p.parent.resolve() != (runtime_dir / "bundles").resolve():
            return None
    except OSError:
        return None
    return p


def _set_aside(cut: Path) -> None:
    """Move what the cut capture wrote in `cut` into `cut/cut-capture/` (nothing is lost: the
    recovery writes the bundle's files afresh beside it). Never raises."""
    keep = cut / "cut-capture"
    with contextlib.suppress(OSError):
        names = [n for n in os.listdir(cut) if n != keep.name]
        if names:
            keep.mkdir(exist_ok=True, mode=0o700)
        for n in names:
            if os.path.lexists(keep / n):  # a recovery cut in turn: the first capture's copy stays
                continue
            with contextlib.suppress(OSError):
                os.rename(cut / n, keep / n)


def _contract_of(bundle: Path) -> dict[str, Any]:
    """The verdict contract of a complete bundle (its incident.json; {} when unreadable)."""
    try:
        data = json.loads(read_regular(bundle / "incident.json", _MAX_MARKER_BYTES) or b"")
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _not_foreign(procs: dict[int, ProcessInfo], run_id: str | None) -> dict[int, ProcessInfo]:
    """The processes without those whose pid now runs another program (alive, not proven the
    dead run's by its marker or start time): the bundle writer must not read /proc for those."""
    from xpu_serve import procfs
    from xpu_serve.cleanup import is_proven

    return {
        pid: p
        for pid, p in procs.items()
        if p.exit_code is not None
        or p.signal is not None
        or not procfs.alive(pid)
        or is_proven(pid, run_id, None, {pid: p.started_at} if p.started_at is not None else None)
    }


def pending_dirs(logs_root: Path) -> list[Path]:
    """The folders under RUNTIME/logs holding an incident without a bundle, oldest first."""
    try:
        dirs = [p for p in logs_root.iterdir() if p.is_dir() and not p.is_symlink() and is_pending(p)]
    except OSError:
        return []
    return sorted(dirs, key=_mtime)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return time.time()


def _incarnation_of(log_dir: Path) -> int:
    head = log_dir.name.split(".", 1)[0]
    return int(head) if head.isdigit() else 0
