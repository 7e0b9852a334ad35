"""`xpu-serve up` end to end: real supervisor, real simulator process tree, real signals and files.

Each test runs `python -m xpu_serve up` as a child (own session) on a config written to a tmp dir
(free port, time-scaled simulator, a unique XPU_SERVE_SIM_DIST_TAG so the test knows exactly which
/dev/shm and /tmp/vllm_dist_* entries are its own). Teardown kills the supervisor and sweeps every
process carrying its run id, whatever happened.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from xpu_serve import cleanup, exitcodes
from xpu_serve.state import pid_alive

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    def start(self, *extra: str) -> Up:
        self.out = open(self.tmp / f"up-{len(self.run_ids)}.out", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xpu_serve", "up", "-c", str(self.config), "--log-format", "json", *extra],
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
        evs = [json.loads(x) for x in lines if x.strip()]
        return [e for e in evs if name is None or e["event"] == name]

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
        if self.proc is not None and self.proc.poll() is None:
            with_suppress(lambda: os.killpg(self.proc.pid, signal.SIGKILL))  # type: ignore[union-attr]
            self.proc.wait(10)
        for pid in self.our_pids():
            with_suppress(lambda p=pid: os.kill(p, signal.SIGKILL))
        for path in self.our_segments():
            with_suppress(lambda p=path: os.unlink(p))
        if hasattr(self, "out"):
            self.out.close()


def proc_connector_available() -> bool:
    from xpu_serve.sources.processes import ProcConnector

    c = ProcConnector.open()
    if c is None:
        return False
    c.close()
    return True


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


def _assert_nothing_left(u: Up, segments_seen: set[str]) -> None:
    """No process of ours; none of our segments, except those the supervisor kept, on purpose,
    because another vLLM (another engineer's or test's tree on this shared host) started when they
    appeared and ours never mapped them: "never another's" wins over "remove everything"."""
    u.wait_for(lambda: not u.our_pids(), 10, "no process of ours left")
    kept: dict[str, str] = {}
    for e in u.events("cleaned") + u.events("orphans"):
        kept.update(e.get("kept") or {})
    left = [s for s in segments_seen | set(u.our_segments()) if os.path.exists(s)]
    unexplained = [s for s in left if not kept.get(s, "").startswith("another vLLM started")]
    assert not unexplained, f"segments left behind: {unexplained} (kept: {kept})"


# ------------------------------------------------------------------------------------------------


def test_worker_segv_detected_recorded_restarted(up_factory: Any) -> None:
    u = up_factory(tp=4, faults="worker-segv rank=0 after=50 incarnation=1").start()
    st1 = u.wait_tree(1)
    w0 = next(p for p in st1["processes"] if p["name"] == "Worker_TP0")
    inc1_pids = {p["pid"] for p in st1["processes"]}
    assert u.our_segments(), "the simulator made its /dev/shm and /tmp/vllm_dist_* entries"
    st2 = u.wait_tree(2)
    assert st2["restarts"] == 1
    li = st2["last_incident"]
    # the verdict is the Analyzer's (issue 5); on the simulator's log it names the worker's crash
    # or EngineCore's re-raised exception: the supervisor records whichever it returns
    assert li["cause"] in ("process-crash", "process-exception")
    assert Path(li["bundle"]).is_dir() and li["bundle"].endswith(f"-i1-{li['cause']}")
    inc = json.loads((Path(li["bundle"]) / "incident.json").read_text())
    assert inc["cause"] == li["cause"]
    w0_after = next(p for p in inc["supervisor"]["processes"] if p["name"] == "Worker_TP0")
    if proc_connector_available():  # the exit status of a grandchild: root on the host
        assert w0_after["signal"] == "SIGSEGV"
    failed = u.events("failed")[0]
    assert failed["incarnation"] == 1
    # the trigger is the worker's death (pidfd) or, when EngineCore is quicker, its fatal line
    assert failed["trigger"] in ("process-exit", "fatal-line")
    if failed["trigger"] == "process-exit":
        assert failed["pid"] == w0["pid"] and failed["rank"] == 0
    sched = u.events("restart-scheduled")[0]
    assert sched["cause"] == li["cause"] and sched["delay_s"] == pytest.approx(0.2, abs=0.01)
    cleaned = u.events("cleaned")[0]
    assert cleaned["left"] == []
    # nothing of incarnation 1 survives; its segments are gone or re-created by incarnation 2
    assert not [p for p in inc1_pids if pid_alive(p)]
    assert u.events("incident")[0]["bundle"] == li["bundle"]
    # the incarnation's log and the echo tagged with the incarnation
    assert "Worker_TP0" in (u.runtime / "logs" / "1" / "vllm.log").read_text()
    u.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert u.exit_code() == exitcodes.OK
    _assert_nothing_left(u, set())
    assert "[i1] " in (u.tmp / "up-0.out").read_text() and "[i2] " in (u.tmp / "up-0.out").read_text()


def test_engine_core_crash_restarts(up_factory: Any) -> None:
    u = up_factory(faults="engine-crash after=30 incarnation=1").start()
    st = u.wait_tree(2)
    assert st["restarts"] == 1 and st["last_incident"]["cause"] in ("process-crash", "process-exception")
    f = u.events("failed")[0]
    assert f["trigger"] in ("process-exit", "fatal-line")
    u.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert u.exit_code() == 0
    _assert_nothing_left(u, set())


def test_api_server_sigkill_orphans_are_swept(up_factory: Any) -> None:
    """With `orphans`, EngineCore and workers outlive a SIGKILLed API server: the sweep finds them."""
    u = up_factory(faults="orphans incarnation=1").start()
    st = u.wait_tree(1)
    api = next(p["pid"] for p in st["processes"] if p["name"] == "APIServer")
    rest = {p["pid"] for p in st["processes"] if p["name"] != "APIServer"}
    os.kill(api, signal.SIGKILL)
    st2 = u.wait_tree(2)
    f = u.events("failed")[0]
    assert f["trigger"] == "process-exit" and f["process"] == "APIServer" and f["signal"] == "SIGKILL"
    assert not [p for p in rest if pid_alive(p)], "orphans of incarnation 1 were swept"
    cleaned = u.events("cleaned")[0]
    assert set(cleaned["killed"]) | rest >= rest  # stopped by SIGTERM or SIGKILL
    assert st2["restarts"] == 1


def test_startup_failure_loop_backs_off_then_gives_up(up_factory: Any) -> None:
    u = up_factory(
        faults="device-oom rank=1",
        restart={"initial_delay_s": 0.1, "multiplier": 2, "max_delay_s": 10, "max_failures": 4},
    ).start()
    assert u.exit_code(90) == exitcodes.GAVE_UP
    st = u.state()
    assert st["state"] == "gave-up" and "crash loop" in st["reason"]
    sched = u.events("restart-scheduled")
    assert len(sched) == 3
    ceilings = [float(re.search(r"ceiling ([\d.]+) s", e["msg"]).group(1)) for e in sched]  # type: ignore[union-attr]
    assert ceilings == [0.1, 0.2, 0.4]
    assert sched[0]["delay_s"] == pytest.approx(0.1, abs=0.005)
    assert all(0.1 - 1e-6 <= e["delay_s"] <= c + 1e-6 for e, c in zip(sched, ceilings, strict=True))
    assert u.events("gave-up")[0]["exit_code"] == exitcodes.GAVE_UP
    assert st["last_incident"]["cause"] == "device-oom"
    _assert_nothing_left(u, set())


def test_config_error_gives_up_at_once(up_factory: Any) -> None:
    u = up_factory(engine={"args": {"max-num-seqs": "lots"}}).start()
    assert u.exit_code(60) == exitcodes.GAVE_UP_AT_ONCE
    st = u.state()
    assert st["state"] == "gave-up" and st["incarnation"] == 1 and not u.events("restart-scheduled")
    assert st["last_incident"]["cause"] == "config-error"
    assert "restart cannot fix" in st["reason"]


def test_engine_not_executable_gives_up_at_once(up_factory: Any) -> None:
    u = up_factory(engine={"command": [str(Path("/nonexistent/vllm")), "serve"]}).start()
    assert u.exit_code(60) == exitcodes.GAVE_UP_AT_ONCE
    assert "cannot start '/nonexistent/vllm'" in u.state()["reason"]


@pytest.mark.parametrize("when", ["starting", "ready", "backoff"])
def test_sigterm_stops_everything_exit_0(up_factory: Any, when: str) -> None:
    if when == "starting":
        u = up_factory(faults="slow-start seconds=2000").start()
        u.wait_for(lambda: len(u.state().get("processes", [])) >= 3, 30, "tree started")
        assert u.state()["state"] == "starting"
    elif when == "ready":
        u = up_factory().start()
        u.wait_tree(1)
    else:
        u = up_factory(
            faults="worker-exit rank=1 code=3 after=10 incarnation=1", restart={"initial_delay_s": 60}
        )
        u.start()
        u.wait_state("backoff", 1)
    seen = set(u.state().get("cleanup", {}).get("shm", []))
    u.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert u.exit_code(30) == exitcodes.OK
    assert u.state()["state"] == "stopped"
    _assert_nothing_left(u, seen)


def test_second_sigint_kills_at_once(up_factory: Any) -> None:
    u = up_factory(
        faults="worker-hang rank=0 after=5", stop={"grace_s": 30, "port_free_timeout_s": 10}
    ).start()
    u.wait_tree(1)
    time.sleep(0.3)  # the hung worker ignores SIGTERM: only SIGKILL ends it
    t0 = time.monotonic()
    u.proc.send_signal(signal.SIGINT)  # type: ignore[union-attr]
    u.wait_for(lambda: u.state().get("state") == "stopping", 10, "stopping")
    u.proc.send_signal(signal.SIGINT)  # type: ignore[union-attr]
    assert u.exit_code(30) == 0
    assert time.monotonic() - t0 < 20  # well under the 30 s grace
    _assert_nothing_left(u, set())


def test_sighup_is_a_planned_restart(up_factory: Any) -> None:
    u = up_factory().start()
    u.wait_tree(1)
    u.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    st = u.wait_tree(2)
    assert st["restarts"] == 1 and st["failures"] == 0 and st["last_incident"] is None
    assert not u.events("failed")


def test_kill_9_supervisor_next_up_cleans_orphans(up_factory: Any) -> None:
    u = up_factory().start()
    st = u.wait_tree(1)
    old = {p["pid"] for p in st["processes"]}
    os.kill(u.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
    u.proc.wait(10)  # type: ignore[union-attr]
    assert all(pid_alive(p) for p in old), "the engine outlives its supervisor"
    u.start()
    st2 = u.wait_tree(1)
    assert not [p for p in old if pid_alive(p)]
    orphans = u.events("orphans")
    assert orphans and set(orphans[0]["pids"]) >= old
    assert st2["run_id"] != st["run_id"]
    u.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert u.exit_code() == 0
    _assert_nothing_left(u, set())


def test_port_taken_by_another_program(up_factory: Any) -> None:
    u = up_factory()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", u.port))
    s.listen()
    try:
        u.start()
        assert u.exit_code(30) == exitcodes.GAVE_UP_AT_ONCE
        reason = u.state()["reason"]
        assert (
            f"port 127.0.0.1:{u.port} is taken by another program" in reason
            and f"pid {os.getpid()}" in reason
        )
        assert "gave-up" in u.stderr()
    finally:
        s.close()


def test_second_supervisor_on_same_runtime_dir_is_locked(up_factory: Any, xpu_serve_cmd: list[str]) -> None:
    u = up_factory().start()
    u.wait_tree(1)
    p = subprocess.run(
        [*xpu_serve_cmd, "up", "-c", str(u.config)], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == exitcodes.LOCKED
    assert f"in use by another xpu-serve supervisor (pid {u.proc.pid})" in p.stderr  # type: ignore[union-attr]
    # status and stop see the running supervisor
    s = subprocess.run(
        [*xpu_serve_cmd, "status", "--runtime-dir", str(u.runtime), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert s.returncode == 0
    doc = json.loads(s.stdout)
    assert doc["supervisor_alive"] is True and doc["state"] == "ready" and len(doc["processes"]) == 4
    t = subprocess.run(
        [*xpu_serve_cmd, "status", "--runtime-dir", str(u.runtime)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "Worker_TP1" in t.stdout and "running" in t.stdout
    stop = subprocess.run(
        [*xpu_serve_cmd, "stop", "--runtime-dir", str(u.runtime)], capture_output=True, text=True, timeout=60
    )
    assert stop.returncode == 0
    assert u.exit_code() == 0
    s2 = subprocess.run(
        [*xpu_serve_cmd, "status", "--runtime-dir", str(u.runtime)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert s2.returncode == 1 and "not running" in s2.stdout and "stopped" in s2.stdout


def test_status_says_when_supervisor_is_dead(up_factory: Any, xpu_serve_cmd: list[str]) -> None:
    u = up_factory().start()
    u.wait_tree(1)
    os.kill(u.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
    u.proc.wait(10)  # type: ignore[union-attr]
    s = subprocess.run(
        [*xpu_serve_cmd, "status", "--runtime-dir", str(u.runtime)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert s.returncode == 1
    assert f"supervisor pid {u.proc.pid} is dead" in s.stdout  # type: ignore[union-attr]
