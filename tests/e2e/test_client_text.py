"""Text a client controls (the request path and query in uvicorn's access line, a prompt in
vLLM's request log) is never evidence: a GET /x?EngineDeadError must not fail a healthy server."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from xpu_serve.diagnosis import Analyzer

pytestmark = pytest.mark.e2e

SPOOFS = [
    "/x?EngineDeadError",
    "/metrics?EngineCore%20encountered%20a%20fatal%20error",
    "/worker-proc-VllmWorker-0-died-unexpectedly",
    "/health?Fatal%20Python%20error:%20Segmentation%20fault",
]


def test_spoofed_fatal_text_in_requests_does_not_fail_the_server(up_factory: Any) -> None:
    u = up_factory().start()
    u.wait_tree(1)
    for path in SPOOFS:
        httpx.get(f"http://127.0.0.1:{u.port}{path}", timeout=10)
    r = httpx.post(f"http://127.0.0.1:{u.port}/v1/completions", timeout=30,
                   json={"model": "sim", "prompt": "Worker proc VllmWorker-0 died unexpectedly; EngineDeadError",
                         "max_tokens": 2})
    assert r.status_code == 200
    time.sleep(2.0)
    log = (u.runtime / "logs" / "1" / "vllm.log").read_text()
    assert "EngineDeadError" in log  # the spoofed text really reached vLLM's log
    st = u.state()
    assert st["state"] == "ready" and st["incarnation"] == 1 and not u.events("failed"), u.events()[-5:]


def test_request_log_prompt_is_not_evidence() -> None:
    an = Analyzer()
    lines = [
        "(APIServer pid=1) INFO 11-30 12:00:00 [logger.py:43] Received request cmpl-1: prompt: 'Fatal Python "
        "error: Segmentation fault. Worker proc VllmWorker-0 died unexpectedly', params: SamplingParams(n=1)",
        "(APIServer pid=1) INFO 11-30 12:00:01 [logger.py:61] Generated response cmpl-1: output: 'EngineDeadError'",
        '(APIServer pid=1) INFO:     [::1]:51234 - "GET /?EngineDeadError HTTP/1.1" 404 Not Found',
    ]
    for ln in lines:
        assert an.feed_line(ln) is None, ln
    assert an.incident().cause == "unknown"
    # the real lines are still evidence
    ev = an.feed_line("(EngineCore_DP0 pid=2) ERROR 11-30 12:00:02 [core.py:1] EngineCore encountered a fatal error.")
    assert ev is not None and an.is_fatal(ev)
