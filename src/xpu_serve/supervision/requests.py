"""What the operator asked the state loop for (SIGTERM/SIGINT, SIGHUP, `xpu-serve stop`, tests)
and the event that wakes the loop from any wait."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Requests:
    """`stop`: stop the server and exit 0; `kill_now`: without the grace period; `restart`: a
    planned restart (no backoff, not a failure). `wake` is set on every request."""

    stop: bool = False
    kill_now: bool = False
    restart: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pending(self) -> bool:
        """A stop or a planned restart is asked for."""
        return self.stop or self.restart

    def rearm(self) -> None:
        """Clear `wake` before a new wait; set it again at once when a request is pending (one
        that raced with the work before the wait)."""
        self.wake.clear()
        if self.pending:
            self.wake.set()
