"""Render a systemd service unit for `xpu-serve up -c CONFIG` (what `xpu-serve unit` prints).

Choices, each for a reason (systemd.service(5), systemd.exec(5), systemd.kill(5), systemd.unit(5));
tests/e2e/test_systemd_real.py checks them under a real systemd 252:
- `Type=notify`, `NotifyAccess=main`: `up` sends READY=1 when the server first answers, so units
  ordered after this one start only once vLLM really serves. `up` sends STOPPING=1 only when it
  itself shuts down: an in-place restart of vLLM keeps the unit active/running (NRestarts 0).
- `TimeoutStartSec` covers the config's whole start-up limit plus a margin; `up` also sends
  EXTEND_TIMEOUT_USEC while the model loads.
- `WatchdogSec=30` (`unit --watchdog-sec N` to change it): `up` pings WATCHDOG=1 from its own
  event loop, so a hung (or SIGSTOPped) supervisor is killed and the unit restarted.
- `KillMode=mixed`: on stop, SIGTERM goes to the supervisor alone, which stops its vLLM tree in
  order (bundle first, then SIGTERM, grace, SIGKILL, sweep); anything still in the cgroup after
  `TimeoutStopSec` (e.g. after a supervisor crash) gets SIGKILL from systemd.
- `OOMPolicy=continue`: systemd's default for a service is `stop` when the kernel OOM killer kills
  any process of the cgroup; that would stop the whole unit for one worker killed by a host OOM,
  which is an incident for the supervisor to diagnose (kmsg) and restart in place.
- `Restart=on-failure` with `RestartSec` = the config's backoff cap: the supervisor does the fast
  restarts of vLLM itself; systemd restarts only the supervisor, after it gave up on a crash loop
  (exit 3), crashed or stopped answering the watchdog, so the two backoffs never stack into a
  storm. `StartLimitIntervalSec` is longer than `StartLimitBurst` x (`RestartSec` + start
  timeout), so the limit can really trip.
- `RestartPreventExitStatus=2 4 5`: failures a restart of the supervisor cannot fix. 2 (USAGE):
  the config is invalid or unreadable; 4 (GAVE_UP_AT_ONCE): a config error in the engine or a
  port owned by another program; 5 (LOCKED): another supervisor (a manual `up` outside this
  unit) holds the runtime directory's lock. It holds it as long as it runs, so restarting every
  RestartSec only fills the journal until the start limit trips; an old supervisor of this
  unit cannot be the holder, since systemd kills the whole cgroup before a restart.
- No `ExecReload=`: `up` has nothing it can re-read in place (the engine's arguments and
  environment are fixed for the life of a vLLM process), and SIGHUP is a planned restart of
  vLLM that drops every request in flight. Offered as `systemctl reload`, that would surprise;
  `systemctl reload` is refused instead ("Job type reload is not applicable"). Use
  `systemctl restart` to apply a changed config (a new supervisor reads it), or
  `systemctl kill -s HUP UNIT` for an in-place planned restart (not counted as a failure).
- `SupplementaryGroups=` lists those of `render` and `video` that exist on the host `unit` runs
  on (access to /dev/dri render nodes without root), and is omitted when neither exists: systemd
  refuses to start a service naming an unknown group (status=216/GROUP).
- `EnvironmentFile=-/etc/xpu-serve/<config file stem>.env` (`unit --env-file PATH` to change
  it; "-": optional): systemd starts services with a clean environment, so a `${VAR}` the config
  uses without a default must be set there (`unit` warns for each, see `env_file_warnings`).
- `WorkingDirectory=` the directory `unit` was run in: relative paths in the config (runtime_dir,
  model, engine command) resolve as they did when the operator ran `up` there by hand (systemd's
  default is `/`).

Values are escaped for systemd, never for a shell (systemd.unit(5) "Specifiers",
systemd.service(5) "Command lines"): `%` is a specifier, `$` an environment substitution in
`ExecStart=`, whose words are double-quoted with C escapes (for a backslash, a quote, a
newline, `xNN` for a control character); a newline would end the setting and start another,
so `Description=` gets it as a space, and a path setting (`WorkingDirectory=`,
`EnvironmentFile=`) or `User=` holding a control character is refused (UnitError): those
settings have no escape for one. tests/e2e/test_systemd_real.py checks the argv systemd passes.
"""

from __future__ import annotations

import grp
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from xpu_serve import exitcodes

WATCHDOG_SEC = 30
START_LIMIT_BURST = 3
DEVICE_GROUPS = ("render", "video")
ENV_FILE_DIR = Path("/etc/xpu-serve")
# Set by systemd itself in a system service's environment (systemd.exec(5), "Environment
# variables in spawned processes"); HOME, USER, LOGNAME and SHELL only when User= is set.
SYSTEMD_SETS = frozenset(
    {"PATH", "LANG", "INVOCATION_ID", "JOURNAL_STREAM", "NOTIFY_SOCKET", "WATCHDOG_PID",
     "WATCHDOG_USEC", "SYSTEMD_EXEC_PID", "MANAGERPID", "STATE_DIRECTORY"}
)
USER_VARS = frozenset({"HOME", "USER", "LOGNAME", "SHELL"})


class UnitError(ValueError):
    """A value that cannot be written into a unit file (message names the setting)."""


def _no_control(setting: str, text: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise UnitError(f"{setting}: {text!r} holds a control character (newline, tab...): systemd has no escape for it")
    return text


def _unit_path(setting: str, p: Path | str) -> str:
    """A path as the value of `setting`: "%" escaped as "%%" (a specifier otherwise); UnitError
    for a control character."""
    return _no_control(setting, str(p)).replace("%", "%%")


def _unit_text(text: str) -> str:
    """Free text (Description=) on one line: whitespace runs and control characters become one
    space, "%" is escaped."""
    return " ".join("".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in text).split()).replace("%", "%%")


