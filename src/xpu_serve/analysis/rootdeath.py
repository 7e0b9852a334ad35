"""The root's own death records (crash dump, exit fact, EngineCore's report: evidence, not
consequences) and, for a kernel GPU fault, the driver's record that opened the fault burst."""

from __future__ import annotations

import re
from functools import cmp_to_key

from xpu_serve.analysis.deaths import death_signal
from xpu_serve.analysis.incident import Root
from xpu_serve.analysis.timeorder import cmp_time, same_burst
from xpu_serve.analysis.work import Ctx
from xpu_serve.events import Event

_DRM_DEV_RE = re.compile(r"(?:xe|i915|amdgpu) ([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.\d)")


def root_evidence(cx: Ctx, root: Event, subj: Root, pool: list[Event]) -> list[Event]:
    """Death records of the root's own process (its crash dump, the supervisor's exit fact,
    EngineCore's report of its death), in time order: evidence of the root, not consequences.
    A dump without a process prefix is linked by order (as for the root) and only one is taken,
    so the teardown dumps of the surviving ranks stay consequences."""
    proc, rank, pid = subj.process, subj.rank, subj.pid
    anonymous = proc is None and pid is None
    root_sig = death_signal(root)
    out: list[Event] = []
    seen: set[int] = {id(root)}
    unprefixed = 0
    for ev in sorted(pool, key=cmp_to_key(cmp_time)):
        if id(ev) in seen or ev.signature not in cx.st._set["death_evidence"]:
            continue
        seen.add(id(ev))
        if (
            ev.signature == root.signature
            and ev.file is not None
            and ev.file == root.file
            and ev.line is not None
            and root.line is not None
            and 0 < ev.line - root.line <= 64
            and ev.pid is None
            and ev.process is None
        ):
            out.append(ev)  # the next frames of the root's own crash stack
            continue
        if anonymous:
            continue
        bare = ev.signature in cx.st._set["unprefixed_dumps"] and ev.pid is None and ev.process is None
        p, r, d = cx.subj.subject(ev, [], link=bare)
        if d is not None and pid is not None and (ev.source == "kernel") == (root.source == "kernel"):
            same = d == pid  # pids of one namespace (the kernel's, or the log's and the supervisor's)
        else:
            same = p is not None and p == proc and r == rank and (r is not None or p != "Worker")
        if not same:
            continue
        if bare:
            s2 = death_signal(ev)
            if unprefixed or (root_sig and s2 and s2 != root_sig):
                continue
            unprefixed += 1
        out.append(ev)
    return out


def primary_gpu_fault(cx: Ctx, root: Event, kernel_gpu: list[Event]) -> Event | None:
    """The device's own fault record (page fault, CAT error, GuC load/init failure) that opened
    the kernel burst `root` belongs to, when it comes before `root`; else None.

    The xe driver reports a bad access first (xe_gt_pagefault.c "Fault response", "Engine memory
    CAT error"), then bans the context and times the job out (xe_guc_submit.c "Timedout job"),
    resets the engine or the GT and, when that fails, declares the device wedged; i915 reports
    a GuC load failure before "declaring it wedged"; amdgpu reports the ring timeout
    (amdgpu_job.c amdgpu_job_timedout) before its reset and "device wedged". The later records rank higher as root
    candidates because they name the process; causally the first fault is the root."""
    dev = _DRM_DEV_RE.match(root.text)
    best: Event | None = None
    for ev in kernel_gpu:
        if ev is root or ev.signature not in cx.st._burst_openers:
            continue
        d = _DRM_DEV_RE.match(ev.text)
        if dev is not None and d is not None and d.group(1) != dev.group(1):
            continue
        if not same_burst(ev, root) or cmp_time(ev, root) > 0:
            continue
        if cmp_time(ev, root) == 0 and (ev.file != root.file or (ev.line or 0) >= (root.line or 0)):
            continue
        if (
            best is None
            or cmp_time(ev, best) < 0
            or (cmp_time(ev, best) == 0 and ev.file == best.file and (ev.line or 0) < (best.line or 0))
        ):
            best = ev
    return best
