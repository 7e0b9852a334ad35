"""One-line JSON log records (docker json-file, a runner's event stream, Loki/Elastic exports,
journalctl -o json) are unwrapped: the message field is parsed as its own line."""

from __future__ import annotations

import json

import pytest

from xpu_serve.diagnosis import Analyzer
from xpu_serve.events import parse_line

VLLM = "(EngineCore_DP0 pid=2674) ERROR 04-14 23:32:27 [core.py:938] RuntimeError: Native API failed. Native API returns: 20 (UR_RESULT_ERROR_DEVICE_LOST)"


@pytest.mark.parametrize(
    "obj",
    [
        {"log": VLLM + "\n", "stream": "stderr", "time": "2026-05-08T11:47:02.257Z"},
        {"event": "line", "data": VLLM},
        {"message": VLLM, "level": "error"},
        {"textPayload": VLLM + "\n"},
    ],
)
def test_json_line_message_is_parsed_as_a_vllm_line(obj: dict) -> None:  # type: ignore[type-arg]
    ev = parse_line(json.dumps(obj), "x.log", 3)
    assert (ev.source, ev.process, ev.pid, ev.level) == ("vllm", "EngineCore_DP0", 2674, "ERROR")
    assert ev.text.endswith("(UR_RESULT_ERROR_DEVICE_LOST)") and ev.line == 3


def test_json_line_takes_the_shipper_stamp_when_the_record_has_none() -> None:
    ev = parse_line(json.dumps({"log": "Traceback (most recent call last):\n", "time": "2026-05-08T11:47:02.257Z"}))
    assert ev.text == "Traceback (most recent call last):"
    assert ev.time is not None and (ev.time.hour, ev.time.minute) == (11, 47)


def test_journal_json_kernel_record_goes_to_the_kernel_parser() -> None:
    line = json.dumps({"MESSAGE": "xe 0000:03:00.0: [drm] *ERROR* GT0: Engine reset: engine_class=ccs", "_TRANSPORT": "kernel"})
    assert parse_line(line).source == "kernel"


@pytest.mark.parametrize("line", ['{"a": 1}', '{"log": 5}', '{"log": "x"', "{not json}"])
def test_other_braced_lines_stay_text(line: str) -> None:
    ev = parse_line(line)
    assert ev.source == "text" and ev.text == line


def test_multi_line_message_reads_its_last_line() -> None:
    # a traceback shipped as one object: its last line carries the exception (log_envelopes._json_line)
    ev = parse_line(json.dumps({"log": "Traceback (most recent call last):\nRuntimeError: CUDA error: boom\n"}))
    assert ev.text.endswith("RuntimeError: CUDA error: boom")


def test_verdict_from_a_docker_json_file_log() -> None:
    an = Analyzer()
    lines = [
        {"log": "(EngineCore_DP0 pid=2674) ERROR 04-14 23:32:27 [core.py:938] Traceback (most recent call last):\n"},
        {"log": VLLM + "\n"},
    ]
    for i, obj in enumerate(lines, 1):
        an.feed_line(json.dumps({**obj, "stream": "stderr", "time": "2026-05-08T11:47:02Z"}), "c.json.log", i)
    inc = an.incident()
    assert inc.cause == "device-lost" and inc.root is not None and inc.root.pid == 2674
