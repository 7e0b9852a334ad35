"""Restart policy: exponential backoff with jitter, reset after a stable period, crash-loop limit.

Pure logic: no sleeping, no threads, no I/O. Time comes from the `now` argument of each call (or
from the injected `clock`), randomness from the injected `rng`; both are plain inputs, so tests
drive it with a fixed clock and a seeded `random.Random`.

API (called by `supervisor.py`)::

    policy = RestartPolicy(cfg.supervision.restart)     # RestartConfig, see config.py
    policy.on_ready(now)                   # the incarnation became ready (monotonic seconds)
    d = policy.on_failure(now, fatal=False)  # -> Decision
    if d.action == "give-up": exit with d.exit_code (exitcodes.GAVE_UP / GAVE_UP_AT_ONCE)
    else: sleep d.delay_s (after the tree is stopped), then start the next incarnation
    d = policy.planned_restart(now)        # SIGHUP: restart now, not counted as a failure

Semantics, with the field names of `config.RestartConfig`:

- Backoff. The n-th consecutive failure (n = 0, 1, 2... since the last reset) has the ceiling
  ``min(max_delay_s, initial_delay_s * multiplier**n)`` and the delay is drawn uniformly from
  ``[floor, ceiling]`` with ``floor = min(initial_delay_s, max_delay_s)``.
  Why not AWS "full jitter" (uniform(0, ceiling))? It can draw a delay of ~0 s, and a GPU that
  just lost a device or reset an engine needs a moment before the next start; an operator who
  wrote `initial_delay_s: 5` expects at least 5 s. Why not "equal jitter" (ceiling/2 +
  uniform(0, ceiling/2))? Its floor grows with n, which narrows the spread exactly where
  de-synchronising several supervisors on one host (one per GPU group, all hit by the same
  driver event) matters most. So: full jitter above a fixed floor of `initial_delay_s`. The
  first failure (n = 0) therefore waits exactly `initial_delay_s`; later ones spread out.
  With the defaults (5 s, x2, 300 s): ceilings 5, 10, 20, 40, 80, 160, 300, 300... s.
- Reset. When the failing incarnation had been ready for at least `stable_after_s`, the
  backoff starts again at n = 0 (its failure is the first of a new series). The crash-loop
  window below is not reset by stability: it counts failures in time, whatever happened between.
- Crash loop. Failures are remembered with their time; those older than `failure_window_s` are
  forgotten. The failure that brings the count inside the window to `max_failures` gives up
  (so with max_failures=5 there are at most 4 automatic restarts inside the window).
- Fatal. `on_failure(now, fatal=True)` gives up at once: a failure that a restart cannot fix
  (config error, missing model, port owned by another program).
- Planned restart (SIGHUP, operator): not a failure; restarts with no delay. The stability of
  the current incarnation still counts: if it had been ready for `stable_after_s`, the backoff
  series is reset, as it would have been on a failure.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from xpu_serve import exitcodes
from xpu_serve.config import RestartConfig


@dataclass(frozen=True)
class Decision:
    """What to do after a failure (or a planned restart).

    Attributes:
        action: "restart" or "give-up".
        delay_s: seconds to wait before the next start (0.0 when giving up or planned).
        reason: one line for people, e.g. "failure 3 of 5 within 1800 s; backoff 14.2 s (drawn between 5 and 20 s;
            x2 per failure in a row, up to 300 s)".
        failures_in_window: failures counted inside `failure_window_s`, this one included
            (0 for a planned restart that is not a failure... unless earlier ones are still in the window).
        attempt: 0-based position of this failure in the current backoff series (the exponent n).
        ceiling_s: the backoff ceiling the delay was drawn under (0.0 when giving up).
        exit_code: for "give-up", the documented exit code of `xpu-serve up`
            (`exitcodes.GAVE_UP` for a crash loop, `exitcodes.GAVE_UP_AT_ONCE` for a fatal failure);
            None for "restart".
    """

    action: Literal["restart", "give-up"]
    delay_s: float
    reason: str
    failures_in_window: int
    attempt: int = 0
    ceiling_s: float = 0.0
    exit_code: int | None = None


class RestartPolicy:
    """Backoff, stability reset and crash-loop limit for one supervisor (see the module docstring).

    Args:
        cfg: `config.RestartConfig` (initial_delay_s, multiplier, max_delay_s, stable_after_s,
            max_failures, failure_window_s); seconds throughout.
        clock: monotonic seconds, used when a method is called without `now`.
        rng: source of jitter; `rng.uniform(a, b)` is the only call made.

    Not thread-safe: call it from the supervisor's event loop only.
    """

    def __init__(
        self,
        cfg: RestartConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg if cfg is not None else RestartConfig()
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._failures: deque[float] = deque()  # times of failures, oldest first
        self._series = 0  # consecutive failures since the last reset (the next exponent)
        self._ready_at: float | None = None  # when the current incarnation became ready
        self.gave_up = False

    # --- inputs -----------------------------------------------------------------------------

    def on_ready(self, now: float | None = None) -> None:
        """The current incarnation became ready (starts its stability period)."""
        self._ready_at = self._now(now)

    def on_failure(self, now: float | None = None, fatal: bool = False) -> Decision:
        """The current incarnation failed at `now`; decide whether and when to restart.

        `fatal=True` marks a failure that a restart cannot fix: give up at once.
        Once the policy gave up, every later call gives up again (same exit code kind).
        """
        t = self._now(now)
        self._reset_if_stable(t)
        self._ready_at = None
        self._failures.append(t)
        in_window = self._count_in_window(t)
        if fatal:
            self.gave_up = True
            return Decision(
                "give-up",
                0.0,
                "failure that a restart cannot fix: giving up at once",
                in_window,
                attempt=self._series,
                exit_code=exitcodes.GAVE_UP_AT_ONCE,
            )
        if self.gave_up or in_window >= self.cfg.max_failures:
            self.gave_up = True
            return Decision(
                "give-up",
                0.0,
                f"crash loop: {in_window} failures within {self.cfg.failure_window_s:g} s "
                f"(limit {self.cfg.max_failures})",
                in_window,
                attempt=self._series,
                exit_code=exitcodes.GAVE_UP,
            )
        n = self._series
        ceiling = self.ceiling(n)
        floor = min(self.cfg.initial_delay_s, self.cfg.max_delay_s)
        delay = self._rng.uniform(floor, ceiling) if ceiling > floor else ceiling
        drawn = f"drawn between {floor:g} and {ceiling:g} s; " if ceiling > floor else ""
        self._series += 1
        return Decision(
            "restart",
            delay,
            f"failure {in_window} of {self.cfg.max_failures} within {self.cfg.failure_window_s:g} s; "
            f"backoff {delay:.1f} s ({drawn}x{self.cfg.multiplier:g} per failure in a row, up to "
            f"{self.cfg.max_delay_s:g} s)",
            in_window,
            attempt=n,
            ceiling_s=ceiling,
        )

    def planned_restart(self, now: float | None = None) -> Decision:
        """A planned restart (SIGHUP): not a failure, no delay; the failure history is kept."""
        t = self._now(now)
        self._reset_if_stable(t)
        self._ready_at = None
        return Decision(
            "restart", 0.0, "planned restart (not counted as a failure)", self._count_in_window(t)
        )

    # --- queries ----------------------------------------------------------------------------

    def ceiling(self, n: int) -> float:
        """Backoff ceiling in seconds for the n-th (0-based) consecutive failure."""
        c = self.cfg
        # Compare logarithms, not the power itself: multiplier**n overflows a float for large n.
        if c.initial_delay_s >= c.max_delay_s or (
            n > 0
            and c.multiplier > 1.0
            and n * math.log(c.multiplier) >= math.log(c.max_delay_s / c.initial_delay_s)
        ):
            return c.max_delay_s
        return min(c.max_delay_s, c.initial_delay_s * c.multiplier**n)

    def failures_in_window(self, now: float | None = None) -> int:
        """Failures remembered inside `failure_window_s` before `now`."""
        return self._count_in_window(self._now(now))

    @property
    def series(self) -> int:
        """Consecutive failures since the last reset (the exponent of the next backoff)."""
        return self._series

    def is_stable(self, now: float | None = None) -> bool:
        """True when the current incarnation has been ready for at least `stable_after_s`."""
        return self._ready_at is not None and self._now(now) - self._ready_at >= self.cfg.stable_after_s

    # --- internals --------------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def _reset_if_stable(self, t: float) -> None:
        if self._ready_at is not None and t - self._ready_at >= self.cfg.stable_after_s:
            self._series = 0

    def _count_in_window(self, t: float) -> int:
        horizon = t - self.cfg.failure_window_s
        while self._failures and self._failures[0] <= horizon:
            self._failures.popleft()
        return len(self._failures)
