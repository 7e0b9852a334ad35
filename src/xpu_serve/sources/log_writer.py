"""The log pump's line writer: queued chunks and relay frames -> numbered lines in every output.

`PumpWriter.process(items)` takes the pump's queue items ``(kind, stream, data, a, b)`` (the
relay's frame kinds, `xpu_serve.sources.log_relay`, plus `FALLBACK`), splits each stream's bytes
into lines (CR and CRLF -> LF, a partial last line held per stream, lines over `max_line_bytes`
cut and ended with `` [xpu-serve] line truncated: N bytes dropped``), numbers them in the
incarnation's logical ``vllm.log`` (`lineno`, 1-based, rotated parts oldest first), replaces
known secrets by ``***`` and writes, per batch and in this order: ``vllm.log`` (thread fallback
only; in relay mode the relay wrote it), the per-process files (`log_demux.Demux`), the echo
(`log_echo.Echo`), then `on_line(line, lineno)`. Lines whose forwarding was dropped are counted
and marked in every per-process file and the echo. Writer thread only; the counters may be read
from any thread.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from xpu_serve.sources import log_relay
from xpu_serve.sources.log_demux import Batch, Demux
from xpu_serve.sources.log_echo import Echo
from xpu_serve.sources.log_files import RotatingFile, Sink

OnLine = Callable[[str, int], None]

# Queue items: (kind, stream, data, a, b), kinds of the relay's frames (see log_relay) and
# FALLBACK (queue only): the relay died, the writer writes vllm.log from here on.
DATA, DROP, EOF, ACK, ROT, MARK = log_relay.DATA, log_relay.DROP, log_relay.EOF, log_relay.ACK, log_relay.ROT, log_relay.MARK
ERR, LOGOK, LOGMISS, UDATA, UDROP = log_relay.ERR, log_relay.LOGOK, log_relay.LOGMISS, log_relay.UDATA, log_relay.UDROP
FALLBACK = 11
Item = tuple[int, int, bytes | memoryview, int, int]  # (data: memoryview for a cut frame)

_MAX_PROCESS_FILES = 64  # distinct per-process files before falling back to unprefixed.log
_SAFE_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]")


class PumpWriter:
    """Lines out of queue items, into the files, the echo and the callback (see the module doc).

    Args:
        log_dir, max_bytes, backups, retry_interval_s: the files (`log_files`).
        max_line_bytes: longer lines are cut here (and marked).
        on_line: the callback, or None.
        secrets: byte values replaced by ``***`` (longest first, no CR/LF).
        echo: the echo queue (its notices also report disk errors).
        pending_timeout_s: held early Worker/oneCCL lines wait this long (`Demux`).
    """

    def __init__(
        self,
        log_dir: Path,
        max_bytes: int,
        backups: int,
        retry_interval_s: float,
        max_line_bytes: int,
        on_line: OnLine | None,
        secrets: list[bytes],
        echo: Echo,
        pending_timeout_s: float,
    ) -> None:
        self.log_dir = log_dir
        self.max_bytes = max_bytes
        self.backups = backups
        self.retry_interval_s = retry_interval_s
        self.max_line_bytes = max_line_bytes
        self.on_line = on_line
        self.secrets = secrets
        self.echo = echo
        self.demux = Demux(pending_timeout_s, self._write_dest)
        self._carry: dict[int, bytes] = {}
        self._cut: dict[int, int] = {}  # stream -> bytes dropped from a line being truncated
        self._sinks: dict[str, Sink] = {}
        self._lineno = 0
        self._unlogged = False  # process(): the lines being fed are not in vllm.log (UDATA)
        self._callback_reported = False
        self._dest_names: set[str] = set()  # per-process outputs seen so far (drop markers)
        # Counters (PumpStats).
        self.lines = 0
        self.dropped_lines = 0
        self.dropped_bytes = 0
        self.write_errors = 0
        self.truncated = 0
        self.callback_errors = 0
        self.log_missed = 0
        self.acked = 0  # highest flush sequence processed (ACK items)
        # vllm.log's line bookkeeping (`locate`): written through in thread mode; in relay mode
        # the relay writes the file and the writer only keeps `lines` and `starts` from frames.
        self.vlog = RotatingFile(log_dir / "vllm.log", max_bytes, backups)
        self.relay_log = False  # the relay writes vllm.log (in queue order)

    # SinkReport
    def notice(self, msg: str) -> None:
        self.echo.notice(msg)

    def write_error(self) -> None:
        self.write_errors += 1

    def missed(self, nlines: int, vllm_log: bool) -> None:
        if vllm_log:
            self.log_missed += nlines

    def process(self, items: list[Item]) -> None:
        """Turn queued chunks and frames into lines and write them."""
        out = Batch()
        i = 0
        while i < len(items):
            kind, s, data, nlines, nbytes = items[i]
            i += 1
            if kind == DATA or kind == UDATA:
                # Coalesce consecutive chunks of the same stream (and kind: UDATA, lines that
                # vllm.log could not take, take no numbers of their own).
                parts = [data]
                while i < len(items) and items[i][0] == kind and items[i][1] == s:
                    parts.append(items[i][2])
                    i += 1
                self._unlogged = kind == UDATA
                self._feed(out, s, b"".join(parts) if len(parts) > 1 else data)
                self._unlogged = False
            elif kind == EOF:
                rest = self._carry.pop(s, b"")
                cut = self._cut.pop(s, 0)
                if rest.endswith(b"\r"):
                    rest = rest[:-1]
                if rest or cut:
                    self._emit(out, self._finish_line(rest, cut))
            elif kind == ACK or kind == FALLBACK:
                self._write_batch(out)  # everything before it is on disk before flush() returns
                out = Batch()
                if kind == ACK:
                    self.acked = max(self.acked, nlines)
                else:
                    self.relay_log = False
                    self.vlog.lines = self._lineno
            else:
                self._control(out, kind, s, nlines, nbytes)
        self._write_batch(out)

    def _control(self, out: Batch, kind: int, s: int, a: int, b: int) -> None:
        """A frame without lines: drops, rotation, markers, vllm.log's errors."""
        if kind == DROP and self.relay_log:
            # Whole lines the relay wrote to vllm.log but did not forward: they take their
            # numbers; the per-process files and the echo say where to find them.
            first = self._lineno + 1
            self._lineno += a
            self._not_forwarded(out, a, b, f"vllm.log has them (lines {first}-{self._lineno})")
        elif kind == UDROP:
            # Neither forwarded nor in vllm.log (a disk error): no line numbers.
            self._not_forwarded(out, a, b, "vllm.log could not take them either (write error)")
        elif kind == DROP:
            # The stream's held partial line was cut by the drop: it goes too (its newline,
            # in the dropped bytes, is already in a).
            b += len(self._carry.pop(s, b"")) + self._cut.pop(s, 0)
            self.dropped_lines += a
            self.dropped_bytes += b
            self.log_missed += a
            self._marker(out, f"[xpu-serve] dropped {a} lines ({b} bytes): log writer could not keep up")
        elif kind == ROT:
            self.vlog.rotated(self._lineno)
        elif kind == MARK:
            self._lineno += a
        elif kind == ERR:
            if a:
                self.write_errors += 1
            if b:  # first failure of a period
                err = f"[Errno {a}] {os.strerror(a)}"
                self.echo.notice(
                    f"log write to {self.vlog.path} failed: {err}; going on without it "
                    "(per-process files, echo and analysis continue)"
                )
        elif kind == LOGOK:
            self.log_missed += a
            self.echo.notice(f"log file {self.vlog.path} writable again ({a} lines missed)")
        elif kind == LOGMISS:
            self.log_missed += a

    def _feed(self, out: Batch, s: int, chunk: bytes | memoryview) -> None:
        data = self._carry.pop(s, b"") + chunk
        cut = self._cut.pop(s, 0)
        if b"\r" in data:
            hold = b""
            if data.endswith(b"\r"):
                data, hold = data[:-1], b"\r"  # may be the CR of a CRLF split across reads
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + hold
        nl = data.rfind(b"\n")
        if nl < 0:
            self._hold(s, data, cut)
            return
        body, rest = data[:nl], data[nl + 1 :]
        if cut or len(body) > self.max_line_bytes:
            lines = body.split(b"\n")
            if cut:
                lines[0] = self._finish_line(lines[0], cut)
            if max(map(len, lines)) > self.max_line_bytes:
                lines = [self._finish_line(ln, 0) if len(ln) > self.max_line_bytes else ln for ln in lines]
            body = b"\n".join(lines)
        self._emit(out, body)
        self._hold(s, rest, 0)

    def _hold(self, s: int, data: bytes, cut: int) -> None:
        """Keep a partial line; beyond max_line_bytes keep only its head and count the rest."""
        if len(data) > self.max_line_bytes:
            cut += len(data) - self.max_line_bytes
            data = data[: self.max_line_bytes]
        if data:
            self._carry[s] = data
        if cut:
            self._cut[s] = cut

    def _finish_line(self, line: bytes, cut: int) -> bytes:
        if len(line) > self.max_line_bytes:
            cut += len(line) - self.max_line_bytes
            line = line[: self.max_line_bytes]
        if cut:
            self.truncated += 1
            line += f" [xpu-serve] line truncated: {cut} bytes dropped".encode()
        return line

    def _emit(self, out: Batch, body: bytes) -> None:
        """Queue engine lines (`body`: lines joined by LF, no final LF) for every output."""
        for sec in self.secrets:  # (relay mode: already replaced there; this covers the fallback)
            if sec in body:
                body = bytes(body).replace(sec, b"***")
        tlines = body.decode("utf-8", "replace").split("\n")
        if not self.relay_log:  # (else the relay wrote them to vllm.log already)
            out.vllm.append(body)
            out.vllm.append(b"\n")
            out.vllm_lines += len(tlines)
        if self._unlogged:  # (not in vllm.log: the number of the next line written there)
            out.text.append((self._lineno + 1, tlines, 0))
        else:
            out.text.append((self._lineno + 1, tlines, 1))
        if self.echo.stream is not None:
            piece = self.echo.piece(tlines)
            if piece is not None:
                out.echo.append(piece)
        if not self._unlogged:
            self._lineno += len(tlines)
        self.lines += len(tlines)
        self.demux.demux(out, tlines)

    def _not_forwarded(self, out: Batch, nlines: int, nbytes: int, where: str) -> None:
        """Count lines the relay did not forward and mark the spot in every per-process file
        and the echo ("... dropped N lines (B bytes) here: ...; `where`")."""
        self.dropped_lines += nlines
        self.dropped_bytes += nbytes
        msg = (
            f"[xpu-serve] dropped {nlines} lines ({nbytes} bytes) here: the supervisor could not "
            f"keep up; {where}"
        )
        for name in self._dest_names | set(out.dest) or {"unprefixed"}:
            out.list_for(name).append(msg)
        out.echo.append(self.echo.tag + msg + "\n")

    def _marker(self, out: Batch, msg: str) -> None:
        out.vllm.append(msg.encode() + b"\n")
        out.vllm_lines += 1
        self._lineno += 1
        out.echo.append(self.echo.tag + msg + "\n")

    def _sink(self, name: str) -> Sink:
        sink = self._sinks.get(name)
        if sink is None:
            if len(self._sinks) >= _MAX_PROCESS_FILES + 1 and name not in ("vllm.log", "unprefixed.log"):
                return self._sink("unprefixed.log")
            file = self.vlog if name == "vllm.log" else RotatingFile(self.log_dir / name, self.max_bytes, self.backups)
            sink = self._sinks[name] = Sink(file, self.retry_interval_s, self)
        return sink

    def _write_batch(self, out: Batch) -> None:
        if self.relay_log:
            self.vlog.lines = self._lineno  # all of them are in vllm.log (locate)
        if out.vllm:
            self._sink("vllm.log").write(b"".join(out.vllm), out.vllm_lines)
        self._write_dest(out)
        # Echo (engine lines and markers, tagged, in order), then the callback.
        self.echo.put(out.echo)
        if self.on_line is not None:
            for first, tlines, step in out.text:
                self._call_back(tlines, first, step)

    def _call_back(self, tlines: list[str], first: int, step: int = 1) -> None:
        cb = self.on_line
        assert cb is not None
        k = 0
        while k < len(tlines):
            try:
                for line in tlines[k:] if k else tlines:
                    cb(line, first + k * step)
                    k += 1
            except Exception as e:  # the callback is the supervisor's; never stop the pump
                k += 1
                self.callback_errors += 1
                if not self._callback_reported:
                    self._callback_reported = True
                    self.echo.notice(f"on_line callback raised {type(e).__name__}: {e}")

    def _write_dest(self, out: Batch) -> None:
        for name, lines in out.dest.items():
            if not lines:
                continue
            self._dest_names.add(name)
            fname = name + ".log" if name != "unprefixed" else "unprefixed.log"
            fname = _SAFE_NAME_RE.sub("_", fname)
            data = ("\n".join(lines) + "\n").encode("utf-8", "replace")
            self._sink(fname).write(data, len(lines))

    def close(self) -> None:
        for sink in self._sinks.values():
            sink.close()
