"""Log folders of earlier runs: `logdirs.set_aside_old_logs` on real directories."""

from __future__ import annotations

from pathlib import Path

from xpu_serve import recovery
from xpu_serve.logdirs import set_aside_old_logs


def _folder(p: Path, text: str, pending: bool = False) -> Path:
    p.mkdir(parents=True)
    (p / "vllm.log").write_text(text)
    if pending:
        recovery.mark_pending(p, {"incarnation": 1})
    return p


def test_a_prev_folder_without_its_bundle_is_kept_not_replaced(tmp_path: Path) -> None:
    """logs/1.prev holds an incident whose bundle was never written (its marker is there): the
    next run's move of logs/1 renamed it logs/1.prev.2 instead of deleting the only copy."""
    logs = tmp_path / "logs"
    _folder(logs / "1.prev", "crash of run 1\n", pending=True)
    _folder(logs / "1", "run 2\n")
    assert set_aside_old_logs(logs / "1") == logs / "1.prev"
    assert (logs / "1.prev" / "vllm.log").read_text() == "run 2\n"
    assert (logs / "1.prev.2" / "vllm.log").read_text() == "crash of run 1\n"
    assert recovery.is_pending(logs / "1.prev.2")
    _folder(logs / "1", "run 3\n")
    assert set_aside_old_logs(logs / "1") == logs / "1.prev"  # a bundled .prev is replaced
    assert (logs / "1.prev" / "vllm.log").read_text() == "run 3\n"
    assert sorted(p.name for p in logs.iterdir()) == ["1.prev", "1.prev.2"]
    assert recovery.pending_dirs(logs) == [logs / "1.prev.2"]


def test_prune_logs_keeps_newest_current_and_pending_and_caps_bytes(tmp_path: Path) -> None:
    """keep 2 of five folders (ages by last write): the two newest stay, an old pending one stays,
    the rest go; then a byte cap removes the oldest unprotected one but never the current one."""
    import os
    import time

    from xpu_serve.logdirs import prune_logs

    logs = tmp_path / "logs"
    now = time.time()
    for i, name in enumerate(["3.prev", "1.prev", "1", "2", "3"]):
        _folder(logs / name, "x" * 1000, pending=name == "1.prev")
        os.utime(logs / name / "vllm.log", (now - 100 + i, now - 100 + i))
    rep = prune_logs(logs, 2, 10**9, current=logs / "3")
    assert sorted(rep.removed) == ["1", "3.prev"] and not rep.errors
    assert sorted(p.name for p in logs.iterdir()) == ["1.prev", "2", "3"]
    rep = prune_logs(logs, 10, 1500, current=logs / "3")
    assert rep.removed == ["2"]
    assert sorted(p.name for p in logs.iterdir()) == ["1.prev", "3"]


def test_recovery_of_a_capture_cut_after_its_bundle_was_complete(tmp_path: Path) -> None:
    """A kill -9 after bundle.json was written but before the marker was removed: the next `up`
    clears the marker and names that bundle; it writes no second bundle of the incident."""
    rt = tmp_path / "rt"
    b = rt / "bundles" / "20261202T000000Z-i1-process-crash"
    b.mkdir(parents=True)
    (b / "incident.json").write_text('{"cause": "process-crash", "summary": "Worker_TP0 died"}')
    (b / "bundle.json").write_text('{"complete": true}')
    logs = _folder(rt / "logs" / "1", "Fatal Python error: Segmentation fault\n")
    recovery.mark_pending(logs, {"incarnation": 1, "bundle": str(b)})
    path, contract = recovery.recover_one(logs, rt, None, 1)
    assert path == str(b) and contract["cause"] == "process-crash"
    assert not recovery.is_pending(logs)
    assert sorted(p.name for p in (rt / "bundles").iterdir()) == [b.name]
    assert (b / "bundle.json").read_text() == '{"complete": true}'


def test_recovery_never_writes_into_a_folder_outside_the_bundles_dir(tmp_path: Path) -> None:
    """A marker naming a folder elsewhere (or a symlink) is not finished: not the cut bundle."""
    rt = tmp_path / "rt"
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert recovery._begun_bundle(rt, str(other)) is None
    (rt / "bundles").mkdir(parents=True)
    (rt / "bundles" / "link").symlink_to(other)
    assert recovery._begun_bundle(rt, str(rt / "bundles" / "link")) is None
    assert recovery._begun_bundle(rt, 7) is None
    (rt / "bundles" / "real").mkdir()
    assert recovery._begun_bundle(rt, str(rt / "bundles" / "real")) == rt / "bundles" / "real"


def test_a_recovery_cut_in_turn_keeps_the_first_captures_files(tmp_path: Path) -> None:
    """The folder a cut capture began is finished by the recovery; when that recovery is cut too,
    the next one keeps the capture's own files in cut-capture/ (not the recovery's half copies)."""
    rt = tmp_path / "rt"
    b = rt / "bundles" / "20261202T000000Z-i1-process-crash"
    b.mkdir(parents=True)
    (b / "incident.json").write_text('{"cause": "process-crash", "from": "capture"}')
    (b / "stacks.txt").write_text("live stacks")
    recovery._set_aside(b)
    (b / "incident.json").write_text('{"cause": "process-crash", "from": "recovery 1"}')
    recovery._set_aside(b)
    keep = b / "cut-capture"
    assert sorted(p.name for p in keep.iterdir()) == ["incident.json", "stacks.txt"]
    assert '"capture"' in (keep / "incident.json").read_text()
    assert (keep / "stacks.txt").read_text() == "live stacks"
