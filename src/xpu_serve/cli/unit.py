"""`xpu-serve unit -c FILE [--exec PATH] [--user USER] [--env-file PATH] [--watchdog-sec N]`:
print a systemd unit for the config (choices explained in `xpu_serve.integrations.unit`).

stdout: the unit. stderr: one `warning:` line per `${VAR}` the config uses without a default that
would be unset under systemd, naming the env file to set it in. Exit 0, or 2 on a bad config or
arguments or a value a unit file cannot hold (a newline in a path or the user name)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from xpu_serve import exitcodes
from xpu_serve.cli._common import default_exec, load_config_or_report


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of seconds > 0")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `unit`."""
    p.add_argument("-c", "--config", required=True, help="config file")
    p.add_argument("--exec", dest="exec_path", help="path of the xpu-serve executable (default: the one running)")
    p.add_argument("--user", help="run the service as this user (default: root)")
    p.add_argument(
        "--env-file", type=Path,
        help="EnvironmentFile= of the unit (default: /etc/xpu-serve/<config file stem>.env)",
    )
    p.add_argument(
        "--watchdog-sec", type=_positive_int, default=None,
        help="WatchdogSec= (default 30; a shorter one is for tests)",
    )


def _raw(path: str) -> object:
    """The config's YAML before interpolation (load_config_or_report has already read it)."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None


def run(args: argparse.Namespace) -> int:
    """Print the unit and the environment warnings; exit 2 with one line per problem on a bad config."""
    from xpu_serve.integrations.unit import (
        WATCHDOG_SEC,
        UnitError,
        default_env_file,
        env_file_warnings,
        render_unit,
    )

    cfg = load_config_or_report(args.config)
    if cfg is None:
        return exitcodes.USAGE
    exec_path = args.exec_path or default_exec()
    env_file = args.env_file.absolute() if args.env_file else default_env_file(Path(args.config))
    for line in env_file_warnings(_raw(args.config), env_file, args.user):
        print(f"xpu-serve unit: {line}", file=sys.stderr)
    try:
        text = render_unit(
            cfg, Path(args.config), exec_path, args.user,
            env_file=env_file, watchdog_sec=args.watchdog_sec or WATCHDOG_SEC,
        )
    except UnitError as e:
        print(f"xpu-serve unit: {e}", file=sys.stderr)
        return exitcodes.USAGE
    sys.stdout.write(text)
    return exitcodes.OK
