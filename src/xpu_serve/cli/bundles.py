"""`xpu-serve bundles [--runtime-dir DIR | -c FILE] [--json] list|show ID|path ID`.

- `list` (the default): every bundle under RUNTIME/bundles, oldest first: id, cause, incarnation,
  size, whether it is complete, and the verdict's summary.
- `show ID`: the bundle's summary.md, then its files and collector outcomes (bundle.json).
- `path ID`: the bundle's folder (or its .tar.gz with `--tar`), for scripts.

ID is a full bundle id, a unique prefix or substring, or `latest`.
Exit codes: 0; 2 (`exitcodes.USAGE`) for an unknown or ambiguous ID, a missing ID, a bad config.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from xpu_serve import exitcodes
from xpu_serve.cli._common import nonempty_dir
from xpu_serve.cli.status import add_runtime_arguments, resolve_runtime_dir

if TYPE_CHECKING:
    from xpu_serve.bundle import BundleInfo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--runtime-dir DIR, -c FILE, --json; then ACTION: list, show ID, path [--tar] ID.

    The options are accepted before and after the action (`bundles --runtime-dir D show X` and
    `bundles show X --runtime-dir D`)."""
    add_runtime_arguments(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    for name, help_text in (("list", "list bundles, oldest first (the default)"),
                            ("show", "print a bundle's summary, errors and files"),
                            ("path", "print a bundle's folder (or .tar.gz with --tar)")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: an option given before the action is not reset by the action's parser
        p.add_argument("--runtime-dir", metavar="DIR", type=nonempty_dir, default=argparse.SUPPRESS,
                       help="the runtime directory")
        p.add_argument("-c", "--config", metavar="FILE", default=argparse.SUPPRESS,
                       help="take the runtime directory from this config")
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
        if name != "list":
            p.add_argument("id", metavar="ID", nargs="?", help="bundle id, unique prefix or substring, or 'latest'")
        if name == "path":
            p.add_argument("--tar", action="store_true", help="print the .tar.gz instead of the folder")


def _size(n: int) -> str:
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if f < 1024 or unit == "GiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return f"{n} B"


def _words(text: str, n: int) -> str:
    """`text` in at most `n` characters, cut at a word boundary with "…"."""
    text = " ".join(text.split())
    if len(text) <= n:
        return text
    cut = text[: n - 1].rsplit(" ", 1)[0] if " " in text[: n - 1] else text[: n - 1]
    return cut.rstrip(",;:") + "…"


def run(args: argparse.Namespace) -> int:
    """List, show or locate bundles; returns an exit code from `xpu_serve.exitcodes`. Errors are
    one line on stderr, `xpu-serve bundles ACTION: ...`, naming the bundles folder."""
    from xpu_serve.bundle import find_bundle

    runtime_dir = resolve_runtime_dir(args)
    if runtime_dir is None:
        return exitcodes.USAGE
    action = args.action or "list"
    if action == "list":
        return _list(runtime_dir, args.json)
    if not getattr(args, "id", None):
        return _error(action, "an ID is required (see `xpu-serve bundles list`)")
    try:
        b = find_bundle(runtime_dir, args.id)
    except LookupError as e:
        return _error(action, str(e))
    if action == "path":
        target = b.tar if (getattr(args, "tar", False) or b.path is None) else b.path
        if target is None:
            return _error(action, f"bundle {b.id} has no .tar.gz (bundles.tar is off)")
        print(target)
        return exitcodes.OK
    _show(b, args.json)
    return exitcodes.OK


def _error(action: str, message: str) -> int:
    print(f"xpu-serve bundles {action}: {message}", file=sys.stderr)
    return exitcodes.USAGE


def _list(runtime_dir: Path | str, as_json: bool) -> int:
    """`bundles list`: a table, oldest first (`--json`: the `BundleInfo` dicts)."""
    from xpu_serve.bundle import list_bundles

    bundles = list_bundles(runtime_dir)
    if as_json:
        print(json.dumps([b.to_dict() for b in bundles], indent=2))
        return exitcodes.OK
    if not bundles:
        print(f"no bundles under {Path(runtime_dir) / 'bundles'}")
        return exitcodes.OK
    width = max(len(b.id) for b in bundles)
    print(f"{'ID':<{width}}  {'CAUSE':<20} {'INC':>4} {'SIZE':>10}  {'COMPLETE':<8}  SUMMARY")
    for b in bundles:
        comp = {True: "yes", False: "no", None: "partial"}[b.complete]
        text = f"DAMAGED: {b.problem}" if b.problem else b.summary
        print(f"{b.id:<{width}}  {b.cause:<20} {b.incarnation:>4} {_size(b.size_bytes):>10}  {comp:<8}  "
              f"{_words(text, 100)}")
    return exitcodes.OK


def _show(b: BundleInfo, as_json: bool) -> None:
    """`bundles show ID`: state, summary.md, the manifest's errors and files (`--json`: the
    bundle, incident.json and bundle.json as one object)."""
    from xpu_serve.bundle import read_bundle_file

    manifest = incident = None
    summary = ""
    if b.path is not None:
        manifest = _json_object(read_bundle_file(b.path, "bundle.json"))
        incident = _json_object(read_bundle_file(b.path, "incident.json"))
        summary = (read_bundle_file(b.path, "summary.md") or b"").decode("utf-8", "replace")
    if as_json:
        print(json.dumps({"bundle": b.to_dict(), "incident": incident, "manifest": manifest}, indent=2))
        return
    print(f"bundle {b.id}")
    print(f"path: {b.path or '-'}" + (f"\ntar: {b.tar}" if b.tar else ""))
    comp = {True: "complete", False: "INCOMPLETE", None: "partial (the writer did not finish)"}[b.complete]
    print(f"state: {comp}, {_size(b.size_bytes)}" + (f" (damaged: {b.problem})" if b.problem else ""))
    print()
    if summary:
        print(summary.rstrip("\n"))
    elif b.path is None:
        print("(only the .tar.gz is left; unpack it to read the bundle)")
    _show_manifest(manifest)


def _show_manifest(manifest: dict | None) -> None:
    if not manifest:
        return
    errors = manifest.get("errors")
    if isinstance(errors, list) and errors:
        print("\n## Errors")
        for err in errors:
            print(f"- {err}")
    files = manifest.get("files")
    if isinstance(files, list):
        print("\n## Files")
        for f in files:
            if isinstance(f, dict):
                print(f"{f.get('bytes', 0)!s:>12}  {f.get('path')}")


def _json_object(raw: bytes | None) -> dict | None:
    """The JSON object in `raw`, or None (missing, malformed, or not an object)."""
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None
