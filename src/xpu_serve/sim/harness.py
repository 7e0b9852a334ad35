"""Start the simulator as a real process tree from tests and benchmarks, and always clean it up.

    with SimRun(tmp_path, tp=4, faults="worker-segv rank=0 after=50") as sim:
        sim.wait_ready()
        status, body = sim.get("/health")

Every process of a run carries ``XPU_SERVE_SIM_RUN_ID=<uuid>`` in its environment (inherited, like
``XPU_SERVE_INCARNATION``; visible in /proc/PID/environ because the run sets ``SPT_NOENV=1``), so :meth:`SimRun.processes` finds the whole tree, re-parented orphans
included, and :meth:`SimRun.kill_all` leaves nothing behind. The run's own /dev/shm and /tmp
``vllm_dist_*`` leftovers are removed by :meth:`SimRun.cleanup_leftovers`, by the supervisor's
ownership rule (:func:`xpu_serve.cleanup.remove_segments`): what the run's processes mapped or held
open before :meth:`SimRun.kill_all`, and what carries the run id in its name. The EngineCore's
MessageQueue buffer (``psm_*``, registered with multiprocessing's resource tracker) is among them: the
tracker unlinks it when the tree exits, but not when a SIGKILL to the session kills the tracker too.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil

from xpu_serve import cleanup

SHM_PREFIX_VAR = "XPU_SERVE_SIM_SHM_PREFIX"
"""The simulator's MessageQueue segment name prefix (sim/cli.py); a test session sets a base for it."""
PREFIX_RE = re.compile(r"^\((?P<name>[\w:.-]+) pid=(?P<pid>\d+)\) ")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shm_prefix(run_id: str) -> str:
    """``<base><run_id>_``: the name prefix of a run's MessageQueue segment; ``<base>`` is
    XPU_SERVE_SIM_SHM_PREFIX of this process (a test session's own, tests/conftest.py) or ``psm_``."""
    return f"{os.environ.get(SHM_PREFIX_VAR) or 'psm_'}{run_id}_"


def run_files(tag: str, prefix: str) -> list[str]:
    """Existing ``/dev/shm/vllm_dist_<tag>-*``, ``/dev/shm/<prefix>*`` and ``/tmp/vllm_dist_<tag>``
    (`tag`: XPU_SERVE_SIM_DIST_TAG, `prefix`: XPU_SERVE_SIM_SHM_PREFIX of one run)."""
    shm = glob.glob(f"/dev/shm/vllm_dist_{glob.escape(tag)}*") + glob.glob(f"/dev/shm/{glob.escape(prefix)}*")
    return sorted(shm + glob.glob(f"/tmp/vllm_dist_{glob.escape(tag)}"))


