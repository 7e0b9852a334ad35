"""The kernel-log reader: `/dev/kmsg`, `journalctl -k`, `dmesg`, or a file; followed or read once.

The live `KernelWatcher` follows a source (`records()`), `xpu-serve npd check` reads one once
(`snapshot()`), and the bundle's kernel and versions collectors read the whole ring buffer
(`read_kmsg`) or, when it cannot be opened, the journal and dmesg (`snapshot_argv()` +
`frame_output()`). All of them frame with the same functions into the same `KernelRecord`.

What this module does (and does not):

- It *frames* kernel records (splits the stream into records, reads the sequence number and the
  boot-relative timestamp, converts it to wall time, keeps a look-back window and resynchronises
  after ring-buffer overruns). The *meaning* of a record (pid, comm, library, PCI device, fault
  kind) comes from the diagnose pipeline: `xpu_serve.events.parse_kernel_record` and the
  signature table (`xpu_serve.signatures`), so `up` and `diagnose` classify the same line the
  same way.
- It correlates a record's pid/comm with the live incarnation's processes (NSpid-aware) and a
  PCI address with a TP rank (best effort), see `Correlator` and `device_ranks`.

Formats read (sources of truth):

- `/dev/kmsg` (Linux Documentation/ABI/testing/dev-kmsg, kernel/printk/printk.c devkmsg_read):
  every read() returns exactly one record, `prio,seq,usec,flags[,...];message\\n` followed by
  optional continuation lines ` KEY=value\\n` (e.g. ` SUBSYSTEM=pci`, ` DEVICE=+pci:0000:47:00.0`);
  `prio` is `facility << 3 | level`; `usec` is microseconds since boot (printk's local_clock);
  non-printable bytes in the message are escaped as `\\xNN`. read() fails with EPIPE when the
  reader fell behind and records were overwritten (the next read() returns the oldest record
  still present), EAGAIN on O_NONBLOCK when there is nothing new, EINVAL when the buffer is too
  small. lseek(SEEK_DATA) goes to the first record after the last `dmesg -c`, SEEK_END to the
  end. poll() signals a new record.
- `journalctl -k -f -o json` (systemd.journal-fields(7)): one JSON object per line with
  `MESSAGE` (string, or a list of byte values when not UTF-8), `PRIORITY` (string "0".."7"),
  `_SOURCE_MONOTONIC_TIMESTAMP` (kernel timestamp, µs since boot) and `__REALTIME_TIMESTAMP`
  (µs since the epoch).
- `dmesg --follow` (util-linux dmesg(1)): `[  551.424205] message`.
- A file (config `watchers.kernel.source: file`, `path:`): any of the line shapes
  `parse_kernel_record` accepts, appended by another program (the simulator's `kernel=PATH`).

The framing is written here, not taken from a library: no maintained Python library reads
/dev/kmsg non-blocking with overrun handling, and the format is the domain itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xpu_serve import aio, procfs
from xpu_serve.events import Event
from xpu_serve.incarnation import ProcessInfo

KMSG_PATH = "/dev/kmsg"
# A kmsg record is at most LOG_LINE_MAX (1024 - 32) bytes of text plus the dictionary; CONSOLE_EXT_LOG_MAX
# is 8192. A read() with a smaller buffer fails with EINVAL, so read with more than that.
_KMSG_READ_SIZE = 16384
# The inode number of the initial pid namespace (include/linux/proc_ns.h: PROC_PID_INIT_INO).
PROC_PID_INIT_INO = 0xEFFFFFFC
# The kernel cuts a task's comm to TASK_COMM_LEN - 1 = 15 bytes (include/linux/sched.h).
TASK_COMM_LEN = 16

_KMSG_HEAD_RE = re.compile(r"^\s*(\d+),(\d+),(\d+),([^;]*);")
_DMESG_HEAD_RE = re.compile(r"^\s*(?:<(\d)>)?\[\s*(\d+)\.(\d+)\]\s?")
_PCI_RE = re.compile(r"\b([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\b", re.IGNORECASE)
_HEX_ESC_RE = re.compile(rb"\\x([0-9a-fA-F]{2})")

_LEVEL_NAMES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")


def level_name(prio: int | None) -> str | None:
    """Syslog level name ("err", "warning"...) of a kmsg/journal priority (facility bits ignored)."""
    if prio is None:
        return None
    return _LEVEL_NAMES[prio & 7]


def boot_offset() -> float:
    """Seconds to add to a boot-relative kernel time to get epoch seconds (the wall time of boot), measured now.

    CLOCK_REALTIME - CLOCK_BOOTTIME, as util-linux dmesg converts stamps (dmesg.c get_boot_time):
    it differs from printk's clock (local_clock, which stops while suspended) only after a
    suspend, which servers do not do.
    """
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def uptime_s() -> float:
    """Seconds since boot (CLOCK_BOOTTIME)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass
