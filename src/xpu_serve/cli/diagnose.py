"""`xpu-serve diagnose [--json] [--dmesg FILE] FILE|BUNDLE...`: name the root cause of an incident from
log files (vLLM logs, kernel logs, or both mixed as people paste them; `-` reads stdin).

A bundle directory (docs/bundles.md: `RUNTIME/bundles/<id>/`) is accepted as FILE: its full
vLLM log (`logs/vllm.log` or `logs/<n>/vllm.log`, rotations oldest first), the supervisor's facts
log (`logs/facts.log`: process exits, the trigger... as the live analysis got them) and
`kernel.log` are read; the per-process logs (`logs/Worker_TP0.log`...) are not, they repeat lines of vllm.log.

Inputs: regular files, FIFOs and `-` (stdin), each opened exactly once and read to EOF; an
input that never ends (a FIFO whose writer never closes) runs until EOF, like `grep`. Lines longer
than 64 KiB are cut, so memory stays bounded. A UTF-8/UTF-16/UTF-32 byte-order mark at the start of
an input selects its encoding (logs saved by Windows tools are UTF-16 with a BOM); else UTF-8.

Exit codes (xpu_serve.exitcodes): 0 when the analysis reached a verdict, 6 (NO_VERDICT) when it
ran but the verdict is `cause: unknown` (the report is printed all the same), so scripts can tell
"nothing found" from a verdict; 2 with one line on stderr for a path that cannot be read, a device or socket ("PATH: not a
regular file"), a directory that is not a bundle, or no file given.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import BinaryIO

from xpu_serve import exitcodes
from xpu_serve.analysis.kernel_owner import KernelOwners, owners, recorded_processes
from xpu_serve.facts import FACTS_LOG
from xpu_serve.incarnation import ProcessInfo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments: files, --json, --dmesg FILE (repeatable; another input file)."""
    parser.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="log files (vLLM, kernel, mixed), or a bundle directory (its vllm.log and kernel.log); - for stdin",
    )
    parser.add_argument(
        "--dmesg",
        action="append",
        default=[],
        metavar="FILE",
        help="a kernel log file (same as giving it as FILE)",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict contract as JSON")


_ROTATION_RE = re.compile(r"^vllm\.log(?:\.(\d+))?$")


def bundle_inputs(d: str | Path) -> list[str] | None:
    """The files to diagnose in a bundle directory, or None when `d` is not a bundle.

    A bundle (xpu_serve.bundle, docs/bundles.md) holds `incident.json` or `bundle.json` and a
    `logs/` folder. Returned: every `vllm.log` of `logs/` and of `logs/<n>/` (incarnations in
    numeric order; within one, rotations `vllm.log.<k>` oldest first, i.e. highest k first, then
    `vllm.log`, then that folder's `facts.log`: the supervisor's own facts, `xpu_serve.facts`),
    then `kernel.log` when present. Without any vllm.log, the per-process logs of `logs/` (the
    analysis counts a line repeated across files once). Never raises.
    """
    root = Path(d)
    try:
        if not (root / "logs").is_dir() or not any(
            (root / f).is_file() for f in ("incident.json", "bundle.json")
        ):
            return None
        folders = [root / "logs"] + sorted(
            (p for p in (root / "logs").iterdir() if p.is_dir()),
            key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name),
        )
        out: list[str] = []
        for f in folders:
            rot: list[tuple[int, str]] = []
            for p in f.iterdir():
                m = _ROTATION_RE.match(p.name)
                if m and p.is_file():
                    rot.append((int(m.group(1) or 0), str(p)))
            out.extend(p for _, p in sorted(rot, reverse=True))
            if (f / FACTS_LOG).is_file():
                out.append(str(f / FACTS_LOG))
        if not any(_ROTATION_RE.match(Path(p).name) for p in out):
            out = sorted(str(p) for p in (root / "logs").iterdir() if p.is_file() and p.suffix == ".log")
        if (root / "kernel.log").is_file():
            out.append(str(root / "kernel.log"))
        return out
    except OSError:
        return None


def bundle_owners(bundles: list[str]) -> KernelOwners | None:
    """The kernel-record owners of the bundles (analysis/kernel_owner.py): the processes their
    incident.json recorded, or None (no bundle, or none recorded: every pid is eligible). The
    kernel prints these pids only when every bundle says so (`initial_pid_ns`)."""
    procs: list[ProcessInfo] = []
    initial = True
    for b in bundles:
        got, ns = recorded_processes(b)
        procs += got
        initial = initial and ns is True
    return KernelOwners(owners(procs, initial)) if procs else None


def _live_exits(bundle: str) -> list[str]:
    """The process exits the supervisor saw itself (pidfd, proc connector), from the bundle's
    incident.json `supervisor.processes` (xpu_serve.bundle): ["Worker_TP1 (pid 9136) killed by
    SIGABRT", ...]. Live, the Analyzer was fed them as facts (xpu_serve.facts.process_exit); the
    logs alone do not hold them. [] when unreadable or none. Never raises."""
    from xpu_serve.fsread import read_regular

    try:
        raw = read_regular(Path(bundle) / "incident.json", 8 << 20, follow=False)
        procs = json.loads(raw or b"{}").get("supervisor", {}).get("processes") or []
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        # (RecursionError: a hand-made incident.json nested 100000 deep)
        return []
    out = []
    for p in procs if isinstance(procs, list) else []:
        if not isinstance(p, dict):
            continue
        if p.get("signal"):
            how = f"killed by {p['signal']}"
        elif isinstance(p.get("exit_code"), int):
            how = f"exit code {p['exit_code']}"
        elif p.get("exited_at"):
            how = "exit status unknown"
        else:
            continue
        out.append(f"{p.get('name')} (pid {p.get('pid')}) {how}")
    return out


