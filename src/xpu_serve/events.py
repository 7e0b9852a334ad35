"""`Event`: one recognised line or fact, the unit every source feeds into the analysis.

Line parsers for vLLM, oneCCL, kernel records and crash dumps live here and turn raw text into
`Event`s. Live sources (log pump, kernel log, process watch, health) produce the same `Event`s,
so `diagnose` and `up` share one pipeline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from xpu_serve.log_envelopes import Envelope, unwrap


@dataclass
class Event:
    """One line or fact.

    Attributes:
        source: where it came from: "vllm", "ccl", "kernel", "process", "health", "supervisor".
        text: the message without wrappers and prefixes (the whole raw line when unparsed).
        raw: the line as read (CR and trailing newline stripped).
        time: wall-clock time when known (naive local time as printed, or aware UTC when the
            source is aware), else None.
        time_text: the time exactly as it appears in the input (e.g. "04-14 23:00:33"), or None.
        process: vLLM process name ("APIServer", "EngineCore", "Worker_TP0"...), or the kernel
            comm ("VLLM::Worker_TP"), or None.
        rank: TP rank when known, else None.
        pid: pid as printed by the source (container pid for vLLM, host pid for the kernel).
        level: "INFO", "WARNING", "ERROR"... or the kernel priority name; None if unknown.
        file, line: where the line is in the input (1-based line), for evidence.
        code_location: vLLM's "[core.py:936]" as "core.py:936", or None.
        seq: kernel record sequence number (/dev/kmsg), or None.
        signature, role, cause: filled in by classification (signatures table).
        group: id of the multi-line block (traceback, crash dump) this line belongs to, or None.
        extra: source-specific fields (e.g. {"library": "libze_intel_gpu.so.1.14.37020"}).
    """

    source: str
    text: str
    raw: str = ""
    time: datetime | None = None
    time_text: str | None = None
    process: str | None = None
    rank: int | None = None
    pid: int | None = None
    level: str | None = None
    file: str | None = None
    line: int | None = None
    code_location: str | None = None
    seq: int | None = None
    signature: str | None = None
    role: str | None = None
    cause: str | None = None
    group: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


# vLLM prefixes its child processes' output with "(Name pid=N) " (vllm/utils: _add_prefix via
# decorate_logs), and re-prefixes what it relays, so lines can carry nested prefixes:
# "(APIServer pid=A) (EngineCore_DP0 pid=B) ERROR ...". Written here (not a library) because it is
# the domain's own log shape.
# Older and Ray-relayed spellings of the same prefix: vLLM 0.8-0.10 "(VllmWorker rank=1 pid=N)" and
# "(VllmWorker TP0 pid=N)", Ray's "(RayWorkerWrapper pid=N, ip=10.0.0.1)" and other Ray actors
# ("(model_worker/12 pid=N, ip=...)"; ray/_private/log_monitor.py adds ", ip=" for remote nodes).
# Ray Data actors nest parentheses in the name: "(MapWorker(MapBatches(vLLMEngineActor)) pid=N, ip=...)".
_PREFIX_RE = re.compile(
    r"\(([A-Za-z][\w:./()-]*)(?: (?:TP|rank=)(\d+))? pid=(\d+)(?:, ip=[\w.:\[\]-]+)?\)\s?"
)


def split_process_prefix(line: str) -> tuple[str | None, int | None, str]:
    """Split vLLM's process prefix(es) off a line.

    Returns (name, pid, rest) for the innermost prefix, e.g.
    "(APIServer pid=1) (EngineCore_DP0 pid=2) INFO x" -> ("EngineCore_DP0", 2, "INFO x");
    the older "(VllmWorker TP0 pid=3)" / "(VllmWorker rank=0 pid=3)" give "VllmWorker_TP0", and a
    Ray ", ip=..." part is dropped. (None, None, line) when the line has no prefix at its start.
    """
    name: str | None = None
    pid: int | None = None
    pos = 0
    while True:
        m = _PREFIX_RE.match(line, pos)
        if not m:
            break
        name, pid, pos = m.group(1), int(m.group(3)), m.end()
        if m.group(2) is not None:
            name = f"{name}_TP{m.group(2)}"
    return name, pid, line[pos:]


# ---------------------------------------------------------------------------------------------
# Line parsers.
#
# Written here rather than taken from a library: these are the domain's own log shapes (vLLM's
# logger format, oneCCL's logger, the kernel's printk/kmsg records, systemd-coredump and CPython
# faulthandler dumps) and no maintained Python library parses them. Sources of each format:
# - vLLM: vllm/logger.py (_FORMAT "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s",
#   date format "%m-%d %H:%M:%S"), vllm/utils (decorate_logs: "(Name pid=N) " prefixes);
#   uvicorn's "INFO:     host:port - \"GET /x HTTP/1.1\" 200 OK".
# - oneCCL: src/common/log/log.hpp ("YYYY:MM:DD-HH:MM:SS:(tid) |LEVEL| file:line msg", and the
#   "pid:[rank]" / "pid" variants of later releases).
# - kernel: Documentation/ABI/testing/dev-kmsg ("prio,seq,usec,flags;message" + " KEY=value"
#   continuation lines), util-linux dmesg ("[ sec.usec]", -T "[Mon Mar 26 10:12:46 2026]",
#   --time-format iso "2026-03-26T10:12:46,123456+00:00"), journalctl -k short/short-iso/json.
# - docker: `docker logs -t` (RFC 3339 nano stamp + space), compose ("service  | ").
# - PyTorch c10d: "[rank0]:[E ProcessGroupNCCL.cpp:563] ..."; NCCL "host:pid:tid [dev] NCCL INFO".
# ---------------------------------------------------------------------------------------------

_VLLM_RE = re.compile(
    r"(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+(\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)?\s+"
    r"(?:\[?([\w./<>-]+:\d+)\]\s?)?"
)
_UVICORN_RE = re.compile(r"(INFO|WARNING|ERROR|CRITICAL):\s+")
_CCL_RE = re.compile(
    r"(\d{4}):(\d\d):(\d\d)-(\d\d:\d\d:\d\d):\s*(?:\(\s*(\d+)\)|(\d+))(?::\[(\d+)\])?\s*\|(CCL_\w+)\|\s?"
)
_KMSG_RE = re.compile(r"(\d+),(\d+),(\d+),[^;]*;")
_DMESG_RE = re.compile(r"\[\s*(\d+\.\d+)\]\s?")
# `dmesg -T` prints strftime's "%a %b %e %H:%M:%S %Y" in the host's language: "[Thu Mar 26 ...]",
# "[Do Mär 26 ...]", "[jeu. mars 26 ...]", "[木  3月 26 ...]", "[四 3月 26 ...]"
_DMESG_T_RE = re.compile(
    r"\[((?:[^\W\d_]{1,4}\.? +)?(?:[^\W\d_]{2,5}\.?|\d{1,2}月)\s+\d+ \d\d:\d\d:\d\d \d{4})\]\s?"
)
_ISO_RE = re.compile(r"\s*(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)([.,]\d+)?(Z|[+-]\d\d:?\d\d)?\s+")
# month abbreviations of any locale ("Mar", "Mär", "mars", "févr.", "ene"): journalctl prints
# strftime's %b, so a non-English host writes its own month names (the order stays "%b %d").
# The host is absent when the poster cut it out of a journal excerpt ("Jun 18 22:16:41
# ollama[116408]: ..."): then only an identifier with its "[pid]" is taken as the tag.
_SYSLOG_RE = re.compile(
    r"((?:[^\W\d_]{3,5}\.?|\d{1,2}月) [ \d]\d \d\d:\d\d:\d\d)(?:\.\d+)? (?:(?=[^\s\[:]+\[\d+\]: )|(\S+) )"
    r"([^\s\[:]+)(?:\[(\d+)\])?: ?"
)
_MID_PREFIX_RE = re.compile(
    r"\([A-Za-z][\w:./-]*(?: (?:TP|rank=)\d+)? pid=\d+(?:, ip=[\w.:\[\]-]+)?\) (?:DEBUG|INFO|WARNING|ERROR|CRITICAL) "
)
_PREFIX_ONLY_RE = re.compile(r"\([A-Za-z][\w:./-]*(?: (?:TP|rank=)\d+)? pid=\d+(?:, ip=[\w.:\[\]-]+)?\)")
# a launcher that relays its child's output behind its own level and source tags, each one word in
# brackets or parentheses ("[Error] (Process) " from Lemonade server) after its stamp, before vLLM's
# process prefix
_RELAY_TAGS_RE = re.compile(
    r"(?:\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)? )?(?:[\[(][A-Za-z]\w*[\])] ){1,3}"
    r"(?=\([A-Za-z][\w:./-]*(?: (?:TP|rank=)\d+)? pid=\d+)"
)
# oneCCL lines whose stamp was cut off or never printed ("|CCL_WARN| msg", "CCL_ERROR| msg",
# "CCL_WARN msg" as people quote them)
_CCL_BARE_RE = re.compile(r"\|?(CCL_(?:ERROR|WARN|INFO|DEBUG|TRACE|FATAL))(?:\| ?| )")
# a log shipper's stamp with a space (Ray Data, fluent-bit, kubectl --timestamps with a custom
# format) before a vLLM process prefix: "2026-03-09 01:31:29.489210231 (EngineCore_DP0 pid=N) ..."
_ISO_SP_RE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\s+(?=\()")
# the head between a stamp and a kernel record: `journalctl -o short-iso` / rsyslog "host kernel: ",
# appliance syslog templates that add the facility.level or a level word (Synology, Unraid,
# TrueNAS, syslog-ng "host kern.err kernel: ", "host kern warning kernel: "), also no host at all
_HOST_KERNEL_RE = re.compile(
    r"(?:[\w.:-]+ )?(?:(?:kern\.\w+|kern|<\d{1,3}>|\[?(?:emerg|alert|crit|err|error|warn|warning|notice|info|debug)\]?) ){0,2}"
    r"kernel(?:\[\d+\])?: "
)
# a Mmm dd hh:mm:ss syslog stamp alone (its head then read with _HOST_KERNEL_RE)
_SYSLOG_STAMP_RE = re.compile(r"((?:[^\W\d_]{3,5}\.?|\d{1,2}月) [ \d]\d \d\d:\d\d:\d\d)(?:\.\d+)? ")
# Anchors of a kernel record after a prefix no shape here knows (a relay's or shipper's own
# template): the kernel tag after a time of day, a dmesg stamp ("[%5lu.%06lu] ", printk's
# print_time), or a GPU driver's device prefix after a time of day. Prefixes that carry a
# user-space logger's level word or an exception are not taken (a program quoting a record).
_ANCHOR_TAG_RE = re.compile(r"\d:\d\d:\d\d\S*(?: +\S+){0,4}? +kernel(?:\[\d+\])?: ")
_ANCHOR_STAMP_RE = re.compile(r"(?:^|(?<=[\s:|>\]]))\[\s*\d+\.\d{6}\] ")
_ANCHOR_DRIVER_RE = re.compile(
    r"(?<![\w.-])(?:(?:xe|i915|amdgpu|radeon|nouveau|nvidia) [0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.\d: |NVRM: )"
)
_ANCHOR_TIME_RE = re.compile(r"\d:\d\d:\d\d")
_USERSPACE_PREFIX_RE = re.compile(
    r"\b(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b|Error\b|Exception\b|Traceback|pid="
)
_ANCHOR_MAX = 200  # characters of prefix searched for an anchor
_COMPOSE_RE = re.compile(r"([A-Za-z0-9][\w.-]*)\s*\| ")
_TORCH_RANK_RE = re.compile(r"(?:\[\d+\] )?\[rank(\d+)\]: ?")
# Ray's C++ log prefix (src/ray/util/logging.cc, spdlog pattern "[%Y-%m-%d %H:%M:%S,%e %L %P %t]"):
# "[2024-02-27 18:08:15,439 E 73667 73667] logging.cc:361: msg" - stamp, level letter, pid, tid,
# then the source location; raylet, GCS and core-worker logs and a driver's stderr
_RAY_CPP_RE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ([DIWEC]) (\d+) \d+\] (?:([\w.-]+\.\w+:\d+): )?"
)
_RAY_LEVELS = {"D": "DEBUG", "I": "INFO", "W": "WARNING", "E": "ERROR", "C": "CRITICAL"}
# NCCL's debug lines (src/debug.cc, ncclDebugLog): "host:pid:tid [cudaDev] NCCL INFO msg"; WARN lines
# carry "file.cc:line " before "NCCL", and NCCL_DEBUG_TIMESTAMP_FORMAT (2.23+) puts "[%F %T] " first
_NCCL_RE = re.compile(
    r"(?:\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)[^\]]*\] )?"
    r"(\S+):(\d+):(\d+) \[(\d+)\] (?:[\w./-]+:\d+ )?NCCL (INFO|WARN|ERROR|TRACE)\s"
)
_KPRIO = ("EMERG", "ALERT", "CRIT", "ERR", "WARNING", "NOTICE", "INFO", "DEBUG")
_MONTHS = {
    m: i
    for i, m in enumerate(
        ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1
    )
}
# %b of other locales (glibc localedata: de_DE, fr_FR, es_ES, it_IT, pt_BR, nl_NL), lower case, dot dropped
_MONTHS_INTL = {
    m: i
    for i, names in enumerate(
        (
            "jan janv ene gen",
            "feb févr fév fev",
            "mär mrz mars mar",
            "apr avr abr",
            "mai may mag",
            "jun juin giu",
            "jul juil lug",
            "aug août ago",
            "sep sept set",
            "okt oct ott out",
            "nov",
            "dez déc dec dic",
        ),
        1,
    )
    for m in names.split()
}


def _month(tok: str) -> int:
    """Month number of a %b token in English or another locale ("Mar", "Mär", "mars", "3月");
    raises KeyError when unknown."""
    got = _MONTHS.get(tok)
    if got is not None:
        return got
    if tok.endswith("月") and tok[:-1].isdigit():
        return int(tok[:-1])
    return _MONTHS_INTL[tok.rstrip(".").lower()]


# Kernel messages (after any stamp) that identify a record as a kernel one when it arrives
# without a kernel-only wrapper (e.g. an ISO stamp that could also be `docker logs -t`).
_KERNEL_MSG_RE = re.compile(
    r"(?:xe|i915|amdgpu|nouveau|pcieport|nvidia|snd_hda_intel) [0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.\d|"
    r"NVRM: |\S+\[\d+\]: segfault at |traps: |Out of memory: |oom-kill:|\S+ invoked oom-killer|"
    r"\[drm\]|\[drm:|audit: |BUG: |Call Trace:|Memory cgroup out of memory|"
    # a GPU driver's record quoted with its module tag instead of the device ("[i915] *ERROR* ...")
    r"\[(?:i915|xe|amdgpu|nouveau)\] |"
    # FreeBSD drm-kmod (LinuxKPI) prints DRM errors as "[drm ERROR :func] ..." and names the
    # device "drmn0:" (dmesg -a, no time stamp)
    r"\[drm (?:ERROR|WARN|INFO|DEBUG) :|drmn\d+: |"
    # i915 GPU error state (/sys/class/drm/card*/error, i915_gpu_coredump.c) pasted on its own
    r"GPU HANG: ecode "
)
# pid and comm inside kernel messages.
_K_COMM_PID_RE = re.compile(r"(?:traps: )?(\S[^\[\]]*?)\[(\d+)\]:? (?:segfault|general protection|trap )")
_K_IN_COMM_RE = re.compile(r" in (\S+) \[(\d+)\]")
# "Killed process 7986 (comm) total-vm:..." (mm/oom_kill.c since 2.6.x), older kernels (RHEL 6,
# 2.6.32) "Killed process 11726, UID 498, (comm) total-vm:..."
_K_OOM_RE = re.compile(r"Killed process (\d+)(?:, UID \d+,)? \(([^)]*)\)|task=([^,]*),pid=(\d+)")
_K_DEVICE_RE = re.compile(r"\b([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.\d)\b|\(PCI:([0-9a-f:.]+)\)")


def _clean(raw: str) -> str:
    """Strip newline, stray CR (kept: the text after the last CR, as a terminal shows it) and
    a literal "^M" that some pastes carry."""
    s = raw.rstrip("\r\n")
    if "\x1b[" in s:  # ANSI colours (Ray, docker compose with a TTY)
        s = _ANSI_RE.sub("", s)
    if "\r" in s:
        s = s.rstrip("\r")
        if "\r" in s:
            s = s.rsplit("\r", 1)[1]
    if s.endswith("^M"):
        s = s[:-2]
    return s


def kernel_message_info(ev: Event) -> None:
    """Fill `pid`, `process` (the kernel comm) and extra["device"] of a kernel Event from its
    message (segfault/traps lines, OOM-killer lines, xe "Timedout job ... in comm [pid]",
    NVIDIA Xid "pid=N, name=comm"). Called again when continuation lines are appended."""
    msg = ev.text
    m = _K_COMM_PID_RE.match(msg)
    if m:
        ev.process, ev.pid = m.group(1), int(m.group(2))
    else:
        m2 = _K_OOM_RE.search(msg)
        if m2:
            if m2.group(1):
                ev.pid, ev.process = int(m2.group(1)), m2.group(2)
            else:
                ev.process, ev.pid = m2.group(3), int(m2.group(4))
        else:
            m3 = _K_IN_COMM_RE.search(msg)
            if m3:
                ev.process, ev.pid = m3.group(1), int(m3.group(2))
            elif "NVRM: Xid" in msg:
                mp = re.search(r"pid=(\d+)(?:, name=([^,]+))?", msg)
                if mp:
                    ev.pid = int(mp.group(1))
                    ev.process = mp.group(2)
    md = _K_DEVICE_RE.search(msg)
    if md:
        ev.extra["device"] = md.group(1) or md.group(2)


_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# journal excerpts pasted without date and host: "22:39:31 kernel: msg" or "kernel: msg"
_BARE_KERNEL_RE = re.compile(r"(?:(\d\d:\d\d:\d\d)(?:\.\d+)? )?kernel: ")
_K_INNER_RE = re.compile(r"(?:\[\s*\d+\.\d+\]\s*)?(?:\[\s*[TC]\d+\]\s*)?")


def _kernel_event(
    text: str,
    raw: str,
    *,
    time_text: str | None,
    level: str | None = None,
    seq: int | None = None,
    boot_s: float | None = None,
    t: datetime | None = None,
) -> Event:
    if text[:1] == "[":
        # a caller id ("[   T3930] ", CONFIG_PRINTK_CALLER) or a boot stamp inside a syslog record
        m = _K_INNER_RE.match(text)
        if m and m.end():
            inner = text[: m.end()]
            if boot_s is None and "." in inner:
                try:
                    boot_s = float(inner.strip().split("]")[0].strip("[ "))
                except ValueError:
                    pass
            text = text[m.end() :]
    ev = Event(source="kernel", text=text, raw=raw, time=t, time_text=time_text, level=level, seq=seq)
    if boot_s is not None:
        ev.extra["boot_s"] = boot_s
    kernel_message_info(ev)
    return ev


def parse_kernel_record(line: str) -> Event | None:
    """Parse one kernel log record in any of the kernel formats into an Event (source "kernel").

    Formats: /dev/kmsg "prio,seq,usec,flags;message" (Documentation/ABI/testing/dev-kmsg),
    `dmesg` "[ 551.424205] message", `dmesg -T` "[Thu Mar 26 10:12:46 2026] message",
    `dmesg --time-format iso` "2026-03-26T10:12:46,123456+00:00 message", `journalctl -k`
    "Mar 26 10:12:46 host kernel: message" (also -o short-iso), `journalctl -k -o json`
    (one JSON object per line; MESSAGE, __REALTIME_TIMESTAMP, _PID, _COMM), or a bare message.

    Boot-relative times (kmsg usec, dmesg seconds) go to extra["boot_s"] (seconds since boot);
    `time` is set only for wall-clock formats. Returns None for empty lines and kmsg
    " KEY=value" continuation lines. Never raises.
    """
    s = _clean(line)
    if not s.strip():
        return None
    try:
        c = s[0]
        if c == "<" or c == "M" or (c.islower() and s.find(":", 3, 10) > 0):
            env = unwrap(s)  # a relay's envelope (log_envelopes): the record is inside
            if env is not None:
                return _enveloped_kernel(env, s)
        ev = _parse_kernel(s)
        if ev is None and c == "{" and (env := unwrap(s)) is not None:
            return _enveloped_kernel(env, s)  # a shipper's JSON without the journal's MESSAGE
        return ev
    except Exception:  # a parser must never take the caller down; keep the text
        return Event(source="kernel", text=s.strip(), raw=s)


def _enveloped_kernel(env: Envelope, raw: str) -> Event | None:
    """The kernel record inside an envelope (from a kernel source: every record is the kernel's)."""
    ev = _parse_kernel(env.text) if env.text.strip() else None
    if ev is None:
        return None
    ev.raw = raw
    if ev.level is None:
        ev.level = env.level
    if ev.time is None and env.time is not None:
        ev.time, ev.time_text = env.time, env.time_text
    return ev


def _parse_kernel(s: str) -> Event | None:
    c = s[0]
    if c == " " and "=" in s and not s.lstrip().startswith(("[", "2")):
        return None  # kmsg dictionary continuation (" SUBSYSTEM=drm")
    if c.isdigit():
        m = _KMSG_RE.match(s)
        if m:
            prio = int(m.group(1))
            usec = int(m.group(3))
            return _kernel_event(
                s[m.end() :],
                s,
                time_text=f"{usec / 1e6:.6f}",
                level=_KPRIO[prio & 7],
                seq=int(m.group(2)),
                boot_s=usec / 1e6,
            )
    if c == "{":
        return _parse_journal_json(s)
    level: str | None = None
    if c == "<":
        m0 = re.match(r"<(\d)>", s)
        if m0:
            level = _KPRIO[int(m0.group(1)) & 7]
            s = s[m0.end() :]
            c = s[:1] or " "
    if c == "[":
        m = _DMESG_RE.match(s)
        if m:
            rest = s[m.end() :]
            mh = _HOST_KERNEL_RE.match(rest)  # `journalctl -o short-monotonic`: "[ 5.1] host kernel: msg"
            if mh:
                rest = rest[mh.end() :]
            return _kernel_event(rest, s, time_text=m.group(1), boot_s=float(m.group(1)))
        m = _DMESG_T_RE.match(s)
        if m:
            t = _parse_ctime(m.group(1))
            return _kernel_event(s[m.end() :], s, time_text=m.group(1), t=t)
    m = _ISO_RE.match(s)
    if m:
        ts = m.group(1)
        t = _parse_iso(ts)
        rest = s[m.end() :]
        mh = _HOST_KERNEL_RE.match(rest)
        if mh:
            rest = rest[mh.end() :]
        return _kernel_event(rest, s, time_text=ts.replace("T", " "), t=t)
    m = _SYSLOG_RE.match(s)
    if m:
        return _kernel_event(s[m.end() :], s, time_text=m.group(1), t=_parse_syslog_time(m.group(1)))
    m = _BARE_KERNEL_RE.match(s)
    if m:
        return _kernel_event(s[m.end() :], s, time_text=m.group(1), level=level)
    return _kernel_event(s.strip(), s, time_text=None, level=level)


def _parse_journal_json(s: str) -> Event | None:
    import json

    try:
        obj = json.loads(s)
    except ValueError:
        return _kernel_event(s, s, time_text=None)
    if not isinstance(obj, dict):
        return None
    msg = obj.get("MESSAGE")
    if isinstance(msg, list):  # journald sends non-UTF-8 messages as byte arrays
        msg = bytes(int(b) & 0xFF for b in msg).decode("utf-8", "replace")
    if not isinstance(msg, str):
        return None
    t = None
    ts = obj.get("__REALTIME_TIMESTAMP")
    if ts is not None:
        try:
            t = datetime.fromtimestamp(int(ts) / 1e6)
        except (ValueError, OverflowError, OSError):
            t = None
    ev = _kernel_event(msg, s, time_text=t.strftime("%Y-%m-%d %H:%M:%S.%f") if t else None, t=t)
    mono = obj.get("__MONOTONIC_TIMESTAMP")
    if mono is not None:
        try:
            ev.extra["boot_s"] = int(mono) / 1e6
        except ValueError:
            pass
    return ev


def _parse_iso(ts: str) -> datetime | None:
    try:
        return datetime.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None


def _parse_ctime(ts: str) -> datetime | None:
    parts = ts.split()
    try:
        mon, day, hms, year = parts[-4], int(parts[-3]), parts[-2], int(parts[-1])
        h, mi, se = (int(x) for x in hms.split(":"))
        return datetime(year, _month(mon), day, h, mi, se)
    except (KeyError, ValueError, IndexError):
        return None


def _parse_syslog_time(ts: str) -> datetime | None:
    try:
        mon, day, hms = ts.split()
        h, mi, se = (int(x) for x in hms.split(":"))
        return datetime(1900, _month(mon), int(day), h, mi, se)
    except (KeyError, ValueError):
        return None


def _vllm_time(tt: str) -> datetime | None:
    # "MM-DD HH:MM:SS": vLLM prints no year; the year is left at 1900 (only order matters).
    try:
        return datetime(1900, int(tt[0:2]), int(tt[3:5]), int(tt[6:8]), int(tt[9:11]), int(tt[12:14]))
    except ValueError:
        return None


def parse_line(raw: str, file: str | None = None, lineno: int | None = None) -> Event:
    """Parse one line of a mixed log (vLLM output, oneCCL, kernel records, crash dumps) into an
    Event. Always returns an Event (source "text" when no known shape is recognised); never raises.

    Recognised, after stripping CR/"^M" and wrappers (`docker logs -t` RFC 3339 stamp, docker
    compose "service  | ", syslog/journald "Mon DD HH:MM:SS host unit[pid]: "):
    vLLM "(Name pid=N) LEVEL MM-DD HH:MM:SS [file:line] msg" (nested prefixes, or none), uvicorn
    "INFO:     ...", oneCCL "YYYY:MM:DD-HH:MM:SS: pid:[rank] |CCL_ERROR| msg" (and the "(  tid)" /
    "pid" variants), kernel records (see `parse_kernel_record`), PyTorch "[rankN]:[E ...]" lines
    and NCCL "host:pid:tid [dev] NCCL WARN" lines. Other lines (tracebacks, faulthandler and
    native dumps, systemd-coredump stacks, `terminate called ...`) keep their text with source
    "text" and are classified by the signature table.
    """
    try:
        return _parse_line(raw, file, lineno)
    except Exception:  # defensive: a malformed line must never stop the analysis
        s = raw.rstrip("\r\n")
        return Event(source="text", text=s, raw=s, file=file, line=lineno)


# One field of a pretty-printed JSON log entry that carries the record's text: Google Cloud Logging
# ("textPayload"), journalctl -o json-pretty ("MESSAGE"), docker's json-file driver ("log"), Loki /
# Elastic exports ("message", "msg"), pasted one field per line.
_JSON_FIELD_RE = re.compile(
    r'\s*"(?:textPayload|MESSAGE|message|log|msg)"\s*:\s*("(?:[^"\\]|\\.)*")\s*,?\s*$'
)
# line ends left inside the value, escaped once more by a shipper that escapes text ("\\r\\n")
_ESCAPED_EOL_RE = re.compile(r"(?:\\r|\\n)+$")


def _json_field_record(text: str) -> str | None:
    """The log record inside a JSON field line (`"textPayload": "[ 12.3] msg\\n",`), decoded,
    without its trailing line end; None when the line is not such a field or the value is empty."""
    m = _JSON_FIELD_RE.match(text)
    if m is None:
        return None
    import json

    try:
        val = json.loads(m.group(1))
    except ValueError:
        return None
    if not isinstance(val, str):
        return None
    val = _ESCAPED_EOL_RE.sub("", val.rstrip("\r\n")).rstrip("\r\n")
    return val if val.strip() and "\n" not in val else None


# the message field of a one-line JSON log record: docker's json-file driver {"log": ..., "stream": ...},
# a process runner's event stream {"event": "line", "data": ...}, Loki/Elastic/Cloud Logging exports
# ("message", "msg", "textPayload"), journalctl -o json ("MESSAGE"); and its stamp field, if any
@dataclass
class _Line:
    """A line being unwrapped: the cleaned line (`raw`), the text left after the wrappers
    stripped so far, and what they carried (the outermost stamp, a journal's pid)."""

    raw: str
    text: str
    file: str | None
    lineno: int | None
    wrap_time: str | None = None
    wrap_dt: datetime | None = None
    wrap_pid: int | None = None


def _at(ev: Event, ln: _Line) -> Event:
    ev.file, ev.line = ln.file, ln.lineno
    return ev


def _strip_gutter(ln: _Line) -> Event | None:
    """A log viewer's gutter before every line ("  | ERROR 07-01 13:54:43 ...", vllm#6042)."""
    t = ln.text
    if t[0] in (" ", "|") and t.lstrip(" ")[:2] == "| ":
        ln.text = t.lstrip(" ")[2:]
    return None


_PANE_EDGES = ("\u2502", "\u2503")  # box drawings light / heavy vertical


def _strip_pane_border(ln: _Line) -> Event | None:
    """A terminal UI's pane border around the line: k9s's log view (and other TUIs drawn with
    box-drawing characters) frames each line as "│ <line><padding to the pane width>│"."""
    t = ln.text
    if t[0] in _PANE_EDGES:
        t = t[1:].rstrip()
        if t.endswith(_PANE_EDGES):
            t = t[:-1].rstrip()
        ln.text = t[1:] if t[:1] == " " else t
    return None


def _strip_quote(ln: _Line) -> Event | None:
    """A markdown quote or inline code around the line (a report's paste)."""
    if ln.text[0] in (">", "`"):
        ln.text = _strip_markdown(ln.text)
    return None


def _strip_fence_end(ln: _Line) -> Event | None:
    """A code fence glued to the end of the line."""
    t = ln.text
    if t[-1] == "`" and t.endswith("```"):
        ln.text = t[:-3]
    return None


# journalctl -x's message-catalog block under an entry (systemd src/shared/logs-show.c
# print_catalog: every line of the catalog text after the prefix "░░" (two light shades) in a
# UTF-8 locale, "--" otherwise, and one space): "░░ Subject: Unit process exited". The text is
# the catalog's explanation of the entry above it, never a record. The "--" form is taken only
# for the catalog's header fields and the bare prefix (its body lines read like prose)
_CATALOG_SHADE = "\u2591\u2591"
_CATALOG_DASH_RE = re.compile(r"-- ?(?:$|(?:Subject|Defined-By|Support|Documentation): )")


def _strip_journal_catalog(ln: _Line) -> Event | None:
    """A journalctl catalog line ("░░ Subject: ...", "-- Defined-By: systemd"): left empty."""
    t = ln.text
    if (t[0] == "\u2591" and t.startswith(_CATALOG_SHADE)) or (t[0] == "-" and _CATALOG_DASH_RE.match(t)):
        ln.text = ""
    return None


def _strip_envelope(ln: _Line) -> Event | None:
    """A log shipper's or journal export's envelope (log_envelopes.unwrap): read the record in it."""
    t = ln.text
    c = t[0]
    if c == "<" or c == "{" or c == "M" or (c.islower() and t.find(":", 3, 10) > 0):
        env = unwrap(t)
        if env is not None:
            return _from_envelope(env, ln.raw, ln.file, ln.lineno)
    return None


def _strip_iso_stamp(ln: _Line) -> Event | None:
    """A leading ISO stamp (`docker logs -t`, a shipper's time): a kernel record's own header, or
    a wrapper stamp taken as the line's time; "YYYY-MM-DD HH:MM:SS" too; an indented ISO kernel record."""
    t = ln.text
    c = t[0]
    if c.isdigit() and len(t) > 20 and t[4] == "-" and t[10] == "T":
        return _strip_iso_t(ln)
    if c.isdigit() and len(t) > 20 and t[4] == "-" and t[10] == " ":
        m = _ISO_SP_RE.match(t)
        if m:
            ln.wrap_time = m.group(1)
            ln.wrap_dt = _parse_iso(m.group(1).replace(" ", "T"))
            ln.text = t[m.end() :]
    elif c == " " and t.lstrip()[:1].isdigit() and _ISO_RE.match(t):
        ev = parse_kernel_record(t)
        if ev is not None:
            return _at(ev, ln)
    return None


def _strip_iso_t(ln: _Line) -> Event | None:
    t = ln.text
    m = _ISO_RE.match(t)
    if not m:
        return None
    rest = t[m.end() :]
    if _HOST_KERNEL_RE.match(rest) or _KERNEL_MSG_RE.match(rest) or (m.group(2) or "").startswith(","):
        ev = parse_kernel_record(t)
        if ev is not None:
            return _at(ev, ln)
    ln.wrap_time = m.group(1).replace("T", " ")
    ln.wrap_dt = _parse_iso(m.group(1))
    if rest[:1].isdigit():
        # `docker logs -t` over a kernel record that carries its own ISO stamp
        inner = _ISO_RE.match(rest)
        if inner and _KERNEL_MSG_RE.match(rest[inner.end() :]):
            ev = parse_kernel_record(rest)
            if ev is not None:
                return _at(ev, ln)
    # the wrapper puts one space after its stamp: more is the line's own indentation (a wrapped
    # kernel record's continuation, a traceback frame), kept as in the unwrapped log
    ws = m.end() - len(t[: m.end()].rstrip())
    ln.text = " " * (ws - 1) + rest if ws > 1 and rest else rest
    return None


def _strip_compose(ln: _Line) -> Event | None:
    """`docker compose logs`' "service  | " prefix, and the ISO stamp `-t` adds after it."""
    t = ln.text
    if not (t[0].isalpha() and " | " in t[:80]):
        return None
    m = _COMPOSE_RE.match(t)
    if m:
        t = ln.text = t[m.end() :]
        if t[:1].isdigit() and ln.wrap_time is None and len(t) > 20 and t[4] == "-" and t[10] == "T":
            # `docker compose logs -t`: "service  | 2026-04-16T12:49:28.263Z msg"
            m = _ISO_RE.match(t)
            if m:
                ln.wrap_time = m.group(1).replace("T", " ")
                ln.wrap_dt = _parse_iso(m.group(1))
                ln.text = t[m.end() :]
    return None


def _strip_shipped_quote(ln: _Line) -> Event | None:
    """A quoted line under a shipper's wrapper ("vllm-1  | > Nov 30 ... kernel: ...")."""
    if ln.text[0] == ">":
        ln.text = _strip_markdown(ln.text)
    return None


# SGLang's logger prefix (python/sglang/srt/utils/common.py configure_logger: "[%(asctime)s{prefix}] "
# with datefmt "%Y-%m-%d %H:%M:%S"); a scheduler's prefix names its ranks (managers/scheduler.py
# run_scheduler_process: " DP0", " PP0", " ATTN_CP0", " MOE_DP0", " TP0", " EP0"). Only the form
# with ranks is read here: the bare "[stamp] " of other processes stays the line's text
_SGLANG_RANKS_RE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)((?: (?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+)+)\] "
)
_SGLANG_TP_RE = re.compile(r" TP(\d+)")