class KernelRecord:
    """One kernel record as framed by a source (meaning not yet parsed).

    Attributes:
        line: the line handed to `parse_kernel_record`: the record's first line exactly as the
            source gave it (kmsg `prio,seq,usec,flags;msg`, dmesg `[ sec.usec] msg`, a file's line).
        message: the message text alone (kmsg `\\xNN` escapes decoded).
        origin: "kmsg", "journalctl", "dmesg" or "file".
        seq: kmsg sequence number, or None.
        prio: syslog level 0..7 (facility stripped), or None.
        boot_s: seconds since boot, or None.
        wall: epoch seconds, or None when the source gives no time.
        fields: kmsg continuation ` KEY=value` lines (SUBSYSTEM, DEVICE...).
    """

    line: str
    message: str
    origin: str
    seq: int | None = None
    prio: int | None = None
    boot_s: float | None = None
    wall: float | None = None
    fields: dict[str, str] = field(default_factory=dict)

    def iso(self) -> str:
        """The record as `dmesg --time-format iso` prints it, on one line: "2026-11-30T09:04:12,123456+00:00
        msg" (local time zone); a newline inside the message (printk's multi-line records, e.g.
        amd_pstate's CPPC notice, as journald stores them) written as the kernel's own `\\x0a`
        escape (kernel/printk/printk.c). Only for a record with a `wall` time."""
        from datetime import datetime

        assert self.wall is not None, "iso() of a record without a wall time"
        stamp = datetime.fromtimestamp(self.wall).astimezone().strftime("%Y-%m-%dT%H:%M:%S,%f%z")
        msg = self.message.replace("\r", "\\x0d").replace("\n", "\\x0a")
        return f"{stamp[:-2]}:{stamp[-2:]} {msg}"


def unescape_kmsg(text: str) -> str:
    """Decode the kernel's `\\xNN` escapes in a kmsg message (printk.c: every byte < 0x20, >= 0x7f
    and the backslash itself is escaped), then UTF-8 (a multi-byte character is escaped byte by byte)."""
    if "\\x" not in text:
        return text
    raw = _HEX_ESC_RE.sub(lambda x: bytes((int(x.group(1), 16),)), text.encode("utf-8", "surrogateescape"))
    return raw.decode("utf-8", "replace")


def frame_kmsg(text: str, origin: str = "kmsg", offset: float | None = None) -> KernelRecord | None:
    """Frame one kmsg record `prio,seq,usec,flags;msg[\\n KEY=value]...` (decoded text).

    `offset` converts boot time to wall time (see `boot_offset`); None leaves `wall` unset.
    Returns None when the first line has no kmsg header.
    """
    first, _, rest = text.partition("\n")
    m = _KMSG_HEAD_RE.match(first)
    if not m:
        return None
    boot_s = int(m.group(3)) / 1e6
    fields: dict[str, str] = {}
    if rest:
        for cont in rest.split("\n"):
            if cont.startswith(" ") and "=" in cont:
                k, _, v = cont[1:].partition("=")
                fields[k] = v
    message = first[m.end() :]
    return KernelRecord(
        line=first,
        message=unescape_kmsg(message) if "\\x" in message else message,
        origin=origin,
        seq=int(m.group(2)),
        prio=int(m.group(1)) & 7,
        boot_s=boot_s,
        wall=None if offset is None else offset + boot_s,
        fields=fields,
    )


def parse_kmsg_frame(data: bytes, offset: float | None = None) -> KernelRecord | None:
    """Frame one `/dev/kmsg` read(): `prio,seq,usec,flags;msg\\n[ KEY=value\\n]...` (see `frame_kmsg`)."""
    return frame_kmsg(data.decode("utf-8", "replace"), "kmsg", offset)


def frame_text_line(line: str, origin: str, offset: float | None = None) -> KernelRecord:
    """Frame one text line from `dmesg`, a file or anything line-based.

    Reads the kmsg (`prio,seq,usec,flags;msg`) or dmesg (`[ sec.usec] msg`, also `<p>[...]` of
    `dmesg --raw`) header when there is one, for the sequence number and boot time; other shapes
    (`dmesg -T`, journalctl short, ISO) are passed on with no time (the parser reads their stamps).
    """
    line = line.rstrip("\r\n")
    rec = frame_kmsg(line, origin, offset)
    if rec is not None:
        return rec
    d = _DMESG_HEAD_RE.match(line)
    if d:
        boot_s = int(d.group(2)) + int(d.group(3)) / 10 ** len(d.group(3))
        return KernelRecord(
            line=line,
            message=line[d.end() :],
            origin=origin,
            prio=int(d.group(1)) if d.group(1) else None,
            boot_s=boot_s,
            wall=None if offset is None else offset + boot_s,
        )
    return KernelRecord(line=line, message=line, origin=origin)


