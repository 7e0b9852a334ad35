"""Real public failure reports in tests/fixtures/reports/ give their expected verdict through a real
`xpu-serve diagnose --json` subprocess (all files of a case passed together, as the cases README says).

Each case folder holds the log lines as posted (personal paths/hosts replaced), `expected.json` (same
keys as tests/fixtures/cases) and `SOURCE.md` (thread URL and why the expected cause is right per the
cause table). Cases the analysis does not yet get right are marked xfail(strict=True) with the reason,
so the suite stays green and a fix is noticed (the xfail then fails and must be removed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_cases import CASE_DIRS, assert_verdict, run_case
from xpu_serve.diagnosis import diagnose_files

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
    assert len(REPORT_DIRS) >= 40
    for case in REPORT_DIRS:
        assert (case / "SOURCE.md").read_text().count("https://") >= 1, case.name
        assert any(p.suffix in (".log", ".txt") for p in case.iterdir()), case.name
    assert set(KNOWN_GAPS) <= {p.name for p in REPORT_DIRS}


# How the same log reaches us in other hands: each transform rewrites every file of a case the way a
# paste, a terminal or a log shipper does. The verdict must not change.
_PREFIX_AT_START = re.compile(r"^(\([^)]*pid=\d+[^)]*\))")


def _lines(f: Callable[[str], str]) -> Callable[[str], str]:
    return lambda t: "\n".join(f(x) if x else x for x in t.split("\n"))


SHAPES: dict[str, Callable[[str], str]] = {
    # Windows line ends (a log copied through a Windows editor or a CRLF terminal capture)
    "crlf": lambda t: t.replace("\n", "\r\n"),
    # GitHub quote marks around every line (a log quoted in a reply)
    "quoted": lambda t: "\n".join("> " + x if x else ">" for x in t.split("\n")),
    # a markdown fence with a language tag around the whole log
    "fenced": lambda t: "```text\n" + t.rstrip("\n") + "\n```\n",
    # ANSI colours around vLLM's process prefix (Ray and docker compose on a TTY)
    "ansi": _lines(lambda x: _PREFIX_AT_START.sub("\x1b[1;36m\\1\x1b[0m", x)),
    # the capture ends in the middle of a line
    "truncated-tail": lambda t: t.rstrip("\n") + "\n(APIServer pid=1) INFO 01-0",
    # `docker logs -t` stamps / `docker compose logs` service prefixes (only on logs without a wrapper)
    "docker-t": _lines(lambda x: "2026-04-16T12:49:28.263781156Z " + x),
    "compose": _lines(lambda x: "vllm-1  | " + x),
}
_WRAPPED = re.compile(r"^(?:\s*\d{4}-\d\d-\d\dT|[\w.-]+\s+\| )", re.M)


def _shape_params() -> list[Any]:
    out = []
    for case in [*CASE_DIRS, *REPORT_DIRS]:
        if case.name in KNOWN_GAPS:
            continue
        for shape in SHAPES:
            out.append(pytest.param(case, shape, id=f"{case.parent.name}/{case.name}-{shape}"))
    return out


@pytest.mark.parametrize(("case", "shape"), _shape_params())
def test_verdict_survives_log_shape(case: Path, shape: str, tmp_path: Path) -> None:
    files = sorted(p for p in case.iterdir() if p.suffix in (".log", ".txt"))
    texts = [p.read_bytes().decode("utf-8", "replace") for p in files]
    if shape in ("docker-t", "compose") and any(_WRAPPED.search(t) for t in texts):
        pytest.skip("the log already carries a docker/compose/ISO wrapper")
    paths = []
    for p, t in zip(files, texts, strict=True):
        q = tmp_path / p.name
        q.write_bytes(SHAPES[shape](t).encode())
        paths.append(q)
    got = diagnose_files(paths).to_contract()
    assert_verdict(got, json.loads((case / "expected.json").read_text()))


def _verdict_of(tmp_path: Path, text: str) -> dict[str, Any]:
    p = tmp_path / "input.log"
    p.write_text(text)
    return diagnose_files([p]).to_contract()


def test_engine_start_waits_are_a_stall_only_without_ready(tmp_path: Path) -> None:
    waits = "".join(
        f"(APIServer pid=1) INFO 05-16 13:12:{s:02d} [utils.py:741] Waiting for 1 local, 0 remote core engine proc(s) "
        "to start.\n"
        for s in (10, 20, 30)
    )
    got = _verdict_of(tmp_path, waits)
    assert got["cause"] == "startup-hang"
    assert got["root"]["line"] == 3 and got["hang"]["detected_at"] == "05-16 13:12:30"
    # the same waits in a start that then became ready: nothing failed
    ready = waits + '(APIServer pid=1) INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 200 OK\n'
    assert _verdict_of(tmp_path, ready)["cause"] == "unknown"
    # one wait line alone is an ordinary start-up
    assert _verdict_of(tmp_path, waits.split("\n")[0] + "\n")["cause"] == "unknown"


def test_exception_from_argument_or_config_checks_is_config_error(tmp_path: Path) -> None:
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/usr/local/bin/vllm", line 8, in <module>\n'
        "    sys.exit(main())\n"
        '  File "/usr/lib/python3.12/site-packages/vllm/engine/arg_utils.py", line 1020, in create_engine_config\n'
        "    raise ValueError(msg)\n"
        "ValueError: Chunked prefill and prefix caching cannot be combined here\n"
    )
    got = _verdict_of(tmp_path, tb)
    assert (got["cause"], got["root"]["line"]) == ("config-error", 6)
    # the same exception raised from model code is an ordinary exception
    model = tb.replace("vllm/engine/arg_utils.py", "vllm/model_executor/models/llama.py").replace(
        "create_engine_config", "forward"
    )
    assert _verdict_of(tmp_path, model)["cause"] == "process-exception"
