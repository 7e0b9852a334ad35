"""Hostile inputs: each is one line and exit 2, never a traceback, a
hang, or a file read from outside the bundle. Real `xpu-serve` subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from xpu_serve import exitcodes

BID = "20261130T000000Z-i1-process-crash"


def _xs(*args: str, stdin: int | None = subprocess.DEVNULL, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xpu_serve", *args], capture_output=True, text=True,
                          stdin=stdin, timeout=timeout)


def _bundle(tmp_path: Path) -> Path:
    b = tmp_path / "rt" / "bundles" / BID
    (b / "logs").mkdir(parents=True)
    return b


def test_bundles_show_never_follows_a_symlink_out_of_the_bundle(tmp_path: Path) -> None:
    b = _bundle(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("root:SECRET-HASH:20228:0:99999:7:::\n")
    (b / "summary.md").symlink_to(secret)
    (b / "incident.json").symlink_to(secret)
    (b / "bundle.json").write_text(json.dumps({"complete": True, "files": [], "errors": []}))
    r = _xs("bundles", "show", BID, "--runtime-dir", str(tmp_path / "rt"))
    assert r.returncode == exitcodes.OK, r.stderr
    assert "SECRET-HASH" not in r.stdout + r.stderr
    # a manifest saying complete is not believed when incident.json cannot be read
    assert "state: INCOMPLETE" in r.stdout and "incident.json missing or unreadable" in r.stdout
    r = _xs("bundles", "list", "--runtime-dir", str(tmp_path / "rt"), "--json")
    assert "SECRET-HASH" not in r.stdout
    # a link to an endless device is not read either
    (b / "bundle.json").unlink()
    (b / "bundle.json").symlink_to("/dev/zero")
    r = _xs("bundles", "show", BID, "--runtime-dir", str(tmp_path / "rt"), timeout=20)
    assert r.returncode == exitcodes.OK and "partial" in r.stdout


def test_bundles_show_manifest_of_wrong_types(tmp_path: Path) -> None:
    b = _bundle(tmp_path)
    (b / "bundle.json").write_text('{"complete":"yes","files":7,"errors":null}')
    (b / "incident.json").write_text("[1, 2]")
    r = _xs("bundles", "show", BID, "--runtime-dir", str(tmp_path / "rt"))
    assert r.returncode == exitcodes.OK, r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr
    # "yes" is not a completed manifest, and the writer did finish: damaged, not partial
    assert "state: INCOMPLETE" in r.stdout and "bundle.json unreadable" in r.stdout


def test_diagnose_refuses_a_symlink_inside_a_bundle(tmp_path: Path) -> None:
    b = _bundle(tmp_path)
    (b / "incident.json").write_text("{}")
    secret = tmp_path / "secret.log"
    secret.write_text("(Worker_TP0 pid=1) ERROR SECRET-LINE\n")
    (b / "logs" / "vllm.log").symlink_to(secret)
    r = _xs("diagnose", str(b))
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.strip() == f"xpu-serve diagnose: {b / 'logs' / 'vllm.log'}: a symlink inside a bundle: refused"
    assert "SECRET-LINE" not in r.stdout


def test_diagnose_with_stdin_closed() -> None:
    # the shell closes fd 0 before exec: Python then has no sys.stdin at all
    r = subprocess.run(["bash", "-c", f"exec '{sys.executable}' -m xpu_serve diagnose - <&-"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.strip() == "xpu-serve diagnose: -: standard input is closed"
    # closed after start-up: the read fails, still one line naming the input
    r = subprocess.run([sys.executable, "-c", "import os, sys; os.close(0); from xpu_serve.cli import main; "
                        "sys.exit(main(['diagnose', '-']))"], capture_output=True, text=True, timeout=30)
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.strip() == "xpu-serve diagnose: -: cannot read: Bad file descriptor"


def test_status_on_a_fifo_or_huge_state_file(tmp_path: Path) -> None:
    rt = tmp_path / "rt"
    rt.mkdir()
    os.mkfifo(rt / "state.json")
    r = _xs("status", "--runtime-dir", str(rt), timeout=20)
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.strip() == f"{rt / 'state.json'}: not a regular file"
    (rt / "state.json").unlink()
    with open(rt / "state.json", "wb") as f:
        f.write(b'{"x": "' + b"a" * (5 << 20) + b'"}')
    r = _xs("status", "--runtime-dir", str(rt))
    assert r.returncode == exitcodes.USAGE
    assert "larger than" in r.stderr and len(r.stdout) < 1000


def test_empty_runtime_dir_and_non_finite_stop_timeout_are_usage_errors(tmp_path: Path) -> None:
    # `--runtime-dir "$UNSET"` used to mean "no option": `up` then ran in the config's (relative)
    # runtime_dir while `status`/`stop` looked at /var/lib/xpu-serve; `stop --timeout nan` waited
    # for ever. Now each is one line and exit 2, before anything is started or signalled.
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"engine: {{model: m, command: [/bin/true]}}\nruntime_dir: {tmp_path / 'rt'}\n")
    for args in (
        ("up", "-c", str(cfg), "--runtime-dir", ""),
        ("status", "--runtime-dir", " "),
        ("stop", "--runtime-dir", ""),
        ("bundles", "list", "--runtime-dir", ""),
        ("stop", "--runtime-dir", str(tmp_path), "--timeout", "nan"),
        ("stop", "--runtime-dir", str(tmp_path), "--timeout", "-1"),
    ):
        r = _xs(*args, timeout=20)
        assert r.returncode == exitcodes.USAGE, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].endswith(
            ("must not be empty", "got 'nan'", "got '-1'")
        ), (args, r.stderr)
    assert not (tmp_path / "rt").exists()  # `up` started nothing


def test_diagnose_read_error_names_the_file() -> None:
    # reading /proc/self/mem from offset 0 fails with EIO: the line used to name "-" (stdin)
    r = _xs("diagnose", "/proc/self/mem")
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.strip() == "xpu-serve diagnose: /proc/self/mem: cannot read: Input/output error"


@pytest.mark.parametrize(
    "incident, manifest, problem",
    [
        (None, {"complete": True, "files": [], "errors": []}, "incident.json missing or unreadable"),
        (b"{", {"complete": True, "files": [], "errors": []}, "incident.json missing or unreadable"),
        (b'{"summary": "x"}', b"\x8d\x00garbage", "bundle.json unreadable"),
    ],
)
def test_bundles_list_does_not_call_a_damaged_bundle_complete(
    tmp_path: Path, incident: bytes | None, manifest: Any, problem: str
) -> None:
    """A bundle whose incident.json was missing or garbage while bundle.json said
    complete was listed `yes`; a garbage bundle.json was called "partial (the writer did not
    finish)". Now both are `no` with what is damaged, and diagnose still reads the logs."""
    b = _bundle(tmp_path)
    (b / "logs" / "vllm.log").write_text("x\n")
    if incident is not None:
        (b / "incident.json").write_bytes(incident)
    (b / "bundle.json").write_bytes(manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode())
    r = _xs("bundles", "list", "--runtime-dir", str(tmp_path / "rt"))
    assert r.returncode == exitcodes.OK, r.stderr
    row = r.stdout.splitlines()[1]
    assert row.split()[5] == "no" and f"DAMAGED: {problem}" in row, row
    r = _xs("bundles", "list", "--runtime-dir", str(tmp_path / "rt"), "--json")
    (info,) = json.loads(r.stdout)
    assert info["complete"] is False and info["problem"] == problem
    r = _xs("bundles", "show", BID, "--runtime-dir", str(tmp_path / "rt"))
    assert r.returncode == exitcodes.OK and "state: INCOMPLETE, " in r.stdout and problem in r.stdout


