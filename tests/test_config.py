"""Config loading: each kind of bad config gives its one clear line and exit 2 through a real
`xpu-serve` subprocess; interpolation, line mapping, hashing and the shipped configs in-process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from xpu_serve import exitcodes
from xpu_serve.config import ConfigError, config_hash, interpolate, load_config

UNSET = "XPU_SERVE_TEST_SURELY_UNSET"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPU_SERVE_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


# (name, file text, the one expected stderr line after "FILE:")
BAD = [
    (
        "unknown-key",
        "engine:\n  model: m\n  prot: 8000\n",
        "3: engine.prot: unknown key (did you mean 'port'?)",
    ),
    (
        "wrong-type",
        "engine:\n  model: m\n  port: eighty\n",
        "3: engine.port: must be an integer, got 'eighty'",
    ),
    (
        "wrong-type-section",
        "engine:\n  model: m\nsupervision: [1, 2]\n",
        "3: supervision: must be a mapping, got list",
    ),
    (
        "zero-duration",
        "engine:\n  model: m\nsupervision:\n  restart:\n    max_delay_s: 0\n",
        "5: supervision.restart.max_delay_s: must be > 0",
    ),
    (
        "negative-duration",
        "engine:\n  model: m\nsupervision:\n  hang:\n    after_s: -5\n",
        "5: supervision.hang.after_s: must be > 0",
    ),
    ("missing-model", "# no model\nengine:\n  port: 8000\n", "2: engine.model: required key is missing"),
    ("missing-engine", "runtime_dir: /tmp/x\n", "1: engine: required key is missing"),
    (
        "malformed-yaml",
        "engine:\n  model: m\n  args: {a: 1\n",
        "4: malformed YAML: expected ',' or '}', but got '<stream end>' (while parsing a flow mapping started at line 3)",
    ),
    (
        "malformed-indent",
        "engine:\n  model: m\n port: 1\n",
        "3: malformed YAML: expected <block end>, but found '<block mapping start>' "
        "(while parsing a block mapping started at line 1)",
    ),
    (
        "unset-var",
        f"engine:\n  model: m\n  api_key: ${{{UNSET}}}\n",
        f"3: engine.api_key: environment variable {UNSET} is not set (set it, or write ${{{UNSET}:-default}})",
    ),
    (
        "unset-var-in-int",
        f"engine:\n  model: m\n  port: ${{{UNSET}}}\n",
        f"3: engine.port: environment variable {UNSET} is not set (set it, or write ${{{UNSET}:-default}})",
    ),
    (
        "unknown-preset",
        "engine:\n  model: m\nenvironment:\n  presets:\n    - arc-b60-tp\n    - arc-b60\n",
        "6: environment.presets[1]: unknown preset 'arc-b60' (did you mean 'arc-b60-tp'?); "
        "known: arc-b60-tp, sycl-jit-cache",
    ),
    ("duplicate-key", "engine:\n  model: m\n  port: 1\n  port: 2\n", "4: engine.port: duplicate key"),
    (
        "empty-file",
        "",
        "1: the config must be a mapping with at least `engine: {model: ...}`, got an empty file",
    ),
    (
        "short-flag-in-args",
        "engine:\n  model: m\n  args:\n    tp: 4\n",
        "4: engine.args.tp: a short option; write its long name 'tensor-parallel-size'",
    ),
    (
        "typed-flag-in-args",
        "engine:\n  model: m\n  args:\n    max-model-len: 4\n",
        "4: engine.args.max-model-len: has its own key: use engine.max_model_len",
    ),
    (
        "bool-env-value",
        "engine:\n  model: m\nenvironment:\n  vars:\n    HF_HUB_OFFLINE: true\n",
        '5: environment.vars.HF_HUB_OFFLINE: a boolean is ambiguous as an environment value: quote it, e.g. "1"',
    ),
]


@pytest.mark.parametrize("name,text,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_config_one_line_exit_2(
    xpu_serve_cmd: list[str], tmp_path: Path, name: str, text: str, expected: str
) -> None:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(text)
    r = _run([*xpu_serve_cmd, "render", "-c", str(cfg)], tmp_path)
    assert r.returncode == exitcodes.USAGE == 2
    assert r.stdout == ""
    assert r.stderr.splitlines() == [f"{cfg}:{expected}"]


def test_missing_file_one_line_exit_2(xpu_serve_cmd: list[str], tmp_path: Path) -> None:
    r = _run([*xpu_serve_cmd, "render", "-c", "nope/absent.yaml"], tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["nope/absent.yaml: cannot read config: No such file or directory"]


def test_check_exits_2_on_bad_config_too(xpu_serve_cmd: list[str], tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  model: m\n  prot: 1\n")
    r = _run([*xpu_serve_cmd, "check", "-c", str(cfg)], tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"{cfg}:3: engine.prot: unknown key (did you mean 'port'?)"]


def test_several_problems_one_line_each_in_line_order(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "engine:\n"  # 1
        "  model: m\n"  # 2
        "  port: 70000\n"  # 3
        "  command: []\n"  # 4
        "supervision:\n"  # 5
        "  restart:\n"  # 6
        "    multiplier: 0.5\n"  # 7
        "    max_failures: 0\n"  # 8
        "watchers:\n"  # 9
        "  kernel:\n"  # 10
        "    source: kmesg\n"  # 11
        "bundles: {keep: 2, tarball: true}\n"  # 12
    )
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    assert ei.value.problems == [
        f"{cfg}:3: engine.port: must be <= 65535",
        f"{cfg}:4: engine.command: must not be empty",
        f"{cfg}:7: supervision.restart.multiplier: must be >= 1",
        f"{cfg}:8: supervision.restart.max_failures: must be > 0",
        f"{cfg}:11: watchers.kernel.source: must be one of 'auto', 'kmsg', 'journalctl', 'dmesg', 'file' or "
        "'none', got 'kmesg'",
        f"{cfg}:12: bundles.tarball: unknown key (did you mean 'tar'?)",
    ]


def test_interpolation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XPU_T_KEY", "sk-secret-123")
    monkeypatch.setenv("XPU_T_PORT", "8123")
    monkeypatch.setenv("XPU_T_EMPTY", "")
    monkeypatch.delenv("XPU_T_NONE", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "engine:\n"
        "  command: ['${XPU_T_NONE:-/opt/venv}/bin/vllm', serve]\n"
        "  model: m\n"
        "  port: ${XPU_T_PORT}\n"
        "  api_key: ${XPU_T_KEY}\n"
        "  served_model_name: ${XPU_T_EMPTY:-fallback}\n"
        "environment:\n"
        "  vars:\n"
        "    PRICE: $$5 and $${NOT_A_VAR}\n"
    )
    c = load_config(cfg)
    assert c.engine.command == ["/opt/venv/bin/vllm", "serve"]
    assert c.engine.port == 8123
    assert c.engine.api_key == "sk-secret-123"
    assert c.engine.served_model_name == "fallback"  # `:-` also covers set-but-empty, as in sh
    assert c.environment.vars == {"PRICE": "$5 and ${NOT_A_VAR}"}
    assert c.source_path == cfg


def test_interpolate_function() -> None:
    env = {"A": "1", "E": ""}
    assert interpolate("x${A}y${B:-2}z${E}", env) == ("x1y2z", [])
    assert interpolate("${B}${C}", env) == ("", ["B", "C"])


def test_empty_api_key_means_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XPU_T_NOKEY", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  model: m\n  api_key: ${XPU_T_NOKEY:-}\n")
    assert load_config(cfg).engine.api_key is None


@pytest.mark.parametrize("name", ["glm47-flash.yaml", "qwen3-30b-a3b.yaml"])
def test_shipped_configs_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("XPU_SERVE_MODEL", "XPU_SERVE_API_KEY", "XPU_SERVE_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    c = load_config(ROOT / "configs" / name)
    assert c.engine.tensor_parallel_size == 4
    assert c.source_path == ROOT / "configs" / name


def test_config_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = tmp_path / "a.yaml"
    a.write_text("engine: {model: m, api_key: '${XPU_T_K}'}\nenvironment: {vars: {HF_TOKEN: '${XPU_T_K}'}}\n")
    monkeypatch.setenv("XPU_T_K", "first-secret")
    h1 = config_hash(load_config(a))
    monkeypatch.setenv("XPU_T_K", "second-secret")
    h2 = config_hash(load_config(a))
    assert h1 == h2 and len(h1) == 64 and int(h1, 16) >= 0  # secrets do not enter the hash
    # Same meaning written differently (defaults spelled out, other order) -> same hash.
    b = tmp_path / "b.yaml"
    b.write_text("environment: {vars: {HF_TOKEN: x}}\nengine: {api_key: y, model: m, port: 8000}\n")
    assert config_hash(load_config(b)) == h1
    c = tmp_path / "c.yaml"
    c.write_text("engine: {model: m, port: 8001}\n")
    assert config_hash(load_config(c)) != h1
