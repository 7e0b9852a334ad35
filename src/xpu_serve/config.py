"""The YAML config schema (pydantic v2) and its loader.

`load_config(path)` reads one YAML file, substitutes `${VAR}` / `${VAR:-default}` in string values
from the environment, validates it against `Config` and returns it; every problem becomes one line
"FILE:LINE: key.path: message" naming the YAML line of the offending key, collected in
`ConfigError.problems`. Field names here are the contract other modules use; rename only with care.

Hostile input gets the same one line: the file is capped at MAX_FILE_BYTES, the YAML
composer counts nodes (aliases at the full size of their anchor: MAX_NODES), nesting (MAX_DEPTH)
and integer digits (MAX_INT_DIGITS), refuses recursive aliases; every number has an upper bound
(durations MAX_DURATION_S, finite); ints, floats and bools are strict (a bool is not an int, a
string is not a number unless `${VAR}` produced it); NUL characters and malformed `${` are errors.

`python -m xpu_serve.config --reference` prints the config reference in the README (generated from
the field descriptions below; tests/test_readme.py keeps the two equal).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

from annotated_types import Ge, Gt, Le
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

# --------------------------------------------------------------------------- limits
# Hostile or broken input must end in one line and exit 2, fast and in bounded memory.
# A real config is a few KB, a few hundred YAML nodes, nested 3-6 levels.

MAX_FILE_BYTES = 1024 * 1024
# a config path that is a FIFO (a named pipe nobody writes to): seconds to wait for its data
FIFO_WAIT_S = 10.0
"""A config file larger than this (1 MiB) is refused before parsing."""
MAX_NODES = 10_000
"""YAML nodes in the document, every use of an alias counted with the full size of its anchor
(this is what stops a "billion laughs" alias bomb, and bounds the parse time of any file)."""
MAX_DEPTH = 64
"""Nesting levels of mappings and sequences (deeper input would exhaust Python's recursion)."""
MAX_INT_DIGITS = 100
"""Digits of an integer literal (Python refuses to parse more than 4300)."""
MAX_PROBLEMS = 20
"""At most this many problem lines (the last one says how many more there were)."""
MAX_DURATION_S = 30 * 86400
"""Upper bound of every duration field: 30 days, in seconds (also rejects `.inf` and 1e400)."""
MAX_TP = 64
"""Upper bound of `engine.tensor_parallel_size`: vLLM's tensor parallelism spans the GPUs of one
host (more hosts use pipeline/data parallelism or Ray); the largest single hosts have 8-16 GPUs,
an Arc Pro B60 box 4-8. 64 leaves room, and keeps per-rank work in the supervisor small."""
MAX_TOKENS = 2**31 - 1
"""Upper bound of token counts (`max_model_len`, `max_num_batched_tokens`): int32, as vLLM's
tensors index tokens."""
MAX_COUNT = 10_000
"""Upper bound of small counts (`max_failures`, `health.failures`, `bundles.keep`)."""
MAX_GROUP_NODES = 64
"""Upper bound of `group.nnodes`: hosts in one vLLM multi-node group (a 16-node group of 8-GPU
hosts is already a rack; the head keeps one membership record per node)."""
MIN_SECRET_CHARS = 16
"""Shortest `group.secret`, characters: the HMAC-SHA256 key of the group channel."""


class _FromEnv(str):
    """A string value that `${VAR}` interpolation produced: environment values are always strings,
    so a number or boolean field accepts it when it parses (`port: "${PORT:-8100}"`). A string
    written as such in the file is not a number."""


def _env_int(v: Any) -> Any:
    if isinstance(v, _FromEnv) and re.fullmatch(r"\s*[+-]?[0-9]{1,100}\s*", v):
        return int(v)
    return v


def _env_float(v: Any) -> Any:
    if isinstance(v, _FromEnv) and re.fullmatch(
        r"\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*", v
    ):
        return float(v) if len(v) <= 64 else v
    return v


def _env_bool(v: Any) -> Any:
    if isinstance(v, _FromEnv):
        return {"true": True, "1": True, "false": False, "0": False}.get(v.strip().lower(), v)
    return v


_Int = Annotated[int, Strict(), BeforeValidator(_env_int)]
"""An integer: not a bool, not a float, not a string unless it came from `${VAR}`."""
_Float = Annotated[float, Strict(), AllowInfNan(False), BeforeValidator(_env_float)]
"""A finite number: not a bool, not a string unless it came from `${VAR}`; an int is fine."""
Seconds = Annotated[_Float, Gt(0), Le(MAX_DURATION_S)]
SecondsOrZero = Annotated[_Float, Ge(0), Le(MAX_DURATION_S)]
TPSize = Annotated[_Int, Gt(0), Le(MAX_TP)]
Port = Annotated[_Int, Ge(1), Le(65535)]
Tokens = Annotated[_Int, Gt(0), Le(MAX_TOKENS)]
BlockSize = Annotated[_Int, Gt(0), Le(1024)]
Count = Annotated[_Int, Gt(0), Le(MAX_COUNT)]
Bool = Annotated[bool, Strict(), BeforeValidator(_env_bool)]
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
Command = Annotated[list[NonEmptyStr], Field(min_length=1)]

# --------------------------------------------------------------------------- presets (data)


@lru_cache(maxsize=1)
def env_presets() -> dict[str, dict[str, Any]]:
    """The environment presets from `xpu_serve/data/env_presets.yaml`.

    Returns:
        preset name -> {"description": str, "vars": {NAME: {"value": str, "what": str,
        "source": str}}}, in file order.
    """
    from xpu_serve.yamldata import load_data

    text = resources.files("xpu_serve").joinpath("data/env_presets.yaml").read_text(encoding="utf-8")
    data = load_data(text) or {}
    return {str(k): v for k, v in data.items()}


def preset_vars(name: str) -> dict[str, str]:
    """NAME -> value of one preset, in file order. Raises KeyError for an unknown preset."""
    return {k: str(v["value"]) for k, v in env_presets()[name]["vars"].items()}


def _known_preset(name: str) -> str:
    presets = env_presets()
    if name not in presets:
        import difflib  # (only for a bad name: the supervisor keeps what it imports)

        close = difflib.get_close_matches(name, list(presets), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown preset {_shown(name)}{hint}; known: {', '.join(presets)}")
    return name


def _env_value(v: Any) -> Any:
    """Environment values are strings; YAML numbers are accepted and written as in the file."""
    if isinstance(v, bool):
        raise ValueError('a boolean is ambiguous as an environment value: quote it, e.g. "1"')
    if isinstance(v, (int, float)):
        return str(v)
    return v


# --------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Short options vLLM's parser accepts, for a clear error when one is used as an `engine.args` key.
_SHORT_FLAGS = {
    "tp": "tensor-parallel-size",
    "pp": "pipeline-parallel-size",
    "dp": "data-parallel-size",
    "q": "quantization",
}


class _KeyProblem(ValueError):
    """A problem with one key of a mapping field (or a key path below the model that raised it,
    as a tuple): reported at that key's line."""

    def __init__(self, key: str | tuple[str, ...], message: str):
        super().__init__(message)
        self.key = key

    @property
    def keys(self) -> tuple[str, ...]:
        return self.key if isinstance(self.key, tuple) else (self.key,)


def _check_args(args: dict[str, Any]) -> dict[str, Any]:
    typed = {name.replace("_", "-") for name in EngineConfig.model_fields if name not in ("command", "args")}
    typed.add("model")
    for key, value in args.items():
        flag = key.lstrip("-").replace("_", "-")
        if not flag or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", flag):
            raise _KeyProblem(key, "not a vLLM flag name (write it like disable-log-requests)")
        if flag in _SHORT_FLAGS:
            raise _KeyProblem(key, f"a short option; write its long name {_SHORT_FLAGS[flag]!r}")
        if flag in typed:
            raise _KeyProblem(key, f"has its own key: use engine.{flag.replace('-', '_')}")
        if flag in GROUP_FLAGS:
            own = "group.role" if flag in ("headless", "distributed-executor-backend") else f"group.{flag.replace('-', '_')}"
            raise _KeyProblem(key, f"set by the group section: use {own}")
        if isinstance(value, list) and any(isinstance(x, (dict, list)) for x in value):
            raise _KeyProblem(key, "list items must be scalars")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise _KeyProblem(key, f"must be a finite number, got {item}")
    # plain str again where a value came from `${VAR}` (see _FromEnv)
    return {
        k: [str(x) if isinstance(x, _FromEnv) else x for x in v]
        if isinstance(v, list)
        else (str(v) if isinstance(v, _FromEnv) else v)
        for k, v in args.items()
    }


_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?"
)


def _check_host(v: str) -> str:
    """An IP address (ipaddress: IPv4, IPv6 without brackets, an IPv6 scope) or a host name of
    dot-separated labels of 1-63 letters, digits, '-' and '_' (RFC 1123; '_' as resolvers allow),
    253 characters at most. Whether it resolves is a property of the host: `check` and `up` say."""
    import ipaddress

    try:
        ipaddress.ip_address(v)
        return v
    except ValueError:
        pass
    if not _HOSTNAME_RE.fullmatch(v):
        raise ValueError(f"must be a host name or an IP address, got {_shown(v)}")
    return v


class EngineConfig(_Strict):
    """The `vllm serve` invocation. Typed fields render as their vLLM flags; `args` passes the rest."""

    command: Command = Field(
        default_factory=lambda: ["vllm", "serve"],
        description="argv prefix that starts the server, non-empty strings; `${VAR}` allowed (e.g. a venv path)",
    )
    model: NonEmptyStr = Field(description="model directory or hub id (required)")
    model_arg: Literal["positional", "flag"] = Field(
        "positional",
        description="how the model is passed: `positional` (`vllm serve MODEL`, what vLLM "
        "recommends) or `flag` (`--model MODEL`, deprecated by vLLM but still accepted)",
    )
    served_model_name: NonEmptyStr | None = Field(None, description="`--served-model-name`")
    tensor_parallel_size: TPSize = Field(
        1, description="`--tensor-parallel-size` (always rendered; GPUs of one host, hence <= 64; "
        "with `group:`, of the whole group)"
    )
    host: Annotated[str, AfterValidator(_check_host)] = Field(
        "127.0.0.1",
        description="`--host` (always rendered; health checks use it): a host name or IP address; "
        "one that does not resolve makes `up` give up at once (exit 4)",
    )
    port: Port = Field(8000, description="`--port` (always rendered; health checks use it)")
    dtype: NonEmptyStr | None = Field(None, description="`--dtype`")
    max_model_len: Tokens | None = Field(None, description="`--max-model-len`")
    gpu_memory_utilization: _Float | None = Field(None, gt=0, le=1, description="`--gpu-memory-utilization`")
    enforce_eager: Bool = Field(False, description="`--enforce-eager` when true")
    trust_remote_code: Bool = Field(False, description="`--trust-remote-code` when true")
    quantization: NonEmptyStr | None = Field(None, description="`--quantization`")
    block_size: BlockSize | None = Field(None, description="`--block-size`")
    max_num_batched_tokens: Tokens | None = Field(None, description="`--max-num-batched-tokens`")
    api_key: str | None = Field(
        None,
        description="the key clients must send; passed to vLLM as `VLLM_API_KEY` in its environment (never on its command line); write `${VAR}` so it never sits in the file; empty = none; shown as `***`",
    )

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, v: str | None) -> str | None:
        return v or None  # `${KEY:-}` with KEY unset: no key required

    args: Annotated[dict[str, Any], AfterValidator(_check_args)] = Field(
        default_factory=dict,
        description="any other vLLM flag, in order: `name: value` -> `--name value`; `true` -> `--name`; "
        "`false` -> `--no-name`; `null` -> omitted; a list -> `--name a b` (one flag, as argparse "
        "`nargs='+'` expects; `--middleware`, an `append` flag, repeats per item); a mapping -> JSON",
    )


