"""What `xpu-serve up` shows an operator on an incident: the compact report (verdict, root cause,
what followed, next step) in its output, and a bundle whose report.txt points into the bundle.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

# an evidence reference of report.txt: "  FILE:LINE: text", "  also FILE:LINE: text", "[FILE:LINE]"
REF = re.compile(r"(?:^\s+(?:also )?|\[)(?P<file>[^\s\[\]:]+):(?P<line>\d+)(?:\]|: (?P<text>.*))")
TIME = re.compile(r"^\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? ")


def test_up_prints_the_compact_report_and_report_txt_points_into_the_bundle(sim_up_factory: Any) -> None:
    up = sim_up_factory("worker-segv rank=0 after=50 incarnation=1")
    try:
        rep = up.wait_event("report", 60)
        bundle = Path(up.wait_event("incident", 5)["bundle"])
        up.wait_event("cleaned", 30)
    finally:
        assert up.stop() == 0
    lines = rep["lines"]
    assert 4 <= len(lines) <= 20, lines
    assert lines[0].startswith("VERDICT: process-crash — Worker_TP0 (rank 0, pid ")
    assert any(ln.startswith("ROOT CAUSE: ") for ln in lines), lines
    assert "WHAT FOLLOWED (consequences, not causes):" in lines
    assert any(ln.startswith("NEXT: ") for ln in lines), lines
    out = (up.tmp / "up.out").read_text()
    assert f"report: incarnation 1; full report {bundle}/report.txt" in out
    assert "\n  " + lines[0] + "\n" in out  # the block itself, not only the event file

    text = (bundle / "report.txt").read_text()
    assert str(up.runtime / "logs") not in text
    refs = [m for ln in text.splitlines() if (m := REF.search(ln))]
    assert len(refs) >= 5, text
    for m in refs:
        f = bundle / m["file"]
        assert f.resolve().is_relative_to(bundle.resolve()) and f.is_file(), m[0]
        src = f.read_text(errors="replace").splitlines()
        n = int(m["line"])
        assert 1 <= n <= len(src), m[0]
        quoted = m["text"]
        if quoted:
            quoted = TIME.sub("", quoted.rstrip(" …").rstrip("…")).strip()
            assert " ".join(quoted.split()) in " ".join(src[n - 1].split()), (m[0], src[n - 1])