def test_status_of_a_dead_supervisor_promises_no_restart(tmp_path: Path) -> None:
    """state.json of a supervisor killed in backoff showed `next restart ... (in 1.2 s)`,
    a restart nobody would do. Now it says none is coming."""
    rt = tmp_path / "rt"
    rt.mkdir()
    import time

    (rt / "state.json").write_text(json.dumps(
        {"state": "backoff", "supervisor_pid": 2**22 + 7, "incarnation": 1, "restarts": 0,
         "next_restart_at": time.time() + 30}
    ))
    r = _xs("status", "--runtime-dir", str(rt))
    assert r.returncode == exitcodes.FAILURE, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("next restart"))
    assert "none: the supervisor that planned it" in row and "(in " not in row, row


@pytest.mark.parametrize("incident", ["[" * 100000 + "]" * 100000, '{"supervisor": 5}', '{"supervisor": {"processes": 7}}'])
def test_diagnose_bundle_with_a_hostile_incident_json(tmp_path: Path, incident: str) -> None:
    """An incident.json nested 100000 deep made `diagnose BUNDLE` end in "internal
    error: RecursionError" (exit 1). The incident is only a source of live facts: the verdict
    comes from the logs, exit 0."""
    b = _bundle(tmp_path)
    (b / "incident.json").write_text(incident)
    (b / "logs" / "vllm.log").write_text(
        "(Worker_TP0 pid=11) INFO 11-30 18:18:26 [gpu_model_runner.py:4481] Starting to load model m...\n"
        "Fatal Python error: Segmentation fault\n"
    )
    r = _xs("diagnose", str(b))
    assert r.returncode == exitcodes.OK, r.stderr
    assert "internal error" not in r.stderr and r.stdout.startswith("VERDICT:"), r.stdout + r.stderr


