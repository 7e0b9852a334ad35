"""Start-up milestones per TP rank, and stall detection.

A `vllm serve` start-up on 4x Arc Pro B60 takes minutes (weights alone took 168 s in the
Qwen3-30B-A3B case) and can stop dead in the middle: in the qwen3-30b-startup-stall case rank 1
never printed its oneCCL init lines while ranks 0, 2 and 3 did, and nothing was printed again.
`StartupTracker` reads the engine's output lines and knows, per rank, which milestones were
reached; `stall(now)` names the phase that did not complete and the ranks that did not reach it.

Milestones, in start-up order, and the lines that mark them (vLLM sources; texts as in
tests/fixtures/cases):

| phase | per rank | line (source) |
| --- | --- | --- |
| engine-start | no | `Initializing a V1 LLM engine` (vllm/v1/engine/core.py EngineCore.__init__) |
| distributed-init | yes | `world_size=4 rank=1 local_rank=1 distributed_init_method=... backend=xccl` (vllm/distributed/parallel_state.py init_distributed_environment) |
| ccl-init | yes | oneCCL's own `YYYY:MM:DD-HH:MM:SS: PID[:[RANK]] \\|CCL_WARN\\| ...` lines (oneCCL logger), only with an xccl/ccl backend |
| weight-loading | no | `Loading weights took`, `Model loading took` (vllm/model_executor/model_loader/default_loader.py, gpu_model_runner.py) |
| kv-cache | no | `Available KV cache memory`, `GPU KV cache size` (gpu_worker.py, v1/core/kv_cache_utils.py) |
| engine-ready | no | `init engine (profile, create kv cache, warmup model) took` (v1/engine/core.py) |
| ready | no | `Application startup complete.` (uvicorn, via the API server) |

Any other new line (weight-loading progress bars, compile messages) is progress that keeps the
stall timer alive, except lines that repeat while waiting (`No available shared memory broadcast block`).
Written here (not a library): the milestones are the domain itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from xpu_serve.events import split_process_prefix

PHASES = (
    "engine-start",
    "distributed-init",
    "ccl-init",
    "weight-loading",
    "kv-cache",
    "engine-ready",
    "ready",
)
PER_RANK = frozenset({"distributed-init", "ccl-init"})

_DIST_RE = re.compile(r"world_size=(\d+) rank=(\d+) local_rank=\d+ .*?backend=(\w+)")
_DIST_SHORT_RE = re.compile(r"world_size=(\d+) rank=(\d+)\b")
_ASSIGNED_RE = re.compile(r"rank (\d+) in world size (\d+) is assigned as .*TP rank (\d+)")
# oneCCL: "2026:03:26-04:12:17: 7989 |CCL_WARN| ..." and "2026:03:26-04:12:18: 7986:[0] |CCL_WARN| ...",
# also "(  tid)" variants; the year-first stamp is oneCCL's logger format.
_CCL_RE = re.compile(
    r"^\s*\d{4}:\d{2}:\d{2}-\d{2}:\d{2}:\d{2}:\s*(\d+)(?::\[(\d+)\])?\s*(?:\(\s*\d+\)\s*)?\|CCL_\w+\|"
)
_WORKER_TP_RE = re.compile(r"^Worker_TP(\d+)$")
_SIMPLE = (
    ("engine-start", ("Initializing a V1 LLM engine",)),
    ("weight-loading", ("Loading weights took", "Model loading took")),
    ("kv-cache", ("Available KV cache memory", "GPU KV cache size")),
    ("engine-ready", ("init engine (profile, create kv cache, warmup model) took",)),
    ("ready", ("Application startup complete.",)),
)
_NOT_PROGRESS = ("No available shared memory broadcast block",)


@dataclass
class StartupStall:
    """A start-up that stopped: `phase` not completed, `missing_ranks` that did not reach it
    (empty for a phase that is not per rank), `stalled_s` seconds without progress, the last
    milestone reached by anyone (`last_phase`, None if none)."""

    phase: str
    missing_ranks: list[int]
    stalled_s: float
    last_phase: str | None


@dataclass
class StartupTracker:
    """Per-rank start-up milestones from log lines; times are seconds on any one clock.

    Args:
        world_size: expected TP ranks (config `engine.tensor_parallel_size`); a
            `world_size=N` line overrides it.
        stall_s: no progress for this long is a stall.
        started: time the incarnation started (the stall timer's origin).
    """

    world_size: int
    stall_s: float
    started: float
    reached: dict[str, set[int]] = field(default_factory=dict)  # phase -> ranks (-1 for global phases)
    pid_rank: dict[int, int] = field(default_factory=dict)
    last_progress: float = 0.0
    backend: str | None = None
    is_ready: bool = False

    def __post_init__(self) -> None:
        self.last_progress = self.started

    def set_rank(self, pid: int, rank: int) -> None:
        """Record that `pid` is TP rank `rank` (from the process tree or a log prefix)."""
        self.pid_rank[pid] = rank

    def _reach(self, phase: str, rank: int) -> bool:
        ranks = self.reached.setdefault(phase, set())
        if rank in ranks:
            return False
        ranks.add(rank)
        return True

    def on_line(self, line: str, now: float) -> str | None:
        """Feed one output line received at `now`; returns the phase it newly reached, if any."""
        if self.is_ready:
            return None
        name, pid, rest = split_process_prefix(line)
        rank: int | None = None
        if name is not None:
            m = _WORKER_TP_RE.match(name)
            if m:
                rank = int(m.group(1))
                if pid is not None:
                    self.pid_rank[pid] = rank
            elif pid is not None:
                rank = self.pid_rank.get(pid)
        new: str | None = None
        if "world_size=" in rest:
            m = _DIST_RE.search(rest) or _DIST_SHORT_RE.search(rest)
            if m:
                self.world_size = int(m.group(1))
                r = int(m.group(2))
                if pid is not None:
                    self.pid_rank[pid] = r
                if m.re is _DIST_RE:
                    self.backend = m.group(3)
                if self._reach("distributed-init", r):
                    new = "distributed-init"
        elif "|CCL_" in rest:
            m = _CCL_RE.match(rest)
            if m:
                ccl_pid = int(m.group(1))
                ccl_rank = int(m.group(2)) if m.group(2) is not None else self.pid_rank.get(ccl_pid)
                if ccl_rank is not None and self._reach("ccl-init", ccl_rank):
                    new = "ccl-init"
        else:
            for phase, needles in _SIMPLE:
                if any(n in rest for n in needles):
                    if self._reach(phase, -1):
                        new = phase
                    if phase == "ready":
                        self.is_ready = True
                    break
        if new is not None or not any(n in rest for n in _NOT_PROGRESS):
            self.last_progress = now
        return new

    def _ranks(self) -> list[int]:
        return list(range(self.world_size))

    def _expected(self) -> list[str]:
        phases = list(PHASES)
        # oneCCL prints its init lines only with an xccl/ccl backend and more than one rank.
        uses_ccl = (self.backend is None or "ccl" in self.backend.lower()) and self.world_size > 1
        if not uses_ccl and "ccl-init" not in self.reached:
            phases.remove("ccl-init")
        return phases

    def current_phase(self) -> tuple[str, list[int], str | None]:
        """(phase not completed, ranks missing from it, last phase anyone reached).

        The phase is the earliest one some expected rank has not reached although a later one
        was reached (a rank left behind), else the one after the furthest reached.
        """
        phases = self._expected()
        furthest = -1
        for i, ph in enumerate(phases):
            if self.reached.get(ph):
                furthest = i
        last = phases[furthest] if furthest >= 0 else None
        for ph in phases[: furthest + 1]:
            if ph in PER_RANK:
                missing = [r for r in self._ranks() if r not in self.reached.get(ph, set())]
                if missing:
                    return ph, missing, last
        nxt = phases[furthest + 1] if furthest + 1 < len(phases) else phases[-1]
        missing = self._ranks() if nxt in PER_RANK else []
        return nxt, missing, last

    def stall(self, now: float) -> StartupStall | None:
        """A `StartupStall` when not ready and nothing progressed for `stall_s`, else None."""
        if self.is_ready:
            return None
        stalled = now - self.last_progress
        if stalled < self.stall_s:
            return None
        phase, missing, last = self.current_phase()
        return StartupStall(phase, missing, stalled, last)
