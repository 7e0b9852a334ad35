"""`GroupWatcher`: this host's supervisor as a member of a multi-node group (docs/multi-node.md,
"States"), plugged into the supervisor as one `Watcher` (`name`, `run(ctx)`) and one observer
(`on_state`, `on_incident`), plus two gates the supervisor awaits: `before_launch()` (a follower
launches only once the head has launched the group's epoch) and `ready_gate(ctx)` (ready only with
every node joined).

Head (node rank 0): serves the group channel (`channel.GroupHead`) on `group.listen` for the life
of the supervisor; fails its incarnation when a follower reports a death (`node-death`, within
the channel's round trip), when a registered follower is not heard from for `peer_timeout_s`
(`node-unreachable`) or when a follower has not joined `supervision.startup.stall_s` after the
launch (`rendezvous-stall`, naming the node and the address it last registered from, if it ever did). Any failure of the head's incarnation starts the
next epoch at once: every follower's next heartbeat is refused with the new epoch named, which
tells it to capture and stop (a group restart).

Follower: registers before each launch, heartbeats every `heartbeat_interval_s` with its state
and incarnation, stops (`request_stop`: a planned stop, exit 0, no incident) when the head's
answer says it is stopping for good (its `xpu-serve stop` or SIGTERM; the head waits a heartbeat
period for its followers to hear it, `before_exit`), reports its own incarnation's trigger to the head as an incident the moment it
fires, fails its incarnation (`group-restart`) when the head names a newer epoch and
(`head-lost`) when the head has not answered for `peer_timeout_s` (no stranded followers).

The head's bundle gets `nodes/node<R>/` per node (`write_node_folders`): the follower ships the
incident message only (its trigger: process, TP rank, time on its clock, cause, detail), not its
bundle. Why: the message is what the verdict needs (who died first, when, on the head's clock), it
fits the channel's 64 KiB limit, and it is sent before the follower captures anything, so the
head's capture never waits on a follower; the follower's full bundle stays on its host, named by
its node rank and epoch in its own events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xpu_serve import facts
from xpu_serve.group.channel import ChannelError, GroupFollower, GroupHead, ReceivedIncident
from xpu_serve.incarnation import IncarnationContext, Status, Trigger

POLL_S = 0.2
"""The head's membership check period, seconds (a death report fails the incarnation at once)."""
REPORT_SLACK_S = 0.3
"""How much longer than a heartbeat period the head's capture waits for its followers' word, s."""
GROUP_TRIGGERS = ("node-death", "node-unreachable", "rendezvous-stall", "group-restart", "head-lost")
"""Trigger kinds of the group (`Trigger.kind`)."""


