"""A multi-node group of two `xpu-serve up` supervisors on the simulator's multi-node mode, on
127.0.0.1 (different ports and runtime directories): the head (node 0, TP rank 0, the API
server) and a `--headless` follower (node 1, TP rank 1). The flows of docs/multi-node.md,
"States": a follower's worker killed, the head supervisor SIGKILLed, the follower supervisor
SIGSTOPped; each checked for its verdict, the group restart and nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness import Up, _free_port

pytestmark = pytest.mark.timeout(240)

SECRET = "group-test-secret-0123456789"


def _pair(tmp: Path, peer_timeout_s: float = 3.0) -> tuple[Up, Up]:
    master, channel = _free_port(), _free_port()
    head, fol = Up(tmp / "head", tp=2), Up(tmp / "follower", tp=2)
    for u, role, rank in ((head, "head", 0), (fol, "follower", 1)):
        u.cfg["group"] = {
            "role": role,
            "nnodes": 2,
            "node_rank": rank,
            "master_addr": "127.0.0.1",
            "master_port": master,
            "peer_timeout_s": peer_timeout_s,
            "heartbeat_interval_s": 0.5,
            "listen": f"127.0.0.1:{channel}",
            "secret": SECRET,
        }
        u.write_config()
    return head, fol


@pytest.fixture
def group(tmp_path: Path) -> Iterator[tuple[Up, Up]]:
    for d in ("head", "follower"):
        (tmp_path / d).mkdir()
    head, fol = _pair(tmp_path)
    try:
        head.start()
        fol.start()
        head.wait_state("ready", 1, timeout=90)
        fol.wait_state("ready", 1, timeout=30)
        yield head, fol
    finally:
        for u in (head, fol):
            u.kill_all()


def _pids(u: Up, name: str) -> list[int]:
    return [p["pid"] for p in u.state().get("processes", []) if p["name"] == name]


def _incident(u: Up, n: int = 0) -> dict[str, Any]:
    u.wait_for(lambda: len(u.events("incident")) > n, 60, "an incident")
    return u.events("incident")[n]


def _group_json(u: Up, bundle: Path) -> dict[str, Any]:
    """BUNDLE/nodes/group.json, written by the head's group observer just after the `incident` event."""
    path = bundle / "nodes" / "group.json"
    u.wait_for(path.is_file, 10, str(path))
    return dict(json.loads(path.read_text()))


