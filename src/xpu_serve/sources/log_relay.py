"""Log relay: a standalone program that drains the engine's pipes into ``vllm.log`` and forwards
the same lines as frames to the supervisor (`xpu_serve.sources.log_pump.LogPump` starts it).

Standard library only, one thread, run in its own interpreter and session::

    python -I -S log_relay.py xpu-serve-log-relay CAP_BYTES OUT_FD CTL_FD ACK_FD LOG_PATH
        MAX_BYTES BACKUPS RETRY_S HOLD_BYTES STATE_FD IN_FD...

stdin: the known secret values, hex, one per line, until EOF (empty: none); they are replaced by
``***`` in every line before it is written or forwarded (never on the argv, which /proc shows to
every user). SIGINT, SIGTERM and SIGHUP are ignored. Exit status 0 on every path below.

Per read() it does only what keeps ``vllm.log`` whole lines: CR -> LF, hold each stream's partial
last line (longer than HOLD_BYTES: written out split), rotate at a line end before the file passes
MAX_BYTES (``vllm.log`` -> ``.1`` ... ``.<BACKUPS>``); no per-line Python loop. ``vllm.log`` and its
rotations are named relative to the directory held open here, so a relay draining an orphan's
pipes goes on in that directory after it was moved (``logs/N`` -> ``logs/N.prev``); a deleted
``vllm.log`` (or its directory) is noticed within a second and made again. A disk error closes the
file, counts the lines it misses and retries every RETRY_S seconds, then writes a marker line.

Forwarding (OUT_FD, frames `FRAME` = kind, stream, a, b; DATA/UDATA followed by `a` payload bytes):

- DATA (stream, len): whole lines exactly as written to ``vllm.log``, in its order;
- DROP (lines, bytes): written to ``vllm.log``, not forwarded: the supervisor's end held more than
  CAP_BYTES (forwarding resumes below CAP_BYTES / 2, after the dropped lines are counted, which
  happens when the input is calm, under ~100 MB/s, read back from the file);
- UDATA (stream, len), UDROP (lines, bytes): the same for lines ``vllm.log`` could not take;
- EOF (stream); ACK (flush sequence); ROT: ``vllm.log`` was rotated here; MARK (lines): a marker
  of that many lines was written here; ERR (errno, 1 = first failure of a period);
  LOGOK (lines missed, errno): writable again; LOGMISS (lines missed, errno): the last stream
  ended while ``vllm.log`` still failed.

While the forwarding drops (or the supervisor is gone) and there are no secrets, the pipes move
into ``vllm.log`` by `os.splice` (no copy; CRs kept; a stream whose splice stopped mid-line owns
the file until its line ends, another stream waits at most `OWN_WAIT` before that line is ended
with LF; a splice stops `MARGIN` short of MAX_BYTES so the read path rotates at a line end).

Control (CTL_FD): ``F`` + 8-byte big-endian sequence: read what the pipes hold into ``vllm.log``,
write the sequence to ACK_FD and send ACK; ``Q`` + 8 bytes then EOF: drain, send EOF frames,
exit. EOF without ``Q`` (the supervisor died) or a broken OUT_FD: stop forwarding, keep draining
into ``vllm.log`` until the pipes reach EOF. STATE_FD (a memfd): byte 1 while the input is a burst
(not calm, or above ~6 MB/s while the forwarding drops), else 0; 0 at exit.

Own code rather than a library: the byte-batch rotation at line ends, the splice path and the
frame protocol are the pump's own (``logging.handlers`` writes one record at a time).
"""

from __future__ import annotations

import collections
import errno
import os
import select
import signal
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # (the relay runs with -S: no typing import at run time)
    from typing import Any

FRAME = struct.Struct("!BBQQ")  # kind, stream, a, b
DATA, DROP, EOF, ACK, ROT, MARK, ERR, LOGOK, LOGMISS, UDATA, UDROP = range(11)
READ = 1 << 20  # bytes per read()
MARGIN = 1 << 16  # a splice stops this far before max_bytes: the read path rotates at a line end
SMALL = 1 << 16  # read size that ends an owner's line when another stream waits
OWN_WAIT = 0.02  # s another stream waits for the owner's line to end before it is split
EOF_SEEN, NO_SPLICE = -1, -2  # splice_in() results besides a byte count / None
# After a small read, let the pipe fill a little (fewer wake-ups and reads per line written):
# short enough that a child writing 2 GB/s does not fill a 1 MiB pipe meanwhile.
NAP = 0.0002
# Dropped lines are counted (and the forwarding resumes) only once the input is calm: under
# CALM bytes per WIN seconds (~100 MB/s). The splice path keeps up with a burst, so its reads
# are small; counting then would resume the forwarding (copies, the supervisor's CPU) mid-burst.
WIN, CALM = 0.01, 1 << 20