EnvValue = Annotated[str, BeforeValidator(_env_value)]


class EnvironmentConfig(_Strict):
    """Environment of the engine: presets (data, `data/env_presets.yaml`) then `vars`, user wins."""

    presets: list[Annotated[str, AfterValidator(_known_preset)]] = Field(
        default_factory=list, description="names from `data/env_presets.yaml`, applied in order (see Presets)"
    )
    vars: dict[str, EnvValue] = Field(
        default_factory=dict,
        description="NAME: value set for the engine; wins over presets; `PYTHONFAULTHANDLER=1` is always set",
    )

    @field_validator("vars")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise _KeyProblem(name, "not a valid environment variable name")
        return v


class RestartConfig(_Strict):
    """Restart policy: exponential backoff with jitter, reset after a stable period, crash-loop limit."""

    initial_delay_s: Seconds = Field(5.0, description="backoff before the first restart, seconds")
    multiplier: _Float = Field(2.0, ge=1.0, le=100, description="backoff growth per consecutive failure")
    max_delay_s: Seconds = Field(300.0, description="backoff ceiling, seconds")
    stable_after_s: Seconds = Field(600.0, description="healthy this long resets the backoff, seconds")
    max_failures: Count = Field(5, description="this many failures inside the window -> give up (exit 3)")
    failure_window_s: Seconds = Field(1800.0, description="window for `max_failures`, seconds")


