"""Shared fixtures for the test suite, and the session's /dev/shm check.

Every simulator a test starts (directly, through `SimRun`, or under a supervisor) inherits
XPU_SERVE_SIM_SHM_PREFIX=`SHM_PREFIX` (set in `pytest_configure`), so its EngineCore's MessageQueue
buffer is `/dev/shm/<SHM_PREFIX>...` (sim/dist_files.py, `make_dist_files`) and not Python's
anonymous `psm_<8 hex>`. The prefix is random per session, so `pytest_sessionfinish` sees exactly
the segments this session's simulators left, never another session's or another program's: it
lists them, removes them (they are proven ours by the name) and fails the run.
"""

from __future__ import annotations

import glob
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from xpu_serve.sim.harness import SHM_PREFIX_VAR

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

SHM_PREFIX = f"psm_t{uuid.uuid4().hex[:8]}_"
"""This session's base of the simulators' MessageQueue segment names."""


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SHM_PREFIX_VAR] = SHM_PREFIX


_TEST_SPANS: list[tuple[float, float, str]] = []
"""(start, end, nodeid) of every test run so far, wall clock seconds: a leftover is named by the
test that was running when the segment was last written (its st_mtime)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    start = time.time()
    yield
    _TEST_SPANS.append((start, time.time(), item.nodeid))


def writer_of(path: str) -> str:
    """The nodeid of the test that ran when `path` was last modified, or "between tests"."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return "gone"
    for start, end, nodeid in _TEST_SPANS:
        if start - 1.0 <= mtime <= end + 1.0:
            return nodeid
    return "between tests"


def session_leftovers() -> list[str]:
    """/dev/shm entries named by this session's prefix that exist now."""
    return sorted(glob.glob(f"/dev/shm/{glob.escape(SHM_PREFIX)}*"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = session_leftovers()
    if not left:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.ensure_newline()
    write = tr.write_line if tr is not None else (lambda s: print(s, file=sys.stderr))
    write(f"shared memory leaked by this session's simulators ({len(left)}, removed now):")
    for path in left:
        write(f"  {path} (last written during {writer_of(path)})")
        try:
            os.unlink(path)
        except OSError as e:
            write(f"  cannot remove {path}: {e.strerror}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def xpu_serve_cmd() -> list[str]:
    """argv prefix that runs the installed CLI in a real subprocess."""
    return [sys.executable, "-m", "xpu_serve"]
