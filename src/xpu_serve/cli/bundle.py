"""`xpu-serve bundle [--runtime-dir DIR | -c FILE] [--note TEXT] [--standalone] [--timeout S] [--json]`:
take a diagnostic bundle now (an operator's snapshot; nothing is stopped or restarted).

How: when a supervisor holds RUNTIME's lock, the command drops a request file in
RUNTIME/requests/ (`xpu_serve.bundle.request_bundle`) and sends SIGUSR1 to the supervisor (pid
from the lock); the supervisor's `BundleRequestWatcher` takes it at once and writes the bundle from its live incarnation (its
config, processes, logs; `py-spy` stacks of every live process). When no supervisor runs, when
it does not take the request within 3 s (13 s when the signal could not be sent: the
supervisor's slow scan runs every 10 s) (between incarnations, or a supervisor without the
watcher), or with `--standalone`, the command writes the bundle itself from RUNTIME/state.json,
/proc and the config given with `-c` (without `-c`, bundle defaults apply and config.yaml says so).

Prints the bundle's folder on stdout (problems on stderr). Exit codes: 0 when a bundle was
written (even incomplete: its errors are printed), 1 when none could be written, 2 for a bad
config or arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xpu_serve import exitcodes, procfs
from xpu_serve.cli.status import add_runtime_arguments, resolve_runtime_dir
from xpu_serve.events import Event
from xpu_serve.incarnation import ProcessInfo, Trigger

ACK_TIMEOUT_S = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--runtime-dir DIR, -c FILE, --note TEXT, --standalone, --timeout S, --json."""
    add_runtime_arguments(parser)
    parser.add_argument("--note", metavar="TEXT", help="a note kept in the bundle (why it was taken)")
    parser.add_argument("--standalone", action="store_true",
                        help="write the bundle from this process even when a supervisor runs")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="seconds to wait for the supervisor's bundle (default: 2 x collector timeout + 15)")
    parser.add_argument("--json", action="store_true", help="print {path, complete, errors, cause, taken_by}")


@dataclass
class StandaloneContext:
    """An `IncarnationContext` rebuilt from RUNTIME/state.json and /proc, for a snapshot taken
    without the supervisor's help. `fail` and `record` do nothing: a snapshot declares nothing."""

    incarnation: int
    config: Any
    runtime_dir: Path
    started_at: float
    ready_at: float | None
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    restarts: int | None = None

    def fail(self, trigger: Trigger) -> None:
        return None

    def record(self, event: Event) -> None:
        return None


def _between_incarnations(runtime_dir: Path) -> str | None:
    """"in backoff" / "given up" / "stopped" when state.json (xpu_serve.state) says no incarnation
    of the supervisor runs now, else None (also when state.json is unreadable). Never raises."""
    from xpu_serve.state import read_state

    try:
        st = (read_state(runtime_dir) or {}).get("state")
    except (ValueError, OSError, AttributeError):
        return None
    return {"backoff": "in backoff", "gave-up": "given up", "stopped": "stopped"}.get(st) if isinstance(st, str) else None


def standalone_context(runtime_dir: Path, config: Any, state: dict[str, Any] | None) -> StandaloneContext:
    """The context of the incarnation named in state.json: its live processes (pid reuse checked
    against their start times), else the supervisor's live descendants; kernel window from the
    earliest process start, else the last hour."""
    st = state or {}
    procs: dict[int, ProcessInfo] = {}
    for d in st.get("processes") or []:
        if not isinstance(d, dict) or not isinstance(d.get("pid"), int):
            continue
        if d.get("exit_code") is not None or d.get("signal"):
            continue
        if procfs.still_running(d["pid"], d.get("started_at"), 5.0):
            procs[d["pid"]] = ProcessInfo(name=str(d.get("name") or "process"), pid=d["pid"], rank=d.get("rank"),
                                          started_at=d.get("started_at"))
    spid = st.get("supervisor_pid")
    if not procs and isinstance(spid, int):
        try:
            import psutil

            for c in psutil.Process(spid).children(recursive=True):
                title = " ".join(c.cmdline()[:1]) or c.name()
                name = title.split("::", 1)[1].split()[0] if "VLLM::" in title else "process"
                procs[c.pid] = ProcessInfo(name=name, pid=c.pid, started_at=c.create_time())
        except Exception:
            pass
    starts = [p.started_at for p in procs.values() if p.started_at]
    started = min(starts) if starts else time.time() - 3600.0
    inc = st.get("incarnation")
    return StandaloneContext(
        incarnation=int(inc) if isinstance(inc, int) else 0,
        config=config,
        runtime_dir=runtime_dir,
        started_at=float(started),
        ready_at=None,
        processes=procs,
        restarts=st.get("restarts") if isinstance(st.get("restarts"), int) else None,
    )


