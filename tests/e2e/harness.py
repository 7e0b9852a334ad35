"""Shared harness for end-to-end tests: one `xpu-serve up` child on the simulator.

`Up` writes a config to a tmp dir (free port, time-scaled simulator, a unique
XPU_SERVE_SIM_DIST_TAG so the test knows exactly which /dev/shm and /tmp/vllm_dist_* entries are its
own), runs `python -m xpu_serve up` in its own session, reads state.json and events.jsonl, and in
teardown kills the supervisor and sweeps every process carrying its run id, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from xpu_serve import cleanup

from ..ports import free_port as _free_port


class Up:
    """One `xpu-serve up` child and helpers to read its runtime directory."""

    def __init__(
        self, tmp: Path, tp: int = 2, faults: str = "", engine: dict[str, Any] | None = None, **sup: Any
    ):
        self.tmp = tmp
        self.runtime = tmp / "runtime"
        self.tag = uuid.uuid4().hex  # the simulator wants hex (it derives a port from it)
        self.port = _free_port()
        supervision: dict[str, Any] = {
            "restart": {"initial_delay_s": 0.2, "multiplier": 2, "max_delay_s": 5, "max_failures": 5},
            "health": {"interval_s": 0.5, "failures": 3},
            "startup": {"stall_s": 30, "timeout_s": 60},
            "stop": {"grace_s": 3, "port_free_timeout_s": 10},
        }
        supervision.update(sup)
        eng: dict[str, Any] = {
            "command": [sys.executable, "-m", "xpu_serve.sim", "serve"],
            "model": "test/Sim",
            "served_model_name": "sim",
            "tensor_parallel_size": tp,
            "host": "127.0.0.1",
            "port": self.port,
        }
        eng.update(engine or {})
        self.cfg = {
            "engine": eng,
            "environment": {
                "vars": {
                    "XPU_SERVE_SIM_TIME_SCALE": "0.01",
                    "XPU_SERVE_SIM_FAULTS": faults,
                    "XPU_SERVE_SIM_DIST_TAG": self.tag,
                }
            },
            "supervision": supervision,
            "watchers": {"kernel": {"enabled": False}},
            "metrics": {"enabled": False},
            "bundles": {"collector_timeout_s": 3},
            "runtime_dir": str(self.runtime),
        }
        self.config = tmp / "config.yaml"
        self.config.write_text(yaml.safe_dump(self.cfg))
        self.proc: subprocess.Popen[str] | None = None
        self.run_ids: set[str] = set()

    def write_config(self) -> None:
        """Write `self.cfg` again after a test changed it."""
        self.config.write_text(yaml.safe_dump(self.cfg))

    def start(self, *extra: str, env: dict[str, str] | None = None) -> Up:
        self.out = open(self.tmp / f"up-{len(self.run_ids)}.out", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xpu_serve", "up", "-c", str(self.config), "--log-format", "json", *extra],
            env=None if env is None else {**os.environ, **env},
            stdout=self.out,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.wait_for(lambda: self.state().get("supervisor_pid") == self.proc.pid if self.proc else False, 30)
        self.run_ids.add(self.state()["run_id"])
        return self

    def state(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.runtime / "state.json").read_text()))
        except (FileNotFoundError, ValueError):
            return {}

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        try:
            lines = (self.runtime / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        evs = []
        for x in lines:
            try:  # (a full disk may have cut a line short)
                evs.append(json.loads(x))
            except ValueError:
                pass
        return [e for e in evs if isinstance(e, dict) and (name is None or e.get("event") == name)]

    def wait_for(self, cond: Any, timeout: float, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; events: {self.events()[-8:]}")

    def wait_state(self, state: str, incarnation: int | None = None, timeout: float = 45) -> dict[str, Any]:
        def ok() -> bool:
            st = self.state()
            return st.get("state") == state and (incarnation is None or st.get("incarnation") == incarnation)

        self.wait_for(ok, timeout, f"state {state} incarnation {incarnation}")
        return self.state()

    def wait_tree(self, incarnation: int, timeout: float = 45) -> dict[str, Any]:
        """Ready with the whole tree discovered (API server, EngineCore, every worker)."""
        tp = self.cfg["engine"]["tensor_parallel_size"]

        def ok() -> bool:
            st = self.state()
            names = {p["name"] for p in st.get("processes", [])}
            return (
                st.get("state") == "ready"
                and st.get("incarnation") == incarnation
                and {"APIServer", "EngineCore"} | {f"Worker_TP{r}" for r in range(tp)} <= names
            )

        self.wait_for(ok, timeout, f"incarnation {incarnation} ready with its tree")
        return self.state()

    def exit_code(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stderr(self) -> str:
        assert self.proc is not None
        try:
            _, err = self.proc.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError):
            return ""
        return err or ""

    def our_pids(self) -> set[int]:
        pids: set[int] = set()
        for rid in self.run_ids:
            pids |= cleanup.find_members(rid)
        return pids

    def our_segments(self) -> list[str]:
        found = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if self.tag in n]
        found += [f"/tmp/{n}" for n in os.listdir("/tmp") if n == f"vllm_dist_{self.tag}"]
        return found

    def kill_all(self) -> None:
        # segments this test's engine maps (the simulator's psm_* MessageQueue buffer, as vLLM's
        # shm_broadcast): a SIGKILL teardown gives the supervisor no chance to remove them
        mapped = {p for p in cleanup.segments_of(self.our_pids()) if p.startswith("/dev/shm/")}
        if self.proc is not None and self.proc.poll() is None:
            with_suppress(lambda: os.killpg(self.proc.pid, signal.SIGKILL))  # type: ignore[union-attr]
            self.proc.wait(10)
        for pid in self.our_pids():
            with_suppress(lambda p=pid: os.kill(p, signal.SIGKILL))
        for path in {*self.our_segments(), *mapped}:
            with_suppress(lambda p=path: os.unlink(p))
        if hasattr(self, "out"):
            self.out.close()


class SimUp:
    """`xpu-serve up` on a 4-rank simulator in a real subprocess, started at once; `stop()` leaves
    nothing of its tree behind.

    `faults` is XPU_SERVE_SIM_FAULTS; `extra` maps dotted config keys ("watchers.kernel") to values
    set over the base config, in order; `env` adds `environment.vars`; `os_env` adds to the
    supervisor's own environment. Output (stdout and stderr) goes to `tmp/up.out`. Unless `extra`
    sets `watchers.kernel`, the kernel watcher reads `tmp/kernel.txt` (empty): the machine's kernel
    log holds records that other suites' simulators and the opt-in kmsg tests wrote (GPU faults
    count whatever pid they name), which are no evidence of this run.
    """

    def __init__(
        self,
        tmp: Path,
        faults: str,
        extra: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        os_env: dict[str, str] | None = None,
    ):
        self.tmp = tmp
        self.port = _free_port()
        self.runtime = tmp / "rt"
        cfg: dict[str, Any] = {
            "engine": {
                "command": [sys.executable, "-m", "xpu_serve.sim", "serve"],
                "model": "tiny",
                "tensor_parallel_size": 4,
                "port": self.port,
            },
            "environment": {
                "vars": {"XPU_SERVE_SIM_TIME_SCALE": "0.01", "XPU_SERVE_SIM_FAULTS": faults, **(env or {})}
            },
            "supervision": {"restart": {"initial_delay_s": 0.2, "max_failures": 3}},
            "metrics": {"enabled": False},
            "runtime_dir": str(self.runtime),
        }
        if not any(k == "watchers" or k.startswith("watchers.kernel") for k in extra or {}):
            (tmp / "kernel.txt").touch()
            cfg["watchers"] = {"kernel": {"source": "file", "path": str(tmp / "kernel.txt")}}
        for key, value in (extra or {}).items():
            node = cfg
            *path, last = key.split(".")
            for p in path:
                node = node.setdefault(p, {})
            node[last] = value
        self.config = tmp / "config.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.out = open(tmp / "up.out", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xpu_serve", "up", "-c", str(self.config)],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(os_env or {})},
        )
        self.ps = psutil.Process(self.proc.pid)

    def state(self) -> dict[str, Any]:
        """state.json now ({} when absent or not yet whole)."""
        try:
            got = json.loads((self.runtime / "state.json").read_text())
        except (OSError, ValueError):
            return {}
        return got if isinstance(got, dict) else {}

    def events(self) -> list[dict[str, Any]]:
        """events.jsonl so far (lines that do not parse yet are skipped)."""
        try:
            text = (self.runtime / "events.jsonl").read_text()
        except OSError:
            return []
        out = []
        for ln in text.splitlines():
            try:
                out.append(json.loads(ln))
            except ValueError:
                pass
        return out

    def wait_event(self, name: str, timeout: float, after: int = 0) -> dict[str, Any]:
        """The (after+1)-th event named `name`; AssertionError with the output tail on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evs = [e for e in self.events() if e.get("event") == name]
            if len(evs) > after:
                return evs[after]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(
            f"no {name!r} event in {timeout}s; output:\n{(self.tmp / 'up.out').read_text()[-3000:]}"
        )

    def bundle(self, timeout: float = 60) -> Path:
        """The bundle path of the first incident (its `incident` event comes once the bundle is
        finished, after the tree is stopped)."""
        ev = self.wait_event("incident", timeout)
        path = ev.get("bundle") or ev["msg"].rsplit("bundle ", 1)[1]
        return Path(path)

    def stop(self) -> int:
        """SIGTERM (SIGKILL after 30 s), then kill, by pid, any child left; returns the exit code.
        When the supervisor did not stop on its own (killed here, or by the test), the /dev/shm
        segments its tree mapped are removed too: a SIGKILLed supervisor cleans nothing (its next
        `up` would). After a clean exit they are left for the session's leak check to see."""
        kids: list[psutil.Process] = []
        try:
            kids = self.ps.children(recursive=True)
        except psutil.Error:
            pass
        run_id = self.state().get("run_id")  # (a killed supervisor's tree: found by its run marker)
        for pid in cleanup.find_members(run_id) if isinstance(run_id, str) and run_id else ():
            with contextlib.suppress(psutil.Error):
                if pid not in {k.pid for k in kids}:
                    kids.append(psutil.Process(pid))
        mapped = {p for p in cleanup.segments_of([k.pid for k in kids]) if p.startswith("/dev/shm/")}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        for k in kids:  # the supervisor cleans its tree; make sure, by pid, nothing of ours is left
            try:
                if k.is_running():
                    k.kill()
            except psutil.Error:
                pass
        if code < 0:
            psutil.wait_procs(kids, timeout=5)
            for path in mapped:
                with_suppress(lambda p=path: os.unlink(p))
        self.out.close()
        return code