def _strip_rank_stamp(ln: _Line) -> Event | None:
    """SGLang's "[YYYY-MM-DD HH:MM:SS TP3] msg": the message read as a line, with the stamp as its
    time (unless the message has its own) and the TP rank as its rank."""
    t = ln.text
    if not (t[0] == "[" and t[1:2].isdigit()):
        return None
    m = _SGLANG_RANKS_RE.match(t)
    if m is None:
        return None
    ev = _parse_line(t[m.end() :], ln.file, ln.lineno)
    ev.raw = ln.raw
    if ev.time is None:
        ev.time_text, ev.time = m.group(1), _parse_iso(m.group(1).replace(" ", "T"))
    tp = _SGLANG_TP_RE.search(m.group(2))
    if ev.rank is None and tp is not None:
        ev.rank = int(tp.group(1))
    return ev


def _strip_json_field(ln: _Line) -> Event | None:
    """One field of a pretty-printed JSON log entry (see _JSON_FIELD_RE): read the record in it."""
    t = ln.text
    if not ((t[0] == " " or t[0] == '"') and '": "' in t[:48]):
        return None
    rec = _json_field_record(t)
    if rec is None:
        return None
    ev = _parse_line(rec, ln.file, ln.lineno)
    ev.raw = ln.raw
    if ev.time is None and ln.wrap_time is not None:
        ev.time_text, ev.time = ln.wrap_time, ln.wrap_dt
    return ev


