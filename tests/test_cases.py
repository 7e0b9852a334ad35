"""Every real case in tests/fixtures/cases/ gives its expected verdict through a real
`xpu-serve diagnose --json` subprocess (files passed together, as the cases README says)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from xpu_serve import exitcodes

CASES = Path(__file__).resolve().parent / "fixtures" / "cases"
CASE_DIRS = sorted(p for p in CASES.iterdir() if (p / "expected.json").is_file())


def run_case(case: Path) -> dict:
    files = sorted(str(p) for p in case.iterdir() if p.suffix in (".log", ".txt"))
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", "--json", *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stderr == ""
    got = json.loads(out.stdout)
    # diagnose's documented exit codes: 0 for a verdict, NO_VERDICT for `cause: unknown`
    assert out.returncode == (exitcodes.NO_VERDICT if got["cause"] == "unknown" else exitcodes.OK), out.stderr
    return got


def diagnose_text(*files: Path) -> str:
    """The one-screen report of a real `xpu-serve diagnose FILE...` (which must exit 0, silent on stderr)."""
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return out.stdout


CONTRACT_KEYS = {"cause", "summary", "root", "consequences", "timeline", "hang", "library", "notes"}


def assert_verdict(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Assert every key of `expected` (cases README mapping) against a `--json` verdict `got`."""
    assert set(got) >= CONTRACT_KEYS
    assert got["cause"] == expected["cause"], got["summary"]
    root = got["root"] or {}
    if "root_rank" in expected:
        assert root.get("rank") == expected["root_rank"]
    if "root_pid" in expected:
        assert root.get("pid") == expected["root_pid"]
    if "root_process" in expected:
        assert root.get("process") == expected["root_process"]
    if "library" in expected:
        assert got["library"] == expected["library"]
    if "hang_last_progress" in expected:
        assert (got["hang"] or {}).get("last_progress") == expected["hang_last_progress"]
    if "consequence_ranks_include" in expected:
        ranks = {c["rank"] for c in got["consequences"]}
        assert set(expected["consequence_ranks_include"]) <= ranks
    # evidence: the root names a real line of a real file, and that line holds the root's text
    if got["cause"] != "unknown" and root.get("file"):
        lines = Path(root["file"]).read_bytes().decode("utf-8", "replace").split("\n")
        assert root["text"].split()[0] in lines[root["line"] - 1]
    assert len(got["timeline"]) <= 15


@pytest.mark.parametrize("case", CASE_DIRS, ids=[p.name for p in CASE_DIRS])
def test_case_verdict(case: Path) -> None:
    expected = json.loads((case / "expected.json").read_text())
    assert_verdict(run_case(case), expected)


def test_every_fixture_case_is_tested() -> None:
    assert len(CASE_DIRS) >= 10
