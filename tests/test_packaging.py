"""pyproject.toml declares only what src/ uses, and never the serving stack from PyPI.

A runtime dependency or a non-dev extra is used when src/ imports one of its top-level modules
(importlib.metadata.packages_distributions) or names one of its executables as a string (py-spy
is run, not imported). The serving stack (vLLM, torch and the XPU packages next to them) must not
be a requirement: an extra cannot name a package index, so PyPI would give a CUDA torch.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SERVING_STACK = {
    "vllm", "torch", "torchvision", "torchaudio", "triton", "triton-xpu", "vllm-xpu-kernels",
    "intel-extension-for-pytorch", "oneccl-bind-pt",
}


def _norm(name: str) -> str:
    """A distribution name in its PEP 503 normal form ("PyYAML" -> "pyyaml", "a_b" -> "a-b")."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> dict:
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def _requirements(section: str) -> list[Requirement]:
    """The requirements of `dependencies` or of the extra `section`."""
    project = _project()
    raw = project["dependencies"] if section == "dependencies" else project["optional-dependencies"][section]
    return [Requirement(r) for r in raw]


def _src_usage() -> tuple[set[str], set[str]]:
    """(top-level modules imported anywhere in src/, every string constant in src/)."""
    modules: set[str] = set()
    strings: set[str] = set()
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return modules, strings


def _executables(dist: md.Distribution) -> set[str]:
    """Names of the programs a distribution installs into bin/ (console scripts and binaries)."""
    names = {ep.name for ep in dist.entry_points if ep.group == "console_scripts"}
    names |= {Path(str(f)).name for f in dist.files or [] if Path(str(f)).parent.name == "bin"}
    return names


def _unused(section: str) -> list[str]:
    modules, strings = _src_usage()
    by_dist: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        for d in dists:
            by_dist.setdefault(_norm(d), set()).add(module)
    unused = []
    for req in _requirements(section):
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            dist: md.Distribution | None = md.distribution(req.name)
        except md.PackageNotFoundError:
            dist = None
        if dist is None:
            pytest.fail(f"{req.name} ({section}) is not installed: pip install -e '.[dev,{section}]'")
        if not (by_dist.get(_norm(req.name), set()) & modules or _executables(dist) & strings):
            unused.append(req.name)
    return unused


def test_every_runtime_dependency_is_used_by_src() -> None:
    assert _unused("dependencies") == []


@pytest.mark.parametrize("extra", sorted(set(_project()["optional-dependencies"]) - {"dev"}))
def test_every_extra_dependency_is_used_by_src(extra: str) -> None:
    assert _unused(extra) == []


def test_the_serving_stack_is_never_a_requirement() -> None:
    project = _project()
    sections = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    found = [
        f"{section}: {r}"
        for section, reqs in sections.items()
        for r in reqs
        if _norm(Requirement(r).name) in SERVING_STACK
    ]
    assert found == [], "install the serving stack apart from xpu-serve (README, Production)"


def test_unused_detection_sees_a_dependency_src_never_imports() -> None:
    # the check itself: `packaging` (installed with pytest) is neither imported nor run by src/
    modules, strings = _src_usage()
    dist = md.distribution("packaging")
    assert "packaging" not in modules and not _executables(dist) & strings
    assert "py-spy" in _executables(md.distribution("py-spy")) & strings