def _strip_syslog(ln: _Line) -> Event | None:
    """A syslog/journal header ("Mon DD HH:MM:SS host unit[pid]: "): a kernel record, or the
    line's time and pid; a template with the facility/level between host and tag."""
    t = ln.text
    c = t[0]
    if not (
        (c.isalpha() or (c.isdigit() and "月" in t[1:3]))
        and len(t) > 16
        and (sp := t.find(" ", 2, 7)) > 0
        and t[sp + 3] == " "
        and t[sp + 6] == ":"
    ):
        return None
    m = _SYSLOG_RE.match(t)
    if m:
        if m.group(3) == "kernel":
            return _at(
                _kernel_event(t[m.end() :], ln.raw, time_text=m.group(1), t=_parse_syslog_time(m.group(1))),
                ln,
            )
        ln.wrap_time = m.group(1)
        ln.wrap_dt = _parse_syslog_time(m.group(1))
        ln.wrap_pid = int(m.group(4)) if m.group(4) else None
        ln.text = t[m.end() :]
    elif (ms := _SYSLOG_STAMP_RE.match(t)) and (mk := _HOST_KERNEL_RE.match(t, ms.end())):
        ev = _kernel_event(t[mk.end() :], ln.raw, time_text=ms.group(1), t=_parse_syslog_time(ms.group(1)))
        return _at(ev, ln)
    return None


