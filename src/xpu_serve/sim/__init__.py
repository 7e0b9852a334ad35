"""`xpu_serve.sim`: a stand-in for `vllm serve` with scripted faults.

Run as ``python -m xpu_serve.sim serve MODEL [vllm serve flags]``. It starts the same process tree
as vLLM V1 (API server -> ``VLLM::EngineCore`` -> ``VLLM::Worker_TP0..N-1``, plus the
multiprocessing resource tracker), prints vLLM's log lines in vLLM's formats, serves vLLM's HTTP
endpoints, and injects the faults listed in ``XPU_SERVE_SIM_FAULTS`` (see docs/simulator.md and
:mod:`xpu_serve.sim.faults`).

This package is imported by every process of the tree (multiprocessing spawn re-imports it), so
it stays light: no pydantic, no HTTP libraries at import time.
"""

from __future__ import annotations

VLLM_VERSION = "0.14.1"
"""The vLLM release whose log shapes the simulator reproduces (the GLM-4.7-Flash deployment)."""
