"""The verdict's rules one at a time (analysis/verdict.py CAUSE_RULES, hang.py, stall.py,
rootdeath.py), each run on an evidence store fed with real log lines, and the contract edge
(analysis/contract.py) on typed parts."""

from __future__ import annotations

import json
from pathlib import Path

from xpu_serve import facts
from xpu_serve.analysis import verdict
from xpu_serve.analysis.contract import hang_json, incident_json, root_json
from xpu_serve.analysis.hang import hang_cause, hang_facts
from xpu_serve.analysis.incident import Hang, Incident, Root, RootEvidence
from xpu_serve.analysis.rootdeath import primary_gpu_fault, root_evidence
from xpu_serve.analysis.stall import startup_cause, startup_info
from xpu_serve.analysis.work import Ctx, Work
from xpu_serve.diagnosis import Analyzer, diagnose_files
from xpu_serve.events import parse_kernel_record

CASES = Path(__file__).parent / "fixtures" / "cases"
STATS = (
    "(APIServer pid=1) INFO 11-30 08:{m}:00 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 "
    "tokens/s, Avg generation throughput: {g} tokens/s, Running: 1 reqs, Waiting: 0 reqs"
)
READY = "(APIServer pid=1) INFO:     Application startup complete."


def _work(an: Analyzer) -> tuple[Ctx, Work]:
    """The context and a fresh verdict over `an`, with the candidates found and demoted."""
    cx = Ctx.of(an)
    verdict.refresh(cx)
    v = Work(Incident())
    v.cands, v.demoted = verdict.demote(cx, verdict.candidates(cx))
    return cx, v


def _fed(lines: list[str]) -> Analyzer:
    an = Analyzer()
    for i, line in enumerate(lines, 1):
        an.feed_line(line, "vllm.log", i)
    return an


def test_cause_rules_are_rank_then_hang_then_startup() -> None:
    assert verdict.CAUSE_RULES == (verdict.rank, hang_cause, startup_cause)


def test_hang_cause_needs_a_stall_after_progress_on_a_serving_engine() -> None:
    progress = [READY, STATS.format(m="30", g="12.0")]
    cx, v = _work(_fed(progress))
    verdict.rank(cx, v)
    hang_cause(cx, v)
    assert (v.root, v.cause) == (None, None)
    # zero throughput with a request running after the last progress: a hang
    cx, v = _work(_fed([*progress, STATS.format(m="31", g="0.0")]))
    verdict.rank(cx, v)
    hang_cause(cx, v)
    assert v.cause == "engine-hang"
    h = hang_facts(cx, v.root, v.hang_precursors, v.inc.notes)
    assert (h.last_progress, h.no_progress_since, h.detected_at) == ("11-30 08:30:00", "11-30 08:31:00", None)


def test_startup_cause_names_the_rank_that_did_not_reach_the_phase() -> None:
    an = Analyzer()
    an.feed_line(
        "(Worker pid=11) INFO 03-26 07:01:59 [parallel_state.py:1395] world_size=2 rank=0 local_rank=0 "
        "distributed_init_method=tcp://127.0.0.1:1 backend=xccl"
    )
    cx, v = _work(an)
    info = startup_info(cx)
    assert info is not None and (info.last_milestone, info.missing_ranks, info.world_size) == (
        "dist-init",
        (1,),
        2,
    )
    for rule in verdict.CAUSE_RULES:
        rule(cx, v)
    assert v.cause == "startup-hang" and v.startup_info == info


def test_rank_takes_the_fault_that_opened_the_kernel_burst() -> None:
    """xe reports the page fault, then times the job out naming the process: the fault is the
    root, the timed-out job's record names the process."""
    an = _fed(
        [
            "[  100.000001] xe 0000:03:00.0: [drm] Tile0: GT0: Fault response: Unsuccessful -EINVAL",
            "[  100.000002] xe 0000:03:00.0: [drm] *ERROR* Tile0: GT0: Engine memory CAT error [18]: "
            "class=ccs, logical_mask: 0x1, guc_id=6",
            "[  100.500000] xe 0000:03:00.0: [drm] Tile0: GT0: Timedout job: seqno=1, lrc_seqno=1, guc_id=6, "
            "flags=0x0 in python3 [4242]",
        ]
    )
    cx, v = _work(an)
    kernel_gpu = [e for e in v.cands if e.cause == "gpu-fault" and e.source == "kernel"]
    assert len(kernel_gpu) >= 2
    last = max(kernel_gpu, key=lambda e: e.line or 0)
    first = primary_gpu_fault(cx, last, kernel_gpu)
    assert first is not None and first.line == 1
    verdict.rank(cx, v)
    assert v.root is first and v.cause == "gpu-fault"


