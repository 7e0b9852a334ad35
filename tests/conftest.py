"""Shared fixtures for the test suite."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture
def xpu_serve_cmd() -> list[str]:
    """argv prefix that runs the installed CLI in a real subprocess."""
    return [sys.executable, "-m", "xpu_serve"]