def parse_journal_json(line: str) -> KernelRecord | None:
    """Frame one line of `journalctl -k -o json` output; None for non-JSON or non-message lines."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    msg = obj.get("MESSAGE")
    if isinstance(msg, list):  # non-UTF-8 messages come as a list of byte values
        try:
            msg = bytes(int(b) for b in msg).decode("utf-8", "replace")
        except (TypeError, ValueError):
            return None
    if not isinstance(msg, str):
        return None
    boot_s: float | None = None
    wall: float | None = None
    try:
        boot_s = int(obj["_SOURCE_MONOTONIC_TIMESTAMP"]) / 1e6
    except (KeyError, TypeError, ValueError):
        pass
    try:
        wall = int(obj["__REALTIME_TIMESTAMP"]) / 1e6
    except (KeyError, TypeError, ValueError):
        pass
    prio: int | None
    try:
        prio = int(obj.get("PRIORITY", ""))
    except ValueError:
        prio = None
    # Hand the parser the dmesg shape, which carries the kernel's own boot-relative stamp.
    text = f"[{boot_s:12.6f}] {msg}" if boot_s is not None else msg
    return KernelRecord(line=text, message=msg, origin="journalctl", prio=prio, boot_s=boot_s, wall=wall)


# --------------------------------------------------------------------------------------------
# Parsing and classification: delegated to the diagnose pipeline.


def _parse_line(line: str) -> Event | None:
    from xpu_serve import events

    parser: Callable[[str], Event | None] | None = getattr(events, "parse_kernel_record", None)
    if parser is None:  # the diagnose engineer's parser has not landed: keep the raw text
        return Event(source="kernel", text=line, raw=line)
    return parser(line)


_table: Any = None
_table_tried_at = -1e9


def _signature_table() -> Any:
    """The diagnose engineer's signature table (`xpu_serve.signatures.load_table()`), or None
    while it cannot be loaded (retried at most every 10 s)."""
    global _table, _table_tried_at
    if _table is not None:
        return _table
    now = time.monotonic()
    if now - _table_tried_at < 10.0:
        return None
    _table_tried_at = now
    from xpu_serve.signatures import SignatureError, load_table  # (imported on first use: heavy)

    try:
        _table = load_table()
    except (SignatureError, OSError):  # a malformed or unreadable table: classify nothing, keep watching
        _table = None
    return _table


def classify(ev: Event) -> None:
    """Fill ev.signature/role/cause (and the row's named groups into ev.extra) from the signature table."""
    if ev.signature is not None:
        return
    table = _signature_table()
    if table is None:
        return
    hit = table.match(ev)
    if hit is None:
        return
    sig, m = hit
    ev.signature, ev.role, ev.cause = sig.id, sig.role, sig.cause
    for k, v in m.groupdict().items():
        if v is not None:
            ev.extra.setdefault(k, v)


def to_event(rec: KernelRecord) -> Event | None:
    """Parse and classify one framed record into a kernel `Event` (None when the parser rejects it).

    Fills from the framing what the parser cannot know live: `seq`, wall `time` (naive local time),
    `extra["boot_s"]`, `extra["origin"]`, `extra["device"]` (PCI address from the message or the
    kmsg `DEVICE=+pci:` field) and the level name.
    """
    from datetime import datetime

    ev = _parse_line(rec.line)
    if ev is None:
        return None
    ev.source = "kernel"
    if rec.seq is not None:
        ev.seq = rec.seq
    if rec.wall is not None:
        # naive local time, like vLLM's own stamps and `xpu_serve.facts`, so the analysis can order them
        ev.time = datetime.fromtimestamp(rec.wall)
    if ev.level is None:
        ev.level = level_name(rec.prio)
    if rec.boot_s is not None:
        ev.extra.setdefault("boot_s", rec.boot_s)
    ev.extra.setdefault("origin", rec.origin)
    if not ev.extra.get("device"):
        dev = rec.fields.get("DEVICE", "")
        if dev.startswith("+pci:"):
            ev.extra["device"] = dev[5:]
        else:
            m = _PCI_RE.search(rec.message)
            if m:
                ev.extra["device"] = m.group(1).lower()
    classify(ev)
    return ev


# --------------------------------------------------------------------------------------------
# Sources


class KernelSource:
    """Base of the live kernel sources: an async stream of `KernelRecord`s.

    Attributes:
        kind: "kmsg", "journalctl", "dmesg", "file" or "none".
        reason: why this source was chosen (the fallbacks that failed), for `status`; None when
            the first choice worked.
        overruns: how many times the reader fell behind the kmsg ring buffer (EPIPE) and lost records.
    """

    kind = "none"

    def __init__(self, since_wall: float | None = None, reason: str | None = None):
        self.since_wall = since_wall
        self.reason = reason
        self.overruns = 0

    async def records(self) -> AsyncIterator[KernelRecord]:
        """Yield records until cancelled. The base (kind "none") yields nothing and waits forever."""
        await asyncio.Event().wait()
        if False:  # pragma: no cover  (makes this an async generator)
            yield KernelRecord(line="", message="", origin="none")

    def close(self) -> None:
        """Release the file descriptor or child process."""

    def drain(self) -> list[KernelRecord]:
        """Records already available now, without waiting (for a last look when the watch is
        cancelled: a crash record written just before the process died must not be lost)."""
        fn = getattr(self, "read_available", None)
        if fn is None:
            return []
        try:
            recs: list[KernelRecord] = fn()
        except OSError:
            return []
        return recs

    def snapshot(self) -> list[KernelRecord]:
        """Every record the source holds now (newer than `since_wall`), without following: a
        one-shot read (`xpu-serve npd check`). Raises OSError when the source cannot be read
        (for kind "none": its `reason`)."""
        raise OSError(errno.ENODEV, self.reason or "no kernel log source")

    def _keep(self, rec: KernelRecord) -> bool:
        return self.since_wall is None or rec.wall is None or rec.wall >= self.since_wall


class KmsgSource(KernelSource):
    """`/dev/kmsg`, non-blocking, woken by poll (asyncio add_reader = epoll on the fd).

    Starts at the first record still in the ring buffer (SEEK_DATA) and keeps only records newer
    than `since_wall` (the look-back window), then follows. Records with `seq <= after_seq` are
    skipped (set it to the last seq seen to resume across incarnations).

    Raises OSError from the constructor when /dev/kmsg cannot be opened (EPERM with
    kernel.dmesg_restrict=1 and no CAP_SYSLOG, ENOENT in some containers).
    """

    kind = "kmsg"

    def __init__(
        self,
        path: str = KMSG_PATH,
        since_wall: float | None = None,
        after_seq: int | None = None,
        reason: str | None = None,
    ):
        super().__init__(since_wall, reason)
        self.path = path
        self.after_seq = after_seq
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.lseek(self.fd, 0, os.SEEK_DATA if since_wall is not None else os.SEEK_END)
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise
        self.last_seq: int | None = None

    def read_available(self, limit: int = 100000, deadline: float | None = None) -> list[KernelRecord]:
        """Read every record available now (at most `limit`, until `time.monotonic()` passes
        `deadline`), without blocking.

        EPIPE (ring buffer overran this reader) is counted in `overruns` and reading goes on from
        the oldest record still present.
        """
        out: list[KernelRecord] = []
        if self.fd is None:
            return out
        offset = boot_offset()
        for _ in range(limit):
            if deadline is not None and time.monotonic() >= deadline:
                break
            try:
                data = os.read(self.fd, _KMSG_READ_SIZE)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:
                    self.overruns += 1
                    continue
                if e.errno == errno.EINTR:
                    continue
                raise
            if not data:
                break
            rec = parse_kmsg_frame(data, offset)
            if rec is None or rec.seq is None:
                continue
            self.last_seq = rec.seq
            if self.after_seq is not None and rec.seq <= self.after_seq:
                continue
            if self._keep(rec):
                out.append(rec)
        return out

    def snapshot(self) -> list[KernelRecord]:
        return self.read_available()

    async def records(self) -> AsyncIterator[KernelRecord]:
        if self.fd is None:
            return
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(self.fd, ready.set)
        try:
            while True:
                for rec in self.read_available(limit=1000):
                    yield rec
                ready.clear()
                # Re-check after clear: a record that arrived between the read and clear() must not wait.
                batch = self.read_available(limit=1000)
                if batch:
                    for rec in batch:
                        yield rec
                    continue
                await ready.wait()
        finally:
            if self.fd is not None:
                try:
                    loop.remove_reader(self.fd)
                except (ValueError, OSError):
                    pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_kmsg(path: str | os.PathLike[str] = KMSG_PATH, deadline: float | None = None) -> list[KernelRecord]:
    """Every record still in the kernel ring buffer (from its oldest), read from `/dev/kmsg`
    without blocking until `deadline` (`time.monotonic()` value) and without following.

    A regular file in the same format (as `cat /dev/kmsg` saves it: one record per line,
    continuation lines ` KEY=value` after it) is framed line by line. Raises OSError when it
    cannot be opened.
    """
    if not stat.S_ISCHR(os.stat(path).st_mode):
        return _read_kmsg_file(Path(path))
    src = KmsgSource(str(path), since_wall=0.0)
    try:
        return src.read_available(deadline=deadline)
    finally:
        src.close()


def _read_kmsg_file(path: Path) -> list[KernelRecord]:
    offset = boot_offset()
    out: list[KernelRecord] = []
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():
        if line.startswith(" ") and "=" in line and out:
            k, _, v = line[1:].partition("=")
            out[-1].fields[k] = v
            continue
        rec = frame_kmsg(line, "kmsg", offset)
        if rec is not None:
            out.append(rec)
    return out


class _ProcessSource(KernelSource):
    """A source that runs a follow command and frames its stdout lines."""

    argv: list[str] = []

    def __init__(self, since_wall: float | None = None, reason: str | None = None):
        super().__init__(since_wall, reason)
        self.proc: asyncio.subprocess.Process | None = None

    def _frame(self, line: str, offset: float) -> KernelRecord | None:
        raise NotImplementedError

    def snapshot_argv(self) -> list[str]:
        """The command without its follow flag: prints what the log holds now and exits."""
        return [a for a in self.argv if a not in ("-f", "--follow")]

    def frame_output(self, text: str) -> list[KernelRecord]:
        """Frame the output of `snapshot_argv()`, keeping records newer than `since_wall`."""
        offset = boot_offset()
        out = []
        for line in text.splitlines():
            rec = self._frame(line, offset)
            if rec is not None and self._keep(rec):
                out.append(rec)
        return out

    def snapshot(self, timeout_s: float = 30.0) -> list[KernelRecord]:
        """Run `snapshot_argv()` and frame what it prints. OSError when it fails or times out."""
        argv = self.snapshot_argv()
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise OSError(errno.ETIMEDOUT, f"{argv[0]} did not finish in {timeout_s:g} s") from e
        if r.returncode != 0:
            err = r.stderr.decode("utf-8", "replace").strip().splitlines()
            raise OSError(errno.EIO, f"{' '.join(argv)} exited {r.returncode}" + (f": {err[-1]}" if err else ""))
        return self.frame_output(r.stdout.decode("utf-8", "replace"))

    async def records(self) -> AsyncIterator[KernelRecord]:
        proc = self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            limit=1 << 20,
        )
        assert proc.stdout is not None
        try:
            while True:
                raw = await proc.stdout.readline()
                if not raw:
                    break
                rec = self._frame(raw.decode("utf-8", "replace"), boot_offset())
                if rec is not None and self._keep(rec):
                    yield rec
        finally:
            self.close()
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()  # our own child, by its pid
            with contextlib.suppress(Exception):
                await aio.wait_for(proc.wait(), 2.0)  # reap it and close its pipes

    def close(self) -> None:
        p = self.proc
        if p is not None and p.returncode is None:
            try:
                p.kill()  # our own child, by its pid
            except ProcessLookupError:
                pass
        self.proc = None