def _epoch_env(pid: int) -> str | None:
    """XPU_SERVE_GROUP_EPOCH in the environment of process `pid` (/proc/PID/environ)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    got = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"XPU_SERVE_GROUP_EPOCH=")]
    return got[0] if got else None


def _nothing_left(u: Up) -> None:
    u.wait_for(lambda: not u.our_pids() and not u.our_segments(), 30, "nothing left of the tree")


def test_group_ready_only_with_every_node_and_both_stop_clean(group: tuple[Up, Up]) -> None:
    head, fol = group
    joined = [e for e in fol.events("group") if "joined epoch 1" in e["msg"]]
    assert joined and joined[0]["epoch"] == 1
    assert head.events("group")[0]["epoch"] == 1
    # the follower runs only its headless MainProcess and TP rank 1
    names = {p["name"] for p in fol.state()["processes"]}
    assert "Worker_TP1" in names and "EngineCore" not in names and "Worker_TP0" not in names
    # every launch carries the group's epoch: state.json and the engine's environment
    assert head.state()["group_epoch"] == 1 and fol.state()["group_epoch"] == 1
    assert {_epoch_env(p["pid"]) for u in (head, fol) for p in u.state()["processes"]} == {"1"}
    for u in (fol, head):
        assert u.proc is not None
        u.proc.send_signal(signal.SIGTERM)
        assert u.exit_code(60) == 0
        _nothing_left(u)


def test_follower_worker_killed_head_names_node_and_rank_group_restarts(group: tuple[Up, Up]) -> None:
    head, fol = group
    (worker,) = _pids(fol, "Worker_TP1")
    killed_at = time.time()
    os.kill(worker, signal.SIGKILL)
    head.wait_for(lambda: head.events("failed"), 10, "the head's failure")
    failed = head.events("failed")[0]
    assert (
        failed["trigger"] == "node-death" and failed["rank"] == 1 and failed["process"].startswith("node1:")
    )
    # the death reached the head in about a second (generous bound: a loaded 2-core machine)
    print(f"follower death -> head failed: {failed['detected_at'] - killed_at:.3f} s")
    assert failed["detected_at"] - killed_at < 5.0
    inc = _incident(head)
    assert inc["cause"] == "process-crash", inc
    assert "Worker_TP1 (rank 1" in inc["msg"] and "on node 1 was killed by SIGKILL" in inc["msg"], inc
    bundle = Path(inc["bundle"])
    group_json = _group_json(head, bundle)
    assert group_json["epoch"] == 1
    assert group_json["first_death"]["node_rank"] == 1 and group_json["first_death"]["rank"] == 1
    node1 = json.loads((bundle / "nodes" / "node1" / "incident.json").read_text())
    assert node1["rank"] == 1 and node1["process"] == "Worker_TP1" and node1["clock_offset_s"] is not None
    assert (bundle / "nodes" / "node0" / "summary.json").is_file()
    # a group restart: both incarnations +1 under epoch 2, head first
    head.wait_state("ready", 2, timeout=90)
    fol.wait_state("ready", 2, timeout=30)
    assert [e for e in fol.events("group") if "joined epoch 2" in e["msg"]]
    assert head.state()["group_epoch"] == 2 and fol.state()["group_epoch"] == 2
    assert {_epoch_env(p["pid"]) for u in (head, fol) for p in u.state()["processes"]} == {"2"}
    head_launch2 = [e for e in head.events("launched") if e["incarnation"] == 2][0]["ts"]
    fol_launch2 = [e for e in fol.events("launched") if e["incarnation"] == 2][0]["ts"]
    assert head_launch2 <= fol_launch2
    assert len(head.events("incident")) == 1  # one incident for the group on the head
    for u in (fol, head):
        assert u.proc is not None
        u.proc.send_signal(signal.SIGTERM)
        assert u.exit_code(60) == 0
        _nothing_left(u)


def test_head_stopped_followers_stop_cleanly_without_an_incident(group: tuple[Up, Up]) -> None:
    """A planned stop of the head (SIGTERM to its supervisor, what `xpu-serve stop` sends): each
    follower stops its tree too, says the head stopped, writes no bundle and exits 0."""
    head, fol = group
    assert head.proc is not None and fol.proc is not None
    head.proc.send_signal(signal.SIGTERM)
    assert head.exit_code(60) == 0
    assert fol.exit_code(30) == 0
    said = [e for e in fol.events("group") if "the head stopped (a planned stop" in e["msg"]]
    assert len(said) == 1 and "node 1 stops its tree, no incident" in said[0]["msg"], fol.events("group")
    assert fol.events("failed") == [] and fol.events("incident") == []
    assert fol.events("stopped") and fol.state().get("state") == "stopped"
    bundles = fol.runtime / "bundles"
    assert not bundles.exists() or not any(bundles.iterdir())
    assert head.events("incident") == []
    for u in (head, fol):
        _nothing_left(u)


def test_head_supervisor_killed_follower_stops_its_tree(group: tuple[Up, Up]) -> None:
    head, fol = group
    assert head.proc is not None
    killed_at = time.time()
    os.kill(head.proc.pid, signal.SIGKILL)  # the supervisor alone: its engine lives on, orphaned
    head.proc.wait(10)
    fol.wait_for(lambda: fol.events("failed"), 30, "the follower's failure")
    failed = fol.events("failed")[0]
    assert failed["trigger"] == "head-lost", failed
    assert failed["ts"] - killed_at >= 3.0 - 0.5  # not before the peer timeout (from the last answer)
    inc = _incident(fol)
    assert "node-unreachable" in inc["msg"]
    # its tree is stopped and swept; the supervisor waits for a head
    fol.wait_for(
        lambda: (
            fol.state().get("state") in ("backoff", "starting")
            and fol.state().get("incarnation") >= 1
            and not _pids(fol, "Worker_TP1")
        ),
        30,
        "the follower's tree stopped",
    )
    fol.wait_for(lambda: any("waiting for the head" in e["msg"] for e in fol.events("group")), 30, "waiting")
    assert fol.state().get("incarnation") == 2 and not fol.state().get("processes")
    assert fol.proc is not None
    fol.proc.send_signal(signal.SIGTERM)
    assert fol.exit_code(60) == 0
    _nothing_left(fol)


def test_follower_supervisor_stopped_head_says_node_unreachable(group: tuple[Up, Up]) -> None:
    head, fol = group
    assert fol.proc is not None
    os.kill(fol.proc.pid, signal.SIGSTOP)
    try:
        head.wait_for(lambda: head.events("failed"), 30, "the head's failure")
        failed = head.events("failed")[0]
        assert failed["trigger"] == "node-unreachable" and failed["process"] == "node1", failed
        inc = _incident(head)
        assert inc["cause"] == "node-unreachable" and "node 1" in inc["msg"], inc
    finally:
        os.kill(fol.proc.pid, signal.SIGCONT)


def test_head_alone_rendezvous_stall_names_the_node_that_never_joined(tmp_path: Path) -> None:
    (tmp_path / "head").mkdir()
    (tmp_path / "follower").mkdir()
    head, _ = _pair(tmp_path)
    head.cfg["supervision"]["startup"]["stall_s"] = 4
    head.write_config()
    try:
        head.start()
        head.wait_for(lambda: head.events("failed"), 60, "the head's failure")
        failed = head.events("failed")[0]
        assert failed["trigger"] == "rendezvous-stall" and failed["process"] == "node1", failed
        # it never registered: no address is known for it
        assert "node 1 never joined epoch 1 (rendezvous stall, 4 s after the launch)" in failed["msg"], failed
        assert head.state().get("state") != "ready"
        inc = _incident(head)
        # the verdict names the node that never joined and its TP rank
        assert inc["cause"] == "startup-hang", inc
        assert ": node 1 never joined epoch 1 (rendezvous stall, 4 s after the launch); rank 1 did not reach " in inc[
            "msg"
        ], inc
        contract = json.loads((Path(inc["bundle"]) / "incident.json").read_text())
        assert any("node 1 never joined epoch 1" in n for n in contract.get("notes", [])), contract
    finally:
        head.kill_all()


def test_follower_gone_for_good_the_next_epoch_s_stall_names_its_node_and_address(tmp_path: Path) -> None:
    """The follower's supervisor and tree SIGKILLed: the head restarts the group (node
    unreachable), and epoch 2's rendezvous stall names node 1 with the address it registered from."""
    for d in ("head", "follower"):
        (tmp_path / d).mkdir()
    head, fol = _pair(tmp_path)
    head.cfg["supervision"]["startup"]["stall_s"] = 8
    head.write_config()
    try:
        head.start()
        fol.start()
        head.wait_state("ready", 1, timeout=90)
        fol.kill_all()
        head.wait_for(lambda: len(head.events("failed")) >= 2, 90, "epoch 2's stall")
        first, second = head.events("failed")[:2]
        assert first["trigger"] == "node-unreachable", first
        assert second["trigger"] == "rendezvous-stall" and second["process"] == "node1", second
        assert "node 1 (127.0.0.1) never joined epoch 2 (rendezvous stall, 8 s after the launch)" in second["msg"]
        inc = _incident(head, 1)
        assert inc["cause"] == "startup-hang", inc
        assert ": node 1 (127.0.0.1) never joined epoch 2 (rendezvous stall, 8 s after the launch); rank 1 did not " \
            "reach " in inc["msg"], inc
    finally:
        head.kill_all()
        fol.kill_all()


