"""Helpers shared by the CLI subcommand modules (not a subcommand itself)."""

from __future__ import annotations

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
