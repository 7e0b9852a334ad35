"""Which watchers and observers `up` attaches to the supervisor, built from the config.

Kept in one place so the supervisor never imports a watcher or an integration directly:
the kernel and hang watchers (issue 6) add themselves to `watchers_for`, systemd notify,
Prometheus metrics and the webhook (issue 8) to `observers_for`.
"""

from __future__ import annotations

from typing import Any

from xpu_serve.incarnation import Observer, Watcher


def watchers_for(config: Any) -> list[Watcher]:
    """Per-incarnation watchers for this config (kernel log, hang watchdog, start-up stall)."""
    watchers: list[Watcher] = []
    return watchers


def observers_for(config: Any) -> list[Observer]:
    """Observers of state changes and incidents (systemd notify, metrics, webhook)."""
    observers: list[Observer] = []
    return observers
