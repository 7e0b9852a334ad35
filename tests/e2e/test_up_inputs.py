"""What `up` says about its inputs and its own host, as real processes: an engine host that does
not resolve, the metrics port taken, the supervisor itself stopped while a worker dies."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = pytest.mark.e2e


def test_unresolvable_host_gives_up_at_once_with_the_message_of_check(up_factory: Any) -> None:
    """engine.host that does not resolve: `up` waited stop.port_free_timeout_s, then said the port
    "is taken by another program: an unknown process" while `check` said the host does not
    resolve. Now `up` gives up at once (exit 4) with the message of `check`, launching nothing."""
    u = up_factory(engine={"host": "no-such-host.invalid"})
    u.cfg["supervision"]["stop"]["port_free_timeout_s"] = 60
    u.write_config()
    chk = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "check", "-c", str(u.config), "--json"],
        capture_output=True, text=True, timeout=60,
    )
    msgs = [f["message"] for f in json.loads(chk.stdout)["findings"] if f["check"] == "port"]
    assert len(msgs) == 1 and "does not resolve" in msgs[0], msgs
    if "Temporary failure" in msgs[0]:
        pytest.skip("this host's resolver does not answer (EAI_AGAIN): `up` asks again for a while")
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "up", "-c", str(u.config), "--no-echo"],
        capture_output=True, text=True, timeout=120,
    )
    took = time.monotonic() - t0
    assert r.returncode == 4, (r.returncode, r.stderr[-2000:])
    assert took < 30, took
    gave_up = u.events("gave-up")
    assert len(gave_up) == 1 and gave_up[0]["msg"] == f"engine.host: {msgs[0]}", gave_up
    assert "taken by another program" not in r.stderr
    assert not u.events("launched")