def test_follower_stopped_while_waiting_for_its_head_launches_nothing(tmp_path: Path) -> None:
    """A follower whose head never answers, stopped with SIGTERM while it waits to register:
    no engine is launched, exit 0, nothing left."""
    (tmp_path / "head").mkdir()
    (tmp_path / "follower").mkdir()
    _, fol = _pair(tmp_path)
    try:
        fol.start()
        fol.wait_for(
            lambda: any("waiting for the head" in e["msg"] for e in fol.events("group")), 60, "waiting for the head"
        )
        assert fol.proc is not None
        fol.proc.send_signal(signal.SIGTERM)
        assert fol.exit_code(60) == 0
        assert fol.events("launched") == [], fol.events("launched")
        assert any("stopped while waiting for the head" in e["msg"] for e in fol.events("group"))
        _nothing_left(fol)
    finally:
        fol.kill_all()


def test_head_worker_killed_follower_restarts_under_the_new_epoch(group: tuple[Up, Up]) -> None:
    head, fol = group
    (worker,) = _pids(head, "Worker_TP0")
    os.kill(worker, signal.SIGKILL)
    head.wait_for(lambda: head.events("failed"), 30, "the head's failure")
    assert head.events("failed")[0]["trigger"] == "process-exit"
    fol.wait_for(lambda: fol.events("failed"), 30, "the follower's failure")
    failed = fol.events("failed")[0]
    assert failed["trigger"] == "group-restart" and "epoch 2" in failed["msg"], failed
    head.wait_state("ready", 2, timeout=90)
    fol.wait_state("ready", 2, timeout=30)
    assert [e for e in fol.events("group") if "joined epoch 2" in e["msg"]]
    # the head's bundle: its own death first, no follower incident (the follower did not die)
    group_json = _group_json(head, Path(_incident(head)["bundle"]))
    assert group_json["first_death"]["node_rank"] == 0 and group_json["first_death"]["rank"] == 0
    assert not (Path(_incident(head)["bundle"]) / "nodes" / "node1").exists()


