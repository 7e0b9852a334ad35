"""deploy/kubernetes/lws: the LeaderWorkerSet of a two-host group, rendered by the real
kustomize. LWS is a CRD and no schema package of it is installed (the Kubernetes OpenAPI
schemas of kubernetes-validate know only core kinds), so its own fields are checked explicitly
here (apiVersion, kind, size, restartPolicy, templates) and each pod template is validated as a
Pod against the Kubernetes schema (strict: unknown fields fail). The config is loaded by the
real loader with the environment LWS gives each pod, and rendered: the leader is the head, every
worker a `--headless` follower that reaches the leader's address."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests import test_kubernetes_manifests as base
from xpu_serve.config import Config, ConfigError
from xpu_serve.vllm_command import render

LWS = base.ROOT / "deploy" / "kubernetes" / "lws"
LEADER_ADDRESS = "xpu-serve-group-0.xpu-serve-group.xpu-serve"  # the DNS name LWS gives the leader


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return base.render(LWS)


def _lws(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return base.one(objs, "LeaderWorkerSet")


def _templates(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    t = _lws(objs)["spec"]["leaderWorkerTemplate"]
    return {"head": t["leaderTemplate"], "follower": t["workerTemplate"]}


def pod_env(template: dict[str, Any], index: int, size: int) -> dict[str, str]:
    """What the container sees: its literal env values plus what LWS injects (LWS_* variables);
    secrets as stand-ins."""
    c = template["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    env.update({e["name"]: "stand-in-secret-0123456789abcdef" for e in c.get("env", []) if "valueFrom" in e})
    env.update({"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index), "LWS_LEADER_ADDRESS": LEADER_ADDRESS})
    return env


def lws_problems(objs: list[dict[str, Any]], tmp: Path) -> list[str]:
    """Every way the LWS object is malformed or disagrees with the config; [] when none."""
    out: list[str] = []
    lws = _lws(objs)
    if lws.get("apiVersion") != "leaderworkerset.x-k8s.io/v1":
        out.append(f"apiVersion {lws.get('apiVersion')!r}")
    spec = lws.get("spec", {})
    t = spec.get("leaderWorkerTemplate", {})
    size = t.get("size")
    if not isinstance(size, int) or size < 2:
        return [*out, f"leaderWorkerTemplate.size must be an integer >= 2, got {size!r}"]
    if t.get("restartPolicy") != "RecreateGroupOnPodRestart":
        out.append(f"restartPolicy {t.get('restartPolicy')!r}: a group restarts whole")
    if not isinstance(spec.get("replicas", 1), int):
        out.append("replicas must be an integer")
    for role, template in (("head", t.get("leaderTemplate")), ("follower", t.get("workerTemplate"))):
        if not isinstance(template, dict) or "spec" not in template:
            out.append(f"{role}: no pod template")
            continue
        out += [f"{role}: {p}" for p in _pod_problems(objs, template, role, size, tmp)]
    return out


def _pod_problems(objs: list[dict[str, Any]], template: dict[str, Any], role: str, size: int, tmp: Path) -> list[str]:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": template["spec"]}
    try:
        kubernetes_validate.validate(pod, base.K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"pod template fails the Kubernetes schema: {e.message}"]
    out: list[str] = []
    c = template["spec"]["containers"][0]
    env = pod_env(template, 0 if role == "head" else size - 1, size)
    if env.get("XPU_SERVE_GROUP_ROLE") != role:
        out.append(f"XPU_SERVE_GROUP_ROLE is {env.get('XPU_SERVE_GROUP_ROLE')!r}")
    if any(e["name"] == "XPU_SERVE_GROUP_SECRET" and "value" in e for e in c.get("env", [])):
        out.append("the group secret is a literal value, not a secretKeyRef")
    try:
        cfg = base.config_of(objs, tmp, env)
    except ConfigError as e:  # the config as this pod would load it: the supervisor exits 2
        return [*out, *e.problems]
    g = cfg.group
    assert g is not None
    ports = {p["containerPort"] for p in c.get("ports", [])}
    gpus = c["resources"]["limits"].get(base.GPU_RESOURCE)
    if gpus != cfg.engine.tensor_parallel_size // g.nnodes:
        out.append(f"{gpus} GPUs for {cfg.engine.tensor_parallel_size // g.nnodes} TP ranks per pod")
    if role == "head" and not {cfg.engine.port, g.master_port, g.channel_port} <= ports:
        out.append(f"ports {sorted(ports)} miss the API, master or group channel port")
    argv = render(cfg).argv
    if ("--headless" in argv) != (role == "follower") or argv[argv.index("--master-addr") + 1] != LEADER_ADDRESS:
        out.append(f"renders {argv}")
    vols = {v["name"]: v for v in template["spec"].get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    runtime = vols.get(mounts.get(cfg.runtime_dir, ""), {})
    if "hostPath" not in runtime:
        out.append(f"runtime_dir {cfg.runtime_dir} is not on the node: bundles die with the group's pods")
    return out


def test_kustomize_renders_the_group(objects: list[dict[str, Any]]) -> None:
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "LeaderWorkerSet", "Service"]
    for o in objects:
        assert o["metadata"]["namespace"] == "xpu-serve"
    for kind in ("ConfigMap", "Service"):
        kubernetes_validate.validate(base.one(objects, kind), base.K8S_VERSION, strict=True)
    svc = base.one(objects, "Service")
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"  # the head's API


def test_lws_and_config_agree(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    assert lws_problems(objects, tmp_path) == []


def test_every_pod_renders_its_rank(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    size = _lws(objects)["spec"]["leaderWorkerTemplate"]["size"]
    templates = _templates(objects)
    for index in range(size):
        t = templates["head" if index == 0 else "follower"]
        cfg: Config = base.config_of(objects, tmp_path, pod_env(t, index, size))
        argv = render(cfg).argv
        assert argv[argv.index("--node-rank") + 1] == str(index)
        assert argv[argv.index("--nnodes") + 1] == str(size)
        assert ("--headless" in argv) == (index > 0)
        assert "stand-in-secret-0123456789abcdef" not in " ".join(argv)


def _break(objs: list[dict[str, Any]], name: str) -> None:
    t = _lws(objs)["spec"]["leaderWorkerTemplate"]
    if name == "restart-policy":
        t["restartPolicy"] = "None"
    elif name == "size-one":
        t["size"] = 1
    elif name == "worker-role":
        t["workerTemplate"]["spec"]["containers"][0]["env"][0]["value"] = "head"
    elif name == "unknown-pod-field":
        t["leaderTemplate"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    elif name == "gpus":
        t["workerTemplate"]["spec"]["containers"][0]["resources"]["limits"][base.GPU_RESOURCE] = 8
    elif name == "runtime-emptydir":
        vols = t["leaderTemplate"]["spec"]["volumes"]
        for v in vols:
            if v["name"] == "runtime":
                v.pop("hostPath")
                v["emptyDir"] = {}


@pytest.mark.parametrize(
    "name", ["restart-policy", "size-one", "worker-role", "unknown-pod-field", "gpus", "runtime-emptydir"]
)
def test_a_broken_group_is_caught(name: str, objects: list[dict[str, Any]], tmp_path: Path) -> None:
    objs = copy.deepcopy(objects)
    _break(objs, name)
    assert lws_problems(objs, tmp_path) != []
