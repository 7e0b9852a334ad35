"""Rendering: configs/glm47-flash.yaml gives exactly the seed command line of the GLM-4.7-Flash
case (through a real `xpu-serve render --json`); the Qwen3 config gives the engine arguments of
the Qwen3 case; the rendering rules of `engine.args`, presets and secrets."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT
from xpu_serve.config import load_config, preset_vars
from xpu_serve.vllm_command import is_secret_name, render

CASES = FIXTURES / "cases"

# Spellings vLLM's parser accepts for the same option, mapped to the canonical long flag:
# `-tp` is vLLM's own short alias (vllm/engine/arg_utils.py, add_cli_args: "--tensor-parallel-size",
# "-tp"), and argparse accepts any unambiguous prefix of a long option (allow_abbrev, on by
# default in vLLM's FlexibleArgumentParser), so `--gpu-memory-util` is `--gpu-memory-utilization`.
ALIASES = {"-tp": "--tensor-parallel-size", "--gpu-memory-util": "--gpu-memory-utilization"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPU_SERVE_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    return env


def parse_command_sh(text: str) -> tuple[dict[str, str], list[str]]:
    """(leading VAR=value assignments, argv) of a one-command shell script with `\\` continuations."""
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    return env, words


def normalize(argv: list[str]) -> tuple[list[str], Counter[tuple[str, ...]]]:
    """(the program words before the first option, a multiset of (flag, values...) groups) with
    `--flag=value` split and ALIASES applied, so that two spellings of one command compare equal."""
    head: list[str] = []
    groups: list[list[str]] = []
    for word in argv:
        if word.startswith("-"):
            flag, eq, value = word.partition("=")
            groups.append([ALIASES.get(flag, flag)] + ([value] if eq else []))
        elif groups:
            groups[-1].append(word)
        else:
            head.append(word)
    return head, Counter(tuple(g) for g in groups)


def test_glm47_render_json_equals_seed_command(xpu_serve_cmd: list[str]) -> None:
    seed_env, seed_argv = parse_command_sh((CASES / "glm47-flash-engine-hang" / "command.sh").read_text())
    r = subprocess.run(
        [*xpu_serve_cmd, "render", "-c", str(ROOT / "configs" / "glm47-flash.yaml"), "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"argv", "env"}
    head, groups = normalize(doc["argv"])
    seed_head, seed_groups = normalize(seed_argv)
    assert head == seed_head == ["vllm", "serve"]
    assert groups == seed_groups  # every flag and value; nothing missing, nothing extra
    assert sum(seed_groups.values()) == 15  # command.sh has 15 options
    # env: the script's variables, plus only PYTHONFAULTHANDLER, which xpu-serve always sets.
    assert doc["env"] == {"PYTHONFAULTHANDLER": "1", **seed_env}
    assert seed_env == {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def test_normalize_spellings() -> None:
    a = normalize(["vllm", "serve", "-tp=4", "--gpu-memory-util=0.9", "--x", "1"])
    b = normalize(
        ["vllm", "serve", "--x=1", "--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.9"]
    )
    assert a == b
    assert normalize(["v", "--a", "1"]) != normalize(["v", "--a", "2"])


def test_qwen3_render_has_the_case_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("XPU_SERVE_MODEL", "XPU_SERVE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    log = (CASES / "qwen3-30b-worker0-died" / "vllm.log").read_text()
    m = re.search(r"non-default args: (\{.*\})", log)
    assert m
    args = ast.literal_eval(m.group(1))
    # Left out on purpose (the config says why): the hang watcher needs the stats vLLM then drops.
    assert args.pop("disable_log_stats") is True
    rendered = render(load_config(ROOT / "configs" / "qwen3-30b-a3b.yaml"))
    argv = rendered.argv
    assert argv[:3] == ["vllm", "serve", args.pop("model")]  # positional model
    _, groups = normalize(argv)
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        expected = (flag,) if value is True else (flag, str(value))
        assert groups[expected] == 1, (key, value, argv)
    assert "--api-key" not in argv  # ${XPU_SERVE_API_KEY:-} unset: no key
    # The B60 tensor parallel preset, then nothing else but PYTHONFAULTHANDLER.
    assert rendered.env == {"PYTHONFAULTHANDLER": "1", **preset_vars("arc-b60-tp")}
    assert rendered.env["ZE_AFFINITY_MASK"] == "0,1,2,3"


def _cfg(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_args_rules_in_order(tmp_path: Path) -> None:
    cfg = load_config(
        _cfg(
            tmp_path,
            """
engine:
  model: org/model
  args:
    disable-log-requests: true
    enable-prefix-caching: false
    seed: null
    --max-num-seqs: 8
    kv_cache_dtype: fp8
    allowed-origins: [a, b]
    middleware: [m.one, m.two]
    compilation-config: {level: 0, cudagraph_capture_sizes: [1, 2]}
""",
        )
    )
    argv = render(cfg).argv
    assert argv == [
        "vllm",
        "serve",
        "org/model",
        "--tensor-parallel-size",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--disable-log-requests",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "8",
        "--kv-cache-dtype",
        "fp8",
        "--allowed-origins",
        "a",
        "b",
        "--middleware",
        "m.one",
        "--middleware",
        "m.two",
        "--compilation-config",
        '{"level":0,"cudagraph_capture_sizes":[1,2]}',
    ]


def test_presets_then_user_vars_user_wins(tmp_path: Path) -> None:
    cfg = load_config(
        _cfg(
            tmp_path,
            """
engine: {model: m, tensor_parallel_size: 2}
environment:
  presets: [arc-b60-tp, sycl-jit-cache]
  vars:
    ZE_AFFINITY_MASK: "0,1"
    PYTHONFAULTHANDLER: "0"
    CCL_LOG_LEVEL: info