@pytest.mark.parametrize("where", ["model", "runtime_dir", "command"])
def test_check_with_a_path_component_too_long_is_a_finding(tmp_path: Path, where: str) -> None:
    """A 300-character path component in engine.model, runtime_dir or
    engine.command[0] made `check` end in "internal error: OSError: [Errno 36] File name too long"
    (exit 1). Now it is an error finding naming the field, exit 2."""
    long = "/" + "a" * 300
    cfg: dict[str, Any] = {"engine": {"model": "org/name"}, "runtime_dir": str(tmp_path / "rt")}
    field = {"model": "engine.model", "runtime_dir": "runtime_dir", "command": "engine.command[0]"}[where]
    if where == "model":
        cfg["engine"]["model"] = long
    elif where == "runtime_dir":
        cfg["runtime_dir"] = long
    else:
        cfg["engine"]["command"] = [long]
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    r = _xs("check", "-c", str(tmp_path / "c.yaml"))
    assert r.returncode == exitcodes.USAGE, r.stdout + r.stderr
    assert "internal error" not in r.stderr
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("error")]
    assert any(f"{field} {long}: File name too long" in ln for ln in errors), r.stdout


def test_check_model_that_is_a_fifo(tmp_path: Path) -> None:
    """engine.model naming a FIFO was reported as "does not exist"."""
    fifo = tmp_path / "model"
    os.mkfifo(fifo)
    (tmp_path / "c.yaml").write_text(json.dumps({"engine": {"model": str(fifo)}, "runtime_dir": str(tmp_path / "rt")}))
    r = _xs("check", "-c", str(tmp_path / "c.yaml"))
    assert r.returncode == exitcodes.USAGE
    assert f"engine.model {fifo} is neither a directory nor a regular file" in r.stdout, r.stdout


_HOLD_LOCK = (
    "import sys, time\nfrom pathlib import Path\nfrom xpu_serve.state import RuntimeLock\n"
    "RuntimeLock(Path(sys.argv[1])).acquire()\nprint('locked', flush=True)\ntime.sleep(60)\n"
)


