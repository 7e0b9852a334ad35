"""The verdict's types: `Incident` (cause, root, consequences, timeline, hang and start-up facts,
notes) and its parts (`Root`, `RootEvidence`, `Consequence`, `TimelineItem`, `Hang`, `Startup`),
plus `Group` (the consequence events of one signature, process and rank, or of one rank's
collective teardown burst, counted while the verdict is made: analysis/occurrence.py).

The parts carry the fields of the `--json` verdict contract (/work/shared/cases/README.md "The
verdict contract"); they are turned into that JSON only at the edge, by analysis/contract.py
(`Incident.to_contract`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xpu_serve.analysis.stuck import StuckRank
from xpu_serve.events import Event
from xpu_serve.signatures import Signature


@dataclass(frozen=True, slots=True)
class RootEvidence:
    """Another record of the root's own death (its crash dump, the supervisor's exit fact,
    EngineCore's report, the next frames of its crash stack); `text` is cut to 500 characters."""

    signature: str | None
    label: str
    time: str | None
    file: str | None
    line: int | None
    text: str


@dataclass(frozen=True, slots=True)
class Root:
    """The root (or a start-up stall's or hang's subject): `source` is vllm, ccl, kernel,
    process or health; `line` is 1-based in `file`; `text` is cut to 2000 characters; unknown
    fields are None. `evidence` is None until the verdict looked for the root's own death
    records (failures only, not hangs), then the records found (possibly none)."""

    source: str
    process: str | None
    rank: int | None
    pid: int | None
    time: str | None
    file: str | None
    line: int | None
    text: str
    evidence: tuple[RootEvidence, ...] | None = None


@dataclass(frozen=True, slots=True)
class Consequence:
    """What followed the root, per (signature, process, rank): the first line's place and text
    (cut to 500 characters) and `count`, the exact number of events (one traceback, one rank's
    collective teardown burst, one process's burst of lines: analysis/occurrence.py), not lines.
    For a teardown burst `signature` is the first line's row."""

    signature: str
    process: str | None
    rank: int | None
    pid: int | None
    count: int
    file: str | None
    line: int | None
    text: str


@dataclass(frozen=True, slots=True)
class TimelineItem:
    """One key event in causal order; `role` is root, evidence, precursor, progress, milestone,
    consequence...; `text` is cut to 300 characters; `time` is the stamp as the log shows it,
    `normalized_time` the same instant in one format for every source (analysis/clock.py:
    "2026-03-26 10:12:46", "03-26 10:12:46" when the input has no year, "551.424205 s after
    boot" when no record anchors the kernel's clock), None for both on an unstamped line."""

    time: str | None
    source: str
    process: str | None
    rank: int | None
    pid: int | None
    role: str | None
    signature: str | None
    file: str | None
    line: int | None
    text: str
    normalized_time: str | None = None


@dataclass(frozen=True, slots=True)
class Hang:
    """A hang's facts, times as the log shows them: the last progress, when and by what it was
    detected; `delay_s` (seconds from last progress to detection, same clock only), the first
    zero-throughput stats line with work (`no_progress_since`) and the first shared-memory wait
    warning, when known."""

    last_progress: str | None
    detected_at: str | None
    detected_by: str | None
    delay_s: float | None = None
    no_progress_since: str | None = None
    first_wait_warning: str | None = None
    stuck_rank: StuckRank | None = None


@dataclass(frozen=True, slots=True)
class Startup:
    """Start-up facts: the last phase reached (analysis/contract.py PHASES) and its last event;
    the ranks that did not reach the last per-rank phase (`missing_phase`), in rank order."""

    last_milestone: str
    last_milestone_event: Event
    missing_ranks: tuple[int, ...]
    missing_phase: str | None
    world_size: int | None


@dataclass
class Milestone:
    """One start-up phase as read (signatures.yaml rows with `phase`): its first and latest
    event, the TP ranks that reached it, the pids seen without a known rank yet (at most 1024;
    their ranks are added once the pid -> rank map knows them), and whether any of its rows is
    `per_rank` (every rank must reach it)."""

    first: Event
    last: Event
    per_rank: bool
    ranks: set[int] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)


@dataclass
class Group:
    """Consequence events of one (signature, process, rank), or of one (teardown burst, process,
    rank): the first line, the exact count of events (analysis/occurrence.py), the latest line
    (`last`, which the next line may continue), the burst's label (`burst`, the rows'
    `teardown_burst`) and the error it names (`detail`, a row's `burst_detail` group), else None."""

    sig: Signature
    process: str | None
    rank: int | None
    pid: int | None
    first: Event
    count: int = 0
    last: Event | None = None
    burst: str | None = None
    detail: str | None = None

    def copy(self) -> Group:
        """A copy whose count the verdict may raise (the store's groups stay as read)."""
        return Group(
            self.sig, self.process, self.rank, self.pid, self.first, self.count, self.last, self.burst, self.detail
        )

    def consequence(self) -> Consequence:
        """The verdict's consequence of this group."""
        ev = self.first
        return Consequence(
            self.sig.id,
            self.process,
            self.rank,
            self.pid,
            self.count,
            ev.file,
            ev.line,
            ev.text.strip()[:500],
        )


@dataclass
class Incident:
    """The verdict: cause id, root, consequences, timeline, hang facts, notes.

    `summary` is one plain sentence without a final period (callers append "; bundle PATH"):
    process, rank, pid, what happened (the signal when known), when, and how many consequence events
    followed.
    `root.evidence` (also `root_evidence`) lists the other records of the root's own death; they
    are not counted as consequences, and the timeline marks them with role "evidence".

    `to_contract()` gives the `--json` verdict contract of /work/shared/cases/README.md.
    """

    cause: str = "unknown"
    summary: str = "Nothing in the input supports a verdict"
    root: Root | None = None
    consequences: list[Consequence] = field(default_factory=list)
    timeline: list[TimelineItem] = field(default_factory=list)
    hang: Hang | None = None
    library: str | None = None
    notes: list[str] = field(default_factory=list)
    meaning: str = ""
    advice: str = ""
    root_label: str | None = None
    consequence_groups: list[Group] = field(default_factory=list)
    startup: Startup | None = None
    lines_read: int = 0
    files: list[str] = field(default_factory=list)
    # the signal the trigger's process died by, read from its own crash dump when the supervisor
    # did not see its exit status (analysis/supervised.py), else None
    trigger_signal: str | None = None

    @property
    def root_evidence(self) -> tuple[RootEvidence, ...]:
        """The root's own death records (`root.evidence`), () when none or no root."""
        return (self.root.evidence or ()) if self.root is not None else ()

    def to_contract(self) -> dict[str, Any]:
        """The JSON verdict: {cause, summary, root, consequences, timeline, hang, library, notes}."""
        from xpu_serve.analysis.contract import incident_json  # the edge imports these types

        return incident_json(self)
