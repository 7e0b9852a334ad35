"""systemd notify, the unit file, the supervisor's Prometheus endpoint and the incident webhook.

Real sockets throughout: a datagram socket stands in for systemd's notify socket, a real HTTP
server for the webhook receiver, and the metrics endpoint is scraped over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from xpu_serve.events import Event
from xpu_serve.incarnation import Status
from xpu_serve.integrations.metrics import SupervisorMetrics, parse_listen
from xpu_serve.integrations.systemd import SystemdNotifier, notify_socket_address, status_text
from xpu_serve.integrations.webhook import Webhook


def _recv_all(sock: socket.socket, wait_s: float = 0.3) -> list[str]:
    msgs = []
    sock.settimeout(wait_s)
    while True:
        try:
            msgs.append(sock.recv(4096).decode())
        except TimeoutError:
            return msgs


@pytest.fixture
def notify_sock(tmp_path: Path):
    path = tmp_path / "notify.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    yield s, str(path)
    s.close()


def test_notify_socket_address_forms() -> None:
    assert notify_socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_socket_address("@abstract") == b"\0abstract"
    assert notify_socket_address("") is None
    assert notify_socket_address("vsock:2:1234") is None


def test_status_text_names_state_incarnation_restarts_and_last_cause() -> None:
    st = Status(state="ready", incarnation=3, restarts=2, supervisor_pid=1, last_incident={"cause": "umd-segfault"})
    assert status_text(st) == "ready, incarnation 3, 2 restarts, last: umd-segfault"
    assert status_text(Status(state="starting", incarnation=1, restarts=1, supervisor_pid=1)) == (
        "starting, incarnation 1, 1 restart"
    )


def test_notifier_sends_ready_once_status_and_stopping(notify_sock) -> None:
    sock, path = notify_sock
    n = SystemdNotifier(environ={"NOTIFY_SOCKET": path})
    assert n.enabled
    n.on_state(Status(state="starting", incarnation=1, restarts=0, supervisor_pid=1))
    n.on_state(Status(state="ready", incarnation=1, restarts=0, supervisor_pid=1))
    n.on_state(Status(state="failed", incarnation=1, restarts=0, supervisor_pid=1))
    n.on_state(Status(state="stopping", incarnation=1, restarts=0, supervisor_pid=1))  # between restarts
    n.on_state(Status(state="ready", incarnation=2, restarts=1, supervisor_pid=1, last_incident={"cause": "process-crash"}))
    n.on_state(Status(state="stopping", incarnation=2, restarts=1, supervisor_pid=1, shutting_down=True))
    n.on_state(Status(state="stopped", incarnation=2, restarts=1, supervisor_pid=1, shutting_down=True))
    msgs = _recv_all(sock)
    assert msgs[0] == "STATUS=starting, incarnation 1, 0 restarts"
    assert msgs[1] == "READY=1\nSTATUS=ready, incarnation 1, 0 restarts"
    assert msgs[2] == "STATUS=failed, incarnation 1, 0 restarts"
    assert msgs[3] == "STATUS=stopping, incarnation 1, 0 restarts"  # no STOPPING=1: the unit stays active
    assert msgs[4] == "STATUS=ready, incarnation 2, 1 restart, last: process-crash"  # READY only once
    assert msgs[5] == "STOPPING=1\nSTATUS=stopping, incarnation 2, 1 restart"
    assert msgs[6] == "STATUS=stopped, incarnation 2, 1 restart"  # STOPPING=1 only once
    assert sum("READY=1" in m for m in msgs) == 1


def test_notifier_watchdog_and_extend_timeout_from_the_event_loop(notify_sock) -> None:
    sock, path = notify_sock
    import os

    n = SystemdNotifier(
        environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "300000", "WATCHDOG_PID": str(os.getpid())},
        extend_timeout_s=3.0,
    )
    assert n.watchdog_interval_s == pytest.approx(0.1)

    async def drive() -> None:
        n.on_state(Status(state="starting", incarnation=1, restarts=0, supervisor_pid=1))
        await asyncio.sleep(0.55)
        n.on_state(Status(state="stopped", incarnation=1, restarts=0, supervisor_pid=1))
        await asyncio.sleep(0.15)

    asyncio.run(drive())
    msgs = _recv_all(sock)
    assert sum(m == "WATCHDOG=1" for m in msgs) >= 3
    assert "EXTEND_TIMEOUT_USEC=3000000" in msgs


def test_notifier_disabled_without_socket_and_survives_a_vanished_socket(tmp_path: Path) -> None:
    assert not SystemdNotifier(environ={}).enabled
    n = SystemdNotifier(environ={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    n.on_state(Status(state="ready", incarnation=1, restarts=0, supervisor_pid=1))  # must not raise
    assert n.send_errors == 1


def _write_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "svc.yaml"
    cfg.write_text(
        "engine:\n  model: /models/GLM-4.7-Flash\n  served_model_name: glm-4.7-flash\n"
        "  tensor_parallel_size: 4\nsupervision:\n  startup:\n    timeout_s: 1800\n"
        "  restart:\n    max_delay_s: 120\n"
    )
    return cfg


def test_unit_renders_and_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path)
    exe = shutil.which("xpu-serve") or str(Path(sys.executable).parent / "xpu-serve")
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(cfg), "--exec", exe],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    unit = out.stdout
    keys = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line)
    assert keys["Type"] == "notify"
    # relative paths in the config (the default runtime_dir...) resolve where `unit` was run
    assert keys["WorkingDirectory"] == str(tmp_path.resolve())
    assert "Documentation" not in keys
    assert keys["ExecStart"] == f"{exe} up -c {cfg.resolve()}"
    assert keys["KillMode"] == "mixed"
    assert keys["Restart"] == "on-failure"
    # config errors (2, 4) and a lock held by another supervisor (5): restarting cannot fix them
    assert keys["RestartPreventExitStatus"].split() == ["2", "4", "5"]
    assert keys["OOMPolicy"] == "continue"  # a host OOM kill of one worker is the supervisor's incident
    assert "ExecReload" not in keys  # SIGHUP restarts vLLM, it re-reads nothing: no `systemctl reload`
    assert keys["EnvironmentFile"] == "-/etc/xpu-serve/svc.env"
    assert keys["RestartSec"] == "120"
    assert int(keys["TimeoutStartSec"]) >= 1800
    assert int(keys["WatchdogSec"]) > 0
    # only groups that exist here: systemd fails every start on an unknown one (216/GROUP)
    present = [g for g in ("render", "video") if _group_exists(g)]
    assert keys.get("SupplementaryGroups", "").split() == present
    # the start limit can really trip: burst restarts fit inside the interval
    assert int(keys["StartLimitIntervalSec"]) > int(keys["StartLimitBurst"]) * (
        int(keys["RestartSec"]) + int(keys["TimeoutStartSec"])
    )
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    unit_path = tmp_path / "xpu-serve-glm.service"
    unit_path.write_text(unit)
    v = subprocess.run(["systemd-analyze", "verify", str(unit_path)], capture_output=True, text=True, timeout=60)
    # verify exits 0 even on unknown keys; any message on stderr is a defect in the unit
    assert v.returncode == 0 and v.stderr.strip() == "", v.stderr


def _group_exists(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def test_unit_supplementary_groups_only_those_that_exist() -> None:
    from xpu_serve.integrations.unit import host_groups

    known = {"video": object()}
    assert host_groups(("render", "video"), known.__getitem__) == ["video"]
    assert host_groups(("render", "video"), {}.__getitem__) == []


def test_unit_warns_for_each_variable_unset_under_systemd(tmp_path: Path) -> None:
    cfg = tmp_path / "svc.yaml"
    cfg.write_text(
        "engine:\n  command: ['${VENV_PY}', '-m', 'x']\n  model: '${MODEL_DIR}/m'\n"
        "  port: '${PORT:-8000}'\n  api_key: '${API_KEY}'\nruntime_dir: '${XPU_SERVE_PYTHON}.rt'\n"
    )
    env_file = tmp_path / "svc.env"
    env_file.write_text("# comment\nexport API_KEY=secret\n")
    env = {"PATH": "/usr/bin:/bin", "VENV_PY": sys.executable, "MODEL_DIR": "/models", "API_KEY": "k"}
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(cfg), "--env-file", str(env_file),
         "--watchdog-sec", "5", "--exec", "/opt/x/bin/xpu-serve"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stderr
    # PORT has a default, API_KEY is in the env file, XPU_SERVE_PYTHON is xpu-serve's own
    assert out.stderr.splitlines() == [
        f"xpu-serve unit: warning: ${{VENV_PY}} (engine.command.0) has no default and systemd starts the "
        f"service with a clean environment: put VENV_PY=... in {env_file}",
        f"xpu-serve unit: warning: ${{MODEL_DIR}} (engine.model) has no default and systemd starts the "
        f"service with a clean environment: put MODEL_DIR=... in {env_file}",
    ]
    keys = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert keys["EnvironmentFile"] == f"-{env_file}"
    assert keys["WatchdogSec"] == "5"
    bad = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(cfg), "--watchdog-sec", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert bad.returncode == 2 and "--watchdog-sec" in bad.stderr and "Traceback" not in bad.stderr


def test_unit_renders_with_a_secret_only_the_env_file_holds(tmp_path: Path) -> None:
    """The README's `api_key: ${VLLM_API_KEY}` with the key unset where `unit` runs (it lives in
    the env file only): the unit is written (exit 0) with a warning, and the secret appears nowhere
    in it; a variable a typed field needs (a port) still has to parse, so that stays exit 2."""
    cfg = tmp_path / "svc.yaml"
    cfg.write_text("engine:\n  model: /models/m\n  api_key: '${VLLM_API_KEY}'\n")
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(cfg), "--exec", "/opt/x/bin/xpu-serve"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "put VLLM_API_KEY=... in /etc/xpu-serve/svc.env" in out.stderr
    assert "ExecStart=/opt/x/bin/xpu-serve up -c " in out.stdout and "VLLM_API_KEY" not in out.stdout
    cfg.write_text("engine:\n  model: /models/m\n  port: '${PORT}'\n")
    bad = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(cfg)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert bad.returncode == 2 and "environment variable PORT is not set" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_unit_values_cannot_inject_settings_or_specifiers(tmp_path: Path) -> None:
    """A newline in the model name, `%` and `$` in the config path: one Description= line with
    `%%`, an ExecStart= systemd reads back as the same path (`%%`, `$$`), no extra setting;
    systemd-analyze verify stays silent. A newline where a unit has no escape: exit 2."""
    d = tmp_path / "cfg %h $HOME ${HOME} 'q\" x"
    d.mkdir()
    cfg = d / "svc.yaml"
    cfg.write_text(
        'engine:\n  model: "/m/M\\n[Service]\\nExecStartPre=/bin/touch /tmp/pwned"\n'
        '  served_model_name: "a%hb\\nExecStartPre=/bin/false"\n  tensor_parallel_size: 2\n'
    )
    exe = str(Path(sys.executable).parent / "xpu-serve")
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(cfg), "--exec", exe, "--env-file", str(tmp_path / "e.env")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    keys = [line.split("=", 1)[0] for line in out.stdout.splitlines() if "=" in line]
    assert "ExecStartPre" not in keys and keys.count("Description") == 1
    lines = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert lines["Description"] == "xpu-serve: vLLM a%%hb ExecStartPre=/bin/false (tensor parallel 2)"
    assert lines["ExecStart"] == f'{exe} up -c "{tmp_path}/cfg %%h $$HOME $${{HOME}} \'q\\" x/svc.yaml"'
    if shutil.which("systemd-analyze"):
        unit_path = tmp_path / "xpu-serve-x.service"
        unit_path.write_text(out.stdout)
        v = subprocess.run(["systemd-analyze", "verify", str(unit_path)], capture_output=True, text=True, timeout=60)
        assert v.returncode == 0 and v.stderr.strip() == "", v.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(cfg), "--user", "svc\nExecStartPre=/bin/false"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("xpu-serve unit: User=: ") and bad.stderr.count("\n") == 1, bad.stderr


def test_unit_bad_config_gives_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(tmp_path / "missing.yaml")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "missing.yaml" in out.stderr and "Traceback" not in out.stderr


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError):
        parse_listen("nonsense")


def test_metrics_endpoint_over_http_through_a_crash_and_restart() -> None:
    clock = [1000.0]
    m = SupervisorMetrics(clock=lambda: clock[0])
    port = m.start("127.0.0.1:0")
    m.on_state(Status(state="starting", incarnation=1, restarts=0, supervisor_pid=1))
    clock[0] += 12.0
    m.on_state(Status(state="ready", incarnation=1, restarts=0, supervisor_pid=1))
    clock[0] += 30.0
    m.on_event(Event(source="kernel", text="Engine reset", signature="xe-engine-reset", extra={"device": "0000:47:00.0"}))
    m.on_event(Event(source="vllm", text="ignored", signature="x"))
    m.on_incident({"cause": "umd-segfault"}, "/tmp/b")
    m.on_state(Status(state="failed", incarnation=1, restarts=0, supervisor_pid=1))
    m.on_state(Status(state="starting", incarnation=2, restarts=1, supervisor_pid=1))
    clock[0] += 5.0
    m.on_state(Status(state="ready", incarnation=2, restarts=1, supervisor_pid=1))
    clock[0] += 7.0
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples = {}
    for line in text.splitlines():
        if line.startswith("xpu_serve_"):
            k, v = line.rsplit(" ", 1)
            samples[k] = float(v)
    assert samples['xpu_serve_state{state="ready"}'] == 1.0
    assert samples['xpu_serve_state{state="failed"}'] == 0.0
    assert samples["xpu_serve_incarnation"] == 2.0
    assert samples["xpu_serve_restarts_total"] == 1.0
    assert samples['xpu_serve_incidents_total{cause="umd-segfault"}'] == 1.0
    assert samples["xpu_serve_last_incident_timestamp_seconds"] == 1042.0
    assert samples["xpu_serve_ready_timestamp_seconds"] == 1047.0  # when incarnation 2 became ready
    assert "xpu_serve_uptime_seconds" not in samples
    assert samples["xpu_serve_time_to_ready_seconds_count"] == 2.0
    assert samples["xpu_serve_time_to_ready_seconds_sum"] == 17.0
    assert samples['xpu_serve_kernel_events_total{device="0000:47:00.0",kind="xe-engine-reset"}'] == 1.0


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server API)
        n = int(self.headers.get("Content-Length", "0"))
        _Receiver.bodies.append(json.loads(self.rfile.read(n)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_webhook_posts_json_with_slack_text() -> None:
    _Receiver.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        w = Webhook(f"http://127.0.0.1:{srv.server_address[1]}/hook", timeout_s=5)
        w.on_incident({"cause": "process-crash", "summary": "Worker_TP0 died by SIGSEGV"}, "/rt/bundles/x")
        w.join(10)
        assert w.sent == 1 and w.failed == 0
        body = _Receiver.bodies[0]
        assert body["incident"]["cause"] == "process-crash"
        assert body["bundle"] == "/rt/bundles/x"
        assert "process-crash" in body["text"] and "Worker_TP0 died by SIGSEGV" in body["text"]
    finally:
        srv.shutdown()


def test_dead_webhook_never_delays_the_caller() -> None:
    # a listener that accepts connections but never answers: the POST can only time out
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    try:
        w = Webhook(f"http://127.0.0.1:{lsock.getsockname()[1]}/hook", timeout_s=0.5)
        t0 = time.monotonic()
        w.on_incident({"cause": "engine-hang"}, None)
        assert time.monotonic() - t0 < 0.2
        w.join(10)
        assert w.failed == 1 and w.sent == 0
        assert "Timeout" in (w.last_error or "")
    finally:
        lsock.close()
