"""Crash dumps waiting for their first frame: faulthandler's Python frames and the native frames
under a signal dump (tvm-ffi, abseil/glog, UCX, Open MPI) tell whose code crashed (a collective
library's, a GPU runtime's). Owned by the classifier (analysis/classify.py); the line feeder asks
`frame_window` whether a line may still hold such a frame."""

from __future__ import annotations

import re

from xpu_serve.events import Event

# the most recent Python frame of a crash dump inside a collective library's binding (vLLM's
# pynccl wrapper, oneCCL bindings): the crash is the collective library's
_COLLECTIVE_FRAME_RE = re.compile(
    r'File "[^"]*(?:pynccl|/nccl|oneccl|torch_ccl|/ccl/)[^"]*"|\bin (?:nccl|ccl)[A-Z]\w*\s*$'
)
# crash dumps whose stack is native frames (tvm-ffi, abseil/glog, UCX, Open MPI; faulthandler's
# "Fatal Python error" prints Python frames, read by `CrashDumps._crash_frame`), and how many lines after the
# dump header its first frame may come (UCX prints a few header lines first; Open MPI's frames
# may be interleaved with the program's own stdout)
NATIVE_WINDOW = 20
# a native stack frame line of a crash dump: glibc backtrace_symbols / Open MPI
# ("lib.so.0(sym+0x1d)[0x7f..]", opal/util/stacktrace.c), abseil/glog ("@ 0x7f.. sym"), gdb/LLVM
# ("#3 0x7f.. in sym"; gdb's stop location "0x7f.. in sym () from lib.so", infrun.c
# print_stop_event), tvm-ffi ("  ns::func(...)", vllm-project/vllm#52386)
_NATIVE_FRAME_RE = re.compile(
    r"\.so(?:\.[\d.]+)?\((?:[\w$.@]*(?:\+0x[0-9a-f]+)?)?\)|@\s+0x[0-9a-f]+\s+\S|#\d+\s+0x[0-9a-f]+"
    r"|^\s*0x[0-9a-f]+ in \S|^\s*[A-Za-z_][\w:<>~]*::\w+\("
)
# frames that only show the signal being delivered (libc, the dynamic loader, the handler itself)
_SIGNAL_FRAME_RE = re.compile(
    r"libc\.so|libc-|libpthread|ld-linux|__restore_rt|\bkillpg\b|\braise\b|\babort\b|libucs|ucs_handle_error"
    r"|libopen-pal|opal_|libc10\.so\(_ZN3c10\d+Error|FatalSignal|signal_handler|SignalHandler|libc_sigaction"
)
# the crashing frame is in a collective communication library (oneCCL, NCCL/RCCL, MPI, libfabric,
# MSCCL++, HCCL): by name of the shared object, by (mangled) namespace, by API symbol (NCCL's
# ncclXxx and the pncclXxx its profiling entry points export), or by the unprefixed internal
# functions of NCCL's launch path that a stripped libnccl still names (src/enqueue.cc
# addProxyOpIfNeeded, hostStreamPlanTask, uploadProxyOps: the proxy-op enqueue of a collective)
_COLLECTIVE_NATIVE_RE = re.compile(
    r"lib(?:ccl|nccl|rccl|mpi|fabric|mscclpp|hccl|psm\d)\w*\.so|\bccl_\w+::|\bccl::|\bp?nccl[A-Z]\w*"
    r"|\bmscclpp::|_ZN\d*(?:mscclpp|ccl)\d|\bhccl[A-Z]\w*"
    r"|\b(?:addProxyOpIfNeeded|hostStreamPlanTask|uploadProxyOps)\b"
)

# the crashing frame is inside a GPU user-mode driver or runtime: by the shared object's name, or by
# the driver/runtime API symbol when the dump prints no path (CUDA driver/runtime cu*/cuda*, Level
# Zero ze*/zex*, Unified Runtime ur*, HIP hip*, ROCr hsa_*/hsaKmt*). The symbol must be the frame's
# function: after gdb's " in ", glibc/Open MPI's "lib.so(", abseil's "@ 0x.. ", tvm-ffi's "line N, in "
# or at the start of tvm-ffi's bare frame
_GPU_RUNTIME_LIB_RE = re.compile(
    r"(?P<library>(?:libze_|libigc|libigdrcl|libigdfcl|libur_|libsycl|libpi_|libOpenCL|libcuda|libnvidia-"
    r"|libcudart|libnvrtc|libamdhip|libhsa-runtime|libamd_comgr|libumf|libigdgmm)[\w.+-]*?\.so[\d.]*)"
)
_GPU_RUNTIME_SYMBOL_RE = re.compile(
    r"(?:\bin |\.so[\d.]*\(|@\s+0x[0-9a-f]+\s+|^\s*)"
    r"(?P<symbol>(?:cuda|cu|zex|ze|ur|hip)[A-Z]\w*|hsa_\w+|hsaKmt[A-Z]\w*)\b"
)
# tvm-ffi's native frame: 'File "<unknown>", line 0, in cuMemCreate' or a C/C++ source file; a
# Python frame (a .py file, `<frozen ...>`, `<string>`) is not native
_FILE_NATIVE_FRAME_RE = re.compile(
    r'^\s*File "(?:<unknown>|[^"]*\.(?:c|cc|cpp|cxx|cu|h|hpp|S))", line \d+, in '
)


