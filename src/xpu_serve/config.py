"""The YAML config schema (pydantic v2) and its loader.

DRAFT schema by the founding session; the foundation work (issue 2) owns this module:
validation errors that name file, YAML line and key path, `${VAR}` interpolation, presets.
Field names here are the contract other modules use; rename only with care.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineConfig(_Strict):
    """The `vllm serve` invocation. Typed fields render as their vLLM flags; `args` passes the rest."""

    command: list[str] = Field(default_factory=lambda: ["vllm", "serve"])
    model: str
    served_model_name: str | None = None
    tensor_parallel_size: PositiveInt = 1
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    dtype: str | None = None
    max_model_len: PositiveInt | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enforce_eager: bool = False
    trust_remote_code: bool = False
    quantization: str | None = None
    block_size: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    api_key: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)  # other vLLM flags, in order


class EnvironmentConfig(_Strict):
    """Environment of the engine: presets (data, `data/env_presets.yaml`) then `vars`, user wins."""

    presets: list[str] = Field(default_factory=list)
    vars: dict[str, str] = Field(default_factory=dict)


class RestartConfig(_Strict):
    initial_delay_s: PositiveFloat = 5.0
    multiplier: float = Field(2.0, ge=1.0)
    max_delay_s: PositiveFloat = 300.0
    stable_after_s: PositiveFloat = 600.0
    max_failures: PositiveInt = 5
    failure_window_s: PositiveFloat = 1800.0


class HealthConfig(_Strict):
    interval_s: PositiveFloat = 5.0
    timeout_s: PositiveFloat = 5.0
    failures: PositiveInt = 3


class StartupConfig(_Strict):
    stall_s: PositiveFloat = 600.0  # no start-up progress for this long -> startup-hang
    timeout_s: PositiveFloat = 3600.0  # overall limit to become ready


class HangConfig(_Strict):
    enabled: bool = True
    after_s: PositiveFloat = 90.0
    metrics_interval_s: PositiveFloat = 5.0
    canary: bool = False
    canary_interval_s: PositiveFloat = 60.0
    canary_timeout_s: PositiveFloat = 30.0


class StopConfig(_Strict):
    grace_s: PositiveFloat = 20.0
    port_free_timeout_s: PositiveFloat = 30.0


class SupervisionConfig(_Strict):
    restart: RestartConfig = Field(default_factory=RestartConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    startup: StartupConfig = Field(default_factory=StartupConfig)
    hang: HangConfig = Field(default_factory=HangConfig)
    stop: StopConfig = Field(default_factory=StopConfig)


class KernelWatchConfig(_Strict):
    enabled: bool = True
    source: Literal["auto", "kmsg", "journalctl", "dmesg", "file", "none"] = "auto"
    path: str | None = None  # for source: file
    lookback_s: PositiveFloat = 60.0
    device_check: list[str] | None = None  # command that exits 0 once a wedged device answers


class WatchersConfig(_Strict):
    kernel: KernelWatchConfig = Field(default_factory=KernelWatchConfig)


class BundlesConfig(_Strict):
    keep: PositiveInt = 20
    max_bytes: PositiveInt = 2 * 1024**3
    log_cap_bytes: PositiveInt = 64 * 1024**2
    tar: bool = False
    collector_timeout_s: PositiveFloat = 10.0
    release_devcoredump: bool = False


class MetricsConfig(_Strict):
    enabled: bool = True
    listen: str = "127.0.0.1:9400"


class WebhookConfig(_Strict):
    url: str | None = None
    timeout_s: PositiveFloat = 5.0


class Config(_Strict):
    """The whole config file."""

    engine: EngineConfig
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    supervision: SupervisionConfig = Field(default_factory=SupervisionConfig)
    watchers: WatchersConfig = Field(default_factory=WatchersConfig)
    bundles: BundlesConfig = Field(default_factory=BundlesConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)
    runtime_dir: str = "/var/lib/xpu-serve"
    source_path: Path | None = Field(None, exclude=True)  # the file it was loaded from


class ConfigError(Exception):
    """Invalid config: `problems` holds one "FILE:LINE: key.path: message" string per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def load_config(path: str | Path) -> Config:
    """Load and validate a YAML config file.

    Raises:
        ConfigError: one entry per problem, each "FILE:LINE: key.path: message".
    """
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError([f"{p}: cannot read config: {e.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"{p}: malformed YAML: {e}"]) from None
    try:
        cfg = Config.model_validate(data)
    except Exception as e:  # pydantic.ValidationError
        raise ConfigError([f"{p}: {e}"]) from None
    cfg.source_path = p
    return cfg
