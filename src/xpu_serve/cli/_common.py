"""Helpers shared by the CLI subcommand modules (not a subcommand itself)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import shutil
import stat
import sys
import tempfile
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
    """argparse type of --runtime-dir (and `npd`'s --path): an empty value (``--runtime-dir
    "$UNSET"``) is an error (exit 2), not "no option": `up` would fall back to the config's
    runtime_dir and `status` or `stop` to /var/lib/xpu-serve, so they could look at different
    supervisors; `npd check` would read /dev/kmsg instead of the file."""
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


def write_output(text: str, path: str) -> None:
    """Write `text` (UTF-8) to `path`, the `-o FILE` of a command. A regular file (or a new one;
    through a symlink: its target) is replaced atomically: a temp file in its directory, fsync,
    rename, the old file's mode (a new one: 0666 less the umask), so a failed write (a full disk)
    leaves the old file whole. Anything else that exists (/dev/stdout, a FIFO with a reader) is
    written in place, opened without blocking: a FIFO nobody reads fails at once. Raises OSError."""
    real = os.path.realpath(path)
    try:
        st: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        fd = os.open(real, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return
    if st is None:
        umask = os.umask(0)
        os.umask(umask)
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.", suffix=".tmp", dir=os.path.dirname(real))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
