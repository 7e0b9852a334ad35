"""The causal rules of data/rules.yaml: the loader's one-line errors, and each demotion rule of the
packaged document applied on its own to root candidates (analysis/demote.py)."""

from __future__ import annotations

from datetime import datetime
from importlib import resources
from typing import Any

import pytest
import yaml

from xpu_serve.analysis.demote import Candidates, apply_demote, apply_outrank, outrank_notes
from xpu_serve.analysis.rules import DEMOTE_KINDS, RulesError, load_rules, parse_rules
from xpu_serve.events import Event
from xpu_serve.signatures import load_table

TABLE = load_table()
RULES = load_rules()


def _doc() -> dict[str, Any]:
    text = resources.files("xpu_serve").joinpath("data/rules.yaml").read_text(encoding="utf-8")
    doc = yaml.safe_load(text)
    assert isinstance(doc, dict)
    return doc


def _ev(sig: str, order: int, *, sec: int | None = None, **kw: Any) -> Event:
    row = TABLE.by_id[sig]
    extra = kw.pop("extra", {})
    ev = Event(
        source=kw.pop("source", "vllm"),
        text=kw.pop("text", row.example),
        time=datetime(2026, 3, 1, 10, 0, sec) if sec is not None else None,
        file=kw.pop("file", "vllm.log"),
        line=order,
        **kw,
    )
    ev.signature, ev.role, ev.cause = sig, row.role, kw.get("cause", row.cause)
    ev.extra.update(extra, _order=order)
    return ev


def _rule(name: str) -> Any:
    return next(r for r in RULES.demote if r.name == name)


def _run(name: str, evs: list[Event], seen: frozenset[str] = frozenset()) -> list[Event]:
    c = Candidates(list(evs), [], seen)
    apply_demote(_rule(name), c, TABLE, RULES)
    return c.demoted


