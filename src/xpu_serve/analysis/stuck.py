"""The stuck TP rank of a hang, from the supervisor's `rank-states` fact (`facts.rank_states`).

Two kinds of evidence, each naming one rank or nobody:

- process state: exactly one rank stopped (`T`, job-control stop: SIGSTOP, SIGTSTP) or in
  uninterruptible sleep (`D`, inside the kernel: a driver call that does not return) in every
  sample the supervisor took (proc(5) /proc/PID/stat field 3);
- stacks: exactly one rank's readable stack is outside the collective wait frames of
  data/collectives.yaml while every other rank's stack is in one (analysis/stacks.py).

The state names the rank when it singles one out (a stopped process cannot reach any
collective, wherever its stack was when it stopped); the stacks decide only when no rank is
stopped. Two stopped ranks, two ranks outside, or an unreadable stack among the rest: nobody is
named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xpu_serve.analysis.stacks import OUTSIDE, UNKNOWN
from xpu_serve.events import Event

if TYPE_CHECKING:
    from xpu_serve.analysis.incident import Incident, Root

    RootOf = Callable[[Event, str | None, int | None, int | None], Root]

_STUCK_STATES = {"T": "stopped (state T)", "D": "in uninterruptible sleep (state D)"}


@dataclass(frozen=True)
class StuckRank:
    """The rank a hang is on: its process, rank, pid, why (`stopped (state T)`, `outside the
    collective`) and what the other ranks wait in (rank -> label; empty when unknown)."""

    process: str | None
    rank: int
    pid: int | None
    why: str
    others: dict[int, str]

    def sentence(self) -> str:
        """ "Worker_TP1 (rank 1) stopped (state T) while ranks 0,2,3 wait in all_reduce"."""
        head = f"{self.process or 'worker'} (rank {self.rank}) {self.why}"
        by_label: dict[str, list[int]] = {}
        for r, label in sorted(self.others.items()):
            by_label.setdefault(label, []).append(r)
        waits = [
            f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} {'wait' if len(rs) > 1 else 'waits'} in {label}"
            for label, rs in by_label.items()
        ]
        return head + (" while " + " and ".join(waits) if waits else "")

    def to_contract(self) -> dict[str, Any]:
        return {
            "process": self.process,
            "rank": self.rank,
            "pid": self.pid,
            "why": self.why,
            "others": {str(r): label for r, label in sorted(self.others.items())},
        }


def _ranks(fact: dict[str, Any]) -> list[dict[str, Any]]:
    """The rank entries of a `rank-states` fact's extra (one per rank), each with its fields'
    types checked: a fact read back from a bundle's facts.log may hold anything (a list for a
    state, a dict for a process); a field of the wrong type is None."""
    rows = fact.get("ranks")
    if not isinstance(rows, list):
        return []
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        if isinstance(r, dict) and _is_int(r.get("rank")):
            out.setdefault(
                r["rank"],
                {
                    "rank": r["rank"],
                    "pid": r.get("pid") if _is_int(r.get("pid")) else None,
                    **{
                        k: r.get(k) if isinstance(r.get(k), str) else None
                        for k in ("process", "state", "wait")
                    },
                },
            )
    return [out[k] for k in sorted(out)]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _waiting(rows: list[dict[str, Any]], but: int) -> dict[int, str]:
    """rank -> collective label of every rank other than `but` whose stack is in one."""
    return {
        r["rank"]: str(r.get("wait"))
        for r in rows
        if r["rank"] != but and r.get("wait") not in (None, OUTSIDE, UNKNOWN)
    }


def by_state(rows: list[dict[str, Any]]) -> StuckRank | None:
    """The one rank in state T or D, or None (none, or more than one)."""
    hit = [r for r in rows if r.get("state") in _STUCK_STATES]
    if len(hit) != 1:
        return None
    r = hit[0]
    return StuckRank(
        r.get("process"), r["rank"], r.get("pid"), _STUCK_STATES[r["state"]], _waiting(rows, r["rank"])
    )


def by_stacks(rows: list[dict[str, Any]]) -> StuckRank | None:
    """The one rank outside while every other rank (at least one) waits in a collective."""
    outside = [r for r in rows if r.get("wait") == OUTSIDE]
    if len(outside) != 1 or len(rows) < 2:
        return None
    r = outside[0]
    others = _waiting(rows, r["rank"])
    if len(others) != len(rows) - 1:
        return None  # another rank unknown: not proven
    return StuckRank(r.get("process"), r["rank"], r.get("pid"), "is outside the collective", others)


def stuck_rank(fact: dict[str, Any]) -> StuckRank | None:
    """The stuck rank a `rank-states` fact's extra singles out (module docstring), or None."""
    rows = _ranks(fact)
    if any(r.get("state") in _STUCK_STATES for r in rows):
        return by_state(rows)
    return by_stacks(rows)


def name_stuck_rank(inc: Incident, fact: Event | None, root_of: RootOf) -> None:
    """Name the stuck rank in an engine-hang verdict `inc` when the `rank-states` fact `fact`
    singles one out: the root becomes that worker (`root_of(ev, process, rank, pid)`, its text
    the sentence) and `inc.hang.stuck_rank` holds the evidence. Otherwise nothing changes."""
    if fact is None or inc.cause != "engine-hang" or inc.hang is None:
        return
    s = stuck_rank(fact.extra)
    if s is None:
        return
    inc.hang = dataclasses.replace(inc.hang, stuck_rank=s)
    inc.root = dataclasses.replace(root_of(fact, s.process, s.rank, s.pid), text=s.sentence())
    inc.root_label = "stuck TP rank"  # (the report's ROOT CAUSE line; the detection is in HANG:)
