"""Where a TP rank waits, read from its `py-spy dump` text: in a collective (or the step queue
every rank reads), outside one, or unknown (no readable stack).

py-spy's dump (py-spy src/dump.rs print_traces) prints, per thread, a header line
`Thread 7986 (idle): "MainThread"` then one frame per line, innermost first, indented:
`    all_reduce (vllm/distributed/parallel_state.py:493)` (from Python 3.11 the qualified name,
`    GroupCoordinator.all_reduce (...)`); with `--native` native frames such as
`    ncclAllReduce (libnccl.so.2)`; with `--locals` indented `name: value` lines under a frame.
A failed or skipped dump is one comment line starting with `#` (collectors.dump_stacks).

The frames that mean "waiting for the peers" are data: data/collectives.yaml.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from xpu_serve.yamldata import load_data

# `    function (file:line)` or `    function (library)`; the function may hold spaces (C++)
_FRAME_RE = re.compile(r"^\s+(?P<fn>\S.*?) \((?P<file>[^()]*)\)\s*$")
_THREAD_RE = re.compile(r"^Thread (?:0x[0-9a-fA-F]+|\d+)")

OUTSIDE = "outside"  # a readable stack with no collective frame
UNKNOWN = "unknown"  # no readable stack (py-spy missing, failed, timed out)


@dataclass(frozen=True)
class CollectiveFrame:
    """One row of data/collectives.yaml."""

    function: str
    file: str | None
    label: str

    def matches(self, fn: str, file: str) -> bool:
        """The frame `fn (file)` is this one: the same function (py-spy prints a Python 3.11+
        frame by its qualified name, `GroupCoordinator.all_reduce`; C++ names may go on with
        arguments or template parameters) in a file containing `self.file` when set."""
        name = fn.rsplit(".", 1)[-1] if "::" not in fn else fn
        if name != self.function and not fn.startswith((self.function + "(", self.function + "<")):
            return False
        return self.file is None or self.file in file


@lru_cache(maxsize=1)
def collective_frames() -> tuple[CollectiveFrame, ...]:
    """The rows of data/collectives.yaml (loaded once)."""
    text = resources.files("xpu_serve").joinpath("data/collectives.yaml").read_text(encoding="utf-8")
    doc: Any = load_data(text)
    return tuple(
        CollectiveFrame(str(r["function"]), str(r["file"]) if r.get("file") else None, str(r["label"]))
        for r in doc["frames"]
    )


def frames(dump: str) -> list[tuple[str, str]]:
    """(function, file) of every frame of every thread of a py-spy dump text, in print order."""
    out = []
    for line in dump.splitlines():
        m = _FRAME_RE.match(line)
        if m is not None:
            out.append((m.group("fn"), m.group("file")))
    return out


def collective_wait(dump: str) -> str:
    """The label of the collective a py-spy dump waits in (the innermost matching frame of the
    first thread that has one), `OUTSIDE` when its frames hold none, `UNKNOWN` when the text has
    no thread with frames (a `# py-spy ...` note, an empty or cut dump)."""
    if not any(_THREAD_RE.match(line) for line in dump.splitlines()):
        return UNKNOWN
    found = frames(dump)
    if not found:
        return UNKNOWN
    table = collective_frames()
    for fn, file in found:
        for row in table:
            if row.matches(fn, file):
                return row.label
    return OUTSIDE
