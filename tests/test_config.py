"""Config loading: each kind of bad config gives its one clear line and exit 2 through a real
`xpu-serve` subprocess; interpolation, line mapping, hashing and the shipped configs in-process."""

from __future__ import annotations

import os
import subprocess
import sys
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


_GROUP = (
    "group:\n  role: {role}\n  nnodes: {n}\n  node_rank: {r}\n  master_addr: 10.0.0.1\n"
    "  secret: 0123456789abcdef0123\n"
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
    # a duplicated section hides the first one: the duplicate is the one line, not "model missing"
    ("duplicate-section", "engine:\n  model: m\nengine:\n  port: 1\n", "3: engine: duplicate key"),
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
    (
        "group-head-not-rank-0",
        "engine: {model: m, tensor_parallel_size: 2}\n" + _GROUP.format(role="head", n=2, r=1),
        "5: group.node_rank: the head must be node_rank 0, got 1",
    ),
    (
        "group-follower-rank-0",
        "engine: {model: m, tensor_parallel_size: 2}\n" + _GROUP.format(role="follower", n=2, r=0),
        "5: group.node_rank: a follower needs node_rank 1..nnodes-1; 0 is the head",
    ),
    (
        "group-rank-past-nnodes",
        "engine: {model: m, tensor_parallel_size: 2}\n" + _GROUP.format(role="follower", n=2, r=2),
        "5: group.node_rank: must be < nnodes (2), got 2",
    ),
    (
        "group-one-node",
        "engine: {model: m}\n" + _GROUP.format(role="head", n=1, r=0),
        "4: group.nnodes: must be >= 2",
    ),
    (
        "group-follower-without-master-addr",
        "engine: {model: m, tensor_parallel_size: 2}\n"
        "group:\n  role: follower\n  nnodes: 2\n  node_rank: 1\n  secret: 0123456789abcdef0123\n",
        "2: group.master_addr: required key is missing",
    ),
    (
        "group-short-secret",
        "engine: {model: m, tensor_parallel_size: 2}\n"
        "group:\n  role: head\n  nnodes: 2\n  node_rank: 0\n  master_addr: h\n  secret: short\n",
        "7: group.secret: must be at least 16 characters, got 5 "
        "(e.g. `openssl rand -hex 32` in an environment variable, then `${VAR}`)",
    ),
    (
        "group-workers-do-not-split",
        "engine: {model: m, tensor_parallel_size: 3}\n" + _GROUP.format(role="head", n=2, r=0),
        "4: group.nnodes: the group's 3 workers (engine.tensor_parallel_size x pipeline parallel) "
        "do not split evenly over 2 nodes",
    ),
    (
        "group-flag-in-args",
        "engine:\n  model: m\n  args:\n    node-rank: 1\n",
        "4: engine.args.node-rank: set by the group section: use group.node_rank",
    ),
    (
        "group-heartbeat-too-slow",
        "engine: {model: m, tensor_parallel_size: 2}\n" + _GROUP.format(role="head", n=2, r=0)
        + "  peer_timeout_s: 3\n  heartbeat_interval_s: 2\n",
        "9: group.heartbeat_interval_s: must be at most a third of peer_timeout_s (3 s), got 2: "
        "one late heartbeat would look like a lost node",
    ),
    (
        "group-channel-on-master-port",
        "engine: {model: m, tensor_parallel_size: 2}\n" + _GROUP.format(role="head", n=2, r=0)
        + "  listen: 0.0.0.0:29501\n",
        "8: group.listen: PORT 29501 is group.master_port (vLLM's rendezvous)",
    ),
    (
        "metrics-on-engine-port",
        "engine: {model: m, port: 8123}\nmetrics:\n  listen: 127.0.0.1:8123\n",
        "3: metrics.listen: PORT 8123 is engine.port",
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


# --------------------------------------------------------------------------- hostile input (issue 2)


def _bomb() -> str:
    """A "billion laughs": 9 levels of 9 aliases each, 9**9 strings when expanded."""
    lines = ["engine: {model: m}", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


_NUL_MSG = "contains a NUL character: it cannot be passed in a command line or the environment"
_INTERP_HINT = "write ${NAME} or ${NAME:-default} (NAME: letters, digits, _), or $${ for a literal ${"

# (name, file text (str, or bytes written as they are), the one expected stderr line after "FILE")
HOSTILE: list[tuple[str, str | bytes, str]] = [
    (
        "huge-tp",
        "engine:\n  model: m\n  tensor_parallel_size: 99999999999999999999999999999\n",
        ":3: engine.tensor_parallel_size: must be <= 64",
    ),
    (
        "tp-65",
        "engine: {model: m, tensor_parallel_size: 65}\n",
        ":1: engine.tensor_parallel_size: must be <= 64",
    ),
    ("port-0", "engine: {model: m, port: 0}\n", ":1: engine.port: must be >= 1"),
    (
        "inf-duration",
        "engine: {model: m}\nsupervision:\n  stop: {grace_s: .inf}\n",
        ":3: supervision.stop.grace_s: must be a finite number, got inf",
    ),
    (
        "1e400-duration",
        "engine: {model: m}\nsupervision:\n  stop:\n    grace_s: 1.0e+400\n",
        ":4: supervision.stop.grace_s: must be a finite number, got inf",
    ),
    (
        "1e400-is-a-string",  # YAML 1.1 floats need a dot and a signed exponent
        "engine: {model: m}\nsupervision:\n  stop:\n    grace_s: 1e400\n",
        ":4: supervision.stop.grace_s: must be a number, got '1e400'",
    ),
    (
        "31-days",
        "engine: {model: m}\nsupervision: {hang: {after_s: 2678400}}\n",
        ":2: supervision.hang.after_s: must be <= 2592000",
    ),
    (
        "byte-cap",
        "engine: {model: m}\nbundles:\n  max_bytes: 1099511627777\n",
        ":3: bundles.max_bytes: must be <= 1099511627776",
    ),
    ("count", "engine: {model: m}\nbundles: {keep: 1000000}\n", ":2: bundles.keep: must be <= 10000"),
    (
        "nul-byte",
        b"engine:\n  model: m\x00\n",
        ":2: malformed YAML: unacceptable character #x0000 at column 11: special characters are not allowed",
    ),
    (
        "recursive-alias",
        "engine: {model: m}\nx: &x [*x]\n",
        ":2: x[0]: alias *x is inside its own anchor (recursive)",
    ),
    (
        "deep-block",
        "engine: {model: m}\n" + "".join(" " * i + f"k{i}:\n" for i in range(1000)),
        ":67: " + ".".join(f"k{i}" for i in range(22)) + "...: nested deeper than 64 levels",
    ),
    (
        "deep-flow",
        "engine: {model: m}\nx: " + "[" * 5000 + "\n",
        ":2: x" + "[0]" * 25 + "[...: nested deeper than 64 levels",
    ),
    (
        "5001-digits",
        "engine: {model: m}\nx: " + "1" * 5001 + "\n",
        ":2: x: integer of 5001 digits; the limit is 100",
    ),
    ("quoted-nul-model", 'engine: {model: "/a\\0b"}\n', ":1: engine.model: " + _NUL_MSG),
    (
        "nul-env-value",
        'engine: {model: m}\nenvironment:\n  vars:\n    A: "x\\0"\n',
        ":4: environment.vars.A: " + _NUL_MSG,
    ),
    (
        "nul-in-command",
        'engine: {model: m, command: ["vllm\\0", serve]}\n',
        ":1: engine.command[0]: " + _NUL_MSG,
    ),
    ("nul-in-key", 'engine: {model: m, args: {"a\\0": 1}}\n', ":1: engine.args.a\\x00: " + _NUL_MSG),
    (
        "billion-laughs",
        _bomb(),
        ":6: a4[0]: more than 10000 values in the file (an alias counts as everything its anchor holds); "
        "a config needs a few hundred",
    ),
    (
        "200k-keys",
        "engine: {model: m}\n" + "a: 1\n" * 200_000,
        ":5000: more than 10000 values in the file (an alias counts as everything its anchor holds); "
        "a config needs a few hundred",
    ),
    (
        "20MB-comment",
        "engine: {model: m}\n#" + "x" * (20 * 1024 * 1024) + "\n",
        ": config file is 20971541 bytes; the limit is 1 MiB",
    ),
    (
        "tp-true",
        "engine: {model: m, tensor_parallel_size: true}\n",
        ":1: engine.tensor_parallel_size: must be an integer, got true",
    ),
    (
        "tp-float",
        "engine: {model: m, tensor_parallel_size: 4.0}\n",
        ":1: engine.tensor_parallel_size: must be an integer, got 4.0",
    ),
    ("port-quoted", 'engine: {model: m, port: "8100"}\n', ":1: engine.port: must be an integer, got '8100'"),
    (
        "bool-duration",
        "engine: {model: m}\nsupervision: {stop: {grace_s: true}}\n",
        ":2: supervision.stop.grace_s: must be a number, got true",
    ),
    (
        "bool-from-string",
        "engine: {model: m, enforce_eager: 'yes'}\n",
        ":1: engine.enforce_eager: must be true or false, got 'yes'",
    ),
    ("empty-model", 'engine:\n  model: ""\n', ":2: engine.model: must not be empty"),
    (
        "empty-command-item",
        'engine:\n  model: m\n  command: [""]\n',
        ":3: engine.command[0]: must not be empty",
    ),
    ("empty-command", "engine:\n  model: m\n  command: []\n", ":3: engine.command: must not be empty"),
    (
        "malformed-var",
        "engine:\n  model: m\n  host: '${A B}'\n",
        f":3: engine.host: malformed variable reference '${{A B}}': {_INTERP_HINT}",
    ),
    (
        "unclosed-var",
        "engine:\n  model: '/x/${'\n",
        f":2: engine.model: malformed variable reference '${{': {_INTERP_HINT}",
    ),
    (
        "bad-listen",
        "engine: {model: m}\nmetrics:\n  listen: localhost\n",
        ":3: metrics.listen: must be HOST:PORT with PORT 0-65535, got 'localhost'",
    ),
    (
        "bad-listen-port",
        "engine: {model: m}\nmetrics: {listen: 'h:65536'}\n",
        ":2: metrics.listen: must be HOST:PORT with PORT 0-65535, got 'h:65536'",
    ),
    (
        "bad-webhook",
        "engine: {model: m}\nwebhook:\n  url: ftp://example.com/x\n",
        ":3: webhook.url: must be an http:// or https:// URL with a host, got 'ftp://example.com/x'",
    ),
    (
        "webhook-no-host",
        "engine: {model: m}\nwebhook: {url: 'http://'}\n",
        ":2: webhook.url: must be an http:// or https:// URL with a host, got 'http://'",
    ),
    (
        "inf-in-args",
        "engine:\n  model: m\n  args:\n    x: [1, .inf]\n",
        ":4: engine.args.x: must be a finite number, got inf",
    ),
    (
        "binary",
        "engine: {model: !!binary AAA=}\n",
        ":1: engine.model: binary values (!!binary) are not supported",
    ),
]


# A process's ru_maxrss starts from the high-water mark of the address space it was exec'd over
# (Linux exec_mmap -> setmax_mm_hiwater_rss): a command spawned straight from pytest reports at
# least pytest's own RSS, which grows over the suite. This launcher is a fresh small interpreter
# that forks the command, so the figure is the command's own, in bytes, written to the fd in argv[1].
_RSS_LAUNCHER = """
import os, sys
fd = int(sys.argv[1])
pid = os.fork()
if pid == 0:
    os.close(fd)
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
os.write(fd, str(usage.ru_maxrss * 1024).encode())
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _run_measured(cmd: list[str], cwd: Path, limit_s: float = 60.0) -> tuple[int, str, str, float, int]:
    """(exit code, stdout, stderr, wall seconds, peak RSS in bytes) of one real subprocess, its
    process group killed after `limit_s`; the RSS is the command's own (see `_RSS_LAUNCHER`)."""
    import signal
    import threading
    import time

    rss_r, rss_w = os.pipe()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _RSS_LAUNCHER, str(rss_w), *cmd],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        pass_fds=(rss_w,),
        start_new_session=True,
    )
    os.close(rss_w)
    killer = threading.Timer(limit_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
    killer.start()
    try:
        out, err = proc.communicate()
    finally:
        killer.cancel()
        with os.fdopen(rss_r, "rb") as f:
            rss = f.read()
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - t0, int(rss or 0)


@pytest.mark.parametrize("name,text,expected", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_config_one_line_exit_2_fast(
    xpu_serve_cmd: list[str], tmp_path: Path, name: str, text: str | bytes, expected: str
) -> None:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err, wall, rss = _run_measured([*xpu_serve_cmd, "render", "-c", str(cfg)], tmp_path)
    assert (code, out) == (exitcodes.USAGE, "")
    assert err.splitlines() == [f"{cfg}{expected}"]
    assert wall < 10, f"took {wall:.1f} s"
    assert rss < 300 * 1024**2, f"peak RSS {rss / 1024**2:.0f} MiB"


@pytest.mark.parametrize("sub", ["check", "unit", "up"])
@pytest.mark.parametrize("name", ["nul-byte", "huge-tp", "nul-env-value", "bad-listen"])
def test_hostile_config_every_subcommand(
    xpu_serve_cmd: list[str], tmp_path: Path, sub: str, name: str
) -> None:
    """`up` refuses what `render` refuses, before it creates anything or starts an engine."""
    text, expected = next((t, e) for n, t, e in HOSTILE if n == name)
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    extra = ["--runtime-dir", str(tmp_path / "rt")] if sub in ("up", "check") else []
    code, _, err, wall, _ = _run_measured([*xpu_serve_cmd, sub, "-c", str(cfg), *extra], tmp_path)
    assert code == exitcodes.USAGE
    assert err.splitlines() == [f"{cfg}{expected}"]
    assert wall < 10
    assert not (tmp_path / "rt").exists()


def test_interpolated_numbers_and_bools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Environment values are strings: a number or boolean field accepts one from `${VAR}`."""
    monkeypatch.setenv("XPU_T_TP", "4")
    monkeypatch.setenv("XPU_T_EAGER", "true")
    monkeypatch.delenv("XPU_T_NONE", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "engine:\n  model: m\n  port: '${XPU_T_NONE:-8100}'\n  tensor_parallel_size: ${XPU_T_TP}\n"
        "  enforce_eager: ${XPU_T_EAGER}\n  gpu_memory_utilization: ${XPU_T_NONE:-0.9}\n"
        "supervision: {stop: {grace_s: '${XPU_T_NONE:-2.5}'}}\n"
        "environment: {vars: {LIT: '$${A B}'}}\n"
    )
    c = load_config(cfg)
    assert (c.engine.port, c.engine.tensor_parallel_size, c.engine.enforce_eager) == (8100, 4, True)
    assert (c.engine.gpu_memory_utilization, c.supervision.stop.grace_s) == (0.9, 2.5)
    assert c.environment.vars == {"LIT": "${A B}"}
    monkeypatch.setenv("XPU_T_TP", "four")
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    assert ei.value.problems == [f"{cfg}:4: engine.tensor_parallel_size: must be an integer, got 'four'"]


def test_config_at_the_size_limit_loads(tmp_path: Path) -> None:
    from xpu_serve.config import MAX_FILE_BYTES

    cfg = tmp_path / "c.yaml"
    head = "engine: {model: m}\n#"
    cfg.write_text(head + "x" * (MAX_FILE_BYTES - len(head) - 1) + "\n")
    assert cfg.stat().st_size == MAX_FILE_BYTES
    assert load_config(cfg).engine.model == "m"


def test_many_problems_are_capped(tmp_path: Path) -> None:
    from xpu_serve.config import MAX_PROBLEMS

    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  model: m\n" + "".join(f"  k{i}: 1\n" for i in range(3000)))
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    assert len(ei.value.problems) == MAX_PROBLEMS == 20
    assert ei.value.problems[0] == f"{cfg}:3: engine.k0: unknown key"
    assert ei.value.problems[-1] == f"{cfg}: ... and {3000 - 19} more problems"


def test_config_fifo_without_writer_is_an_error_not_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A named FIFO nobody writes to: one line after FIFO_WAIT_S, not a blocked open()."""
    import time as _time

    from xpu_serve import config as cfgmod

    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    monkeypatch.setattr(cfgmod, "FIFO_WAIT_S", 0.3)
    t0 = _time.monotonic()
    with pytest.raises(cfgmod.ConfigError) as ei:
        cfgmod.load_config(fifo)
    assert _time.monotonic() - t0 < 5
    assert str(ei.value).startswith(f"{fifo}: cannot read config: a FIFO with no data from a writer within 0.3 s")


def test_config_from_a_pipe_with_a_writer_loads(tmp_path: Path) -> None:
    """`-c <(...)` and a named FIFO with a writer: the config is read from the pipe."""
    import threading

    from xpu_serve.config import load_config

    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)

    def writer() -> None:
        with open(fifo, "w") as f:  # blocks until the reader opens
            f.write("engine:\n  model: /models/from-fifo\n")

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    cfg = load_config(fifo)
    th.join(5)
    assert cfg.engine.model == "/models/from-fifo"
    r = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m xpu_serve render --json -c <(printf 'engine:\\n  model: /m/x\\n')"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "/m/x" in r.stdout


def test_nested_reference_in_a_default_is_an_error_not_a_literal(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text('engine:\n  model: "${XPU_TEST_UNSET_A:-${XPU_TEST_UNSET_B}}"\n')
    r = _run([sys.executable, "-m", "xpu_serve", "render", "-c", str(cfg)], tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"{cfg}:2: engine.model: nested variable reference in the default of")
    assert r.stdout == ""


@pytest.mark.parametrize(
    "host", ["bad\nhost", "two words", "http://example.com", "[::1]", "a..b", "-lead.example", "x" * 64 + ".com"]
)
def test_engine_host_must_be_a_name_or_address(tmp_path: Path, host: str) -> None:
    """A newline, a space, a URL or brackets in engine.host passed validation (`up` then waited for
    a port it could never bind): now a config error at load, naming the key and its line."""
    import json

    p = tmp_path / "c.yaml"
    p.write_text(f"engine:\n  model: m\n  host: {json.dumps(host)}\n")  # (JSON strings are YAML)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    (line,) = ei.value.problems
    assert line.startswith(f"{p}:3: engine.host: must be a host name or an IP address, got '"), line
    assert "\n" not in line


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "127.0.0.1", "fe80::1%eth0", "gpu-01.lab.example.", "localhost"])
def test_engine_host_accepts_names_and_addresses(tmp_path: Path, host: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(f'engine:\n  model: m\n  host: "{host}"\n')
    assert load_config(p).engine.host == host


def test_default_config_sends_the_idle_canary() -> None:
    """An idle hang is invisible to the counters: the default config must send the canary, and
    within after_s + canary_interval_s."""
    from xpu_serve.config import HangConfig

    h = HangConfig()
    assert h.canary is True
    assert h.canary_interval_s + h.canary_timeout_s <= h.after_s + h.canary_interval_s


def test_group_secret_from_env_masked_in_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (
        "engine: {model: m, tensor_parallel_size: 4}\n"
        "group: {role: follower, nnodes: 2, node_rank: 1, master_addr: '10.0.0.1', "
        "secret: '${XPU_T_GROUP_SECRET}', listen: '0.0.0.0:29700'}\n"
    )
    cfg = tmp_path / "g.yaml"
    cfg.write_text(text)
    monkeypatch.setenv("XPU_T_GROUP_SECRET", "s3cret-one-0123456789")
    a = load_config(cfg)
    assert a.group is not None and a.group.secret == "s3cret-one-0123456789"
    assert a.group.head_url == "http://10.0.0.1:29700"
    assert (a.group.peer_timeout_s, a.group.heartbeat_interval_s, a.group.master_port) == (10.0, 1.0, 29501)
    monkeypatch.setenv("XPU_T_GROUP_SECRET", "s3cret-two-0123456789")
    b = load_config(cfg)
    assert config_hash(a) == config_hash(b)  # the secret is masked before hashing
    # bundles: the config dump shows it as ***, and the supervisor's Redactor knows its value
    from xpu_serve.redact import Redactor, secrets_in_mapping

    dump = a.model_dump(mode="json")
    assert Redactor().mapping(dump)["group"]["secret"] == "***"
    assert "s3cret-one-0123456789" in secrets_in_mapping(dump)
    cfg.write_text(text.replace("node_rank: 1", "node_rank: 1, peer_timeout_s: 20"))
    assert config_hash(load_config(cfg)) != config_hash(a)


def test_group_secret_unset_is_its_line(tmp_path: Path) -> None:
    cfg = tmp_path / "g.yaml"
    cfg.write_text(
        "engine: {model: m, tensor_parallel_size: 2}\ngroup:\n  role: head\n  nnodes: 2\n  node_rank: 0\n"
        f"  master_addr: h\n  secret: ${{{UNSET}}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert e.value.problems == [
        f"{cfg}:7: group.secret: environment variable {UNSET} is not set (set it, or write ${{{UNSET}:-default}})"
    ]
