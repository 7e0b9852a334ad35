"""Command line of the simulator: ``python -m xpu_serve.sim serve MODEL [vllm serve flags]``.

The model is taken positionally (as ``vllm serve MODEL``) or from ``--model``. The flags vLLM
users pass are accepted; those that shape the simulation are read (``--host``, ``--port``,
``--served-model-name``, ``-tp``/``--tensor-parallel-size``, ``--max-model-len``, ``--dtype``,
``--block-size``, ``--api-key``, ``--disable-log-stats``, and the multi-node flags ``--nnodes``,
``--node-rank``, ``--master-addr``, ``--master-port``, ``--headless``: see
:mod:`xpu_serve.sim.multinode`); every other flag is accepted and shown
in the ``non-default args`` line, like vLLM does for the flags it knows.

Environment: ``XPU_SERVE_SIM_FAULTS`` (see :mod:`xpu_serve.sim.faults`),
``XPU_SERVE_SIM_TIME_SCALE``, ``XPU_SERVE_SIM_TOKEN_RATE`` (engine steps per second, default 50),
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300), ``VLLM_RINGBUFFER_WARNING_INTERVAL`` (60),
``VLLM_LOG_STATS_INTERVAL`` (10), ``XPU_SERVE_SIM_PREFIX`` (``0.14``, default, or ``0.32``: whose
process-prefix shapes to print, see :func:`xpu_serve.sim.faults.prefix_style`), ``XPU_SERVE_INCARNATION``, ``XPU_SERVE_SIM_DIST_TAG`` (the hex in
``/tmp/vllm_dist_<hex>`` and ``/dev/shm/vllm_dist_<hex>-cpushm_<rank>``; 1-64 hex digits, checked at
start; random by default), ``XPU_SERVE_SIM_SHM_PREFIX`` (the EngineCore's MessageQueue segment is
``/dev/shm/<prefix><8 hex>``; unset: Python's random ``psm_<8 hex>``, as real vLLM; letters, digits,
``_``, ``.``, ``-``, 1-64, checked at start).

Exit codes: 0 after a shutdown (including every engine failure, as vLLM), 1 when start-up
fails (as vLLM), 2 for bad arguments or a bad fault spec (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import uuid
from typing import TYPE_CHECKING, Any

from xpu_serve.sim.faults import FaultSpecError, active, env_seconds, parse_faults, prefix_style, time_scale

if TYPE_CHECKING:
    from xpu_serve.sim.common import SimConfig

USAGE = 2


def _bool_flag(parser: argparse.ArgumentParser, *names: str) -> None:
    parser.add_argument(*names, action="store_true", default=None)


def build_parser() -> argparse.ArgumentParser:
    """The parser for ``serve``: vLLM's flags that the simulator reads, plus leniency for the rest."""
    p = argparse.ArgumentParser(prog="vllm serve", add_help=True)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int)
    p.add_argument("--api-key")
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--quantization", "-q")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--distributed-executor-backend")
    _bool_flag(p, "--headless")
    _bool_flag(p, "--disable-log-stats")
    _bool_flag(p, "--disable-log-requests")
    _bool_flag(p, "--enforce-eager")
    _bool_flag(p, "--trust-remote-code")
    _bool_flag(p, "--disable-sliding-window")
    return p


