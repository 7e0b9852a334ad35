"""The traceback tracker's named states on a real vLLM traceback shape (CPython's format), and
the pastes that start inside one."""

from __future__ import annotations

from xpu_serve.analysis.classify import wait_frame_re
from xpu_serve.analysis.traceback import Step, TbState, TracebackTracker
from xpu_serve.diagnosis import Analyzer
from xpu_serve.events import Event

KEY = ("vllm.log", 41)


def _read(
    tr: TracebackTracker, lines: list[str], opens: bool = False
) -> list[tuple[Step, bool, TbState | None]]:
    out = []
    for i, text in enumerate(lines, 1):
        got = tr.read(Event(source="vllm", text=text), KEY, i, lambda: opens)
        st = tr.streams.get(KEY)
        out.append((got.step, got.in_tb, st.state if st else None))
    return out


def test_a_whole_traceback_walks_frames_source_exception_and_closes() -> None:
    tr = TracebackTracker()
    got = _read(
        tr,
        [
            "Traceback (most recent call last):",
            '  File "/usr/lib/python3.12/site-packages/vllm/v1/engine/core.py", line 491, in run_engine_core',
            '    raise RuntimeError(f"NCCL error: {e}")',
            "RuntimeError: NCCL error: unhandled system error",
            "INFO 04-14 23:00:35 [launcher.py:80] Shutting down",
        ],
    )
    assert got == [
        (Step.CLASSIFY, False, TbState.FRAMES),
        (Step.CLASSIFY, False, TbState.SOURCE),
        (Step.SKIP, False, TbState.FRAMES),  # the source line is code, never evidence
        (Step.CLASSIFY, True, TbState.EXCEPTION),
        (Step.CLASSIFY, False, None),
    ]
    assert tr.last_frame[1].startswith('File "/usr/lib/python3.12/site-packages/vllm/v1/engine/core.py"')


def test_a_chained_traceback_keeps_its_group() -> None:
    tr = TracebackTracker()
    _read(tr, ["Traceback (most recent call last):", "ValueError: x"])
    got = tr.read(Event(source="vllm", text="Traceback (most recent call last):"), KEY, 9, lambda: False)
    assert got.group == 1 and tr.streams[KEY].state is TbState.FRAMES


def test_a_paste_starting_at_a_frame_or_at_a_bare_exception_line_opens_one() -> None:
    tr = TracebackTracker()
    assert _read(tr, ['  File "x.py", line 3, in f'])[0][2] is TbState.SOURCE
    tr = TracebackTracker()
    assert _read(tr, ["torch.OutOfMemoryError: XPU out of memory"]) == [(Step.CLASSIFY, False, None)]
    assert _read(tr, ["torch.OutOfMemoryError: XPU out of memory"], opens=True) == [
        (Step.CLASSIFY, True, TbState.EXCEPTION)
    ]


def test_a_quiet_stream_is_closed() -> None:
    tr = TracebackTracker()
    _read(tr, ["Traceback (most recent call last):"])
    for i in range(256):
        tr.expire(2000 + i)
    assert tr.streams == {}


def test_a_native_frame_has_no_source_line() -> None:
    # tvm-ffi's crash handler prints C frames in Python's frame shape with line 0: the line after
    # one is the next frame or the process's next output, never the frame's source
    tr = TracebackTracker()
    got = _read(
        tr,
        [
            "!!!!!!! Segfault encountered !!!!!!!",
            '  File "<unknown>", line 0, in 0xffffffffffffffff',
            "Worker proc VllmWorker-1 died unexpectedly (exit code: None), shutting down executor.",
        ],
    )
    assert got[1][2] is TbState.FRAMES
    assert got[2][0] is Step.CLASSIFY  # read, not skipped as code
    tr = TracebackTracker()
    walked = _read(
        tr,
        [
            "Traceback (most recent call last):",
            '  File "<unknown>", line 0, in 0x7f3a2b1c',
            '  File "/usr/lib/python3.12/site-packages/vllm/worker.py", line 12, in run',
            "    self.step()",
            "RuntimeError: boom",
        ],
    )
    assert [s for _, _, s in walked] == [
        TbState.FRAMES,
        TbState.FRAMES,
        TbState.SOURCE,
        TbState.FRAMES,
        TbState.EXCEPTION,
    ]


def test_the_engine_core_s_wait_on_its_workers_is_a_wait_frame() -> None:
    # collective_rpc's call of get_response (multiproc_executor.py), as dequeue's own line, and the
    # Ray compiled graph's output read (ray/dag/compiled_dag_node.py _execute_until); the patterns
    # are the packaged rules' wait_frames rows
    wait = wait_frame_re(Analyzer())
    assert wait is not None
    for source in (
        "    result = get_response(w, dequeue_timeout)",
        "    status, result = mq.dequeue(timeout=t)",
        "    result = self._dag_output_fetcher.read(timeout)",
    ):
        tr = TracebackTracker(wait)
        got = _read(
            tr,
            [
                "Traceback (most recent call last):",
                '  File "/usr/lib/python3.12/site-packages/vllm/v1/executor/multiproc_executor.py", line 220, in collective_rpc',
                source,
            ],
        )
        assert got[2][0] is Step.WAIT_FRAME, source
    # any other source line of a frame is code, never classified
    tr = TracebackTracker(wait)
    got = _read(tr, ["Traceback (most recent call last):", '  File "x.py", line 3, in f', "    result = fetch(timeout)"])
    assert got[2][0] is Step.SKIP