class HealthConfig(_Strict):
    """`GET /health` polling (vLLM answers 200 even while hung: progress is watched separately)."""

    interval_s: Seconds = Field(5.0, description="`GET /health` period, seconds")
    timeout_s: Seconds = Field(5.0, description="one `/health` request timeout, seconds")
    failures: Count = Field(3, description="consecutive failed checks that mean unhealthy")


class StartupConfig(_Strict):
    """Start-up limits: a stall (no start-up progress) and an overall deadline, seconds."""

    stall_s: Seconds = Field(600.0, description="no start-up progress for this long -> startup-hang, seconds")
    timeout_s: Seconds = Field(3600.0, description="overall limit to become ready, seconds")


class HangConfig(_Strict):
    """Engine hang watchdog: progress from `/metrics` and log stats, optional canary request."""

    enabled: Bool = Field(True, description="watch for an engine that stops making progress")
    after_s: Seconds = Field(
        90.0, description="no progress with work in flight for this long -> hang, seconds"
    )
    metrics_interval_s: Seconds = Field(5.0, description="`/metrics` poll period, seconds")
    canary: Bool = Field(
        True, description="send a 1-token completion when idle (catches a hang with no request in flight)"
    )
    canary_interval_s: Seconds = Field(60.0, description="canary period, seconds")
    canary_timeout_s: Seconds = Field(30.0, description="canary deadline, seconds")


class StopConfig(_Strict):
    """Stopping the engine: SIGTERM grace and waiting for the port to be released, seconds."""

    grace_s: Seconds = Field(20.0, description="SIGTERM to SIGKILL, seconds")
    port_free_timeout_s: Seconds = Field(
        30.0, description="wait for the port to be free before a restart, seconds"
    )


