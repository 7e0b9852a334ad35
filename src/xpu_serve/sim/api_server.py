"""The simulated API server: the process `vllm serve` runs in (vllm/entrypoints/openai/api_server.py
with uvicorn, AsyncLLM and the engine-core client of vllm/v1/engine/).

HTTP (stdlib ThreadingHTTPServer, HTTP/1.1, chunked SSE): ``GET /health`` (200, 503 once the engine
is dead; 200 while it hangs, as vLLM), ``/v1/models``, ``/version``, ``/metrics`` (Prometheus text,
vLLM metric names, labels engine/model_name), ``POST /v1/completions`` and
``/v1/chat/completions`` (plain and ``stream: true``). Tokens come from the EngineCore, one per
running request per engine step, so a stopped worker stops them.

Like vLLM, the listening socket is bound before the engine starts (a busy port fails at once)
but requests are only answered after ``Application startup complete.``; when the engine dies
the server answers 503/500 for a short while, then shuts down and exits 0.
"""

from __future__ import annotations

import faulthandler
import http.server
import json
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import uuid
from http import HTTPStatus
from multiprocessing.connection import Connection, wait
from typing import Any

from xpu_serve.sim import vlog
from xpu_serve.sim.common import SimConfig
from xpu_serve.sim.engine_core import run_engine_core

_WORDS = (
    "the xpu engine answers every prompt with steady tokens while four cards share one model "
    "across tensor parallel ranks and the supervisor keeps watch"
).split()

ENGINE_DEAD_MSG = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# the innermost frames of vLLM's AsyncLLM output handler when the EngineCore is dead (file, line, function, text)
_OUTPUT_HANDLER_FRAMES = (
    ("vllm/v1/engine/async_llm.py", 502, "output_handler", "outputs = await engine_core.get_output_async()"),
    (
        "vllm/v1/engine/core_client.py",
        899,
        "get_output_async",
        "raise self._format_exception(outputs) from None",
    ),
)

_ROUTES = [
    ("/openapi.json", "GET, HEAD"),
    ("/docs", "GET, HEAD"),
    ("/docs/oauth2-redirect", "GET, HEAD"),
    ("/redoc", "GET, HEAD"),
    ("/health", "GET"),
    ("/load", "GET"),
    ("/ping", "GET"),
    ("/ping", "POST"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/v1/models", "GET"),
    ("/version", "GET"),
    ("/v1/responses", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/metrics", "GET"),
]


def _architecture(model: str) -> str:
    m = model.lower()
    if "qwen3" in m and ("a3b" in m or "moe" in m):
        return "Qwen3MoeForCausalLM"
    if "glm" in m:
        return "Glm4MoeLiteForCausalLM"
    if "qwen" in m:
        return "Qwen3ForCausalLM"
    return "LlamaForCausalLM"


def _token_text(index: int) -> str:
    return " " + _WORDS[(index * 7) % len(_WORDS)]


# The first frames of every traceback the API server prints: `vllm serve` -> CLI main -> serve
# (vllm/entrypoints/cli/main.py, cli/serve.py), shared by all of them.
_CLI_FRAMES = [
    ("/usr/local/bin/vllm", 10, "<module>", "sys.exit(main())"),
    ("vllm/entrypoints/cli/main.py", 73, "main", "args.dispatch_function(args)"),
    ("vllm/entrypoints/cli/serve.py", 60, "cmd", "uvloop.run(run_server(args))"),
]


# Request fields the simulator knows (a subset of vLLM's CompletionRequest/ChatCompletionRequest);
# others are logged as vLLM logs them: names chosen by the client, in the server's own log.
_REQUEST_FIELDS = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "temperature", "top_p",
     "n", "stop", "seed", "user", "stream_options", "logprobs", "echo", "presence_penalty",
     "frequency_penalty"}
)

class _Request:
    def __init__(self, rid: str, prompt_tokens: int, max_tokens: int):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.q: queue.Queue[tuple] = queue.Queue()
        self.t0 = time.monotonic()
        self.first: float | None = None


