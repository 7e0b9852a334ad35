"""The EngineCore's wait for every worker's answer to one step: a stand-in for vLLM's
shm_broadcast ``MessageQueue`` (vllm/distributed/device_communicators/shm_broadcast.py) read by
``MultiprocExecutor.collective_rpc``'s ``get_response``.

While a step waits it prints, every VLLM_RINGBUFFER_WARNING_INTERVAL (scaled), the INFO line of
``MessageQueue.acquire_read`` (``[shm_broadcast.py:542] No available shared memory broadcast block
found in N seconds. ...``, N the unscaled interval); after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
(scaled) it fails with ``timeout``.

Answers on a worker link: ``("out", step, rank)`` done; ``("err", step, rank, text)`` the
forward pass raised (vLLM: a FAILURE response on the worker's response queue).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from multiprocessing.connection import wait
from typing import Any

from xpu_serve.sim import vlog
from xpu_serve.sim.common import SimConfig
from xpu_serve.sim.core_crash import Fatal


def _warn(interval: float) -> None:
    vlog.info(
        "shm_broadcast.py:542",
        f"No available shared memory broadcast block found in {int(interval) if interval == int(interval) else interval} "
        "seconds. This typically happens when some processes are hanging or doing some "
        "time-consuming work (e.g. compilation, weight/kv cache quantization).",
    )


def wait_answers(
    conns: list[Any], step: int, cfg: SimConfig, failed: threading.Event, remote: Collection[int]
) -> tuple[str, int, str] | None:
    """Wait until every link in `conns` (index = TP rank) answered `step`.

    Returns None when all answered; ``("worker-error", rank, text)`` when a rank answered with
    an error; ``("peer-gone", rank, "")`` when the link of a rank in `remote` (a follower
    node's worker) closed. A local link that closes is dropped: the worker monitor sets
    `failed`. Raises Fatal("cancelled") once `failed` is set, Fatal("timeout") at the
    execute-model timeout."""
    pending = set(range(len(conns)))
    live = {id(c): r for r, c in enumerate(conns)}
    t0 = time.monotonic()
    warn_every = cfg.scaled(cfg.ring_warning_interval)
    next_warn = t0 + warn_every
    deadline = t0 + cfg.scaled(cfg.execute_model_timeout)
    while pending:
        if failed.is_set():
            raise Fatal("cancelled", True)
        now = time.monotonic()
        if now >= deadline:
            raise Fatal("timeout", True)
        if now >= next_warn:
            _warn(cfg.ring_warning_interval)
            next_warn += warn_every
        waiting = [c for c in conns if id(c) in live and live[id(c)] in pending]
        timeout = max(0.0, min(0.05, next_warn - now, deadline - now))
        for obj in wait(waiting, timeout=timeout) if waiting else []:
            link: Any = obj
            try:
                msg = link.recv()
            except (EOFError, OSError):
                gone = live.pop(id(link), -1)
                if gone in remote:  # the follower died inside this step
                    return ("peer-gone", gone, "")
                continue
            if msg[0] == "out" and msg[1] == step:
                pending.discard(msg[2])
            elif msg[0] == "err" and msg[1] == step:
                return ("worker-error", msg[2], msg[3])
        if not waiting:
            time.sleep(timeout)
    return None
