"""node-problem-detector integration: every generated pattern checked with RE2 (the engine family
of Go's regexp, which NPD uses) against the rows' real example lines, NPD's buffer matching
(pattern + `\\z` over the last messages joined by newlines, pkg/systemlogmonitor/log_buffer.go),
and the real `xpu-serve npd` CLI on real kernel logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import re2

from tests.helpers import kmsg_readable, kmsg_write_opted_in
from xpu_serve.events import parse_kernel_record
from xpu_serve.integrations import npd
from xpu_serve.signatures import load_table
from xpu_serve.sources import kernel as k

FIXTURES = Path(__file__).parent / "fixtures"
WEDGED_LOG = FIXTURES / "reports/xe-wedged-guc-engine-reset-failed-cachyos/dmesg.txt"
UMD_SEGV_LOG = FIXTURES / "cases/qwen3-30b-libze-segfault/dmesg.txt"
CLI = [sys.executable, "-m", "xpu_serve"]

RULES = npd.rules()
TABLE = load_table()
CONDITION = {r.row.id: r.condition for r in RULES}


def message(example: str) -> str:
    """The kernel message NPD sees for an example line: the text after the kmsg header, trimmed
    (NPD's kmsg watcher). `parse_kernel_record` strips the dmesg/journal/kmsg prefixes."""
    ev = parse_kernel_record(example)
    assert ev is not None
    return ev.text.strip()


def npd_match(pattern: str, buffer: str) -> re2._Match | None:
    """NPD's Match: `pattern + \\z` searched in the joined buffer (regexp FindStringIndex)."""
    return re2.compile(pattern + r"\z").search(buffer)


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


# ---- the generated patterns -----------------------------------------------------------------


def test_rules_cover_the_gpu_kernel_rows_with_conditions_from_data() -> None:
    ids = {r.row.id for r in RULES}
    assert {"gpu-wedged", "xe-engine-reset-compute", "xe-guc-init-failure", "nvidia-fallen-off-bus"} <= ids
    # rows of other sources, consequences and host problems are not NPD GPU rules
    assert not ids & {"device-lost", "kernel-segfault", "kernel-oom-killed", "amdgpu-gpu-reset-succeeded"}
    assert CONDITION["gpu-wedged"] == "XPUDeviceWedged"
    assert CONDITION["xe-guc-init-failure"] == "XPUFirmwareLoadFailed"
    assert CONDITION["xe-engine-reset-compute"] is None and CONDITION["xe-guc-failure"] is None
    reasons = {r.row.id: r.reason for r in RULES}
    assert reasons["xe-guc-init-failure"] == "XeGuCInitFailure" and reasons["gpu-page-fault"] == "GPUPageFault"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.row.id)
def test_pattern_is_re2_and_matches_its_real_example(rule: npd.Rule) -> None:
    compiled = re2.compile(rule.pattern)  # NPD compiles the pattern alone first
    assert compiled is not None
    msg = message(rule.row.example)
    m = npd_match(rule.pattern, msg)
    assert m is not None, f"{rule.row.id}: {rule.pattern!r} does not match {msg!r}"
    assert m.end() == len(msg)
    # the same line with an unrelated older line before it: the match lies in the newest message
    older = message(TABLE.by_id["kernel-oom-killed"].example)
    buf = f"{older}\n{msg}"
    m = npd_match(rule.pattern, buf)
    assert m is not None and m.start() > len(older), f"{rule.row.id} reaches into the older line"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.row.id)
def test_pattern_does_not_match_examples_of_rows_with_another_condition(rule: npd.Rule) -> None:
    """Every kernel row's real example (a GPU row with another condition, or a host row that is no
    NPD rule) is not matched, except where the table declares the overlap (`overlaps`): the table
    classifies first-match, NPD reports every rule that matches."""
    for other in TABLE.rows:
        if other.id == rule.row.id or "kernel" not in other.sources:
            continue
        if other.id in CONDITION and CONDITION[other.id] == rule.condition:
            continue
        if rule.row.id in other.overlaps:
            continue
        msg = message(other.example)
        assert npd_match(rule.pattern, msg) is None, f"{rule.row.id} matches the example of {other.id}: {msg!r}"


def test_declared_overlaps_fire_every_rule_in_npd() -> None:
    """Xid 79 ("fallen off the bus") is a device-class Xid: NPD sets both conditions for it."""
    msg = message(TABLE.by_id["nvidia-xid-device"].example)
    fired = {r.condition or r.reason for r in RULES if npd_match(r.pattern, msg)}
    assert fired == {"XPUDeviceWedged", "XPUDeviceLost", "NVIDIAXid"}


