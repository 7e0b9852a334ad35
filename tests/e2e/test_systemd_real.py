"""The unit `xpu-serve unit` generates, run by a real systemd (252 on Debian 12) booted as PID 1 of
a new PID + mount namespace, with the simulator as the engine.

Boot recipe (/work/shared/notes/real-systemd.md): private tmpfs /tmp, /var/tmp and /run (booted
with the host's /tmp, systemd-tmpfiles empties it) and a target with DefaultDependencies=no (the
default target starts whatever the host has installed). Units go into the namespace's
/run/systemd/system. Everything the unit names (the venv, the repo, the config, the runtime
directory) lives under the repository's `.systemd-test/` (git-ignored); a repository under /tmp is
bind-mounted back into the namespace after its tmpfs mounts.
Teardown SIGKILLs the namespace's PID 1 (which ends every process in it) and removes the /dev/shm
segments the killed tree left (/dev/shm is the host's).

Skipped when not root or without /lib/systemd/systemd, unshare or nsenter; with CI=true as root
it fails instead, so CI cannot silently skip it. One systemd boot for the whole file (~1-2 min).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from xpu_serve import cleanup

from .harness import _free_port

pytestmark = [pytest.mark.e2e, pytest.mark.systemd]
ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = Path("/lib/systemd/systemd")
PRIVATE = ("/tmp", "/var/tmp", "/run")
WATCHDOG_SEC = 5
BOOT_SCRIPT = (
    "mount -t tmpfs tmpfs /tmp && mount -t tmpfs tmpfs /var/tmp && mount -t tmpfs tmpfs /run && "
    "mkdir -p /run/systemd/system && "
    'printf "[Unit]\\nDescription=only what a test starts\\nDefaultDependencies=no\\n" '
    "> /run/systemd/system/xpu-test.target && "
    "exec /lib/systemd/systemd --system --unit=xpu-test.target"
)
# A checkout under /tmp (a CI clone may be there) would be hidden by the namespace's tmpfs: it is
# bind-mounted to KEEP before the tmpfs mounts and back onto its own path after them, inside the
# namespace only (unshare's mounts are private: the host sees none of this).
KEEP = Path("/var/lib/xpu-serve-systemd-test")


def _boot_script() -> str:
    if not str(ROOT).startswith(tuple(p + "/" for p in PRIVATE)):
        return BOOT_SCRIPT
    root, keep = shlex.quote(str(ROOT)), shlex.quote(str(KEEP))
    tmpfs, rest = BOOT_SCRIPT.split("mkdir -p /run/systemd/system", 1)
    return (
        f"mkdir -p {keep} && mount --bind {root} {keep} && {tmpfs}"
        f"mkdir -p {root} && mount --bind {keep} {root} && mkdir -p /run/systemd/system{rest}"
    )


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (systemd as PID 1 of a new PID namespace)"
    if not SYSTEMD.exists():
        return f"{SYSTEMD} not installed (apt-get install systemd)"
    for tool in ("unshare", "nsenter"):
        if not shutil.which(tool):
            return f"{tool} not found (util-linux)"
    return None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI") == "true" and os.geteuid() == 0:
        pytest.fail(f"real systemd test cannot run in CI: {reason}")
    pytest.skip(reason)


@dataclass
class Namespace:
    """A booted systemd: its host pid, and `run(argv)` inside its PID + mount namespace."""

    popen: subprocess.Popen[bytes]
    pid: int
    work: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)  # XPU_SERVE_SIM_DIST_TAG of the engine
    shm_seen: set[str] = field(default_factory=set)  # segments the engine's processes mapped

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", *argv],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"{argv}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def show(self, unit: str) -> dict[str, str]:
        props = "ActiveState,SubState,NRestarts,StatusText,MainPID,ExecMainStatus,Result"
        out = self.run("systemctl", "show", unit, "-p", props).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _child_of(pid: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise AssertionError(f"unshare (pid {pid}) started no child")


def _tree_pids(tag: str) -> list[int]:
    """Host pids of the engine processes of this test (their environment carries the sim's tag)."""
    marker = f"XPU_SERVE_SIM_DIST_TAG={tag}".encode()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if marker in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                    out.append(int(d))
            except OSError:
                continue
    return out


@pytest.fixture(scope="module")
def ns() -> Iterator[Namespace]:
    why = _unavailable()
    if why:
        _skip_or_fail(why)
    work = ROOT / ".systemd-test" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    log = open(work / "boot.log", "wb")  # noqa: SIM115
    popen = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "sh", "-c", _boot_script()],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    n: Namespace | None = None
    try:
        n = Namespace(popen, _child_of(popen.pid), work)
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            state = n.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.3)
        if state not in ("running", "degraded"):
            _skip_or_fail(f"systemd in a new namespace did not come up ({state!r}): see {work}/boot.log")
        yield n
    finally:
        if n is not None:
            # a test that failed midway leaves the tree running: note what it maps before the kill
            n.shm_seen |= cleanup.segments_of(_tree_pids(n.tag))
            os.kill(n.pid, signal.SIGKILL)  # ends every process of the namespace
        popen.kill()
        popen.wait(30)
        log.close()
        if n is not None:
            for path in n.shm_seen | {f"/dev/shm/{f}" for f in os.listdir("/dev/shm") if n.tag in f}:
                if path.startswith("/dev/shm/"):
                    Path(path).unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def _config(work: Path, tag: str, port: int) -> Path:
    cfg = work / "svc.yaml"
    cfg.write_text(json.dumps({
        "engine": {
            "command": ["${XPU_SERVE_PYTHON:-python3}", "-m", "xpu_serve.sim", "serve"],
            "model": "demo/Simulated-TP2", "served_model_name": "demo", "tensor_parallel_size": 2,
            "host": "127.0.0.1", "port": port,
        },
        "environment": {"vars": {
            "XPU_SERVE_SIM_TIME_SCALE": "0.05",
            # a real SIGSEGV in worker rank 0, 4 s (80 simulated s) after incarnation 1 is ready
            "XPU_SERVE_SIM_FAULTS": "worker-segv rank=0 after=80 incarnation=1",
            "XPU_SERVE_SIM_DIST_TAG": tag,
        }},
        "supervision": {
            "restart": {"initial_delay_s": 1, "max_delay_s": 5, "max_failures": 5},
            "health": {"interval_s": 1, "failures": 3},
            "startup": {"stall_s": 60, "timeout_s": 120},
            "stop": {"grace_s": 3, "port_free_timeout_s": 10},
        },
        "bundles": {"keep": 5, "collector_timeout_s": 2},
        "metrics": {"enabled": False},
        "runtime_dir": str(work / "runtime"),
    }))
    return cfg


