"""The supervisor's signals: what each asks for, a storm acted on once, stray ones ignored.

SIGTERM/SIGINT stop (a second SIGINT kills the tree at once), SIGHUP a planned restart, SIGUSR1
a scan for `xpu-serve bundle` requests. Every other signal whose default action terminates the
process (`STRAY_SIGNALS`) is logged and ignored: a stray `kill -USR2` must not kill the
supervisor and orphan a running server.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable

from xpu_serve.sources import processes as proc_src
from xpu_serve.supervision.eventlog import EventLog

# Signals whose default action ends the process and that the supervisor has no use for (signal(7)):
# handled as "logged, ignored" so that a stray one does not orphan the server. SIGQUIT (core dump,
# asked for on purpose), SIGKILL/SIGSTOP (cannot be caught) and the synchronous fault signals are
# left alone; SIGPIPE is already ignored by Python.
STRAY_SIGNALS: tuple[int, ...] = tuple(
    getattr(signal, n)
    for n in (
        "SIGUSR2",
        "SIGALRM",
        "SIGVTALRM",
        "SIGPROF",
        "SIGPWR",
        "SIGIO",
        "SIGSTKFLT",
        "SIGXCPU",
        "SIGXFSZ",
    )
    if hasattr(signal, n)
) + tuple(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))


def signal_name(signum: int) -> str:
    return proc_src.signal_name(signum)


class Signals:
    """Turns signals into the supervisor's requests: `stop(kill_now)`, `restart()`, `scan()`."""

    def __init__(
        self,
        log: EventLog,
        stop: Callable[[bool], None],
        restart: Callable[[], None],
        scan: Callable[[], None],
    ):
        self.log, self._stop, self._restart, self._scan = log, stop, restart, scan
        self._sigint_count = 0
        self._logged: dict[int, float] = {}  # signal -> monotonic time last logged (_repeat)

    def _repeat(self, signum: int) -> bool:
        """True for the same signal again within a second of the last one logged: a storm of
        SIGTERM/SIGHUP (a script in a loop) is acted on, but logged at most once a second."""
        now = time.monotonic()
        last = self._logged.get(signum)
        if last is not None and now - last < 1.0:
            return True
        self._logged[signum] = now
        return False

    def on_signal(self, signum: int) -> None:
        if signum == signal.SIGUSR1:
            self._scan()
        elif signum == signal.SIGHUP:
            if not self._repeat(signum):
                self.log.emit("signal", "SIGHUP: planned restart")
            self._restart()
        elif signum == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count <= 2 or not self._repeat(signum):
                self.log.emit(
                    "signal", "SIGINT: stopping" if self._sigint_count == 1 else "SIGINT again: kill at once"
                )
            self._stop(self._sigint_count > 1)
        else:
            if not self._repeat(signum):
                self.log.emit("signal", f"{signal_name(signum)}: stopping")
            self._stop(False)

    def on_stray(self, signum: int) -> None:
        """A signal whose default action would end the supervisor (and leave the vLLM tree
        orphaned) but that means nothing to it: logged (at most once a second per signal), ignored."""
        if not self._repeat(signum):
            self.log.emit(
                "signal",
                f"{signal_name(signum)}: ignored (SIGTERM or SIGINT stops, SIGHUP restarts, SIGUSR1 takes a bundle)",
            )

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Python-level handlers, not SIG_IGN, so the engine's processes still get the default
        dispositions after exec."""
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            loop.add_signal_handler(s, self.on_signal, s)
        for stray in STRAY_SIGNALS:
            with contextlib.suppress(ValueError, RuntimeError, OSError):
                loop.add_signal_handler(stray, self.on_stray, stray)


def ignore_from_now_on(loop: asyncio.AbstractEventLoop) -> None:
    """Replace the loop's signal handlers by SIG_IGN (the loop would reset them to SIG_DFL when it
    closes, and a SIGTERM of a storm arriving then would kill the exiting supervisor: exit -15
    instead of 0). The main thread blocks them meanwhile, so the switch has no default-action
    window."""
    sigs = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, *STRAY_SIGNALS}
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        for s in sigs:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                loop.remove_signal_handler(s)
                signal.signal(s, signal.SIG_IGN)
    finally:
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