class JournalctlSource(_ProcessSource):
    """`journalctl -k -f -o json --since @<since_wall>` (the journal's copy of the kernel log)."""

    kind = "journalctl"

    def __init__(self, since_wall: float | None = None, reason: str | None = None):
        super().__init__(since_wall, reason)
        since = f"@{int(since_wall)}" if since_wall is not None else "now"
        self.argv = ["journalctl", "-k", "-f", "-o", "json", "--no-pager", "-q", "--since", since]

    def _frame(self, line: str, offset: float) -> KernelRecord | None:
        return parse_journal_json(line)


class DmesgSource(_ProcessSource):
    """`dmesg --follow` (prints the whole buffer first: the look-back filter drops the old part)."""

    kind = "dmesg"
    argv = ["dmesg", "--follow", "--nopager"]

    def _frame(self, line: str, offset: float) -> KernelRecord | None:
        if not line.strip():
            return None
        return frame_text_line(line, "dmesg", offset)


class FileSource(KernelSource):
    """Tail a file of kernel lines (any shape `parse_kernel_record` reads).

    Starts at the end of the file, minus a look-back: the last `lookback_bytes` are re-read and
    lines whose boot-relative time is older than `since_wall` (or that carry no time) are dropped.
    Follows appends by polling every `poll_s` seconds; a truncated or replaced (rotated) file is
    read again from its start; a file that does not exist yet is waited for. `from_start` reads
    an existing file whole (no time filter): a generic tail of any line-based log.
    """

    kind = "file"

    def __init__(
        self,
        path: str | os.PathLike[str],
        since_wall: float | None = None,
        poll_s: float = 0.05,
        lookback_bytes: int = 1 << 20,
        reason: str | None = None,
        from_start: bool = False,
    ):
        super().__init__(since_wall, reason)
        self.path = Path(path)
        self.poll_s = poll_s
        self.lookback_bytes = lookback_bytes
        self.from_start = from_start

        self._pos: int | None = None  # bytes of the file consumed (framed or in `_buf`)
        self._ino: int | None = None
        self._buf = b""
        self._skip_partial = False  # started mid-file: the first piece is the tail of a line
        self._lookback_end = 0  # bytes before this offset are look-back: kept only when new enough

    def read_available(self) -> list[KernelRecord]:
        """The complete lines appended since the last call (never blocks)."""
        out: list[KernelRecord] = []
        try:
            st: os.stat_result | None = self.path.stat()
        except OSError:
            st = None
        if st is None:
            if self._pos is None:
                self._pos = 0  # the file appears later: all of it is new
            return out
        if self._pos is None:
            if self.from_start:
                self._pos = 0
            elif self.since_wall is not None:
                self._pos = max(0, st.st_size - self.lookback_bytes)
                self._skip_partial = self._pos > 0
                self._lookback_end = st.st_size
            else:
                self._pos = st.st_size
            self._ino = st.st_ino
        elif st.st_ino != self._ino or st.st_size < self._pos:
            self._pos, self._ino, self._buf, self._skip_partial, self._lookback_end = (
                0,
                st.st_ino,
                b"",
                False,
                0,
            )
        if st.st_size <= self._pos:
            return out
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read(st.st_size - self._pos)
        except OSError:
            return out
        line_start = self._pos - len(self._buf)
        self._pos += len(chunk)
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        offset = boot_offset()
        for raw in lines:
            at = line_start
            line_start += len(raw) + 1
            if self._skip_partial:
                self._skip_partial = False
                continue
            text = raw.decode("utf-8", "replace")
            if not text.strip():
                continue
            rec = frame_text_line(text, "file", offset)
            if at < self._lookback_end and (rec.wall is None or not self._keep(rec)):
                continue
            out.append(rec)
        return out

    def snapshot(self) -> list[KernelRecord]:
        """The records of the file (from its start when `from_start`); OSError when it cannot be
        opened (a file that does not exist yet is not waited for here)."""
        with open(self.path, "rb"):
            pass
        return self.read_available()

    async def records(self) -> AsyncIterator[KernelRecord]:
        while True:
            for rec in self.read_available():
                yield rec
            await asyncio.sleep(self.poll_s)


