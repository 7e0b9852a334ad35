"""`xpu-serve unit -c FILE [--exec PATH] [--user USER]`: print a systemd unit for the config."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from xpu_serve import exitcodes
from xpu_serve.cli._common import load_config_or_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `unit`."""
    p.add_argument("-c", "--config", required=True, help="config file")
    p.add_argument("--exec", dest="exec_path", help="path of the xpu-serve executable (default: the one running)")
    p.add_argument("--user", help="run the service as this user (default: root)")


def _default_exec() -> str:
    argv0 = sys.argv[0]
    if os.path.basename(argv0) == "xpu-serve" and os.path.isabs(argv0):
        return argv0
    found = shutil.which("xpu-serve")
    if found:
        return os.path.abspath(found)
    return os.path.join(os.path.dirname(sys.executable), "xpu-serve")


def run(args: argparse.Namespace) -> int:
    """Print the unit; exit 2 with one line per problem on a bad config."""
    from xpu_serve.integrations.unit import render_unit

    cfg = load_config_or_report(args.config)
    if cfg is None:
        return exitcodes.USAGE
    exec_path = args.exec_path or _default_exec()
    sys.stdout.write(render_unit(cfg, Path(args.config), exec_path, args.user))
    return exitcodes.OK
