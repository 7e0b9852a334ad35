"""The timeline's times in one format (analysis/clock.py): the JSON keeps each stamp as the log
shows it in `time` and adds `normalized_time`; the one-screen report shows only the latter. Real
cases through a real `xpu-serve diagnose` subprocess."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests.test_cases import diagnose_text, run_case
from xpu_serve.analysis.clock import Clock
from xpu_serve.events import parse_line

CASES = Path(__file__).resolve().parent / "fixtures" / "cases"
WITH_YEAR = re.compile(r"2026-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{3})?")


def timeline_rows(*files: Path) -> list[str]:
    lines = diagnose_text(*files).splitlines()
    rows = lines[lines.index("TIMELINE:") + 1 :]
    return rows[: rows.index("")]


def test_vllm_and_oneccl_stamps_show_one_format_with_the_year() -> None:
    """qwen3-30b-worker0-died: vLLM's "03-26 04:15:27" (no year) and oneCCL's
    "2026:03:26-04:15:27" are one format, with the year the oneCCL lines give."""
    got = run_case(CASES / "qwen3-30b-worker0-died")
    pairs = {(t["time"], t["normalized_time"]) for t in got["timeline"]}
    assert ("03-26 04:15:27", "2026-03-26 04:15:27") in pairs
    assert ("2026:03:26-04:15:27", "2026-03-26 04:15:27") in pairs
    for t in got["timeline"]:
        assert (t["time"] is None) == (t["normalized_time"] is None), t
        assert t["normalized_time"] is None or WITH_YEAR.fullmatch(t["normalized_time"]), t
    for row in timeline_rows(CASES / "qwen3-30b-worker0-died" / "vllm.log"):
        when = row[4:27].strip()
        assert when == "-" or WITH_YEAR.fullmatch(when), row


def test_no_year_in_the_input_keeps_month_and_day() -> None:
    got = run_case(CASES / "glm47-flash-engine-hang")
    times = [t["normalized_time"] for t in got["timeline"] if t["time"] is not None]
    assert len(times) >= 10 and times[0] == "04-14 23:00:33", times
    assert all(re.fullmatch(r"04-14 \d\d:\d\d:\d\d", x) for x in times), times


def test_kernel_seconds_kept_and_marked_without_an_anchor() -> None:
    """qwen3-30b-libze-segfault: a raw dmesg (seconds since boot) beside vLLM's log: the kernel's
    clock cannot be converted, it is shown as kernel seconds; vLLM's lines get oneCCL's year."""
    got = run_case(CASES / "qwen3-30b-libze-segfault")
    root = next(t for t in got["timeline"] if t["role"] == "root")
    assert (root["time"], root["normalized_time"]) == ("551.424205", "551.424205 s after boot")
    rows = timeline_rows(*sorted((CASES / "qwen3-30b-libze-segfault").glob("*.[lt][ox][gt]")))
    assert rows[0].startswith(" >> 551.424205 s after boot  Worker_TP0 ")
    assert any(r.startswith("  +     2026-03-26 10:12:46  Worker_TP0     Worker proc VllmWorker-0") for r in rows), rows
    assert any(r.startswith("    552.836368 s after boot  kernel ") for r in rows), rows


def test_kernel_seconds_converted_when_a_record_has_both_clocks(tmp_path: Path) -> None:
    """The same case with one of its kernel records also pasted from the syslog ("Mar 26 10:12:47
    host kernel: [  552.836368] ..."): that pair anchors the kernel's clock, the segfault at
    551.424205 s is 1.412163 s before it."""
    case = tmp_path / "case"
    shutil.copytree(CASES / "qwen3-30b-libze-segfault", case)
    (case / "syslog.txt").write_text(
        "Mar 26 10:12:47 b60 kernel: [  552.836368] xe 0000:0e:00.0: [drm] Tile0: GT0: Engine reset: "
        "engine_class=bcs, logical_mask: 0x1, guc_id=54\n"
    )
    got = run_case(case)
    assert got["cause"] == "umd-segfault"
    root = next(t for t in got["timeline"] if t["role"] == "root")
    assert (root["time"], root["normalized_time"]) == ("551.424205", "2026-03-26 10:12:45.587")
    resets = {t["normalized_time"] for t in got["timeline"] if t["signature"] == "xe-engine-reset-copy"}
    assert "2026-03-26 10:12:48.165" in resets  # [554.001852]
    # the converted kernel records take their place among vLLM's lines by that time
    shown = [t["normalized_time"] for t in got["timeline"] if t["normalized_time"]]
    assert shown == sorted(shown) and "2026-03-26 10:12:54" in shown, shown


def test_year_across_new_year() -> None:
    """A vLLM December line in an input whose year comes from a January oneCCL line is of the year
    before."""
    clock = Clock()
    clock.see(parse_line("2027:01:01-00:00:03: 7987:[1] |CCL_ERROR| internal_kvs.cpp:94 kvs_remove_name_key: x"))
    dec = parse_line("(EngineCore pid=1) ERROR 12-31 23:59:58 [core.py:1] EngineCore encountered a fatal error.")
    jan = parse_line("(EngineCore pid=1) ERROR 01-01 00:00:04 [core.py:1] EngineCore encountered a fatal error.")
    assert (clock.show(dec), clock.show(jan)) == ("2026-12-31 23:59:58", "2027-01-01 00:00:04")
    assert Clock().show(dec) == "12-31 23:59:58"
    # an absurd kernel clock is kept as kernel seconds, never an error
    clock.see(parse_line("Mar 26 10:12:47 b60 kernel: [99999999999.000000] xe 0000:0e:00.0: reset"))
    huge = parse_line("[999999999999.000000] xe 0000:0e:00.0: [drm] Tile0: GT0: Engine reset: engine_class=bcs")
    assert clock.show(huge) == "999999999999.000000 s after boot"


def test_time_column_fits_the_widest_time() -> None:
    """A kernel uptime wider than a date ("19277.975559 s after boot") widens the time column for
    every row: the process column stays aligned."""
    case = Path(__file__).resolve().parent / "fixtures" / "reports" / "amdgpu-mmhub-page-fault-rocm-memory-access-fault"
    rows = timeline_rows(*sorted(case.glob("*.log")))
    assert rows[0].startswith(" >> 19277.975559 s after boot  kernel ")
    who = len(" >> 19277.975559 s after boot  ")  # where the process column starts on every row
    assert all(r[who - 2 : who] == "  " and r[who] != " " for r in rows), rows
    assert any(r[:who].strip() == "-" for r in rows)  # the unstamped line too


def test_undated_lines_keep_their_place() -> None:
    """qwen3-30b-worker0-died: the unprefixed, unstamped oneCCL lines ("write: error: ...",
    "terminate called ...") stay between the stamped lines they were printed among."""
    got = run_case(CASES / "qwen3-30b-worker0-died")
    after = [t for t in got["timeline"] if t["role"] not in ("root", "precursor", "progress")]
    undated = [t["line"] for t in after if t["time"] is None]
    assert undated and [t["line"] for t in after] == sorted(t["line"] for t in after), after
