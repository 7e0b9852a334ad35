"""What the verdict rules share: `Ctx` (the evidence store and its readers) and `Work` (a verdict
being made: the incident so far and what the rules found). Each rule of analysis/verdict.py,
hang.py, stall.py and rootdeath.py is a function of (Ctx, Work) or of Ctx."""

from __future__ import annotations

from dataclasses import dataclass, field

from xpu_serve.analysis.contract import Parts
from xpu_serve.analysis.incident import Incident, Startup
from xpu_serve.analysis.store import EvidenceStore
from xpu_serve.analysis.subject import Subjects
from xpu_serve.events import Event


@dataclass(frozen=True, slots=True)
class Ctx:
    """The evidence store `st`, the subject of its records (`subj`) and the parts made of them."""

    st: EvidenceStore
    subj: Subjects
    parts: Parts

    @classmethod
    def of(cls, st: EvidenceStore) -> Ctx:
        subj = Subjects(st)
        return cls(st, subj, Parts(st, subj))


@dataclass
class Work:
    """A verdict being made: the incident so far and what the rules found."""

    inc: Incident
    cands: list[Event] = field(default_factory=list)
    demoted: list[Event] = field(default_factory=list)
    root: Event | None = None
    subject_ev: Event | None = None  # the record that names the root's process
    tl_root: Event | None = None  # the timeline's root
    cause: str | None = None
    hang_precursors: list[Event] = field(default_factory=list)
    startup_waits: list[Event] = field(default_factory=list)
    n_waits: int = 0
    startup_info: Startup | None = None