# Arguments (set by setup()).
cap = out = ctl = ack = state = -1
path = lname = ""
max_bytes = backups = hold_cap = 0
retry_s = 0.0
ins: list[int] = []
dfd: int | None = None  # the log directory, held open (None: not there at the start)
SECRETS: list[bytes] = []  # known secret values, longest first, no CR/LF
SPLICE = False  # os.splice usable (Python >= 3.10 on Linux, no SECRETS: they must be seen)

# Buffers: carry (<= hold_cap) + one read; counting reads back from vllm.log (1 MiB, allocated
# at the first count: bytearray(n) writes its n zero bytes, resident for the relay's life).
buf = bytearray()
bmv = memoryview(buf)
cbuf = bytearray()
cmv = memoryview(cbuf)

# Forwarding.
q: collections.deque[tuple[int, int, int, int, bytes | None]] = collections.deque()  # not yet encoded
qsize = 0  # DATA payload bytes in q
pending: collections.deque[bytes | memoryview] = collections.deque()  # encoded, not (fully) written
# Forwarding drops, counted lazily: the lines of dropped data are counted (numbering needs them)
# from vllm.log when the relay has nothing to read, not on the hot path. pend, in order:
# [fd, start, end] regions of vllm.log not forwarded, None = a rotation, (lines, bytes) = dropped
# data already counted (not in the file: disk error). While pend is not empty, everything is
# dropped (the next forwarded line's number must be known).
pend: list[Any] = []
acc = [0, 0]  # lines, bytes counted from pend, not yet in a DROP frame
keep: set[int] = set()  # fds of rotated files kept open until their regions are counted
hyst = False  # dropping: resume forwarding only below cap // 2
forwarding = True  # False once the supervisor's end is gone: vllm.log goes on
out_mask = 0

# Inputs.
carry: list[bytes] = []  # per stream: partial line (no LF yet), held
stream_of: dict[int, int] = {}
open_ins: set[int] = set()
poller = select.poll()
owner = -1  # stream whose unfinished line ends vllm.log (a splice stopped mid-line); -1: none
frag: list[bool] = []  # per stream: its current line began in spliced (not forwarded) bytes
waiting = False  # a stream is held back by owner
wait_since = 0.0

# vllm.log.
lfd = -1
lsize = 0
partial = False  # the file ends in the middle of a line (a write failed half way)
broken_until = 0.0  # monotonic; 0 = healthy
missed = 0  # lines not written in the current broken period
err_no = 0

# Main loop.
ctl_buf = b""
quit_asked = False  # b"Q" came before the control pipe's EOF: close(), not the supervisor's death
win_t = win_b = 0.0
calm, burst = True, False
link_t = 0.0  # next check that vllm.log was not deleted (relink)


def setup(args: list[str], secrets: list[bytes]) -> None:
    """Parse the arguments after the program name (see the module docstring), open the log dir."""
    global cap, out, ctl, ack, path, max_bytes, backups, retry_s, hold_cap, state, ins
    global dfd, lname, buf, bmv, carry, stream_of, open_ins, frag, SECRETS, SPLICE
    global win_t, link_t
    cap, out, ctl, ack = int(args[1]), int(args[2]), int(args[3]), int(args[4])
    path, max_bytes, backups = args[5], int(args[6]), int(args[7])
    retry_s, hold_cap, state = float(args[8]), int(args[9]), int(args[10])
    ins = [int(a) for a in args[11:]]
    try:
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        lname = os.path.basename(path)
    except OSError:  # (not created: full paths, retried at each open)
        dfd, lname = None, path
    buf = bytearray(hold_cap + READ + 1)
    bmv = memoryview(buf)
    for fd in ins + [out, ctl, ack]:
        os.set_blocking(fd, False)
    carry = [b""] * len(ins)
    frag = [False] * len(ins)
    stream_of = {fd: i for i, fd in enumerate(ins)}
    open_ins = set(ins)
    for fd in ins:
        poller.register(fd, select.POLLIN)
    poller.register(ctl, select.POLLIN)
    SECRETS = sorted(secrets, key=len, reverse=True)
    SPLICE = hasattr(os, "splice") and not SECRETS
    win_t = link_t = time.monotonic()