def test_a_line_does_not_match_again_once_newer_lines_follow() -> None:
    """NPD appends `\\z` to the pattern: a top-level alternation would bind it to its last branch
    only, and the first branches would fire again on every later line. The group prevents that."""
    guc = next(r for r in RULES if r.row.id == "xe-guc-failure")
    assert "|" in guc.row.pattern.pattern
    buf = message(guc.row.example) + "\nxe 0000:47:00.0: Using 46-bit DMA addresses"
    assert npd_match(guc.row.pattern.pattern, buf) is not None  # the table's pattern as is: fires again
    for rule in RULES:
        assert npd_match(rule.pattern, message(rule.row.example) + "\nxe 0000:47:00.0: Using 46-bit DMA addresses") is None


def test_python_only_syntax_is_rewritten_from_data() -> None:
    ras = TABLE.by_id["amdgpu-ras-uncorrectable"]
    with pytest.raises(re2.error):
        re2.compile(ras.pattern.pattern)  # a look-behind: Python only
    override = npd.npd_data()["re2_patterns"]["amdgpu-ras-uncorrectable"]
    rule = next(r for r in RULES if r.row.id == ras.id)
    for line in override["rejects"]:
        assert ras.pattern.search(line) is None
        assert npd_match(rule.pattern, line) is None
    assert npd_match(rule.pattern, message(ras.example)) is not None
    # a count at the start of the newest message, with older lines in the buffer
    assert npd_match(rule.pattern, "older line\n12 uncorrectable hardware errors detected in umc block") is not None


def test_single_line_confines_newline_matching_constructs() -> None:
    assert npd.single_line(r"\S[^\[\]]*\s\W\D[^]x]") == r"\S[^\n\[\]]*[^\S\n][^\w\n][^\d\n][^\n\]x]"
    assert npd.single_line(r"[\w-]+\.so") == r"[\w-]+\.so"
    with pytest.raises(npd.NPDError):
        npd.single_line(r"[\s,]")
    with pytest.raises(npd.NPDError):
        npd.single_line(r"(?s)a.b")


# ---- the CLI --------------------------------------------------------------------------------


