"""Helpers shared by the CLI subcommand modules (not a subcommand itself)."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xpu_serve.config import Config


def load_config_or_report(path: str | Path, problems: list[str] | None = None) -> Config | None:
    """Load the config at `path` (`xpu_serve.config.load_config`), or report why it is invalid.

    On a `ConfigError` each problem ("FILE:LINE: key.path: message") is printed to stderr, one
    line each, appended to `problems` when a list is given, and None is returned; the caller then
    exits with `exitcodes.USAGE`. Other exceptions propagate.
    """
    from xpu_serve.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        for problem in e.problems:
            print(problem, file=sys.stderr)
        if problems is not None:
            problems.extend(e.problems)
        return None


def nonempty_dir(text: str) -> str:
    """argparse type of --runtime-dir: an empty value (``--runtime-dir "$UNSET"``) is an error
    (exit 2), not "no option": `up` would fall back to the config's runtime_dir and `status` or
    `stop` to /var/lib/xpu-serve, so they could look at different supervisors."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    if "\0" in text:
        raise argparse.ArgumentTypeError("must not contain a NUL character")
    return text


def positive_seconds(text: str) -> float:
    """argparse type of a --timeout in seconds: a finite number > 0 (nan would wait for ever)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return v


def default_exec() -> str:
    """The absolute path of the running xpu-serve executable (for a unit's ExecStart= or NPD's
    plugin path): argv[0] when absolute, else the one on PATH, else next to this Python."""
    argv0 = sys.argv[0]
    if os.path.basename(argv0) == "xpu-serve" and os.path.isabs(argv0):
        return argv0
    found = shutil.which("xpu-serve")
    if found:
        return os.path.abspath(found)
    return os.path.join(os.path.dirname(sys.executable), "xpu-serve")