def _strip_bare_kernel(ln: _Line) -> Event | None:
    """A "kernel: " tag after an optional stamp (a journal excerpt without host)."""
    t = ln.text
    if (t[0] == "k" or t[0].isdigit()) and "kernel: " in t[:24]:
        m = _BARE_KERNEL_RE.match(t)
        if m:
            return _at(_kernel_event(t[m.end() :], ln.raw, time_text=m.group(1)), ln)
    return None


# The wrappers around a line, outermost first: each stripper takes its wrapper off `_Line.text`
# (keeping the stamp/pid it carried) or reads the whole line as a record (an Event). A line left
# empty is an empty text event.
_STRIPPERS = (
    _strip_gutter,
    _strip_quote,
    _strip_fence_end,
    _strip_journal_catalog,
    _strip_envelope,
    _strip_iso_stamp,
    _strip_compose,
    _strip_shipped_quote,
    _strip_pane_border,
    _strip_rank_stamp,
    _strip_json_field,
    _strip_syslog,
    _strip_bare_kernel,
)


def _parse_line(raw: str, file: str | None, lineno: int | None) -> Event:
    s = _clean(raw)
    ln = _Line(s, s, file, lineno)
    for strip in _STRIPPERS:
        if not ln.text:
            return Event(
                source="text", text="", raw=s, file=file, line=lineno, time_text=ln.wrap_time, time=ln.wrap_dt
            )
        ev = strip(ln)
        if ev is not None:
            return ev
    if not ln.text:
        return Event(
            source="text", text="", raw=s, file=file, line=lineno, time_text=ln.wrap_time, time=ln.wrap_dt
        )
    return _parse_record(ln)


