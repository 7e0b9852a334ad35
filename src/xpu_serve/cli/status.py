"""`xpu-serve status [--runtime-dir DIR | -c FILE] [--json]`: show the supervisor's state.json.

Reads RUNTIME/state.json (see xpu_serve.state) and checks the lock: when the supervisor that wrote
the file is gone, says so (`supervisor_alive: false` in JSON). When the supervisor runs but the file
was last written more than STALE_HEARTBEATS heartbeats ago (`written_at`, `heartbeat_s`: e.g. the
runtime directory's disk is full), says the state may be stale (`state_stale: true`, `state_age_s`).

Exit 0 while a supervisor runs, 1 when none runs (state shown if any), 2 on bad arguments or a
state file that is unreadable or malformed (not UTF-8, not JSON, not an object, or a field of the
wrong type, e.g. `"processes": "x"`): one line `PATH: ...` on stderr, never a traceback.

`--check` is a probe (docker HEALTHCHECK, exec probes, scripts) with its own exit codes, not
the README's table: 0 the supervisor runs and its state is `ready`, 1 it runs and is not ready
(starting, backoff, capturing, ... or a stale state file), 2 no supervisor runs (nobody holds
the lock). One line on stdout: `ready`, `not ready: STATE[: REASON]` (also a
running supervisor's state.json that cannot be read or is malformed: `not ready: unreadable
state: ...`) or `no supervisor: ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from xpu_serve import exitcodes


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """--runtime-dir DIR and -c/--config FILE (the config's runtime_dir); shared with `stop`."""
    from xpu_serve.cli._common import nonempty_dir

    parser.add_argument(
        "--runtime-dir", metavar="DIR", type=nonempty_dir, help="the supervisor's runtime directory"
    )
    parser.add_argument("-c", "--config", metavar="FILE", help="take the runtime directory from this config")


def resolve_runtime_dir(args: argparse.Namespace) -> Path | None:
    """The runtime directory from --runtime-dir, else -c's runtime_dir, else the config default.
    Prints the config's problems and returns None when the config is invalid."""
    if args.runtime_dir:
        return Path(args.runtime_dir)
    from xpu_serve.config import Config, ConfigError, load_config

    if args.config:
        try:
            return Path(load_config(args.config).runtime_dir)
        except ConfigError as e:
            for p in e.problems:
                print(p, file=sys.stderr)
            return None
    return Path(Config.model_fields["runtime_dir"].default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--runtime-dir DIR, -c FILE, --json."""
    add_runtime_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print state.json plus supervisor_alive")
    parser.add_argument(
        "--check",
        action="store_true",
        help="probe mode, its own exit codes: 0 ready, 1 running but not ready, 2 no supervisor "
        "(or unreadable state); one line on stdout",
    )


# state.json is considered stale when older than this many heartbeats (plus 1 s) while its
# supervisor runs.
STALE_HEARTBEATS = 3

# Field -> allowed JSON types (None: null allowed). What the table below reads; checked first so
# that a malformed file gives one line, not a traceback.
_NUM = (int, float)
_FIELDS: dict[str, tuple[type, ...]] = {
    "state": (str,),
    "reason": (str,),
    "incarnation": (int,),
    "restarts": (int,),
    "supervisor_pid": (int,),
    "engine": (dict,),
    "time_to_ready_s": _NUM,
    "next_restart_at": _NUM,
    "kernel_watch": (dict,),
    "last_incident": (dict,),
    "processes": (list,),
    "written_at": _NUM,
    "updated_at": _NUM,
    "heartbeat_s": _NUM,
}
_PROC_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "pid": (int,),
    "rank": (int,),
    "exit_code": (int,),
    "signal": (str,),
    "exited_at": _NUM,
}


def malformed(st: dict[str, Any]) -> str | None:
    """What is wrong with the state.json object `st` (first problem, e.g. "processes: expected
    list, got str"), or None when every field `status` reads has its type (null allowed)."""

    def bad(where: str, v: Any, types: tuple[type, ...]) -> str | None:
        if isinstance(v, float) and not math.isfinite(v):  # json reads NaN, Infinity
            return f"{where}: {v!r} is not a finite number"
        if v is None or (isinstance(v, types) and not isinstance(v, bool)):
            return None
        want = " or ".join(t.__name__ for t in types)
        return f"{where}: expected {want}, got {type(v).__name__}"

    for k, types in _FIELDS.items():
        why = bad(k, st.get(k), types)
        if why:
            return why
    for i, p in enumerate(st.get("processes") or []):
        if not isinstance(p, dict):
            return f"processes[{i}]: expected object, got {type(p).__name__}"
        for k, types in _PROC_FIELDS.items():
            why = bad(f"processes[{i}].{k}", p.get(k), types)
            if why:
                return why
    li = st.get("last_incident") or {}
    why = bad("last_incident.time", li.get("time"), _NUM)
    if why:
        return why
    for k in ("cause", "bundle"):
        why = bad(f"last_incident.{k}", li.get(k), (str,))
        if why:
            return why
    return None


def staleness(st: dict[str, Any], alive: bool, now: float | None = None) -> tuple[bool, float | None]:
    """(stale, age_s): age of state.json's last write (`written_at`, else `updated_at`; epoch s)
    and whether it is older than STALE_HEARTBEATS x `heartbeat_s` + 1 s while the supervisor is
    alive (a dead supervisor's file is reported as dead, not stale)."""
    written = st.get("written_at", st.get("updated_at"))
    hb = st.get("heartbeat_s")
    if not isinstance(written, (int, float)) or isinstance(written, bool):
        return False, None
    age = max(0.0, (time.time() if now is None else now) - float(written))
    if not alive or not isinstance(hb, (int, float)) or isinstance(hb, bool) or hb <= 0:
        return False, age
    return age > STALE_HEARTBEATS * float(hb) + 1.0, age


def _t(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    try:
        return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"{ts!r} (out of range)"


def run(args: argparse.Namespace) -> int:
    """Print the status; returns 0 when a supervisor runs, 1 when not, 2 on errors."""
    from xpu_serve.state import lock_holder, read_state

    runtime_dir = resolve_runtime_dir(args)
    if runtime_dir is None:
        return exitcodes.USAGE
    unreadable = None
    try:
        st = read_state(runtime_dir)
    except PermissionError:  # RUNTIME is 0700, state.json 0600: the supervisor's user (or root) only
        st, unreadable = None, f"{runtime_dir}/state.json: permission denied: run status as the supervisor's user or root"
    except ValueError as e:
        st, unreadable = None, str(e)
    except OSError as e:
        st, unreadable = None, f"{e.filename or runtime_dir}: {e.strerror or e}"
    holder = lock_holder(runtime_dir)
    alive = holder is not None  # the lock is authoritative: a pid alone may have been reused
    if getattr(args, "check", False):
        return _check(runtime_dir, st, alive, unreadable)
    if unreadable:
        print(unreadable, file=sys.stderr)
        return exitcodes.USAGE
    if st is None:
        if args.json:
            print(json.dumps({"supervisor_alive": alive, "runtime_dir": str(runtime_dir), "state": None}))
        else:
            print(
                f"no supervisor state in {runtime_dir}" + (f" (lock held by pid {holder})" if holder else "")
            )
        return exitcodes.OK if alive else exitcodes.FAILURE
    path = runtime_dir / "state.json"
    why = malformed(st)
    if why:
        print(f"{path}: malformed state: {why}", file=sys.stderr)
        return exitcodes.USAGE
    stale, age = staleness(st, alive)
    if args.json:
        st_out = dict(st)
        st_out["supervisor_alive"] = alive
        st_out["state_stale"] = stale
        st_out["state_age_s"] = None if age is None else round(age, 3)
        print(json.dumps(st_out, indent=2, sort_keys=True, default=str))
        return exitcodes.OK if alive else exitcodes.FAILURE
    try:
        rows = _rows(st, alive, stale, age)
    except Exception as e:  # a shape malformed() does not know: still one line, never a traceback
        print(f"{path}: malformed state: {type(e).__name__}: {e}", file=sys.stderr)
        return exitcodes.USAGE
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return exitcodes.OK if alive else exitcodes.FAILURE


# `status --check` exit codes (a probe's contract, not the README's table)
CHECK_READY, CHECK_NOT_READY, CHECK_NO_SUPERVISOR = 0, 1, 2


def _check(runtime_dir: Path, st: dict[str, Any] | None, alive: bool, unreadable: str | None = None) -> int:
    """`--check`: one line on stdout; CHECK_READY, CHECK_NOT_READY or CHECK_NO_SUPERVISOR.
    `unreadable`: why state.json could not be read (then `st` is None)."""
    if not alive:
        last = f" (last state {st.get('state')})" if isinstance(st, dict) and st.get("state") else ""
        why = f" ({unreadable})" if unreadable else ""
        print(_one_line(f"no supervisor: none holds the lock of {runtime_dir}{last}{why}"))
        return CHECK_NO_SUPERVISOR
    if st is None or malformed(st):
        why = unreadable or (malformed(st) if st is not None else None) or f"no state in {runtime_dir} yet"
        print(_one_line(f"not ready: unreadable state: {why}"))
        return CHECK_NOT_READY
    stale, age = staleness(st, alive)
    state = str(st.get("state"))
    if stale:
        print(f"not ready: state.json is stale ({age:.0f} s old)")
        return CHECK_NOT_READY
    if state == "ready":
        print("ready")
        return CHECK_READY
    reason = f": {st['reason']}" if st.get("reason") else ""
    print(_one_line(f"not ready: {state}{reason}"))
    return CHECK_NOT_READY


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


def _same_process_alive(pid: int, started_at: Any) -> bool:
    """True when `pid` lives and, when `started_at` (epoch s, psutil create_time) is known, is
    still the process state.json names (not a later process given the same pid)."""
    from xpu_serve import procfs

    return procfs.still_running(pid, started_at, 1.0)


def _rows(st: dict[str, Any], alive: bool, stale: bool, age: float | None) -> list[tuple[str, str]]:
    spid = st.get("supervisor_pid")
    rows: list[tuple[str, str]] = []
    state = str(st.get("state"))
    if not alive and state not in ("stopped", "gave-up"):
        state += f"  (supervisor pid {spid} is dead: state is stale)"
    elif stale and age is not None:
        state += (
            f"  (MAY BE STALE: state.json last written {age:.0f} s ago although the supervisor runs and "
            f"rewrites it every {st.get('heartbeat_s'):g} s; is the runtime directory's disk full?)"
        )
    rows.append(("supervisor", f"pid {spid} ({'running' if alive else 'not running'})"))
    rows.append(("state", state))
    if st.get("reason"):
        rows.append(("reason", str(st["reason"])))
    rows.append(("incarnation", str(st.get("incarnation"))))
    rows.append(("restarts", str(st.get("restarts"))))
    eng = st.get("engine") or {}
    if eng:
        rows.append(
            ("server", f"http://{eng.get('host')}:{eng.get('port')} model {eng.get('served_model_name')}")
        )
    if st.get("time_to_ready_s") is not None:
        rows.append(("time to ready", f"{st['time_to_ready_s']:.1f} s"))
    if st.get("next_restart_at") and not alive:
        # (a dead supervisor's countdown would read as a restart that is still coming)
        rows.append(("next restart", f"none: the supervisor that planned it for {_t(st['next_restart_at'])} is gone"))
    elif st.get("next_restart_at"):
        rows.append(
            (
                "next restart",
                f"{_t(st['next_restart_at'])} (in {max(0.0, st['next_restart_at'] - time.time()):.1f} s)",
            )
        )
    kw = st.get("kernel_watch")
    if isinstance(kw, dict):  # KernelWatcher.source_status(), written by the supervisor
        if kw.get("source") and kw.get("source") != "none":
            kv = str(kw["source"]) + (f" ({kw['reason']})" if kw.get("reason") else "")
            if kw.get("overruns"):
                kv += f"; {kw['overruns']} ring-buffer overrun(s)"
        elif kw.get("reason"):
            kv = f"off: {kw['reason']}"
        else:
            kv = "not started yet"
        rows.append(("kernel watch", kv))
    li = st.get("last_incident")
    if li:
        rows.append(("last incident", f"{li.get('cause')} at {_t(li.get('time'))}"))
        if li.get("bundle"):
            rows.append(("bundle", str(li["bundle"])))
    for p in st.get("processes") or []:
        ended = ""
        if p.get("signal"):
            ended = f" killed by {p['signal']}"
        elif p.get("exit_code") is not None:
            ended = f" exited {p['exit_code']}"
        elif p.get("exited_at"):
            ended = " exited (status unknown)"
        elif isinstance(p.get("pid"), int) and not _same_process_alive(p["pid"], p.get("started_at")):
            ended = " gone"  # (stopped with the tree, or died after state.json was written)
        elif not alive and isinstance(p.get("pid"), int):
            # the supervisor was killed (kill -9, OOM killer) and this process still runs, unwatched;
            # the next `up` on this runtime directory stops it (orphans sweep)
            ended = " ORPHANED (still running, no supervisor; `up` on this runtime directory stops it)"
        rank = f" rank {p['rank']}" if p.get("rank") is not None else ""
        rows.append(("process", f"{p.get('name')} pid {p.get('pid')}{rank}{ended}"))
    return rows
