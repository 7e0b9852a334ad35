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