def test_kernel_monitor_cli_writes_the_config(tmp_path: Path) -> None:
    out = tmp_path / "kernel-monitor.json"
    r = run_cli("npd", "kernel-monitor", "-o", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    stdout = run_cli("npd", "kernel-monitor")
    assert stdout.returncode == 0 and json.loads(stdout.stdout) == doc
    assert (doc["plugin"], doc["logPath"], doc["bufferSize"]) == ("kmsg", "/dev/kmsg", 10)
    types = [c["type"] for c in doc["conditions"]]
    assert types == ["XPUDeviceWedged", "XPUDeviceLost", "XPUFirmwareLoadFailed"]
    assert len(doc["rules"]) == len(RULES)
    for rule in doc["rules"]:
        assert rule["type"] in ("temporary", "permanent")
        assert (rule["type"] == "permanent") == ("condition" in rule)
        assert rule.get("condition", types[0]) in types
        re2.compile(rule["pattern"])
    assert {r["condition"] for r in doc["rules"] if r["type"] == "permanent"} == set(types)


def test_npd_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = run_cli("npd", "kernel-monitor", "-o", str(tmp_path / "no-dir" / "x.json"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "no-dir" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("npd", "custom-plugin-config", "--interval", "soon")
    assert r.returncode == 2 and "--interval" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("npd")
    assert r.returncode == 2


def test_custom_plugin_config_runs_the_check_as_npd_would(tmp_path: Path) -> None:
    r = run_cli("npd", "custom-plugin-config", "--path", str(WEDGED_LOG), "--interval", "2m")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["plugin"] == "custom" and doc["pluginConfig"]["max_output_length"] == 80
    assert doc["pluginConfig"]["invoke_interval"] == "2m"
    (rule,) = doc["rules"]
    assert rule["type"] == "permanent" and rule["condition"] == doc["conditions"][0]["type"]
    assert rule["args"][:2] == ["npd", "check"] and "--window" in rule["args"]
    assert os.path.isabs(rule["path"])
    # run it the way NPD's plugin runner does: path + args, exit status and trimmed stdout
    run = subprocess.run([rule["path"], *rule["args"]], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.strip().startswith("XPUDeviceWedged 0000:00:02.0")


def _check(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    r = run_cli("npd", "check", *args, env=env)
    assert "Traceback" not in r.stderr
    out = r.stdout.strip()
    assert out.count("\n") == 0 and 0 < len(out.encode()) <= 80, out
    return r.returncode, out


def test_check_on_real_kernel_logs(tmp_path: Path) -> None:
    assert _check("--path", str(WEDGED_LOG)) == (
        1,
        "XPUDeviceWedged 0000:00:02.0 (5 GPU records since boot): GPU wedged",
    )
    code, out = _check("--path", str(UMD_SEGV_LOG))
    assert code == 1 and out.startswith("KernelSegfaultUMD VLLM::Worker_TP (5 GPU records since boot)")
    clean = tmp_path / "dmesg.txt"
    clean.write_text("".join(UMD_SEGV_LOG.read_text().splitlines(keepends=True)[:4]))  # the probe lines
    assert _check("--path", str(clean)) == (0, "no GPU fault in 4 kernel records since boot")


def test_check_unreadable_source_is_unknown(tmp_path: Path) -> None:
    code, out = _check("--path", str(tmp_path / "missing.log"))
    assert code == 2 and out.startswith("kernel log unreadable: ") and "missing.log" in out
    code, out = _check("--source", "file", "--path", str(tmp_path))
    assert code == 2 and out.startswith("kernel log unreadable: not a regular file: ")
    r = run_cli("npd", "check", "--source", "file")
    assert r.returncode == 2 and "--path" in r.stderr
    r = run_cli("npd", "check", "--source", "kmsg", "--path", str(WEDGED_LOG))
    assert r.returncode == 2 and "--path needs --source file" in r.stderr
    # a source whose command is not there: journalctl and dmesg not on PATH
    no_path = {**os.environ, "PATH": str(tmp_path)}
    for kind in ("journalctl", "dmesg"):
        code, out = _check("--source", kind, env=no_path)
        assert (code, out) == (2, f"kernel log unreadable: no kernel log source: {kind} not found")


@pytest.mark.parametrize("kind", ["journalctl", "dmesg"])
def test_check_reads_the_real_journal_and_dmesg_once(kind: str) -> None:
    argv = ["journalctl", "-k", "-n", "1", "-o", "json", "-q", "--no-pager"] if kind == "journalctl" else ["dmesg", "--raw"]
    ok, why = k._probe(argv)
    if not ok:
        pytest.skip(why)
    start = time.monotonic()
    code, out = _check("--source", kind)
    assert code in (0, 1), out
    assert "records since boot" in out
    assert time.monotonic() - start < 30  # it reads once: a follow would never return


def test_check_window_counts_old_events_out_but_keeps_conditions(tmp_path: Path) -> None:
    up = k.uptime_s()
    if up < 300:
        pytest.skip("needs a host up for more than 5 minutes")
    reset = message(TABLE.by_id["xe-engine-reset-compute"].example)
    wedge = message(TABLE.by_id["gpu-wedged"].example)
    old, new = int((up - 200) * 1e6), int((up - 1) * 1e6)
    log = tmp_path / "kmsg.txt"
    log.write_text(f"6,1,{old},-;{reset}\n")
    assert _check("--path", str(log))[0] == 1
    assert _check("--path", str(log), "--window", "60") == (
        0,
        "no GPU fault in 1 kernel records since boot, events 60 s",
    )
    log.write_text(f"6,1,{old},-;{reset}\n6,2,{new},-;{reset}\n")
    code, out = _check("--path", str(log), "--window", "60")
    assert code == 1 and out.startswith("XeEngineResetCompute 0000:3d:00.0 (1 GPU records")
    log.write_text(f"3,1,{old},-;{wedge}\n")
    code, out = _check("--path", str(log), "--window", "60")
    assert code == 1 and out.startswith("XPUDeviceWedged 0000:03:00.0")


@pytest.mark.skipif(not kmsg_readable(), reason="/dev/kmsg not readable here")
def test_check_reads_the_real_kmsg() -> None:
    code, out = _check("--source", "kmsg")
    assert code in (0, 1), out  # this host's own kernel log: readable, fault or not
    assert "kernel records since boot" in out or "GPU records since boot" in out


@pytest.mark.kmsg
@pytest.mark.skipif(not kmsg_write_opted_in(), reason="writes to /dev/kmsg: opt-in with XPU_SERVE_TEST_KMSG=1 as root")
def test_check_sees_a_gpu_record_written_to_kmsg() -> None:
    marker = f"xpu-serve-test {uuid.uuid4().hex}"
    src = k.KmsgSource(since_wall=0.0)
    try:
        src.snapshot()
        before = src.last_seq or 0
        fd = os.open(k.KMSG_PATH, os.O_WRONLY)
        try:  # an engine reset (temporary): a --window check forgets it again
            os.write(fd, f"<4>xe 0000:99:00.0: [drm] Tile0: GT0: Engine reset: engine_class=ccs, {marker}\n".encode())
        finally:
            os.close(fd)
        time.sleep(0.1)
        mine = [r for r in src.snapshot() if r.seq is not None and r.seq > before and marker in r.message]
    finally:
        src.close()
    assert len(mine) == 1
    status, out = npd.verdict(mine, window_s=30)
    assert status == npd.PROBLEM and out.startswith("XeEngineResetCompute 0000:99:00.0 (1 GPU records")
    code, _ = _check("--source", "kmsg", "--window", "30")
    assert code == 1


def test_check_is_unknown_at_once_for_what_is_no_kernel_log_file(tmp_path: Path) -> None:
    """A FIFO nobody writes (it blocked for ever), /dev/zero and a 2 GiB sparse file (both read
    as a clean log, the second after 25 s and 2 GB of memory): Unknown, one line, in seconds."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sparse = tmp_path / "sparse.log"
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)
    for path, why in ((fifo, "not a regular file"), (Path("/dev/zero"), "not a regular file"),
                      (sparse, "larger than 16 MiB")):
        t0 = time.monotonic()
        code, out = _check("--path", str(path))
        assert code == 2 and out.startswith(f"kernel log unreadable: {why}: ") and path.name in out, out
        assert time.monotonic() - t0 < 15  # NPD's plugin timeout


def test_check_reads_the_last_line_without_newline_and_cuts_long_lines(tmp_path: Path) -> None:
    wedged = WEDGED_LOG.read_text().splitlines()
    line = next(x for x in wedged if "wedged" in x)
    log = tmp_path / "kern.log"
    log.write_bytes(b"[    1.000000] " + b"\\x" * (3 << 20) + b"\n" + b"\xff\x00 junk\n" + line.encode())  # no final newline
    t0 = time.monotonic()
    code, out = _check("--path", str(log))
    assert code == 1 and out.startswith("XPUDeviceWedged 0000:00:02.0 (1 GPU records since boot)"), out
    assert time.monotonic() - t0 < 15


def test_config_output_through_a_symlink_a_fifo_and_a_full_disk(tmp_path: Path) -> None:
    target = tmp_path / "target.json"
    target.write_text("{}")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert run_cli("npd", "kernel-monitor", "-o", str(link)).returncode == 0
    assert link.is_symlink() and json.loads(target.read_text())["plugin"] == "kmsg"
    assert target.stat().st_mode & 0o777 == 0o640
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run_cli("npd", "kernel-monitor", "-o", str(fifo), timeout=20)  # nobody reads it: no hang
    assert r.returncode == 2 and r.stderr.startswith(f"xpu-serve npd kernel-monitor: cannot write {fifo}: ")
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a tmpfs mount (root)")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(small)], check=True, timeout=30)
    try:
        old = small / "kernel-monitor.json"
        old.write_text('{"old": "config"}\n')
        with open(small / "fill", "wb") as f:
            with pytest.raises(OSError):
                f.write(b"x" * (64 << 10))
                f.flush()
        r = run_cli("npd", "kernel-monitor", "-o", str(old))
        assert r.returncode == 2 and "No space left on device" in r.stderr
        assert old.read_text() == '{"old": "config"}\n'  # the config NPD reads is still whole
        assert sorted(p.name for p in small.iterdir()) == ["fill", "kernel-monitor.json"]
    finally:
        subprocess.run(["umount", str(small)], check=True, timeout=30)


def test_custom_plugin_window_reads_back_as_the_same_number() -> None:
    r = run_cli("npd", "custom-plugin-config", "--window", "1234567")
    assert r.returncode == 0, r.stderr
    args = json.loads(r.stdout)["rules"][0]["args"]
    assert float(args[args.index("--window") + 1]) == 1234567.0  # `%g` made it 1.23457e+06


def test_custom_plugin_config_makes_relative_paths_absolute(tmp_path: Path) -> None:
    r = subprocess.run([*CLI, "npd", "custom-plugin-config", "--path", "kern.log", "--exec", "bin/xpu-serve"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (rule,) = json.loads(r.stdout)["rules"]
    assert rule["path"] == str(tmp_path / "bin/xpu-serve")  # NPD's working directory is its own
    assert rule["args"][rule["args"].index("--path") + 1] == str(tmp_path / "kern.log")


def test_an_empty_path_is_bad_arguments_not_the_default_source() -> None:
    for cmd in ("check", "custom-plugin-config"):
        r = run_cli("npd", cmd, "--path", "")  # `--path "$UNSET"`: it read /dev/kmsg, or named the cwd
        assert r.returncode == 2 and "--path: must not be empty" in r.stderr and r.stdout == "", r
