"""What a hostile operator does to a running `xpu-serve up` (stray signals, kill -9 at each state,
FIFOs in the request folder, signal storms), as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from xpu_serve import supervisor

pytestmark = pytest.mark.e2e


def test_stray_signals_are_logged_and_ignored_not_fatal(up_factory: Any) -> None:
    """`kill -USR2` (or ALRM, PROF, a real-time signal) to the supervisor of a ready server: before
    the fix the default action killed the supervisor and left the whole vLLM tree running,
    unsupervised. Now: logged once a second, ignored, the server stays up, SIGTERM still stops all;
    the engine's processes keep the default dispositions (handlers, not SIG_IGN)."""
    assert signal.SIGUSR2 in supervisor.STRAY_SIGNALS and signal.SIGRTMIN + 3 in supervisor.STRAY_SIGNALS
    u = up_factory()
    u.start()
    st = u.wait_tree(1)
    for _ in range(50):
        for sig in (signal.SIGUSR2, signal.SIGALRM, signal.SIGPROF, signal.SIGVTALRM, signal.SIGRTMIN + 3):
            os.kill(u.proc.pid, sig)
    time.sleep(1.0)
    assert u.proc.poll() is None, u.stderr()
    now = u.state()
    assert now["state"] == "ready" and now["incarnation"] == 1
    ignored = [e for e in u.events("signal") if "ignored" in e["msg"]]
    assert {e["msg"].split(":")[0] for e in ignored} >= {"SIGUSR2", "SIGALRM", "SIGPROF", "SIGVTALRM"}
    assert len(ignored) < 50  # a storm is rate-limited, not 250 lines
    for p in st["processes"]:
        with open(f"/proc/{p['pid']}/status") as f:
            ign = int(next(ln for ln in f if ln.startswith("SigIgn:")).split()[1], 16)
        assert not ign & (1 << (signal.SIGUSR2 - 1)), (p, hex(ign))
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    assert not u.our_pids()
    assert not u.our_segments()


def test_status_after_kill9_names_the_orphans_and_the_next_up_stops_them(up_factory: Any) -> None:
    """kill -9 of the supervisor of a ready server: `status` listed the still-running server
    processes as if nothing were wrong. Now each is ORPHANED; a second `up` on the same runtime
    directory stops them and removes their segments, and its own SIGTERM leaves nothing."""
    u = up_factory()
    u.start()
    st = u.wait_tree(1)
    old = {p["pid"] for p in st["processes"]}
    u.proc.kill()
    u.proc.wait(10)
    time.sleep(0.5)
    assert all(os.path.exists(f"/proc/{p}") for p in old)  # nobody stopped the tree
    r = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "status", "--runtime-dir", str(u.runtime)],
        capture_output=True, text=True, timeout=30,
    )
    assert r.returncode == 1, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("process")]
    assert len(rows) == len(old) and all("ORPHANED" in ln for ln in rows), r.stdout
    u.start()
    u.wait_tree(1)
    orphans = [e for e in u.events("orphans") if "process(es)" in e["msg"]]
    assert orphans and all(str(p) in orphans[-1]["msg"] for p in old), orphans
    assert not any(os.path.exists(f"/proc/{p}") and psutil.Process(p).status() != "zombie" for p in old)
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    assert not u.our_pids()
    assert not u.our_segments()


def test_a_fifo_or_a_deep_json_in_the_request_folder_does_not_block_bundle_requests(up_factory: Any) -> None:
    """A FIFO named requests/bundle-x.json blocked the request watcher's thread forever on open():
    no later `xpu-serve bundle` request of the incarnation was answered by the supervisor, and
    each such FIFO held one worker of the default executor for good. A note nested 100000 deep
    was taken and never answered. Now: the FIFO is not a request; the deep one gets a bundle; a
    real request after both is answered by the supervisor."""
    from xpu_serve.bundle import REQUESTS_DIR, request_bundle, wake_supervisor

    u = up_factory()
    u.start()
    u.wait_tree(1)
    req_dir = u.runtime / REQUESTS_DIR
    req_dir.mkdir(exist_ok=True)
    os.mkfifo(req_dir / "bundle-0000fifo.json")
    (req_dir / "bundle-0001deep.json").write_text('{"note": ' + "[" * 100000 + "]" * 100000 + "}")
    real = request_bundle(u.runtime, note="after the hostile ones")
    assert wake_supervisor(u.proc.pid) is True
    deadline = time.monotonic() + 30
    answers = [req_dir / "bundle-0001deep.done.json", real.with_name(real.name[: -len(".json")] + ".done.json")]
    while time.monotonic() < deadline and not all(a.exists() for a in answers):
        time.sleep(0.05)
    for a in answers:
        assert a.exists(), sorted(p.name for p in req_dir.iterdir())
        ans = json.loads(a.read_text())
        assert ans["path"] and Path(ans["path"]).is_dir(), ans
    assert (req_dir / "bundle-0000fifo.json").exists()  # left alone, not taken
    assert u.proc.poll() is None
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    assert not u.our_pids()


def test_kill9_while_capturing_is_reported_by_the_next_up(up_factory: Any) -> None:
    """kill -9 of the supervisor while it captured an incident (the tree had already exited):
    the next `up` on the runtime directory swept the segments and said nothing; the incident
    was lost without a word. Now it says the previous supervisor died while capturing, which
    failure it was, and where the logs are."""
    u = up_factory(faults="worker-segv rank=0 after=50 incarnation=1")
    u.start()
    u.wait_for(lambda: u.state().get("state") == "capturing", 45, "state capturing")
    u.proc.kill()
    u.proc.wait(10)
    assert "SIGSEGV" in (u.state().get("reason") or ""), u.state()
    u.cfg["environment"]["vars"]["XPU_SERVE_SIM_FAULTS"] = ""
    u.write_config()
    u.start()
    u.wait_tree(1)
    msgs = [e["msg"] for e in u.events("orphans") if e.get("previous_state")]
    assert len(msgs) == 1, u.events("orphans")
    assert "ended without a clean stop while capturing (incarnation 1)" in msgs[0]
    assert "SIGSEGV" in msgs[0] and "has no finished bundle" in msgs[0], msgs[0]
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code() == 0
    assert not u.our_pids()
    assert not u.our_segments()


def test_a_sigterm_and_sighup_storm_stops_once_with_few_log_lines(up_factory: Any) -> None:
    """SIGHUP every 3 ms for 1.5 s, then SIGTERM every 3 ms until it exits: one event line per
    signal before (hundreds); now repeats within a second are acted on but not logged. Exit 0, nothing
    left."""
    u = up_factory()
    u.start()
    u.wait_tree(1)
    sent = 0
    end = time.monotonic() + 1.5
    while time.monotonic() < end:  # spaced out, so that the kernel does not merge them
        os.kill(u.proc.pid, signal.SIGHUP)
        sent += 1
        time.sleep(0.003)
    try:
        while u.proc.poll() is None:
            os.kill(u.proc.pid, signal.SIGTERM)
            sent += 1
            time.sleep(0.003)
    except ProcessLookupError:
        pass
    assert u.exit_code() == 0
    sig = u.events("signal")
    assert sent > 100 and 2 <= len(sig) <= 10, (sent, [e["msg"] for e in sig])
    assert any(e["msg"] == "SIGTERM: stopping" for e in sig)
    assert not u.our_pids()
    assert not u.our_segments()
