"""`xpu-serve status [--runtime-dir DIR | -c FILE] [--json]`: show the supervisor's state.json.

Reads RUNTIME/state.json (see xpu_serve.state) and checks the lock: when the supervisor that wrote
the file is gone, says so (`supervisor_alive: false` in JSON). Exit 0 while a supervisor runs,
1 when none runs (state shown if any), 2 on bad arguments or an unreadable state file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from xpu_serve import exitcodes


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """--runtime-dir DIR and -c/--config FILE (the config's runtime_dir); shared with `stop`."""
    parser.add_argument("--runtime-dir", metavar="DIR", help="the supervisor's runtime directory")
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


def _t(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def run(args: argparse.Namespace) -> int:
    """Print the status; returns 0 when a supervisor runs, 1 when not, 2 on errors."""
    from xpu_serve.state import lock_holder, read_state

    runtime_dir = resolve_runtime_dir(args)
    if runtime_dir is None:
        return exitcodes.USAGE
    try:
        st = read_state(runtime_dir)
    except (ValueError, OSError) as e:
        print(str(e), file=sys.stderr)
        return exitcodes.USAGE
    holder = lock_holder(runtime_dir)
    alive = holder is not None  # the lock is authoritative: a pid alone may have been reused
    if st is None:
        if args.json:
            print(json.dumps({"supervisor_alive": alive, "runtime_dir": str(runtime_dir), "state": None}))
        else:
            print(
                f"no supervisor state in {runtime_dir}" + (f" (lock held by pid {holder})" if holder else "")
            )
        return exitcodes.OK if alive else exitcodes.FAILURE
    spid = st.get("supervisor_pid")
    st_out = dict(st)
    st_out["supervisor_alive"] = alive
    if args.json:
        print(json.dumps(st_out, indent=2, sort_keys=True, default=str))
        return exitcodes.OK if alive else exitcodes.FAILURE
    rows: list[tuple[str, str]] = []
    state = str(st.get("state"))
    if not alive and state not in ("stopped", "gave-up"):
        state += f"  (supervisor pid {spid} is dead: state is stale)"
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
    if st.get("next_restart_at"):
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
        rank = f" rank {p['rank']}" if p.get("rank") is not None else ""
        rows.append(("process", f"{p.get('name')} pid {p.get('pid')}{rank}{ended}"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return exitcodes.OK if alive else exitcodes.FAILURE
