"""Hang watchdog: /metrics and stats-line parsing, the progress trackers on exact sequences, and
HangWatcher against a real HTTP server (metrics that stop growing, metrics gone, idle canary),
with real py-spy stack dumps of a real Python process."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.conftest import FIXTURES
from tests.helpers import Ctx as BaseCtx
from xpu_serve.config import Config
from xpu_serve.events import Event
from xpu_serve.incarnation import ProcessInfo
from xpu_serve.sources import progress as prog
from xpu_serve.watchers import HangWatcher, KernelWatcher

GLM_LOG = FIXTURES / "cases" / "glm47-flash-engine-hang" / "vllm.log"


@dataclass
class Ctx(BaseCtx):
    """`tests.helpers.Ctx`, ready (`ready_at` now) unless told otherwise."""

    ready_at: float | None = field(default_factory=time.time)


def metrics_text(running: int, waiting: int, prompt: float, gen: float) -> str:
    """vLLM's /metrics shape (names, types, labels as in vllm/v1/metrics/loggers.py)."""
    lab = 'engine="0",model_name="tiny"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{lab}}} {running}.0\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{lab}}} {waiting}.0\n"
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        f"vllm:prompt_tokens_total{{{lab}}} {prompt}\n"
        f"vllm:prompt_tokens_created{{{lab}}} 1.7645e+09\n"
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        f"vllm:generation_tokens_total{{{lab}}} {gen}\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{lab}}} 0.01\n"
    )


class FakeEngine:
    """A real HTTP server on 127.0.0.1 serving /metrics and /v1/completions from mutable state."""

    def __init__(self) -> None:
        self.running, self.waiting, self.prompt, self.gen = 0, 0, 0.0, 0.0
        self.growing = False
        self.metrics_status = 200
        self.completion_delay_s = 0.0
        self.completions = 0
        eng = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/metrics" or eng.metrics_status != 200:
                    self.send_response(404 if self.path != "/metrics" else eng.metrics_status)
                    self.end_headers()
                    return
                if eng.growing:
                    eng.gen += 7
                body = metrics_text(eng.running, eng.waiting, eng.prompt, eng.gen).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(n)
                eng.completions += 1
                time.sleep(eng.completion_delay_s)
                body = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"!"}]}'
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine() -> Any:
    e = FakeEngine()
    yield e
    e.close()


@pytest.fixture
def python_proc() -> Any:
    """A real Python process (as a vLLM worker would be) for py-spy to dump."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import time\ndef serve_forever():\n    time.sleep(120)\nserve_forever()"]
    )
    time.sleep(0.3)
    yield p
    p.kill()
    p.wait()


def hang_config(port: int, **hang: Any) -> Config:
    h = {"after_s": 1.0, "metrics_interval_s": 0.1}
    h.update(hang)
    return Config.model_validate(
        {
            "engine": {"model": "tiny", "port": port, "host": "0.0.0.0"},
            "supervision": {"hang": h},
            "bundles": {"collector_timeout_s": 10},
        }
    )


# ---- parsing ------------------------------------------------------------------------------------


def test_parse_metrics_sums_label_sets() -> None:
    text = metrics_text(1, 2, 30.0, 400.0) + 'vllm:num_requests_running{engine="1",model_name="tiny"} 3.0\n'
    s = prog.parse_metrics(text)
    assert (s.running, s.waiting, s.prompt_tokens, s.generation_tokens) == (4.0, 2.0, 30.0, 400.0)
    assert s.in_flight == 6.0 and s.tokens == 430.0
    assert prog.parse_metrics("# nothing here\n").in_flight is None
    assert prog.parse_metrics("vllm:x{ 1\n").in_flight is None  # not one of the four families
    with pytest.raises(ValueError, match="does not parse"):
        prog.parse_metrics('vllm:num_requests_running{engine="0" 1\n')
    with pytest.raises(ValueError, match="not a number"):
        prog.parse_metrics('vllm:num_requests_waiting{engine="0"} one\n')


def test_parse_metrics_agrees_with_prometheus_client_parser() -> None:
    """The scan gives prometheus_client's own parser's sums on real exposition text: label values
    holding `}`, spaces, escaped quotes and newlines, other families with the same name prefix,
    _created samples, timestamps, NaN-free random values over many label sets."""
    import random

    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    rng = random.Random(7)
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    fams = {
        "running": Gauge("vllm:num_requests_running", "r", labels, registry=reg),
        "waiting": Gauge("vllm:num_requests_waiting", "w", labels, registry=reg),
        "prompt": Counter("vllm:prompt_tokens", "p", labels, registry=reg),
        "gen": Counter("vllm:generation_tokens", "g", labels, registry=reg),
        "decoy": Gauge("vllm:num_requests_running_max", "d", labels, registry=reg),
    }
    names = ['m}o del', 'q"uote', "new\nline", "back\\slash", "plain"]
    for name in names:
        for engine in ("0", "1"):
            lv = {"model_name": name, "engine": engine}
            for key in ("running", "waiting", "decoy"):
                fams[key].labels(**lv).set(rng.randint(0, 50))
            for key in ("prompt", "gen"):
                fams[key].labels(**lv).inc(rng.uniform(0, 1e6))
    text = generate_latest(reg).decode()
    text += 'vllm:num_requests_waiting{model_name="x",engine="9"} 3 1700000000000\n'
    want: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            want[s.name] = want.get(s.name, 0.0) + s.value
    got = prog.parse_metrics(text)
    assert got.running == pytest.approx(want[prog.RUNNING])
    assert got.waiting == pytest.approx(want[prog.WAITING])
    assert got.prompt_tokens == pytest.approx(want[prog.PROMPT_TOKENS])
    assert got.generation_tokens == pytest.approx(want[prog.GENERATION_TOKENS])
    assert got.waiting >= 3


def test_parse_metrics_refuses_a_huge_sample_line_at_once() -> None:
    """A 15 MB sample line of quoted label values and no closing brace: the whole-text scan
    backtracked over it for 9 s on the supervisor's loop; now it is refused unread."""
    line = "vllm:num_requests_running{" + 'a="' * (5 << 20)
    text = metrics_text(1, 0, 5, 5) + line + "\n"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="longer than 16384"):
        prog.parse_metrics(text)
    assert time.monotonic() - t0 < 3
    ok = 'vllm:num_requests_running{model_name="' + "m" * 16000 + '"} 2\n'
    assert prog.parse_metrics(ok).running == 2.0  # long, but a line vLLM could write