class _Metrics:
    """vLLM's Prometheus families (vllm/v1/metrics/loggers.py PrometheusStatLogger), same names,
    types and labels; built with prometheus_client like vLLM itself."""

    def __init__(self, model_name: str):
        from prometheus_client import Counter, Gauge, Histogram

        labels = ["model_name", "engine"]
        self.lv = {"model_name": model_name, "engine": "0"}
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels
        )
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels)
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels)
        self.gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels)
        self.preempt = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels
        )
        self.pc_q = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", labels
        )
        self.pc_h = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels
        )
        self.success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", labels + ["finished_reason"]
        )
        self.iter_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels,
            buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels
        )
        self.req_prompt = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
        )
        self.req_gen = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
        )
        for fam in (
            self.running,
            self.waiting,
            self.kv,
            self.prompt,
            self.gen,
            self.preempt,
            self.pc_q,
            self.pc_h,
            self.iter_tokens,
            self.ttft,
            self.e2e,
            self.req_prompt,
            self.req_gen,
        ):
            fam.labels(**self.lv)
        for reason in ("stop", "length", "abort"):
            self.success.labels(finished_reason=reason, **self.lv)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest()


class APIServer:
    """The API server process. :meth:`run` returns the process exit code."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.stop = threading.Event()
        self.dead = False
        self.ready = False
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.reqs: dict[str, _Request] = {}
        self.stats: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self.tok_prompt = 0
        self.tok_gen = 0
        self.engine: Any = None
        self.conn: Connection | None = None
        self.httpd: http.server.ThreadingHTTPServer | None = None
        self.metrics: _Metrics | None = None

    # -- start-up ----------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        vlog.set_style(cfg.prefix_style)
        vlog.set_name("APIServer")
        vlog.install_streams()
        if os.environ.get("PYTHONFAULTHANDLER") or cfg.faults_of("api-crash"):
            faulthandler.enable(all_threads=True)
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        vlog.info("api_server.py:1351", f"vLLM API server version {cfg.vllm_version}")
        vlog.info("utils.py:253", f"non-default args: {cfg.non_default_args!r}")
        if not self._bind():
            return 1
        vlog.info("model.py:533", f"Resolved architecture: {_architecture(cfg.model)}")
        vlog.info("model.py:1582", f"Using max model len {cfg.max_model_len}")
        vlog.info("scheduler.py:231", "Chunked prefill is enabled with max_num_batched_tokens=8192.")
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
            vlog.warning(
                "system_utils.py:152",
                "We must use the spawn multiprocessing start method. Overriding VLLM_WORKER_MULTIPROC_METHOD to "
                "'spawn'. See https://docs.vllm.ai/en/latest/usage/troubleshooting.html#python-multiprocessing "
                "for more information. Reasons: XPU is initialized",
            )
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe(duplex=True)
        self.engine = ctx.Process(target=run_engine_core, args=(cfg, theirs), name=cfg.engine_name)
        self.engine.start()
        theirs.close()
        self.conn = mine
        if not self._wait_ready():
            return self._shutdown_before_ready()
        self.metrics = _Metrics(cfg.served_model_name)
        vlog.info("api_server.py:1598", "Supported tasks: ['generate']")
        vlog.info("launcher.py:38", f"Starting vLLM API server 0 on http://{cfg.host}:{cfg.port}")
        vlog.info("launcher.py:46", "Available routes are:")
        for path, methods in _ROUTES:
            vlog.info("launcher.py:34", f"Route: {path}, Methods: {methods}")
        vlog.uvicorn(f"Started server process [{os.getpid()}]")
        vlog.uvicorn("Waiting for application startup.")
        vlog.uvicorn("Application startup complete.")
        self.ready = True
        self._send(("serving",))
        threading.Thread(target=self._read_outputs, name="output_handler", daemon=True).start()
        threading.Thread(target=self._log_stats, name="stat_logger", daemon=True).start()
        assert self.httpd is not None
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        for f in cfg.faults_of("api-crash"):
            threading.Timer(cfg.scaled(f.after or 0.0), self._crash, (f.signal or "SEGV",)).start()
        while not self.stop.wait(0.1):
            pass
        return self._shutdown()

    def _bind(self) -> bool:
        cfg = self.cfg
        server = self

        class Handler(_Handler):
            api = server

        try:
            self.httpd = http.server.ThreadingHTTPServer((cfg.host, cfg.port), Handler)
        except OSError as e:
            frames = [
                *_CLI_FRAMES,
                (
                    "vllm/entrypoints/openai/api_server.py",
                    1397,
                    "run_server",
                    "listen_address, sock = setup_server(args)",
                ),
                (
                    "vllm/entrypoints/openai/api_server.py",
                    1362,
                    "setup_server",
                    "sock = create_server_socket(sock_addr)",
                ),
                ("vllm/entrypoints/openai/api_server.py", 1319, "create_server_socket", "sock.bind(addr)"),
            ]
            sys.stderr.write(vlog.traceback_text(frames, f"OSError: [Errno {e.errno}] {e.strerror}") + "\n")
            sys.stderr.flush()
            return False
        self.httpd.daemon_threads = True
        return True

    def _wait_ready(self) -> bool:
        assert self.conn is not None
        while not self.stop.is_set():
            got = wait([self.conn, self.engine.sentinel], timeout=0.2)
            msg = None
            if self.conn in got:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg and msg[0] == "ready":
                    return True
            if self.stop.is_set():
                return False
            if self.engine.sentinel in got or (self.conn in got and msg is None):
                self.engine.join(5)
                code = self.engine.exitcode
                frames = [
                    *_CLI_FRAMES,
                    (
                        "vllm/entrypoints/openai/api_server.py",
                        1398,
                        "run_server",
                        "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)",
                    ),
                    (
                        "vllm/entrypoints/openai/api_server.py",
                        1417,
                        "run_server_worker",
                        "async with build_async_engine_client(",
                    ),
                    (
                        "vllm/entrypoints/openai/api_server.py",
                        172,
                        "build_async_engine_client_from_engine_args",
                        "async_llm = AsyncLLM.from_vllm_config(",
                    ),
                    ("vllm/v1/engine/async_llm.py", 223, "from_vllm_config", "return cls("),
                    (
                        "vllm/v1/engine/async_llm.py",
                        134,
                        "__init__",
                        "self.engine_core = EngineCoreClient.make_async_mp_client(",
                    ),
                    (
                        "vllm/v1/engine/core_client.py",
                        121,
                        "make_async_mp_client",
                        "return AsyncMPClient(*client_args)",
                    ),
                    (
                        "vllm/v1/engine/core_client.py",
                        471,
                        "__init__",
                        "with launch_core_engines(vllm_config, executor_class, log_stats) as (",
                    ),
                    ("py:contextlib.py", 144, "__exit__", "next(self.gen)"),
                    ("vllm/v1/engine/utils.py", 880, "launch_core_engines", "wait_for_engine_startup("),
                    ("vllm/v1/engine/utils.py", 937, "wait_for_engine_startup", "raise RuntimeError("),
                ]
                exc = (
                    "RuntimeError: Engine core initialization failed. See root cause above. "
                    f"Failed core proc(s): {{'{self.cfg.engine_name}': {code}}}"
                )
                sys.stderr.write(vlog.traceback_text(frames, exc) + "\n")
                sys.stderr.flush()
                self.startup_failed = True
                return False
        return False

    def _shutdown_before_ready(self) -> int:
        failed = getattr(self, "startup_failed", False)
        self._stop_engine()
        return 1 if failed else 0

    # -- engine I/O --------------------------------------------------------------------------
    def _send(self, msg: tuple) -> bool:
        with self.send_lock:
            try:
                assert self.conn is not None
                self.conn.send(msg)
                return True
            except (OSError, EOFError, ValueError, AssertionError):
                return False

    def _read_outputs(self) -> None:
        assert self.conn is not None
        m = self.metrics
        assert m is not None
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                if not self.stop.is_set():
                    self.engine.join(0.5)
                    vlog.error(
                        "core_client.py:610",
                        f"Engine core proc {self.cfg.engine_name} died unexpectedly, shutting down client.",
                    )
                    self._engine_dead()
                return
            if msg[0] == "dead":
                self._engine_dead()
                return
            if msg[0] != "out":
                continue
            outs, stats = msg[1], msg[2]
            now = time.monotonic()
            with self.lock:
                self.stats = stats
                self.tok_prompt += stats["prompt_tokens"]
                self.tok_gen += stats["generation_tokens"]
                for rid, idx, finished in outs:
                    req = self.reqs.get(rid)
                    if req is None:
                        continue
                    if req.first is None:
                        req.first = now
                        m.ttft.labels(**m.lv).observe(now - req.t0)
                    req.q.put(("tok", idx, finished))
                    if finished:
                        self.reqs.pop(rid, None)
                        m.e2e.labels(**m.lv).observe(now - req.t0)
                        m.success.labels(finished_reason="length", **m.lv).inc()
                        m.req_prompt.labels(**m.lv).observe(req.prompt_tokens)
                        m.req_gen.labels(**m.lv).observe(req.max_tokens)
            m.running.labels(**m.lv).set(stats["running"])
            m.waiting.labels(**m.lv).set(stats["waiting"])
            m.kv.labels(**m.lv).set(stats["kv_usage"])
            m.prompt.labels(**m.lv).inc(stats["prompt_tokens"])
            m.gen.labels(**m.lv).inc(stats["generation_tokens"])
            m.pc_q.labels(**m.lv).inc(stats["prompt_tokens"])
            m.iter_tokens.labels(**m.lv).observe(stats["prompt_tokens"] + stats["generation_tokens"])

    def _engine_dead(self) -> None:
        if self.dead:
            return
        frames = list(_OUTPUT_HANDLER_FRAMES)
        vlog.error(
            "async_llm.py:546",
            "AsyncLLM output_handler failed.\n"
            + vlog.traceback_text(frames, f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MSG}"),
        )
        with self.lock:
            self.dead = True
            for req in self.reqs.values():
                req.q.put(("dead",))
            self.reqs.clear()
        # vLLM's terminate_if_errored: the server shuts itself down shortly after.
        threading.Timer(self.cfg.scaled(2.0, floor=0.5), self.stop.set).start()

    def _log_stats(self) -> None:
        """vLLM LoggingStatLogger: every VLLM_LOG_STATS_INTERVAL; INFO only while this or the
        previous interval had throughput (so a hang shows one 0.0 line, then silence)."""
        if self.cfg.disable_log_stats:
            return
        last_p = last_g = 0.0
        t_last = time.monotonic()
        interval = self.cfg.scaled(self.cfg.stats_interval)
        while not self.stop.wait(interval):
            now = time.monotonic()
            with self.lock:
                p, g = self.tok_prompt, self.tok_gen
                self.tok_prompt = self.tok_gen = 0
                st = dict(self.stats)
                dead = self.dead
            el = max(1e-6, now - t_last)
            t_last = now
            pt, gt = p / el, g / el
            if dead:
                return
            if pt or gt or last_p or last_g:
                vlog.info(
                    "loggers.py:257",
                    f"Engine 000: Avg prompt throughput: {pt:.1f} tokens/s, Avg generation throughput: {gt:.1f} tokens/s, "
                    f"Running: {st['running']} reqs, Waiting: {st['waiting']} reqs, "
                    f"GPU KV cache usage: {100 * st['kv_usage']:.1f}%, Prefix cache hit rate: 0.0%",
                )
            last_p, last_g = pt, gt

    def _crash(self, sig: str) -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))

    # -- requests ----------------------------------------------------------------------------
    def submit(self, prompt_tokens: int, max_tokens: int, prefix: str) -> _Request | None:
        """Queue a request in the engine; None when the engine is dead."""
        rid = f"{prefix}-{uuid.uuid4().hex[:16]}"
        req = _Request(rid, prompt_tokens, max_tokens)
        with self.lock:
            if self.dead:
                return None
            self.reqs[rid] = req
        if not self._send(("add", rid, prompt_tokens, max_tokens)):
            with self.lock:
                self.reqs.pop(rid, None)
            return None
        return req

    def abort(self, req: _Request) -> None:
        with self.lock:
            live = self.reqs.pop(req.rid, None) is not None
        if live:
            self._send(("abort", req.rid))
            if self.metrics:
                self.metrics.success.labels(finished_reason="abort", **self.metrics.lv).inc()

    def stream_error(self, chat: bool) -> None:
        where = "serving_chat.py:1343" if chat else "serving_completion.py:389"
        what = "chat completion" if chat else "completion"
        func = "chat_completion_stream_generator" if chat else "completion_stream_generator"
        path = "vllm/entrypoints/openai/" + ("serving_chat.py" if chat else "serving_completion.py")
        frames = [
            (path, 715 if chat else 301, func, "async for res in result_generator:"),
            ("vllm/v1/engine/async_llm.py", 437, "generate", "out = q.get_nowait() or await q.get()"),
            ("vllm/v1/engine/output_processor.py", 77, "get", "raise output"),
            *_OUTPUT_HANDLER_FRAMES,
        ]
        vlog.error(
            where,
            f"Error in {what} stream generator.\n"
            + vlog.traceback_text(frames, f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MSG}"),
        )

    # -- shutdown ----------------------------------------------------------------------------
    def _stop_engine(self) -> None:
        if self.engine is None:
            return
        if self.engine.is_alive():
            self.engine.terminate()
        self.engine.join(self.cfg.scaled(5.0, floor=2.0))
        if self.engine.is_alive():
            self.engine.kill()
            self.engine.join(2.0)

    def _shutdown(self) -> int:
        vlog.uvicorn("Shutting down")
        if self.httpd is not None:
            threading.Thread(target=self.httpd.shutdown, daemon=True).start()
        vlog.uvicorn("Waiting for application shutdown.")
        vlog.uvicorn("Application shutdown complete.")
        vlog.uvicorn(f"Finished server process [{os.getpid()}]")
        self._stop_engine()
        return 0


class _Handler(http.server.BaseHTTPRequestHandler):
    """OpenAI-compatible endpoints of vLLM, with uvicorn's access-log line per response."""

    api: APIServer
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler API
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        try:
            phrase = HTTPStatus(int(code)).phrase
        except ValueError:
            phrase = ""
        host, port = self.client_address[:2]
        vlog.uvicorn(f'{host}:{port} - "{self.command} {self.path} {self.request_version}" {code} {phrase}')

    def _json(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, typ: str) -> None:
        self._json(code, {"error": {"message": message, "type": typ, "param": None, "code": code}})

    def _authorized(self) -> bool:
        key = self.api.cfg.api_key
        if not key or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        api = self.api
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path == "/health":
            self.send_response(503 if api.dead else 200)
            self.send_header("content-length", "0")
            self.end_headers()
        elif path == "/v1/models":
            c = api.cfg
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": c.served_model_name,
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "vllm",
                            "root": c.model,
                            "parent": None,
                            "max_model_len": c.max_model_len,
                            "permission": [
                                {
                                    "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                                    "object": "model_permission",
                                    "created": int(time.time()),
                                    "allow_create_engine": False,
                                    "allow_sampling": True,
                                    "allow_logprobs": True,
                                    "allow_search_indices": False,
                                    "allow_view": True,
                                    "allow_fine_tuning": False,
                                    "organization": "*",
                                    "group": None,
                                    "is_blocking": False,
                                }
                            ],
                        }
                    ],
                },
            )
        elif path == "/version":
            self._json(200, {"version": self.api.cfg.vllm_version})
        elif path == "/metrics":
            assert api.metrics is not None
            data = api.metrics.text()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path in ("/ping", "/load"):
            self._json(200, {} if path == "/ping" else {"server_load": len(api.reqs)})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self._authorized():
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._json(404, {"detail": "Not Found"})
            return
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            self._error(400, f"Invalid JSON body: {e}", "BadRequestError")
            return
        chat = path == "/v1/chat/completions"
        self._generate(body, chat)

    def _generate(self, body: dict[str, Any], chat: bool) -> None:
        api = self.api
        cfg = api.cfg
        extra = set(body) - _REQUEST_FIELDS
        if extra:  # vLLM's OpenAIBaseModel.__log_extra_fields__ (WARNING up to ~0.11, DEBUG later)
            vlog.warning("protocol.py:51", f"The following fields were present in the request but ignored: {extra}")
        model = body.get("model", cfg.served_model_name)
        if model not in (cfg.served_model_name, cfg.model):
            self._error(404, f"The model `{model}` does not exist.", "NotFoundError")
            return
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                self._error(400, "messages: Field required", "BadRequestError")
                return
            text = " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        else:
            prompt = body.get("prompt")
            if prompt is None:
                self._error(400, "prompt: Field required", "BadRequestError")
                return
            text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        prompt_tokens = max(1, len(text.split()) + (8 if chat else 1))
        try:
            max_tokens = int(
                body.get("max_tokens") or body.get("max_completion_tokens") or (64 if chat else 16)
            )
        except (TypeError, ValueError):
            self._error(400, "max_tokens: Input should be a valid integer", "BadRequestError")
            return
        if max_tokens < 1 or prompt_tokens + max_tokens > cfg.max_model_len:
            self._error(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
                "BadRequestError",
            )
            return
        req = api.submit(prompt_tokens, max_tokens, "chatcmpl" if chat else "cmpl")
        if req is None:
            self._error(500, ENGINE_DEAD_MSG, "InternalServerError")
            return
        created = int(time.time())
        name = model
        if body.get("stream"):
            self._stream(req, chat, created, name)
            return
        pieces: list[str] = []
        while True:
            item = self._next(req)
            if item is None:
                return
            if item[0] == "dead":
                self._error(500, ENGINE_DEAD_MSG, "InternalServerError")
                return
            pieces.append(_token_text(item[1]))
            if item[2]:
                break
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(pieces),
            "completion_tokens": len(pieces),
            "prompt_tokens_details": None,
        }
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "".join(pieces),
                    "refusal": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": "".join(pieces),
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        self._json(
            200,
            {
                "id": req.rid,
                "object": obj,
                "created": created,
                "model": name,
                "choices": [choice],
                "usage": usage,
            },
        )

    def _next(self, req: _Request) -> tuple | None:
        while True:
            try:
                return req.q.get(timeout=0.5)
            except queue.Empty:
                if self.api.stop.is_set():
                    return None

    def _chunk(self, payload: str) -> None:
        data = payload.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _stream(self, req: _Request, chat: bool, created: int, name: str) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict[str, Any]) -> None:
            body = {"id": req.rid, "object": obj, "created": created, "model": name, "choices": [choice]}
            self._chunk(f"data: {json.dumps(body)}\n\n")

        try:
            if chat:
                event(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            while True:
                item = self._next(req)
                if item is None:
                    break
                if item[0] == "dead":
                    self.api.stream_error(chat)
                    err = {
                        "error": {
                            "message": ENGINE_DEAD_MSG,
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    }
                    self._chunk(f"data: {json.dumps(err)}\n\n")
                    break
                text = _token_text(item[1])
                fin = "length" if item[2] else None
                if chat:
                    event({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": fin})
                else:
                    event(
                        {
                            "index": 0,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": fin,
                            "stop_reason": None,
                        }
                    )
                if item[2]:
                    break
            self._chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            self.api.abort(req)
            self.close_connection = True


def run(cfg: SimConfig) -> int:
    """Run the API server (and through it the whole tree) in this process; returns the exit code."""
    return APIServer(cfg).run()
