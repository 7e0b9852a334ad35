"""Host preflight for `xpu-serve check`: can this machine run the configured engine?

`preflight(cfg)` returns one `Finding` per fact checked, each with a level:
`ok`, `info` (optional facts), `warning` (serving may work, but something will be missing or
slow), `error` (`up` would fail or crash). Checks: engine executable, model path or hub id,
API port and metrics port free, /dev/shm size, /dev/dri render nodes and their permissions,
ZE_AFFINITY_MASK against the tensor parallel size, kernel log readable, runtime directory
writable, xpu-smi / sycl-ls present, and the installed Level Zero GPU driver against the
known-bad list (data: `xpu_serve/data/known_bad_drivers.yaml`).

Nothing here needs an XPU; on a machine without one the GPU checks report what is missing.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import stat
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from xpu_serve.config import Config
from xpu_serve.vllm_command import render

Level = Literal["ok", "info", "warning", "error"]
LEVELS: tuple[Level, ...] = ("ok", "info", "warning", "error")

LIB_DIRS_ENV = "XPU_SERVE_LIB_DIRS"
"""Colon-separated directories searched for libze_intel_gpu.so* instead of the defaults
(`check --lib-dir` does the same); with either, `ldconfig -p` is not consulted."""

DEFAULT_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/lib/x86_64-linux-gnu",
    "/opt/intel/oneapi/redist/lib",
)
"""Where distributions and Intel's packages put libze_intel_gpu.so* (plus LD_LIBRARY_PATH)."""

LEVEL_ZERO_GPU_LIB = "libze_intel_gpu.so"

SHM_MIN_BYTES = 1024**3
"""Below this /dev/shm size, tensor parallel serving is warned about: vLLM's shared-memory
broadcast queue between EngineCore and workers lives there (vllm/distributed/device_communicators/
shm_broadcast.py), and Docker's default --shm-size is only 64 MiB. Intel llm-scaler's run
example uses --shm-size=32g."""

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Finding:
    """One preflight result: `level` (ok/info/warning/error), `check` (a short id such as
    "port", "driver"), `message` (one line for a person)."""

    level: Level
    check: str
    message: str

    def line(self, width: int = 11) -> str:
        """`LEVEL   CHECK       message`, the text form `check` prints; `width`: the CHECK column's
        (the longest check id of the list, so the messages line up)."""
        return f"{self.level:<7} {self.check:<{width}} {self.message}"

    def as_dict(self) -> dict[str, str]:
        """{"level", "check", "message"}, the `check --json` form."""
        return asdict(self)


@lru_cache(maxsize=1)
def known_bad_drivers() -> list[dict[str, Any]]:
    """Entries of `data/known_bad_drivers.yaml`: [{"file", "symptom", "evidence", "advice"}]."""
    from xpu_serve.yamldata import load_data

    text = resources.files("xpu_serve").joinpath("data/known_bad_drivers.yaml").read_text(encoding="utf-8")
    return list(load_data(text) or [])


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


# --------------------------------------------------------------------------- individual checks


def check_engine(cfg: Config, env: dict[str, str]) -> Finding:
    """The engine's argv[0] exists and is executable (looked up on the engine's PATH)."""
    try:
        return _check_engine(cfg, env)
    except OSError as e:  # ENAMETOOLONG, EACCES on a parent...: Path.is_file() raises them
        return Finding("error", "engine", f"engine.command[0] {cfg.engine.command[0]}: {e.strerror or e}")


def _check_engine(cfg: Config, env: dict[str, str]) -> Finding:
    exe = cfg.engine.command[0]
    if "/" in exe:
        p = Path(exe)
        if p.is_file() and os.access(p, os.X_OK):
            return Finding("ok", "engine", f"{exe} is executable")
        why = "not executable" if p.exists() else "does not exist"
        return Finding("error", "engine", f"engine.command[0] {exe} {why}")
    found = shutil.which(exe, path=env.get("PATH", os.defpath))
    if found:
        return Finding("ok", "engine", f"{exe} found at {found}")
    return Finding("error", "engine", f"engine.command[0] {exe!r} is not on PATH")


