"""Bundle benchmarks: redaction throughput on a vLLM-shaped log, and a whole bundle's wall time.

    .venv/bin/python bench/bench_bundle.py [--mib 64] [--runs 5]

1. Redaction (`xpu_serve.redact.Redactor.bytes`, what every byte of a bundle goes through) on a
   synthetic log of MIB MiB shaped like vLLM's (prefixed INFO lines, stats lines with "tokens",
   1 line in 200 with a secret-looking flag): MB/s, against a plain `bytes.lower()` pass over the
   same data in the same process (the floor any text scan pays).
2. A whole incident bundle (`write_incident_bundle`, every collector, 3 live `sleep` processes,
   the log above capped at 16 MiB): median seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xpu_serve.bundle import write_incident_bundle
from xpu_serve.config import Config
from xpu_serve.incarnation import ProcessInfo, Trigger
from xpu_serve.redact import Redactor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_loadavg  # noqa: E402


def make_log(mib: int) -> bytes:
    lines = []
    for i in range(200):
        if i % 50 == 0:
            lines.append(f"(APIServer pid=7700) INFO 11-30 09:00:{i % 60:02d} [loggers.py:123] Engine 000: Avg prompt "
                         f"throughput: 12.0 tokens/s, Avg generation throughput: 41.3 tokens/s, Running: 1 reqs")
        elif i == 7:
            lines.append("(APIServer pid=7700) INFO 11-30 09:00:07 [utils.py:233] non-default args: "
                         "{'model': '/models/x', 'api_key': 'sk-bench-secret', 'tensor_parallel_size': 4}")
        else:
            lines.append(f"(Worker_TP{i % 4} pid={7800 + i % 4}) INFO 11-30 09:00:{i % 60:02d} [gpu_worker.py:{i}] "
                         f"Loading weights took 3.21 seconds, shard {i}")
    block = ("\n".join(lines) + "\n").encode()
    return block * (mib * 1024 * 1024 // len(block) + 1)


@dataclass
class Ctx:
    incarnation: int
    config: Any
    runtime_dir: Path
    started_at: float
    ready_at: float | None
    processes: dict[int, ProcessInfo] = field(default_factory=dict)

    def fail(self, trigger: Trigger) -> None: ...

    def record(self, event: Any) -> None: ...


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    data = make_log(a.mib)
    r = Redactor(["sk-bench-secret", "hf_some_token_value"])
    red, base = [], []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        out = r.bytes(data)
        red.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        data.lower()
        base.append(time.perf_counter() - t0)
    assert b"sk-bench-secret" not in out
    mb = len(data) / 1e6
    med_r, med_b = statistics.median(red), statistics.median(base)
    print(f"redaction: {mb:.0f} MB in {med_r:.3f} s median = {mb / med_r:.0f} MB/s; "
          f"bytes.lower() baseline {mb / med_b:.0f} MB/s; ratio x{med_r / med_b:.1f}")

    with tempfile.TemporaryDirectory() as tmp:
        rt = Path(tmp)
        (rt / "logs" / "1").mkdir(parents=True)
        (rt / "logs" / "1" / "vllm.log").write_bytes(data)
        cfg = Config.model_validate({"engine": {"model": "m"},
                                     "bundles": {"log_cap_bytes": 16 * 1024 * 1024, "keep": 100}})
        kids = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
        try:
            procs = {p.pid: ProcessInfo(n, p.pid) for n, p in zip(("APIServer", "EngineCore", "Worker_TP0"), kids,
                                                                     strict=True)}
            ctx = Ctx(1, cfg, rt, time.time() - 60, time.time() - 50, procs)
            times = []
            for _ in range(a.runs):
                t0 = time.perf_counter()
                res = write_incident_bundle(ctx, Trigger("process-exit", "bench", time.time()),
                                            {"cause": "process-crash", "summary": "bench"}, "bench\n")
                times.append(time.perf_counter() - t0)
                assert res.complete, res.errors
        finally:
            for p in kids:
                p.kill()
                p.wait()
    print(f"whole bundle (16 MiB log cap, 3 processes): median {statistics.median(times):.3f} s "
          f"over {a.runs} runs (bound: 2 x collector_timeout_s + 5 = 25 s)")
    return 0


if __name__ == "__main__":
    sys.exit(with_loadavg(main))
