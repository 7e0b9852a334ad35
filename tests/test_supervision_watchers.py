"""The supervisor's built-in detectors as watchers, on a real event loop with a real Analyzer:
the start-up timeout and stall, fatal lines from the log pump's thread, and the hold of a
non-exit trigger while a process of the tree is exiting (a real child in state Z)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from xpu_serve.config import Config
from xpu_serve.events import Event
from xpu_serve.incarnation import ProcessInfo, Trigger
from xpu_serve.supervision.context import Incarnation, new_analyzer
from xpu_serve.supervision.watch import LineWatcher, StallWatcher, StartupTimeoutWatcher


def _config(**startup: float) -> Config:
    return Config.model_validate(
        {"engine": {"model": "m"}, "supervision": {"startup": startup, "health": {"interval_s": 0.05}}}
    )


def _ctx(cfg: Config, tmp_path: Path, fails: list[Trigger], records: list[Event]) -> Incarnation:
    def fail(t: Trigger) -> None:
        fails.append(t)
        ctx.trigger = ctx.trigger or t

    ctx = Incarnation(
        incarnation=1,
        config=cfg,
        runtime_dir=tmp_path,
        run_id="r",
        started_at=time.time(),
        log_dir=tmp_path,
        on_fail=fail,
        on_record=records.append,
        _loop=asyncio.get_running_loop(),
        _thread=threading.get_ident(),
    )
    return ctx


def test_startup_timeout_fails_with_the_last_probe_and_not_once_ready(tmp_path: Path) -> None:
    async def main() -> tuple[list[Trigger], float, list[Trigger]]:
        fails: list[Trigger] = []
        cfg = _config(timeout_s=0.3)
        ctx = _ctx(cfg, tmp_path, fails, [])
        t0 = time.monotonic()
        await asyncio.wait_for(StartupTimeoutWatcher(cfg, lambda: "connection refused").run(ctx), 5)
        took = time.monotonic() - t0
        ready_fails: list[Trigger] = []
        ready = _ctx(cfg, tmp_path, ready_fails, [])
        ready.ready_at = time.time()
        await asyncio.wait_for(StartupTimeoutWatcher(cfg, lambda: "x").run(ready), 5)  # returns at once
        return fails, took, ready_fails

    fails, took, ready_fails = asyncio.run(main())
    assert [t.kind for t in fails] == ["startup-timeout"]
    assert fails[0].detail == "not ready after 0.3 s (last probe: connection refused)"
    assert 0.3 <= took < 3.0
    assert ready_fails == []


def test_stall_watcher_records_and_fails_after_stall_s_without_a_line(tmp_path: Path) -> None:
    async def main() -> tuple[list[Trigger], list[Event]]:
        fails: list[Trigger] = []
        records: list[Event] = []
        cfg = _config(stall_s=0.2)
        ctx = _ctx(cfg, tmp_path, fails, records)
        last = time.monotonic()
        await asyncio.wait_for(StallWatcher(cfg, lambda: last).run(ctx), 5)
        return fails, records

    fails, records = asyncio.run(main())
    assert [t.kind for t in fails] == ["startup-stall"]
    assert fails[0].detail.startswith("no start-up progress for ") and fails[0].event is records[0]
    assert records[0].extra == {"fact": "startup-stall", "phase": "unknown", "missing_ranks": []}
    assert records[0].text.startswith("start-up stalled for ")


LINES = [
    "(EngineCore_DP0 pid=2390) INFO 11-06 19:52:01 [core.py:90] Initializing a V1 LLM engine",
    "(EngineCore_DP0 pid=2390) ERROR 11-06 19:52:03 [core.py:718] EngineCore encountered a fatal error.",
]


def test_line_watcher_routes_pump_thread_lines_and_fails_on_a_fatal_line(tmp_path: Path) -> None:
    seen_hooks: list[tuple[str, int, int]] = []
    engine_lines: list[str] = []

    async def main() -> tuple[list[Trigger], int]:
        fails: list[Trigger] = []
        cfg = _config()
        ctx = _ctx(cfg, tmp_path, fails, [])
        ctx.analyzer = new_analyzer()
        lw = LineWatcher(
            [lambda line, _f, n: seen_hooks.append((line, n, threading.get_ident()))],
            lambda _c, line: engine_lines.append(line),
        )
        lw.bind(ctx)
        task = asyncio.ensure_future(lw.run(ctx))
        pump = threading.Thread(target=lambda: [lw.from_pump(ln, i) for i, ln in enumerate(LINES, 1)])
        pump.start()
        pump.join()
        for _ in range(100):
            if fails:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return fails, pump.ident or 0

    fails, pump_thread = asyncio.run(main())
    assert [(ln, n) for ln, n, _ in seen_hooks] == [(LINES[0], 1), (LINES[1], 2)]
    assert {t for *_, t in seen_hooks} == {pump_thread}  # hooks run on the pump's thread
    assert engine_lines == LINES  # on the loop, in order
    assert [t.kind for t in fails] == ["fatal-line"]
    assert fails[0].process == "EngineCore_DP0" and fails[0].pid == 2390 and "fatal error" in fails[0].detail


def test_exit_watcher_holds_a_line_trigger_while_a_process_is_exiting(tmp_path: Path) -> None:
    """A consequence line read while a watched process is already dead (a zombie) waits for the
    exit window instead of failing the incarnation at once."""
    from xpu_serve.redact import Redactor
    from xpu_serve.supervision.engine import Engine
    from xpu_serve.supervision.eventlog import EventLog
    from xpu_serve.supervision.exits import ExitWatcher

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # a zombie until we reap it
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.01)

    async def main() -> tuple[bool, bool, list[Trigger]]:
        accepted: list[Trigger] = []
        cfg = _config()
        ctx = _ctx(cfg, tmp_path, [], [])
        ctx.processes[child.pid] = ProcessInfo("Worker_TP1", child.pid, rank=1)
        log = EventLog(stream=open(os.devnull, "w"))  # noqa: SIM115
        engine = Engine(cfg, "r", log, Redactor(), None, -1, protected=set, stop_requested=lambda: False)
        ew = ExitWatcher(engine, log, lambda e: None, accepted.append, lambda: True)
        ew.start(ctx)
        other = _ctx(cfg, tmp_path, [], [])
        not_started = ew.hold(other, Trigger(kind="fatal-line", detail="x", at=time.time()))
        held = ew.hold(ctx, Trigger(kind="fatal-line", detail="Worker died unexpectedly", at=time.time()))
        for _ in range(500):  # the window: 0.15 s, extended up to 1 s while the exit is under way
            if accepted:
                break
            await asyncio.sleep(0.01)
        ew.close()
        log.stream.close()
        return not_started, held, accepted

    try:
        not_started, held, accepted = asyncio.run(main())
    finally:
        child.wait()
    assert not_started is False  # an incarnation the watcher does not watch: fail at once
    assert held is True
    assert [t.detail for t in accepted] == ["Worker died unexpectedly"]  # used when no exit came