def test_status_check_of_a_running_supervisor_with_a_bad_state_file(tmp_path: Path) -> None:
    """The lock held (a real flock, as `up` holds it) and state.json torn, NaN or multi-line:
    `not ready` (exit 1) in one line on stdout, never `no supervisor` (exit 2) or `ready`."""
    rt = tmp_path / "rt"
    rt.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(rt)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        now = __import__("time").time()
        for text, want in (
            ('{"state": "rea', "not ready: unreadable state: "),
            (json.dumps({"state": "ready", "written_at": float("nan"), "heartbeat_s": 5}),
             "not ready: unreadable state: written_at: nan is not a finite number"),
            (json.dumps({"state": "ready", "written_at": now, "heartbeat_s": float("inf")}),
             "not ready: unreadable state: heartbeat_s: inf is not a finite number"),
            (json.dumps({"state": "ready\nready", "reason": "a\nb", "written_at": now, "heartbeat_s": 5}),
             "not ready: ready ready: a b"),
        ):
            (rt / "state.json").write_text(text)
            r = _xs("status", "--check", "--runtime-dir", str(rt))
            assert r.returncode == 1 and r.stdout.startswith(want) and r.stdout.count("\n") == 1, (text, r)
    finally:
        holder.kill()
        holder.wait(10)
    (rt / "state.json").write_text("{")
    r = _xs("status", "--check", "--runtime-dir", str(rt))
    assert r.returncode == 2 and r.stdout.startswith(f"no supervisor: none holds the lock of {rt} (")
    assert "not valid JSON" in r.stdout and r.stdout.count("\n") == 1
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    r = _xs("status", "--runtime-dir", str(not_dir))
    assert (r.returncode, r.stderr) == (2, f"{not_dir / 'state.json'}: Not a directory\n")


def test_status_check_and_stop_with_a_fifo_for_the_lock_file(tmp_path: Path) -> None:
    """A FIFO where supervisor.lock should be: the probe (docker HEALTHCHECK) and `stop`
    blocked in open() until killed; now: no supervisor, at once."""
    rt = tmp_path / "rt"
    rt.mkdir()
    os.mkfifo(rt / "supervisor.lock")
    r = _xs("status", "--check", "--runtime-dir", str(rt), timeout=20)
    assert (r.returncode, r.stdout) == (2, f"no supervisor: none holds the lock of {rt}\n")
    r = _xs("stop", "--runtime-dir", str(rt), timeout=20)
    assert "Traceback" not in r.stderr and r.returncode in (exitcodes.OK, exitcodes.FAILURE), r


@pytest.mark.parametrize(("ranks", "named"), [
    ([{"rank": 0, "state": ["T"], "wait": "all_reduce"}, {"rank": 1, "state": "S", "wait": "all_reduce"}],
     None),
    ([{"rank": 0, "state": "T", "pid": "x", "process": {"a": 1}}, {"rank": 1, "state": "S", "wait": {"a": 1}}],
     "worker (rank 0) stopped (state T)"),
    ([{"rank": 0, "state": "S", "pid": [1], "process": 5, "wait": "outside"},
      {"rank": 1, "state": "S", "wait": "all_reduce"}],
     "worker (rank 0) is outside the collective while rank 1 waits in all_reduce"),
], ids=["list-state", "dict-process", "int-process"])
def test_diagnose_bundle_with_a_garbage_rank_states_fact(
    tmp_path: Path, ranks: list[dict[str, Any]], named: str | None
) -> None:
    """A rank-states fact in a bundle's facts.log with fields of the wrong type (a list for a
    state, a dict or int for a process) ended `diagnose BUNDLE` in a TypeError. The stuck rank is
    still named from the fields that are well typed, exit 0."""
    from datetime import datetime

    from xpu_serve import facts

    b = _bundle(tmp_path)
    (b / "incident.json").write_text("{}")
    (b / "logs" / "1").mkdir()
    (b / "logs" / "1" / "vllm.log").write_text(
        "(EngineCore_DP0 pid=10) INFO 12-02 05:00:00 [core.py:1] engine started\n"
    )
    lines = [facts.to_line(facts.rank_states(ranks), 1),
             facts.to_line(facts.hang(92.0, 1, 0, datetime(2026, 12, 2, 5, 0, 0)), 1)]
    (b / "logs" / "1" / facts.FACTS_LOG).write_text("\n".join(lines) + "\n")
    r = _xs("diagnose", str(b))
    assert r.returncode == exitcodes.OK, r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("VERDICT: engine-hang"), r.stdout
    if named is None:
        assert "(rank 0)" not in r.stdout, r.stdout
    else:
        assert named in r.stdout, r.stdout
