"""The head's verdict of a multi-node group through a real `xpu-serve diagnose` run: the head's
vllm.log (its TP rank 0 and EngineCore, as the simulator's multi-node mode and vLLM write them)
and its facts.log holding the death a follower reported (`Worker_TP1@node1`, the node's rank and
address, on the head's clock: group/watcher.py). The head's gloo errors naming the dead node's
address and its RPC timeouts after that death are consequences; the follower's death is the root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from xpu_serve import exitcodes, facts

GLOO = "[../third_party/gloo/gloo/transport/tcp/pair.cc:{line}] {what}"
CLOSED = "Connection closed by peer [{ip}]:52614"
RESET = "Read error [{ip}]:52614: Connection reset by peer"


def _head_log(stamp: str, error: str) -> str:
    """The head's vllm.log from start-up to its TP rank 0's failed collective and EngineCore's re-raise."""
    w = f"(Worker_TP0 pid=4101) ERROR {stamp} [multiproc_executor.py:817] "
    e = f"(EngineCore_DP0 pid=4100) ERROR {stamp} [core.py:938] "
    return "\n".join(
        [
            "(APIServer pid=4000) INFO 03-01 09:59:50 [api_server.py:1000] vLLM API server version 0.11.0",
            "(Worker_TP0 pid=4101) INFO 03-01 09:59:52 [cpu_model_runner.py:68] Starting to load model sim",
            "(APIServer pid=4000) INFO:     Application startup complete.",
            w + "WorkerProc hit an exception.",
            w + "Traceback (most recent call last):",
            w + '  File "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", line 2806, in all_reduce',
            w + "    work = group.allreduce([tensor], opts)",
            w + f"RuntimeError: {error}",
            e + "EngineCore encountered a fatal error.",
            e + "Traceback (most recent call last):",
            e + '  File "/usr/lib/python3/site-packages/vllm/v1/executor/multiproc_executor.py", line 273, in get_response',
            e + "    raise RuntimeError(",
            e + f"RuntimeError: Worker failed with error '{error}', please check the stack trace above for the root cause",
            "",
        ]
    )


def _remote_death(at: datetime, address: str) -> str:
    """The facts.log line of a follower's reported worker death (as GroupWatcher records it)."""
    ev = facts.process_exit("Worker_TP1@node1", 9012, 1, None, "SIGKILL", at=at.timestamp())
    ev.extra.update(node_rank=1, node_address=address)
    return facts.to_line(ev, 3) + "\n"


def _diagnose(tmp_path: Path, log: str, facts_log: str) -> dict[str, Any]:
    (tmp_path / "vllm.log").write_text(log)
    (tmp_path / "facts.log").write_text(facts_log)
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", "--json", str(tmp_path / "vllm.log"), str(tmp_path / "facts.log")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TZ": "UTC"},
    )
    assert out.returncode == exitcodes.OK and out.stderr == "", (out.returncode, out.stderr)
    return dict(json.loads(out.stdout))


def _at(sec: int, micro: int = 0) -> datetime:
    return datetime(2026, 3, 1, 10, 0, sec, micro, tzinfo=timezone.utc)


def _is_follower_root(v: dict[str, Any]) -> None:
    assert v["cause"] == "process-crash", v["summary"]
    assert (v["root"]["process"], v["root"]["rank"], v["root"]["pid"]) == ("Worker_TP1", 1, 9012)
    assert v["summary"].startswith("Worker_TP1 (rank 1, pid 9012) on node 1 was killed by SIGKILL"), v["summary"]


@pytest.mark.parametrize(
    ("what", "line"), [(CLOSED, 534), (RESET, 598)], ids=["closed-by-peer-idle", "reset-by-peer-in-a-step"]
)
def test_gloo_error_naming_the_dead_node_in_the_death_second_is_a_consequence(
    tmp_path: Path, what: str, line: int
) -> None:
    # the follower's death at 10:00:21.6 on the head's clock; vLLM stamps the head's error 10:00:21
    error = GLOO.format(line=line, what=what.format(ip="10.0.0.2"))
    v = _diagnose(tmp_path, _head_log("03-01 10:00:21", error), _remote_death(_at(21, 600_000), "10.0.0.2"))
    _is_follower_root(v)
    gloo = [c for c in v["consequences"] if c["signature"] == "gloo-peer-lost"]
    assert {c["process"] for c in gloo} == {"Worker_TP0", "EngineCore"}, v["consequences"]


