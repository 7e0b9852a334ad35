"""The cancellation race of asyncio.wait_for on Python < 3.12 (cpython gh-86296) and our fix."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from xpu_serve import aio


async def _lost_cancellations(fn: Callable[[Awaitable[Any], float], Awaitable[Any]], rounds: int = 100) -> int:
    """How many times a loop waiting with `fn(event.wait(), 5)` ignored a cancel() sent in the
    same loop iteration as event.set() (what _discover saw when an incarnation died early)."""
    lost = 0

    async def body(ev: asyncio.Event, stop: list[bool]) -> None:
        while not stop:
            try:
                await fn(ev.wait(), 5)
            except asyncio.TimeoutError:
                pass
            ev.clear()
            await asyncio.sleep(0)

    for _ in range(rounds):
        ev = asyncio.Event()
        stop: list[bool] = []
        t = asyncio.create_task(body(ev, stop))
        await asyncio.sleep(0.001)
        ev.set()
        t.cancel()
        done, _ = await asyncio.wait({t}, timeout=0.5)
        if not done or not t.cancelled():
            lost += 1
            stop.append(True)
            t.cancel()
            await asyncio.wait({t}, timeout=2)
    return lost


def test_wait_for_never_loses_a_cancellation() -> None:
    assert asyncio.run(_lost_cancellations(aio.wait_for)) == 0


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="fixed in CPython 3.12")
def test_the_race_is_real_on_this_python() -> None:
    """The reason aio.wait_for exists: the stdlib loses (nearly) every one of these here."""
    assert asyncio.run(_lost_cancellations(asyncio.wait_for, rounds=6)) >= 3


def test_wait_for_result_timeout_and_inner_cancel() -> None:
    async def main() -> None:
        assert await aio.wait_for(asyncio.sleep(0.01, result=7), 5) == 7
        inner = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await aio.wait_for(inner, 0.05)
        assert inner.cancelled()
        ev = asyncio.Event()
        assert await aio.wait_event(ev, 0.05) is False
        ev.set()
        assert await aio.wait_event(ev, 0.05) is True

    asyncio.run(main())
