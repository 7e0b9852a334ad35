"""A reader of the supervisor's stdout/stderr that stops reading (a wedged journald, `| sleep`)
does not freeze supervision: lines it cannot take are dropped and counted, events.jsonl stays
complete, and once the reader catches up a summary line says how many were dropped."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from .harness import _free_port


def _status(runtime: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "status", "--runtime-dir", str(runtime), "--json"],
        capture_output=True, text=True, timeout=30,
    )
    try:
        return dict(json.loads(out.stdout))
    except ValueError:
        return {}


def _wait_ready(runtime: Path, incarnation: int, proc: subprocess.Popen[bytes], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = _status(runtime)
        names = {p.get("name") for p in st.get("processes") or []}
        if st.get("state") == "ready" and st.get("incarnation") == incarnation and "Worker_TP1" in names:
            return time.monotonic() - t0
        assert proc.poll() is None, f"up exited {proc.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"incarnation {incarnation} not ready within {timeout} s: {_status(runtime).get('state')}")


def _fill(write_fd: int) -> int:
    """Fill the pipe through a new, non-blocking open of it (its own file description: the
    supervisor's stays blocking); returns the bytes written."""
    fd = os.open(f"/proc/self/fd/{write_fd}", os.O_WRONLY | os.O_NONBLOCK)
    n = 0
    try:
        while True:
            try:
                n += os.write(fd, b"x" * 4095 + b"\n")
            except BlockingIOError:
                return n
    finally:
        os.close(fd)


def test_supervision_goes_on_while_nobody_reads_its_output(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    cfg = {
        "engine": {
            # 2 MB of output at each start (echoed: more than the supervisor holds for stdout),
            # then the simulator in its place (same pid)
            "command": [
                "sh", "-c", "head -c 2000000 /dev/zero | tr '\\0' x | fold -w 99; exec \"$0\" \"$@\"",
                sys.executable, "-m", "xpu_serve.sim", "serve",
            ],
            "model": "tiny",
            "tensor_parallel_size": 4,
            "port": _free_port(),
        },
        "environment": {"vars": {"XPU_SERVE_SIM_TIME_SCALE": "0.01"}},
        "supervision": {"restart": {"initial_delay_s": 0.2, "max_failures": 3}},
        "metrics": {"enabled": False},
        "runtime_dir": str(runtime),
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "xpu_serve", "up", "-c", str(config)],
        stdout=w, stderr=w, start_new_session=True,
    )
    kids: list[psutil.Process] = []
    drained = bytearray()
    reader: threading.Thread | None = None
    try:
        _wait_ready(runtime, 1, proc, 60)
        kids = psutil.Process(proc.pid).children(recursive=True)
        _fill(w)  # (full already, unless the supervisor's writer blocks nowhere)
        assert _fill(w) == 0
        st = _status(runtime)
        worker = next(p["pid"] for p in st["processes"] if p["name"] == "Worker_TP1")
        os.kill(worker, signal.SIGKILL)
        took = _wait_ready(runtime, 2, proc, 60)
        kids = psutil.Process(proc.pid).children(recursive=True)
        # the supervisor's stdout/stderr file description was left blocking (shared with its caller)
        assert fcntl.fcntl(w, fcntl.F_GETFL) & os.O_NONBLOCK == 0
        os.close(w)
        w = -1

        def drain() -> None:
            while chunk := os.read(r, 1 << 16):
                drained.extend(chunk)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while b"lines dropped (" not in drained and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for k in kids:
            try:
                k.kill()
            except psutil.Error:
                pass
        if w >= 0:
            os.close(w)
        if reader is None or not reader.is_alive():
            os.close(r)
    text = drained.decode("utf-8", "replace")
    assert took < 60
    summary = [ln for ln in text.splitlines() if "lines dropped (" in ln and "not read)" in ln]
    assert summary, text[-3000:]
    events = [json.loads(ln) for ln in (runtime / "events.jsonl").read_text().splitlines() if ln.strip()]
    names = [e["event"] for e in events]
    assert names.count("launched") == 2 and names.count("ready") == 2 and "incident" in names, names
    assert names[-1] == "stopped", names[-5:]
    drops = [e for e in events if e["event"] == "output-dropped"]
    assert drops and all(e["dropped"] > 0 for e in drops), drops
    # every event line that reached the pipe is in events.jsonl, and some only there
    shown = [ln for ln in text.splitlines() if " xpu-serve: " in ln and not ln.startswith("[i")]
    # (an event's text may span lines, e.g. the one-screen report: its first line is the event's line)
    msgs = {f"{e['event']}: {e['msg']}".split("\n", 1)[0] for e in events}
    for ln in shown:
        assert ln.split(" xpu-serve: ", 1)[1] in msgs, ln
    assert len(shown) < len(events), (len(shown), len(events))