def _parse_record(ln: _Line) -> Event:
    """The unwrapped line: a vLLM-prefixed record, oneCCL, uvicorn, torch's rank prefix, a kernel
    record in one of its headers, NCCL's WARN line, or plain text."""
    name: str | None = None
    pid: int | None = None
    text = ln.text
    if text[0] == "(":
        name, pid, text = split_process_prefix(text)
        ln.text = text
    c = text[:1]
    if c.isupper():
        ev = _upper_record(ln, name, pid)
    elif c == "|" and text[1:5] == "CCL_":
        ev = _leveled(
            _CCL_BARE_RE, "ccl", text, ln.raw, name, pid, ln.file, ln.lineno, ln.wrap_time, ln.wrap_dt
        )
    elif c.isdigit():
        ev = _digit_record(ln, name, pid)
    elif c == "<" and name is None and len(text) > 3 and text[1].isdigit() and text[2] == ">":
        ev = parse_kernel_record(text)
        ev = _at(ev, ln) if ev is not None else None
    elif c == "[":
        ev = _bracket_record(ln, name, pid)
    else:
        ev = None
    return ev if ev is not None else _tail_record(ln, name, pid)


def _upper_record(ln: _Line, name: str | None, pid: int | None) -> Event | None:
    """vLLM's "LEVEL MM-DD HH:MM:SS [file.py:N] msg", oneCCL's bare "CCL_LEVEL| ...", uvicorn's "INFO: ..."."""
    text = ln.text
    m = _VLLM_RE.match(text)
    if m:
        tt = m.group(2)
        return Event(
            source="vllm",
            text=text[m.end() :],
            raw=ln.raw,
            time=_vllm_time(tt),
            time_text=tt,
            process=name,
            pid=pid if name else ln.wrap_pid,
            level=m.group(1),
            file=ln.file,
            line=ln.lineno,
            code_location=m.group(3),
        )
    if text[:4] == "CCL_":
        ev = _leveled(
            _CCL_BARE_RE, "ccl", text, ln.raw, name, pid, ln.file, ln.lineno, ln.wrap_time, ln.wrap_dt
        )
        if ev is not None:
            return ev
    if text.startswith(("INFO:", "WARNING:", "ERROR:", "CRITICAL:")):
        return _leveled(
            _UVICORN_RE, "vllm", text, ln.raw, name, pid, ln.file, ln.lineno, ln.wrap_time, ln.wrap_dt
        )
    return None


