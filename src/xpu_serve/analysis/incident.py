"""The verdict's types: `Incident` (cause, root, consequences, timeline, hang and start-up facts,
notes) and `Group` (consequences of one signature, process and rank, counted). `Incident` is
turned into the `--json` verdict contract only by `Incident.to_contract`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xpu_serve.events import Event
from xpu_serve.signatures import Signature


@dataclass
class Group:
    """Consequences of one (signature, process, rank): the first event and the exact count."""

    sig: Signature
    process: str | None
    rank: int | None
    pid: int | None
    first: Event
    count: int = 0

    def to_contract(self) -> dict[str, Any]:
        """The contract's consequence: {signature, process, rank, pid, count, file, line, text}."""
        ev = self.first
        return {
            "signature": self.sig.id,
            "process": self.process,
            "rank": self.rank,
            "pid": self.pid,
            "count": self.count,
            "file": ev.file,
            "line": ev.line,
            "text": ev.text.strip()[:500],
        }


@dataclass
class Incident:
    """The verdict: cause id, root event, consequences, timeline, hang facts, notes.

    `summary` is one plain sentence without a final period (callers append "; bundle PATH"):
    process, rank, pid, what happened (the signal when known), when, and how many lines followed.
    `root["evidence"]` (also `root_evidence`) lists the other records of the root's own death
    (its crash dump, the supervisor's exit fact, EngineCore's report, the next frames of its crash
    stack): {signature, label, time, file, line, text}; they are not counted as consequences, and
    the timeline marks them with role "evidence".

    `to_contract()` gives the `--json` verdict contract of /work/shared/cases/README.md.
    """

    cause: str = "unknown"
    summary: str = "Nothing in the input supports a verdict"
    root: dict[str, Any] | None = None
    consequences: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    hang: dict[str, Any] | None = None
    library: str | None = None
    notes: list[str] = field(default_factory=list)
    meaning: str = ""
    advice: str = ""
    root_label: str | None = None
    root_evidence: list[dict[str, Any]] = field(default_factory=list)
    consequence_groups: list[Group] = field(default_factory=list)
    startup: dict[str, Any] | None = None
    lines_read: int = 0
    files: list[str] = field(default_factory=list)
    # the signal the trigger's process died by, read from its own crash dump when the supervisor
    # did not see its exit status (analysis/supervised.py), else None
    trigger_signal: str | None = None

    def to_contract(self) -> dict[str, Any]:
        """The JSON verdict: {cause, summary, root, consequences, timeline, hang, library, notes}."""
        return {
            "cause": self.cause,
            "summary": self.summary,
            "root": self.root,
            "consequences": self.consequences,
            "timeline": self.timeline,
            "hang": self.hang,
            "library": self.library,
            "notes": self.notes,
        }
