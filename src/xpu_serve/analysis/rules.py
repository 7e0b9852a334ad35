"""The causal rules (`data/rules.yaml`), typed: which rows of the signature table play a part in
the analysis, which rows it treats alike, and the ordered rules that demote a root candidate to a
consequence of another record or let a record outrank the first-ranked root.

Document shape (one mapping):

- rows: {part: signature id} - the single rows the analysis gives a part (stats_line,
  generic_exception, startup_stall, first_wait, hang_fact, uncaught_cxx, coredump,
  coredump_frame, live_death); every part in `ROW_PARTS` must be given;
- sets: {name: [signature id, ...]} - rows treated alike; every name in `SET_NAMES` must be given;
- pid_in_message: {signature id: default process name or null} - rows naming the dead pid in text;
- unquotable_causes: [cause] - a quoted error of these causes gives a consequence no cause;
- relay_pattern: a regex for a line that relays another process's error ("Worker failed with error");
- demote: [rule] - applied in order to the root candidates. A rule: name, why, kind, and
  `anchor` / `demote` selectors (below); kinds:
  - whenever-seen: when a row of `seen` was read (as a root candidate or a consequence), every
    candidate matching `demote` is demoted;
  - read-after: candidates matching `demote` read after the first-read `anchor` match;
  - read-after-in-file: the same, in the anchor's file only;
  - at-or-after: candidates matching `demote` stamped after the earliest `anchor` match or in its
    second;
  - after: candidates matching `demote` stamped after the earliest `anchor` match; with
    `same_second` (a selector, plus `relay: false`: not a relayed error) also those in its second,
    unless read before a shell's report of the anchor in the same file (printed after the death);
  `other_process: true` keeps candidates of the anchor's own process;
  `same_peer: true` demotes only candidates naming a peer's address (the row's `peer_addr`
  group) that is the address of an anchor's node (`node_address`: a death another node of the
  group reported, group/watcher.py), each against the earliest anchor of its own address; with
  `window_s` also those stamped up to that many seconds before the anchor (the anchor's time is
  another host's, on this clock through an estimated offset, and its exit latency); `after_link`
  (a selector) demotes too the candidates stamped at or after the first candidate so linked (this
  node's deaths that followed the lost link);
- outrank: [rule] - name, why, `root` and `by` selectors, `note`: a root matching `root` is
  replaced by the earliest candidate matching `by`; the note is added when the final root has a
  cause of `by` and a candidate matches `root`.

A selector (all given fields must hold): signatures, except (signature ids), causes, not_causes,
sources, not_sources, signals (the death signal the record names: `analysis.deaths.death_signal`,
or only from `signal_fields` of the record's groups when given: signame, exit_code),
launcher_report (the row's flag), abnormal (a death that explains what follows it), remote (a
record another node of the group reported: it carries `node_rank`).

Loading raises RulesError naming the file, the rule and the field; ids are checked against the
signature table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from xpu_serve.signatures import CAUSES, SOURCES, SignatureTable, load_table
from xpu_serve.yamldata import load_packaged

ROW_PARTS = (
    "stats_line",
    "generic_exception",
    "startup_stall",
    "first_wait",
    "hang_fact",
    "uncaught_cxx",
    "coredump",
    "coredump_frame",
    "kernel_task_info",
    "live_death",
)
SET_NAMES = (
    "death_evidence",
    "unprefixed_dumps",
    "signal_dumps",
    "native_dumps",
    "death_reports",
    "worker_death_reports",
    "bare_failure_reports",
    "reporter_pid",
    "engine_core_reports",
    "launcher_reports",
    "kernel_pid",
    "unprefixed_linkable",
    "not_hang_detection",
    "keep_latest",
    "wait_frames",
)
DEMOTE_KINDS = ("whenever-seen", "read-after", "read-after-in-file", "at-or-after", "after")
SIGNAL_FIELDS = ("signame", "exit_code")
_SELECT_KEYS = frozenset(
    {
        "signatures",
        "except",
        "causes",
        "not_causes",
        "sources",
        "not_sources",
        "signals",
        "signal_fields",
        "launcher_report",
        "abnormal",
        "relay",
        "remote",
    }
)


class RulesError(ValueError):
    """The rules document is malformed (the message names the file, the rule and the field)."""


@dataclass(frozen=True)
class Select:
    """Which events a rule applies to; an empty field does not restrict."""

    signatures: frozenset[str] = frozenset()
    except_: frozenset[str] = frozenset()
    causes: frozenset[str] = frozenset()
    not_causes: frozenset[str] = frozenset()
    sources: frozenset[str] = frozenset()
    not_sources: frozenset[str] = frozenset()
    signals: frozenset[str] = frozenset()
    signal_fields: tuple[str, ...] = ()
    launcher_report: bool | None = None
    abnormal: bool | None = None
    relay: bool | None = None
    remote: bool | None = None


@dataclass(frozen=True)
class DemoteRule:
    """One demotion rule (kinds: see the module docstring)."""

    name: str
    why: str
    kind: str
    demote: Select
    anchor: Select = Select()
    seen: frozenset[str] = frozenset()
    same_second: Select | None = None
    other_process: bool = False
    same_peer: bool = False
    window_s: float = 0.0
    after_link: Select | None = None


@dataclass(frozen=True)
class OutrankRule:
    """A root matching `root` is replaced by the earliest candidate matching `by`."""

    name: str
    why: str
    root: Select
    by: Select
    note: str = ""


@dataclass(frozen=True)
class Rules:
    """The loaded rules document."""

    rows: dict[str, str]
    sets: dict[str, frozenset[str]]
    death_reports: tuple[str, ...]
    pid_in_message: dict[str, str | None]
    unquotable_causes: frozenset[str | None]
    relay: re.Pattern[str]
    demote: tuple[DemoteRule, ...]
    outrank: tuple[OutrankRule, ...] = field(default=())


def _ids(v: Any, where: str, table: SignatureTable) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise RulesError(f"{where}: expected a list of signature ids")
    for x in v:
        if x not in table.by_id:
            raise RulesError(f"{where}: unknown signature id {x!r}")
    return tuple(v)


def _names(v: Any, where: str, allowed: tuple[str, ...]) -> frozenset[str]:
    if v is None:
        return frozenset()
    if not isinstance(v, list) or not all(isinstance(x, str) and x in allowed for x in v):
        raise RulesError(f"{where}: expected a list of {', '.join(allowed)}")
    return frozenset(v)


def _flag(v: Any, where: str) -> bool | None:
    if v is not None and not isinstance(v, bool):
        raise RulesError(f"{where}: expected true or false")
    return v


def parse_select(d: Any, where: str, table: SignatureTable) -> Select:
    """A selector mapping -> Select; RulesError names `where` and the bad field."""
    if not isinstance(d, dict):
        raise RulesError(f"{where}: expected a mapping")
    bad = sorted(set(d) - _SELECT_KEYS)
    if bad:
        raise RulesError(f"{where}: unknown field {bad[0]!r}")
    sig_names = tuple(f"SIG{s}" for s in ("SEGV", "ABRT", "KILL", "BUS", "TERM", "ILL", "FPE", "INT", "HUP"))
    return Select(
        signatures=frozenset(_ids(d.get("signatures"), f"{where}.signatures", table)),
        except_=frozenset(_ids(d.get("except"), f"{where}.except", table)),
        causes=_names(d.get("causes"), f"{where}.causes", CAUSES),
        not_causes=_names(d.get("not_causes"), f"{where}.not_causes", CAUSES),
        sources=_names(d.get("sources"), f"{where}.sources", SOURCES),
        not_sources=_names(d.get("not_sources"), f"{where}.not_sources", SOURCES),
        signals=_names(d.get("signals"), f"{where}.signals", sig_names),
        signal_fields=tuple(sorted(_names(d.get("signal_fields"), f"{where}.signal_fields", SIGNAL_FIELDS))),
        launcher_report=_flag(d.get("launcher_report"), f"{where}.launcher_report"),
        abnormal=_flag(d.get("abnormal"), f"{where}.abnormal"),
        relay=_flag(d.get("relay"), f"{where}.relay"),
        remote=_flag(d.get("remote"), f"{where}.remote"),
    )


def _parse_demote(d: Any, where: str, table: SignatureTable) -> DemoteRule:
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise RulesError(f"{where}: expected a mapping with a name")
    where = f"{where} ({d['name']})"
    kind = d.get("kind")
    if kind not in DEMOTE_KINDS:
        raise RulesError(f"{where}: kind must be one of {', '.join(DEMOTE_KINDS)}")
    seen = frozenset(_ids(d.get("seen"), f"{where}.seen", table))
    if kind == "whenever-seen" and not seen:
        raise RulesError(f"{where}: kind whenever-seen needs `seen`")
    if kind != "whenever-seen" and "anchor" not in d:
        raise RulesError(f"{where}: kind {kind} needs an `anchor`")
    if d.get("same_peer") and kind not in ("at-or-after", "after"):
        raise RulesError(f"{where}.same_peer: only for kinds at-or-after and after")
    same, link, window = d.get("same_second"), d.get("after_link"), d.get("window_s", 0.0)
    if (link is not None or window) and not d.get("same_peer"):
        raise RulesError(f"{where}: window_s and after_link need same_peer: true")
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window <= 60:
        raise RulesError(f"{where}.window_s: expected seconds between 0 and 60")
    return DemoteRule(
        name=d["name"],
        why=str(d.get("why") or ""),
        kind=kind,
        demote=parse_select(d.get("demote"), f"{where}.demote", table),
        anchor=parse_select(d.get("anchor") or {}, f"{where}.anchor", table),
        seen=seen,
        same_second=parse_select(same, f"{where}.same_second", table) if same is not None else None,
        other_process=bool(_flag(d.get("other_process"), f"{where}.other_process")),
        same_peer=bool(_flag(d.get("same_peer"), f"{where}.same_peer")),
        window_s=float(window),
        after_link=parse_select(link, f"{where}.after_link", table) if link is not None else None,
    )


def _parse_outrank(d: Any, where: str, table: SignatureTable) -> OutrankRule:
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise RulesError(f"{where}: expected a mapping with a name")
    where = f"{where} ({d['name']})"
    return OutrankRule(
        name=d["name"],
        why=str(d.get("why") or ""),
        root=parse_select(d.get("root"), f"{where}.root", table),
        by=parse_select(d.get("by"), f"{where}.by", table),
        note=str(d.get("note") or ""),
    )


def _parse_rows(doc: dict[str, Any], origin: str, table: SignatureTable) -> dict[str, str]:
    rows = doc.get("rows")
    if not isinstance(rows, dict):
        raise RulesError(f"{origin}: rows: expected a mapping of part -> signature id")
    for part in ROW_PARTS:
        if part not in rows:
            raise RulesError(f"{origin}: rows: missing {part}")
        if rows[part] not in table.by_id:
            raise RulesError(f"{origin}: rows.{part}: unknown signature id {rows[part]!r}")
    return {str(k): str(v) for k, v in rows.items()}


def _parse_sets(doc: dict[str, Any], origin: str, table: SignatureTable) -> dict[str, tuple[str, ...]]:
    sets = doc.get("sets")
    if not isinstance(sets, dict):
        raise RulesError(f"{origin}: sets: expected a mapping of name -> [signature id]")
    for name in SET_NAMES:
        if name not in sets:
            raise RulesError(f"{origin}: sets: missing {name}")
    return {str(k): _ids(v, f"{origin}: sets.{k}", table) for k, v in sets.items()}


def parse_rules(doc: Any, table: SignatureTable, origin: str = "rules.yaml") -> Rules:
    """The rules document -> Rules; RulesError names `origin`, the section and the field."""
    if not isinstance(doc, dict):
        raise RulesError(f"{origin}: expected a mapping")
    sets = _parse_sets(doc, origin, table)
    pim = doc.get("pid_in_message") or {}
    if not isinstance(pim, dict):
        raise RulesError(f"{origin}: pid_in_message: expected a mapping of signature id -> name")
    _ids(list(pim), f"{origin}: pid_in_message", table)
    try:
        relay = re.compile(str(doc.get("relay_pattern") or "(?!)"))
    except re.error as e:
        raise RulesError(f"{origin}: relay_pattern: {e}") from e
    causes = _names(doc.get("unquotable_causes"), f"{origin}: unquotable_causes", CAUSES)
    demote = doc.get("demote") or []
    outrank = doc.get("outrank") or []
    if not isinstance(demote, list) or not isinstance(outrank, list):
        raise RulesError(f"{origin}: demote and outrank must be lists of rules")
    return Rules(
        rows=_parse_rows(doc, origin, table),
        sets={k: frozenset(v) for k, v in sets.items()},
        death_reports=sets["death_reports"],
        pid_in_message={str(k): (None if v is None else str(v)) for k, v in pim.items()},
        unquotable_causes=frozenset({None, *causes}),
        relay=relay,
        demote=tuple(_parse_demote(r, f"{origin}: demote[{i}]", table) for i, r in enumerate(demote)),
        outrank=tuple(_parse_outrank(r, f"{origin}: outrank[{i}]", table) for i, r in enumerate(outrank)),
    )


def load_rules(table: SignatureTable | None = None) -> Rules:
    """The packaged `xpu_serve/data/rules.yaml`, checked against `table` (the packaged signature
    table when None; that pair is cached). Raises RulesError when it is malformed."""
    if table is None:
        return _default_rules()
    return parse_rules(_packaged_doc(), table)


@lru_cache(maxsize=1)
def _packaged_doc() -> Any:
    return load_packaged("rules")


@lru_cache(maxsize=1)
def _default_rules() -> Rules:
    return parse_rules(_packaged_doc(), load_table())
