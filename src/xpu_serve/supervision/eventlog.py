"""The supervisor's own event log: one line per event (text or JSON) plus RUNTIME/events.jsonl."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, cast

from xpu_serve import output

# Level of each supervisor event (EventLog.emit): a root cause or giving up is an error; what
# needs a look but is handled is a warning; routine progress is info.
EVENT_LEVELS = {
    "incident": "error",
    "failed": "error",
    "gave-up": "error",
    "detected": "warning",
    "warning": "warning",
    "orphans": "warning",
    "restart-held": "warning",
    "kill": "warning",
    "output-dropped": "warning",
    "reaped": "debug",
}
# syslog priorities of the levels (sd-daemon.h: SD_ERR 3, SD_WARNING 4, SD_INFO 6, SD_DEBUG 7)
SYSLOG_PRIORITY = {"error": 3, "warning": 4, "info": 6, "debug": 7}


def _is_journal_stream(stream: IO[str], journal_stream: str) -> bool:
    """True when `stream`'s file is the one $JOURNAL_STREAM ("DEVICE:INODE", decimal) names."""
    dev, _, ino = journal_stream.partition(":")
    try:
        st = os.fstat(stream.fileno())
        return dev.isdigit() and ino.isdigit() and (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError, AttributeError):
        return False


def _open_private_append(path: Path) -> IO[str]:
    """`path` opened for appending lines, created 0600 (and made 0600 if an earlier run left it wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o600)
    return open(fd, "a", buffering=1)  # noqa: SIM115 (lives as long as the log)


class EventLog:
    """The supervisor's own events, one line each, on `stream` (stderr by default).

    Text: `2026-11-30T09:00:00.123Z xpu-serve: ready: incarnation 1 in 3.2 s`.
    JSON (`fmt="json"`): {"time": ISO, "ts": epoch s, "event": "ready", "level": "info", "msg": ...,
    **fields}. Every event is also appended as JSON to RUNTIME/events.jsonl (mode 0600) when
    `jsonl_path` is set. `level` (debug/info/warning/error) is `emit(level=)` or else
    EVENT_LEVELS[event] (default info). When `stream` is connected to journald ($JOURNAL_STREAM
    names its device:inode, systemd.exec(5)), each line starts with `<N>`, the syslog priority
    (sd-daemon(3): SD_ERR "<3>" ... SD_DEBUG "<7>"), which journald strips and stores as PRIORITY,
    so `journalctl -p err` selects the errors.
    The default stream is `xpu_serve.output.writer(2)`: a reader that stops reading never
    blocks `emit`; lines it could not take are dropped, and where they were an `output-dropped`
    event (`dropped`: lines, `stream`) is written, to events.jsonl too (`watch_output`).
    `redact`, when set (the supervisor sets its known secrets' `Redactor.mapping`), is applied to
    every record before it is written anywhere.
    """

    def __init__(self, fmt: str = "text", stream: IO[str] | None = None, jsonl_path: Path | None = None):
        self.fmt = fmt
        self.stream: IO[str] = stream if stream is not None else cast(IO[str], output.writer(2))
        self.redact: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._lock = threading.Lock()  # events.jsonl: the loop and the output writers' threads
        self._jsonl: IO[str] | None = None
        self._jsonl_path = jsonl_path
        if jsonl_path is not None:
            with contextlib.suppress(OSError):
                self._jsonl = _open_private_append(jsonl_path)
        self.journal = _is_journal_stream(self.stream, os.environ.get("JOURNAL_STREAM", ""))
        self.watch_output(self.stream)

    def watch_output(self, stream: Any) -> None:
        """Record the drops of `stream` (an `output.LineWriter`; others are ignored) as
        `output-dropped` events: its summary line is that event's line."""
        if isinstance(stream, output.LineWriter):
            stream.summary = lambda n, name=stream.name: self._dropped(name, n)

    def _dropped(self, name: str, n: int) -> str:
        rec, line = self._record(
            "output-dropped",
            f"{n} lines dropped ({name} not read)",
            "warning",
            {"dropped": n, "stream": name},
        )
        self._append(rec)
        return line

    def _record(
        self, event: str, msg: str, level: str | None, fields: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        ts = time.time()
        iso = datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        level = level or EVENT_LEVELS.get(event, "info")
        rec = {"time": iso, "ts": ts, "event": event, "level": level, "msg": msg, **fields}
        if self.redact is not None:
            rec = self.redact(rec)
        line = (
            json.dumps(rec, default=str) if self.fmt == "json" else f"{iso} xpu-serve: {event}: {rec['msg']}"
        )
        if self.journal:
            line = f"<{SYSLOG_PRIORITY.get(level, 6)}>{line}"
        return rec, line

    def _append(self, rec: dict[str, Any]) -> None:
        with self._lock:
            if self._jsonl is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._jsonl.write(json.dumps(rec, default=str) + "\n")

    def emit(self, event: str, msg: str, level: str | None = None, **fields: Any) -> None:
        rec, line = self._record(event, msg, level, fields)
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(line + "\n")
            self.stream.flush()
        self._append(rec)

    def reopen_if_moved(self) -> None:
        """Open events.jsonl again when its path no longer names the open file (the runtime
        directory was removed or the file rotated away), so events still reach RUNTIME."""
        path, f = self._jsonl_path, self._jsonl
        if path is None:
            return
        try:
            if f is not None:
                held, now = os.fstat(f.fileno()), os.stat(path)
                if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                    return
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            return
        try:
            new = _open_private_append(path)
        except OSError:
            return
        self.close()
        self._jsonl = new

    def close(self) -> None:
        """Close events.jsonl; a full disk at the final flush loses those lines, never the exit code."""
        with self._lock:
            if self._jsonl is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._jsonl.close()
                self._jsonl = None