class GroupWatcher:
    """This host's part of the group: `GroupWatcher(config, warn)`; `warn(message)` logs.

    Attributes: `epoch` (the group's, as this node knows it), `role`, `node_rank`.
    """

    name = "group"

    def __init__(self, config: Any, warn: Callable[[str], None] | None = None):
        self.config, self.g = config, config.group
        self.role, self.node_rank = self.g.role, self.g.node_rank
        self.warn = warn or (lambda m: None)
        self.head: GroupHead | None = None
        self.follower: GroupFollower | None = None
        self.state = "starting"
        self.incarnation = 0
        self.stopping = False  # this supervisor is stopping for good (a stop or gave-up)
        self._stopping_since: float | None = None
        self.request_stop: Callable[[], None] | None = None  # the supervisor's stop (a follower's head stopped)
        self.head_state: str | None = None
        self._launched_epoch: int | None = None
        self._ctx: IncarnationContext | None = None
        if self.role == "head":
            self.head = GroupHead(
                self.g.secret,
                self.g.nnodes,
                on_incident=self._on_remote_incident,
                admit=self._admit,
                info=lambda: {"state": self.state, "stopping": self.stopping},
            )

    @property
    def epoch(self) -> int | None:
        return self.head.epoch if self.head is not None else (self.follower.epoch if self.follower else None)

    # ---- the supervisor's hooks ----------------------------------------------------------------

    def on_state(self, status: Status) -> None:
        self.state, self.incarnation = status.state, status.incarnation
        if status.shutting_down and not self.stopping:
            self.stopping, self._stopping_since = True, time.time()

    async def before_exit(self) -> None:
        """Head, before its supervisor exits after a stop: until every follower of the epoch has
        been answered since the stop began (its answers carry `stopping: true`, and a follower
        then stops its own tree: a planned stop, no incident), at most one heartbeat period plus
        `REPORT_SLACK_S`. Follower: nothing."""
        if self.head is None or self._stopping_since is None:
            return
        since, ranks = self._stopping_since, self.head.members_of_failed_epoch(self.head.epoch)
        end = time.monotonic() + self.g.heartbeat_interval_s + REPORT_SLACK_S
        while time.monotonic() < end and not all(self.head.heard.get(r, 0.0) >= since for r in ranks):
            await asyncio.sleep(0.02)

    def on_incident(self, incident: dict[str, Any], bundle_path: str | None) -> None:
        if self.head is not None and bundle_path:
            try:
                write_node_folders(Path(bundle_path), self.head, incident, self._launched_epoch or 1)
            except OSError as e:
                self.warn(f"node folders of {bundle_path} not written: {e}")

    async def before_launch(self, stop: Callable[[], bool]) -> str:
        """Wait until this node may launch; returns one line for the event log. Head: starts the
        channel (once) and opens the epoch to registrations. Follower: registers, retrying every
        heartbeat period until the head has launched this epoch (head first), or `stop()`."""
        if self.head is not None:
            if self.head.server is None:
                host, _, port = self.g.listen.rpartition(":")
                self.head.start(host.strip("[]"), int(port))
            self._launched_epoch = self.head.epoch
            return f"group head: epoch {self.head.epoch}, channel on {self.g.listen}"
        if self.follower is None:
            self.follower = GroupFollower(self.g.head_url, self.g.secret, self.node_rank)
        # the head's state as last answered was the failed epoch's ("ready"): a follower is ready
        # only once the head answers `ready` in this epoch (`ready_gate`), not on that stale word
        self.head_state = None
        last = ""
        while not stop():
            try:
                await self.follower.register(os.getpid())
                return f"group follower: node {self.node_rank} joined epoch {self.follower.epoch} at {self.g.head_url}"
            except ChannelError as e:
                if str(e) != last:
                    self.warn(f"waiting for the head: {e}")
                    last = str(e)
            await asyncio.sleep(self.g.heartbeat_interval_s)
        return "group follower: stopped while waiting for the head"

    async def settle_reports(self, ctx: IncarnationContext) -> None:
        """Head, before its capture's verdict: until every follower of the failed epoch has been
        heard from since the failure (a follower whose tree died reports it at once; a healthy
        one heartbeats), at most one heartbeat period plus `REPORT_SLACK_S`. A follower's death
        that caused the head's own failure is then on the verdict's timeline (its exit reaches
        the head a few ms after the head's own collective failed)."""
        if self.head is None or self._launched_epoch is None:
            return
        trig = getattr(ctx, "trigger", None)
        since = trig.at if trig is not None else time.time()
        ranks = self.head.members_of_failed_epoch(self._launched_epoch)
        end = time.monotonic() + min(self.g.heartbeat_interval_s + REPORT_SLACK_S, self.g.peer_timeout_s)
        while time.monotonic() < end:
            if all(self.head.heard.get(r, 0.0) >= since for r in ranks):
                return
            await asyncio.sleep(0.02)

    async def ready_gate(self, ctx: IncarnationContext) -> None:
        """Head: until every follower has joined this epoch. Follower: until the head is ready."""
        while True:
            if self.head is not None and not self.head.membership.missing():
                return
            if self.follower is not None and self.head_state == "ready":
                return
            await asyncio.sleep(POLL_S / 2)

    async def run(self, ctx: IncarnationContext) -> None:
        self._ctx = ctx
        try:
            if self.head is not None:
                await self._run_head(ctx)
            else:
                await self._run_follower(ctx)
        finally:
            self._ctx = None

    # ---- head ----------------------------------------------------------------------------------

    def _admit(self, kind: str) -> str | None:
        """Registrations wait until the head launched the epoch (head first)."""
        assert self.head is not None
        if kind == "register" and self._launched_epoch != self.head.epoch:
            return f"the head has not launched epoch {self.head.epoch} yet"
        return None

    async def _run_head(self, ctx: IncarnationContext) -> None:
        assert self.head is not None
        head = self.head
        failed = _failed_event(ctx)
        try:
            await self._watch_members(ctx, failed)
        finally:
            # the head's incarnation failed (here or on a follower): the next epoch tells every
            # follower. In `finally`: the supervisor may cancel this watch before its next poll.
            if failed is not None and failed.is_set():
                new = head.new_epoch()
                self.warn(f"epoch {new}: every follower captures and stops; the head launches first")
        await asyncio.Event().wait()

    async def _watch_members(self, ctx: IncarnationContext, failed: asyncio.Event | None) -> None:
        """Until the incarnation failed: fail it for a node unreachable past the peer timeout or
        one that never joined `startup.stall_s` after the launch."""
        assert self.head is not None
        head, g = self.head, self.g
        stall_s = self.config.supervision.startup.stall_s
        while failed is None or not failed.is_set():
            now = time.time()
            for m in head.membership.lost(g.peer_timeout_s):
                ctx.fail(
                    Trigger(
                        kind="node-unreachable",
                        at=now,
                        rank=None,
                        process=f"node{m.node_rank}",
                        detail=f"node {m.node_rank} ({m.address}) unreachable: no heartbeat for more "
                        f"than {g.peer_timeout_s:g} s, no death reported (epoch {head.epoch})",
                    )
                )
            missing = head.membership.missing()
            if missing and ctx.ready_at is None and now - ctx.started_at > stall_s:
                nodes = ", ".join(
                    f"{r} ({head.addresses[r]})" if r in head.addresses else str(r) for r in missing
                )
                ctx.fail(
                    Trigger(
                        kind="rendezvous-stall",
                        at=now,
                        process=f"node{missing[0]}",
                        detail=f"node{'s' if len(missing) > 1 else ''} {nodes} never joined epoch {head.epoch} "
                        f"(rendezvous stall, {stall_s:g} s after the launch)",
                    )
                )
            await asyncio.sleep(POLL_S)

    def _on_remote_incident(self, rec: ReceivedIncident) -> None:
        """A follower's death report (the channel's thread): its process exit goes into the head's
        analysis as a fact on the head's clock with the node's rank and address (`node_rank`,
        `node_address`: one timeline, the first death of the group is the root, the head's gloo
        "Connection reset by peer [IP]" at or after it a consequence), and the head's
        incarnation fails (unless it already did: the report still counts while capturing)."""
        ctx, inc = self._ctx, rec.incident
        if ctx is None or inc.cause in GROUP_TRIGGERS or inc.epoch != self._launched_epoch:
            return  # (a late report of an epoch the head has relaunched since)
        who = f"{inc.process or 'its tree'}" + (f" (rank {inc.rank})" if inc.rank is not None else "")
        at = rec.head_time if rec.head_time is not None else rec.received_at
        if inc.process and inc.pid is not None:
            name = f"{inc.process}@node{inc.node_rank}"  # the node in every line of the verdict
            ev = facts.process_exit(name, inc.pid, inc.rank, inc.exit_code, inc.signal, at)
            ev.extra.update(node_rank=inc.node_rank, node_address=rec.address)  # (data/rules.yaml same_peer)
            ctx.record(ev)
        ctx.fail(
            Trigger(
                kind="node-death",
                at=at,
                detected_at=rec.received_at,
                rank=inc.rank,
                process=f"node{inc.node_rank}:{inc.process}",
                detail=f"node {inc.node_rank} ({rec.address}): {who} died first: {inc.message or inc.cause}",
            )
        )

    # ---- follower ------------------------------------------------------------------------------

    async def _run_follower(self, ctx: IncarnationContext) -> None:
        fol, g = self.follower, self.g
        assert fol is not None
        failed = _failed_event(ctx)
        reported = False
        while True:
            trig = getattr(ctx, "trigger", None)
            if trig is not None and not reported:
                reported = True
                if trig.kind not in GROUP_TRIGGERS:
                    await self._report(trig)
            if trig is None:
                await self._beat(ctx)
            if fol.head_lost(g.peer_timeout_s) and trig is None:
                ctx.fail(
                    Trigger(
                        kind="head-lost",
                        at=time.time(),
                        process="node0",
                        detail=f"head {g.head_url} not heard from for more than {g.peer_timeout_s:g} s: "
                        "stopping this node's tree",
                    )
                )
            with contextlib.suppress(TimeoutError):
                if failed is not None:
                    await asyncio.wait_for(
                        failed.wait() if trig is None else asyncio.Event().wait(), g.heartbeat_interval_s
                    )
                else:
                    await asyncio.sleep(g.heartbeat_interval_s)

    async def _beat(self, ctx: IncarnationContext) -> None:
        fol = self.follower
        assert fol is not None
        try:
            answer = await fol.heartbeat(self.state, self.incarnation)
            self.head_state = answer.get("state") if isinstance(answer.get("state"), str) else None
            if answer.get("stopping") is True and not self.stopping and self.request_stop is not None:
                self.warn(f"the head stopped (a planned stop, its state {self.head_state}): node "
                          f"{self.node_rank} stops its tree, no incident")
                self.request_stop()
        except ChannelError as e:
            if e.status == 409 and e.epoch is not None and e.epoch != fol.epoch:
                ctx.fail(
                    Trigger(
                        kind="group-restart",
                        at=time.time(),
                        process="node0",
                        detail=f"the head started epoch {e.epoch} (group restart): "
                        f"node {self.node_rank} captures and stops",
                    )
                )

    async def _report(self, trig: Trigger) -> None:
        fol = self.follower
        assert fol is not None
        try:
            await fol.incident(
                trig.rank,
                trig.at,
                trig.kind,
                trig.process,
                trig.detail,
                pid=trig.pid,
                signal=trig.signal,
                exit_code=trig.exit_code,
            )
        except ChannelError as e:
            self.warn(f"incident not delivered to the head: {e}")


