"""`xpu-serve npd kernel-monitor|custom-plugin-config|check`: node-problem-detector integration
(formats and rule choices: `xpu_serve.integrations.npd`, data/npd.yaml, docs/node-problem-detector.md).

- `kernel-monitor [-o FILE]`: the kernel monitor JSON (NPD `--config.system-log-monitor`).
- `custom-plugin-config [-o FILE] [--exec PATH] [--window S] [--interval D] [--source K] [--path F]`:
  the custom plugin monitor JSON (NPD `--config.custom-plugin-monitor`) that runs `npd check`.
- `check [--window S] [--source K] [--path F]`: the custom plugin itself. Reads the kernel log
  since boot once and prints one line of at most 80 bytes; exit 0 no GPU fault, 1 a GPU fault
  (NPD NonOK), 2 the kernel log cannot be read or bad arguments (NPD Unknown). These exit codes
  are NPD's plugin protocol, not the README's table (which agrees on 0 and 2).

`--path F` must be a regular file of at most MAX_FILE_BYTES (a FIFO, a device, a directory or a
larger file is Unknown at once, never a hang or a read of gigabytes); every line counts, the
last one also without its newline, and only its first MAX_LINE_BYTES bytes are classified.

Writing a config: exit 0, or 2 with one line when FILE cannot be written; FILE is replaced
atomically (`_common.write_output`), so a full disk leaves the old config whole.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
import time
from typing import Any

from xpu_serve import exitcodes
from xpu_serve.cli._common import default_exec, nonempty_dir, positive_seconds, write_output

_SOURCES = ("auto", "kmsg", "journalctl", "dmesg", "file")
MAX_FILE_BYTES = 16 << 20  # classified at ~2 MB/s on a 2-core VM: inside NPD's 15 s plugin timeout
MAX_LINE_BYTES = 4096  # a printk record is at most 1024 bytes; a syslog or journal prefix adds < 200


def _go_duration(text: str) -> str:
    """argparse type of --interval: a Go duration (time.ParseDuration) such as 60s, 1m30s."""
    if not re.fullmatch(r"(?:\d+(?:\.\d+)?(?:ns|us|ms|s|m|h))+", text) or not re.search(r"[1-9]", text):
        raise argparse.ArgumentTypeError(f"must be a Go duration > 0 such as 60s or 2m, got {text!r}")
    return text


def _source_args(p: argparse.ArgumentParser, window: float | None = None) -> None:
    p.add_argument("--source", choices=_SOURCES, default=None,
                   help="kernel log to read (default auto: /dev/kmsg, then journalctl -k, then dmesg; file with --path)")
    p.add_argument("--path", type=nonempty_dir, help="read this file of kernel lines (kmsg, dmesg or journal shapes) instead")
    since = "since boot" if window is None else f"{window:g}"
    p.add_argument("--window", type=positive_seconds, default=window,
                   help=f"count temporary GPU events only this many seconds back (default: {since}); "
                        "conditions such as a wedged device count since boot")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `npd` and its three commands."""
    sub = p.add_subparsers(dest="npd_command", metavar="NPD_COMMAND", required=True)
    km = sub.add_parser("kernel-monitor", help="print the kernel monitor config (JSON)")
    km.add_argument("-o", "--output", help="write it to this file instead of stdout")
    cp = sub.add_parser("custom-plugin-config", help="print the custom plugin monitor config that runs `npd check`")
    cp.add_argument("-o", "--output", help="write it to this file instead of stdout")
    cp.add_argument("--exec", dest="exec_path", help="path of xpu-serve where NPD runs (default: the one running)")
    cp.add_argument("--interval", type=_go_duration, help="NPD invoke_interval, a Go duration such as 60s (default from data/npd.yaml)")
    _source_args(cp, window=600.0)
    ck = sub.add_parser("check", help="the custom plugin: exit 0 no GPU fault, 1 a GPU fault, 2 unknown")
    _source_args(ck)


def _write(doc: object, output: str | None, cmd: str) -> int:
    text = json.dumps(doc, indent=2) + "\n"
    if output is None:
        sys.stdout.write(text)
        return exitcodes.OK
    try:
        write_output(text, output)
    except OSError as e:
        print(f"xpu-serve npd {cmd}: cannot write {output}: {e.strerror or e}", file=sys.stderr)
        return exitcodes.USAGE
    return exitcodes.OK


def _file_records(path: str) -> list[Any]:
    """The records of the kernel log file `path` (`sources.kernel.frame_text_line` per line).
    Raises OSError: unreadable, not a regular file (opened without blocking), too large."""
    from xpu_serve.fsread import read_regular
    from xpu_serve.sources.kernel import boot_offset, frame_text_line

    raw = read_regular(path, MAX_FILE_BYTES + 1)
    if raw is None:
        raise OSError(errno.EINVAL, "not a regular file")
    if len(raw) > MAX_FILE_BYTES:
        raise OSError(errno.EFBIG, f"larger than {MAX_FILE_BYTES >> 20} MiB")
    offset = boot_offset()
    texts = (line[:MAX_LINE_BYTES].decode("utf-8", "replace") for line in raw.split(b"\n"))
    return [frame_text_line(t, "file", offset) for t in texts if t.strip()]


def _check(args: argparse.Namespace) -> int:
    from xpu_serve.integrations.npd import UNKNOWN, clip, verdict
    from xpu_serve.sources.kernel import KernelSource, open_source, uptime_s

    kind = args.source or ("file" if args.path else "auto")
    if (kind == "file") != bool(args.path):
        print(f"xpu-serve npd check: {'--source file needs --path' if args.path is None else '--path needs --source file'}",
              file=sys.stderr)
        return UNKNOWN
    src: KernelSource | None = None
    try:
        if kind == "file":
            records = _file_records(args.path)
        else:
            src = open_source(kind, since_wall=time.time() - uptime_s() - 1.0)
            records = src.snapshot()
    except OSError as e:
        why = f"kernel log unreadable: {e.strerror or e}"
        if src is not None:  # a "none" source's reason names what was tried
            print(clip(why if src.kind == "none" else f"{why}: {src.kind}"))
        else:
            line = f"{why}: {args.path}"
            print(clip(line if len(line) <= 80 else f"{why}: .../{os.path.basename(args.path)}"))
        return UNKNOWN
    finally:
        if src is not None:
            src.close()
    status, message = verdict(records, args.window)
    print(message)
    return status


def _number(value: float) -> str:
    """`value` as short text that reads back as the same float (600.0 -> "600", not "6e+02")."""
    text = f"{value:g}"
    return text if float(text) == value else repr(value)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the npd command; see the module docstring for output and exit codes."""
    from xpu_serve.integrations import npd

    if args.npd_command == "check":
        return _check(args)
    try:
        if args.npd_command == "kernel-monitor":
            return _write(npd.kernel_monitor(), args.output, args.npd_command)
        check_args: list[str] = []
        for flag in ("source", "path", "window"):
            value = getattr(args, flag)
            if flag == "path" and value is not None:
                value = os.path.abspath(value)  # NPD runs the plugin from its own directory
            if value is not None:
                check_args += [f"--{flag}", _number(value) if isinstance(value, float) else str(value)]
        exec_path = os.path.abspath(args.exec_path) if args.exec_path else default_exec()
        doc = npd.custom_plugin_config(exec_path, check_args, args.interval)
        return _write(doc, args.output, args.npd_command)
    except npd.NPDError as e:
        print(f"xpu-serve npd {args.npd_command}: {e}", file=sys.stderr)
        return exitcodes.FAILURE
