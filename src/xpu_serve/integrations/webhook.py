"""Optional incident webhook: one JSON POST per incident, sent from a background thread.

Body: {"text": one line for people (Slack-compatible), "incident": the verdict contract,
"bundle": path or null, "host": hostname}. A slow or dead endpoint never delays a restart: each
post runs in its own daemon thread with `timeout_s`, and failures are counted, not raised.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx

from xpu_serve.incarnation import Status


def incident_text(incident: dict[str, Any], bundle_path: str | None, host: str) -> str:
    """Slack-style one-liner, e.g. "xpu-serve on gpu01: umd-segfault — Worker_TP0 ... (bundle: /var/...)"."""
    summary = incident.get("summary") or "incident"
    cause = incident.get("cause") or "unknown"
    text = f"xpu-serve on {host}: {cause} — {summary}"
    if bundle_path:
        text += f" (bundle: {bundle_path})"
    return text


class Webhook:
    """An `Observer` posting each incident to `url` with `timeout_s` (seconds)."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url
        self.timeout_s = timeout_s
        self.host = socket.gethostname()
        self.sent = 0
        self.failed = 0
        self.last_error: str | None = None
        self.on_failure: Callable[[], Any] | None = None  # called (on the post's thread) per failed post
        self._threads: list[threading.Thread] = []

    def on_state(self, status: Status) -> None:
        """Observer hook: state changes are not posted."""

    def on_incident(self, incident: dict[str, Any], bundle_path: str | None) -> None:
        """Observer hook: start a daemon thread that posts the incident; returns at once."""
        body = {
            "text": incident_text(incident, bundle_path, self.host),
            "incident": incident,
            "bundle": bundle_path,
            "host": self.host,
        }
        t = threading.Thread(target=self._post, args=(body,), name="xpu-serve-webhook", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _post(self, body: dict[str, Any]) -> None:
        try:
            r = httpx.post(self.url, json=body, timeout=self.timeout_s)
            r.raise_for_status()
            self.sent += 1
        except Exception as e:  # any failure of a best-effort notification is only counted
            self.failed += 1
            self.last_error = f"{type(e).__name__}: {e}"
            if self.on_failure is not None:
                self.on_failure()

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for posts in flight (used at shutdown and in tests)."""
        for t in list(self._threads):
            t.join(timeout_s)
