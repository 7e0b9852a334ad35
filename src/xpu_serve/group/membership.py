"""The head's view of its followers: who registered under which epoch, when each was last
heard from (monotonic seconds), its last reported state and clock offset."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Member:
    """One follower, as the head knows it.

    Attributes:
        node_rank: vLLM's `--node-rank` (1..nnodes-1).
        pid: the follower's supervisor pid.
        epoch: the group epoch it registered under.
        address: the IP its messages come from.
        registered_at: head's Unix time of the registration.
        last_seen: head's monotonic time of its last message, seconds.
        state: the follower supervisor's last reported state (`starting`, `ready`...).
        incarnation: its engine incarnation, 0 before the first launch.
        clock_offset_s: head clock minus follower clock, seconds (None before a heartbeat).
        heartbeats: heartbeats received since it registered.
    """

    node_rank: int
    pid: int
    epoch: int
    address: str
    registered_at: float
    last_seen: float
    state: str = "registered"
    incarnation: int = 0
    clock_offset_s: float | None = None
    heartbeats: int = 0


class Membership:
    """Followers of one epoch, keyed by node rank. Thread-safe.

    Args:
        nnodes: nodes in the group (the head is node 0).
        clock: monotonic seconds (last-seen times).
    """

    def __init__(self, nnodes: int, clock: Callable[[], float] = time.monotonic):
        self.nnodes, self.clock = nnodes, clock
        self._members: dict[int, Member] = {}
        self._lock = threading.Lock()

    def register(self, node_rank: int, pid: int, epoch: int, address: str, wall: float) -> Member | None:
        """Record (or replace: a restarted supervisor) follower `node_rank`; returns the member it
        replaced, or None."""
        with self._lock:
            old = self._members.get(node_rank)
            self._members[node_rank] = Member(node_rank, pid, epoch, address, wall, self.clock())
            return old

    def heartbeat(self, node_rank: int, state: str, incarnation: int, clock_offset_s: float | None) -> Member | None:
        """Update a registered follower; None when `node_rank` is not registered."""
        with self._lock:
            m = self._members.get(node_rank)
            if m is None:
                return None
            m = replace(m, last_seen=self.clock(), state=state, incarnation=incarnation,
                        clock_offset_s=clock_offset_s, heartbeats=m.heartbeats + 1)
            self._members[node_rank] = m
            return m

    def seen(self, node_rank: int) -> Member | None:
        """Stamp a registered follower's last-seen time (any authenticated message counts)."""
        with self._lock:
            m = self._members.get(node_rank)
            if m is not None:
                m = self._members[node_rank] = replace(m, last_seen=self.clock())
            return m

    def get(self, node_rank: int) -> Member | None:
        with self._lock:
            return self._members.get(node_rank)

    def members(self) -> list[Member]:
        """Registered followers, by node rank."""
        with self._lock:
            return [self._members[r] for r in sorted(self._members)]

    def lost(self, peer_timeout_s: float) -> list[Member]:
        """Registered followers not heard from for more than `peer_timeout_s` seconds."""
        now = self.clock()
        return [m for m in self.members() if now - m.last_seen > peer_timeout_s]

    def missing(self) -> list[int]:
        """Follower node ranks that have not registered (what a rendezvous waits for)."""
        with self._lock:
            return [r for r in range(1, self.nnodes) if r not in self._members]

    def clear(self) -> None:
        """Forget every follower (a new epoch: each registers again)."""
        with self._lock:
            self._members.clear()