def read_secrets(fd: int = 0) -> list[bytes]:
    """The secret values on `fd` (hex, one per line, until EOF); [] when fd is not open."""
    data = b""
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        return []
    return [bytes.fromhex(x.decode()) for x in data.split() if x]


def frame(kind: int, i: int = 0, a: int = 0, b: int = 0) -> None:
    count_all()
    q.append((kind, i, a, b, None))


def grow_cbuf(n: int) -> None:
    """Make the counting buffer `n` bytes long."""
    global cbuf, cmv
    cmv.release()
    cbuf = bytearray(n)
    cmv = memoryview(cbuf)


def count_step(limit: int = 1 << 20) -> None:
    """Count the lines of the oldest pending dropped data (<= limit bytes read from vllm.log)."""
    e = pend[0]
    if e is None:
        pend.pop(0)
        emit_drop()
        q.append((ROT, 0, 0, 0, None))
    elif type(e) is tuple:  # (not in vllm.log: they take no line numbers there)
        pend.pop(0)
        emit_drop()
        q.append((UDROP, 0, e[0], e[1], None))
    else:
        fd, start, end = e
        k = 0
        if len(cbuf) < limit:
            grow_cbuf(limit)
        try:
            k = os.preadv(fd, [cmv[: min(limit, end - start)]], start)
        except OSError:
            pass
        if k <= 0:  # cannot read it back (truncated by someone?): numbering is off from here
            k = end - start
        else:
            acc[0] += cbuf.count(b"\n", 0, k)
        acc[1] += k
        e[1] = start + k
        if e[1] >= end:
            pend.pop(0)
            if fd in keep and not any(type(x) is list and x[0] == fd for x in pend):
                keep.discard(fd)
                os.close(fd)
    if not pend:
        emit_drop()


def emit_drop() -> None:
    if acc[1]:
        q.append((DROP, 0, acc[0], acc[1], None))
        acc[0] = acc[1] = 0


def count_all() -> None:
    while pend:
        count_step()


def rot() -> None:
    if pend:
        pend.append(None)
    else:
        q.append((ROT, 0, 0, 0, None))


def forward(i: int, data: bytes | bytearray, pos: int, stop: int, off: int | None = None) -> None:
    """Queue whole lines data[pos:stop] for the supervisor, or drop them (counted) past the cap.

    off: where they are in the open vllm.log (None: not written there, a disk error: UDATA /
    UDROP, they take no line numbers). A stream's line whose head was spliced (frag) is dropped
    too (it ends in data: whole lines).
    """
    global qsize, hyst
    if not forwarding:
        return
    n = stop - pos
    f = frag[i]
    frag[i] = False
    if f or dropping() or qsize + n > cap and qsize:  # (one read fits an empty q)
        hyst = True
        if off is None:
            pend.append((data.count(b"\n", pos, stop), n))
        else:
            drop_region(off, n)
        return
    hyst = False
    # (data may be the read buffer: a copy)
    q.append((DATA if off is not None else UDATA, i, n, 0, bytes(memoryview(data)[pos:stop])))
    qsize += n