def test_gloo_error_at_the_next_collective_long_after_the_death(tmp_path: Path) -> None:
    # idle: the head notices at its next collective, 21 s after the follower's worker died
    error = GLOO.format(line=534, what=CLOSED.format(ip="10.0.0.2"))
    v = _diagnose(tmp_path, _head_log("03-01 10:00:21", error), _remote_death(_at(0, 300_000), "10.0.0.2"))
    _is_follower_root(v)
    assert "gloo-peer-lost" in {c["signature"] for c in v["consequences"]}


def test_gloo_error_naming_another_address_is_not_that_death_s_consequence(tmp_path: Path) -> None:
    # the dead node is 10.0.0.3; the head lost its link to 10.0.0.2 in the same second: the head's
    # own collective failure stays the root (the address links a peer error to a death, not the clock)
    error = GLOO.format(line=534, what=CLOSED.format(ip="10.0.0.2"))
    v = _diagnose(tmp_path, _head_log("03-01 10:00:21", error), _remote_death(_at(21, 600_000), "10.0.0.3"))
    assert v["cause"] == "collective-failure", v["summary"]
    assert v["root"]["rank"] == 0 and "Connection closed by peer [10.0.0.2]" in v["root"]["text"], v["root"]


def test_a_remote_exit_stamped_after_the_head_s_own_failure_is_still_the_root(tmp_path: Path) -> None:
    # as measured on the simulator's group under load: the follower's worker is SIGKILLed at
    # 10:00:20.98, the head's gloo error is stamped 10:00:20 and its EngineCore exits at 20.998,
    # while the follower's exit time on the head's clock reads 21.008 (its exit is reported after
    # its sockets closed; the offset is measured within a round trip)
    error = GLOO.format(line=598, what=RESET.format(ip="10.0.0.2"))
    core = facts.process_exit("EngineCore", 4100, None, 1, None, at=_at(20, 998_000).timestamp())
    tp0 = facts.process_exit("Worker_TP0", 4101, 0, 0, None, at=_at(20, 997_000).timestamp())
    lines = facts.to_line(tp0, 13) + "\n" + facts.to_line(core, 13) + "\n" + _remote_death(_at(21, 8_000), "10.0.0.2")
    v = _diagnose(tmp_path, _head_log("03-01 10:00:20", error), lines)
    _is_follower_root(v)
    assert {"gloo-peer-lost", "process-exited"} <= {c["signature"] for c in v["consequences"]}, v["consequences"]


def test_an_ipv4_mapped_channel_address_names_the_same_node(tmp_path: Path) -> None:
    error = GLOO.format(line=598, what=RESET.format(ip="10.0.0.2"))
    v = _diagnose(
        tmp_path, _head_log("03-01 10:00:21", error), _remote_death(_at(21, 600_000), "::ffff:10.0.0.2")
    )
    _is_follower_root(v)


def test_rpc_timeout_on_the_head_after_a_remote_death_is_a_consequence(tmp_path: Path) -> None:
    e = "(EngineCore_DP0 pid=4100) ERROR 03-01 10:05:21 [core.py:938] "
    log = "\n".join(
        [
            "(APIServer pid=4000) INFO 03-01 09:59:50 [api_server.py:1000] vLLM API server version 0.11.0",
            "(APIServer pid=4000) INFO:     Application startup complete.",
            e + "EngineCore encountered a fatal error.",
            e + "Traceback (most recent call last):",
            e + '  File "/usr/lib/python3/site-packages/vllm/v1/executor/multiproc_executor.py", line 262, in get_response',
            e + "    raise TimeoutError(f\"RPC call to {method} timed out.\") from e",
            e + "TimeoutError: RPC call to execute_model timed out.",
            "",
        ]
    )
    v = _diagnose(tmp_path, log, _remote_death(_at(21, 600_000), "10.0.0.2"))
    _is_follower_root(v)
    assert "rpc-timeout" in {c["signature"] for c in v["consequences"]}, v["consequences"]