def _digit_record(ln: _Line, name: str | None, pid: int | None) -> Event | None:
    """oneCCL's "YYYY:MM:DD-HH:MM:SS:(pid) |CCL_LEVEL| ..." or a /dev/kmsg record."""
    text = ln.text
    if len(text) > 20 and text[4] == ":" and text[10] == "-":
        m = _CCL_RE.match(text)
        if m:
            tt = f"{m.group(1)}:{m.group(2)}:{m.group(3)}-{m.group(4)}"
            try:
                hh, mi, ss = (int(x) for x in m.group(4).split(":"))
                t = datetime(int(m.group(1)), int(m.group(2)), int(m.group(3)), hh, mi, ss)
            except ValueError:
                t = None
            cpid = m.group(5) or m.group(6)
            return Event(
                source="ccl",
                text=text[m.end() :],
                raw=ln.raw,
                time=t,
                time_text=tt,
                process=name,
                pid=int(cpid) if cpid else pid,
                rank=int(m.group(7)) if m.group(7) else None,
                level=m.group(8),
                file=ln.file,
                line=ln.lineno,
                extra={"tid": int(m.group(5))} if m.group(5) else {},
            )
    if _KMSG_RE.match(text) and name is None:
        ev = parse_kernel_record(text)
        if ev is not None:
            return _at(ev, ln)
    return None


