"""Hang detection time: xpu-serve's hang watchdog vs vLLM's own execute-model timeout, on the
same simulated fault in the same run.

Each run starts the simulator (`python -m xpu_serve.sim serve`, TP=4) with
`worker-hang rank=1`, time scale S (default 0.01), streams one completion, and runs the
HangWatcher (defaults: hang after_s=90, metrics_interval_s=5, both x S) against it without
killing anything. From the last token the client received (an SSE `data:` chunk with
non-empty generated text; `[DONE]`, blank lines and the error object do not count), it measures:
  - ours: the watchdog's verdict (Trigger.at, before the stack dumps);
  - vLLM's: the `RPC call to execute_model timed out` line (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
    default 300 s x S) as read from the simulator's output.
Times are printed in real (scaled) seconds and unscaled (/ S) seconds; the ratio is ours / vLLM's.

    .venv/bin/python bench/bench_hang.py [RUNS] [SCALE]
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from xpu_serve.cleanup import remove_segments
from xpu_serve.config import Config
from xpu_serve.events import Event
from xpu_serve.incarnation import ProcessInfo, Trigger
from xpu_serve.sim.harness import run_files, shm_prefix
from xpu_serve.watchers import HangWatcher

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402


@dataclass
class Ctx:
    config: Any
    started_at: float = field(default_factory=time.time)
    incarnation: int = 1
    runtime_dir: Any = None
    ready_at: float | None = None
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    failures: list[Trigger] = field(default_factory=list)
    records: list[Event] = field(default_factory=list)

    def fail(self, trigger: Trigger) -> None:
        self.failures.append(trigger)

    def record(self, event: Event) -> None:
        self.records.append(event)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_token_chunk(line: str) -> bool:
    """True for one SSE `data:` line of an OpenAI-style stream that carries generated text
    (completions: choices[0].text, chat: choices[0].delta.content, non-empty). False for blank
    separator lines, `data: [DONE]`, an error object (`{"error": ...}`, what vLLM sends when the
    engine dies mid-stream), chat's role-only first chunk, and anything that is not JSON."""
    if not line.startswith("data:"):
        return False
    payload = line[5:].strip()
    if payload == "[DONE]":
        return False
    try:
        body = json.loads(payload)
    except ValueError:
        return False
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    first = choices[0]
    delta = first.get("delta")
    text = first.get("text") if "text" in first else (delta.get("content") if isinstance(delta, dict) else None)
    return isinstance(text, str) and text != ""


def check_plausible(ours: float, theirs: float, scale: float) -> None:
    """Raise RuntimeError unless both delays are positive and near what the settings imply: the
    watchdog at least after_s (90 s x scale) and less than vLLM's; vLLM's within 0.5x-3x its
    300 s x scale timeout (the hang starts on the token after the last one received)."""
    after, timeout = 90 * scale, 300 * scale
    if not (0 < ours and 0 < theirs):
        raise RuntimeError(f"non-positive delay: watchdog {ours:.3f} s, vLLM {theirs:.3f} s")
    if not (0.9 * after <= ours < theirs):
        raise RuntimeError(f"implausible watchdog delay {ours:.3f} s (after_s {after:g} s, vLLM {theirs:.3f} s)")
    if not (0.5 * timeout <= theirs <= 3 * timeout):
        raise RuntimeError(f"implausible vLLM delay {theirs:.3f} s (its timeout is {timeout:g} s)")


def one_run(scale: float) -> tuple[float, float]:
    port = free_port()
    tag = uuid.uuid4().hex  # names this run's /dev/shm and /tmp files: removed after the SIGKILL
    env = dict(
        os.environ,
        XPU_SERVE_SIM_TIME_SCALE=str(scale),
        XPU_SERVE_SIM_FAULTS="worker-hang rank=1 after=300",
        XPU_SERVE_SIM_DIST_TAG=tag,
        XPU_SERVE_SIM_SHM_PREFIX=shm_prefix(tag),
    )
    started = time.time()
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xpu_serve.sim",
            "serve",
            "tiny",
            "--port",
            str(port),
            "--tensor-parallel-size",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    seen: dict[str, float] = {}

    def reader() -> None:
        assert sim.stdout is not None
        for raw in sim.stdout:
            line = raw.decode("utf-8", "replace")
            if "Application startup complete." in line:
                seen.setdefault("ready", time.time())
            if "RPC call to execute_model timed out" in line:
                seen.setdefault("vllm", time.time())

    threading.Thread(target=reader, daemon=True).start()
    try:
        deadline = time.time() + 60
        while "ready" not in seen:
            if sim.poll() is not None or time.time() > deadline:
                raise RuntimeError("simulator did not start")
            time.sleep(0.02)
        chunks: list[float] = []

        def stream() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 3000, "stream": True}
            try:
                with httpx.stream(
                    "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120
                ) as r:
                    for line in r.iter_lines():
                        if is_token_chunk(line):
                            chunks.append(time.time())
            except httpx.HTTPError:
                pass

        threading.Thread(target=stream, daemon=True).start()
        cfg = Config.model_validate(
            {
                "engine": {"model": "tiny", "port": port, "tensor_parallel_size": 4},
                "supervision": {"hang": {"after_s": 90 * scale, "metrics_interval_s": 5 * scale}},
            }
        )
        ctx = Ctx(cfg, ready_at=time.time())
        watcher = HangWatcher(cfg, dump=lambda pids, t: {})

        async def watch() -> None:
            task = asyncio.ensure_future(watcher.run(ctx))
            t0 = time.time()
            while not ctx.failures and time.time() - t0 < 60:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(watch())
        t0 = time.time()
        while "vllm" not in seen and time.time() - t0 < 60:
            time.sleep(0.02)
        if not ctx.failures or "vllm" not in seen or not chunks:
            raise RuntimeError(
                f"incomplete run: ours={bool(ctx.failures)} vllm={'vllm' in seen} chunks={len(chunks)}"
            )
        last = chunks[-1]
        ours, theirs = ctx.failures[0].at - last, seen["vllm"] - last
        check_plausible(ours, theirs, scale)
        return ours, theirs
    finally:
        try:
            os.killpg(sim.pid, signal.SIGKILL)  # the simulator's own session, started above
        except ProcessLookupError:
            pass
        sim.wait()
        # the SIGKILL took multiprocessing's resource tracker too: nothing else unlinks them
        remove_segments(None, set(run_files(tag, env["XPU_SERVE_SIM_SHM_PREFIX"])), started, None)


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    scale = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    try:
        results = [one_run(scale) for _ in range(runs)]
    except RuntimeError as e:
        print(f"bench_hang: {e}", file=sys.stderr)
        return 1
    ours = statistics.median(r[0] for r in results)
    theirs = statistics.median(r[1] for r in results)
    print(
        f"runs: {runs}, time scale {scale} (after_s 90 -> {90 * scale:g} s, vLLM timeout 300 -> {300 * scale:g} s)"
    )
    for i, (a, b) in enumerate(results):
        print(f"  run {i + 1}: watchdog {a:.3f} s, vLLM {b:.3f} s (from the last token)")
    print(f"median watchdog: {ours:.3f} s scaled = {ours / scale:.1f} s unscaled")
    print(f"median vLLM timeout: {theirs:.3f} s scaled = {theirs / scale:.1f} s unscaled")
    print(f"ratio watchdog / vLLM: {ours / theirs:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(with_loadavg(main))
