"""The head's node folders (`group.watcher.write_node_folders`): every node's death on the head's
clock, the first one named, only the failed epoch's incidents. A follower's readiness in a new
epoch (`GroupWatcher.ready_gate`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from xpu_serve.config import load_config
from xpu_serve.group.channel import GroupFollower, GroupHead, Incident, ReceivedIncident
from xpu_serve.group.watcher import GroupWatcher, write_node_folders

SECRET = "group-test-secret-0123456789"


def _rec(node: int, epoch: int, rank: int, t: float, offset: float) -> ReceivedIncident:
    inc = Incident(
        node_rank=node,
        epoch=epoch,
        rank=rank,
        time=t,
        cause="process-exit",
        process=f"Worker_TP{rank}",
        message=f"Worker_TP{rank} killed by SIGKILL",
    )
    return ReceivedIncident(inc, "10.200.0.2", t + offset + 0.01, t + offset)


def test_first_death_on_the_heads_clock_and_only_the_failed_epoch(tmp_path: Path) -> None:
    head = GroupHead(SECRET, nnodes=3)
    # node 2's clock is 5 s behind the head's: its death at 100.0 is 105.0 on the head's clock,
    # after node 1's at 103.0 (its clock 2 s ahead: 105.0 - 2.0), though its own stamp is smaller
    head.incidents += [_rec(2, 1, 2, 100.0, 5.0), _rec(1, 1, 1, 105.0, -2.0), _rec(1, 2, 1, 50.0, 0.0)]
    contract = {
        "cause": "process-crash",
        "summary": "s",
        "supervisor": {"trigger": {"kind": "process-exit", "rank": 0, "process": "Worker_TP0", "at": 104.0}},
    }
    out = write_node_folders(tmp_path, head, contract, epoch=1)
    g = json.loads((out / "group.json").read_text())
    assert g["epoch"] == 1
    assert [(d["node_rank"], d["rank"], d["time"]) for d in g["deaths"]] == [
        (1, 1, 103.0),
        (0, 0, 104.0),
        (2, 2, 105.0),
    ]
    assert g["first_death"]["node_rank"] == 1
    n2 = json.loads((out / "node2" / "incident.json").read_text())
    assert (n2["time"], n2["head_time"], n2["clock_offset_s"], n2["epoch"]) == (100.0, 105.0, 5.0, 1)
    assert json.loads((out / "node0" / "summary.json").read_text())["cause"] == "process-crash"
    assert (out / "node1" / "incident.json").stat().st_mode & 0o777 == 0o600


def test_a_group_trigger_on_the_head_is_not_a_death(tmp_path: Path) -> None:
    head = GroupHead(SECRET, nnodes=2)
    contract = {
        "cause": "node-unreachable",
        "supervisor": {"trigger": {"kind": "node-unreachable", "at": 1.0}},
    }
    g = json.loads((write_node_folders(tmp_path, head, contract, epoch=3) / "group.json").read_text())
    assert g == {"epoch": 3, "deaths": [], "first_death": None}


def test_a_follower_is_not_ready_in_a_new_epoch_on_the_head_s_ready_of_the_last_one(tmp_path: Path) -> None:
    """Measured with the real engine across two network namespaces (tests/realvllm/
    test_group_real.py): after a group restart, node 1 was `ready` 0.03 s after its launch into
    epoch 2, 77 s before the head, on the head's `ready` answered in epoch 1. Ready again only
    once the head answers `ready` in the new epoch."""
    cfg_path = tmp_path / "follower.yaml"
    cfg_path.write_text(
        "engine:\n  model: m\n  tensor_parallel_size: 2\ngroup:\n  role: follower\n  nnodes: 2\n"
        f"  node_rank: 1\n  master_addr: 10.200.0.1\n  secret: {SECRET}\n"
    )
    w = GroupWatcher(load_config(cfg_path))

    async def register(pid: int) -> dict[str, Any]:
        return {}

    async def flow() -> tuple[bool, bool]:
        w.follower = GroupFollower(w.g.head_url, SECRET, 1)
        w.follower.register = register  # type: ignore[method-assign]
        w.head_state = "ready"  # the head's answers of epoch 1, before the group restart
        await w.before_launch(lambda: False)  # epoch 2's launch
        gate = asyncio.ensure_future(w.ready_gate(None))  # type: ignore[arg-type]
        await asyncio.sleep(0.3)
        early = gate.done()
        w.head_state = "ready"  # the head's first `ready` answer in epoch 2
        await asyncio.wait_for(gate, 2)
        return early, gate.done()

    early, later = asyncio.run(flow())
    assert (early, later) == (False, True)


def test_a_follower_stopped_by_a_group_restart_names_no_stall_of_a_rank_it_does_not_run() -> None:
    """Measured on node 1 (TP rank 1) with the real engine, its tree stopped for the head's
    epoch 3: its own verdict read "startup-hang: Start-up stalled after phase load-model; rank 0
    did not reach dist-init" (no API server's ready lines on a follower). The group restart is
    what happened: the head's verdict is the group's, this node's says so."""
    from xpu_serve.analysis.incident import Incident, Root
    from xpu_serve.analysis.supervised import complete
    from xpu_serve.incarnation import Trigger
    from xpu_serve.signatures import load_table

    stall = "Start-up stalled after phase load-model; rank 0 did not reach dist-init"
    root = Root(
        "vllm", "Worker_TP0", 0, None, "12-03 11:59:21", "vllm.log", 36, "Loading weights took 0.02 seconds"
    )
    detail = "the head started epoch 3 (group restart): node 1 captures and stops"
    trig = Trigger(kind="group-restart", detail=detail, at=1.0, process="node0")
    inc = Incident(cause="startup-hang", summary=stall, root=root)
    complete(inc, trig, load_table())
    assert (inc.cause, inc.root, inc.summary) == ("unknown", None, detail)
    assert any(stall in n for n in inc.notes), inc.notes
    # a real death on the follower stays its verdict
    crash = Incident(cause="process-crash", summary="Worker_TP1 (rank 1) was killed by SIGKILL", root=root)
    complete(crash, trig, load_table())
    assert crash.cause == "process-crash" and crash.root is root