def _unknown_to_dict(extra: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if tok.startswith("-"):
            key, sep, val = tok.lstrip("-").partition("=")
            key = key.replace("-", "_")
            if sep:
                out[key] = val
            elif i + 1 < len(extra) and not extra[i + 1].startswith("-"):
                out[key] = extra[i + 1]
                i += 1
            else:
                out[key] = True
        i += 1
    return out


def _multinode_problem(args: argparse.Namespace, tp: int) -> str | None:
    """One line when the multi-node flags do not fit (the simulator's own rules, stricter than
    vLLM's: a follower is `--headless` with node rank 1..nnodes-1, the head node rank 0)."""
    n, r = args.nnodes, args.node_rank
    if n < 1 or not 0 <= r < n:
        return f"--node-rank: must be 0..{max(n, 1) - 1} with --nnodes {n}, got {r}"
    if tp % n:
        return f"--tensor-parallel-size {tp} does not split over --nnodes {n}"
    if bool(args.headless) != (r > 0):
        return "--headless goes with --node-rank 1..nnodes-1 (a follower), and only there"
    if not 1 <= args.master_port <= 65535:
        return f"--master-port: must be 1..65535, got {args.master_port}"
    if n > 1 and args.distributed_executor_backend not in (None, "mp"):
        return f"--distributed-executor-backend {args.distributed_executor_backend}: multi-node needs mp"
    return None


def _fail(msg: str) -> int:
    sys.stderr.write(f"xpu_serve.sim: {msg}\n")
    sys.stderr.flush()
    return USAGE


class _BadInput(Exception):
    """A bad flag or environment value: the one line main prints before exiting USAGE."""


def main(argv: list[str] | None = None) -> int:
    """Run the simulator; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        return _fail("usage: python -m xpu_serve.sim serve MODEL [vllm serve flags]")
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv[1:])
    except SystemExit as e:  # argparse printed its own one-line error (and usage)
        return int(e.code or 0) and USAGE
    try:
        cfg = _config(parser, args, extra)
    except _BadInput as e:
        return _fail(str(e))
    if cfg.headless:
        from xpu_serve.sim.headless import run_headless

        code = run_headless(cfg)
    else:
        from xpu_serve.sim.api_server import run

        code = run(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no multiprocessing atexit join: the children are already handled


def _model(args: argparse.Namespace, extra: list[str]) -> str:
    """The model (positional MODEL or --model); fixes `args`/`extra` when argparse took an
    unknown flag's value as MODEL. Raises _BadInput."""
    model = args.model_tag or args.model
    if args.model and args.model_tag and args.model_tag != args.model:
        # `--model X --unknown-flag value`: argparse took the unknown flag's value as MODEL.
        model = args.model
        extra.append(args.model_tag)
        args.model_tag = None
    if not model:
        raise _BadInput("vllm serve: error: no model given (positional MODEL or --model)")
    return str(model)


def _check_args(args: argparse.Namespace) -> None:
    """Raises _BadInput for a TP size < 1, a port outside 0..65535 or a bad multi-node set."""
    tp = args.tensor_parallel_size
    if tp < 1:
        raise _BadInput(f"--tensor-parallel-size: must be >= 1, got {tp}")
    if not 0 <= args.port <= 65535:
        raise _BadInput(f"--port: must be 0..65535, got {args.port}")
    bad = _multinode_problem(args, tp)
    if bad:
        raise _BadInput(bad)


def _env_settings(tp: int) -> dict[str, Any]:
    """The simulator's environment (see the module docstring) as SimConfig fields, faults not
    yet filtered by incarnation. Raises _BadInput naming the variable."""
    try:
        settings: dict[str, Any] = {
            "time_scale": time_scale(),
            "faults": parse_faults(os.environ.get("XPU_SERVE_SIM_FAULTS", ""), tp),
            "execute_model_timeout": env_seconds("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300.0),
            "ring_warning_interval": env_seconds("VLLM_RINGBUFFER_WARNING_INTERVAL", 60.0),
            "stats_interval": env_seconds("VLLM_LOG_STATS_INTERVAL", 10.0),
            "token_rate": env_seconds("XPU_SERVE_SIM_TOKEN_RATE", 50.0),
            "prefix_style": prefix_style(),
        }
    except FaultSpecError as e:
        if "XPU_SERVE_SIM" in str(e) or "VLLM_" in str(e):
            raise _BadInput(str(e)) from None
        raise _BadInput(f"XPU_SERVE_SIM_FAULTS: {e}") from None
    dist_tag = os.environ.get("XPU_SERVE_SIM_DIST_TAG") or uuid.uuid4().hex
    # hex only: the workers derive the init port from its first hex digits (worker.py, dist-init)
    if not re.fullmatch(r"[0-9A-Fa-f]{1,64}", dist_tag):
        raise _BadInput(f"XPU_SERVE_SIM_DIST_TAG: hex digits only (1-64), got {dist_tag!r}")
    shm_prefix = os.environ.get("XPU_SERVE_SIM_SHM_PREFIX", "")
    if shm_prefix and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", shm_prefix):
        raise _BadInput(
            f"XPU_SERVE_SIM_SHM_PREFIX: letters, digits, '_', '.', '-' only (1-64), got {shm_prefix!r}"
        )
    settings.update(dist_tag=dist_tag, shm_prefix=shm_prefix)
    return settings


def _non_default(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: str, extra: list[str]
) -> dict[str, Any]:
    """vLLM's ``non-default args: {...}`` (vllm/entrypoints/utils.py log_non_default_args):
    the flags that differ from their defaults, then the unknown ones."""
    non_default: dict[str, Any] = {}
    if args.model_tag:
        non_default["model_tag"] = args.model_tag
    for key, val in vars(args).items():
        if key == "model_tag" or val is None:
            continue
        if parser.get_default(key) != val:
            non_default[key] = val
    non_default.setdefault("model", model)
    non_default.update(_unknown_to_dict(extra))
    return non_default


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> SimConfig:
    """The run's SimConfig from the flags and the environment. Raises _BadInput."""
    from xpu_serve.sim.common import SimConfig, getenv_incarnation

    model = _model(args, extra)
    _check_args(args)
    env = _env_settings(args.tensor_parallel_size)
    env["faults"] = active(env["faults"], getenv_incarnation())
    return SimConfig(
        model=model,
        served_model_name=(args.served_model_name or [model])[0],
        tensor_parallel_size=args.tensor_parallel_size,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len or 4096,
        dtype="float16" if args.dtype in ("auto", "half") else args.dtype,
        block_size=args.block_size or 64,
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
        disable_log_stats=bool(args.disable_log_stats),
        non_default_args=_non_default(parser, args, model, extra),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        headless=bool(args.headless),
        **env,
    )
