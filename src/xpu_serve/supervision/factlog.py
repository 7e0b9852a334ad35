"""`FactLog`: the incarnation's facts log, RUNTIME/logs/N/facts.log (format: `xpu_serve.facts`).

Every fact the supervisor feeds the live analysis (process exits, health failures, hangs,
start-up stalls, the trigger) is appended as one line when it is recorded, so it is on disk
before anything is killed and the bundle (which copies logs/N/) carries it. A write that fails
(a full disk, a removed or read-only folder) is one `warning` event per incarnation; the fact
still reaches the live analysis and supervision goes on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from xpu_serve import facts
from xpu_serve.events import Event


class FactLog:
    """Append-only facts log of one incarnation. `warn(msg)` reports the first failed write."""

    def __init__(self, path: Path, warn: Callable[[str], None]):
        self.path, self._warn = path, warn
        self.dropped = 0  # facts that could not be written

    def write(self, ev: Event, after: int) -> None:
        """Append the fact `ev`, read by the live analysis after `after` lines of vllm.log.
        Never raises. One os.write per line: a line is never interleaved or half-buffered."""
        try:
            data = (facts.to_line(ev, after) + "\n").encode("utf-8", "replace")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except (OSError, ValueError, TypeError) as ex:
            self.dropped += 1
            if self.dropped == 1:
                err = ex.strerror if isinstance(ex, OSError) and ex.strerror else ex
                self._warn(f"facts log {self.path}: cannot write ({err}); the bundle will lack facts")