def _failed_event(ctx: Any) -> asyncio.Event | None:
    ev = getattr(ctx, "failed", None)
    return ev if isinstance(ev, asyncio.Event) else None


def write_node_folders(bundle: Path, head: GroupHead, contract: dict[str, Any], epoch: int) -> Path:
    """`BUNDLE/nodes/`: `node0/summary.json` (the head's verdict: cause, summary), one
    `node<R>/incident.json` per follower that reported (its message, its clock and the head's,
    the clock offset) and `group.json`: the deaths of every node on the head's clock, the first
    one named (`first_death`: the verdict's root when it is one of them); incidents of `epoch` (the failed one) only. Returns the folder.
    Raises OSError."""
    out = bundle / "nodes"
    (out / "node0").mkdir(parents=True, exist_ok=True, mode=0o700)
    _dump(
        out / "node0" / "summary.json",
        {
            "cause": contract.get("cause"),
            "summary": contract.get("summary"),
            "trigger": (contract.get("supervisor") or {}).get("trigger"),
        },
    )
    deaths = []
    for rec in head.incidents:
        inc = rec.incident
        if inc.epoch != epoch:
            continue
        offset = (
            None if rec.head_time is None else rec.head_time - inc.time
        )  # (membership is the new epoch's)
        d = {
            **inc.model_dump(),
            "address": rec.address,
            "received_at": rec.received_at,
            "head_time": rec.head_time,
            "clock_offset_s": offset,
        }
        (out / f"node{inc.node_rank}").mkdir(exist_ok=True, mode=0o700)
        _dump(out / f"node{inc.node_rank}" / "incident.json", d)
        deaths.append(
            {
                "node_rank": inc.node_rank,
                "rank": inc.rank,
                "process": inc.process,
                "pid": inc.pid,
                "time": rec.head_time if rec.head_time is not None else rec.received_at,
            }
        )
    trig = (contract.get("supervisor") or {}).get("trigger") or {}
    if trig and trig.get("kind") not in GROUP_TRIGGERS:
        deaths.append(
            {"node_rank": 0, "rank": trig.get("rank"), "process": trig.get("process"), "pid": trig.get("pid"),
             "time": trig.get("at")}
        )
    deaths.sort(key=lambda d: d["time"] if isinstance(d["time"], (int, float)) else float("inf"))
    _dump(out / "group.json", {"epoch": epoch, "deaths": deaths, "first_death": _first_death(deaths, contract)})
    return out


def _first_death(deaths: list[dict[str, Any]], contract: dict[str, Any]) -> dict[str, Any] | None:
    """The death the verdict names as its root (process, rank and pid), else the earliest on the
    head's clock: the verdict also weighs the causal links (a gloo error naming the dead node)
    that order deaths a few ms apart better than two hosts' exit times do."""
    root = contract.get("root") or {}
    key = (root.get("process"), root.get("rank"), root.get("pid"))
    named = [d for d in deaths if (d["process"], d["rank"], d["pid"]) == key]
    return named[0] if named else (deaths[0] if deaths else None)


def _dump(path: Path, data: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, default=str)
