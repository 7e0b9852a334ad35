"""Render a systemd service unit for `xpu-serve up -c CONFIG` (what `xpu-serve unit` prints).

Choices, each for a reason (systemd.service(5), systemd.kill(5), systemd.unit(5)):
- `Type=notify`, `NotifyAccess=main`: `up` sends READY=1 when the server first answers, so units
  ordered after this one start only once vLLM really serves.
- `TimeoutStartSec` covers the config's whole start-up limit plus a margin; `up` also sends
  EXTEND_TIMEOUT_USEC while the model loads.
- `WatchdogSec=30`: `up` pings WATCHDOG=1 from its own event loop, so a hung supervisor is restarted.
- `KillMode=mixed`: on stop, SIGTERM goes to the supervisor alone, which stops its vLLM tree in
  order (bundle first, then SIGTERM, grace, SIGKILL, sweep); anything still in the cgroup after
  `TimeoutStopSec` (e.g. after a supervisor crash) gets SIGKILL from systemd.
- `Restart=on-failure` with `RestartSec` = the config's backoff cap: the supervisor does the fast
  restarts of vLLM itself; systemd restarts only the supervisor, after it gave up on a crash loop
  (exit 3) or crashed, so the two backoffs never stack into a storm. `StartLimitIntervalSec` is
  longer than `StartLimitBurst` x (`RestartSec` + start timeout), so the limit can really trip.
- `RestartPreventExitStatus=4`: exit 4 means a failure a restart cannot fix (config error).
- `SupplementaryGroups=render video`: access to /dev/dri render nodes without running as root.
- `WorkingDirectory=` the directory `unit` was run in: relative paths in the config (runtime_dir,
  model, engine command) resolve as they did when the operator ran `up` there by hand (systemd's
  default is `/`).
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from xpu_serve import exitcodes

WATCHDOG_SEC = 30


def _unit_path(p: Path) -> str:
    """A path as a unit-file value: "%" escaped as "%%" (a specifier otherwise, systemd.unit(5))."""
    return str(p).replace("%", "%%")
START_LIMIT_BURST = 3


def render_unit(
    config: Any, config_path: Path, exec_path: str, user: str | None = None, cwd: Path | None = None
) -> str:
    """Return the text of a `.service` unit.

    Args:
        config: a loaded `xpu_serve.config.Config`.
        config_path: the config file (made absolute in `ExecStart=`).
        exec_path: absolute path of the `xpu-serve` executable.
        user: run as this user (with the render/video groups), or root when None.
        cwd: `WorkingDirectory=` (default: the current directory, made absolute).
    """
    sup = config.supervision
    start_timeout = int(math.ceil(sup.startup.timeout_s + 120))
    stop_timeout = int(math.ceil(sup.stop.grace_s + config.bundles.collector_timeout_s * 3 + 30))
    restart_sec = int(math.ceil(sup.restart.max_delay_s))
    limit_interval = START_LIMIT_BURST * (restart_sec + start_timeout) + 60
    name = config.engine.served_model_name or Path(config.engine.model).name or config.engine.model
    runtime_dir = str(config.runtime_dir)
    cmd = [exec_path, "up", "-c", str(config_path.resolve())]
    lines = [
        "[Unit]",
        f"Description=xpu-serve: vLLM {name} (tensor parallel {config.engine.tensor_parallel_size})",
        "After=network-online.target",
        "Wants=network-online.target",
        f"StartLimitIntervalSec={limit_interval}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=" + " ".join(shlex.quote(c) for c in cmd),
        f"WorkingDirectory={_unit_path(Path(cwd or Path.cwd()).resolve())}",
        "ExecReload=/bin/kill -HUP $MAINPID",
        f"TimeoutStartSec={start_timeout}",
        f"TimeoutStopSec={stop_timeout}",
        f"WatchdogSec={WATCHDOG_SEC}",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        "Restart=on-failure",
        f"RestartSec={restart_sec}",
        f"RestartPreventExitStatus={exitcodes.GAVE_UP_AT_ONCE}",
        "SupplementaryGroups=render video",
        "LimitNOFILE=65536",
        "LimitMEMLOCK=infinity",
    ]
    if user:
        lines.append(f"User={user}")
    if runtime_dir == "/var/lib/xpu-serve":
        lines.append("StateDirectory=xpu-serve")
        lines.append("StateDirectoryMode=0700")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)