def proc_connector_available() -> bool:
    from xpu_serve.sources.processes import ProcConnector

    c = ProcConnector.open()
    if c is None:
        return False
    c.close()
    return True


def start_with_metrics(u: Up) -> int:
    """Start `u` with the supervisor's metrics and probes on a free loopback port and wait until
    incarnation 1 is ready with its whole tree; returns that port."""
    port = _free_port()
    u.cfg["metrics"] = {"enabled": True, "listen": f"127.0.0.1:{port}"}
    u.write_config()
    u.start()
    u.wait_tree(1, timeout=60)
    return port


def with_suppress(fn: Any) -> None:
    try:
        fn()
    except OSError:
        pass


@pytest.fixture
def up_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Up] = []

    def make(**kw: Any) -> Up:
        u = Up(tmp_path / f"u{len(made)}", **kw)
        made.append(u)
        return u

    for d in range(4):
        (tmp_path / f"u{d}").mkdir()
    yield make
    for u in made:
        u.kill_all()


@pytest.fixture
def sim_up_factory(tmp_path: Path) -> Iterator[Any]:
    """`SimUp(tmp_path, faults, extra=..., env=..., os_env=...)` runs, all stopped at teardown."""
    ups: list[SimUp] = []

    def make(*a: Any, **kw: Any) -> SimUp:
        u = SimUp(tmp_path, *a, **kw)
        ups.append(u)
        return u

    yield make
    for u in ups:
        u.stop()
