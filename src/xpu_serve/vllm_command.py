"""Config -> the argv and environment of `vllm serve` (what `xpu-serve render` prints, what `up` runs).

Rendering rules (the README's config reference repeats them):

- argv = `engine.command`, then the model (`MODEL` positional, or `--model MODEL` with
  `engine.model_arg: flag`), then the typed fields as vLLM's canonical long flags
  (`--served-model-name`, `--tensor-parallel-size`, `--host`, `--port`, `--dtype`,
  `--max-model-len`, `--gpu-memory-utilization`, `--enforce-eager`, `--trust-remote-code`,
  `--quantization`, `--block-size`, `--max-num-batched-tokens`, `--api-key`), each as two argv
  items `--flag value`; `--host`, `--port` and `--tensor-parallel-size` always, the others when set
  (booleans when true). With a `group:` section, vLLM's multi-node flags follow
  (`--nnodes N --node-rank R --master-addr A --master-port P --distributed-executor-backend mp`,
  and `--headless` on a follower: vllm/config/parallel.py, entrypoints/launchers/cli_args.py).
  The group's secret is the supervisors' own: it never reaches vLLM. Then `engine.args` in file order:
  `true` -> `--name`; `false` -> `--no-name` (argparse BooleanOptionalAction, e.g.
  `--no-enable-prefix-caching`); `null` -> nothing; a list -> `--name a b` (one flag, argparse
  `nargs='+'`, e.g. `--allowed-origins`), except flags vLLM declares with `action='append'`
  (`APPEND_FLAGS`), which repeat `--name a --name b`; a mapping -> `--name '{"json": ...}'`
  (vLLM parses JSON for its dict-valued flags such as `--compilation-config`).
- env = only what xpu-serve sets or overrides: `PYTHONFAULTHANDLER=1` (a native crash in any
  vLLM process prints its Python stack), then the presets in order, then `environment.vars`
  (the user wins). The supervisor adds `XPU_SERVE_INCARNATION` itself at each start.

Secrets: `--api-key` and any flag or variable whose name has a word TOKEN, KEY, SECRET, PASSWORD,
PASSWD or CREDENTIAL (`is_secret_name`) are shown as `***` by `Rendered.redacted_argv()` and
`Rendered.redacted_env()`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xpu_serve.config import Config, EngineConfig, preset_vars

MASK = "***"
"""What a secret value is shown as."""

_SECRET_WORD = re.compile(r".*(?:TOKEN|KEYS?|SECRETS?|PASSWORDS?|PASSWD|CREDENTIALS?)", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """True when a flag or variable name names a secret: one of its words (split on `-`, `_`, `.`)
    is, or ends with, TOKEN, KEY(S), SECRET(S), PASSWORD(S), PASSWD or CREDENTIAL(S), any case.

    "HF_TOKEN", "--api-key", "--api-keys", "OPENAI_APIKEY" are secret; "--max-num-batched-tokens"
    (a count: TOKEN takes no plural for that reason) and
    "--ssl-keyfile" (a path) are not: a plain substring match would hide them and break the
    rendered command line, hence words rather than `xpu_serve.redact`'s substring rule.
    """
    words = [w for w in re.split(r"[-_.]+", name.strip("-")) if w]
    return any(_SECRET_WORD.fullmatch(w) for w in words)


APPEND_FLAGS = frozenset({"middleware"})
"""vLLM flags declared with argparse `action='append'` (vllm/entrypoints/openai/cli_args.py):
a list value repeats the flag once per item instead of `--flag a b`."""

ALWAYS_ENV = {"PYTHONFAULTHANDLER": "1"}
"""Set in every engine environment (before presets and user variables)."""


@dataclass(frozen=True)
class Rendered:
    """The engine invocation.

    Attributes:
        argv: the full command line, argv[0] is the executable (a name looked up on PATH, or a path).
        env: only the variables xpu-serve sets or overrides (merge over the inherited environment
            with `process_env()`), in the order they were applied.
        secret_keys: names of variables in `env` whose values are secret.
        secret_argv: indices into `argv` of values that are secret (the item after `--api-key`...).
        head: argv[:head] is `engine.command` (plus the positional model): `shell()` keeps it on
            one line.
    """

    argv: list[str]
    env: dict[str, str]
    secret_keys: frozenset[str] = field(default_factory=frozenset)
    secret_argv: frozenset[int] = field(default_factory=frozenset)
    head: int = 0

    def redacted_argv(self) -> list[str]:
        """`argv` with every secret value replaced by `***`."""
        return [MASK if i in self.secret_argv else a for i, a in enumerate(self.argv)]

    def redacted_env(self) -> dict[str, str]:
        """`env` with every secret value replaced by `***`."""
        return {k: (MASK if k in self.secret_keys else v) for k, v in self.env.items()}

    def process_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The complete environment to exec the engine with: `base` (default os.environ) + `env`."""
        merged = dict(os.environ if base is None else base)
        merged.update(self.env)
        return merged

    def shell(self) -> str:
        """A POSIX shell snippet, secrets as `***`: one `NAME=value \\` line per variable, then the
        quoted argv, one item or `--flag value` pair per line."""
        lines = [f"{k}={shlex.quote(v)} \\" for k, v in self.redacted_env().items()]
        argv = self.redacted_argv()
        # The command (and a positional model) stays on one line; each flag starts a line.
        i = self.head
        while i < len(argv) and not argv[i].startswith("-"):
            i += 1
        head = argv[:i]
        parts: list[list[str]] = [head]
        for a in argv[i:]:
            if a.startswith("-"):
                parts.append([a])
            else:
                parts[-1].append(a)
        rendered = [" ".join(shlex.quote(a) for a in p) for p in parts if p]
        lines += [r + " \\" for r in rendered[:-1]] + rendered[-1:]
        return "\n".join(lines) + "\n"