class SupervisionConfig(_Strict):
    """Everything about keeping the engine alive."""

    restart: RestartConfig = Field(default_factory=RestartConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    startup: StartupConfig = Field(default_factory=StartupConfig)
    hang: HangConfig = Field(default_factory=HangConfig)
    stop: StopConfig = Field(default_factory=StopConfig)


class KernelWatchConfig(_Strict):
    """The kernel log watcher (Xe GPU faults, engine resets, user-mode driver segfault lines)."""

    enabled: Bool = Field(True, description="read the kernel log (GPU faults, segfault lines)")
    source: Literal["auto", "kmsg", "journalctl", "dmesg", "file", "none"] = Field(
        "auto", description="`auto` tries `/dev/kmsg`, then `journalctl -k`, then `dmesg`"
    )
    path: NonEmptyStr | None = Field(None, description="the file to follow for `source: file`")
    lookback_s: Seconds = Field(60.0, description="kernel records this far before a failure count, seconds")
    device_check: Command | None = Field(
        None, description="command that exits 0 once a wedged device answers again (gates a restart)"
    )
    settle_s: SecondsOrZero = Field(
        0.5,
        description="after a crash, wait this long for the kernel's segfault record before the verdict, seconds",
    )


class WatchersConfig(_Strict):
    """Per-incarnation watchers besides the engine's own output."""

    kernel: KernelWatchConfig = Field(default_factory=KernelWatchConfig)


class BundlesConfig(_Strict):
    """Diagnostic bundles written on each incident: retention and size caps (bytes)."""

    keep: Count = Field(20, description="bundles kept in the runtime directory")
    max_bytes: Annotated[_Int, Gt(0), Le(2**40)] = Field(
        2 * 1024**3, description="total size cap of all bundles, bytes (<= 1 TiB)"
    )
    log_cap_bytes: Annotated[_Int, Gt(0), Le(2**32)] = Field(
        64 * 1024**2,
        description="engine log (and devcoredump) kept per bundle, bytes (<= 4 GiB: a devcoredump is read into memory)",
    )
    tar: Bool = Field(False, description="also write each bundle as a .tar.gz")
    collector_timeout_s: Seconds = Field(10.0, description="limit per evidence collector, seconds")
    release_devcoredump: Bool = Field(False, description="free the Xe devcoredump after copying it")


class LogsConfig(_Strict):
    """Retention of the engine's logs, RUNTIME/logs/<N>/ (one folder per incarnation)."""

    keep_incarnations: Count = Field(
        20,
        description="log folders kept (this run's incarnations and earlier runs' `N.prev`), newest "
        "first; the current incarnation and one whose incident has no bundle yet are never removed",
    )
    max_bytes: Annotated[_Int, Gt(0), Le(2**40)] = Field(
        4 * 1024**3,
        description="total size cap of all log folders, bytes (<= 1 TiB); oldest removed first, "
        "with the same exceptions",
    )


def _check_listen(v: str) -> str:
    """HOST:PORT or [IPV6]:PORT, PORT 0-65535 (what integrations.metrics.parse_listen accepts)."""
    host, sep, port = v.rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        raise ValueError(f"must be HOST:PORT with PORT 0-65535, got {_shown(v)}")
    if not host or re.search(r"[\s/]", host) or (host.startswith("[") != host.endswith("]")):
        raise ValueError(f"must be HOST:PORT with a host name or address, got {_shown(v)}")
    return v


def _check_url(v: str) -> str:
    """An absolute http:// or https:// URL with a host (urllib.parse.urlsplit)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(v)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and not re.search(r"\s", v)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"must be an http:// or https:// URL with a host, got {_shown(v)}")
    return v


class MetricsConfig(_Strict):
    """The supervisor's own Prometheus endpoint."""

    enabled: Bool = Field(True, description="serve the supervisor's Prometheus metrics")
    listen: Annotated[str, AfterValidator(_check_listen)] = Field(
        "127.0.0.1:9400", description="HOST:PORT of the metrics endpoint (PORT 0-65535, 0 = any free port)"
    )

    @property
    def port(self) -> int:
        """The metrics endpoint's TCP port (from `listen`; 0 = any free port)."""
        return int(self.listen.rpartition(":")[2])


class WebhookConfig(_Strict):
    """Incident notification by HTTP POST."""

    url: Annotated[str, AfterValidator(_check_url)] | None = Field(
        None, description="POST each incident summary here (JSON); an http:// or https:// URL"
    )
    timeout_s: Seconds = Field(5.0, description="webhook request timeout, seconds")


GROUP_FLAGS = ("nnodes", "node-rank", "master-addr", "master-port", "headless", "distributed-executor-backend")
"""vLLM's multi-node flags (vllm/config/parallel.py `nnodes`, `node_rank`, `master_addr`,
`master_port`; vllm/entrypoints/launchers/cli_args.py `--headless`), rendered from `group:`."""


class GroupConfig(_Strict):
    """One host of a vLLM multi-node group (multiprocessing backend): its role, vLLM's rendezvous
    (`--nnodes --node-rank --master-addr --master-port`) and the supervisors' group channel."""

    role: Literal["head", "follower"] = Field(
        description="`head`: node rank 0, runs the API server and EngineCore, coordinates the group; "
        "`follower`: `vllm serve --headless`, only its local workers"
    )
    nnodes: Annotated[_Int, Ge(2), Le(MAX_GROUP_NODES)] = Field(
        description="`--nnodes`: hosts in the group; `engine.tensor_parallel_size` is the whole "
        "group's and must be a multiple of it"
    )
    node_rank: Annotated[_Int, Ge(0), Le(MAX_GROUP_NODES - 1)] = Field(
        description="`--node-rank`: 0 on the head, 1..nnodes-1 on followers"
    )
    master_addr: Annotated[str, AfterValidator(_check_host)] = Field(
        description="`--master-addr`: the head's address every node reaches, on the head too (vLLM's "
        "default 127.0.0.1 holds only when every node is this host)",
    )
    master_port: Port = Field(29501, description="`--master-port`: vLLM's rendezvous port on the head")
    peer_timeout_s: Seconds = Field(
        10.0,
        description="a node not heard from for this long is lost (the head's view of a follower, a "
        "follower's view of the head), seconds",
    )
    heartbeat_interval_s: Seconds = Field(
        1.0, description="follower -> head heartbeat period, seconds (at most a third of `peer_timeout_s`)"
    )
    listen: Annotated[str, AfterValidator(_check_listen)] = Field(
        "0.0.0.0:29600",
        description="HOST:PORT of the group channel: where the head listens; followers reach it at "
        "`master_addr` and this PORT (not 0)",
    )
    secret: str = Field(
        description="shared key of the group channel (HMAC-SHA256), the same on every node, at "
        f"least {MIN_SECRET_CHARS} characters; write `${{VAR}}`; never on a command line, shown as "
        "`***`"
    )

    @field_validator("secret")
    @classmethod
    def _long_secret(cls, v: str) -> str:
        if len(v) < MIN_SECRET_CHARS:
            raise ValueError(
                f"must be at least {MIN_SECRET_CHARS} characters, got {len(v)} "
                "(e.g. `openssl rand -hex 32` in an environment variable, then `${VAR}`)"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> GroupConfig:
        if self.role == "head" and self.node_rank != 0:
            raise _KeyProblem("node_rank", f"the head must be node_rank 0, got {self.node_rank}")
        if self.role == "follower" and self.node_rank == 0:
            raise _KeyProblem("node_rank", "a follower needs node_rank 1..nnodes-1; 0 is the head")
        if self.node_rank >= self.nnodes:
            raise _KeyProblem("node_rank", f"must be < nnodes ({self.nnodes}), got {self.node_rank}")
        if self.heartbeat_interval_s * 3 > self.peer_timeout_s:
            raise _KeyProblem(
                "heartbeat_interval_s",
                f"must be at most a third of peer_timeout_s ({_num(self.peer_timeout_s)} s), got "
                f"{_num(self.heartbeat_interval_s)}: one late heartbeat would look like a lost node",
            )
        port = self.channel_port
        if port == 0:
            raise _KeyProblem("listen", "the group channel needs a fixed PORT (followers connect to it), got 0")
        if port == self.master_port:
            raise _KeyProblem("listen", f"PORT {port} is group.master_port (vLLM's rendezvous)")
        return self

    @property
    def channel_port(self) -> int:
        """The group channel's TCP port (from `listen`)."""
        return int(self.listen.rpartition(":")[2])

    @property
    def head_url(self) -> str:
        """Base URL of the head's group channel: http://MASTER_ADDR:PORT (IPv6 in brackets)."""
        host = self.master_addr
        return f"http://{f'[{host}]' if ':' in host else host}:{self.channel_port}"


class Config(_Strict):
    """The whole config file."""

    engine: EngineConfig
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    supervision: SupervisionConfig = Field(default_factory=SupervisionConfig)
    watchers: WatchersConfig = Field(default_factory=WatchersConfig)
    bundles: BundlesConfig = Field(default_factory=BundlesConfig)
    logs: LogsConfig = Field(default_factory=LogsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)
    group: GroupConfig | None = Field(None, description="absent: one host (see `group.*` below)")
    runtime_dir: NonEmptyStr = Field(
        "/var/lib/xpu-serve",
        description="state, logs and bundles (relative: to the current directory); "
        "`up --runtime-dir` overrides",
    )
    source_path: Path | None = Field(None, exclude=True)  # the file it was loaded from

    @model_validator(mode="after")
    def _metrics_port_apart(self) -> Config:
        """The metrics listener and the engine cannot share a port: whichever binds second fails."""
        m = self.metrics
        if m.enabled and m.port == self.engine.port:
            raise _KeyProblem(("metrics", "listen"), f"PORT {self.engine.port} is engine.port")
        return self

    @model_validator(mode="after")
    def _group_fits_engine(self) -> Config:
        g, e = self.group, self.engine
        if g is None:
            return self
        pp = e.args.get("pipeline-parallel-size", e.args.get("pipeline_parallel_size", 1))
        world = e.tensor_parallel_size * (pp if isinstance(pp, int) and pp > 0 else 1)
        if world % g.nnodes:
            raise _KeyProblem(
                ("group", "nnodes"),
                f"the group's {world} workers (engine.tensor_parallel_size x pipeline parallel) do not "
                f"split evenly over {g.nnodes} nodes",
            )
        if g.channel_port == e.port:
            raise _KeyProblem(("group", "listen"), f"PORT {e.port} is engine.port")
        return self


# --------------------------------------------------------------------------- errors and loading


class ConfigError(Exception):
    """Invalid config: `problems` holds one "FILE:LINE: key.path: message" string per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


Loc = tuple[str | int, ...]


def _path_str(loc: Loc) -> str:
    """("engine", "command", 0) -> "engine.command[0]"; a key with a control character is shown
    escaped (the message stays one line), a key longer than 60 characters is cut."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = str(part) if str(part).isprintable() else repr(str(part))[1:-1]
            out += ("." if out else "") + (text if len(text) <= 60 else text[:57] + "...")
    return out


def _node_lines(node: Any, loc: Loc, lines: dict[Loc, int], dups: list[tuple[Loc, int]]) -> None:
    """Record the 1-based YAML line of every key and list item under `node` (a yaml.Node)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for knode, vnode in node.value:
            key = knode.value if isinstance(knode, yaml.ScalarNode) else repr(knode.value)
            if key == "<<":  # merge key: lines of merged keys stay at the anchor
                continue
            sub = (*loc, key)
            if key in seen:
                dups.append((sub, knode.start_mark.line + 1))
            seen.add(key)
            lines[sub] = knode.start_mark.line + 1
            _node_lines(vnode, sub, lines, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = (*loc, i)
            lines[sub] = item.start_mark.line + 1
            _node_lines(item, sub, lines, dups)


def _line_of(loc: Loc, lines: dict[Loc, int]) -> int:
    """Line of the deepest existing prefix of `loc` (a missing key is reported at its parent)."""
    for n in range(len(loc), 0, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return 1


_VAR_RE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|(\$\{[^}]{0,30}\}?)")


def builtin_env() -> dict[str, str]:
    """Variables interpolation sees when the environment does not set them: XPU_SERVE_PYTHON =
    the interpreter running xpu-serve (`sys.executable`), so a config's
    `${XPU_SERVE_PYTHON:-python3}` (configs/demo.yaml) finds the installed package, the same for
    `up`, `render` and `check`."""
    return {"XPU_SERVE_PYTHON": sys.executable}


def interpolate(text: str, env: Mapping[str, str] | None = None) -> tuple[str, list[str]]:
    """Substitute `${VAR}` and `${VAR:-default}` in `text` from `env` (default: os.environ, with
    `builtin_env()` for what it does not set).

    `$$` stands for a literal `$`. `${VAR:-default}` uses the default when VAR is unset or empty,
    as in POSIX sh. Returns (new text, names of variables that were unset and had no default).

    Raises:
        ValueError: a malformed reference (`${`, `${A B}`, `${A:x}`...), naming it; write `$${`
            for a literal `${`.
    """
    source = os.environ if env is None else env
    builtins = builtin_env() if env is None else {}
    missing: list[str] = []

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(3) is not None:
            raise ValueError(
                f"malformed variable reference {_shown(m.group(3))}: write ${{NAME}} or ${{NAME:-default}} "
                "(NAME: letters, digits, _), or $${ for a literal ${"
            )
        name, default = m.group(1), m.group(2)
        if default is not None and "${" in default.replace("$${", ""):
            raise ValueError(
                f"nested variable reference in the default of {_shown(m.group(0))}...: not supported; "
                "set the variable or use a plain default"
            )
        value = source.get(name)
        if value is None:
            value = builtins.get(name)
        if value:
            return value
        if default is not None:
            return default
        if value is None:
            missing.append(name)
            return ""
        return value

    return _VAR_RE.sub(sub, text), missing


def variable_references(data: Any, loc: Loc = ()) -> list[tuple[str, str | None, Loc]]:
    """Every `${VAR}` / `${VAR:-default}` in the strings of a parsed (not yet interpolated) YAML
    tree, in document order: (name, default or None, key path). Malformed references are skipped
    (`load_config` reports them)."""
    out: list[tuple[str, str | None, Loc]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += variable_references(v, (*loc, str(k)))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += variable_references(v, (*loc, i))
    elif isinstance(data, str):
        out += [(m.group(1), m.group(2), loc) for m in _VAR_RE.finditer(data) if m.group(1)]
    return out


_NUL = "contains a NUL character: it cannot be passed in a command line or the environment"


def _interpolate_tree(data: Any, loc: Loc, problems: list[tuple[Loc, str]]) -> Any:
    """A copy of `data` with `${...}` substituted in every string (each result a `_FromEnv` when
    a variable was used); unset variables, malformed references and NUL characters (in keys
    or values, before or after substitution) go to `problems` as (loc, message)."""
    if isinstance(data, dict):
        for k in data:
            if isinstance(k, str) and "\0" in k:
                problems.append(((*loc, k), _NUL))
        return {k: _interpolate_tree(v, (*loc, k), problems) for k, v in data.items()}
    if isinstance(data, list):
        return [_interpolate_tree(v, (*loc, i), problems) for i, v in enumerate(data)]
    if isinstance(data, bytes):
        problems.append((loc, "binary values (!!binary) are not supported"))
        return data
    if isinstance(data, str) and "$" in data:
        try:
            new, missing = interpolate(data)
        except ValueError as e:
            problems.append((loc, str(e)))
            return data
        for name in missing:
            problems.append(
                (loc, f"environment variable {name} is not set (set it, or write ${{{name}:-default}})")
            )
        if "\0" in new:
            problems.append((loc, _NUL))
        return _FromEnv(new) if "${" in data.replace("$$", "") else new
    if isinstance(data, str) and "\0" in data:
        problems.append((loc, _NUL))
    return data


def _num(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _shown(v: Any) -> str:
    """A value as YAML would show it (true, null, 'text'), at most 60 characters."""
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    text = repr(str(v) if isinstance(v, str) else v)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: Any) -> str:
    """One short sentence for a pydantic error dict (pydantic_core ErrorDetails)."""
    kind, ctx, msg = err["type"], err.get("ctx") or {}, err["msg"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind == "greater_than":
        return f"must be > {_num(ctx.get('gt'))}"
    if kind == "greater_than_equal":
        return f"must be >= {_num(ctx.get('ge'))}"
    if kind == "less_than_equal":
        return f"must be <= {_num(ctx.get('le'))}"
    if kind == "less_than":
        return f"must be < {_num(ctx.get('lt'))}"
    got = _shown(err.get("input"))
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"must be an integer, got {got}"
    if kind in ("float_parsing", "float_type"):
        return f"must be a number, got {got}"
    if kind == "finite_number":
        return f"must be a finite number, got {got}"
    if kind in ("bool_parsing", "bool_type"):
        return f"must be true or false, got {got}"
    if kind == "string_type":
        return f"must be a string, got {type(err.get('input')).__name__}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping, got {type(err.get('input')).__name__}"
    if kind == "list_type":
        return f"must be a list, got {type(err.get('input')).__name__}"
    if kind in ("too_short", "string_too_short"):
        return "must not be empty"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {err.get('input')!r}"
    if kind == "value_error":
        return str(ctx.get("error", msg))
    return str(msg[0].lower() + msg[1:]) if msg else kind


def _unknown_key_hint(loc: Loc) -> str:
    """' (did you mean X?)' for a misspelt key, from the schema's field names."""
    model: Any = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        sub = _section(getattr(field, "annotation", None))
        if sub is None:
            return ""
        model = sub
    import difflib  # (only for an unknown key: the supervisor keeps what it imports)

    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close and close[0] != "source_path" else ""


class _LimitError(Exception):
    """Input past one of the limits above: `line` (1-based) and `path` (key path) where known."""

    def __init__(self, line: int, path: Loc, message: str):
        super().__init__(message)
        self.line, self.path, self.message = line, path, message


def _safe_loader(text: str) -> Any:
    """A yaml.SafeLoader for `text` that counts nodes (aliases at their anchor's full size) while
    composing, and refuses recursive aliases, nesting past MAX_DEPTH, integers longer than
    MAX_INT_DIGITS and `!!binary`, raising `_LimitError` at once (PyYAML's composer itself expands
    nothing but has no limits: a recursive or exponential alias graph breaks every later walk).

    Raises:
        yaml.YAMLError: as PyYAML (yaml.reader.ReaderError for a NUL or other control character).
    """
    import yaml

    class Loader(yaml.SafeLoader):
        nodes = 0
        path: list[str | int] = []
        sizes: dict[str, int] = {}
        open_anchors: set[str] = set()

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            pushed = parent is not None and index is not None  # index None: a mapping key
            if pushed:
                key = index.value if isinstance(index, yaml.ScalarNode) else index
                self.path.append(key if isinstance(key, (str, int)) else "?")
            try:
                line = event.start_mark.line + 1
                if isinstance(event, yaml.AliasEvent):
                    if event.anchor in self.open_anchors:
                        raise _LimitError(
                            line,
                            tuple(self.path),
                            f"alias *{event.anchor} is inside its own anchor (recursive)",
                        )
                    node = super().compose_node(parent, index)
                    self._count(self.sizes.get(str(event.anchor), 1), line)
                    return node
                if len(self.path) > MAX_DEPTH:
                    raise _LimitError(line, tuple(self.path), f"nested deeper than {MAX_DEPTH} levels")
                anchor, start = event.anchor, self.nodes
                if anchor is not None:
                    self.open_anchors.add(anchor)
                node = super().compose_node(parent, index)
                if anchor is not None:
                    self.open_anchors.discard(anchor)
                if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:binary":
                    raise _LimitError(line, tuple(self.path), "binary values (!!binary) are not supported")
                if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int":
                    digits = sum(c.isdigit() for c in node.value)
                    if digits > MAX_INT_DIGITS:
                        raise _LimitError(
                            line,
                            tuple(self.path),
                            f"integer of {digits} digits; the limit is {MAX_INT_DIGITS}",
                        )
                self._count(1, line)
                if anchor is not None:
                    self.sizes[anchor] = self.nodes - start
                return node
            finally:
                if pushed:
                    self.path.pop()

        def _count(self, n: int, line: int) -> None:
            self.nodes += n
            if self.nodes > MAX_NODES:
                raise _LimitError(
                    line,
                    tuple(self.path),
                    f"more than {MAX_NODES} values in the file (an alias counts as everything its "
                    "anchor holds); a config needs a few hundred",
                )

    loader = Loader(text)
    loader.path, loader.sizes, loader.open_anchors = [], {}, set()
    return loader


def _read_fifo(p: Path) -> bytes:
    """A FIFO's content up to EOF (at most MAX_FILE_BYTES + 1 bytes), waiting at most
    FIFO_WAIT_S seconds for data. `-c <(...)` hands us a pipe whose writer exists; a named FIFO
    nobody writes to would block a plain open() forever. Raises OSError (ETIMEDOUT)."""
    from xpu_serve.fsread import read_fd

    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return read_fd(
            fd, MAX_FILE_BYTES + 1, time.monotonic() + FIFO_WAIT_S,
            f"a FIFO with no data from a writer within {FIFO_WAIT_S:g} s",
        )
    finally:
        os.close(fd)


def _read_limited(p: Path) -> str:
    """The file's text, at most MAX_FILE_BYTES. Raises ConfigError (one line) otherwise."""
    try:
        if stat.S_ISFIFO(os.stat(p).st_mode):
            raw = _read_fifo(p)
            if len(raw) > MAX_FILE_BYTES:
                raise ConfigError([f"{p}: config file is more than {MAX_FILE_BYTES} bytes; the limit is 1 MiB"])
            return raw.decode("utf-8")
        with p.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
            size = os.fstat(f.fileno()).st_size
        if len(raw) > MAX_FILE_BYTES:
            n = f"{size} bytes" if size > MAX_FILE_BYTES else f"more than {MAX_FILE_BYTES} bytes"
            raise ConfigError([f"{p}: config file is {n}; the limit is 1 MiB"])
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError([f"{p}: cannot read config: {reason}"]) from None


def load_config(path: str | Path) -> Config:
    """Load, interpolate and validate a YAML config file.

    `${VAR}` and `${VAR:-default}` in string values are taken from the environment; the result
    keeps the file's path in `Config.source_path`.

    Hostile input is bounded (MAX_FILE_BYTES, MAX_NODES, MAX_DEPTH, MAX_INT_DIGITS): the worst
    files the limits allow load in under 1 s and ~11 MiB of Python heap on a 2-core CI VM
    (bench/bench_config.py); at most MAX_PROBLEMS lines are reported.

    Raises:
        ConfigError: one entry per problem, each "FILE:LINE: key.path: message" (LINE 1-based;
            a file that cannot be read or is too large has no line: "FILE: cannot read config:
            REASON", "FILE: config file is N bytes; the limit is 1 MiB"; a YAML syntax error has
            no key path: "FILE:LINE: malformed YAML: ...").
    """
    p = Path(path)
    text = _read_limited(p)
    data, root = _parse_yaml(p, text)
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise ConfigError(
            [f"{p}:1: the config must be a mapping with at least `engine: {{model: ...}}`, got {got}"]
        )

    lines: dict[Loc, int] = {}
    dups: list[tuple[Loc, int]] = []
    _node_lines(root, (), lines, dups)
    problems: list[tuple[int, str]] = [
        (line, f"{p}:{line}: {_path_str(loc)}: duplicate key") for loc, line in dups
    ]

    interp: list[tuple[Loc, str]] = []
    data = _interpolate_tree(data, (), interp)
    problems += [
        (_line_of(loc, lines), f"{p}:{_line_of(loc, lines)}: {_path_str(loc)}: {msg}") for loc, msg in interp
    ]

    cfg, invalid = _validate(p, data, lines, interp, dups)
    problems += invalid
    if "source_path" in data:
        line = lines.get(("source_path",), 1)
        problems.append((line, f"{p}:{line}: source_path: unknown key"))

    if problems or cfg is None:
        _raise_problems(p, problems)
    cfg.source_path = p
    return cfg


def _parse_yaml(p: Path, text: str) -> tuple[Any, Any]:
    """(data, root node) of the config text under the loader's limits; raises ConfigError with
    one line for a limit hit, a bad character, too deep a nesting or a YAML syntax error."""
    import yaml

    loader = None
    try:
        loader = _safe_loader(text)
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _LimitError as e:
        where = _path_str(e.path)
        where = f" {where if len(where) <= 80 else where[:77] + '...'}:" if where else ""
        raise ConfigError([f"{p}:{e.line}:{where} {e.message}"]) from None
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        col = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        char = e.character if isinstance(e.character, int) else ord(e.character)
        raise ConfigError(
            [f"{p}:{line}: malformed YAML: unacceptable character #x{char:04x} at column {col}: {e.reason}"]
        ) from None
    except RecursionError:  # not expected past the MAX_DEPTH check; one line all the same
        raise ConfigError([f"{p}: malformed YAML: nested too deeply"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = mark.line + 1 if mark is not None else 1
        what = getattr(e, "problem", None) or str(e)
        context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and cmark is not None and cmark.line + 1 != line:
            what += f" ({context} started at line {cmark.line + 1})"
        raise ConfigError([f"{p}:{line}: malformed YAML: {what}"]) from None
    finally:
        if loader is not None:
            loader.dispose()

    return data, root


def _validate(
    p: Path,
    data: dict[str, Any],
    lines: dict[Loc, int],
    interp: list[tuple[Loc, str]],
    dups: list[tuple[Loc, int]],
) -> tuple[Config | None, list[tuple[int, str]]]:
    """(the Config or None, its problems as (line, "FILE:LINE: key.path: message")): pydantic's
    errors, less those already reported as an interpolation problem or a duplicate key."""
    problems: list[tuple[int, str]] = []
    cfg: Config | None = None
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc: Loc = tuple(x for x in err["loc"] if x != "[key]")
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, _KeyProblem):
                loc = (*loc, *cause.keys)
            if any(loc[: len(bad)] == bad for bad, _ in interp):
                continue  # already reported: the unset variable (or NUL...) is the problem
            if any(loc[: len(dup)] == dup for dup, _ in dups):
                continue  # the duplicate key is the problem: its second value hid the first
            if loc and loc[0] == "source_path":
                continue  # reported below: not a key of the file
            msg = _message(err)
            if err["type"] == "extra_forbidden":
                msg += _unknown_key_hint(loc)
            line = _line_of(loc, lines)
            problems.append((line, f"{p}:{line}: {_path_str(loc) or '(top)'}: {msg}"))
    return cfg, problems


def _raise_problems(p: Path, problems: list[tuple[int, str]]) -> NoReturn:
    """ConfigError with the problems in line order, each once, at most MAX_PROBLEMS lines."""
    problems.sort(key=lambda t: t[0])
    lines_out = list(dict.fromkeys(msg for _, msg in problems))
    if len(lines_out) > MAX_PROBLEMS:
        more = len(lines_out) - MAX_PROBLEMS + 1
        lines_out = [*lines_out[: MAX_PROBLEMS - 1], f"{p}: ... and {more} more problems"]
    raise ConfigError(lines_out)


# --------------------------------------------------------------------------- hash


def config_hash(cfg: Config) -> str:
    """sha256 (hex, 64 characters) of the normalized config, for incident records.

    Normalized: every field with its default filled in, keys sorted, JSON; `source_path` is
    left out, and secrets (`engine.api_key`, environment variables and `engine.args` whose name
    looks secret, `group.secret`) are replaced by `***` first, so the hash neither leaks nor changes with a key
    rotation.
    """
    from xpu_serve.vllm_command import MASK, is_secret_name

    data = cfg.model_dump(mode="json")
    if data["engine"].get("api_key") is not None:
        data["engine"]["api_key"] = MASK
    data["engine"]["args"] = {
        k: (MASK if is_secret_name(k) else v) for k, v in data["engine"]["args"].items()
    }
    if data.get("group"):
        data["group"]["secret"] = MASK
    env = data["environment"]["vars"]
    data["environment"]["vars"] = {k: (MASK if is_secret_name(k) else v) for k, v in env.items()}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- reference


_BOUNDS = {"Gt": (">", "gt"), "Ge": (">=", "ge"), "Lt": ("<", "lt"), "Le": ("<=", "le")}


def _type_name(ann: Any, bounds: list[str]) -> str:
    """A readable type ("int or null", "one of 'a', 'b'"); numeric bounds found go to `bounds`."""
    import types
    import typing

    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:
        bounds += [
            f"{_BOUNDS[type(m).__name__][0]} {_num(getattr(m, _BOUNDS[type(m).__name__][1]))}"
            for m in args[1:]
            if type(m).__name__ in _BOUNDS
        ]
        return _type_name(args[0], bounds)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a, bounds) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a, []) for a in args)}]"
    if ann is Any:
        return "any"
    return getattr(ann, "__name__", str(ann))


