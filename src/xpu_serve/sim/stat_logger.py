"""The simulated API server's stats line: vLLM's ``LoggingStatLogger`` (vllm/v1/metrics/loggers.py
``log``), ``[loggers.py:257] Engine 000: Avg prompt throughput: P tokens/s, Avg generation
throughput: G tokens/s, Running: N reqs, Waiting: N reqs, GPU KV cache usage: X%, Prefix cache hit
rate: 0.0%`` every VLLM_LOG_STATS_INTERVAL (scaled), only while this or the previous interval had
throughput (so a hang shows one 0.0 line, then silence)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from xpu_serve.sim import vlog


class StatLogger:
    """Token counts since the last line and the latest scheduler stats, fed by the output handler."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self.tok_prompt = 0
        self.tok_gen = 0

    def record(self, stats: dict[str, Any]) -> None:
        """One engine step's scheduler stats (sim.scheduler.advance)."""
        with self.lock:
            self.stats = stats
            self.tok_prompt += stats["prompt_tokens"]
            self.tok_gen += stats["generation_tokens"]

    def _take(self) -> tuple[int, int, dict[str, Any]]:
        with self.lock:
            p, g = self.tok_prompt, self.tok_gen
            self.tok_prompt = self.tok_gen = 0
            return p, g, dict(self.stats)

    def run(self, interval: float, stop: threading.Event, dead: Callable[[], bool]) -> None:
        """Every `interval` seconds (already scaled) until `stop` is set or `dead()` is true."""
        last_p = last_g = 0.0
        t_last = time.monotonic()
        while not stop.wait(interval):
            now = time.monotonic()
            p, g, st = self._take()
            el = max(1e-6, now - t_last)
            t_last = now
            pt, gt = p / el, g / el
            if dead():
                return
            if pt or gt or last_p or last_g:
                vlog.info(
                    "loggers.py:257",
                    f"Engine 000: Avg prompt throughput: {pt:.1f} tokens/s, Avg generation throughput: {gt:.1f} tokens/s, "
                    f"Running: {st['running']} reqs, Waiting: {st['waiting']} reqs, "
                    f"GPU KV cache usage: {100 * st['kv_usage']:.1f}%, Prefix cache hit rate: 0.0%",
                )
            last_p, last_g = pt, gt
