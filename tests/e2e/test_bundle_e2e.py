"""Bundles end to end: `xpu-serve up` with the simulator, one scripted fault per run (time-scaled).

Each fault kind yields a bundle with the expected files and a verdict matching the fault; a
secret planted in the config, the environment, the argv and the log appears nowhere in it; a
read-only bundle folder does not stop the restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from .harness import SimUp

pytestmark = pytest.mark.e2e

try:
    import xpu_serve.sim  # noqa: F401
    import xpu_serve.supervisor  # noqa: F401
except ImportError:  # pragma: no cover - before the simulator and supervisor land
    pytest.skip("needs xpu_serve.sim and xpu_serve.supervisor", allow_module_level=True)


@pytest.fixture
def up_factory(sim_up_factory: Any) -> Any:
    """`SimUp` runs with tar bundles (collector timeout 5 s); `env_vars` go to `environment.vars`."""

    def make(faults: str, extra: dict[str, Any] | None = None, env_vars: dict[str, str] | None = None,
             os_env: dict[str, str] | None = None) -> SimUp:
        extra = {"bundles.collector_timeout_s": 5, "bundles.tar": True, **(extra or {})}
        return sim_up_factory(faults, extra=extra, env=env_vars, os_env=os_env)  # type: ignore[no-any-return]

    return make


def _incident_bundle(up: SimUp, timeout: float = 60) -> Path:
    ev = up.wait_event("incident", timeout)
    path = ev.get("bundle")
    assert path, ev
    return Path(path)


BASE_FILES = {"summary.md", "incident.json", "bundle.json", "kernel.log", "env.txt", "config.yaml", "versions.txt",
              "host.txt", "logs/vllm.log"}

# fault spec (KERN = a kernel-log file the watcher reads), extra config, expected cause, extra files
# Verdicts the live analysis does not reach reliably yet (issue 5/4, reported to the lead): the
# EngineCore's "RuntimeError: Executor failed." or the API server's exception, which follow the
# worker's death, are sometimes taken as the root instead of the death itself. The bundle part of
# these runs is asserted before the verdict, so only the verdict is expected to fail.
FAULTS = [
    ("worker-segv rank=1 after=50 incarnation=1", {}, "process-crash", set()),
    ("worker-segv rank=2 after=50 kernel=KERN incarnation=1", {}, "umd-segfault", set()),
    ("worker-exit rank=3 code=3 after=50 incarnation=1", {}, "process-crash", set()),
    ("engine-crash after=50 incarnation=1", {}, "process-crash", set()),
    ("api-crash after=50 incarnation=1", {}, "process-crash", set()),
    ("worker-hang rank=1 after=50 incarnation=1",
     {"supervision.hang": {"after_s": 30, "metrics_interval_s": 0.2, "canary": True, "canary_interval_s": 1.0,
                           "canary_timeout_s": 1.5}},
     "engine-hang", {"stacks"}),
    ("startup-hang phase=ccl-init rank=1 incarnation=1", {"supervision.startup": {"stall_s": 1.5}},
     "startup-hang", {"stacks"}),
    ("device-oom rank=0 incarnation=1", {}, "device-oom", set()),
    ("host-oom rank=1 after=50 kernel=KERN incarnation=1", {}, "host-oom", set()),
]


@pytest.mark.parametrize(("faults", "extra", "cause", "more"), FAULTS,
                         ids=[str((f.values if hasattr(f, "values") else f)[0]).split(" incarnation")[0] for f in FAULTS])
def test_each_fault_yields_a_matching_bundle(tmp_path: Path, up_factory: Any, faults: str, extra: dict[str, Any],
                                             cause: str, more: set[str]) -> None:
    # Every case reads its kernel log from its own file: records other tests wrote to the real
    # /dev/kmsg (opt-in kmsg tests) must not leak into these verdicts.
    kern = tmp_path / "kernel.txt"
    kern.write_text("")
    faults = faults.replace("KERN", str(kern))
    extra = {**extra, "watchers.kernel": {"source": "file", "path": str(kern)}}
    env = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3000"} if "hang" in faults else {}
    up = up_factory(faults, extra=extra, env_vars=env)
    bundle = _incident_bundle(up)
    files = {str(p.relative_to(bundle)) for p in bundle.rglob("*")}
    assert BASE_FILES <= files, sorted(BASE_FILES - files)
    assert more <= files
    assert any(f.startswith("logs/") and f != "logs/vllm.log" for f in files), files  # per-process logs
    incident = json.loads((bundle / "incident.json").read_text())
    sup = incident["supervisor"]
    assert sup["incarnation"] == 1 and sup["trigger"]["kind"] and sup["config_hash"].startswith("sha256:")
    assert sup["processes"], "the process tree was known"
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["complete"] is True, manifest["errors"]
    assert (bundle.parent / f"{bundle.name}.tar.gz").is_file()
    if "stacks" in more:  # taken before the kill: the live processes were dumped
        dumps = [p.read_text() for p in (bundle / "stacks").iterdir()]
        assert any("Thread" in d for d in dumps), dumps[:1]
    if "kernel=" in faults:  # the kernel records the watcher read are in the bundle
        assert "VLLM::Worker_TP" in (bundle / "kernel.log").read_text()
    assert up.stop() == 0
    # last, the verdict: the folder name and incident.json agree with the fault
    assert incident["cause"] == cause, incident.get("summary")
    assert bundle.name.endswith(f"-i1-{cause}"), bundle.name


def test_secrets_from_config_env_argv_and_log_appear_nowhere(tmp_path: Path, up_factory: Any) -> None:
    api_key = "sk-E2E-API-8c1f4d2b"  # config (via ${VAR}) -> the engine's VLLM_API_KEY
    hf_token = "hf_E2E_TOKEN_51a9e0"  # config environment.vars -> the engine's environment
    os_secret = "pw-E2E-SUPERVISOR-7d7d"  # the supervisor's own environment (inherited)
    up = up_factory("worker-exit rank=0 code=1 after=50 incarnation=1",
                    extra={"engine.api_key": "${E2E_API_KEY}"},
                    env_vars={"HF_TOKEN": hf_token},
                    os_env={"E2E_API_KEY": api_key, "DB_PASSWORD": os_secret})
    bundle = _incident_bundle(up)
    # the engine's environment really carried it (so the test tests something), never its argv
    env_txt = (bundle / "env.txt").read_text()
    assert "VLLM_API_KEY=***" in env_txt and "--api-key" not in env_txt, env_txt[-2000:]
    assert "HF_TOKEN=***" in env_txt
    blobs: list[tuple[str, bytes]] = [(str(p), p.read_bytes()) for p in bundle.rglob("*") if p.is_file()]
    tar = bundle.parent / f"{bundle.name}.tar.gz"
    with tarfile.open(tar) as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m) if m.isfile() else None
            if f is not None:
                blobs.append((f"{tar}:{m.name}", f.read()))
    assert len(blobs) > 20
    for name, data in blobs:
        for secret in (api_key, hf_token, os_secret):
            assert secret.encode() not in data, f"{secret} in {name}"
    assert up.stop() == 0


def _mount(path: Path, opts: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0


def test_read_only_bundle_dir_does_not_stop_the_restart(tmp_path: Path, up_factory: Any) -> None:
    bundles = tmp_path / "rt" / "bundles"
    if not _mount(bundles, "ro,size=1m"):
        bundles.rmdir()
        bundles.write_text("a file where the bundles folder should be")
    try:
        up = up_factory("worker-segv rank=1 after=50 incarnation=1")
        incident = up.wait_event("incident", 60)
        assert not incident.get("bundle")
        up.wait_event("ready", 60, after=1)  # incarnation 2 is up all the same
        assert up.stop() == 0
    finally:
        subprocess.run(["umount", str(bundles)], capture_output=True)


def test_operator_snapshot_from_the_running_supervisor(tmp_path: Path, up_factory: Any) -> None:
    """`xpu-serve bundle` while `up` serves: the supervisor answers, nothing is stopped."""
    kern = tmp_path / "kernel.txt"
    kern.write_text("")
    up = up_factory("", extra={"watchers.kernel": {"source": "file", "path": str(kern)}})
    up.wait_event("ready", 60)
    r = subprocess.run([sys.executable, "-m", "xpu_serve", "bundle", "--runtime-dir", str(up.runtime), "--json",
                        "--note", "e2e look"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    ans = json.loads(r.stdout)
    assert ans["taken_by"] == f"supervisor pid {up.proc.pid}" and ans["complete"] is True, ans
    bundle = Path(ans["path"])
    assert bundle.name.endswith("-i1-snapshot")
    names = sorted(p.name for p in (bundle / "stacks").iterdir())
    assert len(names) >= 6 and any("Worker_TP3" in n for n in names), names  # API server, EngineCore, 4 workers
    assert any("Thread" in (bundle / "stacks" / n).read_text() for n in names)
    incident = json.loads((bundle / "incident.json").read_text())
    assert incident["supervisor"]["trigger"]["kind"] == "operator" and "e2e look" in incident["notes"]
    time.sleep(0.5)
    assert not [e for e in up.events() if e.get("event") == "failed"]  # a snapshot is not a failure
    assert up.stop() == 0


def test_operator_snapshot_during_backoff_is_written_at_once(tmp_path: Path, up_factory: Any) -> None:
    """`xpu-serve bundle` while the supervisor waits in backoff: no incarnation runs, so nobody would
    answer the request (before: a silent wait, then "did not answer"). The command says so and
    writes the snapshot itself at once; the supervisor is not disturbed (still in backoff)."""
    up = up_factory("worker-segv rank=1 after=5 incarnation=1",
                    extra={"supervision.restart.initial_delay_s": 60, "supervision.restart.max_delay_s": 60})
    up.wait_event("restart-scheduled", 60)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "xpu_serve", "bundle", "--runtime-dir", str(up.runtime), "--json"],
                       capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert f"supervisor (pid {up.proc.pid}) is in backoff: no server running; writing the bundle here" in r.stderr
    assert "did not answer" not in r.stderr
    ans = json.loads(r.stdout)
    assert ans["taken_by"] == "xpu-serve bundle (standalone)", ans
    assert Path(ans["path"]).name.endswith("-snapshot") and (Path(ans["path"]) / "bundle.json").is_file()
    assert took < 30, took  # no request wait (ack 3 s + the full answer timeout) before writing
    state = json.loads((up.runtime / "state.json").read_text())
    assert state["state"] == "backoff" and up.proc.poll() is None
    reqs = up.runtime / "requests"
    assert not (reqs.is_dir() and list(reqs.glob("bundle-*.json")))  # no request left for incarnation 2
