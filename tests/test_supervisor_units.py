"""Supervisor integration pieces without a whole `up`: the kernel watcher's settle (a real file
source and a real process), fatal lines from the signature table, XPU_SERVE_PYTHON in config
loading for every command, the bundle-request wake-up by signal."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from xpu_serve import bundle as bundle_mod
from xpu_serve import procfs
from xpu_serve.config import interpolate, load_config
from xpu_serve.diagnosis import Analyzer
from xpu_serve.incarnation import ProcessInfo
from xpu_serve.sim.kernel import segfault_records, write_records
from xpu_serve.supervision.watch import is_fatal
from xpu_serve.watchers import KernelWatcher

from .helpers import kmsg_readable
from .test_kernel_source import Ctx, make_config, spawn_with_comm

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_settle_waits_for_a_late_segfault_record(tmp_path: Path) -> None:
    path = tmp_path / "kernel.log"
    path.write_text("")
    cfg = make_config(source="file", path=str(path))
    worker = spawn_with_comm("VLLM::Worker_TP")
    kw = KernelWatcher(cfg, sysfs_drm=str(tmp_path / "no-drm"), settle_s=3.0)
    ctx = Ctx(cfg, started_at=time.time() - 1)
    ctx.processes[worker.pid] = ProcessInfo("Worker_TP2", worker.pid, rank=2)
    try:

        async def main() -> tuple[bool, float, bool, float]:
            task = asyncio.ensure_future(kw.run(ctx))
            await asyncio.sleep(0.3)  # the watch caches the worker's comm while it lives
            worker.kill()
            worker.wait()
            # the kernel prints the record 0.4 s after the exit was seen
            threading.Timer(
                0.4, write_records, (str(path), segfault_records("VLLM::Worker_TP", worker.pid, 7))
            ).start()
            t0 = time.monotonic()
            got = await kw.settle(ctx, [worker.pid])
            waited = time.monotonic() - t0
            # nothing more comes: a second incarnation-less wait gives up after max_s
            t1 = time.monotonic()
            again = await kw.settle(ctx, [worker.pid], max_s=0.2)  # already seen: at once
            again_s = time.monotonic() - t1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return got, waited, again, again_s

        got, waited, again, again_s = asyncio.run(main())
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert got is True and 0.3 < waited < 2.5, waited
    assert again is True and again_s < 0.1
    seg = [e for e in ctx.records if "segfault at" in e.text]
    assert len(seg) == 1 and seg[0].rank == 2 and seg[0].process == "Worker_TP2"
    assert kw.crash_pids == {worker.pid}


@pytest.mark.skipif(not kmsg_readable(), reason="/dev/kmsg is not readable here (needs root or CAP_SYSLOG)")
def test_kernel_settle_from_kmsg_ends_within_the_short_kmsg_window() -> None:
    """From the real /dev/kmsg (read only), a death with no crash record (a `kill -9` from user
    space) settles as soon as the watch has read the ring buffer to its end (a crash record is
    in it by the time the exit is seen), well within KMSG_SETTLE_S, not the configured settle_s
    (3 s here)."""
    from xpu_serve.watchers import KMSG_SETTLE_S

    cfg = make_config(source="kmsg")
    kw = KernelWatcher(cfg, settle_s=3.0)
    ctx = Ctx(cfg)

    async def main() -> tuple[str | None, bool, float]:
        task = asyncio.ensure_future(kw.run(ctx))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        got = await kw.settle(ctx, [2**22 + 7])  # a pid no record names
        waited = time.monotonic() - t0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return kw.source_kind, got, waited

    kind, got, waited = asyncio.run(main())
    assert kind == "kmsg" and got is False
    assert waited < KMSG_SETTLE_S * 0.5, waited


def test_kernel_settle_gives_up_after_settle_s_and_when_not_reading(tmp_path: Path) -> None:
    path = tmp_path / "kernel.log"
    path.write_text("")
    cfg = make_config(source="file", path=str(path))
    kw = KernelWatcher(cfg, settle_s=0.3)
    ctx = Ctx(cfg)

    async def main() -> tuple[bool, float, bool]:
        before = await kw.settle(ctx, [1])  # not running: nothing to wait for
        task = asyncio.ensure_future(kw.run(ctx))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        got = await kw.settle(ctx, [1])
        waited = time.monotonic() - t0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return before, waited, got

    before, waited, got = asyncio.run(main())
    assert before is False and got is False
    assert 0.25 <= waited < 2.0, waited
    off = KernelWatcher(make_config(source="none"), settle_s=5.0)

    async def off_main() -> tuple[bool, float]:
        task = asyncio.ensure_future(off.run(Ctx(off.config)))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        r = await off.settle(Ctx(off.config), [1])
        await asyncio.gather(task, return_exceptions=True)
        return r, time.monotonic() - t0

    r, t = asyncio.run(off_main())
    assert r is False and t < 0.5
    assert off.source_status()["source"] == "none"
    assert "source: none" in str(off.source_status()["reason"])


def test_fatal_lines_come_from_the_signature_table() -> None:
    an = Analyzer()
    fatal = an.feed_line(
        "(EngineCore_DP0 pid=2390) ERROR 11-06 19:52:03 [core.py:708] EngineCore encountered a fatal error."
    )
    assert fatal is not None and is_fatal(an, fatal)
    assert an.table.by_id[fatal.signature].extra.get("fatal") is True
    not_fatal = an.feed_line(
        "(EngineCore_DP0 pid=2390) ERROR 11-06 19:52:03 [core.py:718] RuntimeError: Native API failed. "
        "Native API returns: 20 (UR_RESULT_ERROR_DEVICE_LOST)"
    )
    assert not_fatal is not None and not is_fatal(an, not_fatal)
    assert not is_fatal(an, None)
    fatal_ids = {sid for sid, sig in an.table.by_id.items() if sig.extra.get("fatal")}
    assert {"engine-core-fatal", "engine-dead-error", "engine-core-failed-start"} <= fatal_ids


def _env_without_python() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XPU_SERVE_PYTHON", None)
    return env


def test_xpu_serve_python_defaults_to_our_interpreter_in_every_command(tmp_path: Path) -> None:
    saved = os.environ.pop("XPU_SERVE_PYTHON", None)
    try:
        assert interpolate("${XPU_SERVE_PYTHON:-python3}") == (sys.executable, [])
        assert interpolate("${XPU_SERVE_PYTHON}") == (sys.executable, [])
        # an explicit environment mapping sees only itself
        assert interpolate("${XPU_SERVE_PYTHON:-python3}", {}) == ("python3", [])
        cfg = load_config(ROOT / "configs" / "demo.yaml")
        assert cfg.engine.command[0] == sys.executable
    finally:
        if saved is not None:
            os.environ["XPU_SERVE_PYTHON"] = saved
    env = _env_without_python()
    r = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "render", "-c", str(ROOT / "configs" / "demo.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert f"\n{sys.executable} -m xpu_serve.sim serve" in r.stdout, r.stdout
    assert "\npython3 -m" not in r.stdout
    env["XPU_SERVE_PYTHON"] = "/opt/other/python"
    r = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "render", "-c", str(ROOT / "configs" / "demo.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0 and "\n/opt/other/python -m xpu_serve.sim" in r.stdout, r.stdout + r.stderr


def test_wake_supervisor_only_signals_a_process_that_catches_sigusr1() -> None:
    code = (
        "import signal, sys, time\n"
        "got = []\n"
        "if sys.argv[1] == 'catch':\n"
        "    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\n"
        "print('ok', flush=True)\n"
        "t = time.monotonic()\n"
        "while not got and time.monotonic() - t < 20: time.sleep(0.01)\n"
        "print('woken' if got else 'timeout', flush=True)\n"
    )
    catcher = subprocess.Popen([sys.executable, "-c", code, "catch"], stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen([sys.executable, "-c", code, "plain"], stdout=subprocess.PIPE, text=True)
    try:
        assert catcher.stdout is not None and catcher.stdout.readline() == "ok\n"
        assert plain.stdout is not None and plain.stdout.readline() == "ok\n"
        assert procfs.catches_signal(catcher.pid, signal.SIGUSR1) is True
        assert procfs.catches_signal(plain.pid, signal.SIGUSR1) is False
        assert bundle_mod.wake_supervisor(catcher.pid) is True
        assert catcher.stdout.readline() == "woken\n"
        assert bundle_mod.wake_supervisor(plain.pid) is None  # not sent: it would have died
        time.sleep(0.1)
        assert plain.poll() is None
        assert bundle_mod.wake_supervisor(None) is False and bundle_mod.wake_supervisor(-1) is False
    finally:
        for p in (catcher, plain):
            p.kill()
            p.wait()


def test_exit_burst_ranking_and_the_exiting_flag() -> None:
    """The trigger of an exit burst: the earliest abnormal death (signal or non-zero code), before
    unknown statuses and clean exit-0 teardowns; a zombie or gone pid counts as exiting."""
    from xpu_serve.incarnation import Trigger
    from xpu_serve.supervision.exits import exit_rank, exiting

    def t(name: str, at: float, code: int | None = None, sig: str | None = None) -> Trigger:
        return Trigger(kind="process-exit", detail=name, at=at, process=name, exit_code=code, signal=sig)

    burst = [
        t("Worker_TP1", 1.0, code=0),
        t("EngineCore", 0.5),
        t("APIServer", 2.0, sig="SIGKILL"),
        t("Worker_TP0", 3.0, code=1),
    ]
    assert min(burst, key=exit_rank).process == "APIServer"
    assert min(burst[:2], key=exit_rank).process == "EngineCore"  # unknown before a clean exit
    assert min([*burst, t("Worker_TP2", 1.5, code=1)], key=exit_rank).process == "Worker_TP2"
    # dated alike (still exiting when a peer's exit came): the outside kill or the fault, not the
    # abort it caused, whichever was reported first; a later fault stays after an earlier abort
    alike = [t("Worker_TP3", 4.0, sig="SIGABRT"), t("Worker_TP0", 4.0, sig="SIGKILL"), t("Worker_TP1", 4.0, code=1)]
    assert min(alike, key=exit_rank).process == "Worker_TP0"
    assert min([*alike[:1], t("Worker_TP2", 4.0, sig="SIGSEGV")], key=exit_rank).process == "Worker_TP2"
    assert min([*alike[:1], t("Worker_TP0", 4.1, sig="SIGSEGV")], key=exit_rank).process == "Worker_TP3"

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not exiting(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not exiting(p.pid) and time.monotonic() < deadline:  # a zombie until reaped
            time.sleep(0.01)
        assert exiting(p.pid)
    finally:
        p.kill()
        p.wait()


def test_signal_of_an_unknown_exit_status_comes_from_its_own_crash_dump() -> None:
    """EngineCore reaps a worker before the supervisor reads its status (no proc connector in a
    container): the verdict's root, the worker's own unprefixed crash dump in the real
    cpu-tp2-worker0-segv log, names the signal. Another process, or a known status, is left alone."""
    from xpu_serve.analysis.incident import Root
    from xpu_serve.analysis.supervised import signal_from_root
    from xpu_serve.diagnosis import Analyzer, diagnose_files
    from xpu_serve.facts import trigger
    from xpu_serve.incarnation import Trigger
    from xpu_serve.signatures import load_table

    real = Path(__file__).parent / "fixtures" / "cases" / "cpu-tp2-worker0-segv" / "vllm.log"
    root = diagnose_files([real]).root
    assert root is not None and root.process == "Worker_TP0"
    assert root.text == "!!!!!!! Segfault encountered !!!!!!!"
    table = load_table()

    def trig(**kw: object) -> Trigger:
        base: dict[str, object] = dict(kind="process-exit", detail="d", at=0.0, process="Worker_TP0", rank=0,
                                       pid=root.pid)
        base.update(kw)
        return Trigger(**base)  # type: ignore[arg-type]

    assert signal_from_root(root, trig(), table) == "SIGSEGV"
    assert signal_from_root(root, trig(exit_code=1), table) is None  # the status is known
    assert signal_from_root(root, trig(signal="SIGKILL"), table) is None
    other = trig(process="Worker_TP1", rank=1, pid=(root.pid or 0) + 1)
    assert signal_from_root(root, other, table) is None  # not the root's process
    assert signal_from_root(root, trig(kind="health"), table) is None
    faulthandler = Root("vllm", "EngineCore", None, 9, None, None, None, "Fatal Python error: Aborted")
    assert signal_from_root(faulthandler, trig(process="EngineCore", pid=9), table) == "SIGABRT"
    plain = Root("vllm", "Worker_TP0", 0, None, None, None, None, "ValueError: x")
    assert signal_from_root(plain, trig(), table) is None

    # the trigger fed as a fact: the analysis itself completes the verdict
    an = Analyzer()
    an.add_event(trigger("process-exit", "Worker_TP0 died: exit status unknown", 0.0,
                         {"process": "Worker_TP0", "rank": 0, "pid": root.pid}))
    inc = diagnose_files([real], analyzer=an)
    assert inc.trigger_signal == "SIGSEGV"
    assert f"Worker_TP0 (pid {root.pid}): exit status not seen by the supervisor; signal SIGSEGV taken " \
        "from its crash dump" in inc.notes


def test_event_log_levels_and_journald_priority_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json as _json

    from xpu_serve.supervision.eventlog import EventLog

    out = tmp_path / "stderr.txt"
    with open(out, "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        log = EventLog(stream=stream, jsonl_path=tmp_path / "events.jsonl")
        log.emit("incident", "incarnation 1: process-crash")
        log.emit("ready", "incarnation 1 ready")
        log.emit("warning", "bundle incomplete")
        log.emit("reaped", "reaped 1")
        log.emit("signal", "SIGTERM: stopping", level="warning")
        log.close()
    lines = out.read_text().splitlines()
    assert [ln[:3] for ln in lines] == ["<3>", "<6>", "<4>", "<7>", "<4>"]
    recs = [_json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["level"] for r in recs] == ["error", "info", "warning", "debug", "warning"]
    # another stream (a terminal, a pipe, a file that is not journald's): no prefix
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    with open(out, "w") as stream:
        EventLog(stream=stream, fmt="json").emit("gave-up", "crash loop", exit_code=3)
    rec = _json.loads(out.read_text())
    assert rec["level"] == "error" and rec["exit_code"] == 3
