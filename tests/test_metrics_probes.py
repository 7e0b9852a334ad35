"""The supervisor's metrics families and health probes, over real HTTP on a real listener
(`xpu_serve.integrations.metrics` and `.probes`); the live-supervisor runs are in
tests/e2e/test_probes_e2e.py."""

from __future__ import annotations

import asyncio
import os
import select
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xpu_serve import __version__
from xpu_serve.config import Config
from xpu_serve.incarnation import Status
from xpu_serve.integrations import probes
from xpu_serve.integrations.metrics import SupervisorMetrics
from xpu_serve.integrations.webhook import Webhook
from xpu_serve.plugins import observers_for
from xpu_serve.signatures import CAUSES
from xpu_serve.sources.startup import PHASES


def _st(state: str, inc: int = 1, **kw: object) -> Status:
    return Status(state=state, incarnation=inc, restarts=0, supervisor_pid=1, **kw)  # type: ignore[arg-type]


def _get(port: int, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)


def _samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_families_no_created_series_build_info_causes_from_zero_process_collector() -> None:
    m = SupervisorMetrics()
    port = m.start("127.0.0.1:0")
    text = _get(port, "/metrics").text
    assert "_created" not in text
    s = _samples(text)
    assert s[f'xpu_serve_build_info{{version="{__version__}"}}'] == 1.0
    for cause in CAUSES:  # the signature table's cause list, every one from 0
        assert s[f'xpu_serve_incidents_total{{cause="{cause}"}}'] == 0.0
    assert s["xpu_serve_webhook_failures_total"] == 0.0
    assert s["xpu_serve_ready_timestamp_seconds"] == 0.0
    assert s["process_resident_memory_bytes"] > 1e6
    assert "process_cpu_seconds_total" in s and "process_open_fds" in s


def test_startup_phase_state_set_follows_the_watcher_then_ready() -> None:
    class FakeStartup:  # the real StartupWatcher's interface: name and phase()
        name = "startup-stall"
        now: str | None = "ccl-init"

        def phase(self) -> str | None:
            return self.now

    w = FakeStartup()
    m = SupervisorMetrics()
    m.attach([w])
    port = m.start("127.0.0.1:0")

    def phases() -> dict[str, float]:
        s = _samples(_get(port, "/metrics").text)
        return {ph: s[f'xpu_serve_startup_phase{{phase="{ph}"}}'] for ph in PHASES}

    m.on_state(_st("starting"))
    got = phases()
    assert got["ccl-init"] == 1.0 and sum(got.values()) == 1.0
    w.now = "weight-loading"
    assert phases()["weight-loading"] == 1.0
    m.on_state(_st("ready"))
    got = phases()
    assert got["ready"] == 1.0 and sum(got.values()) == 1.0
    m.on_state(_st("failed"))
    assert phases()["ready"] == 1.0  # the last start-up's phase outside a start-up
    m.on_state(_st("starting", 2))
    w.now = None  # the watcher has not seen a line of incarnation 2 yet
    assert phases()["engine-start"] == 1.0


def test_webhook_failures_counted_in_metrics() -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    cfg = Config.model_validate(
        {
            "engine": {"model": "m"},
            "metrics": {"listen": f"127.0.0.1:{mport}"},
            "webhook": {"url": f"http://127.0.0.1:{dead}/hook", "timeout_s": 2},
        }
    )
    obs = observers_for(cfg)
    hook = next(o for o in obs if isinstance(o, Webhook))
    hook.on_incident({"cause": "process-crash"}, None)
    hook.on_incident({"cause": "process-crash"}, None)
    hook.join(10)
    assert hook.failed == 2
    assert _samples(_get(mport, "/metrics").text)["xpu_serve_webhook_failures_total"] == 2.0


def test_unknown_path_404_and_head() -> None:
    m = SupervisorMetrics()
    port = m.start("127.0.0.1:0")
    assert _get(port, "/").status_code == 404
    assert _get(port, "/nonsense").status_code == 404
    assert _get(port, "/metrics?x=1").status_code == 200
    r = httpx.head(f"http://127.0.0.1:{port}/startupz", timeout=5)
    assert r.status_code == 503 and r.content == b""


def test_probe_answers_per_state_over_http() -> None:
    m = SupervisorMetrics()
    port = m.start("127.0.0.1:0")
    assert _get(port, "/livez").status_code == 503  # no loop to vouch for (not started on one)
    assert _get(port, "/readyz").text == "supervisor starting\n"
    m.on_state(_st("starting"))
    assert _get(port, "/readyz").status_code == 503 and _get(port, "/startupz").status_code == 503
    m.on_state(_st("ready"))
    assert _get(port, "/readyz").status_code == 200 and _get(port, "/startupz").status_code == 200
    m.on_state(_st("backoff", next_restart_at=time.time() + 30, reason="device wedged\nwaiting"))
    r = _get(port, "/readyz")
    assert r.status_code == 503
    assert r.text.startswith("state backoff, restart in ") and r.text.count("\n") == 1
    assert "device wedged waiting" in r.text
    assert _get(port, "/startupz").status_code == 200  # stays past the first start-up


