"""`xpu-serve diagnose` on real vLLM logs kept from the real-vLLM runs (fast: no vLLM needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "realvllm"


@pytest.mark.parametrize("case", sorted(p.name for p in CASES.iterdir() if (p / "expected.json").is_file()))
def test_diagnose_real_vllm_log(case: str, xpu_serve_cmd: list[str]) -> None:
    folder = CASES / case
    want = json.loads((folder / "expected.json").read_text())
    out = subprocess.run(
        [*xpu_serve_cmd, "diagnose", "--json", *sorted(str(p) for p in folder.glob("*.log"))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["cause"] == want["cause"], got["summary"]
    if "root_process" in want:
        assert got["root"]["process"] == want["root_process"], got["root"]
    if "hang_last_progress" in want:
        assert got["hang"]["last_progress"] == want["hang_last_progress"], got["hang"]
