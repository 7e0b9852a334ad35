"""Reap zombie children that are not ours to wait for, when `up` runs as PID 1.

In a container without tini, `xpu-serve up` is PID 1 of its PID namespace, so every vLLM process
that loses its parent (an EngineCore whose API server was SIGKILLed, a worker of a dead
EngineCore) is re-parented to it. Such orphans become zombies when they exit and nobody else will
wait for them. A blanket `waitpid(-1)` would also steal the exit status of the children the
supervisor waits for itself (the API server via `subprocess.Popen`, the log relay), so this reaps
only zombies that are direct children, not in a protected set and (as the supervisor calls it) in
one of the engine's sessions, found from `/proc/PID/stat` (proc(5): field 3 state, field 4 ppid,
field 6 session; a zombie keeps its session until it is reaped). Collector tools the supervisor
runs itself (py-spy, xpu-smi, a device check) are in other sessions, so their `subprocess` waits
keep their exit codes.

Written here rather than using tini's logic: `up` must also work as a plain PID 1 (docker run
without --init), and the protected set is the supervisor's own knowledge.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from xpu_serve import procfs


def zombie_children(
    parent: int | None = None, sessions: Iterable[int] | None = None, also: Iterable[int] = ()
) -> list[int]:
    """Pids of zombie (state Z) processes whose parent is `parent` (default: this process) and,
    when `sessions` is given, whose session id is one of them or whose pid is in `also`."""
    me = os.getpid() if parent is None else parent
    sids = None if sessions is None else set(sessions)
    extra = set(also)
    out: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        rest = procfs.stat_fields(name)
        if rest is None:
            continue
        try:
            if len(rest) < 4 or rest[0] != b"Z" or int(rest[1]) != me:
                continue
            if sids is not None and int(rest[3]) not in sids and int(name) not in extra:
                continue
        except ValueError:
            continue
        out.append(int(name))
    return out


def reap_orphans(
    protected: Iterable[int] = (), sessions: Iterable[int] | None = None, also: Iterable[int] = ()
) -> list[int]:
    """Reap every zombie child of this process except `protected` pids (and, when `sessions` is
    given, only those in one of these session ids or in `also`: pids the supervisor proved its
    own and stopped, e.g. a detached grandchild that left the engine's session with setsid);
    returns the reaped pids.

    Never raises: a child reaped meanwhile by someone else is skipped.
    """
    keep = set(protected)
    reaped: list[int] = []
    for pid in zombie_children(sessions=sessions, also=also):
        if pid in keep:
            continue
        try:
            got, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if got == pid:
            reaped.append(pid)
    return reaped
