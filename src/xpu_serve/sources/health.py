"""Health source: readiness and `/health` probing of the OpenAI-compatible server over HTTP
(`KeepAliveGet`: one kept-alive `http.client` connection).

vLLM's API server (vllm/entrypoints/openai/api_server.py) answers `GET /health` with 200 while
the engine client is alive and 503 once the engine is dead (EngineDeadError); `GET /v1/models`
lists `{"data": [{"id": <served model name>, ...}]}`. Readiness needs both: `/health` answers
before the model is registered on some versions. Note `/health` stays 200 while the engine is
hung: hangs are the hang watchdog's job, not this probe's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from xpu_serve.sources.http_get import KeepAliveGet


def base_url(host: str, port: int) -> str:
    """http://HOST:PORT for a listen address; wildcard hosts are probed on loopback."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def probe_ready(getter: KeepAliveGet, served_name: str) -> tuple[bool, str]:
    """Ready when `/health` is 200 and `/v1/models` lists `served_name`. Returns (ready, detail):
    "/health: connection refused", "/v1/models: HTTP 404", "/v1/models does not list ..."."""
    ok, detail = await poll_health(getter)
    if not ok:
        return False, f"/health: {detail}"
    res = await getter.get("/v1/models")
    if res.status is None:
        return False, f"/v1/models: {res.error or 'no response'}"
    if res.status != 200:
        return False, f"/v1/models: HTTP {res.status}"
    try:
        ids = [m.get("id") for m in json.loads(res.body).get("data", []) if isinstance(m, dict)]
    except (ValueError, AttributeError):
        return False, "/v1/models: not a model list"
    if served_name not in ids:
        return False, f"/v1/models does not list {served_name!r} (lists {ids})"
    return True, "ready"


def probe_address(host: str) -> str:
    """The address to probe for a listen address: wildcards are probed on loopback; IPv6 without
    brackets (as `KeepAliveGet` takes it)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host.strip("[]")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header vLLM's API server checks (`--api-key`), or none."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def poll_health(getter: KeepAliveGet) -> tuple[bool, str]:
    """GET /health over the kept-alive connection: (ok, detail), detail "HTTP 503",
    "connection refused", "timed out"..."""
    res = await getter.get("/health")
    if res.status is None:
        return False, res.error or "no response"
    return res.status == 200, f"HTTP {res.status}"


@dataclass
class HealthMonitor:
    """Probe `/health` every `interval_s`; call `on_failure(count, detail)` after `failures` in a row.

    `on_failure` is called once per run of consecutive failures (it is the supervisor's trigger);
    a success resets the count. `run()` loops until cancelled. `consecutive` and `last_detail`
    are readable at any time (for `status`). The polls share one kept-alive connection
    (`getter`, closed by its owner).
    """

    getter: KeepAliveGet
    interval_s: float
    failures: int
    on_failure: Callable[[int, str], None]
    consecutive: int = 0
    last_detail: str = ""

    async def run(self) -> None:
        fired = False
        while True:
            await asyncio.sleep(self.interval_s)
            ok, detail = await poll_health(self.getter)
            self.last_detail = detail
            if ok:
                self.consecutive, fired = 0, False
                continue
            self.consecutive += 1
            if self.consecutive >= self.failures and not fired:
                fired = True
                self.on_failure(self.consecutive, detail)