def _print_result(ans: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(ans))
    elif ans.get("path"):
        print(ans["path"])
    for e in ans.get("errors") or []:
        print(f"warning: {e}", file=sys.stderr)
    if not ans.get("path"):
        if not as_json:
            print("no bundle could be written: " + "; ".join(ans.get("errors") or ["unknown reason"]), file=sys.stderr)
        return exitcodes.FAILURE
    return exitcodes.OK


def run(args: argparse.Namespace) -> int:
    """Take a snapshot bundle; returns an exit code from `xpu_serve.exitcodes`."""
    from xpu_serve import bundle
    from xpu_serve.config import ConfigError, load_config
    from xpu_serve.state import lock_holder, read_state

    runtime_dir = resolve_runtime_dir(args)
    if runtime_dir is None:
        return exitcodes.USAGE
    config = None
    if args.config:
        try:
            config = load_config(args.config)
        except ConfigError as e:
            for p in e.problems:
                print(p, file=sys.stderr)
            return exitcodes.USAGE
    if args.timeout is not None and args.timeout <= 0:
        print(f"--timeout: must be > 0, got {args.timeout:g}", file=sys.stderr)
        return exitcodes.USAGE
    ctimeout = float(getattr(getattr(config, "bundles", None), "collector_timeout_s", 10.0))
    wait_s = args.timeout if args.timeout is not None else 2 * ctimeout + 15.0

    holder = lock_holder(runtime_dir)
    between = _between_incarnations(runtime_dir) if holder is not None and not args.standalone else None
    if between:
        # the supervisor answers requests from its running incarnation's watchers; in backoff (or
        # after it gave up) none runs, so a request would only wait out the timeout
        print(f"supervisor (pid {holder}) is {between}: no server running; writing the bundle here", file=sys.stderr)
    elif holder is not None and not args.standalone:
        try:
            req = bundle.request_bundle(runtime_dir, args.note)
        except OSError as e:
            print(f"{runtime_dir}: cannot drop a bundle request: {e.strerror}; writing it here", file=sys.stderr)
        else:
            spid = holder
            if spid <= 0:  # lock held but its pid unreadable: state.json names the supervisor
                with contextlib.suppress(ValueError, OSError, AttributeError):
                    spid = int((read_state(runtime_dir) or {}).get("supervisor_pid") or 0)
            woke = bundle.wake_supervisor(spid)
            # not woken (signal refused): its slow scan finds the request; an older supervisor
            # that does not catch SIGUSR1 (woke is None) polls every 0.5 s
            ack_s = ACK_TIMEOUT_S if woke is not False else ACK_TIMEOUT_S + bundle.SLOW_SCAN_S
            ans = bundle.wait_for_answer(req, ack_s, max(wait_s, ack_s))
            if ans is not None:
                ans["taken_by"] = f"supervisor pid {holder}"
                return _print_result(ans, args.json)
            print(f"supervisor (pid {holder}) did not answer the request; writing the bundle here", file=sys.stderr)
    elif holder is None and not args.standalone:
        print(
            f"no supervisor runs for {runtime_dir}: writing the bundle here from its state file and the "
            "last incarnation's logs",
            file=sys.stderr,
        )

    try:
        state = read_state(runtime_dir)
    except (ValueError, OSError) as e:
        print(f"warning: {e}; no process information", file=sys.stderr)
        state = None
    ctx = standalone_context(Path(runtime_dir), config, state)
    res = bundle.write_snapshot_bundle(ctx, args.note)
    ans = {"path": str(res.path) if res.path else None, "complete": res.complete, "errors": res.errors,
           "cause": res.cause, "taken_by": "xpu-serve bundle (standalone)"}
    return _print_result(ans, args.json)
