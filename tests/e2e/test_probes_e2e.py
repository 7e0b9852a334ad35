"""The health probes and `status --check` over real HTTP against a live `xpu-serve up` on the
simulator, through every state it can reach: starting (slow start-up), ready, a worker hang with
a request in flight before the watchdog's verdict, backoff, ready again, stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from .harness import _free_port

pytestmark = pytest.mark.e2e


def _probe(port: int, path: str) -> tuple[int, str]:
    r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    return r.status_code, r.text


def _check(u: Any) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "status", "--check", "--runtime-dir", str(u.runtime)],
        capture_output=True, text=True, timeout=30,
    )
    return out.returncode, out.stdout.strip()


def _stream(port: int, stop: threading.Event) -> None:
    body = {"model": "sim", "prompt": "hello", "max_tokens": 3000, "stream": True}
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    except httpx.HTTPError:
        pass


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_probes_and_check_through_every_state(up_factory: Any) -> None:
    u = up_factory(
        tp=2,
        # start-up ~3 s longer (x0.01), then rank 1 hangs in incarnation 1 once a request runs
        faults="slow-start seconds=300 incarnation=1; worker-hang rank=1 after=100 incarnation=1",
        engine={"served_model_name": "sim"},
        restart={"initial_delay_s": 4, "multiplier": 2, "max_delay_s": 5, "max_failures": 5},
        hang={"after_s": 6, "metrics_interval_s": 0.3},
    )
    u.cfg["environment"]["vars"]["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "100000"
    mport = _free_port()
    u.cfg["metrics"] = {"enabled": True, "listen": f"127.0.0.1:{mport}"}
    u.write_config()
    u.start()

    # starting: alive, not ready, not past its first start-up
    _wait(lambda: _probe(mport, "/livez")[0] == 200, 30, "/livez 200")
    assert u.state()["state"] == "starting"
    code, text = _probe(mport, "/readyz")
    assert code == 503 and text.startswith("state starting"), text
    assert _probe(mport, "/startupz")[0] == 503
    assert _check(u)[0] == 1

    # ready
    u.wait_tree(1, timeout=60)
    assert _probe(mport, "/readyz") == (200, "ready\n")
    assert _probe(mport, "/startupz")[0] == 200
    assert _check(u) == (0, "ready")

    # a request in flight, rank 1 hangs: /readyz fails before the watchdog's verdict
    stop = threading.Event()
    threading.Thread(target=_stream, args=(u.port, stop), daemon=True).start()
    try:
        text = _wait(
            lambda: (lambda c, t: t if c == 503 else None)(*_probe(mport, "/readyz")), 30, "/readyz 503"
        )
        assert text.startswith("hang suspected: no token progress for "), text
        assert u.state()["state"] == "ready" and not u.events("failed")  # no verdict yet
        assert _probe(mport, "/livez")[0] == 200
        assert _check(u)[0] == 0  # state.json still says ready: /readyz is the finer probe

        # the verdict, then backoff
        u.wait_state("backoff", incarnation=1, timeout=60)
        code, text = _probe(mport, "/readyz")
        assert code == 503 and text.startswith("state backoff, restart in "), text
        assert _probe(mport, "/startupz")[0] == 200
        assert _probe(mport, "/livez")[0] == 200
        code, line = _check(u)
        assert code == 1 and line.startswith("not ready: backoff"), line
    finally:
        stop.set()
    assert any(e.get("cause") == "engine-hang" or "hang" in str(e) for e in u.events("incident"))

    # ready again, then stopped: no listener, no supervisor
    u.wait_tree(2, timeout=60)
    assert _probe(mport, "/readyz")[0] == 200
    assert u.proc is not None
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code(60) == 0
    with pytest.raises(httpx.ConnectError):
        _probe(mport, "/livez")
    code, line = _check(u)
    assert code == 2 and line.startswith("no supervisor") and "last state stopped" in line, line
