"""One time format for people, whatever clock a line was stamped with.

The input mixes clocks: vLLM's "MM-DD HH:MM:SS" without a year (vllm/logger.py, `_DATE_FORMAT`
"%m-%d %H:%M:%S"), oneCCL's "YYYY:MM:DD-HH:MM:SS" (oneCCL src/common/log/log.cpp,
`logger::write_prefix`), ISO and `dmesg -T` stamps with a year, and the kernel's seconds since
boot ("[551.424205]", kernel/printk/printk.c `print_time`). `Clock` learns, from the lines the
analysis classifies, the year of the input (the latest stamp that has one) and the wall-clock
time of boot (a kernel record stamped with both: a syslog or journal line around "[551.424205]",
a journal record's __MONOTONIC_TIMESTAMP beside __REALTIME_TIMESTAMP), then shows any event's
time as:

- "2026-03-26 10:12:46" (".123" milliseconds when the stamp has them) when a year is known from
  the line or from the input;
- "03-26 10:12:46" when no line of the input has a year;
- kernel seconds since boot converted to wall-clock time when the boot time is known, else
  "551.424205 s after boot";
- None for a line without a stamp.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from xpu_serve.events import Event

_NO_YEAR = 1900  # the year events.parse_line leaves on a stamp that prints none (vLLM's)


@dataclass
class Clock:
    """The input's year as (year, month) of the latest stamp with a year, and the wall-clock
    time of boot (naive, as the anchoring record printed it), each None until learned."""

    year_at: tuple[int, int] | None = None
    boot_wall: datetime | None = None

    def see(self, ev: Event) -> None:
        """Learn from a classified event: its stamp's year, the boot time from a kernel record
        stamped with both clocks."""
        t = ev.time
        if t is None:
            return
        if t.year != _NO_YEAR:
            self.year_at = (t.year, t.month)
        b = ev.extra.get("boot_s")
        if self.boot_wall is None and ev.source == "kernel" and isinstance(b, (int, float)):
            try:
                self.boot_wall = t.replace(tzinfo=None) - timedelta(seconds=float(b))
            except (OverflowError, ValueError):  # a boot time before year 1: not a real clock
                pass

    def wall(self, ev: Event) -> datetime | None:
        """The event's wall-clock time with its year where known (see the module docstring)."""
        t = ev.time
        if t is None:
            b = ev.extra.get("boot_s")
            if self.boot_wall is None or not isinstance(b, (int, float)):
                return None
            try:
                t = self.boot_wall + timedelta(seconds=float(b))
            except (OverflowError, ValueError):  # seconds past year 9999: not a real clock
                return None
        t = t.replace(tzinfo=None)
        if t.year == _NO_YEAR and self.year_at is not None:
            year, month = self.year_at
            # a log across New Year: a December line before a January stamp is of the year before
            y = year - 1 if t.month - month > 6 else year + 1 if month - t.month > 6 else year
            try:
                t = t.replace(year=y)
            except ValueError:  # 02-29 of a year that has none
                return t
        return t

    def show(self, ev: Event) -> str | None:
        """The event's time in the one format of the module docstring, or None (no stamp)."""
        t = self.wall(ev)
        if t is None:
            b = ev.extra.get("boot_s")
            return f"{float(b):.6f} s after boot" if isinstance(b, (int, float)) else None
        ms = f".{t.microsecond // 1000:03d}" if t.microsecond else ""
        if t.year == _NO_YEAR:
            return f"{t:%m-%d %H:%M:%S}{ms}"
        return f"{t:%Y-%m-%d %H:%M:%S}{ms}"
