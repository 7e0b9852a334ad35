"""asyncio helpers that never lose a cancellation.

On Python < 3.12, `asyncio.wait_for(aw, timeout)` swallows a cancellation that arrives in the same
loop iteration as `aw` completing (cpython gh-86296, fixed in 3.12 by rewriting wait_for on
`asyncio.timeout`): the caller's task goes on as if it had not been cancelled. A supervisor loop
waiting on an event that the failure path sets while it also cancels the loop (`Engine.discover`
when an incarnation dies in its first second) then never ends, and `up` hangs in state `failed`.
Measured in tests/test_aio.py: 200 of 200 such races lost the cancellation with
`asyncio.wait_for` on 3.11; none with `wait_for` below.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """`asyncio.wait_for` with the 3.12 semantics on every Python: the result of `aw`, or
    `asyncio.TimeoutError` after `timeout` seconds (`aw` is then cancelled); a cancellation of
    the caller always propagates (and cancels `aw`), even when `aw` completes at the same time."""
    if sys.version_info >= (3, 12):
        return await asyncio.wait_for(aw, timeout)
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})  # let it finish its cancellation, as wait_for does
        raise asyncio.TimeoutError
    return task.result()


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until `event` is set, at most `timeout` seconds; True if it is set. Cancellation
    always propagates (see `wait_for`)."""
    if event.is_set():
        return True
    try:
        await wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return event.is_set()
    return True
