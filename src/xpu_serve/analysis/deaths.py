"""Deaths: the signal a death record names, the process a vLLM prefix names, and whether a
death explains what follows it.

Sources of the formats: CPython faulthandler (Python/faulthandler.c `faulthandler_handlers`),
tvm-ffi's "!!!!!!! Segfault encountered !!!!!!!", the kernel's "segfault at", bash/zsh job
reports and glibc's strsignal translations, systemd's "status=11/SEGV", a launcher's exit status
128+N, vLLM's process names (vllm/v1/executor/multiproc_executor.py `VllmWorker-N`/`Worker_TPn`).
"""

from __future__ import annotations

import re
import signal

from xpu_serve.events import Event

WORKER_RE = re.compile(r"(?:VllmWorker-|Worker_TP|VllmWorker_TP)(\d+)")
EXIT_SIG = {
    "-11": "SIGSEGV",
    "-6": "SIGABRT",
    "-9": "SIGKILL",
    "-7": "SIGBUS",
    "-15": "SIGTERM",
    "-4": "SIGILL",
}
# how crash dumps name the signal (CPython faulthandler: Python/faulthandler.c `faulthandler_handlers`;
# tvm-ffi's "!!!!!!! Segfault encountered !!!!!!!"; the kernel's "segfault at")
SIGNAME = {
    "segmentation fault": "SIGSEGV",
    "segfault": "SIGSEGV",
    "aborted": "SIGABRT",
    "abort": "SIGABRT",
    "bus error": "SIGBUS",
    "floating point exception": "SIGFPE",
    "illegal instruction": "SIGILL",
    "killed": "SIGKILL",
    # zsh's job reports (Src/signames2.awk names SIGIOT = SIGABRT on Linux "IOT instruction")
    "iot instruction": "SIGABRT",
    "illegal hardware instruction": "SIGILL",
    # the shell's job reports in other languages (glibc strsignal translations: po/de.po, fr.po, ...)
    "speicherzugriffsfehler": "SIGSEGV",
    "erreur de segmentation": "SIGSEGV",
    "violación de segmento": "SIGSEGV",
    "falha de segmentação": "SIGSEGV",
    "errore di segmentazione": "SIGSEGV",
    "ошибка сегментирования": "SIGSEGV",
    "段错误": "SIGSEGV",
    "セグメンテーション違反です": "SIGSEGV",
    "abgebrochen": "SIGABRT",
    "abandon": "SIGABRT",
    "abortado": "SIGABRT",
    "аварийный останов": "SIGABRT",
    "已放弃": "SIGABRT",
    "中止": "SIGABRT",
    "getötet": "SIGKILL",
    "已杀死": "SIGKILL",
}


def death_signal(ev: Event) -> str | None:
    """The signal a death record names, as "SIGSEGV"..., or None: the supervisor's exit fact
    (`extra["signal"]`), a crash dump's signal text ("Segmentation fault"), a negative exit code."""
    for k in ("signal", "signame"):
        v = ev.extra.get(k)
        if isinstance(v, str) and v:
            if v.upper().startswith("SIG"):
                return v.upper()
            got = SIGNAME.get(v.strip().lower())
            if got:
                return got
    code = ev.extra.get("exit_code")
    if code is not None:
        return EXIT_SIG.get(str(code))
    num = ev.extra.get("signum")  # a signal number (systemd's "status=11/SEGV")
    if num is not None and str(num).isdigit():
        try:
            return signal.Signals(int(str(num))).name
        except ValueError:
            return None
    status = ev.extra.get("exit_status")  # a shell/launcher exit status 128+N: killed by signal N
    if status is not None and str(status).isdigit() and 128 < int(str(status)) < 160:
        try:
            return signal.Signals(int(str(status)) - 128).name
        except ValueError:
            return None
    return None


def normalize_process(name: str | None, rank: int | None = None) -> str | None:
    """vLLM process name as the verdict contract spells it: "EngineCore" for "EngineCore_DP0",
    "Worker_TP<rank>" for "Worker"/"VllmWorker-<n>" when the rank is known, "APIServer"..."""
    if not name:
        return None
    if name.startswith("EngineCore"):
        return "EngineCore"
    m = WORKER_RE.search(name)
    if m:
        return f"Worker_TP{m.group(1)}"
    if name.startswith(("VLLM::Worker", "Worker", "VllmWorker", "RayWorker")):
        return f"Worker_TP{rank}" if rank is not None else "Worker"
    if name.startswith("VLLM::EngineCor"):
        return "EngineCore"
    return name


def signals_in_fields(ev: Event, fields: tuple[str, ...]) -> set[str]:
    """The signals named by the record's own groups `fields` only ("signame": a crash text such as
    "Aborted" or "SIGABRT"; "exit_code": a negative exit code), not by a supervisor fact."""
    out: set[str] = set()
    for f in fields:
        v = ev.extra.get(f)
        if v is None or v == "":
            continue
        if f == "exit_code":
            got = EXIT_SIG.get(str(v))
        else:
            s = str(v).strip()
            got = s.upper() if s.upper().startswith("SIG") else SIGNAME.get(s.lower())
        if got:
            out.add(got)
    return out


def abnormal_death(ev: Event) -> bool:
    """A death that explains what follows it: vLLM's reports and crash dumps, or a supervisor
    fact of a death by a crash signal or a non-zero exit (not SIGTERM/exit 0 of shutdown)."""
    if ev.source != "process":
        return True
    sig_name = str(ev.extra.get("signame") or ev.extra.get("signal") or "")
    if sig_name:
        return sig_name not in ("SIGTERM", "SIGINT", "SIGHUP")
    code = ev.extra.get("exit_code")
    return code not in (None, 0, "0")


def same_proc(death: Event, ev: Event) -> bool:
    """`ev` is from the process `death` records (the worker it names, the engine core it names,
    or its pid)."""
    w = death.extra.get("worker")
    if isinstance(w, str):
        m = WORKER_RE.search(w)
        if m and ev.rank is not None and int(m.group(1)) == ev.rank:
            return True
    engine = death.extra.get("engine")
    if isinstance(engine, str) and ev.process and normalize_process(engine) == normalize_process(ev.process):
        return True
    return death.pid is not None and death.pid == ev.pid
