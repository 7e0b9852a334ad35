"""Log envelopes: the wrappers a syslog relay, the journal or a log shipper puts around a record.

`unwrap(text)` takes one line and returns an `Envelope`: the record inside (the text the program
or the kernel printed), whether the envelope says it is a kernel record, and the time, level,
host and pid the envelope carries. `xpu_serve.events.parse_line` then reads the record itself
with its own shapes. None means the line is not in any envelope known here.

Envelopes (sources of truth):

- RFC 5424 (syslog protocol): `<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID SD [MSG]`, each
  header field "-" when absent, STRUCTURED-DATA "-" or `[id k="v" ...]...`, MSG optionally after
  a UTF-8 BOM. The kernel's records have APP-NAME "kernel" (rsyslog's imklog, syslog-ng).
- RFC 3164 (BSD syslog) as relayed over the network: `<PRI>Mmm dd hh:mm:ss HOST TAG: MSG`; rsyslog
  with RFC 3339 stamps writes `<PRI>2026-01-02T03:04:05+00:00 HOST TAG: MSG`. PRI is
  facility * 8 + severity; facility 0 is kern. Only the PRI is taken off here; the stamp and
  tag are read by `parse_line` like a local syslog file's.
- `dmesg -x` / `--decode` (util-linux): `kern  :err   : [  551.424205] msg`.
- journald export format (systemd JOURNAL_EXPORT_FORMATS): one `FIELD=value` per line, records
  separated by an empty line; the text is the `MESSAGE=` line (binary fields, length-prefixed,
  are not text and are skipped).
- JSON lines of log shippers: `journalctl -o json` (MESSAGE, _TRANSPORT "kernel",
  SYSLOG_IDENTIFIER, __REALTIME_TIMESTAMP in µs, MESSAGE as a byte list when not UTF-8), docker's
  json-file driver and fluent-bit/Fluentd (`log`, `time`), Vector and CloudWatch (`message`,
  `timestamp`), Loki/Elastic (`message`/`msg`, `@timestamp`), Google Cloud Logging LogEntry
  (`textPayload` or `jsonPayload.message`/`jsonPayload.MESSAGE`, `timestamp` RFC 3339,
  `severity`), process wrappers that emit `{"event": "line", "data": ...}`, Kubernetes node-problem-detector style `{"kind": ..., "message": ...}`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone

_KPRIO = ("EMERG", "ALERT", "CRIT", "ERR", "WARNING", "NOTICE", "INFO", "DEBUG")

_RFC5424_RE = re.compile(
    r"<(\d{1,3})>1 (\S+) (\S+) (\S+) (\S+) (\S+) (?:-|(?:\[(?:[^\]\\]|\\.)*\])+)(?: \ufeff?|$)"
)
_PRI_RE = re.compile(r"<(\d{1,3})>(?=[A-Za-z\d])")
_DECODE_RE = re.compile(
    r"(kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:"
    r"(emerg|alert|crit|err|warn|notice|info|debug)\s*: "
)
# where a shipper's JSON object keeps the text, in the order tried (dotted: a nested object)
MESSAGE_KEYS = (
    "MESSAGE", "message", "log", "msg", "data", "textPayload", "jsonPayload.message", "jsonPayload.MESSAGE"
)
_TIME_KEYS = ("__REALTIME_TIMESTAMP", "timestamp", "time", "@timestamp", "ts", "date")


@dataclass
class Envelope:
    """What an envelope says about the record inside it.

    Attributes:
        text: the record inside (one line, no line end).
        kernel: True when the envelope marks it a kernel record (APP-NAME/TAG "kernel", facility
            kern, journal _TRANSPORT "kernel"); False when it says nothing or names another program.
        level: the kernel-style level name ("ERR") from PRI/severity, or None.
        time: wall time from the envelope, or None; time_text: that stamp as written.
        pid: PROCID / _PID when given.
    """

    text: str
    kernel: bool = False
    level: str | None = None
    time: datetime | None = None
    time_text: str | None = None
    pid: int | None = None


def unwrap(text: str) -> Envelope | None:
    """The record inside one line's envelope (see the module docstring), or None when the line
    has none of these envelopes. Never raises."""
    c = text[:1]
    try:
        if c == "<":
            return _syslog(text)
        if c == "{":
            return _json_line(text)
        if c == "M" and text.startswith("MESSAGE="):
            return Envelope(text=text[8:]) if text[8:].strip() else None
        if c.islower():
            m = _DECODE_RE.match(text)
            if m:
                return Envelope(text=text[m.end() :], kernel=m.group(1) == "kern", level=m.group(2).upper())
    except (ValueError, TypeError, RecursionError):
        return None
    return None


def _iso(ts: str) -> datetime | None:
    try:
        t = datetime.fromisoformat(ts.replace("Z", "+00:00").replace(",", "."))
    except ValueError:
        try:
            t = datetime.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")
        except ValueError:
            return None
    return t.astimezone(timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def _syslog(text: str) -> Envelope | None:
    m = _RFC5424_RE.match(text)
    if m:
        pri, ts, _host, app, procid = int(m.group(1)), m.group(2), m.group(3), m.group(4), m.group(5)
        t = _iso(ts) if ts != "-" else None
        return Envelope(
            text=text[m.end() :],
            kernel=app == "kernel" or (app == "-" and pri >> 3 == 0),
            level=_KPRIO[pri & 7],
            time=t,
            time_text=ts.replace("T", " ") if t else None,
            pid=int(procid) if procid.isdigit() else None,
        )
    m = _PRI_RE.match(text)
    if m and text[m.end() : m.end() + 1] != "[":  # "<3>[ 12.3] msg" is `dmesg --raw`: the kernel's own
        pri = int(m.group(1))
        return Envelope(text=text[m.end() :], kernel=False, level=_KPRIO[pri & 7])
    return None


def _field(obj: dict[str, object], key: str) -> object:
    cur: object = obj
    for part in key.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _json_line(text: str) -> Envelope | None:
    obj = json.loads(text)
    if not isinstance(obj, dict):
        return None
    msg: object = None
    for k in MESSAGE_KEYS:
        msg = _field(obj, k)
        if msg is not None:
            break
    if isinstance(msg, list):  # journald: a message that is not UTF-8 comes as its byte values
        msg = bytes(int(b) & 0xFF for b in msg).decode("utf-8", "replace")
    if not isinstance(msg, str) or not msg.strip():
        return None
    msg = msg.rstrip("\r\n")
    if "\n" in msg:  # a multi-line entry (a traceback in one object): its last line carries the error
        msg = msg.rsplit("\n", 1)[1]
    kernel = obj.get("_TRANSPORT") == "kernel" or obj.get("SYSLOG_IDENTIFIER") == "kernel"
    level = None
    prio = obj.get("PRIORITY")
    if isinstance(prio, (str, int)) and str(prio).isdigit():
        level = _KPRIO[int(prio) & 7]
    t, tt = _json_time(obj)
    pid = obj.get("_PID")
    return Envelope(
        text=msg, kernel=kernel, level=level, time=t, time_text=tt,
        pid=int(pid) if isinstance(pid, (str, int)) and str(pid).isdigit() else None,
    )


def _json_time(obj: dict[str, object]) -> tuple[datetime | None, str | None]:
    for k in _TIME_KEYS:
        v = obj.get(k)
        if v is None:
            continue
        if isinstance(v, str) and not v.isdigit():
            t = _iso(v)
        else:
            try:
                n = int(v)  # type: ignore[call-overload]
            except (TypeError, ValueError):
                continue
            # µs (journal), ms (CloudWatch) or s since the epoch, told apart by magnitude
            secs = n / 1e6 if n > 1e14 else n / 1e3 if n > 1e11 else float(n)
            try:
                t = datetime.fromtimestamp(secs, timezone.utc).replace(tzinfo=None)
            except (OverflowError, OSError, ValueError):
                t = None
        if t is not None:
            return t, t.strftime("%Y-%m-%d %H:%M:%S.%f")
    return None, None
