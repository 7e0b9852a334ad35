"""`xpu-serve check -c FILE [--strict] [--json] [--lib-dir DIR]... [--runtime-dir DIR]`.

Validates the config, then preflights the host (`xpu_serve.preflight`). Prints one line per
finding, `LEVEL CHECK message` (LEVEL: ok, info, warning, error), or with `--json`
`{"config": FILE, "problems": [...], "findings": [{"level", "check", "message"}], "exit_code": N}`.

Exit codes: 0 fine; 1 (exitcodes.FAILURE) warnings with `--strict`; 2 (exitcodes.USAGE) an
invalid config (its problems on stderr, one "FILE:LINE: key.path: message" line each) or any
error finding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from xpu_serve import exitcodes
from xpu_serve.cli._common import load_config_or_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """-c/--config FILE (required), --strict, --json, --lib-dir DIR (repeatable), --runtime-dir DIR."""
    parser.add_argument("-c", "--config", required=True, metavar="FILE", help="the YAML config")
    parser.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument(
        "--lib-dir",
        action="append",
        type=Path,
        metavar="DIR",
        help="search DIR for libze_intel_gpu.so* instead of the system library directories and "
        "`ldconfig -p` (repeatable; env XPU_SERVE_LIB_DIRS=DIR:DIR does the same)",
    )
    parser.add_argument("--runtime-dir", metavar="DIR", help="the runtime directory `up` will be given")


def run(args: argparse.Namespace) -> int:
    """Validate and preflight; returns an exit code."""
    from xpu_serve.preflight import LIB_DIRS_ENV, exit_code, preflight

    problems: list[str] = []
    cfg = load_config_or_report(args.config, problems)
    if cfg is None:
        if args.json:
            doc = {
                "config": str(args.config),
                "problems": problems,
                "findings": [],
                "exit_code": exitcodes.USAGE,
            }
            print(json.dumps(doc, indent=2))
        return exitcodes.USAGE

    lib_dirs = args.lib_dir
    if lib_dirs is None and os.environ.get(LIB_DIRS_ENV):
        lib_dirs = [Path(d) for d in os.environ[LIB_DIRS_ENV].split(":") if d]
    findings = preflight(cfg, lib_dirs=lib_dirs, runtime_dir=args.runtime_dir)
    code = exit_code(findings, args.strict)
    if args.json:
        doc = {
            "config": str(args.config),
            "problems": [],
            "findings": [f.as_dict() for f in findings],
            "exit_code": code,
        }
        print(json.dumps(doc, indent=2))
    else:
        width = max((len(f.check) for f in findings), default=0)
        for f in findings:
            print(f.line(width))
        counts = {lvl: sum(f.level == lvl for f in findings) for lvl in ("error", "warning")}
        print(
            f"check: {counts['error']} error(s), {counts['warning']} warning(s)"
            f"{' (strict)' if args.strict else ''} -> exit {code}",
            file=sys.stderr,
        )
    return code