# --------------------------------------------------------------------------------------------
# Choosing a source


def _probe(argv: list[str], timeout_s: float = 5.0) -> tuple[bool, str]:
    """Run a quick read-only probe command; (worked, why not)."""
    if shutil.which(argv[0]) is None:
        return False, f"{argv[0]} not found"
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{argv[0]}: {e}"
    if r.returncode != 0:
        err = r.stderr.decode("utf-8", "replace").strip().splitlines()
        return False, f"{' '.join(argv)} exited {r.returncode}" + (f": {err[-1]}" if err else "")
    if not r.stdout.strip():
        return False, f"{' '.join(argv)} printed nothing (no kernel records available)"
    return True, ""


def open_source(
    kind: str = "auto",
    path: str | None = None,
    since_wall: float | None = None,
    after_seq: int | None = None,
    kmsg_path: str = KMSG_PATH,
) -> KernelSource:
    """Open the kernel source for config `watchers.kernel.source` (`kind`).

    "auto" tries /dev/kmsg, then `journalctl -k`, then `dmesg`, then gives a "none" source whose
    `reason` says why each failed. An explicit kind that cannot work also gives "none" with the
    reason (never raises). "file" needs `path`.
    """
    reasons: list[str] = []
    if kind == "none":
        return KernelSource(since_wall, reason="kernel watch disabled by config (source: none)")
    if kind == "file":
        if not path:
            return KernelSource(
                since_wall, reason="watchers.kernel.source is file but watchers.kernel.path is not set"
            )
        return FileSource(path, since_wall=since_wall)
    if kind in ("auto", "kmsg"):
        try:
            return KmsgSource(kmsg_path, since_wall=since_wall, after_seq=after_seq)
        except OSError as e:
            reasons.append(f"{kmsg_path}: {e.strerror or e}")
    if kind in ("auto", "journalctl"):
        ok, why = _probe(["journalctl", "-k", "-n", "1", "-o", "json", "-q", "--no-pager"])
        if ok:
            return JournalctlSource(since_wall, reason="; ".join(reasons) or None)
        reasons.append(why)
    if kind in ("auto", "dmesg"):
        ok, why = _probe(["dmesg", "--raw"])
        if ok:
            return DmesgSource(since_wall, reason="; ".join(reasons) or None)
        reasons.append(why)
    return KernelSource(since_wall, reason="no kernel log source: " + "; ".join(reasons))