def _bracket_record(ln: _Line, name: str | None, pid: int | None) -> Event | None:
    """torch's "[rankN]:" prefix, Ray's C++ log prefix, or a dmesg header ("[ 123.456]", "[Mon Mar 26 ...]")."""
    text = ln.text
    if text.startswith("[rank") or (len(text) > 3 and text[1].isdigit() and "[rank" in text[:16]):
        m = _TORCH_RANK_RE.match(text)
        if m:
            return Event(
                source="vllm",
                text=text[m.end() :],
                raw=ln.raw,
                process=name,
                pid=pid,
                rank=int(m.group(1)),
                file=ln.file,
                line=ln.lineno,
                time_text=ln.wrap_time,
                time=ln.wrap_dt,
                level="ERROR" if text[m.end() : m.end() + 3] == "[E " else None,
            )
    if text[1:3].isdigit():
        m = _RAY_CPP_RE.match(text)
        if m:
            return Event(
                source="vllm",
                text=text[m.end() :],
                raw=ln.raw,
                process=name,
                pid=int(m.group(4)),
                level=_RAY_LEVELS[m.group(3)],
                file=ln.file,
                line=ln.lineno,
                time_text=f"{m.group(1)},{m.group(2)}",
                time=_parse_iso(m.group(1).replace(" ", "T")),
                code_location=m.group(5),
            )
    if name is None and (_DMESG_RE.match(text) or _DMESG_T_RE.match(text)):
        ev = parse_kernel_record(text)
        if ev is not None:
            return _at(ev, ln)
    return None


def _tail_record(ln: _Line, name: str | None, pid: int | None) -> Event:
    """NCCL's "host:pid:tid [dev] NCCL WARN ..." (bare, or under a Ray actor's or vLLM worker's
    "(Name pid=N)" prefix: the process keeps the prefix's name, the pid is NCCL's own), a vLLM
    prefix after other output, a kernel record without its stamp or after an unknown prefix,
    else plain text."""
    text = ln.text
    if " NCCL " in text:
        m = _NCCL_RE.match(text)
        if m:
            nt = m.group(1)
            return Event(
                source="ccl",
                text=text[m.end() :],
                raw=ln.raw,
                process=name,
                pid=int(m.group(3)),
                level="NCCL_" + m.group(6),
                file=ln.file,
                line=ln.lineno,
                time_text=ln.wrap_time or nt,
                time=ln.wrap_dt or (_parse_iso(nt.replace(" ", "T")) if nt else None),
                extra={"device_index": int(m.group(5))},
            )
    if name is None:
        ev = _kernel_tail(ln, text)
        if ev is not None:
            return ev
    return Event(
        source="vllm" if name else "text",
        text=text,
        raw=ln.raw,
        process=name,
        pid=pid if pid else ln.wrap_pid,
        file=ln.file,
        line=ln.lineno,
        time_text=ln.wrap_time,
        time=ln.wrap_dt,
    )


def _kernel_tail(ln: _Line, text: str) -> Event | None:
    if "pid=" in text:
        # a progress bar or other output without a newline before a prefixed vLLM line
        m = _MID_PREFIX_RE.search(text) or _RELAY_TAGS_RE.match(text)
        if m:
            return _parse_line(text[m.end() if m.re is _RELAY_TAGS_RE else m.start() :], ln.file, ln.lineno)
    if ln.wrap_time is None:
        # kernel records quoted without their stamp, also indented in a hand-written report
        # ("  xe 0000:04:00.0: [drm] Tile0: GT0: Engine memory CAT error ...")
        kt = text.lstrip() if text[:1] in (" ", "\t") else text
        if _KERNEL_MSG_RE.match(kt):
            return _at(_kernel_event(kt, ln.raw, time_text=None), ln)
    ev = _quoted_kernel_message(ln, text)  # (also behind a shipper's stamp: the quote has none)
    if ev is not None:
        return ev
    ev = _kernel_after_prefix(text, ln.raw)
    if ev is not None:
        _at(ev, ln)
        if ev.time is None and ln.wrap_time is not None:
            ev.time_text, ev.time = ln.wrap_time, ln.wrap_dt
    return ev


def _quoted_kernel_message(ln: _Line, text: str) -> Event | None:
    """A kernel message a scanning tool quotes whole at the end of its own line, e.g. gpud's
    dmesg scan ('[XID found] (54 minutes ago) "NVRM: Xid (PCI:0000:9b:00): 119, pid=N, ..."',
    leptonai/gpud pkg/kmsg scan output): the quoted text is the record, the prefix is the tool's;
    None when the line does not end in a quote, the quoted text is not a kernel message or the
    prefix is a user-space logger's."""
    q = text.find(' "')
    if q <= 0 or not text.endswith('"') or len(text) - q < 12:
        return None
    inner = text[q + 2 : -1]
    if '"' in inner or not _KERNEL_MSG_RE.match(inner) or _USERSPACE_PREFIX_RE.search(text, 0, q):
        return None
    return _at(_kernel_event(inner, ln.raw, time_text=None), ln)


# A second record glued to the end of another on one pasted line (a terminal that lost the newline,
# a copy from a web log viewer): a oneCCL stamp (oneCCL src/common/log/log.hpp) or a vLLM process
# prefix (vllm/logger.py + multiproc_executor's "(Worker_TP0 pid=N) ") after other text. Found from
# their literal anchors ("|CCL_", " pid=") so a line without a glued record costs two `find`s.
_CCL_STAMP_END_RE = re.compile(r"\d{4}:\d\d:\d\d-\d\d:\d\d:\d\d:\s*(?:\(\s*\d+\)|\d+)(?::\[\d+\])?\s*$")


def _glued_starts(line: str) -> list[int]:
    starts: list[int] = []
    k = line.find("|CCL_", 1)
    while k > 0:
        w = max(0, k - 48)
        m = _CCL_STAMP_END_RE.search(line, w, k)
        if m is not None and m.start() > 0:
            starts.append(m.start())
        k = line.find("|CCL_", k + 5)
    k = line.find(" pid=", 1)
    while k > 0:
        p = line.rfind("(", max(0, k - 64), k)
        if p > 0 and (
            _MID_PREFIX_RE.match(line, p)
            # glued right after the previous record's text (no space), the prefix alone is enough:
            # a traceback pasted with its line ends lost ("...(response)(APIServer pid=7)   File ...")
            or (not line[p - 1].isspace() and _PREFIX_ONLY_RE.match(line, p))
        ):
            starts.append(p)
        k = line.find(" pid=", k + 5)
    return sorted(set(starts))


