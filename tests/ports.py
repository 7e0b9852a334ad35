"""Free TCP ports for tests: each call gives a port no earlier call in this process gave.

The kernel may hand the same ephemeral port to two binds that are closed in between, so two
`bind(0)` calls in a row can return one port (seen: an engine port and a metrics port equal).
"""

from __future__ import annotations

import socket

_given: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not handed out."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port