def test_follower_worker_killed_under_load_node1_died_first(group: tuple[Up, Up]) -> None:
    import threading
    import urllib.request

    head, fol = group
    body = json.dumps({"model": "sim", "prompt": "hello", "max_tokens": 4000}).encode()

    def post() -> None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{head.port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req, timeout=30).read()
        except Exception:
            pass

    t = threading.Thread(target=post, daemon=True)
    t.start()
    time.sleep(0.5)  # the request is in its steps
    (worker,) = _pids(fol, "Worker_TP1")
    os.kill(worker, signal.SIGKILL)
    inc = _incident(head)
    t.join(30)
    # under load the head's own tree fails within milliseconds of the follower's worker (its gloo
    # "Connection reset by peer"): the follower's report still counts (the epoch that just ended),
    # and on the head's clock (offset from the heartbeats) node 1's rank 1 died first
    group_json = _group_json(head, Path(inc["bundle"]))
    assert (group_json["first_death"]["node_rank"], group_json["first_death"]["rank"]) == (1, 1), group_json
    # the verdict too: the head's gloo "Read error [127.0.0.1]:PORT: Connection reset by peer" (its
    # TP rank 0 and EngineCore's re-raise) names the dead node's address: consequences of its death
    assert inc["cause"] == "process-crash", inc
    assert "Worker_TP1 (rank 1, pid " in inc["msg"] and "on node 1 was killed by SIGKILL" in inc["msg"], inc
    contract = json.loads((Path(inc["bundle"]) / "incident.json").read_text())
    assert (contract["root"]["process"], contract["root"]["rank"]) == ("Worker_TP1", 1), contract["root"]
    gloo = [c for c in contract["consequences"] if c["signature"] == "gloo-peer-lost"]
    assert {c["process"] for c in gloo} == {"Worker_TP0", "EngineCore"}, contract["consequences"]
    assert all("Connection reset by peer" in c["text"] for c in gloo)
    facts_log = (head.runtime / "logs" / "1" / "facts.log").read_text()
    assert "Worker_TP1@node1 (pid " in facts_log and "killed by SIGKILL" in facts_log
    head.wait_state("ready", 2, timeout=90)
    fol.wait_state("ready", 2, timeout=30)
