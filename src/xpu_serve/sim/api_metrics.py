"""The simulated API server's Prometheus metrics: vLLM's families (vllm/v1/metrics/loggers.py
``PrometheusStatLogger``) with the same names, types, help texts and labels (``model_name``,
``engine="0"``; ``finished_reason`` on ``vllm:request_success``), plus prometheus_client's default
process/python collectors, as vLLM exposes them on ``/metrics``."""

from __future__ import annotations

from typing import Any


class Metrics:
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

    def on_step(self, stats: dict[str, Any]) -> None:
        """One engine step's scheduler stats (sim.scheduler.advance)."""
        lv = self.lv
        self.running.labels(**lv).set(stats["running"])
        self.waiting.labels(**lv).set(stats["waiting"])
        self.kv.labels(**lv).set(stats["kv_usage"])
        self.prompt.labels(**lv).inc(stats["prompt_tokens"])
        self.gen.labels(**lv).inc(stats["generation_tokens"])
        self.pc_q.labels(**lv).inc(stats["prompt_tokens"])
        self.iter_tokens.labels(**lv).observe(stats["prompt_tokens"] + stats["generation_tokens"])

    def on_finished(self, e2e_s: float, prompt_tokens: int, generation_tokens: int) -> None:
        """A request finished by length after `e2e_s` seconds."""
        self.e2e.labels(**self.lv).observe(e2e_s)
        self.success.labels(finished_reason="length", **self.lv).inc()
        self.req_prompt.labels(**self.lv).observe(prompt_tokens)
        self.req_gen.labels(**self.lv).observe(generation_tokens)