def check_model(cfg: Config) -> Finding:
    """The model is an existing local path (a directory with config.json, or a file), or looks
    like a hub id ORG/NAME (not checked: no network)."""
    try:
        return _check_model(cfg)
    except OSError as e:  # e.g. ENAMETOOLONG for a 300-character path component
        return Finding("error", "model", f"engine.model {cfg.engine.model}: {e.strerror or e}")


def _check_model(cfg: Config) -> Finding:
    model = cfg.engine.model
    p = Path(model).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file() or any(p.glob("*.gguf")):
            return Finding("ok", "model", f"{model} is a model directory")
        return Finding("warning", "model", f"{model} is a directory without config.json")
    if p.is_file():
        return Finding("ok", "model", f"{model} is a file")
    if os.path.lexists(p):  # a FIFO, a socket, a device, a dangling link: vLLM cannot load it
        what = "a dangling symlink" if p.is_symlink() else "neither a directory nor a regular file"
        return Finding("error", "model", f"engine.model {model} is {what}")
    if model.startswith(("/", "./", "../", "~")):
        return Finding("error", "model", f"engine.model {model} does not exist")
    if _HUB_ID.fullmatch(model):
        return Finding(
            "info", "model", f"{model} is not a local path; taken as a hub id (not checked offline)"
        )
    return Finding(
        "error", "model", f"engine.model {model!r} is neither an existing path nor a hub id ORG/NAME"
    )


