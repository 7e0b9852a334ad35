"""Ordering events whose clocks differ: vLLM's wall clock (1 s or finer), the kernel's seconds
since boot, the supervisor's pidfd exit times, and the order the analysis read them in.

An event's time key is (month, day, hour, minute, second, microsecond) from its own stamp, or the
key carried forward from the last stamped line of its file (`extra["_tkey"]`, set while reading);
kernel seconds since boot (`extra["boot_s"]`) compare only with each other.
"""

from __future__ import annotations

from functools import cmp_to_key
from typing import Any

from xpu_serve.events import Event

TKey = tuple[int, int, int, int, int, int]


def order_of(ev: Event) -> int:
    """The order in which the analysis read the event (0 when unknown)."""
    o = ev.extra.get("_order", 0)
    return o if isinstance(o, int) else 0


def tkey(ev: Event) -> TKey | None:
    """The event's time key (see the module docstring), or None."""
    t = ev.time
    if t is None:
        k = ev.extra.get("_tkey")
        return k if isinstance(k, tuple) else None
    return (t.month, t.day, t.hour, t.minute, t.second, t.microsecond)


def boot(ev: Event) -> float | None:
    """Kernel seconds since boot of an event without a wall-clock stamp, else None."""
    b = ev.extra.get("boot_s")
    return float(b) if isinstance(b, (int, float)) and ev.time is None else None


def cmp_time(a: Event, b: Event) -> int:
    """Order two events by time where their clocks are comparable, else by input order."""
    ka, kb = tkey(a), tkey(b)
    if ka is not None and kb is not None and ka != kb:
        return -1 if ka < kb else 1
    ba, bb = boot(a), boot(b)
    if ba is not None and bb is not None and ba != bb:
        return -1 if ba < bb else 1
    oa, ob = order_of(a), order_of(b)
    return (oa > ob) - (oa < ob)


TIME_KEY: Any = cmp_to_key(cmp_time)


def earliest(evs: list[Event]) -> Event | None:
    """The earliest event by `cmp_time`, or None for []."""
    return min(evs, key=TIME_KEY) if evs else None


def same_second(a: Event, b: Event) -> bool:
    """Both stamped within the same wall-clock second."""
    ka, kb = tkey(a), tkey(b)
    return ka is not None and kb is not None and ka[:5] == kb[:5]


def before(a: Event, b: Event) -> bool:
    """`a` stamped strictly before `b` (False when either has no wall-clock key)."""
    ka, kb = tkey(a), tkey(b)
    if ka is not None and kb is not None:
        return ka < kb
    return False


def same_burst(a: Event, b: Event) -> bool:
    """Two kernel records of one incident: within 10 s on the kernel's clock, or (no clock)
    within 50 lines of the same file."""
    ba, bb = boot(a), boot(b)
    if ba is not None and bb is not None:
        return abs(ba - bb) <= 10.0
    if a.time is not None and b.time is not None:
        return abs((a.time - b.time).total_seconds()) <= 10.0
    if ba is None and bb is None and a.time is None and b.time is None:
        return a.file == b.file and abs((a.line or 0) - (b.line or 0)) <= 50
    return False