def dropping() -> bool:
    """In a drop period: dropped lines not counted yet, or the queue still above half the cap,
    or the supervisor still not reading (frames pending: its end of the frame pipe is full)."""
    return bool(pend) or hyst and (qsize > cap // 2 or bool(pending))


def drop_region(off: int, n: int) -> None:
    """vllm.log bytes [off, off + n) of the open file are not forwarded: count their lines later."""
    if pend and type(pend[-1]) is list and pend[-1][0] == lfd and pend[-1][2] == off:
        pend[-1][2] = off + n
    else:
        pend.append([lfd, off, off + n])


def open_log() -> None:
    """Open vllm.log for appending at its end. No O_APPEND: splice() refuses it (EINVAL); the
    relay is its only writer and appends at the end it tracks (lsize)."""
    global lfd, lsize, partial, dfd
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        fd = os.open(lname, flags, 0o600, dir_fd=dfd)
    except FileNotFoundError:
        if dfd is None:
            raise
        # the directory itself was removed (an operator freeing space): make it again by its path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        nd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.close(dfd)
        dfd = nd
        fd = os.open(lname, flags, 0o600, dir_fd=dfd)
    try:
        lsize = os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        os.close(fd)
        raise
    lfd = fd
    partial = partial and lsize > 0  # (a new file: nothing to end)


def relink() -> None:
    """vllm.log was deleted while open (an operator freeing a full disk): its blocks stay in use
    as long as it is open, and what is written to it is lost. Start a new file (numbering goes on
    as after a rotation); not in the middle of a line (checked again later)."""
    global lfd
    if lfd < 0 or partial or owner >= 0:
        return
    try:
        if os.fstat(lfd).st_nlink:
            return
    except OSError:
        return
    fd, lfd = lfd, -1
    if any(type(x) is list and x[0] == fd for x in pend):
        keep.add(fd)
    else:
        os.close(fd)
    rot()


def release() -> None:
    global owner, waiting, wait_since
    owner = -1
    waiting = False
    wait_since = 0.0


def shift_backups(path: str, backups: int, dfd: int | None = None) -> None:
    """path -> path.1 -> ... -> path.<backups>; the oldest is overwritten; backups 0: path goes.

    dfd: a directory fd that path is relative to (the relay's log directory), else None. Only
    the backups that exist move: path.1..path.m, m found by bisection (rotation keeps them
    contiguous; with a gap from outside, the run below some missing path.<m+1> moves, nothing is
    overwritten). A loop over all `backups` names cost 12 ms per rotation at 1000 backups.
    Shared with `xpu_serve.sources.log_files.RotatingFile`.
    """
    if backups <= 0:
        try:
            os.unlink(path, dir_fd=dfd)
        except FileNotFoundError:
            pass
        return

    def there(k: int) -> bool:
        if k == 0:
            return True
        try:
            os.stat(path + "." + str(k), dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return False
        return True

    lo, hi = 0, backups - 1
    if there(hi):
        lo = hi
    while hi - lo > 1:  # there(lo), not there(hi)
        mid = (lo + hi) // 2
        if there(mid):
            lo = mid
        else:
            hi = mid
    for k in range(lo, 0, -1):
        try:
            os.replace(path + "." + str(k), path + "." + str(k + 1), src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            pass
    try:
        os.replace(path, path + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
    except FileNotFoundError:
        pass


def cut_at(data: bytes | bytearray, pos: int, end: int, room: int, size: int) -> int:
    """Where a write of data[pos:end] into a file of `size` bytes with `room` left before
    max_bytes stops: end if it fits, else after the last line end that fits; -1: rotate first
    (not even one line fits and the file is not empty). One line longer than max_bytes goes
    whole into a file of its own. Shared with `xpu_serve.sources.log_files.RotatingFile`."""
    if end - pos <= room:
        return end
    cut = data.rfind(b"\n", pos, pos + max(room, 0))
    if cut >= 0:
        return cut + 1
    if size > 0:
        return -1
    return data.find(b"\n", pos, end) + 1 or end


def rotate() -> None:
    global lfd
    if lfd >= 0:
        fd, lfd = lfd, -1
        if any(type(x) is list and x[0] == fd for x in pend):
            keep.add(fd)  # its dropped regions are still to be counted
        else:
            os.close(fd)
    shift_backups(lname, backups, dfd)


def fail(e: OSError, data: bytes | bytearray, pos: int, end: int) -> None:
    """A disk error: close, count, forward the rest anyway, retry after retry_s."""
    global lfd, broken_until, missed, err_no
    release()  # (the marker that ends the failure period ends an unfinished line: partial)
    count_all()  # (the regions still in the open file)
    if lfd >= 0:
        fd, lfd = lfd, -1
        try:
            os.close(fd)
        except OSError:
            pass
    frame(ERR, 0, e.errno or 0, 0 if broken_until else 1)
    broken_until = time.monotonic() + retry_s
    err_no = e.errno or 0
    missed += data.count(b"\n", pos, end)


def recover(i: int, data: bytes | bytearray, end: int) -> bool:
    """vllm.log is failing: past the retry time write the recovery marker (True: go on writing),
    else count and forward data[:end] as not written (False)."""
    global broken_until, missed
    if time.monotonic() < broken_until:
        missed += data.count(b"\n", 0, end)
        forward(i, data, 0, end)
        return False
    msg = f"[xpu-serve] {missed} lines not written to this file: [Errno {err_no}] {os.strerror(err_no)}\n"
    mark = b""
    try:
        if lfd < 0:
            open_log()
        mark = (b"\n" if partial else b"") + msg.encode()
        write_all(mark)
    except OSError as e:
        fail(e, data, 0, end)
        forward(i, data, 0, end)
        return False
    frame(MARK, 0, mark.count(b"\n"))
    frame(LOGOK, 0, missed, err_no)
    broken_until = 0.0
    missed = 0
    return True


def log(i: int, data: bytes | bytearray, end: int) -> None:
    """Append data[:end] (whole lines) to vllm.log, rotating at line boundaries before the file
    passes max_bytes, and forward it; the file is written first (flush() relies on it)."""
    pos = 0
    if broken_until and not recover(i, data, end):
        return
    while pos < end:
        seg = pos
        w0 = -1
        try:
            if lfd < 0:
                open_log()
            stop = cut_at(data, pos, end, max_bytes - lsize, lsize)
            if stop < 0:
                rotate()
                rot()
                continue
            w0 = lsize
            write_all(memoryview(data)[pos:stop])
        except OSError as e:
            done = pos + (lsize - w0 if w0 >= 0 else 0)  # (written before the error)
            whole = data.rfind(b"\n", pos, done) + 1 or pos  # (its complete lines are in vllm.log)
            if whole > seg:  # (before fail() closes the file: a dropped region is read back)
                forward(i, data, seg, whole, w0)
            fail(e, data, done, end)
            # The rest is not (a half-written line's head is, ended by the recovery marker,
            # which counts it: MARK).
            forward(i, data, whole, end)
            return
        forward(i, data, pos, stop, lsize - (stop - pos))
        pos = stop
        if pos < end:
            try:
                rotate()
            except OSError as e:
                rot()  # the old file is closed: numbering goes on in a new file
                fail(e, data, pos, end)
                forward(i, data, pos, end)
                return
            rot()
    if owner >= 0 and not partial:
        release()  # (log() writes whole lines: an owner's line ended here)


def scrub(data: bytes | bytearray, end: int) -> tuple[bytes | bytearray, int]:
    """data[:end] (whole lines) with every known secret value replaced by ***: (data, end) as
    they are when none occurs (C-level find per value), else a copy and its new length."""
    for s in SECRETS:
        if data.find(s, 0, end) >= 0:
            break
    else:
        return data, end
    b = bytes(memoryview(data)[:end])
    for s in SECRETS:
        b = b.replace(s, b"***")
    return b, len(b)


def take(i: int, n: int) -> None:
    """Write out the whole lines in buf[:n] (the stream's held partial line, then what was just
    read), hold the partial tail; CR and CRLF become LF (a copy, only when there is a CR)."""
    data: bytes | bytearray = buf
    if buf.find(b"\r", 0, n) >= 0:
        data = bytes(bmv[:n])
        hold = b""
        if data.endswith(b"\r"):
            data, hold = data[:-1], b"\r"  # may be the CR of a CRLF split across reads
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + hold
        n = len(data)
    nl = data.rfind(b"\n", 0, n) + 1
    rest = bytes(memoryview(data)[nl:n])
    if len(rest) > hold_cap:  # a very long line: write what we have (it ends up split, not lost)
        data, nl, rest = bytes(memoryview(data)[:n]) + b"\n", n + 1, b""
    carry[i] = rest
    if nl:
        if SECRETS:
            data, nl = scrub(data, nl)
        log(i, data, nl)


def end_stream(fd: int) -> None:
    i = stream_of[fd]
    rest = carry[i]
    carry[i] = b""
    if rest.endswith(b"\r"):
        rest = rest[:-1]
    if rest and owner >= 0 and owner != i:
        split_line()
    if rest or owner == i:  # (owner: its unfinished line is in vllm.log, end it)
        line, k = scrub(rest + b"\n", len(rest) + 1)
        log(i, line, k)
    if len(open_ins) == 1 and broken_until:
        frame(LOGMISS, 0, missed, err_no)
    frame(EOF, i)
    poller.unregister(fd)
    open_ins.discard(fd)
    os.close(fd)


def split_line() -> None:
    """The owner's line stays unfinished too long while another stream waits (or must be
    written now): end it with LF, as a held line longer than hold_cap is (split, nothing lost)."""
    o = owner
    release()
    if lfd < 0 or broken_until or not partial:
        return
    off = lsize
    try:
        write_all(b"\n")
    except OSError as e:
        fail(e, b"", 0, 0)
        return
    if forwarding:
        drop_region(off, 1)  # (ends the owner's spliced, not forwarded line)
    frag[o] = False  # what follows is a line of its own


def write_all(b: bytes | bytearray | memoryview) -> None:
    global lsize, partial
    v = memoryview(b)
    while v:
        k = os.write(lfd, v)
        lsize += k
        partial = v[k - 1] != 10
        v = v[k:]


def splice_in(i: int, fd: int) -> int | None:
    """Move what pipe fd holds into vllm.log with splice() (after the stream's held partial
    line), not past max_bytes - MARGIN. Returns the bytes moved, None (pipe empty), EOF_SEEN
    (handled) or NO_SPLICE (use the read path: no room, disk error, splice unsupported)."""
    global SPLICE, owner, lsize, partial
    c = carry[i]
    try:
        if lfd < 0:
            open_log()
    except OSError:
        return NO_SPLICE  # (the read path fails the same way and degrades)
    off = lsize
    room = max_bytes - lsize - len(c) - MARGIN
    if room < MARGIN:
        return NO_SPLICE  # near the end of the file: the read path rotates at a line end
    k: int | None
    try:
        if c:
            write_all(c)  # the held head of the line, then its rest from the pipe
            carry[i] = b""
            owner = i
        k = os.splice(fd, lfd, room, flags=os.SPLICE_F_NONBLOCK)
    except BlockingIOError:
        k = None
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EBADF):
            SPLICE = False  # this file system (or kernel) cannot: read()/write() from now on
        if lsize == off:
            return NO_SPLICE  # (a disk error: the read path hits it too and degrades)
        carry[i] = b""  # (part of it went in: the read path ends that line)
        k = None
    if k:
        lsize += k
    if lsize > off:
        if forwarding:
            drop_region(off, lsize - off)
        try:
            partial = os.pread(lfd, 1, lsize - 1) != b"\n"  # page cache: did it stop mid-line?
        except OSError:
            partial = True
        frag[i] = partial
        if partial:
            owner = i
        elif owner == i:
            release()
    if k == 0:
        end_stream(fd)
        return EOF_SEEN
    return k


def read_fd(fd: int, rounds: int = 8, force: bool = False) -> int:
    """Read into one reused buffer (a fresh 1 MiB bytes object per read costs page faults),
    after the stream's held partial line; or splice (drop mode). force: do not wait for
    another stream's unfinished line (flush, close). Returns the bytes read (READ at EOF)."""
    global waiting, wait_since
    i = stream_of[fd]
    got = 0
    if owner >= 0 and owner != i:
        now = time.monotonic()
        if not wait_since:
            wait_since = now
        if not force and now - wait_since < OWN_WAIT:
            waiting = True  # (the owner ends its line at its next read, then returns)
            return 0
        split_line()
    for _ in range(rounds):
        w = waiting and owner == i
        if SPLICE and (not forwarding or dropping()) and not broken_until and not w:
            s = splice_in(i, fd)
            if s is None:
                return got
            if s == EOF_SEEN:
                return READ
            if s != NO_SPLICE:
                got += s
                continue
        c = carry[i]
        lc = len(c)
        if lc:
            buf[:lc] = c
        try:
            k = os.readv(fd, [bmv[lc : lc + (SMALL if w else READ)]])
        except BlockingIOError:
            return got
        except OSError:
            k = 0
        if not k:
            end_stream(fd)
            return READ
        got += k
        take(i, lc + k)
        if q and forwarding and not pending:
            write_out()  # (else reads of one round pile up in q and pass the cap, supervisor or not)
        if w and owner < 0:
            return got  # its line ended: the waiting stream's turn
    return got


def drain_inputs() -> None:
    if owner >= 0 and ins[owner] in open_ins:
        read_fd(ins[owner], rounds=1 << 30)  # (may end its line before the others go)
    for fd in list(open_ins):
        read_fd(fd, rounds=1 << 30, force=True)


def encode(limit: int = 4 << 20) -> None:
    """Frame parts for the head of q; consecutive DATA of one stream become one frame."""
    global qsize
    size = 0
    while q and size < limit:
        kind, i, a, b, payload = q.popleft()
        if payload is None:
            pending.append(FRAME.pack(kind, i, a, b))
            continue
        chunks = [payload]
        while q and q[0][0] == kind and q[0][1] == i and size + a < limit:
            nxt = q.popleft()
            chunks.append(nxt[4])  # type: ignore[arg-type]  # (DATA items carry a payload)
            a += nxt[2]
        qsize -= a
        size += a
        pending.append(FRAME.pack(kind, i, a, 0))
        pending.extend(chunks)


def write_out() -> None:
    """writev: no copy into one big buffer; partial writes leave a memoryview of the rest."""
    while pending or q:
        if not pending:
            encode()
        try:
            n = os.writev(out, [pending[k] for k in range(min(len(pending), 512))])
        except BlockingIOError:
            return
        except OSError:
            stop_forwarding()
            return
        while n:
            head = pending[0]
            if len(head) <= n:
                n -= len(head)
                pending.popleft()
            else:
                pending[0] = memoryview(head)[n:]
                n = 0


def stop_forwarding() -> None:
    """The supervisor's end is gone: vllm.log goes on until the engine's pipes close."""
    global forwarding, qsize, out_mask
    forwarding = False
    q.clear()
    pending.clear()
    qsize = 0
    if out_mask:
        poller.unregister(out)
        out_mask = 0


def on_ctl() -> None:
    """Handle what the control pipe holds: flush requests, quit, EOF."""
    global ctl_buf, quit_asked
    try:
        data = os.read(ctl, 4096)
    except BlockingIOError:
        return
    if not data:
        poller.unregister(ctl)
        if not quit_asked:  # the supervisor died: keep vllm.log going until the engine's EOF
            stop_forwarding()
            return
        drain_inputs()
        for fd in list(open_ins):
            end_stream(fd)
        return
    ctl_buf += data
    while len(ctl_buf) >= 9:
        if ctl_buf[:1] == b"Q":
            quit_asked = True
            ctl_buf = ctl_buf[9:]
            continue
        seq = int.from_bytes(ctl_buf[1:9], "big")
        ctl_buf = ctl_buf[9:]
        drain_inputs()
        try:
            os.write(ack, seq.to_bytes(8, "big"))  # flush(): it is in vllm.log now
        except OSError:
            pass  # nobody waits (the pipe is full) or the supervisor is gone
        frame(ACK, 0, seq)


def measure(busy: int) -> None:
    """Update the input rate window and the state byte (the engine writes fast, or still writes
    while the forwarding drops)."""
    global win_t, win_b, calm, burst
    win_b += busy
    now = time.monotonic()
    if now - win_t >= WIN or calm and win_b >= CALM:  # (a burst shows at once, calm takes a window)
        calm = win_b < CALM
        b = not calm or win_b >= CALM >> 4 and dropping()
        if b != burst:
            burst = b
            try:
                os.pwrite(state, b"\1" if burst else b"\0", 0)
            except OSError:
                pass
        win_t, win_b = now, 0


def poll_round() -> None:
    """One round of the main loop: wait for the pipes, read, count, forward."""
    global out_mask, link_t
    mask = select.POLLOUT if (q or pending) and forwarding else 0
    if mask != out_mask:
        if out_mask:
            poller.unregister(out)
        if mask:
            poller.register(out, mask)
        out_mask = mask
    events = poller.poll((0 if calm else WIN * 1000) if pend else None)
    if events and time.monotonic() >= link_t:  # (before what was just signalled is written)
        link_t = time.monotonic() + 1.0
        relink()
    busy = 0
    for fd, ev in events:
        if fd == out:
            if ev & (select.POLLERR | select.POLLHUP):
                stop_forwarding()
        elif fd == ctl:
            on_ctl()
        elif fd in open_ins:
            busy += read_fd(fd)
    measure(busy)
    if pend and busy < SMALL and calm:
        count_step(SMALL * 4)  # little to read: count dropped lines (numbering) meanwhile
    elif NAP and events and busy < SMALL:
        time.sleep(NAP)
    if forwarding:
        write_out()
    else:
        q.clear()


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # ends on EOF (engine gone / supervisor closed ctl) or EPIPE
    setup(argv[1:], read_secrets())
    while open_ins or q or pending:
        poll_round()
    try:
        os.pwrite(state, b"\0", 0)
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
