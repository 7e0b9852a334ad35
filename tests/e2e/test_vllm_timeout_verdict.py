"""A hung worker that vLLM itself times out (the watchdog off or slower): the live verdict is
engine-hang, as `diagnose` says offline, never the clean exit 0 of a worker vLLM shut down."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from xpu_serve.diagnosis import diagnose_files

pytestmark = pytest.mark.e2e


def test_vllm_timeout_of_a_hung_worker_is_engine_hang_live_and_offline(up_factory: Any) -> None:
    u = up_factory(faults="worker-hang rank=1 after=0 incarnation=1", hang={"enabled": False}).start()
    u.wait_tree(1)

    def request() -> None:
        try:
            httpx.post(f"http://127.0.0.1:{u.port}/v1/completions",
                       json={"model": "sim", "prompt": "hi", "max_tokens": 200}, timeout=60)
        except httpx.HTTPError:
            pass  # the server dies under it

    threading.Thread(target=request, daemon=True).start()
    u.wait_for(lambda: (u.state().get("last_incident") or {}).get("cause"), 60, "the incident")
    live = u.state()["last_incident"]
    offline = diagnose_files([u.runtime / "logs" / "1" / "vllm.log"]).to_contract()
    assert offline["cause"] == "engine-hang", offline["summary"]
    assert live["cause"] == "engine-hang", live
    assert "code 0" not in (live.get("summary") or "")


def test_stopped_api_server_is_a_hung_server_not_a_death(up_factory: Any) -> None:
    """SIGSTOP of the API server: /health times out while every process lives. The verdict says
    the server stopped answering (engine-hang, with stacks), not that a process died."""
    import os
    import signal

    u = up_factory(health={"interval_s": 0.5, "failures": 3, "timeout_s": 1.0}).start()
    st = u.wait_tree(1)
    api = next(p["pid"] for p in st["processes"] if p["name"] == "APIServer")
    os.kill(api, signal.SIGSTOP)
    try:
        u.wait_for(lambda: (u.state().get("last_incident") or {}).get("cause"), 60, "the incident")
    finally:
        os.kill(api, signal.SIGCONT)
    live = u.state()["last_incident"]
    assert live["cause"] == "engine-hang", live
    assert "died" not in (live.get("summary") or ""), live
    assert "/health" in (live.get("summary") or ""), live
    failed = u.events("failed")[0]
    assert failed["trigger"] == "health", failed
