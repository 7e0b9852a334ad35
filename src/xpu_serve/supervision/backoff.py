"""State `backoff`: the restart policy's decision after a failure (`decide`), and the wait: the
policy's delay and, while the kernel watcher saw a device wedged, its device check
(`watchers.kernel.device_check`, run from the start of the backoff alongside the delay)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from xpu_serve import aio
from xpu_serve.incarnation import Trigger
from xpu_serve.restart_policy import Decision, RestartPolicy
from xpu_serve.supervision.eventlog import EventLog

# Causes (tests/fixtures/cases/README.md) a restart cannot fix.
UNFIXABLE_CAUSES = {"config-error"}
# Seconds between runs of `watchers.kernel.device_check` while a wedged device holds the restart.
DEVICE_CHECK_INTERVAL_S = 2.0


def decide(policy: RestartPolicy, cause: str, trigger: Trigger, summary: str | None) -> tuple[Decision, str | None]:
    """The policy's decision after a failure of `cause` (the verdict's) on `trigger`, and the
    reason to give up (None: restart). An unfixable cause or a config trigger gives up at once."""
    fatal = cause in UNFIXABLE_CAUSES or trigger.kind == "config"
    d = policy.on_failure(time.monotonic(), fatal=fatal)
    if d.action != "give-up":
        return d, None
    if fatal:
        return d, f"{cause}: {summary or trigger.detail} (a restart cannot fix this)"
    return d, f"{d.reason}; last cause: {cause}"


def restart_blocker(kernel: Any, log: EventLog) -> str | None:
    """Why the device is not ready for a restart (`KernelWatcher.restart_blocker`), or None."""
    if kernel is None:
        return None
    try:
        return kernel.restart_blocker()
    except Exception as ex:
        log.emit("warning", f"restart_blocker: {type(ex).__name__}: {ex}")
        return None


async def run(
    d: Decision,
    cause: str,
    kernel: Any,
    wake: asyncio.Event,
    log: EventLog,
    show: Callable[[float | None, str | None], None],
) -> bool:
    """The backoff after a failure of `cause`: the policy's delay (`d.delay_s`), then, while the
    kernel watcher (`kernel`, or None) says the device is wedged, until its device check passes;
    `wake` (stop, SIGHUP) ends it at once. `show(next_restart_at, reason)` publishes the state
    (epoch s, or None while held). True when it was ended before the device check passed."""
    blocker = restart_blocker(kernel, log)
    show(time.time() + d.delay_s, blocker)
    log.emit(
        "restart-scheduled",
        f"restart in {d.delay_s:.2f} s ({d.reason}; cause {cause})"
        + (f"; held until the device is ready: {blocker}" if blocker else ""),
        delay_s=round(d.delay_s, 3),
        ceiling_s=d.ceiling_s,
        cause=cause,
        blocker=blocker,
    )

    def held() -> None:
        show(None, blocker)
        log.emit("restart-held", f"restart held: {blocker}", reason=blocker)

    return await _wait(d.delay_s, blocker, kernel, wake, log, held)


async def _wait(
    delay_s: float,
    blocker: str | None,
    kernel: Any,
    wake: asyncio.Event,
    log: EventLog,
    held: Callable[[], None],
) -> bool:
    """Wait `delay_s` seconds, then, with a `blocker`, until the device check passes (`held()`
    is called then); `wake` ends the wait at once. True when it ended before the check passed."""
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
