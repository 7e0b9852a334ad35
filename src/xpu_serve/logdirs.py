"""Retention of RUNTIME/logs/: one folder per incarnation (`N`), earlier runs' folders set aside
(`N.prev`, `N.prev.K`, `set_aside_old_logs`).

With real vLLM one incarnation's folder can reach 64 MiB x 6 (vllm.log and its rotations) plus
the per-process logs, so a slow crash loop would fill the disk. `prune_logs` keeps the newest
`logs.keep_incarnations` folders and at most `logs.max_bytes` in all, removing the oldest first,
and never removes the current incarnation's folder nor one that holds an incident without a
bundle (`recovery.is_pending`). Age is the folder's last write (newest mtime of the folder and
its files): an earlier run's leftovers named like this run's (`logs/7` of a run that got further)
sort before this run's own.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from xpu_serve import recovery


@dataclass
class PruneReport:
    """Folders removed (names under RUNTIME/logs) and one line per folder that could not be."""

    removed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _usage(d: Path) -> tuple[float, int]:
    """(last write, epoch s; bytes) of the regular files under `d`, never following links."""
    newest, total = d.lstat().st_mtime, 0
    for dirpath, _dirs, names in os.walk(d):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            total += st.st_size
    return newest, total


def prune_logs(logs_root: Path, keep: int, max_bytes: int, current: Path) -> PruneReport:
    """Remove the oldest folders of `logs_root` past the newest `keep` and while the total is
    over `max_bytes`; never `current` nor a folder with an incident pending. Never raises."""
    rep = PruneReport()
    try:
        dirs = [p for p in logs_root.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError as e:
        rep.errors.append(f"{logs_root}: {e.strerror or e}")
        return rep
    usage: dict[Path, tuple[float, int]] = {}
    for d in dirs:
        try:
            usage[d] = _usage(d)
        except OSError:
            continue
    newest_first = sorted(usage, key=lambda d: (d == current, usage[d][0], d.name), reverse=True)
    protected = {d for d in newest_first if d == current or recovery.is_pending(d)}
    left = list(newest_first)
    for d in newest_first[keep:]:
        if d not in protected and _remove(d, rep):
            left.remove(d)
    total = sum(usage[d][1] for d in left)
    for d in reversed(list(left)):  # oldest first
        if total <= max_bytes:
            break
        if d not in protected and _remove(d, rep):
            total -= usage[d][1]
    return rep


def _remove(d: Path, rep: PruneReport) -> bool:
    try:
        shutil.rmtree(d)  # (never follows symlinks inside)
    except OSError as e:
        rep.errors.append(f"{d}: {e.strerror or e}")
        return False
    rep.removed.append(d.name)
    return True


def set_aside_old_logs(log_dir: Path) -> Path | None:
    """Move RUNTIME/logs/N left by an earlier supervisor run out of the way; returns where to.

    Every run numbers its incarnations from 1, so without this a new run (a systemd restart, the
    next `up` after a kill -9) appended to the old run's ``logs/1/vllm.log`` and per-process files:
    its line numbers (`LogPump.locate`, evidence) pointed at the old run's lines and its bundles
    carried the old run's crash as if it were this one's. A non-empty `log_dir` becomes
    ``logs/N.prev`` (replacing an older one: at most one earlier run's logs are kept, except that
    a ``logs/N.prev`` holding an incident without a bundle, `recovery.is_pending`, is renamed
    ``logs/N.prev.K``, K = 2, 3..., instead of removed); a log relay of the old run still draining
    an orphan's pipes writes on into the moved file. None when there was nothing to move or the
    move failed (read-only or broken runtime directory: the old behaviour, appending)."""
    try:
        with os.scandir(log_dir) as it:
            if next(it, None) is None:
                return None
    except OSError:  # (absent, not a directory: mkdir says what is wrong)
        return None
    prev = log_dir.with_name(log_dir.name + ".prev")
    try:
        if prev.is_symlink() or (prev.exists() and not prev.is_dir()):
            prev.unlink()
        elif prev.exists() and recovery.is_pending(prev):
            k = 2
            while os.path.lexists(f"{prev}.{k}"):
                k += 1
            os.replace(prev, f"{prev}.{k}")
        elif prev.exists():
            shutil.rmtree(prev)  # (never follows symlinks inside)
        os.replace(log_dir, prev)
    except OSError:
        return None
    return prev
