"""Which watchers and observers `up` attaches to the supervisor, built from the config.

Kept in one place so the supervisor never imports a watcher or an integration directly:
the kernel and hang watchers add themselves to `watchers_for`, systemd notify,
Prometheus metrics and the webhook to `observers_for`.
"""

from __future__ import annotations

from typing import Any

from xpu_serve import output
from xpu_serve.incarnation import Observer, Watcher


def watchers_for(config: Any) -> list[Watcher]:
    """Per-incarnation watchers for this config (kernel log, hang watchdog, start-up stall).

    Order: "kernel" (`watchers.kernel.enabled`), "hang" (`supervision.hang.enabled`; it asks the
    kernel watcher for GPU faults to name as the hang's cause), "startup-stall" (always: the
    start-up stall by phase), "bundle-requests", "group" (with a `group:` section:
    `group.watcher.GroupWatcher`, also an observer). See `xpu_serve.watchers`.
    """
    from xpu_serve.watchers import HangWatcher, KernelWatcher, StartupWatcher

    watchers: list[Watcher] = []
    kernel = KernelWatcher(config) if config.watchers.kernel.enabled else None
    if kernel is not None:
        watchers.append(kernel)
    if config.supervision.hang.enabled:
        watchers.append(HangWatcher(config, kernel=kernel))
    watchers.append(StartupWatcher(config))
    from xpu_serve.bundle import BundleRequestWatcher  # answers `xpu-serve bundle`

    watchers.append(BundleRequestWatcher())
    if config.group is not None:  # a multi-node group's member (docs/multi-node.md)
        from xpu_serve.group.watcher import GroupWatcher

        watchers.append(GroupWatcher(config))
    return watchers


def observers_for(config: Any, watchers: list[Watcher] | None = None, warn: Any = None) -> list[Observer]:
    """Observers of state changes and incidents (systemd notify, metrics, webhook).

    `watchers` (from `watchers_for`) lets the metrics endpoint read the hang watchdog (/readyz)
    and the start-up phase. The metrics endpoint is started here; if its address cannot be bound,
    one warning goes to `warn(message)` (the supervisor's event log: stderr and events.jsonl;
    without it, stderr) and supervision goes on without it (metrics are a feature, not a reason
    to stop).
    """

    from xpu_serve.integrations.metrics import SupervisorMetrics
    from xpu_serve.integrations.systemd import SystemdNotifier
    from xpu_serve.integrations.webhook import Webhook

    observers: list[Observer] = [w for w in watchers or [] if getattr(w, "name", None) == "group"]  # type: ignore[misc]
    notifier = SystemdNotifier(extend_timeout_s=60.0)
    if notifier.enabled:
        observers.append(notifier)
    if config.metrics.enabled:
        metrics = SupervisorMetrics()
        metrics.attach(list(watchers or []))
        try:
            metrics.start(config.metrics.listen)
            observers.append(metrics)
        except (OSError, ValueError) as e:
            msg = f"metrics endpoint {config.metrics.listen} disabled: {e}"
            if callable(warn):
                warn(msg)
            else:
                output.writer(2).write(f"xpu-serve: warning: {msg}\n")
    if config.webhook.url:
        hook = Webhook(config.webhook.url, config.webhook.timeout_s)
        m = next((o for o in observers if isinstance(o, SupervisorMetrics)), None)
        if m is not None:
            hook.on_failure = m.webhook_failures.inc
        observers.append(hook)
    return observers
