"""The echo (journald, `docker logs`) leaves out the access lines of the supervisor's own probes;
vllm.log keeps them, and other requests are still echoed."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e


def test_probe_access_lines_not_echoed_but_logged(up_factory: Any) -> None:
    u = up_factory().start()
    u.wait_tree(1)
    r = httpx.post(
        f"http://127.0.0.1:{u.port}/v1/completions", json={"model": "sim", "prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 200
    assert httpx.get(f"http://127.0.0.1:{u.port}/nope", timeout=10).status_code == 404
    time.sleep(2.0)  # several /health probes (interval 0.5 s)
    vllm_log = (u.runtime / "logs" / "1" / "vllm.log").read_text()
    echo = (u.tmp / "up-0.out").read_text()
    assert vllm_log.count('"GET /health HTTP/1.1" 200') >= 3
    assert '"GET /health HTTP/1.1" 200' not in echo
    assert '"GET /v1/models HTTP/1.1" 200' not in echo
    assert '"POST /v1/completions HTTP/1.1" 200' in echo  # real traffic is still echoed
    assert '"GET /nope HTTP/1.1" 404' in echo  # and errors
