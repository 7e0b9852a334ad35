"""The wait in state `backoff`: the restart policy's delay and, while the kernel watcher saw a
device wedged, its device check (`watchers.kernel.device_check`, run from the start of the
backoff alongside the delay)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from xpu_serve import aio
from xpu_serve.supervision.eventlog import EventLog

# Seconds between runs of `watchers.kernel.device_check` while a wedged device holds the restart.
DEVICE_CHECK_INTERVAL_S = 2.0


def restart_blocker(kernel: Any, log: EventLog) -> str | None:
    """Why the device is not ready for a restart (`KernelWatcher.restart_blocker`), or None."""
    if kernel is None:
        return None
    try:
        return kernel.restart_blocker()
    except Exception as ex:
        log.emit("warning", f"restart_blocker: {type(ex).__name__}: {ex}")
        return None


async def wait(
    delay_s: float,
    blocker: str | None,
    kernel: Any,
    wake: asyncio.Event,
    log: EventLog,
    held: Callable[[], None],
) -> bool:
    """Wait `delay_s` seconds, then, with a `blocker`, until the device check passes; `wake`
    (stop, SIGHUP) ends the wait at once. `held()` is called when the delay is over but the
    device is not ready. True when the wait was ended before the device check passed."""
    ready = (
        asyncio.get_running_loop().create_task(kernel.wait_device_ready(DEVICE_CHECK_INTERVAL_S))
        if blocker
        else None
    )
    try:
        await aio.wait_event(wake, delay_s)
        if ready is not None and not ready.done() and not wake.is_set():
            held()
            woken = asyncio.get_running_loop().create_task(wake.wait())
            try:
                await asyncio.wait({ready, woken}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
        forced = ready is not None and not ready.done()
        if ready is not None and ready.done() and not ready.cancelled():
            if ready.exception() is None:
                log.emit("device-ready", "device check passed: restarting")
            else:
                log.emit("warning", f"device check failed: {ready.exception()}; restarting")
        return forced
    finally:
        if ready is not None and not ready.done():
            ready.cancel()
            await asyncio.gather(ready, return_exceptions=True)
