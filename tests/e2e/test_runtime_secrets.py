"""The API key never reaches the runtime directory or the supervisor's own output in clear text,
and everything the supervisor writes there is private to its user (directories 0700, files 0600).

One `up` (simulator, TP=4) with `engine.api_key: ${XPU_TEST_KEY}` goes through what writes files:
a served request with the key, an operator's snapshot (`xpu-serve bundle`), a worker killed
(incident bundle, restart), a hang verdict (the hang watchdog, incident bundle, restart). Then
every file under the runtime directory and the captured stdout/stderr of `up` are searched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import string
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .harness import SimUp


def _state(up: SimUp) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "status", "--runtime-dir", str(up.runtime), "--json"],
        capture_output=True, text=True, timeout=30,
    )
    try:
        return dict(json.loads(out.stdout))
    except ValueError:
        return {}


def _wait_ready(up: SimUp, incarnation: int, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = _state(up)
        names = {p.get("name") for p in st.get("processes") or []}
        if st.get("state") == "ready" and st.get("incarnation") == incarnation and "Worker_TP1" in names:
            return st
        assert up.proc.poll() is None, (up.tmp / "up.out").read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"incarnation {incarnation} not ready in {timeout} s: {st.get('state')}")


def _complete(up: SimUp, key: str, timeout: float = 10) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{up.port}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


def test_api_key_is_nowhere_in_the_runtime_dir_and_output(sim_up_factory: Any) -> None:
    key = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32))
    up = sim_up_factory(
        "worker-hang rank=0 after=0 incarnation=2",
        extra={
            "engine.api_key": "${XPU_TEST_KEY}",
            "supervision.hang": {"after_s": 2, "metrics_interval_s": 0.2},
        },
        env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3000"},  # the watchdog decides, not vLLM's own timeout
        os_env={"XPU_TEST_KEY": key},
    )
    st = _wait_ready(up, 1)
    r = _complete(up, key)
    assert r.status_code == 200, r.text  # the engine really runs with the key
    assert _complete(up, "wrong-key-0123456789").status_code == 401
    snap = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "bundle", "--runtime-dir", str(up.runtime), "--note", "snapshot"],
        capture_output=True, text=True, timeout=120,
    )
    assert snap.returncode == 0, snap.stderr
    # a worker crash: incident, bundle, restart
    worker = next(p["pid"] for p in st["processes"] if p["name"] == "Worker_TP1")
    os.kill(worker, signal.SIGKILL)
    _wait_ready(up, 2, timeout=90)
    # a hang: rank 0 stops answering once a request is in flight; the watchdog gives the verdict
    threading.Thread(target=lambda: _swallow(lambda: _complete(up, key, timeout=60)), daemon=True).start()
    up.wait_event("incident", 60, after=1)
    _wait_ready(up, 3, timeout=90)
    assert up.stop() == 0
    causes = [e.get("cause") for e in up.events() if e.get("event") == "incident"]
    assert causes[:2] == ["process-crash", "engine-hang"], causes
    bundles = [p for p in (up.runtime / "bundles").iterdir() if p.is_dir()]
    assert len(bundles) >= 3, bundles  # snapshot + two incidents

    needle = key.encode()
    hits: list[str] = []
    modes: list[str] = []
    nfiles = 0
    for dirpath, dirnames, filenames in os.walk(up.runtime):
        for d in dirnames:
            m = stat.S_IMODE(os.lstat(os.path.join(dirpath, d)).st_mode)
            if m != 0o700:
                modes.append(f"{os.path.join(dirpath, d)}: {m:o}")
        for f in filenames:
            p = os.path.join(dirpath, f)
            st_ = os.lstat(p)
            if stat.S_ISLNK(st_.st_mode):
                continue
            nfiles += 1
            if stat.S_IMODE(st_.st_mode) != 0o600:
                modes.append(f"{p}: {stat.S_IMODE(st_.st_mode):o}")
            if needle in Path(p).read_bytes():
                hits.append(p)
    root_mode = stat.S_IMODE(os.stat(up.runtime).st_mode)
    out = (up.tmp / "up.out").read_bytes()
    assert nfiles > 30, nfiles
    assert b"launched: " in out and b"--api-key" not in out, "the key goes in the engine's environment, not its argv"
    assert needle not in out, "the key is in the output of up"
    assert not hits, hits
    assert root_mode == 0o700, f"{root_mode:o}"
    assert not modes, modes
    # the key reached the engine through its environment: vLLM's own args line has no api_key
    # (the relay's line-by-line masking of known values is tested in test_log_pump)
    vlog = (up.runtime / "logs" / "1" / "vllm.log").read_text()
    args = [ln for ln in vlog.splitlines() if "non-default args" in ln]
    assert args and all("api_key" not in ln for ln in args), args


def _swallow(fn: Any) -> None:
    try:
        fn()
    except httpx.HTTPError:
        pass


def test_status_of_another_users_private_runtime_dir_says_so(tmp_path: Path) -> None:
    """As a user that is neither the supervisor's nor root (here: root without the capabilities
    that bypass file modes, on a state.json owned by nobody), one line, exit 2."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    (rt / "state.json").write_text("{}")
    os.chown(rt / "state.json", 65534, 65534)
    os.chmod(rt / "state.json", 0o600)
    caps = "-dac_override,-dac_read_search"
    out = subprocess.run(
        ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}",
         sys.executable, "-m", "xpu_serve", "status", "--runtime-dir", str(rt)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out
    assert out.stderr == f"{rt}/state.json: permission denied: run status as the supervisor's user or root\n"
