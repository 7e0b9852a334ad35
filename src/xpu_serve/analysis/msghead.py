"""A logged exception whose traceback was cut before its exception line: its message stands for it.

vLLM's `logger.exception(e)` (vllm/engine/multiprocessing/engine.py run_mp_engine,
vllm/v1/engine/core.py run_engine_core) writes str(e) as an ERROR record, then the traceback line
by line with the same level, prefix and `[file.py:N]`; the exception line at its end names the
class. When a paste is cut inside the traceback, the message record before it is all that says
what was raised (analysis/traceback.py is_message_head). It counts only during start-up and only
when nothing else names a failure or detects a hang: once the engine serves, a logged error with
a traceback may be one request's, or the detection of a hang (V0's "Engine background task
failed" after an iteration timeout).

A traceback cut before its exception line with no message record before it (a paste that starts
and ends inside the frames) says what was raised only by its innermost frame: when that frame is
a config check (vLLM's argument parsing, config checks, the model registry's check of the
architectures; classify.py _CONFIG_FRAME_RE), the frame stands for a config error, on the same
terms (nothing else names a failure or a hang).

A process that a death report says exited with code 1 (Python's exit on an unhandled exception:
the API server's `Failed core proc(s): {'EngineCore': 1}`, the executor's `died unexpectedly (exit
code: 1)`) raised: its own traceback cut before its exception line stands for that exception, a
generic-exception root at its innermost frame, whatever that frame is (the death report is its
consequence, ranked below it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from xpu_serve.analysis.deaths import normalize_process
from xpu_serve.analysis.traceback import TbState, is_message_head
from xpu_serve.events import Event, parse_line

if TYPE_CHECKING:
    from xpu_serve.analysis.classify import Classifier

_MAX_OPEN = 4096  # open tracebacks remembered (oldest dropped first)
_HANG_CAUSES = ("engine-hang", "startup-hang")


class MessageHeads:
    """Traceback group -> the message record logged right before it, until its exception line."""

    def __init__(self, cls: Classifier, request_handler_loc: re.Pattern[str], config_frame: re.Pattern[str]):
        self.cls, self._request_loc, self._config_frame = cls, request_handler_loc, config_frame
        self.heads: dict[int, Event] = {}
        self.frames: dict[int, Event] = {}  # traceback group -> its latest frame line's record

    def before(self, header: Event, file: str, lineno: int) -> Event | None:
        """The message record right before the traceback `header` opens, when no row classified
        it and the engine is not serving yet; else None."""
        st = self.cls.st
        if st.ready or (file, header.pid) in self.cls.tracker.streams:
            return None
        prev = st.pid_last_raw.get(header.pid) if header.pid is not None else None
        raw: str | None = st._last_line.get(file)
        at = lineno - 1
        if prev is not None and prev[1] == file:
            raw, at = prev[0], prev[2]
        if raw is None:
            return None
        pev = parse_line(raw, file, at)
        if not is_message_head(pev, header) or self._request_loc.match(pev.code_location or ""):
            return None  # a request handler's exception is one rejected request
        return pev if st.table.match(pev, False) is None else None

    def read(self, group: int, head: Event | None, in_tb: bool) -> None:
        """After the tracker placed a line in traceback `group`: remember the head of a traceback
        it opened; forget it once the traceback goes on (its exception line names the error)."""
        if head is not None:
            self.heads[group] = head
            if len(self.heads) > _MAX_OPEN:
                del self.heads[next(iter(self.heads))]
        elif in_tb:
            self.heads.pop(group, None)

    def frame(self, group: int, ev: Event) -> None:
        """A frame line (`File "...", line N, in fn`) of traceback `group`: its latest one."""
        self.frames[group] = ev
        if len(self.frames) > _MAX_OPEN:
            del self.frames[next(iter(self.frames))]

    def _cut(self) -> list[tuple[int, Event]]:
        """(group, innermost frame) of each traceback still open at the end of the input, cut
        before its exception line, without a message record before it."""
        out = []
        for stream in self.cls.tracker.streams.values():
            fev = self.frames.get(stream.group)
            if stream.state is not TbState.EXCEPTION and stream.group not in self.heads and fev is not None:
                out.append((stream.group, fev))
        return out

    def _exited_on_exception(self) -> set[str]:
        """The processes (normalize_process names) a root death report says exited with code 1."""
        out = set()
        for evs in self.cls.st.roots.values():
            for e in evs:
                name = e.extra.get("engine") or e.extra.get("worker")
                if str(e.extra.get("exit_code")) == "1" and name:
                    out.add(normalize_process(str(name)) or str(name))
        return out

    def flush(self) -> None:
        """Before the verdict: a cut traceback of a process a death report says exited with code 1
        becomes a generic-exception root at its innermost frame; each remembered message becomes a
        generic-exception root (a config error when its traceback's last frame is a config check);
        without one, a traceback cut inside a config check becomes a config-error root at its
        innermost frame; neither of the last two when something else (not a bare failure report)
        names a failure, and none of them when something names a hang."""
        st, cls = self.cls.st, self.cls
        hang = any(st.table.by_id[sid].cause in _HANG_CAUSES for sid in st.precursors) or any(
            g.sig.cause in _HANG_CAUSES for g in st.groups.values()
        )
        exited = set() if hang else self._exited_on_exception()
        open_tbs = self._cut()
        raised = [(g, f) for g, f in open_tbs if normalize_process(f.process, f.rank) in exited]
        bare = st._set["bare_failure_reports"]
        if hang or any(sid not in bare for sid in st.roots):
            self.heads.clear()
            self.frames.clear()
        sig = st.table.by_id[st._row["generic_exception"]]
        in_check = [(g, f) for g, f in open_tbs if self._config_frame.search(f.text.strip())]
        cut = [] if self.heads else in_check
        for group, fev in raised:
            # the traceback of a process that exited on an exception: its innermost frame stands for it
            fev.signature, fev.role, fev.cause, fev.group = sig.id, sig.role, sig.cause, group
            fev.extra["_order"] = group
            cls._root(fev, sig, fev.file or "", fev.line or 0)
        for group, ev in self.heads.items():
            ev.signature, ev.role, ev.cause, ev.group = sig.id, sig.role, sig.cause, group
            ev.extra["_order"] = group
            frame = cls.tracker.last_frame.get(group)
            if frame is not None and self._config_frame.search(frame):
                ev.cause = "config-error"
            cls._root(ev, sig, ev.file or "", ev.line or 0)
        for group, fev in cut:
            # the frame stands for the exception its cut traceback was raising
            fev.signature, fev.role, fev.cause, fev.group = sig.id, sig.role, "config-error", group
            fev.extra["_order"] = group
            fev.extra["config_frame"] = fev.text.strip()
            cls._root(fev, sig, fev.file or "", fev.line or 0)
        self.heads.clear()
        self.frames.clear()