def _poll(n: Namespace, unit: str, until, timeout: float, every: float = 0.2) -> list[tuple[float, dict[str, str]]]:
    """`systemctl show` every `every` s until `until(props)`; returns every (time, props) seen."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        props = n.show(unit)
        seen.append((time.monotonic(), props))
        if until(props):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{unit}: timed out; last {props}; journal:\n" + _journal_text(n, unit))
        time.sleep(every)


def _journal_text(n: Namespace, unit: str) -> str:
    return n.run("journalctl", "-u", unit, "--no-pager", "-n", "60", check=False).stdout


def _health(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _active(p: dict[str, str]) -> bool:
    return (p["ActiveState"], p["SubState"]) == ("active", "running")


def test_unit_under_real_systemd(ns: Namespace) -> None:
    tag = ns.tag
    port = _free_port()
    cfg = _config(ns.work, tag, port)
    exe = Path(sys.executable).parent / "xpu-serve"
    gen = subprocess.run(
        [str(exe), "unit", "-c", str(cfg), "--watchdog-sec", str(WATCHDOG_SEC), "--env-file", str(ns.work / "svc.env")],
        capture_output=True, text=True, timeout=60, cwd=ns.work,
    )
    assert gen.returncode == 0, gen.stderr
    keys = dict(line.split("=", 1) for line in gen.stdout.splitlines() if "=" in line)
    assert keys["ExecStart"].split()[0] == str(exe)  # the venv's xpu-serve, absolute
    unit = f"xpu-test-{tag[:8]}.service"
    (ns.work / unit).write_text(gen.stdout)
    ns.run("cp", str(ns.work / unit), f"/run/systemd/system/{unit}")
    ns.run("systemctl", "daemon-reload")

    # 1. start: activating until READY=1, which comes when the simulator answers
    t0 = time.monotonic()
    ns.run("systemctl", "start", "--no-block", unit)
    seen = _poll(ns, unit, lambda p: p["ActiveState"] not in ("activating", "inactive"), 90, every=0.1)
    assert _active(seen[-1][1]), seen[-1]
    assert _health(port), "active/running before the server answers"
    assert seen[-1][1]["StatusText"].startswith("ready, incarnation 1"), seen[-1]
    assert any(p["ActiveState"] == "activating" for _, p in seen)
    t_ready1 = seen[-1][0]
    ns.shm_seen |= cleanup.segments_of(_tree_pids(tag))

    # 2. scripted worker SIGSEGV at incarnation 1: restarted in place, the unit active/running throughout
    seen = _poll(ns, unit, lambda p: p["StatusText"].startswith("ready, incarnation 2"), 90)
    states = {(p["ActiveState"], p["SubState"]) for _, p in seen}
    assert states == {("active", "running")}, states
    assert all(p["NRestarts"] == "0" for _, p in seen)
    t_failed = next(t for t, p in seen if not p["StatusText"].startswith("ready, incarnation 1"))
    t_ready2 = seen[-1][0]
    assert _health(port)
    ns.shm_seen |= cleanup.segments_of(_tree_pids(tag))
    main1 = seen[-1][1]["MainPID"]

    # 3. reload is not offered (SIGHUP would restart vLLM, dropping requests): refused, nothing changes
    r = ns.run("systemctl", "reload", unit, check=False)
    assert r.returncode != 0 and "not applicable" in r.stderr, r.stderr
    p = ns.show(unit)
    assert _active(p) and p["NRestarts"] == "0" and p["MainPID"] == main1, p

    # 4. a frozen supervisor stops pinging the watchdog: systemd kills it and restarts the unit
    t_stop = time.monotonic()
    ns.run("systemctl", "kill", "--kill-whom=main", "-s", "SIGSTOP", unit)
    seen = _poll(
        ns, unit, lambda p: p["NRestarts"] == "1" and _active(p) and p["StatusText"].startswith("ready"), 120
    )
    assert seen[-1][1]["MainPID"] != main1
    t_back = seen[-1][0]
    ns.shm_seen |= cleanup.segments_of(_tree_pids(tag))

    # 5. stop: nothing of the tree left, a clean exit
    ns.run("systemctl", "stop", unit, timeout=120)
    p = ns.show(unit)
    assert p["ActiveState"] == "inactive" and p["ExecMainStatus"] == "0" and p["Result"] == "success", p
    assert _tree_pids(tag) == []
    left = [s for s in ns.shm_seen if os.path.exists(s)] + [f for f in os.listdir("/dev/shm") if tag in f]
    assert left == [], left

    # 6. the journal has the supervisor's events with PRIORITY from their level
    out = ns.run("journalctl", "-u", unit, "-o", "json", "--no-pager").stdout
    prio: dict[str, set[str]] = {}
    ours = []
    for line in out.splitlines():
        rec = json.loads(line)
        msg = rec.get("MESSAGE")
        if isinstance(msg, str) and " xpu-serve: " in msg:
            ours.append(msg)
            event = msg.split(" xpu-serve: ", 1)[1].split(":", 1)[0]
            prio.setdefault(event, set()).add(rec["PRIORITY"])
    assert prio.get("ready") == {"6"}, prio
    assert prio.get("incident") == {"3"}, prio
    assert prio.get("detected") == {"4"}, prio
    assert ours and not any(m.startswith("<") for m in ours), "the <N> prefix reached the journal unparsed"
    errors = ns.run("journalctl", "-u", unit, "-p", "err", "-o", "cat", "--no-pager").stdout
    assert " xpu-serve: incident: " in errors and " xpu-serve: ready: " not in errors, errors
    print(
        f"\nreal systemd: ready after {t_ready1 - t0:.1f} s; worker crash seen at +{t_failed - t_ready1:.1f} s, "
        f"incarnation 2 ready {t_ready2 - t_failed:.1f} s later (unit {sorted(states)} throughout, NRestarts 0); "
        f"SIGSTOP -> unit restarted by the watchdog and ready in {t_back - t_stop:.1f} s"
    )


def test_unit_execstart_argv_is_exact_under_real_systemd(ns: Namespace) -> None:
    """`unit`'s ExecStart= for a config path with `%`, `$`, quotes, a backslash and spaces: the
    process systemd starts gets exactly that path (a shell-quoted one got `%h` expanded)."""
    d = ns.work / "cfg %h $HOME ${HOME} 'q\" \\n x"
    d.mkdir()
    cfg = _config(ns.work, ns.tag, _free_port()).rename(d / "svc.yaml")
    dump = ns.work / "argv.json"
    exe = ns.work / "argv-dump"
    exe.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(dump)!r}, 'w'))\n")
    exe.chmod(0o755)
    gen = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "unit", "-c", str(cfg), "--exec", str(exe),
         "--env-file", str(ns.work / "svc.env")],
        capture_output=True, text=True, timeout=60, cwd=ns.work,
    )
    assert gen.returncode == 0, gen.stderr
    unit = f"xpu-argv-{ns.tag[:8]}.service"
    (ns.work / unit).write_text(gen.stdout)
    ns.run("cp", str(ns.work / unit), f"/run/systemd/system/{unit}")
    ns.run("systemctl", "daemon-reload")
    ns.run("systemctl", "start", "--no-block", unit)
    deadline = time.monotonic() + 30
    while not dump.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    ns.run("systemctl", "stop", unit, check=False)
    assert json.loads(dump.read_text()) == ["up", "-c", str(cfg.resolve())]
