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


def test_spoofed_init_file_record_in_requests_does_not_make_another_runs_files_ours(up_factory: Any) -> None:
    """vLLM's "distributed_init_method=file:///tmp/vllm_dist_<id>" record proves a dist file ours
    (cleanup.dist_paths_in_line). The same words in a request path or a prompt used to make the
    supervisor remove another server's init file and CPU shm segments at its next cleanup."""
    import os
    import signal
    import uuid
    from pathlib import Path

    u = up_factory().start()
    u.wait_tree(1)
    vid = uuid.uuid4().hex
    victims = [Path(f"/tmp/vllm_dist_{vid}"), Path(f"/dev/shm/vllm_dist_{vid}-cpushm_0")]
    try:
        for v in victims:  # another server's files, created after our launch, not open right now
            v.write_bytes(b"x")
        record = (
            "[parallel_state.py:1906] world_size=2 rank=0 local_rank=0 "
            f"distributed_init_method=file:///tmp/vllm_dist_{vid} backend=gloo"
        )
        httpx.get(f"http://127.0.0.1:{u.port}/x?distributed_init_method=file:///tmp/vllm_dist_{vid}", timeout=10)
        r = httpx.post(f"http://127.0.0.1:{u.port}/v1/completions", timeout=30,
                       json={"model": "sim", "prompt": record, "max_tokens": 2})
        assert r.status_code == 200
        log = u.runtime / "logs" / "1" / "vllm.log"
        u.wait_for(lambda: f"/tmp/vllm_dist_{vid} HTTP/1.1" in log.read_text(), 10, "the access line in vllm.log")
        time.sleep(0.5)  # (the supervisor reads it through the pump)
        os.kill(u.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        assert u.exit_code() == 0
        assert all(v.exists() for v in victims), [e.get("removed") for e in u.events("cleaned")]
    finally:
        for v in victims:
            v.unlink(missing_ok=True)


def test_spoofed_fatal_text_as_request_field_names_does_not_fail_the_server(up_factory: Any) -> None:
    """vLLM logs the names of unknown request fields (protocol.py, OpenAIBaseModel, WARNING up to
    ~0.11): one anonymous POST with a field named EngineDeadError must not restart a healthy server."""
    u = up_factory().start()
    u.wait_tree(1)
    r = httpx.post(f"http://127.0.0.1:{u.port}/v1/completions", timeout=30,
                   json={"model": "sim", "prompt": "hi", "max_tokens": 2, "EngineDeadError": 1,
                         "Worker proc VllmWorker-0 died unexpectedly (exit code: -11)": 1})
    assert r.status_code == 200
    log = u.runtime / "logs" / "1" / "vllm.log"
    u.wait_for(lambda: "present in the request but ignored" in log.read_text(), 10, "the warning in vllm.log")
    time.sleep(2.0)
    st = u.state()
    assert st["state"] == "ready" and st["incarnation"] == 1 and not u.events("failed"), u.events()[-5:]
