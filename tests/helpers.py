"""Test helpers shared by several test modules."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from xpu_serve.events import Event
from xpu_serve.incarnation import ProcessInfo, Trigger


@dataclass
class Ctx:
    """A minimal IncarnationContext (the supervisor's contract) that keeps what watchers report."""

    config: Any
    started_at: float = field(default_factory=time.time)
    incarnation: int = 1
    runtime_dir: Any = None
    ready_at: float | None = None
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    failures: list[Trigger] = field(default_factory=list)
    records: list[Event] = field(default_factory=list)

    def fail(self, trigger: Trigger) -> None:
        self.failures.append(trigger)

    def record(self, event: Event) -> None:
        self.records.append(event)


def kmsg_readable() -> bool:
    """True when /dev/kmsg can be opened for reading here (root or CAP_SYSLOG, not restricted)."""
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
        return True
    except OSError:
        return False


def kmsg_write_opted_in() -> bool:
    """True when a test may write to the real /dev/kmsg: XPU_SERVE_TEST_KMSG=1, root, writable."""
    return os.environ.get("XPU_SERVE_TEST_KMSG") == "1" and os.geteuid() == 0 and os.access("/dev/kmsg", os.W_OK)


def incident_of(lines: list[str], file: str = "t.log") -> Any:
    """The real Analyzer's Incident of `lines` read as one file (line numbers from 1)."""
    from xpu_serve.diagnosis import Analyzer

    an = Analyzer()
    for i, line in enumerate(lines, 1):
        an.feed_line(line, file, i)
    return an.incident()
