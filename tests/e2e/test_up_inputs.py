"""What `up` says about its inputs and its own host, as real processes: an engine host that does
not resolve, the metrics port taken, the supervisor itself stopped while a worker dies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
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


def test_metrics_port_in_use_warning_is_an_event_too(up_factory: Any) -> None:
    """metrics.listen on a port another program listens on: the warning went to stderr only, so
    events.jsonl (and `--log-format json` consumers) never said why metrics were missing. Now it
    is a `warning` event; supervision goes on and the server becomes ready."""
    import signal
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        u = up_factory()
        u.cfg["metrics"] = {"enabled": True, "listen": f"127.0.0.1:{port}"}
        u.write_config()
        u.start()
        u.wait_tree(1)
        warn = [e for e in u.events("warning") if "metrics endpoint" in e["msg"]]
        assert len(warn) == 1 and f"127.0.0.1:{port} disabled" in warn[0]["msg"], u.events("warning")
        u.proc.send_signal(signal.SIGTERM)
        assert u.exit_code() == 0
        err = u.stderr()
    assert err.count("metrics endpoint") == 1, err[-2000:]  # once, as the event's line


@pytest.mark.parametrize("connector", [True, False], ids=["proc-connector", "pidfd-only"])
def test_worker_death_while_the_supervisor_is_stopped_keeps_its_real_time(up_factory: Any, connector: bool) -> None:
    """SIGSTOP of the supervisor, a worker SIGKILLed, SIGCONT 3 s later: the incident gave the
    detection time as the time of death. Now, with the kernel's proc connector, the death time is
    the kernel's exit event (within 0.5 s of the kill) and the detection time is kept apart; without
    it, the time is marked as detection ("no later than"), with the supervisor's loop stall, and the
    incident says the real time of death is unknown."""
    import signal

    from .harness import proc_connector_available

    if connector and not proc_connector_available():
        pytest.skip("the kernel's proc connector is not available here")
    u = up_factory()
    u.start(env=None if connector else {"XPU_SERVE_PROC_CONNECTOR": "0"})
    st = u.wait_tree(1)
    worker = next(p["pid"] for p in st["processes"] if p["name"] == "Worker_TP1")
    os.kill(u.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(0.3)
        t_kill = time.time()
        os.kill(worker, signal.SIGKILL)
        time.sleep(3.0)
    finally:
        os.kill(u.proc.pid, signal.SIGCONT)
    u.wait_for(lambda: u.events("incident"), 60, "the incident")
    failed = u.events("failed")[0]
    assert failed["trigger"] == "process-exit" and failed["loop_stall_s"] >= 2.5, failed
    assert failed["detected_at"] >= t_kill + 2.5, (failed, t_kill)
    incident = json.loads((Path(u.events("incident")[0]["bundle"]) / "incident.json").read_text())
    trig = incident["supervisor"]["trigger"]
    assert trig["detected_at"] == failed["detected_at"] and trig["at"] == failed["at"]
    if connector:
        assert failed["pid"] == worker and failed["signal"] == "SIGKILL", failed
        assert failed["at_source"] == "kernel" and abs(failed["at"] - t_kill) < 0.5, (failed, t_kill)
        assert any("(the kernel's exit event)" in n for n in incident["notes"]), incident["notes"]
    else:
        # (a peer's earlier report may date it, `_open_window`: still a detection, after the stall)
        assert failed["at_source"] == "detection" and t_kill + 2.5 <= failed["at"] <= failed["detected_at"], failed
        assert any("no later than" in n and "unknown" in n for n in incident["notes"]), incident["notes"]
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    assert not u.our_pids()
