"""`xpu-serve up -c FILE [--runtime-dir DIR] [--log-format text|json] [--no-echo]`: supervise in the foreground.

Exit codes (xpu_serve.exitcodes): 0 stopped on SIGTERM/SIGINT or `xpu-serve stop`; 2 bad config
or arguments (one line per problem); 3 gave up after a crash loop; 4 gave up at once (config
error, port taken by another program); 5 another supervisor holds the runtime directory; 1 the
runtime directory cannot be used. States, signals and clean-up: docs/supervision.md.

The supervisor runs under umask 077 (what it writes in RUNTIME is private: the engine's API key
may be in a crash dump; directories 0700, files 0600); the engine gets the operator's umask.
Its own output goes through `xpu_serve.output` (never blocks; drops are counted).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from xpu_serve import exitcodes
from xpu_serve.cli._common import load_config_or_report, nonempty_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """-c/--config FILE (required), --runtime-dir DIR, --log-format text|json, --no-echo."""
    parser.add_argument("-c", "--config", required=True, metavar="FILE", help="the YAML config")
    parser.add_argument(
        "--runtime-dir",
        metavar="DIR",
        type=nonempty_dir,
        help="state, logs and bundles (default: the config's runtime_dir)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="format of the supervisor's own event lines",
    )
    parser.add_argument(
        "--no-echo",
        action="store_true",
        help="do not echo the engine's output (it is still written to the logs)",
    )


def run(args: argparse.Namespace) -> int:
    """Load the config and run the supervisor until it stops or gives up; returns the exit code."""
    from xpu_serve import output
    from xpu_serve.state import EVENTS_FILE, LockedError
    from xpu_serve.supervisor import EventLog, run_supervisor

    cfg = load_config_or_report(args.config)
    if cfg is None:
        return exitcodes.USAGE
    runtime_dir = Path(args.runtime_dir or cfg.runtime_dir)
    engine_umask = os.umask(0o077)
    try:
        runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        print(f"{runtime_dir}: cannot create the runtime directory: {e.strerror}", file=sys.stderr)
        return exitcodes.FAILURE
    log = EventLog(fmt=args.log_format, jsonl_path=runtime_dir / EVENTS_FILE)
    try:
        return run_supervisor(cfg, runtime_dir, log, echo=not args.no_echo, engine_umask=engine_umask)
    except LockedError as e:
        print(str(e), file=sys.stderr)
        return exitcodes.LOCKED
    except OSError as e:
        print(f"{runtime_dir}: {e.strerror or e}", file=sys.stderr)
        return exitcodes.FAILURE
    finally:
        output.drain_all(2.0)  # the last lines, when someone reads them (drops: events.jsonl)
        log.close()
