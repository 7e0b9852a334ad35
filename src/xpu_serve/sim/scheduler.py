"""The simulated scheduler's bookkeeping for one engine step (vllm/v1/core/sched/scheduler.py
``Scheduler.update_from_output`` reduced to what the simulator shows): every running request
gets one token per step; there is no waiting queue and no preemption."""

from __future__ import annotations

from typing import Any


def advance(requests: dict[str, list[Any]], kv_cache_tokens: int) -> tuple[list[tuple], dict[str, Any]]:
    """Give each request one token; drop the finished ones from `requests` (rid ->
    [prompt_tokens, max_tokens, generated], updated in place).

    Returns (outs, stats): outs [(rid, token index, finished)] in request order; stats the
    scheduler stats the API server's metrics and stats line read: running, waiting (0),
    kv_usage (fraction 0..1 of `kv_cache_tokens`), prompt_tokens (of requests in their first
    step), generation_tokens (tokens of this step)."""
    outs = []
    prompt_new = 0
    for rid, req in list(requests.items()):
        if req[2] == 0:
            prompt_new += req[0]
        req[2] += 1
        finished = req[2] >= req[1]
        outs.append((rid, req[2] - 1, finished))
        if finished:
            del requests[rid]
    in_kv = sum(r[0] + r[2] for r in requests.values())
    stats = {
        "running": len(requests),
        "waiting": 0,
        "kv_usage": min(1.0, in_kv / max(1, kv_cache_tokens)),
        "prompt_tokens": prompt_new,
        "generation_tokens": len(outs),
    }
    return outs, stats