def test_startupz_after_a_failed_first_startup() -> None:
    p = probes.Probes()
    p.on_state(_st("starting"))
    assert p.startupz()[0] == 503
    p.on_state(_st("failed"))  # the supervisor's restart policy takes over from here
    assert p.startupz()[0] == 200
    q = probes.Probes()
    q.on_state(_st("gave-up"))
    assert q.startupz()[0] == 200


def test_readyz_503_while_hang_suspected() -> None:
    m = SupervisorMetrics()

    class FakeHang:
        name = "hang"
        why: str | None = None

        def suspected(self) -> str | None:
            return self.why

    h = FakeHang()
    m.attach([h])
    port = m.start("127.0.0.1:0")
    m.on_state(_st("ready"))
    assert _get(port, "/readyz").status_code == 200
    h.why = "hang suspected: no token progress for 4.0 s with requests in flight (verdict at 10 s)"
    r = _get(port, "/readyz")
    assert r.status_code == 503 and r.text == h.why + "\n"


def test_livez_follows_the_loop_heartbeat() -> None:
    async def main() -> tuple[int, int]:
        m = SupervisorMetrics()
        port = m.start("127.0.0.1:0")
        await asyncio.sleep(0.1)
        alive = await asyncio.to_thread(lambda: _get(port, "/livez").status_code)
        got: list[int] = []

        def probe_later() -> None:
            time.sleep(probes.LIVE_STALE_S + 0.5)
            got.append(_get(port, "/livez").status_code)

        t = threading.Thread(target=probe_later)
        t.start()
        time.sleep(probes.LIVE_STALE_S + 1.5)  # the loop is blocked: no heartbeat meanwhile
        t.join()
        return alive, got[0]

    alive, blocked = asyncio.run(main())
    assert (alive, blocked) == (200, 503)


def test_slow_client_never_blocks_other_probes() -> None:
    m = SupervisorMetrics()
    port = m.start("127.0.0.1:0")
    stuck = socket.create_connection(("127.0.0.1", port))
    stuck.sendall(b"GET /metr")  # half a request, never finished
    try:
        t0 = time.monotonic()
        assert _get(port, "/readyz").status_code == 503
        assert time.monotonic() - t0 < 3
    finally:
        stuck.close()


@pytest.mark.parametrize("path", probes.PROBE_PATHS)
def test_probe_paths_are_served(path: str) -> None:
    m = SupervisorMetrics()
    port = m.start("127.0.0.1:0")
    assert _get(port, path).status_code in (200, 503)




_SERVER = """
import asyncio, os, resource, sys
from xpu_serve.incarnation import Status
from xpu_serve.integrations.metrics import SupervisorMetrics
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
async def main():
    m = SupervisorMetrics()
    print(m.start("127.0.0.1:0"), flush=True)
    m.on_state(Status(state="ready", incarnation=1, restarts=0, supervisor_pid=os.getpid()))
    while True:
        await asyncio.sleep(0.2)
        try:
            open("/proc/self/stat").close()  # what the supervisor's own work needs: a descriptor
        except OSError as e:
            print("open failed:", e, file=sys.stderr, flush=True)
asyncio.run(main())
"""


def test_idle_connection_flood_never_takes_the_supervisors_descriptors() -> None:
    """300 connections that send nothing and one that sends a byte a second, against a
    supervisor process limited to 256 descriptors: its descriptors stay bounded, its own open()
    keeps working, the slow client is cut at the deadline and a prober is answered after it."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        base = len(os.listdir(f"/proc/{proc.pid}/fd"))
        for _ in range(300):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1.0)
        held = len(os.listdir(f"/proc/{proc.pid}/fd"))
        assert held <= base + probes.MAX_CONNECTIONS + 2, (base, held)
        time.sleep(probes.REQUEST_DEADLINE_S + probes.SWEEP_S)  # the flood's accepted ones are cut
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        t0 = time.monotonic()
        got, cut_at = None, None
        for ch in b"GET /readyz HTTP/1.1\r\nHost: h\r\n" * 4:  # a byte every 0.5 s: 30 s in all
            try:
                slow.sendall(bytes([ch]))
                if select.select([slow], [], [], 0.5)[0]:
                    got = slow.recv(100)
            except OSError:
                got = b""
            if got is not None:
                cut_at = time.monotonic() - t0
                break
        assert got == b"" and cut_at is not None and cut_at < probes.REQUEST_DEADLINE_S + 2, (got, cut_at)
        time.sleep(probes.SWEEP_S * 2)
        r = _get(port, "/readyz")  # the flood's connections are still open on the client side
        assert (r.status_code, r.text) == (200, "ready\n")
    finally:
        for s in socks:
            s.close()
        proc.kill()
        _, err = proc.communicate(timeout=10)
    assert "open failed" not in err, err


def test_absolute_form_target_and_query_string() -> None:
    m = SupervisorMetrics()
    port = m.start("127.0.0.1:0")
    m.on_state(_st("ready"))
    for target in (b"http://127.0.0.1/readyz", b"/readyz?x=1", b"http://h:1/readyz?x=%2F"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: h\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        assert data.startswith(b"HTTP/1.0 200 ") and data.endswith(b"\r\n\r\nready\n"), (target, data)
