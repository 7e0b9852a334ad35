"""`xpu-serve bundles list|show|path` and `xpu-serve bundle`, run as real subprocesses."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_bundle import INCIDENT, PY_CHILD, FakeCtx, make_config, trigger
from xpu_serve import exitcodes
from xpu_serve.bundle import BundleRequestWatcher, write_incident_bundle
from xpu_serve.incarnation import ProcessInfo
from xpu_serve.state import RuntimeLock, write_state


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xpu_serve", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def py_child() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", PY_CHILD], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def test_bundles_list_show_path(tmp_path: Path, py_child: subprocess.Popen[bytes]) -> None:
    rt = tmp_path / "rt"
    assert cli("bundles", "--runtime-dir", str(rt), "list").stdout.startswith("no bundles under")
    ctx = FakeCtx(4, make_config(tar=True), rt, time.time() - 10, time.time() - 5,
                  {py_child.pid: ProcessInfo("APIServer", py_child.pid)})
    first = write_incident_bundle(ctx, trigger(), INCIDENT, "REPORT-ONE\n", None)
    second = write_incident_bundle(ctx, trigger(), {**INCIDENT, "cause": "gpu-fault", "summary": "engine reset "
                                   + "consequences " * 12}, "REPORT-TWO\n", None)
    assert first.path and second.path

    r = cli("bundles", "--runtime-dir", str(rt), "list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["ID", "CAUSE", "INC"]
    assert lines[1].startswith(first.path.name) and "umd-segfault" in lines[1] and " yes " in lines[1]
    assert lines[2].startswith(second.path.name) and "gpu-fault" in lines[2] and "engine reset" in lines[2]
    assert lines[2].endswith("consequences…")  # a long summary is cut between words

    r = cli("bundles", "list", "--json", "--runtime-dir", str(rt))
    data = json.loads(r.stdout)
    assert [d["id"] for d in data] == [first.path.name, second.path.name]
    assert data[0]["incarnation"] == 4 and data[0]["complete"] is True and data[0]["size_bytes"] > 1000

    r = cli("bundles", "--runtime-dir", str(rt), "show", "latest")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"bundle {second.path.name}\n")
    assert "REPORT-TWO" in r.stdout and "incident.json" in r.stdout and "kernel.log" in r.stdout

    r = cli("bundles", "--runtime-dir", str(rt), "path", first.path.name)
    assert r.returncode == 0 and r.stdout.strip() == str(first.path)
    r = cli("bundles", "--runtime-dir", str(rt), "path", "--tar", first.path.name)
    assert r.stdout.strip() == f"{first.path}.tar.gz" and Path(r.stdout.strip()).is_file()
    r = cli("bundles", "--runtime-dir", str(rt), "show", "--json", "gpu-fault")  # a unique substring
    assert json.loads(r.stdout)["incident"]["summary"] == "engine reset " + "consequences " * 12

    for args, msg in [(("show", "nope"), f"xpu-serve bundles show: no bundle matches 'nope' under {rt / 'bundles'}"),
                      (("path",), "xpu-serve bundles path: an ID is required"),
                      (("show", "2"), "xpu-serve bundles show: '2' matches 2 bundles")]:
        r = cli("bundles", "--runtime-dir", str(rt), *args)
        assert r.returncode == exitcodes.USAGE
        assert r.stderr.startswith(msg) and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bundle_standalone_from_state_json(tmp_path: Path, py_child: subprocess.Popen[bytes]) -> None:
    rt = tmp_path / "rt"
    rt.mkdir()
    (rt / "logs" / "7").mkdir(parents=True)
    (rt / "logs" / "7" / "vllm.log").write_text("(APIServer pid=1) INFO hello\n")
    import psutil

    write_state(rt, {"state": "ready", "incarnation": 7, "restarts": 6, "supervisor_pid": 999999,
                     "processes": [{"name": "APIServer", "pid": py_child.pid, "rank": None,
                                    "started_at": psutil.Process(py_child.pid).create_time()}]})
    r = cli("bundle", "--runtime-dir", str(rt), "--note", "operator looked at it")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == (
        f"no supervisor runs for {rt}: writing the bundle here from its state file and the last incarnation's logs"
    )
    path = Path(r.stdout.strip())
    assert path.parent == rt / "bundles" and path.name.endswith("-i7-snapshot")
    inc = json.loads((path / "incident.json").read_text())
    assert inc["supervisor"]["trigger"]["kind"] == "operator"
    assert "operator looked at it" in inc["notes"] and inc["supervisor"]["restarts"] == 6
    summary = (path / "summary.md").read_text()
    assert "ready to snapshot:" in summary and "ready to failure" not in summary
    assert "very_distinct_function_name" in (path / "stacks" / f"{py_child.pid}-APIServer.txt").read_text()
    assert (path / "logs" / "vllm.log").read_text() == "(APIServer pid=1) INFO hello\n"


def test_bundle_asks_the_running_supervisor(tmp_path: Path, py_child: subprocess.Popen[bytes]) -> None:
    """A lock holder with the request watcher answers; the CLI prints the supervisor's bundle."""
    rt = tmp_path / "rt"
    rt.mkdir()
    lock = RuntimeLock(rt)
    lock.acquire()
    ctx = FakeCtx(2, make_config(), rt, time.time() - 10, time.time() - 5,
                  {py_child.pid: ProcessInfo("EngineCore", py_child.pid)})
    loop = asyncio.new_event_loop()
    task_box: list[asyncio.Task[None]] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        task_box.append(loop.create_task(BundleRequestWatcher(interval_s=0.1).run(ctx)))
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        r = cli("bundle", "--runtime-dir", str(rt), "--json", "--note", "via supervisor")
        assert r.returncode == 0, r.stderr
        ans = json.loads(r.stdout)
        assert ans["taken_by"].startswith("supervisor pid ") and ans["complete"] is True
        path = Path(ans["path"])
        assert path.name.endswith("-i2-snapshot")
        assert "very_distinct_function_name" in (path / "stacks" / f"{py_child.pid}-EngineCore.txt").read_text()
        assert ctx.failed == []  # a snapshot is not a failure
        assert not list((rt / "requests").iterdir())  # request and answer files cleaned up
    finally:
        async def stop() -> None:
            for tk in task_box:
                tk.cancel()
            await asyncio.gather(*task_box, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        t.join(timeout=5)
        loop.close()
        lock.release()


def test_bundle_falls_back_when_the_supervisor_does_not_answer(tmp_path: Path) -> None:
    rt = tmp_path / "rt"
    rt.mkdir()
    lock = RuntimeLock(rt)
    lock.acquire()  # a "supervisor" without the watcher
    try:
        r = cli("bundle", "--runtime-dir", str(rt))
        assert r.returncode == 0, r.stderr
        assert "did not answer the request; writing the bundle here" in r.stderr
        assert Path(r.stdout.strip()).name.endswith("-i0-snapshot")
        assert not list((rt / "requests").iterdir())  # the request was withdrawn
    finally:
        lock.release()


def test_bundle_bad_config_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  model: m\nbundles:\n  keep: -1\n")
    r = cli("bundle", "-c", str(bad), "--runtime-dir", str(tmp_path))
    assert r.returncode == exitcodes.USAGE and "Traceback" not in r.stderr
    assert "bundles.keep" in r.stderr
