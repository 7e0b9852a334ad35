"""Shared helpers of the supervision benchmarks: run `xpu-serve up` on the simulator, read its events.

Not a benchmark itself. Every helper runs real processes; `Supervised.close()` stops the
supervisor (SIGTERM, then SIGKILL of its process group) so nothing is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sim_config(
    tmp: Path,
    tp: int = 4,
    faults: str = "",
    time_scale: float = 0.01,
    top: dict[str, Any] | None = None,
    **supervision: Any,
) -> Path:
    """Write a config that runs the simulator; returns its path. `supervision` overrides sections."""
    sup: dict[str, Any] = {
        "restart": {
            "initial_delay_s": 0.01,
            "max_delay_s": 0.01,
            "max_failures": 1000,
            "failure_window_s": 0.001,
        },
        "health": {"interval_s": 5, "failures": 3},
        "stop": {"grace_s": 5, "port_free_timeout_s": 10},
        "startup": {"stall_s": 60, "timeout_s": 120},
    }
    sup.update(supervision)
    cfg = {
        "engine": {
            "command": [sys.executable, "-m", "xpu_serve.sim", "serve"],
            "model": "bench/Sim",
            "served_model_name": "bench",
            "tensor_parallel_size": tp,
            "port": free_port(),
        },
        "environment": {
            "vars": {"XPU_SERVE_SIM_TIME_SCALE": str(time_scale), "XPU_SERVE_SIM_FAULTS": faults}
        },
        "supervision": sup,
        "metrics": {"enabled": False},
        "bundles": {"collector_timeout_s": 2},
        "runtime_dir": str(tmp / "runtime"),
    }
    cfg.update(top or {})
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Supervised:
    """`xpu-serve up -c CONFIG --log-format json --no-echo` as a child process."""

    def __init__(self, config: Path, env: dict[str, str] | None = None):
        self.config = config
        self.runtime = Path(yaml.safe_load(config.read_text())["runtime_dir"])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xpu_serve", "up", "-c", str(config), "--log-format", "json", "--no-echo"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )

    def events(self) -> list[dict[str, Any]]:
        try:
            text = (self.runtime / "events.jsonl").read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def state(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.runtime / "state.json").read_text()))
        except (FileNotFoundError, ValueError):
            return {}

    def wait_event(self, name: str, count: int = 1, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evs = [
                e
                for e in self.events()
                if e["event"] == name and all(e.get(k) == v for k, v in match.items())
            ]
            if len(evs) >= count:
                return evs[count - 1]
            if self.proc.poll() is not None:
                raise RuntimeError(f"supervisor exited with {self.proc.returncode} while waiting for {name}")
            time.sleep(0.01)
        raise TimeoutError(f"no {name!r} event #{count} within {timeout} s")

    def ready_state(self, incarnation: int, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state()
            if st.get("state") == "ready" and st.get("incarnation") == incarnation:
                names = {p["name"] for p in st.get("processes", [])}
                if "EngineCore" in names and any(n.startswith("Worker") for n in names):
                    return st
            time.sleep(0.01)
        raise TimeoutError(f"incarnation {incarnation} not ready within {timeout} s")

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def tmpdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="xpu-serve-bench-"))


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]
