"""What the simulated API server prints when something fails (vllm/entrypoints/openai/
api_server.py under ``vllm serve``, AsyncLLM of vllm/v1/engine/async_llm.py): the busy port at
start-up, ``Engine core initialization failed``, ``AsyncLLM output_handler failed.`` with
``EngineDeadError`` and the stream generators' ``Error in ... stream generator.``

Frames are (path, line, function, source line) for :func:`vlog.traceback_text`, line numbers
from vLLM 0.14.1. The start-up tracebacks go bare to stderr (they escape ``vllm serve``'s main),
the others through the logger.
"""

from __future__ import annotations

import sys

from xpu_serve.sim import vlog

ENGINE_DEAD_MSG = "EngineCore encountered an issue. See stack trace (above) for the root cause."
_ENGINE_DEAD = f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MSG}"

# the innermost frames of vLLM's AsyncLLM output handler when the EngineCore is dead
_OUTPUT_HANDLER_FRAMES = (
    ("vllm/v1/engine/async_llm.py", 502, "output_handler", "outputs = await engine_core.get_output_async()"),
    (
        "vllm/v1/engine/core_client.py",
        899,
        "get_output_async",
        "raise self._format_exception(outputs) from None",
    ),
)

# The first frames of every traceback the API server prints: `vllm serve` -> CLI main -> serve
# (vllm/entrypoints/cli/main.py, cli/serve.py), shared by all of them.
_CLI_FRAMES = [
    ("/usr/local/bin/vllm", 10, "<module>", "sys.exit(main())"),
    ("vllm/entrypoints/cli/main.py", 73, "main", "args.dispatch_function(args)"),
    ("vllm/entrypoints/cli/serve.py", 60, "cmd", "uvloop.run(run_server(args))"),
]

# run_server -> setup_server -> create_server_socket: the port is bound before the engine starts.
_BIND_FRAMES = [
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

# run_server_worker -> AsyncLLM -> launch_core_engines -> wait_for_engine_startup (vllm/v1/engine/utils.py).
_ENGINE_STARTUP_FRAMES = [
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


def bind_failed(errno: int | None, strerror: str | None) -> None:
    """``OSError: [Errno N] ...`` of the socket bind, bare on stderr."""
    sys.stderr.write(vlog.traceback_text(_BIND_FRAMES, f"OSError: [Errno {errno}] {strerror}") + "\n")
    sys.stderr.flush()


def engine_startup_failed(engine_name: str, code: int | None) -> None:
    """``RuntimeError: Engine core initialization failed. ... Failed core proc(s): {NAME: CODE}``,
    bare on stderr; `code` the EngineCore's exit code."""
    exc = (
        "RuntimeError: Engine core initialization failed. See root cause above. "
        f"Failed core proc(s): {{'{engine_name}': {code}}}"
    )
    sys.stderr.write(vlog.traceback_text(_ENGINE_STARTUP_FRAMES, exc) + "\n")
    sys.stderr.flush()


def output_handler_failed() -> None:
    """``[async_llm.py:546] AsyncLLM output_handler failed.`` with the EngineDeadError traceback."""
    vlog.error(
        "async_llm.py:546",
        "AsyncLLM output_handler failed.\n" + vlog.traceback_text(list(_OUTPUT_HANDLER_FRAMES), _ENGINE_DEAD),
    )


def stream_error(chat: bool) -> None:
    """A streaming request's generator sees the dead engine (serving_chat.py /
    serving_completion.py ``..._stream_generator``): ``Error in [chat ]completion stream generator.``"""
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
    vlog.error(where, f"Error in {what} stream generator.\n" + vlog.traceback_text(frames, _ENGINE_DEAD))