def gpu_runtime_frame(text: str) -> tuple[str, str | None] | None:
    """(what, library) when a native frame line is inside a GPU driver/runtime: `what` is the library
    file or the API symbol that names it, `library` the file when the frame prints one; else None."""
    m = _GPU_RUNTIME_LIB_RE.search(text)
    if m is not None:
        return m.group("library"), m.group("library")
    s = _GPU_RUNTIME_SYMBOL_RE.search(text)
    if s is not None:
        return s.group("symbol"), None
    return None


class CrashDumps:
    """The open crash dumps of the input: `wait` ((file, pid) -> (header line, dump events)),
    `frame_until` (file -> last line that may hold a native frame), the dumps whose first native
    frame was read."""

    def __init__(self) -> None:
        self.wait: dict[tuple[str, int | None], tuple[int, list[Event]]] = {}
        self.frame_until: dict[str, int] = {}
        self._native_seen: set[tuple[tuple[str, int | None], int]] = set()

    def reset(self) -> None:
        """Forget every open dump (a restart of vLLM in the input); containers emptied in place."""
        self.wait.clear()
        self.frame_until.clear()
        self._native_seen.clear()

    def open_dump(self, ev: Event, file: str, lineno: int, native: bool) -> None:
        """A signal dump header (`ev`, a root candidate) waits for its first frame; a `native` dump
        opens a window of NATIVE_WINDOW lines for a native frame."""
        cw = self.wait.get((file, ev.pid))
        if cw is None or lineno - cw[0] > 60:
            cw = self.wait[(file, ev.pid)] = (lineno, [])
        cw[1].append(ev)
        if native:
            self.frame_until[file] = lineno + NATIVE_WINDOW

    def frame_line(self, ev: Event, file: str, lineno: int, prev: str | None) -> None:
        """A frame line while a crash dump waits for its first frame (Python or native)."""
        text = ev.text
        if text.lstrip().startswith('File "'):
            if file in self.frame_until and _FILE_NATIVE_FRAME_RE.match(text):
                self._native_frame(ev, file, lineno)
            else:
                self._crash_frame(ev, file, lineno, prev)
        elif file in self.frame_until and _NATIVE_FRAME_RE.search(text):
            self._native_frame(ev, file, lineno)

    def _crash_frame(self, ev: Event, file: str, lineno: int, prev: str | None) -> None:
        """The first Python frame of the crashing thread in a crash dump (faulthandler prints
        "Current thread 0x... (most recent call first):" or "Stack (most recent call first):",
        then the most recent call first; faulthandler.c): when it is in a collective library's
        binding, the crash is that library's. Other threads' blocks ("Thread 0x...") are skipped."""
        if prev is None or "(most recent call first)" not in prev:
            return
        if "Thread 0x" in prev and "Current thread" not in prev:
            return
        cw = self.wait.pop((file, ev.pid), None)
        if cw is None or lineno - cw[0] > 200:
            return
        if _COLLECTIVE_FRAME_RE.search(ev.text):
            for cev in cw[1]:
                cev.cause = "collective-failure"
                cev.extra["crash_frame"] = ev.text.strip()

    def frame_window(self, file: str, lineno: int) -> bool:
        """True while `lineno` may hold the first native frame of a crash dump in `file`; the window
        is dropped once past (so a log without open dumps pays one dict truth test per line)."""
        until = self.frame_until.get(file)
        if until is None:
            return False
        if lineno > until:
            del self.frame_until[file]
            return False
        return True

    def _native_frame(self, ev: Event, file: str, lineno: int) -> None:
        """A native frame line within NATIVE_WINDOW lines after a signal dump (tvm-ffi's "!!!!!!! Segfault
        encountered !!!!!!!", Open MPI's "*** Process received signal ***", abseil, UCX): the first
        frame that is not the signal's own delivery (libc, handler) is the crashing code; when it is
        a collective library's, the crash is that library's. Later frames are callers: not read."""
        key = (file, ev.pid)
        cw = self.wait.get(key)
        if cw is None and ev.pid is not None:
            key = (file, None)
            cw = self.wait.get(key)
        if cw is None or lineno - cw[0] > NATIVE_WINDOW or _SIGNAL_FRAME_RE.search(ev.text):
            return
        done = (key, cw[0])
        if done in self._native_seen:
            return
        if len(self._native_seen) > 4096:  # a live log of many crashes: keep the memory bounded
            self._native_seen.clear()
        self._native_seen.add(done)  # the wait stays open for the dump's Python frames (_crash_frame)
        self.frame_until.pop(file, None)
        if _COLLECTIVE_NATIVE_RE.search(ev.text):
            self._attribute_crash(cw[1], "collective-failure", ev.text, None)
            return
        gpu = gpu_runtime_frame(ev.text)
        if gpu is not None:
            self._attribute_crash(cw[1], "umd-segfault", ev.text, gpu[1])

    @staticmethod
    def _attribute_crash(dumps: list[Event], cause: str, frame: str, library: str | None) -> None:
        """The crash dumps waiting on their first frame take `cause` (only a bare process-crash)."""
        for cev in dumps:
            if cev.cause == "process-crash":
                cev.cause = cause
                cev.extra["crash_frame"] = frame.strip()
                if library is not None:
                    cev.extra.setdefault("library", library)
