"""The group channel: followers' supervisors talk to the head's over authenticated HTTP.

Every message is a JSON POST to the head, signed both ways (`xpu_serve.group.auth`):

| path | body (follower -> head) | answer 200 |
| --- | --- | --- |
| `/group/v1/register` | `{node_rank, epoch, pid}` (`epoch` null: join, learn the epoch) | `{epoch, head_time}` |
| `/group/v1/heartbeat` | `{node_rank, epoch, state, incarnation, wall_time, clock_offset_s}` | `{epoch, head_time}` |
| `/group/v1/incident` | `{node_rank, epoch, rank, time, cause, process, message}` | `{epoch, head_time}` |

`head_time` is the head's Unix time when it answered: the follower computes the clock offset
(head minus follower) NTP-style, `head_time - (sent + received) / 2`, and reports it in its next
heartbeat. Refusals carry `{error, epoch, head_time}`: 401 bad or missing signature, stale
timestamp, replayed nonce (nothing is recorded); 409 an epoch that is not the group's (the answer
names the current one) or a heartbeat/incident from a node that is not registered; 400 a body that
is not a message; 404 another path; 413 a body over MAX_BODY bytes. A peer that sends a request slower than READ_TIMEOUT_S, or
hangs up before its whole body, is dropped without an answer.

The head's side is a standard-library `ThreadingHTTPServer` in a daemon thread, like the metrics
listener (`integrations.probes`): a slow peer never blocks the supervisor's asyncio loop, and
no new dependency. The follower's side is `httpx.AsyncClient` (the supervisor's HTTP client,
`sources.health`): async on the supervisor's loop, with timeouts.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Any

import httpx
from annotated_types import Ge, Le
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from xpu_serve.group.auth import NONCE_HEADER, SIG_HEADER, TIME_HEADER, Verifier, signed_headers
from xpu_serve.group.membership import Member, Membership

PREFIX = "/group/v1/"
MAX_BODY = 64 * 1024
"""Largest message body, bytes (an incident's message is cut to MAX_TEXT characters)."""
MAX_TEXT = 4096
READ_TIMEOUT_S = 10.0
"""Longest wait for a peer's request, seconds (a message is one small POST)."""

_Rank = Annotated[int, Strict(), Ge(0), Le(63)]
_Epoch = Annotated[int, Strict(), Ge(1)]
_Time = Annotated[float, Strict(), Field(allow_inf_nan=False)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Register(_Msg):
    node_rank: _Rank
    epoch: _Epoch | None
    pid: Annotated[int, Strict(), Ge(1)]


class Heartbeat(_Msg):
    node_rank: _Rank
    epoch: _Epoch
    state: Annotated[str, Field(min_length=1, max_length=32)]
    incarnation: Annotated[int, Strict(), Ge(0)]
    wall_time: _Time
    clock_offset_s: _Time | None = None


class Incident(_Msg):
    """A follower's tree died: `rank` the TP rank that died first (None: unknown or the follower's
    MainProcess), `time` the death on the follower's clock (Unix seconds), `cause` a cause of
    `signatures.CAUSES` or a short phrase; `pid` (in the follower's pid namespace), `signal` and
    `exit_code` of the process when it is a process exit."""

    node_rank: _Rank
    epoch: _Epoch
    rank: Annotated[int, Strict(), Ge(0)] | None
    time: _Time
    cause: Annotated[str, Field(min_length=1, max_length=200)]
    process: Annotated[str, Field(max_length=200)] | None = None
    message: Annotated[str, Field(max_length=MAX_TEXT)] | None = None
    pid: Annotated[int, Strict(), Ge(1)] | None = None
    signal: Annotated[str, Field(max_length=32)] | None = None
    exit_code: Annotated[int, Strict()] | None = None


MESSAGES: dict[str, type[_Msg]] = {"register": Register, "heartbeat": Heartbeat, "incident": Incident}


@dataclass(frozen=True)
class ReceivedIncident:
    """An incident as the head recorded it: `head_time` is `time` on the head's clock (the
    follower's clock offset applied; None when no offset is known yet)."""

    incident: Incident
    address: str
    received_at: float
    head_time: float | None


class GroupHead:
    """The head's channel: membership of the current epoch, incidents, the HTTP listener.

    Args:
        secret: the group's shared secret (`group.secret`).
        nnodes: nodes in the group.
        epoch: the first epoch (>= 1).
        wall: the head's Unix clock; `clock`: monotonic (membership).
        on_incident: called (from the listener's thread) with each ReceivedIncident.
        admit: called with a message's kind before it is handled: a refusal (409) reason, or
            None to handle it (the head refuses registrations until it launched the epoch).
        info: fields added to every answer (the head supervisor's `state`).
    """

    def __init__(self, secret: str, nnodes: int, epoch: int = 1, *, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic,
                 on_incident: Callable[[ReceivedIncident], None] | None = None,
                 admit: Callable[[str], str | None] | None = None,
                 info: Callable[[], dict[str, Any]] | None = None):
        self.secret, self.wall = secret.encode(), wall
        self.verifier = Verifier(self.secret, wall=wall)
        self.membership = Membership(nnodes, clock)
        self.incidents: list[ReceivedIncident] = []
        self.on_incident, self.admit, self.info = on_incident, admit, info
        self._epoch = epoch
        self._previous: dict[int, Member] = {}  # the last epoch's members: their late incidents count
        self.addresses: dict[int, str] = {}  # node rank -> the address of its last registration (any epoch)
        self.heard: dict[int, float] = {}  # node rank -> head's Unix time its last message was handled
        self._lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def new_epoch(self) -> int:
        """Start the next epoch (a group restart): followers of the old one are refused and
        must register again, but an incident of the epoch that just ended from one of its members
        is still recorded (a follower's death that raced with the head's own failure). Returns
        the new epoch."""
        with self._lock:
            self._previous = {m.node_rank: m for m in self.membership.members()}
            self._epoch += 1
            self.membership.clear()
            return self._epoch

    def start(self, host: str, port: int) -> int:
        """Listen on (host, port) in a daemon thread; returns the bound port. Raises OSError."""
        head = self

        class Handler(_Handler):
            pass

        Handler.head = head
        self.server = _Server((host, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="group-channel", daemon=True).start()
        return int(self.server.server_address[1])

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def members_of_failed_epoch(self, epoch: int) -> list[int]:
        """Node ranks of the followers registered in `epoch` (the current one, or the one that
        just ended when the head has opened the next)."""
        with self._lock:
            if epoch == self._epoch:
                return [m.node_rank for m in self.membership.members()]
            return sorted(self._previous) if epoch == self._epoch - 1 else []

    def handle(self, kind: str, msg: _Msg, address: str) -> tuple[int, dict[str, Any]]:
        """One authenticated message -> (HTTP status, answer body without `head_time`); the
        time it was handled (refused or not) is `heard[node_rank]`."""
        try:
            return self._handle(kind, msg, address)
        finally:
            if isinstance(msg, (Register, Heartbeat, Incident)):
                self.heard[msg.node_rank] = self.wall()

    def _handle(self, kind: str, msg: _Msg, address: str) -> tuple[int, dict[str, Any]]:
        refused = self.admit(kind) if self.admit is not None else None
        if refused is not None:
            return 409, {"error": refused}
        with self._lock:
            epoch = self._epoch
            if isinstance(msg, Register):
                if msg.node_rank == 0 or msg.node_rank >= self.membership.nnodes:
                    return 400, {"error": f"node_rank {msg.node_rank}: a follower is 1..{self.membership.nnodes - 1}"}
                if msg.epoch is not None and msg.epoch != epoch:
                    return 409, {"error": f"epoch {msg.epoch} is not the group's: it runs epoch {epoch}"}
                self.membership.register(msg.node_rank, msg.pid, epoch, address, self.wall())
                self.addresses[msg.node_rank] = address
                return 200, {}
            assert isinstance(msg, (Heartbeat, Incident))
            late = self._previous.get(msg.node_rank) if isinstance(msg, Incident) and msg.epoch == epoch - 1 else None
            if late is None and msg.epoch != epoch:
                return 409, {"error": f"epoch {msg.epoch} is not the group's: it runs epoch {epoch}"}
            member = late or self.membership.get(msg.node_rank)
            if member is None:
                return 409, {"error": f"node {msg.node_rank} is not registered in epoch {epoch}"}
        if late is not None:  # a death in the epoch that just ended (it raced with the head's own)
            assert isinstance(msg, Incident)
            return self._incident(msg, late, address)
        if isinstance(msg, Heartbeat):
            offset = msg.clock_offset_s if msg.clock_offset_s is not None else self.wall() - msg.wall_time
            self.membership.heartbeat(msg.node_rank, msg.state, msg.incarnation, offset)
            return 200, {}
        self.membership.seen(msg.node_rank)
        return self._incident(msg, member, address)

    def _incident(self, msg: Incident, member: Member, address: str) -> tuple[int, dict[str, Any]]:
        off = member.clock_offset_s
        rec = ReceivedIncident(msg, address, self.wall(), None if off is None else msg.time + off)
        self.incidents.append(rec)
        if self.on_incident is not None:
            self.on_incident(rec)
        return 200, {}


class _Server(ThreadingHTTPServer):
    """The listener; a peer that hangs up or stalls mid-request costs its own connection only,
    without a traceback on the supervisor's stderr (socketserver's handle_error prints one)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class _Handler(BaseHTTPRequestHandler):
    head: GroupHead
    # seconds a peer may take to send its request (line, headers, body) before it is dropped: a
    # peer that opens connections and sends nothing must not hold the listener's threads forever
    timeout = READ_TIMEOUT_S
    # one message per connection (HTTP/1.0): a stopped head answers nothing more, where a kept-alive
    # connection's handler thread would outlive `stop()`; a message a second costs nothing here
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass

    def _answer(self, status: int, body: dict[str, Any], nonce: str) -> None:
        extra = self.head.info() if self.head.info is not None else {}
        body = {**extra, **body, "epoch": self.head.epoch, "head_time": self.head.wall()}
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in signed_headers(self.head.secret, f"ANSWER {status} {nonce}", data, self.head.wall()).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        nonce = self.headers.get(NONCE_HEADER, "")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            return self._answer(413, {"error": f"body must be 0..{MAX_BODY} bytes"}, nonce)
        body = self.rfile.read(length)
        if len(body) != length:  # the peer hung up before its whole body: nobody to answer
            self.close_connection = True
            return None
        kind = self.path[len(PREFIX):] if self.path.startswith(PREFIX) else ""
        if kind not in MESSAGES:
            return self._answer(404, {"error": f"no such message {self.path[:80]!r}"}, nonce)
        signed = {h: self.headers.get(h, "") for h in (TIME_HEADER, NONCE_HEADER, SIG_HEADER)}
        why = self.head.verifier.check(f"POST {self.path}", signed, body)
        if why is not None:
            return self._answer(401, {"error": why}, nonce)
        try:
            msg = MESSAGES[kind].model_validate_json(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or "(body)"
            return self._answer(400, {"error": f"{kind}: {where}: {err['msg']}"}, nonce)
        status, answer = self.head.handle(kind, msg, self.client_address[0])
        self._answer(status, answer, nonce)


class ChannelError(Exception):
    """The head could not be reached, or its answer was not authentic (`status` None), or it
    refused the message (`status` the HTTP status, `epoch` the group's epoch it named)."""

    def __init__(self, message: str, status: int | None = None, epoch: int | None = None):
        super().__init__(message)
        self.status, self.epoch = status, epoch


class GroupFollower:
    """A follower's side of the channel (async, on the supervisor's loop).

    Args:
        head_url: `group.head_url` (http://MASTER_ADDR:PORT).
        secret: the group's shared secret.
        node_rank: this node's rank (1..nnodes-1).
        timeout_s: one request's limit, seconds.
        wall, clock: Unix and monotonic clocks.

    After each answer: `epoch` (the group's), `clock_offset_s` (head minus this node, seconds),
    `rtt_s`, `last_answer` (monotonic). Use `async with` or `aclose()`.
    """

    def __init__(self, head_url: str, secret: str, node_rank: int, timeout_s: float = 2.0, *,
                 wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic):
        self.secret, self.node_rank, self.wall, self.clock = secret.encode(), node_rank, wall, clock
        self.verifier = Verifier(self.secret, wall=wall)
        self.client = httpx.AsyncClient(base_url=head_url, timeout=timeout_s)
        self.epoch: int | None = None
        self.clock_offset_s: float | None = None
        self.rtt_s: float | None = None
        self.last_answer: float | None = None

    async def __aenter__(self) -> GroupFollower:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()

    def head_lost(self, peer_timeout_s: float) -> bool:
        """True when the head has not answered for more than `peer_timeout_s` seconds (counting
        from the first answer; before it, never)."""
        return self.last_answer is not None and self.clock() - self.last_answer > peer_timeout_s

    async def register(self, pid: int, epoch: int | None = None) -> dict[str, Any]:
        """Join the group (epoch None: the head's current one). Raises ChannelError."""
        return await self._post("register", {"node_rank": self.node_rank, "epoch": epoch, "pid": pid})

    async def heartbeat(self, state: str, incarnation: int) -> dict[str, Any]:
        """Report this node's state under `epoch`. Raises ChannelError (409: the epoch is over)."""
        return await self._post("heartbeat", {
            "node_rank": self.node_rank, "epoch": self.epoch, "state": state, "incarnation": incarnation,
            "wall_time": self.wall(), "clock_offset_s": self.clock_offset_s,
        })

    async def incident(self, rank: int | None, at: float, cause: str, process: str | None = None,
                       message: str | None = None, **exit_status: Any) -> dict[str, Any]:
        """Tell the head this node's tree died (`at`: this node's Unix time); `exit_status`:
        `pid`, `signal`, `exit_code` (Incident). Raises ChannelError."""
        return await self._post("incident", {
            "node_rank": self.node_rank, "epoch": self.epoch, "rank": rank, "time": at, "cause": cause,
            "process": process, "message": None if message is None else message[:MAX_TEXT], **exit_status,
        })

    async def _post(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        path = PREFIX + kind
        body = json.dumps(payload, separators=(",", ":")).encode()
        sent = self.wall()
        headers = signed_headers(self.secret, f"POST {path}", body, sent)
        try:
            r = await self.client.post(path, content=body, headers={**headers, "Content-Type": "application/json"})
        except httpx.HTTPError as e:
            raise ChannelError(f"head unreachable at {self.client.base_url}: {type(e).__name__}: {e}") from None
        received = self.wall()
        why = self.verifier.check(f"ANSWER {r.status_code} {headers[NONCE_HEADER]}", r.headers, r.content,
                                  remember=False)
        if why is not None:
            raise ChannelError(f"answer from {self.client.base_url} refused: {why}")
        try:
            answer = json.loads(r.content)
            epoch, head_time = int(answer["epoch"]), float(answer["head_time"])
        except (ValueError, KeyError, TypeError):
            raise ChannelError(f"answer from {self.client.base_url} is not a group answer") from None
        self.last_answer = self.clock()
        self.rtt_s = received - sent
        self.clock_offset_s = head_time - (sent + received) / 2
        if r.status_code != 200:
            raise ChannelError(f"head refused {kind}: {r.status_code} {answer.get('error')}", r.status_code, epoch)
        self.epoch = epoch
        return answer

