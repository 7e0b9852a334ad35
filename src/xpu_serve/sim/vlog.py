"""vLLM's output shapes, written the way vLLM writes them (one module for every simulator process).

Shapes reproduced (sources: vLLM v0.14 ``vllm/logger.py`` ``_DATE_FORMAT``/``_FORMAT`` and
``NewLineFormatter``; ``vllm/utils/system_utils.py`` ``decorate_logs``/``_add_prefix``; oneCCL
``src/common/log/log.hpp``; the real logs in tests/fixtures/cases/):

- vLLM logger line: ``LEVEL MM-DD HH:MM:SS [file.py:line] message``; every line of a multi-line
  message (a traceback) repeats the same header (NewLineFormatter).
- Process prefix: vLLM wraps ``sys.stdout``/``sys.stderr`` of its child processes so every line a
  Python-level write starts gets ``(Name pid=N) `` in front (``decorate_logs``). Native writes to
  fd 1/2 (faulthandler dumps, oneCCL, ``terminate called ...``) bypass the wrapper and carry no
  prefix. :class:`PrefixedStream` does the same here.
- oneCCL: ``YYYY:MM:DD-HH:MM:SS: PID:[RANK] |CCL_WARN| message`` (``PID |CCL_WARN|`` before the
  rank is known), written natively to stderr.

Written here rather than with :mod:`logging` because the ``[file.py:line]`` field must name vLLM's
source locations, not the simulator's: that is the domain's own log shape.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time

VLLM_ROOT = "/usr/local/lib/python3.12/dist-packages/vllm"
"""Where the simulated vLLM lives in tracebacks (the GLM-4.7-Flash container's layout)."""
PY_LIB = "/usr/lib/python3.12"
"""The simulated interpreter's standard library path in tracebacks."""

_lock = threading.Lock()
_name = "APIServer"
_stream_prefix = True  # vLLM 0.14: the streams prefix every line; 0.32: only logger records


def _write_fd(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd`; lose it silently if the reader is gone (EPIPE)."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except (BrokenPipeError, OSError):
            return
        view = view[n:]


class PrefixedStream(io.TextIOBase):
    """A text stream on `fd` that starts every line with ``(Name pid=N) `` (vLLM ``_add_prefix``).

    Complete lines are written with one ``os.write`` each, unbuffered, so lines from the
    processes of the tree interleave whole (as long as a line is shorter than PIPE_BUF).
    """

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self._partial = ""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, s: str) -> int:  # type: ignore[override]
        with _lock:
            text = self._partial + s
            lines = text.split("\n")
            self._partial = lines.pop()
            if lines:
                prefix = prefix_text() if _stream_prefix else ""
                out = "".join(f"{prefix}{line}\n" for line in lines)
                _write_fd(self._fd, out.encode("utf-8", "replace"))
        return len(s)

    def flush(self) -> None:
        with _lock:
            if self._partial:
                prefix = prefix_text() if _stream_prefix else ""
                _write_fd(self._fd, (prefix + self._partial).encode("utf-8", "replace"))
                self._partial = ""


def prefix_text() -> str:
    """The current process prefix, e.g. ``(Worker_TP0 pid=7986) ``; empty for the API server
    only when vLLM would not prefix it (never in v0.14)."""
    return f"({_name} pid={os.getpid()}) "


def set_name(name: str) -> None:
    """Set this process's log prefix name ("APIServer", "EngineCore_DP0", "Worker", "Worker_TP0")."""
    global _name
    _name = name


def get_name() -> str:
    """The current log prefix name."""
    return _name


def set_style(style: str) -> None:
    """Where the process prefix goes: "0.14" (vLLM v0.14 ``decorate_logs`` wraps sys.stdout and
    sys.stderr, so every Python-level line is prefixed, uvicorn's included) or "0.32" (only
    vLLM logger records carry it; uvicorn's lines and multiprocessing's ``Process EngineCore:``
    traceback are bare, as in tests/fixtures/cases/cpu-tp2-worker0-segv/vllm.log)."""
    global _stream_prefix
    _stream_prefix = style != "0.32"


def install_streams() -> None:
    """Replace sys.stdout/sys.stderr by prefixing, unbuffered streams on fds 1 and 2."""
    sys.stdout = PrefixedStream(1)
    sys.stderr = PrefixedStream(2)


def stamp(t: float | None = None) -> str:
    """vLLM's logger time: ``MM-DD HH:MM:SS`` in local time."""
    return time.strftime("%m-%d %H:%M:%S", time.localtime(t))


def log(level: str, loc: str, msg: str) -> None:
    """Print one vLLM logger record to stdout (through the prefix): every line of `msg` gets
    ``LEVEL MM-DD HH:MM:SS [loc] `` (vLLM NewLineFormatter). `loc` is ``file.py:line``."""
    header = f"{level} {stamp()} [{loc}] "
    if not _stream_prefix:
        header = prefix_text() + header
    sys.stdout.write("".join(f"{header}{line}\n" for line in msg.split("\n")))


def info(loc: str, msg: str) -> None:
    """`log` at INFO."""
    log("INFO", loc, msg)


def warning(loc: str, msg: str) -> None:
    """`log` at WARNING."""
    log("WARNING", loc, msg)


def error(loc: str, msg: str) -> None:
    """`log` at ERROR."""
    log("ERROR", loc, msg)


def uvicorn(msg: str) -> None:
    """A uvicorn line (``INFO:     msg``), printed through the API server's prefix."""
    sys.stdout.write(f"INFO:     {msg}\n")


def native(text: str) -> None:
    """Write `text` straight to fd 2, as C/C++ code does: no vLLM prefix."""
    _write_fd(2, text.encode("utf-8", "replace"))


def ccl(level: str, msg: str, rank: int | None = None, more: str = "") -> None:
    """One oneCCL log line, native on stderr: ``2026:03:26-04:12:18: 7986:[0] |CCL_WARN| msg``
    (``7986 |CCL_WARN|`` when `rank` is None). `level` is "WARN" or "ERROR". `more`: the lines
    oneCCL prints with it in the same log call (a CCL_THROW_IF_NOT's message), written in the
    same write() so another rank's line never lands between them."""
    t = time.strftime("%Y:%m:%d-%H:%M:%S", time.localtime())
    who = f"{os.getpid()}:[{rank}]" if rank is not None else f"{os.getpid()}"
    native(f"{t}: {who} |CCL_{level}| {msg}\n{more}")


def traceback_text(frames: list[tuple[str, int, str, str]], exc: str, caret: bool = False) -> str:
    """A Python traceback in CPython 3.12's shape.

    Args:
        frames: (path, line, function, source line) from the outermost call inward; a path that
            starts with "vllm/" is placed under :data:`VLLM_ROOT`, "py:" under :data:`PY_LIB`.
        exc: the final ``Type: message`` line (may hold several lines, e.g. chained causes).
        caret: add ``^^^^`` markers under the source line, as CPython does for sub-expressions.
    """
    out = ["Traceback (most recent call last):"]
    for path, line, func, src in frames:
        if path.startswith("vllm/"):
            path = f"{os.path.dirname(VLLM_ROOT)}/{path}"
        elif path.startswith("py:"):
            path = f"{PY_LIB}/{path[3:]}"
        out.append(f'  File "{path}", line {line}, in {func}')
        out.append(f"    {src}")
        if caret and "=" in src:
            rhs = src.split("=", 1)[1].strip()
            pad = len(src) - len(rhs)
            out.append(" " * (4 + pad) + "^" * len(rhs))
    out.append(exc)
    return "\n".join(out)
