"""The head's node folders (`group.watcher.write_node_folders`): every node's death on the head's
clock, the first one named, only the failed epoch's incidents."""

from __future__ import annotations

import json
from pathlib import Path

from xpu_serve.group.channel import GroupHead, Incident, ReceivedIncident
from xpu_serve.group.watcher import write_node_folders

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
