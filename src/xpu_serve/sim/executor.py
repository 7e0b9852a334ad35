"""The simulated EngineCore's ``MultiprocExecutor`` (vllm/v1/executor/multiproc_executor.py): it
spawns the local workers (and, with ``--nnodes``, accepts the follower workers' links), meets
them at the start-up barriers, sends each engine step to every rank and waits for the answers
(sim.shm_broadcast), watches the worker processes' sentinels (``Worker proc VllmWorker-R died
unexpectedly``) and stops them (SIGTERM, SIGKILL after 4 s scaled).

Links: ``conns`` by TP rank, a duplex Connection to a local worker or a multinode.JsonConn to a
follower's; ``deaths`` the write ends of the local workers' death pipes (closing one is the
worker's ``Parent process exited``; ``("peer-died", rank)`` first tells it a peer died).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from xpu_serve.sim import kernel, multinode, shm_broadcast, vlog
from xpu_serve.sim.common import SimConfig, pci_address
from xpu_serve.sim.core_crash import Fatal
from xpu_serve.sim.worker import worker_main


class MultiprocExecutor:
    """The workers of one EngineCore. `dead_rank` and `fail_text` name the rank that failed and
    its error once a start-up or step failure was raised (Fatal)."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.procs: list[BaseProcess] = []
        self.conns: list[Any] = []  # by TP rank: a Connection (local) or multinode.JsonConn (remote)
        self.remote: dict[int, multinode.JsonConn] = {}  # TP rank -> its follower worker's link
        self.deaths: list[Connection] = []
        self.shutting_down = False
        self.failed = threading.Event()  # a worker process died (set by the monitor)
        self.dead_rank: int | None = None
        self.fail_text = ""
        self.reset_thread: threading.Thread | None = None

    def start_workers(self) -> None:
        """Spawn the local workers; with `--nnodes`, listen on the master port first and wait for
        every follower worker to connect (the rendezvous: blocks while a node is missing)."""
        ctx = multiprocessing.get_context("spawn")
        listener = None
        if self.cfg.nnodes > 1:
            listener = multinode.listen(self.cfg.master_addr, self.cfg.master_port)
        for r in self.cfg.local_ranks:
            mine, theirs = ctx.Pipe(duplex=True)
            death_r, death_w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=worker_main, args=(self.cfg, r, theirs, death_r), name=f"VllmWorker-{r}", daemon=True
            )
            p.start()
            theirs.close()
            death_r.close()
            self.procs.append(p)
            self.conns.append(mine)
            self.deaths.append(death_w)
        if listener is not None:
            remote = [r for r in range(self.cfg.tensor_parallel_size) if r not in self.cfg.local_ranks]
            self.remote = multinode.accept_ranks(listener, remote)
            listener.close()
            self.conns += [self.remote[r] for r in remote]

    def wait_for_ready(self, on_phase: Callable[[str], None]) -> None:
        """Run the start-up barriers until every rank is ready: when all ranks reached a phase,
        `on_phase(phase)` runs, then every rank gets ``go``. Raises Fatal("startup-died") when a
        worker dies or fails outside the profile run, Fatal("startup-rpc") when it fails in it."""
        tp = self.cfg.tensor_parallel_size
        reached: dict[str, set[int]] = {}
        ready: set[int] = set()
        conn_rank = {id(c): r for r, c in enumerate(self.conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self.procs)}
        live: list[Any] = list(self.conns) + list(sentinel_rank)
        while len(ready) < tp:
            for obj in wait(live):
                if isinstance(obj, int):
                    self.dead_rank = sentinel_rank[obj]
                    raise Fatal("startup-died", False)
                r = conn_rank[id(obj)]
                try:
                    msg: Any = obj.recv()  # type: ignore[union-attr,call-arg]
                except (EOFError, OSError):
                    live.remove(obj)
                    continue
                if msg[0] == "reached":
                    got = reached.setdefault(msg[1], set())
                    got.add(r)
                    if len(got) == tp:
                        on_phase(msg[1])
                        for c in self.conns:
                            c.send(("go", msg[1]))
                elif msg[0] == "ready":
                    ready.add(r)
                elif msg[0] == "failed":
                    self.dead_rank = r
                    self.fail_text = msg[1]
                    raise Fatal("startup-rpc" if msg[2] == "kv-cache" else "startup-died", False)

    def broadcast(self, msg: tuple) -> None:
        """`msg` to every rank; a link that is gone is skipped."""
        for c in self.conns:
            try:
                c.send(msg)
            except OSError:
                pass

    def execute_model(self, step: int, n_requests: int) -> None:
        """Engine step `step` on every rank; returns when all answered. Raises Fatal
        (``worker-error``, ``cancelled``, ``timeout``: see sim.shm_broadcast)."""
        for r, peer in self.remote.items():
            if peer.closed_by_peer():  # the follower went away while the engine was idle
                self._peer_failed(step, r, reset=False)
        self.broadcast(("step", step, n_requests))
        failure = shm_broadcast.wait_answers(self.conns, step, self.cfg, self.failed, self.remote)
        if failure is None:
            return
        what, rank, text = failure
        if what == "peer-gone":
            self._peer_failed(step, rank, reset=True)
        # a worker raised in the forward pass (vLLM: get_response raises "Worker failed with error")
        self.dead_rank = rank
        self.fail_text = text
        raise Fatal("worker-error", True)

    def _peer_failed(self, step: int, rank: int, reset: bool) -> None:
        """A remote rank's link is gone: TP rank 0's collective with it fails (gloo), rank 0
        answers the step with the error, and the engine fails like on any worker error. Raises
        Fatal("worker-error")."""
        text = multinode.gloo_error(self.remote[rank].peer, reset)
        self.fail_text = text
        self.dead_rank = 0
        try:
            self.conns[0].send(("peer-lost", step, text))
            deadline = time.monotonic() + self.cfg.scaled(5.0, floor=1.0)
            while self.conns[0].poll(max(0.0, deadline - time.monotonic())):
                msg = self.conns[0].recv()
                if msg[0] == "err" and msg[1] == step:
                    break
        except (EOFError, OSError):
            pass
        raise Fatal("worker-error", True)

    def monitor(self, on_failure: Callable[[], None]) -> None:
        """The MultiprocWorkerMonitor thread: on the first worker death (outside a shutdown) log
        it, start the copy-engine resets of a ``worker-segv kernel=`` fault, tell the other ranks
        and close the death pipes, set `failed`, then call `on_failure`."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        ready = wait(list(sentinels))
        if self.shutting_down:
            return
        r = sentinels[ready[0]]  # type: ignore[index]
        self.dead_rank = r
        vlog.error(
            "multiproc_executor.py:231",
            f"Worker proc VllmWorker-{r} died unexpectedly, shutting down executor.",
        )
        for f in self.cfg.faults_of("worker-segv", r):
            if f.kernel:
                self.reset_thread = threading.Thread(
                    target=self._engine_resets, args=(f.kernel,), daemon=True
                )
                self.reset_thread.start()
        # Executor shutdown: tell the surviving ranks a peer died, then close their death pipes.
        self.shutting_down = True
        for i, d in enumerate(self.deaths):
            try:
                if i != r:
                    d.send(("peer-died", r))
                d.close()
            except OSError:
                pass
        self.failed.set()
        on_failure()

    def _engine_resets(self, path: str) -> None:
        """After the user-mode driver died, the xe driver resets each card's copy engine (BCS)."""
        for dev in range(self.cfg.tensor_parallel_size):
            time.sleep(self.cfg.scaled(1.2))
            kernel.write_records(path, [kernel.engine_reset_record(pci_address(dev), 54 - 7 * dev)])

    def close_death_pipes(self) -> None:
        """Every local worker sees its parent go (``Parent process exited, terminating worker``)."""
        for d in self.deaths:
            try:
                d.close()
            except OSError:
                pass

    def join(self, grace: float) -> None:
        """Wait up to `grace` seconds in all for the local workers to exit."""
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        """Stop the workers: SIGTERM, close their death pipes after a grace period, then
        SIGKILL (vLLM MultiprocExecutor.shutdown / _ensure_worker_termination); close the
        follower links."""
        self.shutting_down = True
        for p in self.procs:
            if p.is_alive() and p.pid:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        self.join(self.cfg.scaled(4.0, floor=0.5))
        self.close_death_pipes()
        for p in self.procs:
            if p.is_alive() and p.pid:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.join(1.0)
        for link in self.remote.values():
            link.close()