def _listener(port: int) -> int | None:
    """Pid of the process listening on TCP `port` (psutil; None when unknown or not allowed)."""
    import psutil

    try:
        for c in psutil.net_connections(kind="inet"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return int(c.pid)
    except (psutil.Error, OSError):
        pass
    return None


def _port_owner(pid: int | None) -> str:
    import psutil

    if pid is None:
        return ""
    try:
        return f" by pid {pid} ({psutil.Process(pid).name()})"
    except psutil.Error:
        return f" by pid {pid}"


def _running_here(runtime_dir: str | Path | None) -> tuple[int, set[int]] | None:
    """(supervisor pid, its engine's pids) of the live supervisor holding `runtime_dir`'s lock,
    from RUNTIME/state.json; None when no supervisor runs there. Never raises."""
    from xpu_serve.state import lock_holder, read_state

    if runtime_dir is None:
        return None
    try:
        sup = lock_holder(Path(runtime_dir).expanduser())
        st = read_state(Path(runtime_dir).expanduser()) if sup else None
    except (OSError, ValueError):
        return None
    if not sup or sup == os.getpid() or not isinstance(st, dict):
        return None
    pids = {p["pid"] for p in st.get("processes") or [] if isinstance(p, dict) and isinstance(p.get("pid"), int)}
    return sup, pids


def resolve_problem(host: str, port: int) -> tuple[str, bool] | None:
    """Why `host` cannot be bound: (message, temporary), or None when it resolves. The message
    is the one `check` prints ("host 'x' does not resolve: Name or service not known");
    temporary is True for EAI_AGAIN (the resolver did not answer: worth asking again)."""
    bind_host = host or "0.0.0.0"
    try:
        socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"host {bind_host!r} does not resolve: {e.strerror}", e.errno == socket.EAI_AGAIN
    except (UnicodeError, ValueError) as e:  # (a label longer than 63 for the IDNA codec)
        return f"host {bind_host!r} does not resolve: {e}", False
    return None


def check_port(host: str, port: int, what: str = "port", runtime_dir: str | Path | None = None) -> Finding:
    """Nothing listens on host:port: a bind with SO_REUSEADDR (as uvicorn does) succeeds.

    SO_REUSEADDR lets the bind succeed over sockets in TIME_WAIT, which do not stop vLLM either;
    a listening socket still makes it fail with EADDRINUSE. When the listener is the engine of
    the supervisor running on `runtime_dir` (this config's own server, e.g. `check` while `up`
    serves), the finding is "ok" and says so.
    """
    bind_host = host or "0.0.0.0"
    bad = resolve_problem(host, port)
    if bad is not None:
        return Finding("error", what, bad[0])
    infos = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    with socket.socket(family, socktype, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                owner = _listener(port)
                here = _running_here(runtime_dir)
                if here is not None and owner is not None and owner in here[1]:
                    return Finding(
                        "ok",
                        what,
                        f"{bind_host}:{port} is served by this config's running server (pid {owner}, "
                        f"xpu-serve supervisor pid {here[0]})",
                    )
                return Finding("error", what, f"{bind_host}:{port} is in use{_port_owner(owner)}")
            if e.errno == errno.EADDRNOTAVAIL:
                return Finding("error", what, f"{bind_host} is not an address of this machine")
            if e.errno == errno.EACCES:
                return Finding("error", what, f"binding {bind_host}:{port} needs privileges (port < 1024)")
            return Finding("error", what, f"cannot bind {bind_host}:{port}: {e.strerror}")
    return Finding("ok", what, f"{bind_host}:{port} is free")


def check_shm(path: Path, tensor_parallel_size: int) -> Finding:
    """/dev/shm exists and, for tensor parallel, is at least SHM_MIN_BYTES."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        level: Level = "error" if tensor_parallel_size > 1 else "warning"
        return Finding(level, "shm", f"{path}: {e.strerror}; vLLM's worker broadcast queue needs it")
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    msg = f"{path}: {_size(total)} ({_size(free)} free)"
    if tensor_parallel_size > 1 and total < SHM_MIN_BYTES:
        return Finding(
            "warning",
            "shm",
            f"{msg}; below {_size(SHM_MIN_BYTES)} for tensor parallel "
            "(in Docker: --shm-size=16g or --ipc=host)",
        )
    return Finding("ok", "shm", msg)


def check_render_nodes(dri_dir: Path, tensor_parallel_size: int) -> list[Finding]:
    """Render nodes /dev/dri/renderD* exist, are character devices we can open read-write, and
    are at least as many as the tensor parallel ranks."""
    nodes = sorted(dri_dir.glob("renderD*")) if dri_dir.is_dir() else []
    if not nodes:
        return [
            Finding(
                "warning",
                "dri",
                f"no render nodes under {dri_dir} (fine for CPU or the simulator; "
                "an XPU engine needs them: in Docker, --device /dev/dri)",
            )
        ]
    out: list[Finding] = []
    for node in nodes:
        try:
            st = node.stat()
        except OSError as e:
            out.append(Finding("error", "dri", f"{node}: {e.strerror}"))
            continue
        try:
            import grp

            group = grp.getgrgid(st.st_gid).gr_name
        except (KeyError, ImportError):
            group = str(st.st_gid)
        kind = "" if stat.S_ISCHR(st.st_mode) else " (not a character device)"
        if os.access(node, os.R_OK | os.W_OK):
            out.append(Finding("ok", "dri", f"{node} readable and writable (group {group}){kind}"))
        else:
            out.append(
                Finding(
                    "error",
                    "dri",
                    f"{node}: no read/write access (mode {stat.filemode(st.st_mode)}, "
                    f"group {group}): add the user to group {group}{kind}",
                )
            )
    if 1 < tensor_parallel_size and len(nodes) < tensor_parallel_size:
        out.append(
            Finding(
                "warning",
                "dri",
                f"{len(nodes)} render node(s) for tensor_parallel_size {tensor_parallel_size}",
            )
        )
    return out


def check_render_group(lookup: Callable[[str], Any] | None = None) -> Finding:
    """The `render` group exists (`lookup`: default `grp.getgrnam`, raising KeyError for an
    unknown group). Without it the generated unit carries no `SupplementaryGroups=render`, and
    /dev/dri/renderD* (group `render` on a host with an XPU driver) is then usable only by root."""
    import grp

    try:
        (lookup or grp.getgrnam)("render")
    except KeyError:
        return Finding(
            "warning",
            "render-group",
            "no group 'render' on this host: `xpu-serve unit` leaves it out of SupplementaryGroups=, "
            "so a non-root service cannot open /dev/dri/renderD* (create it with the GPU driver "
            "packages, or run the service as root)",
        )
    return Finding("ok", "render-group", "group 'render' exists (access to /dev/dri render nodes)")


def check_affinity(env: dict[str, str], tensor_parallel_size: int) -> Finding | None:
    """ZE_AFFINITY_MASK (rendered or inherited) exposes at least tensor_parallel_size devices."""
    mask = env.get("ZE_AFFINITY_MASK")
    if mask is None:
        return None
    count = len([x for x in mask.split(",") if x.strip()])
    if count < tensor_parallel_size:
        return Finding(
            "warning",
            "affinity",
            f"ZE_AFFINITY_MASK={mask} exposes {count} device(s), "
            f"tensor_parallel_size is {tensor_parallel_size}",
        )
    return Finding("ok", "affinity", f"ZE_AFFINITY_MASK={mask} ({count} devices)")


def check_kernel_log(cfg: Config, kmsg: Path) -> Finding:
    """The kernel log source the kernel watcher will use is readable (root-cause evidence for
    GPU faults and user-mode driver segfaults comes from it)."""
    kw = cfg.watchers.kernel
    if not kw.enabled or kw.source == "none":
        return Finding("info", "kernel-log", "kernel watcher disabled in the config")
    if kw.source == "file":
        if kw.path and os.access(kw.path, os.R_OK):
            return Finding("ok", "kernel-log", f"{kw.path} readable")
        return Finding("warning", "kernel-log", f"watchers.kernel.path {kw.path!r} is not readable")
    if kw.source in ("journalctl", "dmesg"):
        tool = shutil.which(kw.source)
        return (
            Finding("ok", "kernel-log", f"{kw.source} found at {tool}")
            if tool
            else Finding("warning", "kernel-log", f"{kw.source} not on PATH")
        )
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        fallback = [t for t in ("journalctl", "dmesg") if shutil.which(t)]
        tail = f"; `auto` falls back to {' / '.join(fallback)}" if fallback and kw.source == "auto" else ""
        return Finding(
            "warning",
            "kernel-log",
            f"{kmsg}: {e.strerror} (kernel GPU faults and segfault lines "
            f"will be missing from diagnoses unless readable: root or CAP_SYSLOG){tail}",
        )
    try:
        os.read(fd, 8192)
    except BlockingIOError:
        pass  # no record yet: readable
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.EINVAL):  # EPIPE: a record was overwritten, still readable
            return Finding("warning", "kernel-log", f"{kmsg}: read failed: {e.strerror}")
    finally:
        os.close(fd)
    return Finding("ok", "kernel-log", f"{kmsg} readable")


def check_runtime_dir(runtime_dir: str) -> Finding:
    """The runtime directory exists and is writable, or can be created."""
    try:
        return _check_runtime_dir(runtime_dir)
    except OSError as e:
        return Finding("error", "runtime-dir", f"runtime_dir {runtime_dir}: {e.strerror or e}")


def _check_runtime_dir(runtime_dir: str) -> Finding:
    p = Path(runtime_dir).expanduser()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.is_dir() and os.access(probe, os.W_OK | os.X_OK):
        verb = "writable" if probe == p else f"can be created (in {probe})"
        return Finding("ok", "runtime-dir", f"{p} {verb}")
    return Finding("warning", "runtime-dir", f"{p} is not writable (up --runtime-dir DIR chooses another)")


def check_tools(env: dict[str, str]) -> list[Finding]:
    """xpu-smi and sycl-ls: optional, used for evidence in bundles when present."""
    out = []
    for tool, use in (
        ("xpu-smi", "GPU health and telemetry in bundles"),
        ("sycl-ls", "device list in bundles"),
    ):
        found = shutil.which(tool, path=env.get("PATH", os.defpath))
        out.append(
            Finding("info", "tools", f"{tool} found at {found}" if found else f"{tool} not found ({use})")
        )
    return out


def _ldconfig_libs() -> list[Path]:
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if not ldconfig:
        return []
    try:
        out = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    libs = []
    for line in out.splitlines():
        # "	libze_intel_gpu.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1"
        name, _, target = line.strip().partition(" => ")
        if name.startswith(LEVEL_ZERO_GPU_LIB) and target:
            libs.append(Path(target))
    return libs


def find_level_zero_gpu_libs(lib_dirs: Iterable[Path] | None = None) -> list[Path]:
    """Installed Level Zero GPU driver files (libze_intel_gpu.so*), symlinks resolved, sorted.

    Args:
        lib_dirs: directories to search; None = DEFAULT_LIB_DIRS + LD_LIBRARY_PATH + `ldconfig -p`.
    """
    found: set[Path] = set()
    if lib_dirs is None:
        dirs = [Path(d) for d in DEFAULT_LIB_DIRS]
        dirs += [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
        found.update(p.resolve() for p in _ldconfig_libs() if p.exists())
    else:
        dirs = list(lib_dirs)
    for d in dirs:
        if d.is_dir():
            found.update(p.resolve() for p in d.glob(LEVEL_ZERO_GPU_LIB + "*") if p.exists())
    return sorted(found)


def check_driver(lib_dirs: Iterable[Path] | None = None) -> list[Finding]:
    """Each installed libze_intel_gpu.so* against the known-bad list (error when listed)."""
    libs = find_level_zero_gpu_libs(lib_dirs)
    if not libs:
        return [
            Finding(
                "info",
                "driver",
                f"no {LEVEL_ZERO_GPU_LIB}* found (Level Zero GPU driver not "
                "installed: fine for CPU or the simulator)",
            )
        ]
    bad = {entry["file"]: entry for entry in known_bad_drivers()}
    out = []
    for lib in libs:
        entry = bad.get(lib.name)
        if entry:
            symptom = " ".join(str(entry["symptom"]).split())
            advice = " ".join(str(entry["advice"]).split())
            out.append(
                Finding(
                    "error",
                    "driver",
                    f"{lib} is a known-bad Level Zero driver: {symptom} ({entry['evidence']}). {advice}",
                )
            )
        else:
            out.append(Finding("ok", "driver", f"{lib} (not on the known-bad list)"))
    return out


# --------------------------------------------------------------------------- all together


def preflight(
    cfg: Config,
    *,
    lib_dirs: Iterable[Path] | None = None,
    runtime_dir: str | None = None,
    dri_dir: Path = Path("/dev/dri"),
    kmsg: Path = Path("/dev/kmsg"),
    shm: Path = Path("/dev/shm"),
) -> list[Finding]:
    """Run every check for this config on this host.

    Args:
        cfg: a validated config.
        lib_dirs: where to look for libze_intel_gpu.so* (None: defaults + ldconfig; see
            `find_level_zero_gpu_libs`).
        runtime_dir: overrides `cfg.runtime_dir` (as `up --runtime-dir` does).
        dri_dir, kmsg, shm: the device paths (parameters for tests).

    Returns:
        Findings in check order; never raises for a host problem (each becomes a finding).
    """
    rendered = render(cfg)
    env = rendered.process_env()
    tp = cfg.engine.tensor_parallel_size
    out: list[Finding] = [
        check_engine(cfg, env),
        check_model(cfg),
        check_port(cfg.engine.host, cfg.engine.port, runtime_dir=runtime_dir or cfg.runtime_dir),
    ]
    if cfg.metrics.enabled:
        mhost, _, mport = cfg.metrics.listen.rpartition(":")
        if mport.isdigit():
            out.append(check_port(mhost.strip("[]"), int(mport), "metrics"))
        else:
            out.append(Finding("error", "metrics", f"metrics.listen {cfg.metrics.listen!r} is not HOST:PORT"))
    out.append(check_shm(shm, tp))
    out += check_render_nodes(dri_dir, tp)
    out.append(check_render_group())
    aff = check_affinity(env, tp)
    if aff:
        out.append(aff)
    out.append(check_kernel_log(cfg, kmsg))
    out.append(check_runtime_dir(runtime_dir or cfg.runtime_dir))
    out += check_tools(env)
    out += check_driver(lib_dirs)
    return out


def exit_code(findings: Iterable[Finding], strict: bool) -> int:
    """2 when any error, 1 when any warning and `strict`, else 0 (xpu_serve.exitcodes values)."""
    from xpu_serve import exitcodes

    levels = {f.level for f in findings}
    if "error" in levels:
        return exitcodes.USAGE
    if strict and "warning" in levels:
        return exitcodes.FAILURE
    return exitcodes.OK