class _Usage(Exception):
    """A bad input: the line after "xpu-serve diagnose: " on stderr, exit USAGE."""


def run(args: argparse.Namespace) -> int:
    """Diagnose the files; print the report or the JSON verdict."""
    from xpu_serve.diagnosis import Analyzer, diagnose_files
    from xpu_serve.report import render_text

    try:
        paths, unmatched = _expand_globs(list(args.files) + list(args.dmesg))
        paths, bundles = _expand_bundles(paths)
        _check_inputs(paths)
    except _Usage as e:
        print(f"xpu-serve diagnose: {e}", file=sys.stderr)
        return exitcodes.USAGE
    an = Analyzer()
    an.dedup = len(paths) > 1  # copies of a line in several files of one incident count once
    an.kernel_owners = bundle_owners(bundles)
    inputs: list[str | tuple[str, BinaryIO]] = []
    for p in paths:
        if p != "-":
            inputs.append(p)
        elif not any(isinstance(i, tuple) for i in inputs):  # stdin is read once
            inputs.append(("<stdin>", sys.stdin.buffer))
    try:
        inc = diagnose_files(inputs, analyzer=an)
    except OSError as e:
        # (a read error carries no file name: name the input when there is only one)
        name = e.filename or (paths[0] if len(set(paths)) == 1 else "one of the inputs")
        print(f"xpu-serve diagnose: {name}: cannot read: {e.strerror or e}", file=sys.stderr)
        return exitcodes.USAGE
    for u in unmatched:
        inc.notes.append(f"no file matched {u} (ignored)")
    for b in bundles:
        # a bundle with a facts log gave the analysis the exits themselves; an older one did not
        seen = [] if any(Path(b, "logs").rglob(FACTS_LOG)) else _live_exits(b)
        if seen:
            inc.notes.append(
                f"{b}: live, the supervisor also saw these exits itself (incident.json, not in the "
                f"logs read here; the live verdict counts them): {'; '.join(seen)}"
            )
    if args.json:
        sys.stdout.write(json.dumps(inc.to_contract(), indent=1, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(render_text(inc))
    return exitcodes.NO_VERDICT if inc.cause == "unknown" else exitcodes.OK


def _expand_globs(names: list[str]) -> tuple[list[str], list[str]]:
    """(paths, unmatched patterns): a shell glob that matched nothing reaches us verbatim
    (`diagnose DIR/*.log DIR/*.txt` on a case without a .txt): expand it ourselves, and ignore
    it when it matches nothing. Raises _Usage when no input is left."""
    paths: list[str] = []
    unmatched: list[str] = []
    for p in names:
        if p != "-" and not os.path.lexists(p) and any(ch in p for ch in "*?["):
            found = sorted(glob.glob(p))
            if found:
                paths.extend(found)
            else:
                unmatched.append(p)
            continue
        paths.append(p)
    if not paths:
        what = f" (no file matches {', '.join(unmatched)})" if unmatched else " (FILE... or --dmesg FILE)"
        raise _Usage(f"no input file given{what}")
    return paths, unmatched


def _expand_bundles(paths: list[str]) -> tuple[list[str], list[str]]:
    """(paths with each bundle directory replaced by its inputs, the bundles). Raises _Usage for
    a directory that is not a bundle or a bundle holding a symlink."""
    expanded: list[str] = []
    bundles: list[str] = []
    for p in paths:
        if p != "-" and os.path.isdir(p):
            inside = bundle_inputs(p)
            if inside is None:
                raise _Usage(f"{p}: is a directory (not a bundle: no incident.json and logs/)")
            links = [f for f in inside if os.path.islink(f)]
            if links:
                # a bundle is written by us with regular files only; a link in one copied from
                # elsewhere could make us read (and print evidence from) any file on this host
                raise _Usage(f"{links[0]}: a symlink inside a bundle: refused")
            expanded.extend(inside)
            bundles.append(p)
            continue
        expanded.append(p)
    return expanded, bundles


def _check_inputs(paths: list[str]) -> None:
    """Raises _Usage for a closed stdin, or a path that does not stat, is neither a regular
    file nor a FIFO, or is not readable. Only stat here: each input is opened exactly once, by
    diagnose_files (a FIFO opened to test it and closed loses its writer's data); a device
    would be read forever (/dev/zero)."""
    for p in paths:
        if p == "-":
            if sys.stdin is None:
                raise _Usage("-: standard input is closed")
            continue
        try:
            st = os.stat(p)
        except OSError as e:
            raise _Usage(f"{p}: cannot read: {e.strerror or e}") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise _Usage(f"{p}: not a regular file")
        if not os.access(p, os.R_OK):
            raise _Usage(f"{p}: cannot read: Permission denied")
