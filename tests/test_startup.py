"""Start-up milestones per rank and stall detection, on the real cases' logs and live through
StartupWatcher."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.conftest import FIXTURES
from tests.helpers import Ctx
from xpu_serve.config import Config
from xpu_serve.sources.startup import StartupTracker
from xpu_serve.watchers import StartupWatcher

CASES = FIXTURES / "cases"


def feed(tracker: StartupTracker, path: Any) -> None:
    for i, ln in enumerate(path.read_text().splitlines()):
        tracker.on_line(ln, float(i))


def test_qwen3_startup_stall_names_ccl_init_and_rank_1() -> None:
    t = StartupTracker(world_size=4, stall_s=600, started=0.0)
    feed(t, CASES / "qwen3-30b-startup-stall" / "vllm.log")
    assert t.pid_rank == {24904: 0, 24905: 1, 24906: 2, 24907: 3}
    assert t.reached["distributed-init"] == {0, 1, 2, 3}
    assert t.reached["ccl-init"] == {0, 2, 3}
    assert t.stall(13 + 599) is None
    st = t.stall(13 + 600)
    assert st is not None
    assert (st.phase, st.missing_ranks, st.last_phase) == ("ccl-init", [1], "ccl-init")


def test_full_startup_reaches_every_milestone() -> None:
    t = StartupTracker(world_size=4, stall_s=600, started=0.0)
    feed(t, CASES / "qwen3-30b-worker0-died" / "vllm.log")
    for phase in (
        "engine-start",
        "distributed-init",
        "ccl-init",
        "weight-loading",
        "kv-cache",
        "engine-ready",
    ):
        assert t.reached.get(phase), phase
    assert t.reached["ccl-init"] == {0, 1, 2, 3}
    phase, missing, last = t.current_phase()
    assert (phase, missing, last) == ("ready", [], "engine-ready")


def test_cpu_gloo_run_has_no_ccl_phase() -> None:
    t = StartupTracker(world_size=1, stall_s=60, started=0.0)
    feed(t, CASES / "cpu-tp2-worker0-segv" / "vllm.log")
    assert t.world_size == 2 and t.backend == "gloo"
    assert t.reached["distributed-init"] == {0, 1}
    assert "ccl-init" not in t.reached
    assert t.current_phase()[0] != "ccl-init"


def test_progress_lines_keep_stall_timer_alive() -> None:
    t = StartupTracker(world_size=2, stall_s=10, started=0.0)
    t.on_line("Loading safetensors checkpoint shards: 6% Completed | 1/16 [00:10<02:38, 10.56s/it]", 8.0)
    assert t.stall(17.0) is None and t.stall(18.0) is not None
    # the shared-memory wait warning repeats while stuck: not progress
    t.on_line(
        "(EngineCore pid=1) INFO 04-14 23:01:33 [shm_broadcast.py:542] No available shared memory broadcast block found in 60 seconds.",
        15.0,
    )
    assert t.stall(18.0) is not None
    t.on_line("(APIServer pid=1) INFO:     Application startup complete.", 19.0)
    assert t.is_ready and t.stall(1000.0) is None


def _config(stall_s: float, tp: int = 4) -> Config:
    return Config.model_validate(
        {
            "engine": {"model": "m", "tensor_parallel_size": tp},
            "supervision": {"startup": {"stall_s": stall_s}},
        }
    )


def test_startup_watcher_fails_naming_phase_and_rank() -> None:
    cfg = _config(0.5)
    ctx = Ctx(cfg)
    w = StartupWatcher(cfg)
    lines = (CASES / "qwen3-30b-startup-stall" / "vllm.log").read_text().splitlines()

    async def main() -> float:
        task = asyncio.ensure_future(w.run(ctx))
        t0 = time.monotonic()
        for ln in lines:  # lines keep coming for a while: no stall yet
            w.on_line(ln)
            await asyncio.sleep(0.05)
        assert not ctx.failures
        while not ctx.failures and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return time.monotonic() - t0

    asyncio.run(main())
    assert len(ctx.failures) == 1
    trig = ctx.failures[0]
    assert trig.kind == "startup-stall" and trig.rank == 1
    assert trig.event is not None and trig.event in ctx.records
    assert trig.event.extra["phase"] == "ccl-init" and trig.event.extra["missing_ranks"] == [1]
    assert "phase ccl-init; ranks not reached: 1" in trig.event.text


def test_startup_watcher_quiet_until_fed_and_after_ready() -> None:
    cfg = _config(0.2)
    w = StartupWatcher(cfg)
    unfed = Ctx(cfg)

    async def run_for(ctx: Ctx, seconds: float, lines: list[str]) -> None:
        task = asyncio.ensure_future(w.run(ctx))
        for ln in lines:
            w.on_line(ln)
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run_for(unfed, 0.8, []))
    assert unfed.failures == []  # never fed a line: no verdict from silence we cannot see
    ready = Ctx(cfg)
    asyncio.run(run_for(ready, 0.8, ["(APIServer pid=1) INFO:     Application startup complete."]))
    assert ready.failures == []
