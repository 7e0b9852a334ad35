"""Real public failure reports in tests/fixtures/reports/ give their expected verdict through a real
`xpu-serve diagnose --json` subprocess (all files of a case passed together, as the cases README says).

Each case folder holds the log lines as posted (personal paths/hosts replaced), `expected.json` (same
keys as tests/fixtures/cases) and `SOURCE.md` (thread URL and why the expected cause is right per the
cause table). Cases the analysis does not yet get right are marked xfail(strict=True) with the reason,
so the suite stays green and a fix is noticed (the xfail then fails and must be removed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_cases import assert_verdict, run_case

REPORTS = Path(__file__).resolve().parent / "fixtures" / "reports"
REPORT_DIRS = sorted(p for p in REPORTS.iterdir() if (p / "expected.json").is_file())

# case name -> why the current analysis gets it wrong (the line that should decide it)
KNOWN_GAPS: dict[str, str] = {}


def _params() -> list[Any]:
    out = []
    for case in REPORT_DIRS:
        marks = []
        if case.name in KNOWN_GAPS:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[case.name]))
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


@pytest.mark.parametrize("case", _params())
def test_report_verdict(case: Path) -> None:
    expected = json.loads((case / "expected.json").read_text())
    assert_verdict(run_case(case), expected)


def test_every_report_is_documented() -> None:
    assert 15 <= len(REPORT_DIRS) <= 25
    for case in REPORT_DIRS:
        assert (case / "SOURCE.md").read_text().count("https://") >= 1, case.name
        assert any(p.suffix in (".log", ".txt") for p in case.iterdir()), case.name
    assert set(KNOWN_GAPS) <= {p.name for p in REPORT_DIRS}