def test_scrape_metrics_reads_at_most_max_metrics_bytes() -> None:
    """Over real HTTP: a valid /metrics body larger than MAX_METRICS_BYTES gives no sample (it
    was read whole and parsed on the loop), a normal one gives its sums."""
    from xpu_serve.sources.http_get import KeepAliveGet

    one = b'vllm:num_requests_running{engine="0"} 1\n'
    bodies = [metrics_text(3, 1, 10, 20).encode(), one * ((8 << 20) // len(one) + 1)]  # + a line

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            body = bodies.pop(0)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):  # the client stops reading the huge one
                self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    getter = KeepAliveGet("127.0.0.1", srv.server_address[1], 5.0, max_bytes=prog.MAX_METRICS_BYTES)

    async def main() -> tuple[Any, Any]:
        return await prog.scrape_metrics(getter), await prog.scrape_metrics(getter)

    try:
        small, huge = asyncio.run(main())
    finally:
        getter.close()
        srv.shutdown()
        srv.server_close()
    assert (small.running, small.waiting, small.tokens) == (3.0, 1.0, 30.0)
    assert huge is None


def test_parse_stats_lines_from_real_log() -> None:
    stats = [prog.parse_stats_line(ln) for ln in GLM_LOG.read_text().splitlines()]
    found = [s for s in stats if s is not None]
    assert len(found) >= 10
    last = found[-1]
    assert (last.engine, last.prompt_tps, last.generation_tps, last.running, last.waiting) == (
        0,
        0.0,
        0.0,
        1,
        0,
    )
    assert prog.parse_stats_line("INFO x Running: 1 reqs") is None


# ---- trackers on exact sequences ----------------------------------------------------------------


def test_metrics_progress_sequence() -> None:
    m = prog.MetricsProgress(after_s=90)
    S = prog.MetricsSample
    assert m.observe(0, S(0, 0, 0, 0)) is None  # idle
    assert m.observe(5, S(1, 0, 10, 0)) is None  # work arrives, tokens grew
    assert m.observe(10, S(1, 0, 10, 50)) is None
    for t in range(15, 100, 5):
        v = m.observe(t, S(1, 0, 10, 50))
        if t - 10 < 90:
            assert v is None
    v = m.observe(100, S(1, 0, 10, 50), wall=1000.0)
    assert (
        v is not None and v.no_progress_s == 90 and (v.running, v.waiting, v.detected_by) == (1, 0, "metrics")
    )
    # idle with flat counters is never a hang
    idle = prog.MetricsProgress(after_s=1)
    assert all(idle.observe(t, S(0, 0, 5, 5)) is None for t in range(0, 100, 10))
    # a counter reset (engine restarted) is progress
    r = prog.MetricsProgress(after_s=10)
    r.observe(0, S(1, 0, 100, 100))
    assert r.observe(9, S(1, 0, 0, 0)) is None and r.observe(18, S(1, 0, 0, 0)) is None


def test_stats_line_progress_on_glm_case() -> None:
    """The GLM-4.7-Flash hang: last progress 04-14 23:00:33, then one 0.0 line and silence."""
    sp = prog.StatsLineProgress(after_s=90)
    last_t = 0.0
    for ln in GLM_LOG.read_text().splitlines():
        st = prog.parse_stats_line(ln)
        if st is None:
            continue
        stamp = ln.split(" INFO ")[1][:14]
        t = datetime.strptime("2026-" + stamp, "%Y-%m-%d %H:%M:%S").timestamp()
        sp.observe(t, st, wall=t)
        last_t = t
    assert sp.check(last_t + 60) is None
    v = sp.check(last_t + 90)
    assert v is not None and v.detected_by == "stats-line" and v.running == 1
    assert v.last_progress_at is not None
    assert datetime.fromtimestamp(v.last_progress_at).strftime("%m-%d %H:%M:%S") == "04-14 23:00:33"


# ---- HangWatcher against a real server ----------------------------------------------------------


def _run_until_failure(w: HangWatcher, ctx: Ctx, timeout: float, before: Any = None) -> float:
    """Run the watcher until ctx.fail; returns seconds from start to failure (or timeout)."""

    async def main() -> float:
        t0 = time.monotonic()
        task = asyncio.ensure_future(w.run(ctx))
        if before is not None:
            await before()
        while not ctx.failures and time.monotonic() - t0 < timeout and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return time.monotonic() - t0

    return asyncio.run(main())


def test_hang_detected_from_metrics_with_stacks(
    engine: FakeEngine, python_proc: subprocess.Popen[bytes]
) -> None:
    cfg = hang_config(engine.port, after_s=1.5)
    ctx = Ctx(cfg)
    ctx.processes[python_proc.pid] = ProcessInfo("Worker_TP1", python_proc.pid, rank=1)
    engine.running, engine.growing = 1, True
    hang_started: list[float] = []

    async def stop_growing() -> None:
        await asyncio.sleep(0.8)
        engine.growing = False
        hang_started.append(time.time())

    w = HangWatcher(cfg, kernel=KernelWatcher(cfg))
    _run_until_failure(w, ctx, timeout=20, before=stop_growing)
    assert len(ctx.failures) == 1
    trig = ctx.failures[0]
    assert trig.kind == "hang" and trig.event is not None
    ev = trig.event
    assert ev in ctx.records
    assert ev.extra["detected_by"] == "xpu-serve hang watchdog (/metrics)"
    assert "1 running, 0 waiting" in ev.text
    detected_after = trig.at - hang_started[0]
    # at the hang window, not at some later poll: the upper bound is generous (a loaded 2-core CI VM)
    assert 1.5 * 0.9 <= detected_after <= 1.5 + 3.0, detected_after
    stacks = ev.extra["stacks"]
    assert isinstance(stacks, dict) and set(stacks) == {python_proc.pid}
    assert "serve_forever" in stacks[python_proc.pid], stacks[python_proc.pid]
    assert ev.extra["last_progress"] is not None
    assert trig.stacks is stacks  # type: ignore[attr-defined]  # what the supervisor hands to the bundle


def test_hang_from_stats_lines_when_metrics_unavailable(engine: FakeEngine) -> None:
    cfg = hang_config(engine.port, after_s=1.0)
    engine.metrics_status = 404
    ctx = Ctx(cfg)
    w = HangWatcher(cfg, dump=lambda pids, t: {})
    line = (
        "(APIServer pid=2406) INFO 04-14 23:00:44 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
        "Avg generation throughput: {g} tokens/s, Running: 1 reqs, Waiting: 2 reqs, GPU KV cache usage: 0.4%"
    )

    async def feed() -> None:
        w.on_line(line.format(g="14.2"))
        await asyncio.sleep(0.3)
        w.on_line(line.format(g="0.0"))

    took = _run_until_failure(w, ctx, timeout=10, before=feed)
    assert ctx.failures and ctx.failures[0].kind == "hang"
    ev = ctx.failures[0].event
    assert ev is not None and ev.extra["detected_by"] == "xpu-serve hang watchdog (stats lines)"
    assert "1 running, 2 waiting" in ev.text
    assert took < 1.0 * 1.2 + 1.0


def test_no_hang_while_idle_or_progressing(engine: FakeEngine) -> None:
    cfg = hang_config(engine.port, after_s=0.5)
    ctx = Ctx(cfg)
    engine.running, engine.growing = 0, False  # idle, flat counters

    async def busy() -> None:
        await asyncio.sleep(1.0)
        engine.running, engine.growing = 2, True  # busy and progressing

    _run_until_failure(HangWatcher(cfg, dump=lambda p, t: {}), ctx, timeout=2.0, before=busy)
    assert ctx.failures == []


def test_idle_hang_caught_by_canary(engine: FakeEngine) -> None:
    cfg = hang_config(engine.port, after_s=30, canary=True, canary_interval_s=0.3, canary_timeout_s=0.5)
    engine.completion_delay_s = 3.0  # the engine takes the request and never answers in time
    ctx = Ctx(cfg)
    took = _run_until_failure(HangWatcher(cfg, dump=lambda p, t: {}), ctx, timeout=5)
    assert engine.completions >= 1
    assert ctx.failures and ctx.failures[0].kind == "hang"
    ev = ctx.failures[0].event
    assert ev is not None and ev.extra["detected_by"] == "xpu-serve canary request"
    # the counts are what /metrics showed (idle), not the canary counted as user work
    assert "with 0 running, 0 waiting requests" in ev.text, ev.text
    assert took < 0.3 + 0.5 + 1.0


def test_canary_answering_is_no_hang(engine: FakeEngine) -> None:
    cfg = hang_config(engine.port, after_s=30, canary=True, canary_interval_s=0.2, canary_timeout_s=1.0)
    ctx = Ctx(cfg)
    _run_until_failure(HangWatcher(cfg, dump=lambda p, t: {}), ctx, timeout=1.5)
    assert ctx.failures == [] and engine.completions >= 2


def test_hang_names_kernel_gpu_fault(engine: FakeEngine) -> None:
    cfg = hang_config(engine.port, after_s=0.5)
    kw = KernelWatcher(cfg)
    fault = Event(
        source="kernel",
        text="xe 0000:47:00.0: [drm] Tile0: GT0: Timedout job: seqno=1523, guc_id=9",
        cause="gpu-fault",
    )
    kw.gpu_faults.append((time.monotonic(), fault))
    engine.running = 1
    ctx = Ctx(cfg)
    _run_until_failure(HangWatcher(cfg, kernel=kw, dump=lambda p, t: {}), ctx, timeout=5)
    assert ctx.failures
    trig = ctx.failures[0]
    assert trig.event is not None and trig.event.extra["kernel_faults"] == [fault.text]
    assert "Timedout job" in trig.detail


def test_engine_base_url() -> None:
    from xpu_serve.sources.health import base_url as engine_base_url

    assert engine_base_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert engine_base_url("::1", 8000) == "http://[::1]:8000"
    assert engine_base_url("10.0.0.2", 80) == "http://10.0.0.2:80"


def test_canary_request_outcomes_over_http_client() -> None:
    """The canary's three outcomes against real sockets: a 200 completion (ok), a refused port
    (not a hang: left to the other watchers), a server that accepts and never answers (hung,
    within about its timeout; the request's thread does not hold the loop)."""
    import json
    import socket

    class Completion(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["max_tokens"] == 1 and body["model"] == "tiny"
            out = json.dumps({"choices": [{"text": "x"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Completion)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()  # accepts (the kernel's backlog), never answers
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    refused_port = free.getsockname()[1]
    free.close()
    try:
        ok = asyncio.run(prog.canary_request("127.0.0.1", srv.server_address[1], "tiny", 5.0))
        refused = asyncio.run(prog.canary_request("127.0.0.1", refused_port, "tiny", 5.0))
        t0 = time.monotonic()
        hung = asyncio.run(prog.canary_request("127.0.0.1", mute.getsockname()[1], "tiny", 0.5))
        took = time.monotonic() - t0
    finally:
        srv.shutdown()
        mute.close()
    assert (ok.ok, ok.hung, ok.status, ok.error) == (True, False, 200, None)
    assert (refused.ok, refused.hung, refused.status) == (False, False, None)
    assert refused.error is not None and "ConnectionRefusedError" in refused.error
    assert (hung.ok, hung.hung, hung.status) == (False, True, None)
    assert hung.error is not None and hung.error.startswith("timed out after 0.5s")
    assert took < 10  # generous: the run did not wait for anything but the deadline
