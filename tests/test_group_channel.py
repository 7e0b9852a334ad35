"""The group channel over real HTTP on loopback: a head's listener and followers' clients with
the group's secret, signatures both ways, the replay window, epochs, lost followers and clock
offsets."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from xpu_serve.group.auth import NONCE_HEADER, signed_headers
from xpu_serve.group.channel import ChannelError, GroupFollower, GroupHead, ReceivedIncident

SECRET = "group-test-secret-2f4a9c1d"


@pytest.fixture
def head() -> Iterator[tuple[GroupHead, str]]:
    h = GroupHead(SECRET, nnodes=3)
    port = h.start("127.0.0.1", 0)
    try:
        yield h, f"http://127.0.0.1:{port}"
    finally:
        h.stop()


def test_register_and_heartbeat(head: tuple[GroupHead, str]) -> None:
    h, url = head

    async def go() -> None:
        async with GroupFollower(url, SECRET, node_rank=1) as f:
            answer = await f.register(pid=os.getpid())
            assert answer["epoch"] == 1 and f.epoch == 1
            assert h.membership.missing() == [2]
            await f.heartbeat("starting", 1)
            await f.heartbeat("ready", 1)

    asyncio.run(go())
    [m] = h.membership.members()
    assert (m.node_rank, m.pid, m.epoch, m.address) == (1, os.getpid(), 1, "127.0.0.1")
    assert (m.state, m.incarnation, m.heartbeats) == ("ready", 1, 2)


def test_wrong_secret_is_401_and_not_registered(head: tuple[GroupHead, str]) -> None:
    h, url = head

    async def go() -> ChannelError:
        async with GroupFollower(url, "another-secret-0123456789", node_rank=1) as f:
            with pytest.raises(ChannelError) as e:
                await f.register(pid=1234)
            return e.value

    err = asyncio.run(go())
    # the head's answer is signed with the real secret: the follower cannot trust it either
    assert err.status is None and "bad signature" in str(err)
    assert h.membership.members() == []
    # the same request, read without checking the answer's signature: a 401 naming the reason
    body = json.dumps({"node_rank": 1, "epoch": None, "pid": 1234}).encode()
    hdrs = signed_headers(b"another-secret-0123456789", "POST /group/v1/register", body, time.time())
    r = httpx.post(url + "/group/v1/register", content=body, headers=hdrs)
    assert r.status_code == 401 and r.json()["error"] == "bad signature: not signed with the group's secret"
    r = httpx.post(url + "/group/v1/register", content=body)
    assert r.status_code == 401 and r.json()["error"].startswith("unsigned")
    assert h.membership.members() == []


def test_replayed_message_refused(head: tuple[GroupHead, str]) -> None:
    h, url = head
    body = json.dumps({"node_rank": 2, "epoch": None, "pid": 77}).encode()
    hdrs = signed_headers(SECRET.encode(), "POST /group/v1/register", body, time.time())
    first = httpx.post(url + "/group/v1/register", content=body, headers=hdrs)
    assert first.status_code == 200
    h.membership.clear()
    again = httpx.post(url + "/group/v1/register", content=body, headers=hdrs)
    assert again.status_code == 401 and again.json()["error"] == "replayed: this nonce was already accepted"
    assert h.membership.members() == []
    # a signed message for one path is not valid for another
    other = httpx.post(url + "/group/v1/heartbeat", content=body, headers={**hdrs, NONCE_HEADER: hdrs[NONCE_HEADER]})
    assert other.status_code == 401 and "bad signature" in other.json()["error"]
    # stamped outside the window (an old capture, or clocks apart)
    old = signed_headers(SECRET.encode(), "POST /group/v1/register", body, time.time() - 120)
    stale = httpx.post(url + "/group/v1/register", content=body, headers=old)
    assert stale.status_code == 401 and "from this node's clock (window 30 s)" in stale.json()["error"]


def test_epoch_mismatch_refused(head: tuple[GroupHead, str]) -> None:
    h, url = head

    async def go() -> None:
        async with GroupFollower(url, SECRET, node_rank=1) as f:
            await f.register(pid=10)
            assert h.new_epoch() == 2  # a group restart
            with pytest.raises(ChannelError) as e:
                await f.heartbeat("ready", 1)
            assert (e.value.status, e.value.epoch) == (409, 2)
            assert "epoch 1 is not the group's: it runs epoch 2" in str(e.value)
            with pytest.raises(ChannelError) as e:
                await f.register(pid=10, epoch=1)
            assert (e.value.status, e.value.epoch) == (409, 2)
            assert h.membership.members() == []
            await f.register(pid=11, epoch=2)
            await f.heartbeat("starting", 2)

    asyncio.run(go())
    [m] = h.membership.members()
    assert (m.pid, m.epoch, m.incarnation) == (11, 2, 2)


def test_heartbeat_before_register_and_bad_messages(head: tuple[GroupHead, str]) -> None:
    h, url = head

    async def go() -> None:
        async with GroupFollower(url, SECRET, node_rank=2) as f:
            f.epoch = 1
            with pytest.raises(ChannelError) as e:
                await f.heartbeat("ready", 1)
            assert e.value.status == 409 and "node 2 is not registered in epoch 1" in str(e.value)
        async with GroupFollower(url, SECRET, node_rank=3) as f:  # nnodes 3: ranks 1 and 2
            with pytest.raises(ChannelError) as e:
                await f.register(pid=5)
            assert e.value.status == 400 and "node_rank 3: a follower is 1..2" in str(e.value)

    asyncio.run(go())
    body = b'{"node_rank": 1, "epoch": null, "pid": "12"}'
    hdrs = signed_headers(SECRET.encode(), "POST /group/v1/register", body, time.time())
    r = httpx.post(url + "/group/v1/register", content=body, headers=hdrs)
    assert r.status_code == 400 and r.json()["error"].startswith("register: pid:")
    assert httpx.post(url + "/group/v1/nope", content=b"{}").status_code == 404
    assert h.membership.members() == []


def test_follower_that_stops_heartbeating_is_lost(head: tuple[GroupHead, str]) -> None:
    h, url = head
    timeout = 0.6

    async def go() -> None:
        async with GroupFollower(url, SECRET, node_rank=1) as a, GroupFollower(url, SECRET, node_rank=2) as b:
            await a.register(pid=1)
            await b.register(pid=2)
            for _ in range(8):  # 1.6 s: node 2 keeps beating, node 1 goes silent after its register
                await asyncio.sleep(0.2)
                await b.heartbeat("ready", 1)
                if h.membership.lost(timeout):
                    break
            assert [m.node_rank for m in h.membership.lost(timeout)] == [1]
            assert not b.head_lost(timeout)

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 >= timeout
    assert [m.node_rank for m in h.membership.lost(30.0)] == []


def test_clock_offset_and_incident_on_the_heads_clock() -> None:
    skew = 5.0  # the head's clock runs 5 s ahead of the follower's
    got: list[ReceivedIncident] = []
    h = GroupHead(SECRET, nnodes=2, wall=lambda: time.time() + skew, on_incident=got.append)
    url = f"http://127.0.0.1:{h.start('127.0.0.1', 0)}"
    try:
        async def go() -> GroupFollower:
            f = GroupFollower(url, SECRET, node_rank=1)
            await f.register(pid=3)
            await f.heartbeat("ready", 1)
            died = time.time() - 0.25
            await f.incident(rank=1, at=died, cause="process-exception", process="VLLM::Worker_TP1",
                             message="Worker proc VllmWorker-1 died unexpectedly")
            await f.aclose()
            return f

        f = asyncio.run(go())
    finally:
        h.stop()
    assert f.clock_offset_s is not None and f.rtt_s is not None
    assert abs(f.clock_offset_s - skew) < 0.05 + f.rtt_s
    [m] = h.membership.members()
    assert m.clock_offset_s is not None and abs(m.clock_offset_s - skew) < 0.1
    [rec] = got
    assert rec.incident.rank == 1 and rec.incident.cause == "process-exception"
    assert rec.head_time is not None and abs(rec.head_time - (rec.incident.time + skew)) < 0.1
    assert rec.received_at - rec.head_time == pytest.approx(0.25, abs=0.2)


def test_unsigned_answer_refused_by_the_follower() -> None:
    """A listener that is not the head (no secret) answers 200: the follower trusts nothing."""

    class Fake(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"epoch": 9, "head_time": time.time()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    async def go() -> None:
        async with GroupFollower(f"http://127.0.0.1:{srv.server_address[1]}", SECRET, node_rank=1) as f:
            with pytest.raises(ChannelError) as e:
                await f.register(pid=1)
            assert "unsigned" in str(e.value) and f.epoch is None and f.last_answer is None

    try:
        asyncio.run(go())
    finally:
        srv.shutdown()
        srv.server_close()


def test_head_unreachable_and_head_lost() -> None:
    h = GroupHead(SECRET, nnodes=2)
    url = f"http://127.0.0.1:{h.start('127.0.0.1', 0)}"

    async def go() -> None:
        async with GroupFollower(url, SECRET, node_rank=1, timeout_s=0.5) as f:
            await f.register(pid=1)
            h.stop()
            with pytest.raises(ChannelError) as e:
                await f.heartbeat("ready", 1)
            assert e.value.status is None and "head unreachable" in str(e.value)
            assert not f.head_lost(10.0)
            await asyncio.sleep(0.4)
            assert f.head_lost(0.3)

    asyncio.run(go())


def test_admit_refuses_before_handling_and_info_is_in_every_answer() -> None:
    launched = {"epoch": 0}
    h = GroupHead(SECRET, nnodes=2, admit=lambda kind: None if kind != "register" or launched["epoch"] == 1
                  else "the head has not launched epoch 1 yet", info=lambda: {"state": "starting"})
    url = f"http://127.0.0.1:{h.start('127.0.0.1', 0)}"

    async def go() -> tuple[ChannelError, dict[str, Any]]:
        async with GroupFollower(url, SECRET, node_rank=1) as f:
            with pytest.raises(ChannelError) as e:
                await f.register(pid=os.getpid())
            launched["epoch"] = 1
            return e.value, await f.register(pid=os.getpid())

    try:
        err, answer = asyncio.run(go())
    finally:
        h.stop()
    assert err.status == 409 and "has not launched epoch 1 yet" in str(err) and err.epoch == 1
    assert answer["state"] == "starting" and answer["epoch"] == 1
    assert [m.node_rank for m in h.membership.members()] == [1]


def test_late_incident_of_the_ended_epoch_is_recorded_a_heartbeat_refused(head: tuple[GroupHead, str]) -> None:
    h, url = head
    got: list[ReceivedIncident] = []
    h.on_incident = got.append

    async def go() -> ChannelError:
        async with GroupFollower(url, SECRET, node_rank=1) as f:
            await f.register(pid=os.getpid())
            await f.heartbeat("ready", 1)
            assert h.new_epoch() == 2
            await f.incident(1, time.time(), "process-exit", "Worker_TP1", "killed", pid=4242, signal="SIGKILL")
            with pytest.raises(ChannelError) as e:
                await f.heartbeat("ready", 1)
            return e.value

    err = asyncio.run(go())
    assert err.status == 409 and err.epoch == 2
    [rec] = got
    assert (rec.incident.epoch, rec.incident.pid, rec.incident.signal) == (1, 4242, "SIGKILL")
    assert rec.head_time is not None  # the ended epoch's clock offset applied
    assert h.membership.members() == []


def _raw(port: int, data: bytes, wait_s: float) -> bytes:
    """Send `data` on a fresh TCP connection; everything the head answers until it closes."""
    import socket

    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait_s)
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_hostile_connections_cost_a_refusal_or_a_drop_never_a_traceback(
    head: tuple[GroupHead, str], capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signature header with non-ASCII bytes made the handler raise TypeError (hmac's
    compare_digest), printed as a traceback with no answer; a peer that sends part of a request
    and waits held a listener thread forever; one that hung up mid-body printed a BrokenPipe
    traceback. Now: 401, a drop after the read timeout, a silent drop; the head still answers."""
    from xpu_serve.group import channel

    monkeypatch.setattr(channel._Handler, "timeout", 0.5)
    h, url = head
    port = int(url.rsplit(":", 1)[1])
    sig = _raw(port, b"POST /group/v1/register HTTP/1.0\r\nContent-Length: 2\r\nX-Group-Time: 1\r\n"
                     b"X-Group-Nonce: n\r\nX-Group-Signature: \xe9\xe9\r\n\r\n{}", 10)
    assert sig.startswith(b"HTTP/1.0 401 "), sig[:200]
    assert json.loads(sig.split(b"\r\n\r\n", 1)[1])["error"] == "bad signature: not signed with the group's secret"
    t0 = time.monotonic()
    stalled = _raw(port, b"POST /group/v1/register HTTP/1.0\r\nContent-Length: 100\r\n\r\n{", 20)
    assert stalled == b"" and time.monotonic() - t0 < 15  # dropped by the head, not by our wait
    import socket

    with socket.create_connection(("127.0.0.1", port)) as s:  # hangs up mid-body
        s.sendall(b"POST /group/v1/register HTTP/1.0\r\nContent-Length: 100\r\n\r\n{")
    time.sleep(0.3)

    async def go() -> None:
        async with GroupFollower(url, SECRET, node_rank=1) as f:
            assert (await f.register(pid=os.getpid()))["epoch"] == 1

    asyncio.run(go())
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
