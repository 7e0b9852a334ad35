"""Command-line entry point: argument parsing and exit codes only.

Each subcommand lives in its own module under `xpu_serve.cli` and exposes
`add_arguments(parser)` and `run(args) -> int` (an exit code from `xpu_serve.exitcodes`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from xpu_serve import __version__, exitcodes

# subcommand name -> (module under xpu_serve.cli, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("up", "run and supervise the server in the foreground"),
    "status": ("status", "show the supervisor's state from the runtime directory"),
    "stop": ("stop", "stop a running supervisor"),
    "render": ("render", "print the exact command and environment `up` will use"),
    "check": ("check", "validate the config and preflight the host"),
    "diagnose": ("diagnose", "name the root cause of an incident from log files"),
    "bundles": ("bundles", "list and show diagnostic bundles"),
    "bundle": ("bundle", "take a diagnostic bundle now from a running server"),
    "unit": ("unit", "print a systemd unit for a config"),
    "npd": ("npd", "node-problem-detector: kernel monitor and custom plugin configs, the plugin check"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser; each subcommand module adds its own arguments.

    With `command` (the subcommand the argv names) only that module is imported and the others
    get a bare entry (name and help, so choices and `--help` stay the same): importing all ten
    costs ~0.1 s of a 0.15 s `diagnose`. Without it every module is imported.
    """
    parser = argparse.ArgumentParser(
        prog="xpu-serve",
        description="Supervise `vllm serve` on Intel XPU and name the root cause of every incident.",
    )
    parser.add_argument("--version", action="version", version=f"xpu-serve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or name == command:
            mod = importlib.import_module(f"xpu_serve.cli.{module}")
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `xpu-serve`; returns the process exit code (see `xpu_serve.exitcodes`)."""
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["up"]:
        # SIGUSR1 (operator bundle) and SIGHUP (planned restart) terminate by default: until the
        # supervisor installs its handlers (imports and config take ~0.5 s) they are ignored, so a
        # script or `systemctl reload` that is early does not kill it (the handlers replace this,
        # so the engine, started later, gets the default dispositions again)
        import signal

        for sig in (signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        # the same for the signals the supervisor logs and ignores (supervisor.STRAY_SIGNALS,
        # not imported here: that import is what takes the time)
        for name in ("SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGPWR", "SIGIO", "SIGSTKFLT"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
    parser = build_parser(raw[0] if raw[:1] and raw[0] in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return exitcodes.USAGE
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return exitcodes.OK
    except Exception as e:  # a defect: one line for the operator, the traceback on request
        if os.environ.get("XPU_SERVE_DEBUG"):
            raise
        print(
            f"xpu-serve {args.command}: internal error: {type(e).__name__}: {e} (XPU_SERVE_DEBUG=1 shows where)",
            file=sys.stderr,
        )
        return exitcodes.FAILURE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
