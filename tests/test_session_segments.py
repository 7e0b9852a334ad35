"""The session-end check of tests/conftest.py: a segment named by a session's own prefix that is
still in /dev/shm fails that session, is listed and removed; another session's is never touched.
Each case is a real inner pytest session (a subprocess loading tests/conftest.py as a plugin)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, SHM_PREFIX

INNER = '''
import os
from pathlib import Path

def test_leaves_a_segment():
    Path("/dev/shm", os.environ["XPU_SERVE_SIM_SHM_PREFIX"] + "leak").write_bytes(b"x")
    Path(os.environ["OUT"]).write_text(os.environ["XPU_SERVE_SIM_SHM_PREFIX"])
'''


def _inner(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], str]:
    test = tmp_path / "test_inner.py"
    test.write_text(body)
    out = tmp_path / "prefix.txt"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cloudcoil",
         "-p", "tests.conftest", f"--rootdir={tmp_path}", str(test)],
        cwd=ROOT, env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return r, out.read_text() if out.exists() else ""


def test_a_leaked_segment_fails_its_session_and_is_removed(tmp_path: Path) -> None:
    mine = Path("/dev/shm", SHM_PREFIX + "other-session")  # this (outer) session's: never the inner's
    mine.write_bytes(b"x")
    try:
        r, prefix = _inner(tmp_path, INNER)
        assert prefix.startswith("psm_t") and prefix != SHM_PREFIX, prefix
        leaked = f"/dev/shm/{prefix}leak"
        assert r.returncode == 1, r.stdout + r.stderr
        assert "1 passed" in r.stdout
        assert "shared memory leaked by this session's simulators (1, removed now):" in r.stdout
        line = f"  {leaked} (last written during test_inner.py::test_leaves_a_segment)\n"
        assert line in r.stdout and str(mine) not in r.stdout
        assert not os.path.exists(leaked)
        assert mine.exists()
    finally:
        with contextlib.suppress(OSError):
            mine.unlink()


def test_a_clean_session_passes(tmp_path: Path) -> None:
    r, _ = _inner(tmp_path, "def test_nothing():\n    pass\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "shared memory leaked" not in r.stdout