def test_packaged_rules_load_and_use_every_kind() -> None:
    kinds = {r.kind for r in RULES.demote}
    assert kinds == set(DEMOTE_KINDS)
    assert RULES.rows["generic_exception"] == "python-exception"
    assert "bare-timeout-error" in RULES.sets["not_hang_detection"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["sets"].update(death_evidence=["no-such-row"]),
            "sets.death_evidence: unknown signature id 'no-such-row'",
        ),
        (
            lambda d: d["demote"][0].update(kind="sometimes"),
            "demote[0] (watchdog-abort): kind must be one of",
        ),
        (
            lambda d: d["demote"][1]["demote"].update(colour="red"),
            "demote[1] (terminate-abort).demote: unknown field 'colour'",
        ),
        (
            lambda d: d["demote"][2].pop("anchor"),
            "demote[2] (launcher-stop-kill): kind read-after needs an `anchor`",
        ),
        (lambda d: d["rows"].pop("stats_line"), "rows: missing stats_line"),
        (
            lambda d: d["demote"][2].update(window_s=3),
            "demote[2] (launcher-stop-kill): window_s and after_link need same_peer: true",
        ),
        (
            lambda d: d["demote"][2].update(same_peer=True),
            "demote[2] (launcher-stop-kill).same_peer: only for kinds at-or-after and after",
        ),
        (lambda d: d["demote"][3]["demote"].update(causes=["sadness"]), ".demote.causes: expected a list of"),
    ],
)
def test_a_bad_rules_document_is_one_line_naming_the_rule_and_field(edit: Any, message: str) -> None:
    doc = _doc()
    edit(doc)
    with pytest.raises(RulesError) as e:
        parse_rules(doc, TABLE, origin="rules.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_watchdog_abort_demotes_an_abort_only_when_the_watchdog_was_seen() -> None:
    abort = _ev("process-exited", 2, source="text", extra={"exit_code": "-6"})
    segv = _ev("process-exited", 3, source="text", extra={"exit_code": "-11"})
    assert _run("watchdog-abort", [abort, segv]) == []
    assert _run("watchdog-abort", [abort, segv], frozenset({"pg-watchdog-terminated"})) == [abort]


def test_terminate_abort_demotes_the_later_abort_in_the_same_file_only() -> None:
    term = _ev("cxx-terminate", 1)
    term.cause = "device-lost"  # what() named the failure
    later = _ev("process-exited", 2, source="text", extra={"signame": "Aborted"})
    other_file = _ev("process-exited", 3, source="text", file="other.log", extra={"signame": "Aborted"})
    assert _run("terminate-abort", [term, later, other_file]) == [later]
    term.cause = "process-crash"  # a bare terminate names nothing: no anchor
    assert _run("terminate-abort", [term, later, other_file]) == []


def test_launcher_stop_kill_demotes_a_kill_report_read_after_a_vllm_death() -> None:
    death = _ev("worker-died-unexpectedly", 5)
    kill = _ev("shell-job-signal", 9, source="text", extra={"signame": "Killed"})
    early_kill = _ev("shell-job-signal", 3, source="text", extra={"signame": "Killed"})
    assert _run("launcher-stop-kill", [death, kill, early_kill]) == [kill]
    assert _run("launcher-stop-kill", [kill]) == []


def test_worker_terminated_in_teardown_demotes_sigterm_reports_from_a_failure_on() -> None:
    # V0: the barrier's timeout, then the worker monitor's report of the worker vLLM terminated
    timeout = _ev("gloo-timeout", 1, sec=6)
    term = _ev("worker-died-v0", 2, sec=6, extra={"exit_code": "-15"})
    abort = _ev("worker-died-v0", 3, sec=6, extra={"exit_code": "-6"})
    before = _ev("worker-died-v0", 4, sec=2, extra={"exit_code": "-15"})
    assert _run("worker-terminated-in-teardown", [timeout, term, abort, before]) == [term]
    # a SIGTERM report with no other failure stays a candidate (someone stopped the worker)
    assert _run("worker-terminated-in-teardown", [term]) == []


def test_deaths_after_hang_detection_demotes_live_deaths_from_its_second_on() -> None:
    hang = _ev("rpc-timeout", 1, sec=10)
    same = _ev("process-killed-by-signal", 2, sec=10, source="process", extra={"signal": "SIGKILL"})
    later = _ev("process-killed-by-signal", 3, sec=12, source="process", extra={"signal": "SIGKILL"})
    earlier = _ev("process-killed-by-signal", 4, sec=5, source="process", extra={"signal": "SIGSEGV"})
    assert _run("deaths-after-hang-detection", [hang, same, later, earlier]) == [same, later]


def test_later_live_death_keeps_the_first_and_its_own_process() -> None:
    first = _ev("process-exited", 1, sec=10, source="process", pid=100, extra={"exit_code": 1})
    other = _ev("process-killed-by-signal", 2, sec=11, source="process", pid=200, extra={"signal": "SIGABRT"})
    own = _ev("process-killed-by-signal", 3, sec=12, source="process", pid=100, extra={"signal": "SIGKILL"})
    assert _run("later-live-death", [first, other, own]) == [other]


def test_errors_after_first_death_demote_later_and_same_second_exceptions_of_others() -> None:
    death = _ev("worker-died-unexpectedly", 1, sec=10, pid=100)
    later = _ev("python-exception", 2, sec=11, pid=200)
    same_sec = _ev("python-exception", 3, sec=10, pid=300)
    relayed = _ev(
        "python-exception", 4, sec=10, pid=400, text="RuntimeError: Worker failed with error 'boom'"
    )
    own = _ev("python-exception", 5, sec=11, pid=100)
    kernel = _ev("device-lost", 6, sec=12, source="kernel")
    got = _run("errors-after-first-death", [death, later, same_sec, relayed, own, kernel])
    assert got == [later, same_sec]


def test_peer_errors_after_node_death_link_the_peer_address_to_the_node_that_died() -> None:
    def death(order: int, sec: int, addr: str) -> Event:
        extra = {"signal": "SIGKILL", "node_rank": 1, "node_address": addr}
        return _ev("process-killed-by-signal", order, sec=sec, source="process", pid=900 + order, extra=extra)

    def gloo(order: int, sec: int, addr: str) -> Event:
        return _ev("gloo-peer-lost", order, sec=sec, pid=100 + order, extra={"peer_addr": addr})

    node1, node2 = death(1, 10, "10.0.0.2"), death(2, 30, "[::ffff:10.0.0.3]")
    same_sec, later = gloo(3, 10, "10.0.0.2"), gloo(4, 25, "10.0.0.2")
    # within the rule's window before the death (the remote exit time is late on this clock)
    just_before, long_before = gloo(5, 9, "10.0.0.2"), gloo(6, 20, "10.0.0.3")  # node 2 died at 30
    node3_late = gloo(7, 30, "10.0.0.3")
    local = _ev("process-killed-by-signal", 8, sec=5, source="process", pid=50, extra={"signal": "SIGKILL"})
    local_peer = gloo(9, 10, "10.0.0.9")
    # this node's EngineCore exit 1 in the first linked error's second: it followed the lost link
    core_exit = _ev("process-exited", 10, sec=9, source="process", pid=60, extra={"exit_code": 1})
    evs = [node1, node2, same_sec, later, just_before, long_before, node3_late, local, local_peer, core_exit]
    got = _run("peer-errors-after-node-death", evs)
    assert got == [same_sec, later, just_before, node3_late, core_exit]
    # a death of this node's own tree (no node_rank) anchors nothing
    assert _run("peer-errors-after-node-death", [local, gloo(10, 10, "10.0.0.2")]) == []


def test_kernel_fault_outranks_a_user_space_device_lost() -> None:
    lost = _ev("device-lost", 1, sec=20)
    fault = _ev("xe-cat-error", 2, sec=19, source="kernel")
    rule = RULES.outrank[0]
    assert apply_outrank(rule, lost, [lost, fault], TABLE, RULES) is fault
    assert apply_outrank(rule, fault, [lost, fault], TABLE, RULES) is fault
    assert outrank_notes(fault, [lost, fault], TABLE, RULES) == [rule.note]
    assert outrank_notes(fault, [fault], TABLE, RULES) == []


def test_a_bare_timeout_is_not_a_hang_detection_anchor() -> None:
    bare = _ev("bare-timeout-error", 1, sec=10)
    death = _ev("process-killed-by-signal", 2, sec=11, source="process", extra={"signal": "SIGKILL"})
    assert _run("deaths-after-hang-detection", [bare, death]) == []