# --------------------------------------------------------------------------------------------
# Correlation with the live incarnation


GPU_DRIVERS = ("xe ", "i915 ")  # the kernel drivers whose records `is_gpu_fault` reads by wording


def is_gpu_fault(ev: Event, cause: str | None = None) -> bool:
    """An xe/i915 device fault record (engine reset, job timeout, page fault, GuC error, wedged):
    its cause (`ev.cause`, or `cause` when the caller classified it) is gpu-fault, or its wording."""
    if ev.cause == "gpu-fault" or cause == "gpu-fault":
        return True
    t = ev.text
    return t.startswith(GPU_DRIVERS) and any(
        w in t
        for w in ("Engine reset", "Timedout job", "page fault", "GuC", "wedged", "GPU HANG", "CAT error")
    )


def attributable(ev: Event, ours: bool, cause: str | None = None) -> bool:
    """The ownership rule of kernel records, live (KernelWatcher.handle) and offline (a bundle's
    kernel.log: analysis/kernel_owner.py): a record may be evidence of the incident when it is
    about one of the supervised tree's processes (`ours`: `Correlator.match`), names no pid, or
    is a GPU device fault (device-wide: whichever job it names, the device is the tree's). Another
    program's segfault, trap or OOM kill (a pid that is not the tree's) is not."""
    return ours or ev.pid is None or is_gpu_fault(ev, cause)


