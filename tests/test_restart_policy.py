"""RestartPolicy: backoff growth and cap, jitter bounds, stability reset, crash-loop window, fatal."""

from __future__ import annotations

import random
import statistics

import pytest

from xpu_serve import exitcodes
from xpu_serve.config import RestartConfig
from xpu_serve.restart_policy import RestartPolicy


def _policy(seed: int = 1, **kw: float) -> RestartPolicy:
    cfg = RestartConfig(**kw)  # type: ignore[arg-type]
    return RestartPolicy(cfg, clock=lambda: 0.0, rng=random.Random(seed))


def test_defaults_follow_issue() -> None:
    p = RestartPolicy()
    assert (p.cfg.initial_delay_s, p.cfg.multiplier, p.cfg.max_delay_s) == (5.0, 2.0, 300.0)
    assert p.cfg.stable_after_s == 600.0
    assert [p.ceiling(n) for n in range(9)] == [5, 10, 20, 40, 80, 160, 300, 300, 300]
    assert p.ceiling(10_000) == 300.0  # no float overflow for a long series


def test_delays_grow_within_jittered_bounds_and_cap() -> None:
    # Wide window and limit so the crash-loop rule stays out of the way.
    p = _policy(max_failures=100, failure_window_s=10.0)
    t = 0.0
    decisions = []
    for _ in range(10):
        d = p.on_failure(t)
        decisions.append(d)
        t += 100.0  # outside the window each time: only the backoff series grows
    assert [d.action for d in decisions] == ["restart"] * 10
    assert [d.attempt for d in decisions] == list(range(10))
    assert [d.ceiling_s for d in decisions] == [5, 10, 20, 40, 80, 160, 300, 300, 300, 300]
    assert decisions[0].delay_s == 5.0  # first failure: exactly the floor
    for d in decisions:
        assert 5.0 <= d.delay_s <= d.ceiling_s
        assert d.exit_code is None


def test_jitter_spreads_and_mean_grows() -> None:
    # Mean of uniform(5, ceiling) over many seeds: 7.5, 12.5, 22.5, 42.5 ... capped at 152.5.
    means = []
    for n in range(8):
        samples = []
        for seed in range(400):
            p = _policy(seed=seed, max_failures=100)
            for _ in range(n):
                p.on_failure(0.0)
            samples.append(p.on_failure(0.0).delay_s)
        means.append(statistics.fmean(samples))
        if n >= 2:
            assert statistics.pstdev(samples) > 0.1 * (p.ceiling(n) - 5.0)  # really jittered
    expected = [5.0, 7.5, 12.5, 22.5, 42.5, 82.5, 152.5, 152.5]
    for got, want in zip(means, expected, strict=True):
        assert got == pytest.approx(want, rel=0.08)


def test_reset_after_stable_period() -> None:
    p = _policy(max_failures=100, stable_after_s=600.0)
    for t in (0.0, 10.0, 30.0):
        p.on_failure(t)
    assert p.series == 3
    p.on_ready(100.0)
    assert not p.is_stable(699.0)
    assert p.is_stable(700.0)
    d = p.on_failure(700.0)  # ready for exactly 600 s: a new series
    assert d.attempt == 0 and d.delay_s == 5.0 and d.ceiling_s == 5.0
    # Ready, but not long enough: the series goes on.
    p.on_ready(800.0)
    d = p.on_failure(1399.0)
    assert d.attempt == 1 and d.ceiling_s == 10.0


def test_not_ready_means_not_stable() -> None:
    p = _policy(max_failures=100)
    p.on_failure(0.0)
    d = p.on_failure(5000.0)  # long gap but never became ready: no reset
    assert d.attempt == 1


def test_give_up_after_n_failures_within_window() -> None:
    p = _policy(max_failures=3, failure_window_s=60.0)
    d1 = p.on_failure(0.0)
    d2 = p.on_failure(20.0)
    assert (d1.action, d1.failures_in_window) == ("restart", 1)
    assert (d2.action, d2.failures_in_window) == ("restart", 2)
    d3 = p.on_failure(40.0)
    assert d3.action == "give-up"
    assert d3.failures_in_window == 3
    assert d3.exit_code == exitcodes.GAVE_UP
    assert d3.delay_s == 0.0
    assert "crash loop" in d3.reason and "3 failures within 60 s" in d3.reason
    assert p.gave_up
    assert p.on_failure(10_000.0).action == "give-up"  # stays given up


def test_failures_outside_window_are_forgotten() -> None:
    p = _policy(max_failures=3, failure_window_s=60.0)
    assert p.on_failure(0.0).failures_in_window == 1
    assert p.on_failure(30.0).failures_in_window == 2
    d = p.on_failure(61.0)  # the one at t=0 left the window
    assert d.action == "restart"
    assert d.failures_in_window == 2
    assert p.failures_in_window(200.0) == 0
    assert p.on_failure(200.0).failures_in_window == 1


def test_fatal_gives_up_at_once() -> None:
    p = _policy()
    d = p.on_failure(0.0, fatal=True)
    assert d.action == "give-up"
    assert d.exit_code == exitcodes.GAVE_UP_AT_ONCE
    assert d.failures_in_window == 1
    assert "cannot fix" in d.reason


def test_planned_restart_is_not_a_failure() -> None:
    p = _policy(max_failures=2, failure_window_s=100.0)
    p.on_failure(0.0)
    for t in (1.0, 2.0, 3.0):
        d = p.planned_restart(t)
        assert (d.action, d.delay_s, d.failures_in_window) == ("restart", 0.0, 1)
    assert p.series == 1
    # A planned restart after a stable run resets the series like a failure would.
    p.on_ready(10.0)
    p.planned_restart(10.0 + p.cfg.stable_after_s)
    assert p.series == 0


def test_clock_used_when_now_omitted() -> None:
    now = [0.0]
    p = RestartPolicy(RestartConfig(max_failures=2, failure_window_s=10.0), clock=lambda: now[0])
    assert p.on_failure().action == "restart"
    now[0] = 11.0
    assert p.on_failure().failures_in_window == 1


def test_multiplier_one_is_constant() -> None:
    p = _policy(multiplier=1.0, max_failures=100)
    assert {p.on_failure(0.0).delay_s for _ in range(5)} == {5.0}


def test_cap_below_initial() -> None:
    p = _policy(initial_delay_s=10.0, max_delay_s=3.0, max_failures=100)
    assert [p.on_failure(0.0).delay_s for _ in range(3)] == [3.0, 3.0, 3.0]
