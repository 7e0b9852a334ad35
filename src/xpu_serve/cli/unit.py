"""`xpu-serve unit -c FILE [--exec PATH] [--user USER] [--env-file PATH] [--watchdog-sec N]`:
print a systemd unit for the config (choices explained in `xpu_serve.integrations.unit`).

stdout: the unit. stderr: one `warning:` line per `${VAR}` the config uses without a default that
would be unset under systemd, naming the env file to set it in. A `${VAR}` unset where `unit` runs
(a secret that only the env file holds) does not stop it: the unit is rendered with the reference
itself in its place. Exit 0, or 2 on a bad config or arguments or a value a unit file cannot hold
(a newline in a path or the user name)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


@contextmanager
def _unset_as_references(raw: object) -> Iterator[None]:
    """While inside: each `${VAR}` of `raw` with no default and unset here is set to the text
    `${VAR}` itself (interpolation is not recursive), so the config loads as systemd will see it
    once the env file sets VAR; the environment is restored afterwards."""
    from xpu_serve.config import variable_references

    names = {n for n, default, _loc in variable_references(raw) if default is None and n not in os.environ}
    try:
        for n in names:
            os.environ[n] = "${" + n + "}"
        yield
    finally:
        for n in names:
            os.environ.pop(n, None)


def _load(path: str) -> Any:
    """The config with unset variables standing for themselves; None (problems printed, as
    `load_config_or_report` prints them for the real environment) when it is invalid."""
    from xpu_serve.config import ConfigError, load_config

    try:
        with _unset_as_references(_raw(path)):
            return load_config(path)
    except ConfigError:
        return load_config_or_report(path)  # the problems as the real environment gives them


def run(args: argparse.Namespace) -> int:
    """Print the unit and the environment warnings; exit 2 with one line per problem on a bad config."""
    from xpu_serve.integrations.unit import (
        WATCHDOG_SEC,
        UnitError,
        default_env_file,
        env_file_warnings,
        render_unit,
    )

    cfg = _load(args.config)
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
