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

from xpu_serve.sim import api_crash, vlog
from xpu_serve.sim.api_crash import ENGINE_DEAD_MSG
from xpu_serve.sim.api_metrics import Metrics
from xpu_serve.sim.common import SimConfig
from xpu_serve.sim.engine_core import run_engine_core
from xpu_serve.sim.stat_logger import StatLogger

_WORDS = (
    "the xpu engine answers every prompt with steady tokens while four cards share one model "
    "across tensor parallel ranks and the supervisor keeps watch"
).split()

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


# Request fields the simulator knows (a subset of vLLM's CompletionRequest/ChatCompletionRequest);
# others are logged as vLLM logs them: names chosen by the client, in the server's own log.
_REQUEST_FIELDS = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "temperature", "top_p",
     "n", "stop", "seed", "user", "stream_options", "logprobs", "echo", "presence_penalty",
     "frequency_penalty"}
)

def _completion_body(
    rid: str, chat: bool, created: int, name: str, text: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The JSON of a non-streaming answer (vLLM's ChatCompletionResponse / CompletionResponse),
    finished by length."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
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
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": name,
        "choices": [choice],
        "usage": usage,
    }


class _Request:
    def __init__(self, rid: str, prompt_tokens: int, max_tokens: int):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.q: queue.Queue[tuple] = queue.Queue()
        self.t0 = time.monotonic()
        self.first: float | None = None


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
        self.stat_logger = StatLogger()
        self.engine: Any = None
        self.conn: Connection | None = None
        self.httpd: http.server.ThreadingHTTPServer | None = None
        self.metrics: Metrics | None = None

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
        self.metrics = Metrics(cfg.served_model_name)
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
            api_crash.bind_failed(e.errno, e.strerror)
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
                api_crash.engine_startup_failed(self.cfg.engine_name, self.engine.exitcode)
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
            self.stat_logger.record(stats)
            with self.lock:
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
                        m.on_finished(now - req.t0, req.prompt_tokens, req.max_tokens)
            m.on_step(stats)

    def _engine_dead(self) -> None:
        if self.dead:
            return
        api_crash.output_handler_failed()
        with self.lock:
            self.dead = True
            for req in self.reqs.values():
                req.q.put(("dead",))
            self.reqs.clear()
        # vLLM's terminate_if_errored: the server shuts itself down shortly after.
        threading.Timer(self.cfg.scaled(2.0, floor=0.5), self.stop.set).start()

    def _log_stats(self) -> None:
        """The stats line thread (sim.stat_logger); none with --disable-log-stats."""
        if self.cfg.disable_log_stats:
            return
        self.stat_logger.run(self.cfg.scaled(self.cfg.stats_interval), self.stop, lambda: self.dead)

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
        api_crash.stream_error(chat)

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
        """A completion: the request checked as vLLM's OpenAI server checks it, submitted to the
        engine, answered whole or streamed; 500 with EngineDeadError once the engine is dead."""
        api = self.api
        got = self._read_request(body, chat)
        if got is None:
            return
        model, prompt_tokens, max_tokens = got
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
        text = "".join(pieces)
        self._json(200, _completion_body(req.rid, chat, created, name, text, prompt_tokens, len(pieces)))

    def _read_request(self, body: dict[str, Any], chat: bool) -> tuple[str, int, int] | None:
        """(model, prompt tokens, max tokens) of a request body, or None after answering 404
        (unknown model) or 400 (missing field, bad max_tokens, too long for max_model_len)."""
        cfg = self.api.cfg
        extra = set(body) - _REQUEST_FIELDS
        if extra:  # vLLM's OpenAIBaseModel.__log_extra_fields__ (WARNING up to ~0.11, DEBUG later)
            vlog.warning(
                "protocol.py:51", f"The following fields were present in the request but ignored: {extra}"
            )
        model = body.get("model", cfg.served_model_name)
        if model not in (cfg.served_model_name, cfg.model):
            self._error(404, f"The model `{model}` does not exist.", "NotFoundError")
            return None
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                self._error(400, "messages: Field required", "BadRequestError")
                return None
            text = " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        else:
            prompt = body.get("prompt")
            if prompt is None:
                self._error(400, "prompt: Field required", "BadRequestError")
                return None
            text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        prompt_tokens = max(1, len(text.split()) + (8 if chat else 1))
        try:
            max_tokens = int(
                body.get("max_tokens") or body.get("max_completion_tokens") or (64 if chat else 16)
            )
        except (TypeError, ValueError):
            self._error(400, "max_tokens: Input should be a valid integer", "BadRequestError")
            return None
        if max_tokens < 1 or prompt_tokens + max_tokens > cfg.max_model_len:
            self._error(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
                "BadRequestError",
            )
            return None
        return model, prompt_tokens, max_tokens

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
