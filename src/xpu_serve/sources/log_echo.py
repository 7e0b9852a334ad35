"""The log pump's echo: engine lines, tagged ``[i<incarnation>] ``, on the supervisor's own stdout.

One thread writes from a bounded queue (`cap_bytes` of text), so a slow or blocked stdout
(journald, ``docker logs``) drops echo lines, counted and then marked
(``[xpu-serve] echo dropped N lines: output could not keep up``), and never slows the pump. With
a binary layer (``stream.buffer``) it writes UTF-8 bytes there ("replace": an ASCII stdout cannot
fail, and the buffer's lock keeps each write whole against the supervisor's own writes). uvicorn
access lines of `quiet_paths` (the supervisor's own probes) answered below 400 are left out.
"""

from __future__ import annotations

import errno
import re
import threading
from collections import deque
from typing import TextIO

# uvicorn's access line (uvicorn/logging.py `AccessFormatter`: '%(client_addr)s - "%(request_line)s"
# %(status_code)s', request_line "METHOD full_path HTTP/version", status "200 OK"), as vLLM's API
# server prints it: '(APIServer pid=N) INFO:     127.0.0.1:51234 - "GET /health HTTP/1.1" 200 OK'.
# Groups: path without the query string, status code.
_ACCESS_RE = re.compile(r' - "[A-Z]+ ([^ "?]*)(?:\?[^ "]*)? HTTP/[0-9.]+" (\d{3})\b')


class Echo:
    """Bounded echo queue and its writer thread (`run`); `stream` None: everything is a no-op."""

    def __init__(self, stream: TextIO | None, tag: str, cap_bytes: int, quiet_paths: tuple[str, ...]) -> None:
        self.stream = stream
        self.tag = tag
        self.cap_bytes = cap_bytes
        self._quiet = frozenset(quiet_paths)
        self._cond = threading.Condition()
        self._q: deque[str] = deque()
        self._size = 0
        self.dropped = 0  # lines not echoed (counter for PumpStats)
        self._dropped_pending = 0  # dropped since the last marker
        self._stop = False

    def piece(self, tlines: list[str]) -> str | None:
        """The echo text of engine lines (tagged, quiet access lines left out), None if empty."""
        elines = tlines
        if self._quiet:  # (the substring test is the hot path: most lines are not access lines)
            elines = [ln for ln in tlines if " HTTP/" not in ln or not self._is_quiet(ln)]
        if not elines:
            return None
        tag = self.tag
        return tag + ("\n" + tag).join(elines) + "\n"

    def _is_quiet(self, line: str) -> bool:
        """A uvicorn access line for one of `quiet_paths` with a status below 400."""
        m = _ACCESS_RE.search(line)
        return m is not None and m.group(1) in self._quiet and int(m.group(2)) < 400

    def notice(self, msg: str) -> None:
        """Echo one ``[xpu-serve] msg`` line of the pump's own."""
        self.put([f"{self.tag}[xpu-serve] {msg}\n"])

    def put(self, pieces: list[str]) -> None:
        """Queue text pieces (whole lines); what does not fit in `cap_bytes` is dropped, counted."""
        if self.stream is None or not pieces:
            return
        with self._cond:
            for piece in pieces:
                room = self.cap_bytes - self._size
                dropped = 0
                if len(piece) > room:
                    # Keep the whole lines that fit, drop (and count) the rest of the piece.
                    cut = piece.rfind("\n", 0, max(room - 200, 0)) + 1  # 200: room for the marker
                    dropped = piece.count("\n", cut)
                    piece = piece[:cut]
                if piece:
                    if self._dropped_pending:
                        marker = (
                            f"{self.tag}[xpu-serve] echo dropped {self._dropped_pending} lines: "
                            "output could not keep up\n"
                        )
                        self._q.append(marker)
                        self._size += len(marker)
                        self._dropped_pending = 0
                    self._q.append(piece)
                    self._size += len(piece)
                self.dropped += dropped
                self._dropped_pending += dropped
            self._cond.notify()

    def run(self) -> None:
        """The echo thread: write queued text until `stop()` and the queue is empty."""
        echo = self.stream
        assert echo is not None
        binary = getattr(echo, "buffer", None)
        broken = False
        while True:
            with self._cond:
                while not self._q:  # stop() is called only after the writer ended
                    if self._stop:
                        return
                    self._cond.wait(0.5)
                pieces = list(self._q)
                self._q.clear()
                self._size = 0
            text = "".join(pieces)
            if broken:
                self._count_lost(text)
                continue
            try:
                if binary is not None:
                    binary.write(text.encode("utf-8", "replace"))
                    binary.flush()
                else:
                    echo.write(text)
                    echo.flush()
            except Exception as e:  # EPIPE, closed stream...: count; stop echoing if it is gone for good
                broken = (isinstance(e, OSError) and e.errno in (errno.EPIPE, errno.EBADF)) or (
                    isinstance(e, ValueError) and "closed" in str(e)
                )
                self._count_lost(text)

    def _count_lost(self, text: str) -> None:
        with self._cond:
            self.dropped += text.count("\n")

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stop(self, thread: threading.Thread | None, timeout: float) -> None:
        """Let the echo thread write what is queued and end, within `timeout` seconds; what it
        cannot write (blocked on a stuck stdout) is counted as dropped."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            with self._cond:
                self.dropped += sum(s.count("\n") for s in self._q)
                self._q.clear()
