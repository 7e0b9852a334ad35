"""`xpu-serve render -c FILE [--json]`: print the exact command and environment `up` will use.

Output (stdout): a POSIX shell snippet, `NAME=value \\` lines for the variables xpu-serve sets or
overrides, then the quoted argv; with `--json`, `{"argv": [...], "env": {...}}`. Secrets are `***`
in both. Exit 0, or 2 (exitcodes.USAGE) with one "FILE:LINE: key.path: message" line per problem
on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from xpu_serve import exitcodes
from xpu_serve.cli._common import load_config_or_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """-c/--config FILE (required), --json."""
    parser.add_argument("-c", "--config", required=True, metavar="FILE", help="the YAML config")
    parser.add_argument("--json", action="store_true", help='print {"argv": [...], "env": {...}}')


def run(args: argparse.Namespace) -> int:
    """Render the config; returns an exit code."""
    from xpu_serve.vllm_command import render

    cfg = load_config_or_report(args.config)
    if cfg is None:
        return exitcodes.USAGE
    rendered = render(cfg)
    if args.json:
        doc = {"argv": rendered.redacted_argv(), "env": rendered.redacted_env()}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(rendered.shell())
    return exitcodes.OK
