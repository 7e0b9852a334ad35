"""`xpu-serve stop [--runtime-dir DIR | -c FILE] [--timeout S] [--kill]`: stop a running supervisor.

Sends SIGTERM to the supervisor holding RUNTIME/supervisor.lock (graceful: it stops the server,
cleans up and exits 0); `--kill` sends SIGINT twice (the server is killed at once). Waits until
the supervisor released its lock. Exit 0 when it stopped, 1 when none was running or it did not
stop within --timeout seconds, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from xpu_serve import exitcodes
from xpu_serve.cli._common import positive_seconds
from xpu_serve.cli.status import add_runtime_arguments, resolve_runtime_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--runtime-dir DIR, -c FILE, --timeout S (default 120), --kill."""
    add_runtime_arguments(parser)
    parser.add_argument(
        "--timeout", type=positive_seconds, default=120.0, metavar="S", help="seconds to wait (default 120)"
    )
    parser.add_argument(
        "--kill", action="store_true", help="kill the server at once instead of a graceful stop"
    )


def run(args: argparse.Namespace) -> int:
    """Signal the supervisor and wait for it to exit; returns an exit code."""
    from xpu_serve.state import lock_holder

    runtime_dir = resolve_runtime_dir(args)
    if runtime_dir is None:
        return exitcodes.USAGE
    pid = lock_holder(runtime_dir)
    if pid is None or pid <= 0:
        print(f"no supervisor is running on {runtime_dir}", file=sys.stderr)
        return exitcodes.FAILURE
    try:
        if args.kill:
            os.kill(pid, signal.SIGINT)
            time.sleep(0.2)
            os.kill(pid, signal.SIGINT)
        else:
            os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return exitcodes.OK
    except PermissionError:
        print(f"not allowed to signal supervisor pid {pid}", file=sys.stderr)
        return exitcodes.FAILURE
    deadline = time.monotonic() + args.timeout
    while lock_holder(runtime_dir) is not None:
        if time.monotonic() > deadline:
            print(f"supervisor pid {pid} did not stop within {args.timeout:g} s", file=sys.stderr)
            return exitcodes.FAILURE
        time.sleep(0.1)
    print(f"supervisor pid {pid} stopped")
    return exitcodes.OK