def comm_of_title(title: str) -> str:
    """The kernel's comm for a process title: cut to 15 bytes ("VLLM::Worker_TP0" -> "VLLM::Worker_TP")."""
    return title.encode("utf-8")[: TASK_COMM_LEN - 1].decode("utf-8", "ignore")


def expected_comm(info: ProcessInfo) -> str:
    """The comm vLLM's process of this role has: `VLLM::<name>` cut to 15 bytes; "vllm" for the API server."""
    if info.name == "APIServer":
        return "vllm"
    return comm_of_title(f"VLLM::{info.name}")


def in_initial_pid_namespace() -> bool:
    """True when this process sees pids as the kernel log prints them (the initial pid namespace)."""
    try:
        link = os.readlink("/proc/self/ns/pid")
    except OSError:
        return True
    return link == f"pid:[{PROC_PID_INIT_INO}]"


@dataclass
class Correlation:
    """Which of our processes a kernel record is about.

    Attributes:
        ours: True when the record is about one of the incarnation's processes.
        info: that process when it could be told apart, else None (e.g. several workers share
            the comm `VLLM::Worker_TP` and the namespaces differ).
        by: "pid" (same pid namespace), "nspid" (matched an NSpid entry), "comm+time", or None.
        note: what could not be settled, for the incident's notes.
    """

    ours: bool
    info: ProcessInfo | None = None
    by: str | None = None
    note: str | None = None


