"""Signatures of the group channel's messages: HMAC-SHA256 with the group's shared secret over
the message kind, a timestamp, a nonce and the body, and a replay window.

Headers of every request and answer:

- `X-Group-Time`: the sender's Unix time, seconds (a decimal number);
- `X-Group-Nonce`: 32 random hex digits, once per message;
- `X-Group-Signature`: hex HMAC-SHA256(secret, KIND "\\n" TIME "\\n" NONCE "\\n" BODY).

KIND is `POST PATH` for a request and `ANSWER STATUS REQUEST-NONCE` for its answer, so an answer
cannot be replayed for another request, nor a request for another path. A receiver refuses a
message whose time is more than `REPLAY_WINDOW_S` from its own clock, and a nonce it already
accepted inside that window (a replay). Own code on the standard library's `hmac` (no signing
library needed for one MAC); `hmac.compare_digest` compares in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Mapping

TIME_HEADER = "X-Group-Time"
NONCE_HEADER = "X-Group-Nonce"
SIG_HEADER = "X-Group-Signature"

REPLAY_WINDOW_S = 30.0
"""A message stamped further than this from the receiver's clock is refused, seconds. The
nodes' clocks must agree within it (NTP keeps them within milliseconds); the nonces of the
messages accepted inside it are kept to refuse replays."""
MAX_NONCES = 100_000
"""Nonces kept at most (a heartbeat a second from 64 nodes is ~2,000 per window)."""


def sign(secret: bytes, kind: str, ts: str, nonce: str, body: bytes) -> str:
    """Hex HMAC-SHA256 of one message (module docstring)."""
    msg = b"\n".join((kind.encode(), ts.encode(), nonce.encode(), body))
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def signed_headers(secret: bytes, kind: str, body: bytes, now: float) -> dict[str, str]:
    """The three headers of a message sent at Unix time `now`, with a fresh nonce."""
    ts, nonce = f"{now:.6f}", secrets.token_hex(16)
    return {TIME_HEADER: ts, NONCE_HEADER: nonce, SIG_HEADER: sign(secret, kind, ts, nonce, body)}


class Verifier:
    """Checks signatures, the time window and replays of received messages.

    Args:
        secret: the group's shared secret.
        window_s: REPLAY_WINDOW_S unless told.
        wall: the receiver's clock (Unix seconds).

    Thread-safe (the head's HTTP server calls it from a thread per connection).
    """

    def __init__(self, secret: bytes, window_s: float = REPLAY_WINDOW_S, wall: Callable[[], float] = time.time):
        self.secret, self.window_s, self.wall = secret, window_s, wall
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def check(self, kind: str, headers: Mapping[str, str], body: bytes, remember: bool = True) -> str | None:
        """None when the message is authentic, fresh and new; else the reason, one line.
        `remember=False` (answers: their nonce is the sender's own) skips the replay record."""
        ts, nonce, sig = (headers.get(h) for h in (TIME_HEADER, NONCE_HEADER, SIG_HEADER))
        if not ts or not nonce or not sig:
            return "unsigned: missing X-Group-Time, X-Group-Nonce or X-Group-Signature"
        # (compare_digest refuses str with non-ASCII characters: a hostile header may hold any)
        if not sig.isascii() or not hmac.compare_digest(sign(self.secret, kind, ts, nonce, body), sig):
            return "bad signature: not signed with the group's secret"
        try:
            sent = float(ts)
        except ValueError:
            return f"bad X-Group-Time {ts[:40]!r}"
        now = self.wall()
        if not abs(now - sent) <= self.window_s:
            return (f"stamped {now - sent:+.1f} s from this node's clock (window {self.window_s:g} s): "
                    "a replay, or the nodes' clocks disagree")
        if not remember:
            return None
        with self._lock:
            if nonce in self._seen:
                return "replayed: this nonce was already accepted"
            if len(self._seen) >= MAX_NONCES:
                self._seen = {n: t for n, t in self._seen.items() if now - t <= self.window_s}
                while len(self._seen) >= MAX_NONCES:  # still full: forget the oldest
                    del self._seen[min(self._seen, key=self._seen.__getitem__)]
            self._seen[nonce] = now
        return None
