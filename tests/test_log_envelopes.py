"""Kernel records behind syslog relays, the journal and log shippers, and the kernel GPU vocabulary
of amdgpu and NVIDIA (the Xid catalogue): each envelope's shape is taken from its specification
(RFC 3164, RFC 5424, systemd's journal export and JSON formats, Google Cloud LogEntry, docker's
json-file driver, util-linux dmesg --decode)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from xpu_serve.diagnosis import Analyzer
from xpu_serve.events import parse_line
from xpu_serve.signatures import code_table, load_table

TABLE = load_table()
# one real record of each vocabulary, as dmesg prints it (the message after the envelope)
XE = "xe 0000:03:00.0: [drm] Tile0: GT0: Timedout job: seqno=1523, lrc_seqno=1523, guc_id=9, flags=0x20 in python [2693]"
AMD = "amdgpu 0000:3d:00.0: amdgpu: [mmhub0] no-retry page fault (src_id:0 ring:160 vmid:3 pasid:32790)"
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4231, name=python3, GPU has fallen off the bus."


def sig_of(line: str) -> tuple[str, str | None]:
    ev = parse_line(line, "t", 1)
    got = TABLE.match(ev)
    return ev.source, got[0].id if got else None


@pytest.mark.parametrize(
    "line, row, level",
    [
        # RFC 3164 section 4.1: "<PRI>TIMESTAMP HOSTNAME TAG: MSG", PRI = facility*8 + severity (kern.err = 3)
        (f"<3>Jan  2 03:04:05 gpu01 kernel: {AMD}", "amdgpu-vm-page-fault", "ERR"),
        (f"<3>Jan  2 03:04:05 gpu01 kernel: [ 4512.000001] {XE}", "xe-job-timeout", "ERR"),
        # rsyslog's RFC 3339 stamp in an RFC 3164 frame (template RSYSLOG_ForwardFormat)
        (f"<4>2026-01-02T03:04:05.123456+00:00 gpu01 kernel: {XID79}", "nvidia-xid-device", "WARNING"),
        # RFC 5424 section 6: "<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID SD MSG", NILVALUE "-"
        (f"<3>1 2026-01-02T03:04:05.123Z gpu01 kernel - - - {AMD}", "amdgpu-vm-page-fault", "ERR"),
        (f'<3>1 2026-01-02T03:04:05.123Z gpu01 kernel - - [meta sequenceId="7"] {XID79}', "nvidia-xid-device", "ERR"),
        (f"<3>1 2026-01-02T03:04:05.123Z gpu01 kernel - - - \ufeff[ 12.345678] {XE}", "xe-job-timeout", "ERR"),
    ],
)
def test_syslog_relay_frames(line: str, row: str, level: str) -> None:
    ev = parse_line(line, "t", 1)
    assert ev.source == "kernel", ev
    assert ev.level == level
    assert sig_of(line) == ("kernel", row)


def test_rfc5424_frame_of_a_program_is_read_as_that_programs_line() -> None:
    ev = parse_line(
        "<14>1 2026-01-02T03:04:05.123Z gpu01 vllm 4242 - - (EngineCore_DP0 pid=4242) ERROR 01-02 03:04:05 "
        "[core.py:1] RuntimeError: boom",
        "t",
        1,
    )
    assert (ev.source, ev.process, ev.pid, ev.level, ev.text) == ("vllm", "EngineCore_DP0", 4242, "ERROR", "RuntimeError: boom")


@pytest.mark.parametrize(
    "line",
    [
        # appliance syslog templates: ISO stamp, host, facility.level, tag (Synology, Unraid, TrueNAS)
        f"2026-01-02T03:04:05+00:00 tower kern.err kernel: [ 123.456789] {AMD}",
        f"2026-01-02T03:04:05+00:00 tower kern warning kernel: {AMD}",
        f"Jan  2 03:04:05 tower kern.err kernel: {AMD}",
        # journalctl -o short-precise / short-iso-precise / short-monotonic
        f"Jan 02 03:04:05.123456 gpu01 kernel: {AMD}",
        f"2026-01-02T03:04:05.123456+00:00 gpu01 kernel: {AMD}",
        f"[ 4512.123456] gpu01 kernel: {AMD}",
        # util-linux dmesg --decode (-x), plain and with --time-format iso
        f"kern  :err   : [ 4512.123456] {AMD}",
        f"kern  :err   : 2026-01-02T03:04:05,123456+00:00 {AMD}",
        # journalctl -o export: one FIELD=value per line
        f"MESSAGE={AMD}",
        # a relay's own template: anchors after an unknown prefix
        f"node7 | [ 4512.123456] {AMD}",
        f"gpu01 2026/01/02 03:04:05 kern.err {AMD}",
        f"2026/01/02 03:04:05 gpu01 [kern] kernel: {AMD}",
    ],
)
def test_kernel_record_after_any_prefix(line: str) -> None:
    ev = parse_line(line, "t", 1)
    assert ev.source == "kernel", (line, ev.source, ev.text)
    assert ev.text == AMD
    assert sig_of(line)[1] == "amdgpu-vm-page-fault"


@pytest.mark.parametrize(
    "obj, t",
    [
        # journalctl -o json (systemd JOURNAL_EXPORT_FORMATS: __REALTIME_TIMESTAMP in µs)
        ({"_TRANSPORT": "kernel", "PRIORITY": "3", "SYSLOG_IDENTIFIER": "kernel", "MESSAGE": AMD,
          "__REALTIME_TIMESTAMP": "1767323045123456"}, datetime(2026, 1, 2, 3, 4, 5, 123456)),
        # journald: a message that is not UTF-8 is an array of byte values
        ({"_TRANSPORT": "kernel", "MESSAGE": list(AMD.encode()), "__REALTIME_TIMESTAMP": "1767323045123456"},
         datetime(2026, 1, 2, 3, 4, 5, 123456)),
        # docker json-file / fluent-bit tail of a dmesg file: {"log": "...\n", "stream", "time"}
        ({"log": f"[ 4512.123456] {AMD}\n", "stream": "stdout", "time": "2026-01-02T03:04:05.5Z"},
         datetime(2026, 1, 2, 3, 4, 5, 500000)),
        # Google Cloud LogEntry: textPayload / jsonPayload.message, RFC 3339 timestamp
        ({"textPayload": f"Jan  2 03:04:05 node kernel: {AMD}", "timestamp": "2026-01-02T03:04:05Z",
          "severity": "ERROR", "logName": "projects/p/logs/syslog"}, datetime(1900, 1, 2, 3, 4, 5)),
        ({"jsonPayload": {"message": AMD, "_TRANSPORT": "kernel"}, "timestamp": "2026-01-02T03:04:05Z"},
         datetime(2026, 1, 2, 3, 4, 5)),
        # Vector / CloudWatch Logs: "message", epoch milliseconds
        ({"message": AMD, "SYSLOG_IDENTIFIER": "kernel", "timestamp": 1767323045123, "source_type": "journald"},
         datetime(2026, 1, 2, 3, 4, 5, 123000)),
        # Kubernetes node logs shipped with the journal's own field names
        ({"kubernetes": {"host": "n1"}, "MESSAGE": f"[ 4512.123456] {AMD}", "@timestamp": "2026-01-02T03:04:05Z"},
         datetime(2026, 1, 2, 3, 4, 5)),
    ],
)
def test_json_shippers(obj: dict[str, object], t: datetime) -> None:
    line = json.dumps(obj)
    ev = parse_line(line, "t", 1)
    assert (ev.source, ev.text) == ("kernel", AMD)
    assert ev.time == t
    assert TABLE.match(ev)[0].id == "amdgpu-vm-page-fault"  # type: ignore[index]


@pytest.mark.parametrize(
    "line",
    [
        # a user-space program that quotes a kernel record is not the kernel
        f"2026-01-02 03:04:05 ERROR watcher: saw {AMD}",
        f"(EngineCore_DP0 pid=1) ERROR 01-02 03:04:05 [core.py:1] dmesg: {AMD}",
        f"RuntimeError: 12:00:01 gpu01 {AMD}",
        "12:00:01 compiling kernel: attention_fwd",
        json.dumps({"message": "INFO 01-02 03:04:05 [api_server.py:1] kernel: warmup done", "level": "info"}),
        "<html> [ 4512.123456] not a log",
    ],
)
def test_user_space_lines_are_not_kernel_records(line: str) -> None:
    assert parse_line(line, "t", 1).source != "kernel"


def test_xid_table_classes_follow_nvidias_catalogue() -> None:
    xids = code_table("nvidia_xid")
    got = {n: xids[n]["class"] for n in (13, 31, 43, 45, 48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 154)}
    assert got == {
        13: "application", 31: "application", 43: "application", 45: "consequence", 48: "device",
        62: "device", 63: "info", 64: "device", 74: "device", 79: "device", 92: "info", 94: "device",
        95: "device", 119: "device", 120: "device", 154: "consequence",
    }
    assert all(v.get("name") and v.get("resolution") for v in xids.values())


@pytest.mark.parametrize(
    "xid, row, role",
    [
        (79, "nvidia-xid-device", "root"),
        (48, "nvidia-xid-device", "root"),
        (119, "nvidia-xid-device", "root"),
        (31, "nvidia-xid-application", "root"),
        (13, "nvidia-xid-application", "root"),
        (43, "nvidia-xid-application", "root"),
        (45, "nvidia-xid-consequence", "consequence"),
        (63, "nvidia-xid-info", "context"),
        (250, "nvidia-xid", "root"),
    ],
)
def test_xid_rows_by_number(xid: int, row: str, role: str) -> None:
    ev = parse_line(f"[ 812.345678] NVRM: Xid (PCI:0000:3b:00): {xid}, pid=4242, name=python3, Ch 00000008", "t", 1)
    sig = TABLE.match(ev)
    assert sig is not None and (sig[0].id, sig[0].role) == (row, role)
    assert sig[1].group("xid") == str(xid)
    # no shorter code matches inside a longer one (Xid 4 within 45, 1 within 119)
    assert TABLE.match(parse_line(f"NVRM: Xid (PCI:0000:3b:00): {xid}0{xid}, pid=1", "t", 1))[0].id == "nvidia-xid"  # type: ignore[index]


def _verdict(lines: list[str]) -> dict[str, object]:
    an = Analyzer()
    for i, ln in enumerate(lines, 1):
        an.feed_line(ln, "input.log", i)
    return an.incident().to_contract()


def test_xid45_after_a_killed_worker_is_not_the_root() -> None:
    v = _verdict(
        [
            "[ 900.000001] Out of memory: Killed process 7986 (VLLM::Worker_TP) total-vm:98123456kB, anon-rss:40123456kB, "
            "file-rss:0kB, shmem-rss:2048kB, UID:0 pgtables:90000kB oom_score_adj:0",
            "[ 900.100000] NVRM: Xid (PCI:0000:3b:00): 45, pid=7986, name=VLLM::Worker_TP, Ch 00000008",
        ]
    )
    assert v["cause"] == "host-oom"
    assert any(c["signature"] == "nvidia-xid-consequence" for c in v["consequences"])  # type: ignore[attr-defined]


def test_amdgpu_burst_root_is_the_page_fault_behind_a_gcp_envelope() -> None:
    recs = [
        (1, AMD),
        (2, "amdgpu 0000:3d:00.0: amdgpu: VM_L2_PROTECTION_FAULT_STATUS:0x00301031"),
        (3, "amdgpu 0000:3d:00.0: amdgpu: ring gfx_0.0.0 timeout, signaled seq=10, emitted seq=12"),
        (4, "amdgpu 0000:3d:00.0: amdgpu: GPU reset begin!"),
        (5, "amdgpu 0000:3d:00.0: amdgpu: GPU reset(1) succeeded!"),
    ]
    lines = [
        json.dumps({"textPayload": f"[ 4512.{n:06d}] {m}", "timestamp": f"2026-01-02T03:04:0{n}Z"}) for n, m in recs
    ]
    lines.append("(EngineCore_DP0 pid=4242) ERROR 01-02 03:04:06 [core.py:1] RuntimeError: HIP error: an illegal memory access was encountered")
    v = _verdict(lines)
    assert v["cause"] == "gpu-fault"
    root = v["root"]
    assert isinstance(root, dict) and (root["source"], root["text"]) == ("kernel", AMD)


def test_amdgpu_reset_failure_outranks_its_reset_begin() -> None:
    v = _verdict(
        [
            "Oct 27 13:02:30 host kernel: amdgpu 0000:21:00.0: GPU reset begin!",
            "Oct 27 13:02:31 host kernel: amdgpu 0000:21:00.0: amdgpu: GPU reset(1) failed with error -110",
        ]
    )
    assert v["cause"] == "gpu-fault"
    assert v["root"]["text"] == "amdgpu 0000:21:00.0: amdgpu: GPU reset(1) failed with error -110"  # type: ignore[index]


def test_device_lost_after_an_amdgpu_reset_is_its_consequence() -> None:
    v = _verdict(
        [
            "nov 07 01:36:56 host kernel: amdgpu 0000:0a:00.0: amdgpu: ring gfx_0.0.0 timeout, signaled seq=3295304, emitted seq=3295306",
            "nov 07 01:36:56 host kernel: amdgpu 0000:0a:00.0: amdgpu: GPU reset begin!",
            "nov 07 01:36:59 host kernel: amdgpu 0000:0a:00.0: amdgpu: GPU reset succeeded, trying to resume",
            "(EngineCore_DP0 pid=4242) ERROR 11-07 01:37:00 [core.py:718] RuntimeError: vk::Queue::submit: ErrorDeviceLost "
            "(VK_ERROR_DEVICE_LOST)",
        ]
    )
    assert v["cause"] == "gpu-fault"
    assert v["root"]["source"] == "kernel" and "ring gfx_0.0.0 timeout" in v["root"]["text"]  # type: ignore[index]


def test_codes_placeholder_needs_a_known_class() -> None:
    from xpu_serve.signatures import SignatureError, parse_table

    row = {
        "id": "x", "source": "kernel", "role": "root", "cause": "gpu-fault", "meaning": "m", "example": "e",
        "pattern": r"NVRM: Xid \(\S+\): (?P<xid>{codes})\b", "keywords": ["NVRM"],
    }
    t = parse_table([{**row, "codes": {"table": "nvidia_xid", "class": "consequence"}}])
    assert t.rows[0].pattern.pattern == r"NVRM: Xid \(\S+\): (?P<xid>(?:154|45))\b"
    with pytest.raises(SignatureError, match="x: no code of class 'nope' in nvidia_xid"):
        parse_table([{**row, "codes": {"table": "nvidia_xid", "class": "nope"}}])
    with pytest.raises(SignatureError, match="data/no_such.yaml"):
        parse_table([{**row, "codes": {"table": "no_such", "class": "device"}}])


@pytest.mark.parametrize(
    "line",
    [
        f"<3>1 2026-01-02T03:04:05.123Z gpu01 kernel - - - {AMD}",
        f"<3>Jan  2 03:04:05 gpu01 kernel: {AMD}",
        f"kern  :err   : [ 4512.123456] {AMD}",
        f"MESSAGE={AMD}",
        json.dumps({"log": f"[ 4512.123456] {AMD}\n", "time": "2026-01-02T03:04:05Z"}),
    ],
)
def test_kernel_source_file_reads_relayed_records(line: str) -> None:
    # `watchers.kernel.source: file` on a relay's log: every line goes through parse_kernel_record
    from xpu_serve.events import parse_kernel_record

    ev = parse_kernel_record(line)
    assert ev is not None and (ev.source, ev.text) == ("kernel", AMD)
    assert TABLE.match(ev)[0].id == "amdgpu-vm-page-fault"  # type: ignore[index]
