"""Deployment integrations end to end: `up` under a real notify socket, its Prometheus endpoint
scraped through a crash and restart, and the docker entrypoint as PID 1 of a new PID namespace."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from .harness import _free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _reader(sock: socket.socket, into: list[str]) -> threading.Thread:
    """Read the notify socket continuously, as systemd does (a unix datagram queue holds few messages)."""

    def run() -> None:
        while True:
            try:
                into.append(sock.recv(65536).decode())
            except OSError:
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_notify_protocol_through_ready_crash_restart_and_stop(up_factory: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    msgs: list[str] = []
    _reader(sock, msgs)
    try:
        u = up_factory(tp=2, faults="worker-segv rank=0 after=100 incarnation=1")
        u.start(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "600000"})
        u.wait_tree(2)
        assert u.proc is not None
        u.proc.send_signal(signal.SIGTERM)
        assert u.exit_code(60) == 0
        time.sleep(0.2)
    finally:
        sock.close()
    assert sum("READY=1" in m for m in msgs) == 1, msgs
    statuses = [line[len("STATUS="):] for m in msgs for line in m.splitlines() if line.startswith("STATUS=")]
    first_ready = next(i for i, s in enumerate(statuses) if s.startswith("ready, incarnation 1"))
    failed = next(i for i, s in enumerate(statuses) if s.startswith("failed, incarnation 1"))
    second_ready = next(i for i, s in enumerate(statuses) if s.startswith("ready, incarnation 2"))
    assert first_ready < failed < second_ready
    assert statuses[second_ready] == "ready, incarnation 2, 1 restart, last: process-crash"
    assert any(m.startswith("READY=1") and "ready, incarnation 1" in m for m in msgs)
    assert "WATCHDOG=1" in msgs
    assert any("EXTEND_TIMEOUT_USEC=" in m for m in msgs)
    # STOPPING=1 (systemd: the service is shutting down) only for the SIGTERM, once, never for the
    # in-place restart of incarnation 1
    stopping = [i for i, m in enumerate(msgs) if "STOPPING=1" in m]
    assert len(stopping) == 1, msgs
    assert "STATUS=stopping, incarnation 2" in msgs[stopping[0]]


def test_notify_stopping_once_when_the_supervisor_gives_up(up_factory: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    msgs: list[str] = []
    _reader(sock, msgs)
    try:
        u = up_factory(engine={"args": {"max-num-seqs": "lots"}})  # a config error: gives up at once
        u.start(env={"NOTIFY_SOCKET": path})
        assert u.exit_code(60) == 4
        time.sleep(0.2)
    finally:
        sock.close()
    # stopping the failed incarnation is not the service's shutdown; giving up is
    stopping = [m for m in msgs if "STOPPING=1" in m]
    assert len(stopping) == 1 and "STATUS=gave-up" in stopping[0], msgs
    assert any(m.startswith("STATUS=stopping") for m in msgs), msgs


def _scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("xpu_serve_"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_metrics_scraped_during_a_crash_and_restart(up_factory: Any) -> None:
    u = up_factory(tp=2, faults="worker-segv rank=1 after=150 incarnation=1")
    mport = _free_port()
    u.cfg["metrics"] = {"enabled": True, "listen": f"127.0.0.1:{mport}"}
    u.write_config()
    u.start()
    u.wait_tree(1)
    first = _scrape(mport)
    assert first['xpu_serve_state{state="ready"}'] == 1.0
    assert first["xpu_serve_restarts_total"] == 0.0
    assert first["xpu_serve_time_to_ready_seconds_count"] == 1.0
    u.wait_tree(2)
    after = _scrape(mport)
    assert after['xpu_serve_state{state="ready"}'] == 1.0
    assert after["xpu_serve_incarnation"] == 2.0
    assert after["xpu_serve_restarts_total"] == 1.0
    assert after['xpu_serve_incidents_total{cause="process-crash"}'] == 1.0
    assert after["xpu_serve_time_to_ready_seconds_count"] == 2.0
    assert after["xpu_serve_last_incident_timestamp_seconds"] > time.time() - 120


def test_docker_entrypoint_as_pid1_stops_everything_on_sigterm(up_factory: Any, tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a new PID namespace")
    u = up_factory(tp=2)
    exe = Path(sys.executable).parent / "xpu-serve"
    env = {
        **os.environ,
        "XPU_SERVE_CONFIG": str(u.config),
        "XPU_SERVE_RUNTIME_DIR": str(u.runtime),
        "XPU_SERVE_BIN": str(exe) if exe.exists() else "xpu-serve",
    }
    out = open(tmp_path / "pid1.out", "w")  # noqa: SIM115
    ns = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", str(ROOT / "docker" / "entrypoint.sh")],
        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        st = u.wait_tree(1, timeout=60)
        # seen from inside its namespace the supervisor is PID 1 (the entrypoint exec'd into it, or tini is)
        sup_host_pid = int(st["supervisor_pid"])
        ns_pids = None
        with open(f"/proc/{ns.pid}/task/{ns.pid}/children") as f:
            children = [int(x) for x in f.read().split()]
        assert len(children) == 1
        pid1 = children[0]
        with open(f"/proc/{pid1}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    ns_pids = [int(x) for x in line.split()[1:]]
        assert ns_pids is not None and ns_pids[-1] == 1
        tree = {p["pid"] for p in st["processes"]}
        assert tree, "the vLLM tree was discovered"
        os.kill(pid1, signal.SIGTERM)
        assert ns.wait(60) == 0
        for pid in tree | {sup_host_pid}:
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie_free(pid)
        stopped = u.events("stopped")
        assert stopped and stopped[-1].get("exit_code", 0) == 0
        assert not u.our_segments() or all(not os.path.exists(s) for s in u.our_segments())
    finally:
        if ns.poll() is None:
            os.killpg(ns.pid, signal.SIGKILL)
            ns.wait(10)
        out.close()


def _is_zombie_free(pid: int) -> bool:
    """False while `pid` still runs; a pid reused by an unrelated process counts as gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"XPU_SERVE_RUN_ID" not in f.read()
    except OSError:
        return True


def test_compose_file_is_valid_yaml_for_docker_compose() -> None:
    data = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert data["services"]["vllm"]["build"]["dockerfile"] == "docker/Dockerfile"
