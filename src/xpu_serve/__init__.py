"""xpu-serve: a supervisor for `vllm serve` on Intel XPU.

It starts the server, watches it from every side (processes, HTTP, metrics, the kernel log),
and on failure says what failed first and what merely followed, keeps the evidence in a bundle
and restarts the server with backoff.
"""

__version__ = "0.1.0"