def _value(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def group_flags(cfg: Config) -> list[str]:
    """vLLM's multi-node flags for `cfg.group` (none without a group): `--nnodes N --node-rank R
    --master-addr A --master-port P --distributed-executor-backend mp`, then `--headless` on a
    follower. The mp backend: the one with `--nnodes` support (vllm/config/parallel.py); Ray's
    `check_health` assumes healthy workers, and the CPU platform has no Ray."""
    g = cfg.group
    if g is None:
        return []
    flags = ["--nnodes", str(g.nnodes), "--node-rank", str(g.node_rank), "--master-addr", g.master_addr,
             "--master-port", str(g.master_port), "--distributed-executor-backend", "mp"]
    return flags + (["--headless"] if g.role == "follower" else [])


class _Argv:
    """The argv being built and the indexes of its secret values."""

    def __init__(self, head: list[str]):
        self.argv = list(head)
        self.secret: set[int] = set()

    def add(self, flag: str, value: Any = None, *, is_secret: bool = False) -> None:
        """`flag`, then `value` rendered (a secret when `is_secret` or the flag's name says so)."""
        self.argv.append(flag)
        if value is not None:
            self.argv.append(_value(value))
            if is_secret or is_secret_name(flag):
                self.secret.add(len(self.argv) - 1)


def render(cfg: Config) -> Rendered:
    """Turn a validated config into the engine's argv and environment (rules in the module docstring).

    Raises:
        KeyError: an unknown preset name (not possible for a config from `load_config`, which
            rejects it with its line).
    """
    e = cfg.engine
    out = _Argv(e.command)
    if e.model_arg == "flag":
        out.add("--model", e.model)
    else:
        out.argv.append(e.model)
    head = len(e.command) + (e.model_arg == "positional")
    _typed_flags(e, out)
    out.argv += group_flags(cfg)
    _extra_args(e.args, out)
    env = _engine_env(cfg)
    secret_keys = frozenset(k for k in env if is_secret_name(k))
    return Rendered(
        argv=out.argv, env=env, secret_keys=secret_keys, secret_argv=frozenset(out.secret), head=head
    )


def _typed_flags(e: EngineConfig, out: _Argv) -> None:
    """The flags of the engine section's own keys, in a fixed order."""
    if e.served_model_name is not None:
        out.add("--served-model-name", e.served_model_name)
    out.add("--tensor-parallel-size", e.tensor_parallel_size)
    out.add("--host", e.host)
    out.add("--port", e.port)
    for name in (
        "dtype",
        "max_model_len",
        "gpu_memory_utilization",
        "quantization",
        "block_size",
        "max_num_batched_tokens",
    ):
        v = getattr(e, name)
        if v is not None:
            out.add("--" + name.replace("_", "-"), v)
    if e.enforce_eager:
        out.add("--enforce-eager")
    if e.trust_remote_code:
        out.add("--trust-remote-code")


def _extra_args(args: dict[str, Any], out: _Argv) -> None:
    """`engine.args` in the file's order: True a bare flag, False `--no-FLAG`, None nothing, a
    list one flag per item for APPEND_FLAGS (else the flag once, then the items)."""
    for key, v in args.items():
        name = key.lstrip("-").replace("_", "-")
        flag = "--" + name
        if v is None:
            continue
        if v is True:
            out.add(flag)
        elif v is False:
            out.add("--no-" + name)
        elif isinstance(v, list):
            if name in APPEND_FLAGS:
                for item in v:
                    out.add(flag, item)
            else:
                out.argv.append(flag)
                for item in v:
                    out.argv.append(_value(item))
                    if is_secret_name(flag):
                        out.secret.add(len(out.argv) - 1)
        else:
            out.add(flag, v)


def _engine_env(cfg: Config) -> dict[str, str]:
    """ALWAYS_ENV, then the presets' variables, then `environment.vars`, then VLLM_API_KEY."""
    env: dict[str, str] = dict(ALWAYS_ENV)
    for preset in cfg.environment.presets:
        env.update(preset_vars(preset))
    env.update(cfg.environment.vars)
    if cfg.engine.api_key is not None:
        # in the engine's environment, never on its argv: /proc/PID/cmdline is readable by every
        # local user, /proc/PID/environ only by its owner (vllm/envs.py VLLM_API_KEY; the API
        # server uses `args.api_key or envs.VLLM_API_KEY`)
        env["VLLM_API_KEY"] = cfg.engine.api_key
    return env