def _default_str(field: Any) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return ""
    else:
        value = field.default
    return f"`{json.dumps(value)}`"


def _section(ann: Any) -> type[BaseModel] | None:
    """The model of a section field: `M` or an optional `M | None`; None for any other field."""
    import typing

    for a in (ann, *[x for x in typing.get_args(ann) if x is not type(None)]):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _walk_models(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, type[BaseModel]]]:
    yield prefix, model
    for name, field in model.model_fields.items():
        sub = _section(field.annotation)
        if sub is not None:
            yield from _walk_models(sub, f"{prefix}.{name}" if prefix else name)


def reference() -> str:
    """The config reference as Markdown (README "Config reference"), generated from the schema."""
    out: list[str] = []
    for prefix, model in _walk_models(Config, ""):
        rows = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if name == "source_path" or _section(ann) is not None:
                continue
            key = f"{prefix}.{name}" if prefix else name
            bounds: list[str] = []
            typ = _type_name(ann, bounds)
            bounds += [
                f"{_BOUNDS[type(m).__name__][0]} {_num(getattr(m, _BOUNDS[type(m).__name__][1]))}"
                for m in field.metadata
                if type(m).__name__ in _BOUNDS
            ]
            cons_s = f" ({', '.join(dict.fromkeys(bounds))})" if bounds else ""
            desc = (field.description or "").replace("|", "\\|")
            rows.append(f"| `{key}` | {typ}{cons_s} | {_default_str(field)} | {desc} |")
        if rows:
            out.append(f"### `{prefix or '(top level)'}`\n")
            out.append("| key | type | default | meaning |")
            out.append("| --- | --- | --- | --- |")
            out.extend(rows)
            out.append("")
    out.append("### Presets (`environment.presets`)\n")
    for name, preset in env_presets().items():
        out.append(f"`{name}`: {preset['description'].strip()}\n")
        out.append("| variable | value | what it does | source |")
        out.append("| --- | --- | --- | --- |")
        for var, spec in preset["vars"].items():
            cells = [
                str(spec[k]).strip().replace("\n", " ").replace("|", "\\|")
                for k in ("value", "what", "source")
            ]
            out.append(f"| `{var}` | `{cells[0]}` | {cells[1]} | {cells[2]} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _main(argv: list[str]) -> int:
    if argv == ["--reference"]:
        sys.stdout.write(reference())
        return 0
    print("usage: python -m xpu_serve.config --reference", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main(sys.argv[1:]))
