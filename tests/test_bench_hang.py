"""bench/bench_hang.py counts as tokens only SSE chunks that carry generated text."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench() -> object:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_hang", BENCH / "bench_hang.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_hang"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_only_text_chunks_count() -> None:
    b = _bench()
    err = {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}}
    lines = [
        "data: " + json.dumps({"choices": [{"index": 0, "text": " the", "finish_reason": None}]}),
        "",
        "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "cat"}}]}),
        "data: " + json.dumps(err),
        "data: [DONE]",
        "data: {not json",
    ]
    assert [b.is_token_chunk(x) for x in lines] == [True, False, False, True, False, False, False]  # type: ignore[attr-defined]


def test_implausible_figures_raise() -> None:
    b = _bench()
    b.check_plausible(0.98, 3.0, 0.01)  # type: ignore[attr-defined]
    for ours, theirs in ((-0.2, 3.0), (0.98, -1.0), (0.1, 3.0), (0.98, 30.0)):
        with pytest.raises(RuntimeError):
            b.check_plausible(ours, theirs, 0.01)  # type: ignore[attr-defined]