class SimRun:
    """One ``python -m xpu_serve.sim serve`` process tree, output merged into ``log_path``.

    Args:
        workdir: directory for the log (``sim.log``).
        tp: tensor parallel size.
        faults: ``XPU_SERVE_SIM_FAULTS`` value.
        scale: ``XPU_SERVE_SIM_TIME_SCALE``.
        env: extra environment variables (override everything else).
        args: extra ``vllm serve`` flags.
        served_name: ``--served-model-name``.
    """

    def __init__(
        self,
        workdir: str | Path,
        tp: int = 4,
        faults: str = "",
        scale: float = 0.01,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        served_name: str = "sim",
        model: str = "/models/Qwen3-30B-A3B",
    ):
        self.workdir = Path(workdir)
        self.log_path = self.workdir / "sim.log"
        self.port = free_port()
        self.run_id = uuid.uuid4().hex
        self.served_name = served_name
        self.argv = [
            sys.executable,
            "-m",
            "xpu_serve.sim",
            "serve",
            model,
            "--served-model-name",
            served_name,
            "--tensor-parallel-size",
            str(tp),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(args or []),
        ]
        self.env = dict(os.environ)
        for k in list(self.env):
            if k.startswith(("XPU_SERVE_SIM_", "VLLM_")):
                del self.env[k]
        self.env.update(
            {
                "XPU_SERVE_SIM_FAULTS": faults,
                "XPU_SERVE_SIM_TIME_SCALE": str(scale),
                "XPU_SERVE_SIM_RUN_ID": self.run_id,
                "XPU_SERVE_SIM_DIST_TAG": self.run_id,
                # the MessageQueue buffer carries the run id too: `leftovers` finds it by name
                SHM_PREFIX_VAR: shm_prefix(self.run_id),
                # setproctitle (vLLM's titles) blanks /proc/PID/environ unless SPT_NOENV is set; the
                # supervisor sets it too (supervisor.py), so the marker sweep can see every process.
                "SPT_NOENV": "1",
                "PYTHONFAULTHANDLER": "1",
                "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                "CCL_ATL_TRANSPORT": "ofi",
            }
        )
        self.env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.started_wall = time.time()
        self.mapped: set[str] = set()  # what the run's processes mapped or held open (kill_all)

    def __enter__(self) -> SimRun:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
        self.cleanup_leftovers()

    def start(self) -> None:
        """Launch the API server in its own session (like a supervisor does)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                cwd=str(self.workdir),
            )
        self.started = time.monotonic()
        self.started_wall = time.time()

    # -- observation -------------------------------------------------------------------------
    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
        """GET `path`; (status, body); status 0 when there was no HTTP answer."""
        try:
            with urllib.request.urlopen(self.url(path), timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (OSError, TimeoutError):
            return 0, b""

    def post(self, path: str, body: dict[str, Any], timeout: float = 30.0) -> tuple[int, bytes]:
        """POST JSON; (status, body); status 0 when there was no HTTP answer."""
        req = urllib.request.Request(
            self.url(path), data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (OSError, TimeoutError):
            return 0, b""

    def stream(self, path: str, body: dict[str, Any], timeout: float = 30.0) -> list[str]:
        """POST with ``stream: true``; the ``data: ...`` payloads in order."""
        req = urllib.request.Request(
            self.url(path),
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"content-type": "application/json"},
        )
        events = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Wait for ``/health`` 200; returns seconds since start. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Before start-up completes the bound port accepts but never answers (as vLLM), so
            # probe /health only once the log says the application started.
            if "Application startup complete." in self.log() and self.get("/health", timeout=0.5)[0] == 200:
                return time.monotonic() - self.started
            if self.proc is not None and self.proc.poll() is not None:
                raise TimeoutError(
                    f"simulator exited with {self.proc.returncode} before ready:\n{self.log()[-3000:]}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"simulator not ready after {timeout}s:\n{self.log()[-3000:]}")

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the API server to exit; its return code. Raises subprocess.TimeoutExpired."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def wait_for_line(self, pattern: str, timeout: float = 15.0) -> re.Match[str]:
        """Wait until the log has a line matching regex `pattern`. Raises TimeoutError."""
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.log())
            if m:
                return m
            time.sleep(0.05)
        raise TimeoutError(f"no line matching {pattern!r} after {timeout}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        """The merged output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def lines(self) -> list[str]:
        return self.log().splitlines()

    def pids_by_name(self) -> dict[str, int]:
        """Log prefix name -> pid (the last name each pid used: "Worker_TP0", "EngineCore_DP0"...)."""
        out: dict[str, int] = {}
        for line in self.lines():
            m = PREFIX_RE.match(line)
            if m:
                out[m.group("name")] = int(m.group("pid"))
        return out

    def processes(self) -> list[psutil.Process]:
        """Live (non-zombie) processes of this run, found by XPU_SERVE_SIM_RUN_ID in their environment."""
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if (
                    p.environ().get("XPU_SERVE_SIM_RUN_ID") == self.run_id
                    and p.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        return found

    def wait_gone(self, timeout: float = 10.0) -> list[psutil.Process]:
        """Wait until no process of the run is alive; returns the survivors at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None:
                self.proc.poll()
            left = self.processes()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    # -- cleanup -----------------------------------------------------------------------------
    def kill_all(self) -> None:
        """SIGKILL every process of the run (session, then environment marker), reap the API
        server and wait up to 5 s for the others to be gone (a dying process still maps its
        segments, and `cleanup_leftovers` keeps what a live process maps); first records what
        they map or hold open (`mapped`), for `cleanup_leftovers`."""
        self.mapped |= cleanup.segments_of([p.pid for p in self.processes()])
        if self.proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        rest = self.processes()
        for p in rest:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        psutil.wait_procs(rest, timeout=5)

    def leftovers(self) -> list[str]:
        """``/dev/shm/vllm_dist_<tag>-*``, ``/dev/shm/<shm prefix>*`` (the MessageQueue buffer) and
        ``/tmp/vllm_dist_<tag>`` of this run that still exist (`run_files`; the tag is the run id)."""
        return run_files(self.run_id, self.env[SHM_PREFIX_VAR])

    def cleanup_leftovers(self) -> cleanup.SegmentReport:
        """Remove this run's leaked segments and files as a supervisor's sweep does
        (`cleanup.remove_segments`): those its processes mapped or held open (`mapped`) or that
        carry its run id, unless another live process maps them or they predate the run."""
        return cleanup.remove_segments(None, self.mapped | set(self.leftovers()), self.started_wall, None)
