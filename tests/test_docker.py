"""docker/: lint the Dockerfile and the shell scripts, and run the entrypoint as PID 1.

No docker engine runs on these machines, so the image itself cannot be built here; the
entrypoint script is tested for real as PID 1 of a new PID namespace (`unshare --pid --fork`),
and the HEALTHCHECK's command runs as docker would run it, against a live supervisor.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import up_factory  # noqa: F401  (a pytest fixture, found by name)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (it is in the dev extra: pip install -e '.[dev]')")
    return found


def test_dockerfile_passes_hadolint() -> None:
    r = subprocess.run([_tool("hadolint"), str(ROOT / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_shell_scripts_pass_shellcheck() -> None:
    scripts = [ROOT / "docker" / "entrypoint.sh", ROOT / ".ci" / "run", *sorted((ROOT / "scripts").glob("*.sh"))]
    r = subprocess.run([_tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_defaults_to_the_seed_image_and_runs_the_entrypoint() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=intel/llm-scaler-vllm" in text
    assert "ARG BASE_TAG=0.14.0-b8" in text
    assert 'ENTRYPOINT ["/usr/local/bin/xpu-serve-entrypoint"]' in text


def test_compose_has_devices_capabilities_shm_and_runtime_volume() -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    svc = compose["services"]["vllm"]
    assert "/dev/dri:/dev/dri" in svc["devices"]
    assert "/dev/kmsg:/dev/kmsg" in svc["devices"]
    assert set(svc["cap_add"]) == {"SYS_PTRACE", "SYSLOG"}
    assert svc["shm_size"]
    assert any("render" in str(g) for g in svc["group_add"])
    assert any(v.endswith(":/var/lib/xpu-serve") for v in svc["volumes"])


def test_entrypoint_argument_forms(tmp_path: Path) -> None:
    # a stand-in `xpu-serve` that prints its argv shows what the entrypoint execs
    fake = tmp_path / "xpu-serve"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "XPU_SERVE_BIN": str(fake), "XPU_SERVE_CONFIG": "/c.yaml", "XPU_SERVE_RUNTIME_DIR": "/rt"}
    ep = str(ROOT / "docker" / "entrypoint.sh")
    out = subprocess.run([ep], env=env, capture_output=True, text=True, timeout=30).stdout.split()
    assert out == ["up", "-c", "/c.yaml", "--runtime-dir", "/rt"]
    out = subprocess.run([ep, "--log-format", "json"], env=env, capture_output=True, text=True, timeout=30).stdout.split()
    assert out == ["up", "-c", "/c.yaml", "--runtime-dir", "/rt", "--log-format", "json"]
    out = subprocess.run([ep, "diagnose", "x.log"], env=env, capture_output=True, text=True, timeout=30).stdout.split()
    assert out == ["diagnose", "x.log"]


def _healthcheck() -> tuple[dict[str, str], list[str]]:
    """The Dockerfile's HEALTHCHECK: ({option: value}, the exec-form command)."""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    m = re.search(r"^HEALTHCHECK((?: --[a-z-]+=\S+)*) +CMD +(\[.*\])$", text, re.M)
    assert m, "the Dockerfile has no exec-form HEALTHCHECK"
    options = dict(o.lstrip("-").split("=", 1) for o in m.group(1).split())
    return options, json.loads(m.group(2))


def _run_healthcheck(runtime: Path) -> tuple[int, str]:
    """Run the HEALTHCHECK command as docker does (exec, the image's environment): exit code, output."""
    _, argv = _healthcheck()
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "XPU_SERVE_RUNTIME_DIR": str(runtime)}
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    return r.returncode, (r.stdout + r.stderr).strip()


def test_healthcheck_options_cover_a_model_load() -> None:
    options, argv = _healthcheck()
    assert options == {"interval": "30s", "timeout": "10s", "start-period": "10m", "retries": "3"}
    assert argv[:2] == ["/bin/sh", "-c"] and "xpu-serve status --check" in argv[2]


def test_healthcheck_with_no_supervisor_is_unhealthy_never_docker_reserved_2(tmp_path: Path) -> None:
    r = subprocess.run([str(BIN / "xpu-serve"), "status", "--check", "--runtime-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2  # status --check: no supervisor
    assert _run_healthcheck(tmp_path) == (1, f"no supervisor: none holds the lock of {tmp_path}")


@pytest.mark.e2e
def test_healthcheck_follows_a_live_supervisor(up_factory) -> None:  # noqa: F811
    # start-up ~6 s longer (x0.01) so the check sees the supervisor starting
    u = up_factory(tp=2, faults="slow-start seconds=600 incarnation=1")
    u.start()
    code, out = _run_healthcheck(u.runtime)
    assert u.state()["state"] == "starting" and code == 1 and out.startswith("not ready: starting"), out
    u.wait_tree(1, timeout=60)
    assert _run_healthcheck(u.runtime) == (0, "ready")
    assert u.proc is not None
    u.proc.send_signal(signal.SIGTERM)
    assert u.exit_code(60) == 0
    assert _run_healthcheck(u.runtime) == (1, f"no supervisor: none holds the lock of {u.runtime} (last state stopped)")