_EXEC_ESCAPES = {"\\": "\\\\", '"': '\\"', "%": "%%", "$": "$$", "\n": "\\n"}


_PLAIN_WORD = re.compile(r"[\w/.:,+=@-]+", re.ASCII)


def exec_word(word: str) -> str:
    """One argument of `ExecStart=` such that systemd passes exactly `word`: as it is when it
    holds only `[A-Za-z0-9_/.:,+=@-]`, else double-quoted with escapes."""
    if _PLAIN_WORD.fullmatch(word):
        return word
    out = (_EXEC_ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c) for c in word)
    return '"' + "".join(out) + '"'


def host_groups(names: Iterable[str] = DEVICE_GROUPS, lookup: Callable[[str], Any] = grp.getgrnam) -> list[str]:
    """Those of `names` that exist in this host's group database (`lookup` raises KeyError otherwise)."""
    out = []
    for n in names:
        try:
            lookup(n)
        except KeyError:
            continue
        out.append(n)
    return out


def default_env_file(config_path: Path) -> Path:
    """`/etc/xpu-serve/<config file stem>.env`, e.g. /etc/xpu-serve/demo.env for configs/demo.yaml."""
    return ENV_FILE_DIR / f"{Path(config_path).stem}.env"


def _env_file_names(path: Path) -> set[str]:
    """Variable names an existing env file assigns (`NAME=value` lines, systemd.exec(5)); empty
    when it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return set()
    names = set()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        if line and line[0] not in "#;" and "=" in line:
            names.add(line.split("=", 1)[0].strip())
    return names


def env_file_warnings(raw_config: Any, env_file: Path, user: str | None = None) -> list[str]:
    """One warning line per `${VAR}` that `raw_config` (the parsed YAML, before interpolation)
    uses without a default and that would be unset under systemd: not set by systemd itself and
    not assigned in `env_file` (when that exists and is readable), nor one of xpu-serve's own
    (`config.builtin_env`)."""
    from xpu_serve.config import builtin_env, variable_references

    provided = SYSTEMD_SETS | (USER_VARS if user else set()) | _env_file_names(env_file) | set(builtin_env())
    out: list[str] = []
    seen: set[str] = set()
    for name, default, loc in variable_references(raw_config):
        if default is not None or name in provided or name in seen:
            continue
        seen.add(name)
        where = ".".join(str(x) for x in loc) or "top level"
        out.append(
            f"warning: ${{{name}}} ({where}) has no default and systemd starts the service with a clean "
            f"environment: put {name}=... in {env_file}"
        )
    return out


def render_unit(
    config: Any,
    config_path: Path,
    exec_path: str,
    user: str | None = None,
    cwd: Path | None = None,
    *,
    groups: list[str] | None = None,
    env_file: Path | None = None,
    watchdog_sec: int = WATCHDOG_SEC,
) -> str:
    """Return the text of a `.service` unit.

    Args:
        config: a loaded `xpu_serve.config.Config`.
        config_path: the config file (made absolute in `ExecStart=`).
        exec_path: absolute path of the `xpu-serve` executable.
        user: run as this user (with the render/video groups), or root when None.
        cwd: `WorkingDirectory=` (default: the current directory, made absolute).
        groups: `SupplementaryGroups=` (default: `host_groups()`); none: the line is omitted.
        env_file: `EnvironmentFile=` (default: `default_env_file(config_path)`).
        watchdog_sec: `WatchdogSec=` in seconds (> 0).
    """
    sup = config.supervision
    start_timeout = int(math.ceil(sup.startup.timeout_s + 120))
    stop_timeout = int(math.ceil(sup.stop.grace_s + config.bundles.collector_timeout_s * 3 + 30))
    restart_sec = int(math.ceil(sup.restart.max_delay_s))
    limit_interval = START_LIMIT_BURST * (restart_sec + start_timeout) + 60
    name = config.engine.served_model_name or Path(config.engine.model).name or config.engine.model
    runtime_dir = str(config.runtime_dir)
    cmd = [exec_path, "up", "-c", str(config_path.resolve())]
    groups = host_groups() if groups is None else groups
    env_file = default_env_file(config_path) if env_file is None else env_file
    no_restart = sorted({exitcodes.USAGE, exitcodes.GAVE_UP_AT_ONCE, exitcodes.LOCKED})
    lines = [
        "[Unit]",
        _unit_text(f"Description=xpu-serve: vLLM {name} (tensor parallel {config.engine.tensor_parallel_size})"),
        "After=network-online.target",
        "Wants=network-online.target",
        f"StartLimitIntervalSec={limit_interval}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=" + " ".join(exec_word(c) for c in cmd),
        f"WorkingDirectory={_unit_path('WorkingDirectory=', Path(cwd or Path.cwd()).resolve())}",
        f"EnvironmentFile=-{_unit_path('EnvironmentFile=', Path(env_file))}",
        f"TimeoutStartSec={start_timeout}",
        f"TimeoutStopSec={stop_timeout}",
        f"WatchdogSec={watchdog_sec}",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        "OOMPolicy=continue",
        "Restart=on-failure",
        f"RestartSec={restart_sec}",
        "RestartPreventExitStatus=" + " ".join(str(c) for c in no_restart),
        "LimitNOFILE=65536",
        "LimitMEMLOCK=infinity",
    ]
    if groups:
        lines.append("SupplementaryGroups=" + " ".join(groups))
    if user:
        lines.append(f"User={_unit_path('User=', user)}")
    if runtime_dir == "/var/lib/xpu-serve":
        lines.append("StateDirectory=xpu-serve")
        lines.append("StateDirectoryMode=0700")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)
