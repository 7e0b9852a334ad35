"""systemd notify protocol (`sd_notify(3)`) for `xpu-serve up` under a `Type=notify` unit.

Written here rather than taken from a library: the protocol is one datagram per message to the
socket named in `$NOTIFY_SOCKET` (a path, or an abstract socket when it starts with "@"), and the
Python bindings (`systemd-python`) need libsystemd headers to build. Messages sent (see
sd_notify(3) and systemd.service(5), "Type=notify", "WatchdogSec=", "EXTEND_TIMEOUT_USEC="):

- `READY=1` once, when the server is first ready;
- `STATUS=ready, incarnation 3, 2 restarts, last: umd-segfault` on every state change;
- `EXTEND_TIMEOUT_USEC=N` every few seconds while the first incarnation starts (model load can
  outlast any fixed `TimeoutStartSec=`);
- `WATCHDOG=1` every WATCHDOG_USEC/3 from a task on the supervisor's own asyncio loop, so a
  hung supervisor loop stops pinging and systemd restarts it;
- `STOPPING=1` once, when the supervisor itself begins to end (`Status.shutting_down`: SIGTERM,
  SIGINT, `xpu-serve stop`, gave up), never when it stops one incarnation to restart it: systemd
  takes STOPPING=1 as the start of the service's shutdown (unit deactivating, then SIGKILL of the
  whole cgroup at TimeoutStopSec), which would turn an in-place restart into a unit restart.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from xpu_serve.incarnation import Status


def notify_socket_address(value: str | None) -> str | bytes | None:
    """Turn `$NOTIFY_SOCKET` into a socket address: "@name" -> b"\\0name" (abstract), a path as is."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock addresses ("vsock:CID:PORT") are not supported


def status_text(status: Status) -> str:
    """One-line `STATUS=` text, e.g. "ready, incarnation 3, 2 restarts, last: umd-segfault"."""
    parts = [status.state, f"incarnation {status.incarnation}", f"{status.restarts} restart" + ("" if status.restarts == 1 else "s")]
    if status.last_incident and status.last_incident.get("cause"):
        parts.append(f"last: {status.last_incident['cause']}")
    if status.reason:
        parts.append(status.reason)
    return ", ".join(parts)


class SystemdNotifier:
    """An `Observer` that speaks the notify protocol; does nothing when `$NOTIFY_SOCKET` is unset.

    Args:
        environ: the environment to read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID from.
        extend_timeout_s: how much start-up time each EXTEND_TIMEOUT_USEC asks for (seconds).
    Sending never raises: a vanished socket is counted in `send_errors`.
    """

    def __init__(self, environ: dict[str, str] | None = None, extend_timeout_s: float = 60.0):
        env = dict(os.environ if environ is None else environ)
        self.address = notify_socket_address(env.get("NOTIFY_SOCKET"))
        self.watchdog_interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC")
        wd_pid = env.get("WATCHDOG_PID")
        if usec and usec.isdigit() and int(usec) > 0 and (not wd_pid or wd_pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 1e6 / 3
        self.extend_timeout_s = extend_timeout_s
        self.ready_sent = False
        self.stopping_sent = False
        self.send_errors = 0
        self._state = "starting"
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        """True when `$NOTIFY_SOCKET` named a usable socket."""
        return self._sock is not None

    def send(self, *lines: str) -> bool:
        """Send one datagram of newline-joined `KEY=value` lines; False if it could not be sent."""
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError:
            self.send_errors += 1
            return False

    def on_state(self, status: Status) -> None:
        """Observer hook: STATUS= on every change, READY=1 the first time it is ready, STOPPING=1
        once when the supervisor itself shuts down."""
        if not self.enabled:
            return
        self._state = status.state
        lines = [f"STATUS={status_text(status)}"]
        if status.state == "ready" and not self.ready_sent:
            lines.insert(0, "READY=1")
            self.ready_sent = True
        if status.shutting_down and not self.stopping_sent:
            lines.insert(0, "STOPPING=1")
            self.stopping_sent = True
        self.send(*lines)
        self._ensure_task()

    def on_incident(self, incident: dict[str, Any], bundle_path: str | None) -> None:
        """Observer hook: incidents reach systemd through the STATUS= of the next state change."""

    def _ensure_task(self) -> None:
        if self._task is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not called from the supervisor's loop (e.g. a test); no periodic pings
        self._task = loop.create_task(self._periodic())

    async def _periodic(self) -> None:
        """Runs on the supervisor's loop: WATCHDOG=1 and, before the first READY, EXTEND_TIMEOUT_USEC."""
        extend_every = max(1.0, self.extend_timeout_s / 3)
        next_extend = 0.0
        loop = asyncio.get_running_loop()
        while self._state not in ("stopped", "gave-up"):
            now = loop.time()
            if self.watchdog_interval_s is not None:
                self.send("WATCHDOG=1")
            if not self.ready_sent and now >= next_extend:
                self.send(f"EXTEND_TIMEOUT_USEC={int(self.extend_timeout_s * 1e6)}")
                next_extend = now + extend_every
            step = self.watchdog_interval_s if self.watchdog_interval_s is not None else extend_every
            if self.ready_sent and self.watchdog_interval_s is None:
                return
            await asyncio.sleep(min(step, extend_every) if not self.ready_sent else step)