# a vLLM record header inside a line, after a space: where a paste that turned line ends into
# spaces put the next record ("... self.all_reduce(data) ERROR 11-04 18:02:56 [file.py:597] ...")
_INLINE_HDR_RE = re.compile(
    # vLLM >= 0.6 brackets the source ("[file.py:597] "); older releases wrote "file.py:597] "
    r"(?<=\s)(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? \[?[\w./<>-]+:\d+\] "
)


def record_header_after(line: str, pos: int) -> bool:
    """True when another vLLM record header ("ERROR 06-19 11:25:01 [x.py:1] ") starts after `pos`
    in `line`: a paste whose line ends became spaces glued a later record onto this one."""
    # every header ends its source location with "] ": one C-level find keeps the common line cheap
    return line.find("] ", pos) >= 0 and _INLINE_HDR_RE.search(line, pos) is not None


def _spaced_records(line: str) -> list[str]:
    """Records of a line whose line ends became spaces: split before every vLLM record header but
    the first (text before the first header is a wrapper or the end of an earlier record, kept
    with it). [line] when the line holds fewer than two headers."""
    hs = [m.start() for m in _INLINE_HDR_RE.finditer(line)]
    if line[:1] != " " and _VLLM_RE.match(line):
        hs.insert(0, 0)
    if len(hs) < 2:
        return [line]
    out = [line[: hs[1]].rstrip()]
    for a, b in zip(hs[1:], [*hs[2:], len(line)], strict=True):
        out.append(line[a:b].rstrip())
    if out[0].strip() == "":
        out.pop(0)
    elif out[0][:1] == " " and _VLLM_RE.match(out[0].lstrip()):
        out[0] = out[0].lstrip()
    return out


def split_glued_records(line: str) -> list[str]:
    """Split a pasted line that holds several log records ("...from ATL2025:05:23-19:14:38:(172401)
    |CCL_WARN| ...", "loading(Worker_TP1 pid=3) ERROR ...") into one string per record, in order.
    A wrapper or a nested vLLM prefix before a record ("(APIServer pid=1) (EngineCore_DP0 pid=2)
    ERROR ...", "vllm-1  | (APIServer pid=1) ...") is not a second record.
    Records whose line ends became single spaces ("... ERROR 11-04 18:02:56 [x.py:1] a ERROR
    11-04 18:02:56 [x.py:1] b") are split before each vLLM record header too.
    Returns [line] when nothing is glued. Never raises."""
    starts = _glued_starts(line)
    if not starts:
        if " 0" in line or " 1" in line:  # cheap pre-check: a header holds " MM-DD"
            return _spaced_records(line)
        return [line]
    out: list[str] = []
    start = 0
    for i in starts:
        pre = line[start:i]
        if "\x1b" in pre:
            pre = _ANSI_RE.sub("", pre)
        # glued means no separator: a wrapper before a record ("vllm-1  | ", a `docker logs -t`
        # stamp, Ray's "(RayWorker pid=7) ", a nested prefix) ends in a space
        if pre.strip() and not pre[-1].isspace():
            out.append(line[start:i])
            start = i
    if not out:
        return [line]
    out.append(line[start:])
    return out


def _from_envelope(env: Envelope, raw: str, file: str | None, lineno: int | None) -> Event:
    """The Event of the record inside a syslog/journal/shipper envelope (see log_envelopes): a
    kernel record when the envelope says so, else the record read as a line of its own."""
    if env.kernel:
        ev = parse_kernel_record(env.text) or Event(source="kernel", text="", raw=raw)
    else:
        ev = _parse_line(env.text, file, lineno)
    ev.raw, ev.file, ev.line = raw, file, lineno
    if ev.time is None and env.time is not None:
        ev.time, ev.time_text = env.time, env.time_text
    if ev.source == "kernel" and ev.level is None:
        ev.level = env.level
    if ev.pid is None and env.pid is not None and ev.source != "kernel":
        ev.pid = env.pid
    return ev


def _kernel_after_prefix(text: str, raw: str) -> Event | None:
    """A kernel record behind a prefix of unknown shape, found by its anchor (see _ANCHOR_TAG_RE):
    "<relay stamp> host kern.err kernel: msg", "node7 | [ 551.424205] msg",
    "12:00:01 gpu-03 amdgpu 0000:03:00.0: msg"; None when there is no anchor in the first
    _ANCHOR_MAX characters, the prefix is a user-space logger's, or the text after a tag or a
    stamp anchor is not a kernel record (after a stamp: unless the prefix has a time of day)."""
    head = text[: _ANCHOR_MAX + 40]
    if "kernel" in head:
        m = _ANCHOR_TAG_RE.search(head)
        if (
            m
            and m.start() <= _ANCHOR_MAX
            and (_KERNEL_MSG_RE.match(text, m.end()) or _DMESG_RE.match(text, m.end()))
            and not _USERSPACE_PREFIX_RE.search(text, 0, m.start())
        ):
            return parse_kernel_record(text[m.end() :])
    if "] " in head:
        m = _ANCHOR_STAMP_RE.search(head)
        if (
            m
            and m.start() > 0
            and (_KERNEL_MSG_RE.match(text, m.end()) or _ANCHOR_TIME_RE.search(text, 0, m.start()))
            and not _USERSPACE_PREFIX_RE.search(text, 0, m.start())
        ):
            return parse_kernel_record(text[m.start() :])
    m = _ANCHOR_DRIVER_RE.search(head)
    if (
        m
        and m.start() > 0
        and _ANCHOR_TIME_RE.search(text, 0, m.start())
        and not _USERSPACE_PREFIX_RE.search(text, 0, m.start())
    ):
        return _kernel_event(text[m.start() :], raw, time_text=None)
    return None


def _strip_markdown(text: str) -> str:
    """Drop what a GitHub issue wraps around a pasted log line: quote marks ("> ", "> > ") and a
    code fence glued to the line ("```[Sun Mar 30 ...] msg", "```text"). A Python prompt (">>> ")
    is kept: it is part of the log."""
    while text[:1] == ">" and text[:3] != ">>>":
        text = text[2:] if text[1:2] == " " else text[1:]
    if text[:3] == "```":
        text = text[3:]
        if text.isalnum():  # the fence's language tag alone ("```text", "```log")
            return ""
    return text


def _leveled(
    rx: re.Pattern[str],
    source: str,
    text: str,
    raw: str,
    name: str | None,
    pid: int | None,
    file: str | None,
    lineno: int | None,
    wrap_time: str | None,
    wrap_dt: datetime | None,
) -> Event | None:
    """A line whose level prefix `rx` matches (group 1: the level), e.g. uvicorn's "INFO:     "
    or oneCCL's bare "|CCL_WARN| "; the text after it, with the wrappers already taken off."""
    m = rx.match(text)
    if not m:
        return None
    return Event(
        source=source,
        text=text[m.end() :],
        raw=raw,
        process=name,
        pid=pid,
        level=m.group(1),
        file=file,
        line=lineno,
        time_text=wrap_time,
        time=wrap_dt,
    )