def test_root_evidence_is_the_root_process_own_death_records() -> None:
    """The kernel's segfault record of pid 4242 is the root; the supervisor's exit fact of the
    same pid is its evidence, another worker's exit is not."""
    an = Analyzer()
    an.feed_line(
        "(Worker_TP0 pid=4242) INFO 11-30 08:30:44 [cpu_model_runner.py:68] Starting to load model x"
    )
    an.feed_line(
        "(Worker_TP1 pid=4243) INFO 11-30 08:30:44 [cpu_model_runner.py:68] Starting to load model x"
    )
    an.feed_line(READY)
    an.add_event(facts.process_exit("Worker_TP0", 4242, 0, None, "SIGSEGV"))
    an.add_event(facts.process_exit("Worker_TP1", 4243, 1, None, "SIGKILL"))
    rec = parse_kernel_record(
        "6,99,551424205,-;VLLM::Worker_TP[4242]: segfault at 58619acc8 ip 0000762f1beff168 sp 00007ffd3b90f940 "
        "error 4 in libze_intel_gpu.so.1.3.29735[6ff168,762f1b800000+9d4000]"
    )
    assert rec is not None
    an.add_event(rec)
    cx, v = _work(an)
    verdict.rank(cx, v)
    assert v.root is rec and v.cause == "umd-segfault"
    subject = Root("kernel", "Worker_TP0", 0, 4242, None, None, None, rec.text)
    got = root_evidence(cx, rec, subject, v.cands + v.demoted)
    assert [(e.signature, e.extra.get("proc")) for e in got] == [("process-killed-by-signal", "Worker_TP0")]


def test_contract_edge_turns_typed_parts_into_the_documented_json() -> None:
    inc = diagnose_files([CASES / "qwen3-30b-worker0-died" / "vllm.log"])
    assert inc.root is not None and isinstance(inc.root, Root)
    d = incident_json(inc)
    assert set(d) == {"cause", "summary", "root", "consequences", "timeline", "hang", "library", "notes"}
    assert list(d["root"])[:8] == ["source", "process", "rank", "pid", "time", "file", "line", "text"]
    assert d["consequences"][0].keys() == {
        "signature",
        "process",
        "rank",
        "pid",
        "count",
        "file",
        "line",
        "text",
    }
    assert d["timeline"][0].keys() == {
        "time",
        "source",
        "process",
        "rank",
        "pid",
        "role",
        "signature",
        "file",
        "line",
        "text",
        "normalized_time",
    }
    # the stamp as the log shows it, and the same instant in the one format for people
    assert (d["timeline"][0]["time"], d["timeline"][0]["normalized_time"]) == ("03-26 04:15:27", "2026-03-26 04:15:27")
    assert d == json.loads(json.dumps(d))
    assert sum(c["count"] for c in d["consequences"]) == sum(c.count for c in inc.consequences)
    # evidence appears once looked for, even when none was found; a hang's optional facts only when known
    r = Root("vllm", None, None, None, None, "f", 1, "x")
    assert "evidence" not in root_json(r)
    assert root_json(Root("vllm", None, None, None, None, "f", 1, "x", ()))["evidence"] == []
    ev = RootEvidence("s", "label", None, "f", 2, "y")
    assert root_json(Root("vllm", None, None, None, None, "f", 1, "x", (ev,)))["evidence"] == [
        {"signature": "s", "label": "label", "time": None, "file": "f", "line": 2, "text": "y"}
    ]
    assert hang_json(Hang("a", None, "b")) == {"last_progress": "a", "detected_at": None, "detected_by": "b"}
    assert hang_json(Hang("a", "c", "b", delay_s=0.0))["delay_s"] == 0.0