class Correlator:
    """Match kernel records' pid/comm to the live incarnation's processes.

    Refresh with `update(processes)` whenever the tree changes: it caches each live process's
    comm and NSpid list (a dead process's /proc entry is gone by the time its segfault line is
    read). Matching: by pid (also against every NSpid entry) when the comm agrees; when this
    process is not in the initial pid namespace the kernel prints host pids we cannot see, so
    then by comm and time (the record must be newer than `started_at - slack_s`).
    """

    def __init__(self, started_at: float | None = None, slack_s: float = 2.0, initial_ns: bool | None = None):
        self.started_at = started_at
        self.slack_s = slack_s
        self.initial_ns = in_initial_pid_namespace() if initial_ns is None else initial_ns
        self.comm: dict[int, str] = {}
        self.nspids: dict[int, list[int]] = {}
        self.processes: dict[int, ProcessInfo] = {}

    def update(self, processes: dict[int, ProcessInfo]) -> None:
        """Take the current process map (pid -> info) and cache comm/NSpid of the live ones."""
        self.processes = dict(processes)
        for pid, info in processes.items():
            if pid not in self.comm:
                c = procfs.comm(pid)
                self.comm[pid] = c if c is not None else expected_comm(info)
            if pid not in self.nspids:
                ns = procfs.nspids(pid)
                if ns:
                    self.nspids[pid] = ns

    def match(self, pid: int | None, comm: str | None, wall: float | None) -> Correlation:
        """Correlate a kernel record's pid, comm (as printed, <= 15 bytes) and wall time."""
        if self.started_at is not None and wall is not None and wall < self.started_at - self.slack_s:
            return Correlation(False, note="record older than this incarnation")
        if pid is not None:
            info = self.processes.get(pid)
            if info is not None and (
                comm is None
                or self.comm.get(pid) in (comm, None)
                or comm_of_title(comm) == self.comm.get(pid)
            ):
                return Correlation(True, info, "pid")
            for our_pid, ns in self.nspids.items():
                if pid in ns and our_pid in self.processes:
                    cand = self.processes[our_pid]
                    if comm is None or self.comm.get(our_pid) == comm:
                        return Correlation(True, cand, "nspid")
        if self.initial_ns or comm is None:
            return Correlation(False)
        cands = [info for p, info in self.processes.items() if self.comm.get(p) == comm]
        if not cands:
            return Correlation(False)
        if wall is None and self.started_at is not None:
            return Correlation(False, note=f"comm {comm} matches but the record has no time")
        if len(cands) == 1:
            return Correlation(
                True,
                cands[0],
                "comm+time",
                note=f"kernel pid {pid} is a host pid; matched {cands[0].name} by comm and time",
            )
        dead = [c for c in cands if c.signal or c.exit_code is not None]
        if len(dead) == 1:
            return Correlation(
                True,
                dead[0],
                "comm+time",
                note=f"kernel pid {pid} is a host pid; matched {dead[0].name} by comm, time and its exit",
            )
        names = ", ".join(sorted(c.name for c in cands))
        return Correlation(
            True,
            None,
            "comm+time",
            note=f"kernel pid {pid} ({comm}) is a host pid shared by comm with {names}: rank unknown",
        )


def parse_affinity_mask(mask: str) -> list[int] | None:
    """`ZE_AFFINITY_MASK` ("0,1,2,3", "0.0,1.0" device.sub-device) -> device indices; None if malformed."""
    out: list[int] = []
    for part in mask.split(","):
        part = part.strip()
        if not part:
            continue
        head = part.split(".", 1)[0]
        if not head.isdigit():
            return None
        if int(head) not in out:
            out.append(int(head))
    return out or None


def drm_pci_devices(
    sysfs: str | os.PathLike[str] = "/sys/class/drm", drivers: Iterable[str] = ("xe", "i915")
) -> list[str]:
    """PCI addresses of the GPUs bound to `drivers`, from /sys/class/drm/card*/device, sorted.

    Level Zero enumerates devices in PCI order by default (ZE_ENABLE_PCI_ID_DEVICE_ORDER); that
    is the assumption behind `device_ranks`.
    """
    root = Path(sysfs)
    found: set[str] = set()
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for card in entries:
        if not re.fullmatch(r"card\d+", card.name):
            continue
        dev = card / "device"
        try:
            pci = os.path.basename(os.path.realpath(dev))
            drv = os.path.basename(os.path.realpath(dev / "driver"))
        except OSError:
            continue
        if _PCI_RE.fullmatch(pci) and drv in drivers:
            found.add(pci.lower())
    return sorted(found)


def device_ranks(
    tp_size: int, affinity_mask: str | None, sysfs: str | os.PathLike[str] = "/sys/class/drm"
) -> tuple[dict[str, int], str]:
    """Best-effort PCI address -> TP rank map, and how it was made (or why it is unknown).

    Rank r uses the r-th visible device (vLLM's local_rank); with ZE_AFFINITY_MASK the visible
    devices are the mask's entries in order; devices are numbered in PCI order (see
    `drm_pci_devices`). Returns ({}, reason) when the GPUs cannot be listed.
    """
    pcis = drm_pci_devices(sysfs)
    if not pcis:
        return {}, f"device to rank unknown: no xe/i915 GPU under {sysfs}"
    order = list(range(len(pcis)))
    how = "PCI order of /sys/class/drm (best effort)"
    if affinity_mask:
        mask = parse_affinity_mask(affinity_mask)
        if mask is None:
            return {}, f"device to rank unknown: ZE_AFFINITY_MASK={affinity_mask!r} not understood"
        order = mask
        how = f"ZE_AFFINITY_MASK={affinity_mask} over the PCI order of /sys/class/drm (best effort)"
    out: dict[str, int] = {}
    for rank in range(min(tp_size, len(order))):
        idx = order[rank]
        if 0 <= idx < len(pcis):
            out[pcis[idx]] = rank
    return out, how
