"""The simulated weight loading: 16 safetensors shards over 8 s plus any ``slow-start``
seconds (unscaled), with the tqdm progress bar of vllm/model_executor/model_loader/
weight_utils.py ``safetensors_weights_iterator`` (native, no prefix, TP rank 0 only) and the
``Loading weights took`` (default_loader.py) and ``Model loading took`` (gpu_model_runner.py)
lines."""

from __future__ import annotations

import sys
import time

from xpu_serve.sim import vlog
from xpu_serve.sim.common import SimConfig

SHARDS = 16
_BAR = "Loading safetensors checkpoint shards:"


def _progress(i: int, t0: float) -> None:
    """``<bar>  PP% Completed | i/16 [MM:SS<MM:SS, R.RRs/it]`` after shard `i` (0: the start)."""
    if i == 0:
        vlog.native(f"{_BAR}   0% Completed | 0/{SHARDS} [00:00<?, ?it/s]\n")
        return
    el = time.monotonic() - t0
    pct = int(100 * i / SHARDS)
    rate = el / i
    rem = rate * (SHARDS - i)
    vlog.native(
        f"{_BAR} {pct:3d}% Completed | {i}/{SHARDS} [{int(el) // 60:02d}:{int(el) % 60:02d}<"
        f"{int(rem) // 60:02d}:{int(rem) % 60:02d}, {rate:.2f}s/it]\n"
    )


def load_weights(cfg: SimConfig, rank: int) -> None:
    """Sleep through the shards (scaled); rank 0 prints the progress and the summary lines."""
    extra = sum(f.seconds or 0.0 for f in cfg.faults_of("slow-start"))
    per = (8.0 + extra) / SHARDS  # unscaled seconds
    t0 = time.monotonic()
    if rank == 0:
        _progress(0, t0)
    for i in range(1, SHARDS + 1):
        time.sleep(cfg.scaled(per))
        if rank == 0:
            _progress(i, t0)
    if rank == 0:
        took = time.monotonic() - t0
        sys.stdout.write("\n")
        vlog.info("default_loader.py:384", f"Loading weights took {took:.2f} seconds")
        vlog.info(
            "gpu_model_runner.py:4566",
            f"Model loading took 14.25 GiB memory and {took + 0.8:.6f} seconds",
        )
