"""`Incarnation`: one launch of the engine as its watchers, the capture and the bundle writer see it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xpu_serve import cleanup
from xpu_serve.config import Config
from xpu_serve.events import Event
from xpu_serve.facts import FACT_SOURCES, FACTS_LOG
from xpu_serve.incarnation import ProcessInfo, Trigger
from xpu_serve.sources.log_pump import LogPump
from xpu_serve.supervision.factlog import FactLog


@dataclass
class Incarnation:
    """`xpu_serve.incarnation.IncarnationContext` of one launch, plus the supervisor's bookkeeping.

    Extra attributes for the bundle writer: `log_dir` (RUNTIME/logs/N), `run_id`, `pgid`,
    `trigger` (the first failure), `analyzer`, `argv`, `env` (the overrides we set),
    `restarts`, `stop` (StopReport once stopped), `facts` (the facts log, `FactLog`). `exited`: pid -> time of death (epoch s) of
    the watched processes whose exit was reported. `failed`: set once `trigger` is. `group_epoch`:
    the multi-node group's epoch this incarnation launched in (None without a group).
    """

    incarnation: int
    config: Config
    runtime_dir: Path
    run_id: str
    started_at: float
    log_dir: Path
    on_fail: Callable[[Trigger], None]
    on_record: Callable[[Event], None]
    ready_at: float | None = None
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    pgid: int | None = None
    trigger: Trigger | None = None
    analyzer: Any = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    shm_before: set[str] | None = None
    shm_owned: set[str] = field(default_factory=set)
    stop: cleanup.StopReport | None = None
    pump: LogPump | None = None
    exited: dict[int, float] = field(default_factory=dict)
    facts: FactLog | None = None
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    group_epoch: int | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: int | None = None

    def fail(self, trigger: Trigger) -> None:
        """Declare the incarnation failed; thread-safe; the first trigger wins."""
        self._call(self.on_fail, trigger)

    def record(self, event: Event) -> None:
        """Add evidence to the live analysis; thread-safe."""
        self._call(self.on_record, event)

    def add_fact(self, event: Event) -> None:
        """`event` as evidence for the live analysis (on the loop's thread); the supervisor's own
        facts (`facts.FACT_SOURCES`) go to the facts log first, with how many vllm.log lines the
        analysis had read by then. Never raises."""
        an = self.analyzer
        if event.source in FACT_SOURCES and self.facts is not None:
            seen = an.lines_read(str(self.pump.log_path)) if an is not None and self.pump is not None else 0
            self.facts.write(event, seen)
        if an is not None:
            with contextlib.suppress(Exception):
                an.add_event(event)

    def starts(self) -> dict[int, float]:
        """pid -> start time (epoch s, psutil create_time) of the known processes: the proof
        that a pid is still this incarnation's when it is signalled (`cleanup.is_proven`)."""
        return {
            pid: p.started_at for pid, p in self.processes.items() if isinstance(p.started_at, (int, float))
        }

    def _call(self, fn: Callable[[Any], None], arg: Any) -> None:
        if self._loop is not None and threading.get_ident() != self._thread:
            self._loop.call_soon_threadsafe(fn, arg)
        else:
            fn(arg)


def new_analyzer() -> Any:
    """A fresh `diagnosis.Analyzer` for one incarnation, or None when it cannot be built."""
    from xpu_serve.diagnosis import Analyzer  # (imported on first use: the analysis tables load then)

    try:
        return Analyzer()
    except Exception:
        return None


def new_incarnation(
    n: int,
    config: Config,
    run_id: str,
    log_dir: Path,
    restarts: int,
    on_fail: Callable[[Trigger], None],
    on_record: Callable[[Event], None],
    log: Any,
) -> Incarnation:
    """Incarnation `n` of `run_id`, started now on the running loop: a fresh live analyzer and
    the facts log in `log_dir` (RUNTIME/logs/N); `log` (an EventLog) gets its write warnings."""
    return Incarnation(
        incarnation=n,
        config=config,
        runtime_dir=log_dir.parent.parent,  # (log_dir is RUNTIME/logs/N)
        run_id=run_id,
        started_at=time.time(),
        log_dir=log_dir,
        on_fail=on_fail,
        on_record=on_record,
        restarts=restarts,
        analyzer=new_analyzer(),
        facts=FactLog(log_dir / FACTS_LOG, lambda msg: log.emit("warning", msg)),
        _loop=asyncio.get_running_loop(),
        _thread=threading.get_ident(),
    )
