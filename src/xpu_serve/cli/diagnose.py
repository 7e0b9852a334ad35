"""`xpu-serve diagnose [--json] [--dmesg FILE] FILE...`: name the root cause of an incident from
log files (vLLM logs, kernel logs, or both mixed as people paste them; `-` reads stdin).

Exit codes (xpu_serve.exitcodes): 0 when the analysis ran (also for `cause: unknown`),
2 with one line on stderr for a path that cannot be read or no file given.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from xpu_serve import exitcodes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments: files, --json, --dmesg FILE (repeatable; another input file)."""
    parser.add_argument(
        "files", nargs="*", metavar="FILE", help="log files (vLLM, kernel, mixed); - for stdin"
    )
    parser.add_argument(
        "--dmesg",
        action="append",
        default=[],
        metavar="FILE",
        help="a kernel log file (same as giving it as FILE)",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict contract as JSON")


def run(args: argparse.Namespace) -> int:
    """Diagnose the files; print the report or the JSON verdict."""
    from xpu_serve.diagnosis import Analyzer, diagnose_files
    from xpu_serve.report import render_text

    paths: list[str] = []
    unmatched: list[str] = []
    for p in list(args.files) + list(args.dmesg):
        if p != "-" and not os.path.lexists(p) and any(ch in p for ch in "*?["):
            # a shell glob that matched nothing reaches us verbatim (`diagnose DIR/*.log DIR/*.txt`
            # on a case without a .txt): expand it ourselves, and ignore it when it matches nothing
            found = sorted(glob.glob(p))
            if found:
                paths.extend(found)
            else:
                unmatched.append(p)
            continue
        paths.append(p)
    if not paths:
        what = f" (no file matches {', '.join(unmatched)})" if unmatched else " (FILE... or --dmesg FILE)"
        print(f"xpu-serve diagnose: no input file given{what}", file=sys.stderr)
        return exitcodes.USAGE
    for p in paths:
        if p == "-":
            continue
        if os.path.isdir(p):
            print(f"xpu-serve diagnose: {p}: is a directory", file=sys.stderr)
            return exitcodes.USAGE
        try:
            with open(p, "rb"):
                pass
        except OSError as e:
            print(f"xpu-serve diagnose: {p}: cannot read: {e.strerror or e}", file=sys.stderr)
            return exitcodes.USAGE
    an = Analyzer()
    try:
        if "-" in paths:
            for i, line in enumerate(sys.stdin.buffer, 1):
                an.feed_line(line.decode("utf-8", "replace"), "<stdin>", i)
        inc = diagnose_files([p for p in paths if p != "-"], analyzer=an)
    except OSError as e:
        print(f"xpu-serve diagnose: {e.filename or '?'}: cannot read: {e.strerror or e}", file=sys.stderr)
        return exitcodes.USAGE
    for u in unmatched:
        inc.notes.append(f"no file matched {u} (ignored)")
    if args.json:
        sys.stdout.write(json.dumps(inc.to_contract(), indent=1, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(render_text(inc))
    return exitcodes.OK
