"""Python tracebacks in interleaved output, one stream per (file, pid): which line of a traceback
a line is, so that only its exception line is classified as the error (a frame's source line
`raise RuntimeError(f"NCCL error: ...")` is code, never evidence).

The shape read (CPython Lib/traceback.py `StackSummary.format`, `TracebackException.format`):
"Traceback (most recent call last):", then per frame `  File "path", line N, in func` and its
source line (Python 3.11+ adds caret marks "^^^^" under it), then the exception line
"SomeError: message"; a chained exception follows after "During handling of the above
exception, another exception occurred:" or "The above exception was the direct cause ...".
A paste may start inside a traceback (at a frame line or at the caret marks) or keep only the
exception line; a stream that goes quiet for 512 classified lines is closed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from xpu_serve.events import Event

# an exception line: "ValueError: ...", "torch.OutOfMemoryError: ...", "KeyboardInterrupt"
EXC_LINE_RE = re.compile(
    r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Failure|Fault|Exit|Interrupt)(?::|$)"
)
HEADER = "Traceback (most recent call last)"
# Ray's task-error header, which stands where CPython's header would (python/ray/exceptions.py
# RayTaskError: "{proctitle}() (pid={pid}, ip={ip}[, actor_id=..., repr=...])" before the remote
# traceback's frames, alone, after "ray.exceptions.RayTaskError(Cause): " or after the driver's
# "Possible unhandled error from worker: "): the pid is the process that raised
RAY_TASK_HEADER_RE = re.compile(
    r"(?:^|RayTaskError(?:\(\w+\))?: |Possible unhandled error from worker: )ray::[\w.<>]+\(\) \(pid=(?P<pid>\d+)[,)]"
)
RAY_TASK_TRIGGER = "ray::"


def ray_task_pid(text: str) -> int | None:
    """The pid a Ray task-error header names ("ray::Actor.method() (pid=838798, ip=...)"), or None."""
    if RAY_TASK_TRIGGER not in text:
        return None
    m = RAY_TASK_HEADER_RE.search(text)
    return int(m.group("pid")) if m else None

_EXC_LEVELS = ("ERROR", "CRITICAL")  # the levels logger.exception / logger.critical write at
_CHAINED = ("During handling", "The above exception")
# a native frame in a Python-style dump (tvm-ffi's and other native crash handlers print C frames
# as `File "<unknown>", line 0, in 0x7f...`): no source line follows it, as CPython's
# traceback.StackSummary.format prints one only when linecache finds the file's line (never line 0)
_NATIVE_FRAME_RE = re.compile(r'File "<unknown>", line 0\b|File "[^"]*", line 0,')
_QUIET_AFTER = 512  # classified lines after which a silent stream's traceback is closed
_CHECK_EVERY = 256


class TbState(Enum):
    """Where a stream is inside its traceback."""

    FRAMES = "frames"  # after the header or a frame's source: a frame, carets or the exception line
    SOURCE = "source"  # after a `File "..."` line: the frame's source line comes next
    EXCEPTION = "exception"  # after the exception line: a chained traceback may follow


@dataclass
class Stream:
    """One stream's open traceback: its state, its group id (the order of its first line) and
    the order of its latest line."""

    state: TbState
    group: int
    last: int


class Step(Enum):
    """What the analysis does with a line after the tracker read it."""

    CLASSIFY = "classify"  # classify it (as an exception line when `in_tb`)
    SKIP = "skip"  # a traceback's code line: never classified
    WAIT_FRAME = "wait-frame"  # the EngineCore's wait frame: classified alone, outside the group


@dataclass
class Read:
    step: Step
    in_tb: bool = False
    group: int | None = None


Key = tuple[str, "int | None"]


class TracebackTracker:
    """Traceback state per stream; `streams` is read by the feeding loops (a line of an open
    traceback always takes the slow path). Memory: one entry per open stream, `last_frame`
    bounded to 4096 groups."""

    def __init__(self, wait_frame: re.Pattern[str] | None = None) -> None:
        # the source lines of the EngineCore's waits on its workers (rules.yaml sets.wait_frames)
        self.wait_frame = wait_frame
        self.streams: dict[Key, Stream] = {}
        self.last_frame: dict[int, str] = {}  # group -> its latest `File ...` frame line
        self.check = 0

    def expire(self, order: int) -> None:
        """Close tracebacks whose stream went quiet (bounded work: every 256 calls)."""
        if not self.streams:
            return
        self.check += 1
        if self.check >= _CHECK_EVERY:
            self.check = 0
            for k in [k for k, v in self.streams.items() if order - v.last > _QUIET_AFTER]:
                del self.streams[k]

    def read(self, ev: Event, key: Key, order: int, opens_at_exception: Callable[[], bool]) -> Read:
        """Advance `key`'s stream by the line `ev` (read as the `order`-th classified line).
        `opens_at_exception()` tells whether a bare exception line opens a traceback (it follows
        caret marks, or it is an ERROR record of a vLLM logger). May strip `ev.text` of a quoting
        indent."""
        text = ev.text
        st = self.streams.get(key)
        if (
            text.startswith(HEADER)
            or (HEADER in text and text.rstrip().endswith(":"))
            or ray_task_pid(text) is not None
        ):
            if st is None or st.state is not TbState.EXCEPTION:
                st = Stream(TbState.FRAMES, order, order)
            else:
                st.state = TbState.FRAMES  # a chained traceback keeps the group
            self.streams[key] = st
            return Read(Step.CLASSIFY, False, st.group)
        if st is None:
            return self._open(text, key, order, opens_at_exception)
        st.last = order
        if st.state is TbState.SOURCE:
            return self._source(ev, st)
        if st.state is TbState.FRAMES:
            return self._frames(ev, st, key)
        stripped = text.strip()
        if not stripped or stripped.startswith(_CHAINED):
            return Read(Step.CLASSIFY, False, st.group)
        del self.streams[key]
        return Read(Step.CLASSIFY)

    def _open(self, text: str, key: Key, order: int, opens_at_exception: Callable[[], bool]) -> Read:
        """A line of a stream without an open traceback: a paste may start inside one."""
        ls = text.lstrip()
        if ls[:1] in ("F", "^", "~"):
            if ls.startswith('File "') and ", line " in text:
                # a paste that starts inside a traceback (its header cut off): frames open one
                self.streams[key] = Stream(_after_frame(ls), order, order)
                return Read(Step.CLASSIFY, False, order)
            if "^" in ls and not ls.rstrip().strip("^~"):
                # ... or at the caret marks under a frame's source line (Python 3.11+ prints them
                # only in tracebacks): the exception line follows
                self.streams[key] = Stream(TbState.FRAMES, order, order)
                return Read(Step.CLASSIFY, False, order)
            return Read(Step.CLASSIFY)
        if EXC_LINE_RE.match(text) and opens_at_exception():
            # the exception line right under caret marks that took the fast path, or an ERROR
            # record of a vLLM logger whose message *is* an exception line: vLLM logs a traceback
            # line by line with the same prefix (logger.exception in vllm/v1/engine/core.py
            # run_engine_core, multiproc_executor.py worker_busy_loop) and never words a message
            # of its own as "SomeError: ..."; a paste that kept only that line lost the head only
            self.streams[key] = Stream(TbState.EXCEPTION, order, order)
            return Read(Step.CLASSIFY, True, order)
        return Read(Step.CLASSIFY)

    def _source(self, ev: Event, st: Stream) -> Read:
        """The source line under a frame: code, never evidence."""
        st.state = TbState.FRAMES
        stripped = ev.text.strip()
        if not EXC_LINE_RE.match(stripped):
            if self.wait_frame is not None and self.wait_frame.search(stripped):
                # ... except the EngineCore's wait on its workers (rules.yaml sets.wait_frames: the
                # multiprocessing executor's response-queue dequeue, the Ray compiled graph's output
                # read): on the stack only when the exception came from inside the wait, it is the
                # trace of a hang in an excerpt cut before the exception line; kept out of the
                # group so it never subsumes the exception line's verdict
                ev.text = stripped
                return Read(Step.WAIT_FRAME)
            return Read(Step.SKIP)
        if ev.text[:1] in (" ", "\t"):
            ev.text = stripped  # a traceback quoted with an indent (a report's list)
        return Read(Step.CLASSIFY, False, st.group)

    def _frames(self, ev: Event, st: Stream, key: Key) -> Read:
        """Between frames: a frame line, carets, a chain header, or the exception line."""
        text = ev.text
        stripped = text.strip()
        if stripped.startswith("File "):
            st.state = _after_frame(stripped)
            self.last_frame[st.group] = stripped
            if len(self.last_frame) > 4096:
                del self.last_frame[next(iter(self.last_frame))]
            return Read(Step.CLASSIFY, False, st.group)
        if not stripped or stripped.startswith(("^", "~")) or stripped.startswith(_CHAINED):
            return Read(Step.CLASSIFY, False, st.group)
        if EXC_LINE_RE.match(stripped):
            st.state = TbState.EXCEPTION
            if text[:1] in (" ", "\t"):
                ev.text = stripped  # the exception line of an indented paste, as Python printed it
            return Read(Step.CLASSIFY, True, st.group)
        if text[:1] in (" ", "\t"):
            return Read(Step.SKIP)  # an indented source line of a frame
        # not a traceback line: the traceback was cut off (or its exception line has an unusual
        # shape); classify it as the exception line, then close
        del self.streams[key]
        return Read(Step.CLASSIFY, True, st.group)


def is_message_head(prev: Event, header: Event) -> bool:
    """`prev` is the message of the logged exception whose traceback `header` opens: vLLM's
    `logger.exception(e)` (vllm/engine/multiprocessing/engine.py run_mp_engine, v1/engine/core.py
    run_engine_core) writes str(e) as an ERROR record, then the traceback line by line with the same
    level, prefix and `[file.py:N]`; the exception line at the end names the class. When the paste
    is cut inside the traceback, the message is all that says what was raised."""
    return (
        header.source == "vllm"
        and prev.source == "vllm"
        and prev.level in _EXC_LEVELS
        and prev.level == header.level
        and prev.code_location is not None
        and prev.code_location == header.code_location
        and prev.pid == header.pid
        and bool(prev.text.strip())
        and not prev.text.startswith(HEADER)
    )


def _after_frame(frame: str) -> TbState:
    """The state after a frame line: its source line comes next, except after a native frame."""
    return TbState.FRAMES if _NATIVE_FRAME_RE.search(frame) else TbState.SOURCE