""",
        )
    )
    env = render(cfg).env
    expected = {
        "PYTHONFAULTHANDLER": "0",
        **preset_vars("arc-b60-tp"),
        "SYCL_CACHE_PERSISTENT": "1",
        "ZE_AFFINITY_MASK": "0,1",
        "CCL_LOG_LEVEL": "info",
    }
    assert env == expected
    assert list(env)[0] == "PYTHONFAULTHANDLER"  # always set first, overridable


def test_secrets_masked_in_json_and_shell(xpu_serve_cmd: list[str], tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        """
engine:
  model: m
  api_key: ${XPU_T_API_KEY}
  max_num_batched_tokens: 8192
  args:
    hf-token: ${XPU_T_HF}
environment:
  vars:
    HF_TOKEN: ${XPU_T_HF}
    VLLM_ALLOW_LONG_MAX_MODEL_LEN: "1"
""",
    )
    env = {**_env(), "XPU_T_API_KEY": "sk-live-abcdef", "XPU_T_HF": "hf_zzzzzzzz"}
    j = subprocess.run(
        [*xpu_serve_cmd, "render", "-c", str(cfg), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    s = subprocess.run(
        [*xpu_serve_cmd, "render", "-c", str(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert j.returncode == s.returncode == 0
    for out in (j.stdout, s.stdout):
        assert "sk-live-abcdef" not in out and "hf_zzzzzzzz" not in out
    doc = json.loads(j.stdout)
    argv = doc["argv"]
    assert "--api-key" not in argv  # the key goes in the environment: argv is world-readable in /proc
    assert argv[argv.index("--hf-token") + 1] == "***"
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "8192"  # a count, not a secret
    assert doc["env"] == {
        "PYTHONFAULTHANDLER": "1", "HF_TOKEN": "***", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_API_KEY": "***"
    }
    # The shell snippet is the same command: assignments, then the (redacted) argv.
    shell_env, shell_argv = parse_command_sh(s.stdout)
    assert shell_env == doc["env"] and shell_argv == argv


def test_shell_snippet_quotes(tmp_path: Path) -> None:
    cfg = load_config(
        _cfg(
            tmp_path,
            """
engine:
  command: ["/opt/my venv/bin/vllm", serve]
  model: "/models/it's here"
  args: {chat-template: "{{ messages }} $HOME"}
environment: {vars: {VLLM_CPU_OMP_THREADS_BIND: "0|1"}}
""",
        )
    )
    r = render(cfg)
    env, argv = parse_command_sh(r.shell())
    assert argv == r.argv and env == r.env


@pytest.mark.parametrize(
    "name,secret",
    [
        ("HF_TOKEN", True),
        ("--api-key", True),
        ("--api-keys", True),
        ("api_key", True),
        ("OPENAI_APIKEY", True),
        ("DB_PASSWORD", True),
        ("--max-num-batched-tokens", False),
        ("--ssl-keyfile", False),
        ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", False),
        ("CCL_KVS_MODE", False),
    ],
)
def test_is_secret_name(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_list_value_of_a_plural_secret_flag_is_masked(tmp_path: Path) -> None:
    """`engine.args: {api-keys: [a, b]}` renders `--api-keys a b` with both values masked."""
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("engine:\n  model: m\n  args:\n    api-keys: [k-one-5a1, k-two-9b2]\n")
    r = render(load_config(cfg_path))
    i = r.argv.index("--api-keys")
    assert r.argv[i + 1 : i + 3] == ["k-one-5a1", "k-two-9b2"]
    assert r.redacted_argv()[i + 1 : i + 3] == ["***", "***"]
    assert "k-one-5a1" not in r.shell() and "k-two-9b2" not in r.shell()


_GROUP_CFG = """
engine: {{model: m, tensor_parallel_size: 4, port: 8100}}
group:
  role: {role}
  nnodes: 2
  node_rank: {rank}
  master_addr: 10.200.0.1
  master_port: 29555
  secret: ${{XPU_T_GROUP_SECRET}}
"""


@pytest.mark.parametrize("role,rank,tail", [("head", 0, []), ("follower", 1, ["--headless"])])
def test_group_renders_vllm_multi_node_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str, rank: int, tail: list[str]
) -> None:
    secret = "group-secret-5f0c9a1e77"
    monkeypatch.setenv("XPU_T_GROUP_SECRET", secret)
    r = render(load_config(_cfg(tmp_path, _GROUP_CFG.format(role=role, rank=rank))))
    assert r.argv == [
        "vllm", "serve", "m", "--tensor-parallel-size", "4", "--host", "127.0.0.1", "--port", "8100",
        "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "10.200.0.1", "--master-port", "29555",
        "--distributed-executor-backend", "mp", *tail,
    ]
    # the group's secret is the supervisors' own: not on vLLM's argv, not in its environment
    assert secret not in " ".join(r.argv) and secret not in " ".join(r.env.values())
    assert r.env == {"PYTHONFAULTHANDLER": "1"}


def test_group_secret_nowhere_in_render_output(xpu_serve_cmd: list[str], tmp_path: Path) -> None:
    secret = "group-secret-90ab12cd34"
    cfg = _cfg(tmp_path, _GROUP_CFG.format(role="follower", rank=1))
    for extra in ([], ["--json"]):
        r = subprocess.run(
            [*xpu_serve_cmd, "render", "-c", str(cfg), *extra], capture_output=True, text=True,
            env={**_env(), "XPU_T_GROUP_SECRET": secret}, timeout=60, stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stderr
        assert "--headless" in r.stdout and "--node-rank" in r.stdout
        assert secret not in r.stdout + r.stderr
